"""sparda-jax: SparDA (Sparse Decoupled Attention) for long-context inference in JAX.

The math lives here as pure functions over explicit pytrees; kernels, training and inference
are the subpackages `sparda_jax.kernels`, `sparda_jax.train`, `sparda_jax.infer`.
"""

from .api import Pretrained, init_model, load_pretrained
from .attention import dense_attention
from .config import ConfigError, ForecastConfig, LongRoPEConfig, ModelConfig, SparseConfig, get_preset, preset_names
from .model import KVCache, forward, forward_cached, param_count

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ForecastConfig",
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
    "load_pretrained",
    "param_count",
    "preset_names",
]
