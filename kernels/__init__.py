"""Pallas (Mosaic GPU) kernels and the CUDA copy engine; each op beside its jnp reference."""
