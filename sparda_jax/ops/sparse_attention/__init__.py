"""Block-sparse attention (`api.sparse_attention`, `api.paged_sparse_attention`), its jnp
reference and its backward, the custom VJP (`vjp.py`) and the Mosaic GPU kernels
(`prefill.py`, `decode.py`)."""

from .api import paged_sparse_attention, sparse_attention
from .reference import (paged_sparse_attention_reference, sparse_attention_backward_reference,
                        sparse_attention_reference, sparse_attention_reference_with_lse)

__all__ = ["sparse_attention", "paged_sparse_attention", "sparse_attention_reference",
           "paged_sparse_attention_reference", "sparse_attention_reference_with_lse",
           "sparse_attention_backward_reference"]
