"""Speculative decoding: the draft/verify core (`core`) and the drafters plugged into it."""
