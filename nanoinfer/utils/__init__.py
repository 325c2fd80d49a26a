"""Checkpoint loading (safetensors, GGUF), the default model fetch, and process-level helpers."""
