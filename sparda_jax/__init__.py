"""sparda-jax: SparDA (Sparse Decoupled Attention) for long-context inference in JAX.

The math lives here as pure functions over explicit pytrees (one per-layer pipeline,
`sparda_jax.pipeline`, for every mode); each op with its backends is `sparda_jax.ops`, the Flax
modules `sparda_jax.nn`; the copy engine, training and inference are `sparda_jax.kernels`,
`sparda_jax.train`, `sparda_jax.infer`.
"""

from .api import Pretrained, init_model, load_pretrained
from .attention import dense_attention
from .config import (ConfigError, ForecastConfig, Implementations, LongRoPEConfig, ModelConfig, SparseConfig,
                     get_preset, preset_names)
from .compress import CompressedKeys, compress_keys
from .forecast import forecast_param_count, init_forecast
from .model import KVCache, layered_params, param_count
from .modes import MODES, DecodeState, decode_step, forward, forward_cached, prefill
from .nn import BlockSelector, Forecast, SparseAttention
from .select import select_blocks_forecast, select_blocks_infllmv2, select_blocks_nosa
from .attention import sparse_attention

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "BlockSelector",
    "Forecast",
    "SparseAttention",
    "CompressedKeys",
    "DecodeState",
    "compress_keys",
    "decode_step",
    "forecast_param_count",
    "init_forecast",
    "prefill",
    "select_blocks_forecast",
    "select_blocks_infllmv2",
    "select_blocks_nosa",
    "sparse_attention",
    "ConfigError",
    "ForecastConfig",
    "Implementations",
    "KVCache",
    "LongRoPEConfig",
    "ModelConfig",
    "Pretrained",
    "SparseConfig",
    "dense_attention",
    "forward",
    "forward_cached",
    "get_preset",
    "init_model",
    "layered_params",
    "load_pretrained",
    "param_count",
    "preset_names",
]
