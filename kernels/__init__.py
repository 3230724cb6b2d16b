"""The KV copy op (`kv_copy`): the CUDA UVA gather the offload engine uses, its CPU twin and its
jnp reference. The attention and selection kernels live with their ops, in `sparda_jax.ops`."""

from . import kv_copy

__all__ = ["kv_copy"]
