"""Pallas kernels, one folder per op: reference.py (pure jnp), kernel(s), api.py."""
