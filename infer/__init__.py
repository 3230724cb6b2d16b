"""Inference: KV caches, the offload engine, modes, generation."""
