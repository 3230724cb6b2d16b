"""Pallas (Mosaic GPU) kernels and the KV copy op (`kv_copy`); each op beside its jnp reference."""

from . import kv_copy

__all__ = ["kv_copy"]
