"""Checkpoint readers and writers: GGUF, HF safetensors, orbax; tokenizers and chat templates."""
