"""Block selection, re-exported from its op folder (`sparda_jax.ops.block_select`): the InfLLM-V2
and SparDA Forecast selectors (one `implementation=` argument each), NOSA's and InfiniGen's
selectors, and the jnp pieces they are built from.

Output layout (all selectors): int32 [B, K, Tq, topk], per (sequence, KV head, query) the
selected 64-token block ids in ascending order, then -1 padding.
"""

from __future__ import annotations

from .ops.block_select import (compress_cis, finalize_topk, forecast_chunk_scores, infinigen_chunk_scores,
                               infllmv2_chunk_scores, n_blocks_for, nosa_refine, pool_to_blocks,
                               select_blocks_forecast, select_blocks_forecast_reference, select_blocks_infinigen,
                               select_blocks_infinigen_reference,
                               select_blocks_infllmv2, select_blocks_infllmv2_reference, select_blocks_nosa)

__all__ = [
    "n_blocks_for",
    "pool_to_blocks",
    "finalize_topk",
    "infllmv2_chunk_scores",
    "forecast_chunk_scores",
    "select_blocks_infllmv2",
    "select_blocks_infllmv2_reference",
    "select_blocks_forecast",
    "select_blocks_forecast_reference",
    "select_blocks_nosa",
    "nosa_refine",
    "select_blocks_infinigen",
    "select_blocks_infinigen_reference",
    "infinigen_chunk_scores",
    "compress_cis",
]
