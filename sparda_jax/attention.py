"""Attention cores, re-exported from their op folders (`sparda_jax.ops.dense_attention`,
`sparda_jax.ops.sparse_attention`): dense causal GQA attention and block-sparse attention,
each with one `implementation=` argument, and their jnp references.

Shapes: q [B, Tq, H, D]; k, v [B, S, K, D] with keys at absolute positions 0..S-1;
q_positions int32 [B, Tq]. Query i of sequence b sees key j iff j <= q_positions[b, i].
"""

from __future__ import annotations

from .ops._dispatch import hopper_gpu
from .ops.dense_attention import NEG_INF, dense_attention, dense_attention_reference
from .ops.sparse_attention import (paged_sparse_attention, paged_sparse_attention_reference, sparse_attention,
                                   sparse_attention_reference)

__all__ = ["dense_attention", "dense_attention_reference", "sparse_attention", "sparse_attention_reference",
           "paged_sparse_attention", "paged_sparse_attention_reference", "hopper_gpu", "NEG_INF"]
