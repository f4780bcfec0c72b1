"""KV-cache pytrees."""
