"""The library's accelerated ops, one folder each (after tokamax's `ops/`): `api.py` (the public
functions, a registry of backends and one `implementation=` argument), `reference.py` (the
jnp code every backend is tested against) and the Pallas kernels beside them (Mosaic GPU; the
copy plan's integer tiles in Triton).

- `dense_attention`: causal GQA attention ("xla", "cudnn");
- `sparse_attention`: block-sparse attention, contiguous and paged ("xla", "mosaic_gpu",
  "mosaic_gpu_interpret");
- `block_select`: InfLLM-V2 / Forecast / InfiniGen block selection and the XLA-only selectors
  ("xla", "mosaic_gpu", "mosaic_gpu_interpret", "triton", "triton_interpret");
- `copy_plan`: the decode step's slot assignment in the block cache and its copy task lists
  ("xla", "triton", "triton_interpret").
"""
