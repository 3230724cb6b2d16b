"""Block selection (`api`), its jnp reference and the Mosaic GPU selectors
(`forecast_mgpu.py`, `infllmv2_mgpu.py`, `infinigen_mgpu.py`)."""

from .api import select_blocks_forecast, select_blocks_infinigen, select_blocks_infllmv2, select_blocks_nosa
from .reference import (compress_cis, finalize_topk, forecast_chunk_scores, infinigen_chunk_scores,
                        infllmv2_chunk_scores, n_blocks_for, nosa_refine, pool_to_blocks, select_blocks_forecast_reference,
                        select_blocks_infinigen_reference, select_blocks_infllmv2_reference)

__all__ = ["select_blocks_infllmv2", "select_blocks_forecast", "select_blocks_nosa", "select_blocks_infinigen",
           "nosa_refine", "compress_cis", "finalize_topk", "pool_to_blocks", "n_blocks_for",
           "infllmv2_chunk_scores", "forecast_chunk_scores", "infinigen_chunk_scores",
           "select_blocks_infllmv2_reference", "select_blocks_forecast_reference", "select_blocks_infinigen_reference"]
