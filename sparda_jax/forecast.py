"""The SparDA Forecast: one extra projection per layer, one head per GQA group.

F_l = RoPE(h_l W_l), h_l the layer's normed input (the same input as Q, K, V), selects the
blocks of layer l+1. Layer 0 has no previous layer: a separate F0_cur selects layer 0's own
blocks. The last layer's F is unused, so a model has L projections: F0_cur and F_0..F_{L-2}
(MiniCPM4.1-8B: 32 x 4096 x 256 = 33.5M parameters).

Parameters form their own tree, apart from the backbone, so that an optimizer sees only them:
    {"f0_cur": {"kernel": [D, K, Dh]}, "f": {"kernel": [L-1, D, K, Dh]}}

RoPE: the Forecast is scored against post-RoPE compressed keys exactly as the InfLLM-V2
selector scores the post-RoPE queries, so it gets RoPE at its token's position too (the paper
leaves this implicit; without it the score could not see relative position).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import apply_rope, init_params, param_count

__all__ = ["ForecastProjection", "init_forecast", "forecast_param_count", "selector_kernels",
           "forecast_from_hidden"]


class ForecastProjection(nn.Module):
    """h [B, T, D] -> F [B, T, K, Dh] (no bias)."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        c = self.config
        return nn.DenseGeneral((c.num_kv_heads, c.head_dim), use_bias=False, dtype=self.dtype,
                               kernel_init=nn.initializers.normal(c.forecast.init_std), name="proj")(h)


def init_forecast(config: ModelConfig, key: jax.Array, param_dtype=jnp.float32) -> dict:
    """Random (untrained) Forecast parameters: {"f0_cur": {"kernel": [D, K, Dh]}, "f": {"kernel": [L-1, D, K, Dh]}}."""
    mod = ForecastProjection(config)
    x = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
    k0, kf = jax.random.split(key)
    f0 = mod.init(k0, x)["params"]["proj"]
    f = jax.vmap(lambda k: mod.init(k, x)["params"]["proj"])(jax.random.split(kf, config.num_layers - 1))
    return jax.tree.map(lambda a: a.astype(param_dtype), {"f0_cur": f0, "f": f})


def forecast_param_count(config: ModelConfig, verbose: bool = False) -> int:
    """L projections of D x (K * Dh) each."""
    n = config.num_layers * config.hidden_size * config.num_kv_heads * config.head_dim
    if verbose:
        bb = param_count(jax.eval_shape(lambda: init_params(config, jax.random.key(0))))
        print(f"{config.name}: Forecast {config.num_layers} x {config.hidden_size} x "
              f"{config.num_kv_heads * config.head_dim} = {n / 1e6:.2f}M parameters "
              f"({100 * n / bb:.2f}% of the {bb / 1e9:.2f}B backbone)")
    return n


def selector_kernels(forecast_params: dict) -> jax.Array:
    """[L, D, K, Dh]: entry l is the projection whose output selects layer l's blocks
    (F0_cur for l = 0, applied to h_0; F_{l-1} for l >= 1, applied to h_{l-1})."""
    f0 = forecast_params["f0_cur"]["kernel"]
    return jnp.concatenate([f0[None], forecast_params["f"]["kernel"]], axis=0)


def forecast_from_hidden(h, kernel, cos, sin, dtype=jnp.float32):
    """h [B, T, D], kernel [D, K, Dh] -> RoPE'd Forecast [B, T, K, Dh]."""
    f = jnp.einsum("BTD,DKH->BTKH", h.astype(dtype), kernel.astype(dtype))
    return apply_rope(f, cos, sin)
