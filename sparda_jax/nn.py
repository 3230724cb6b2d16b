"""Flax linen modules over the functional core: the Forecast, the block selector, sparse attention.

Each module is a thin wrapper that owns (at most) its parameters and calls the same functions
`sparda_jax.forward` runs, so a model assembled from them computes what the functional core
computes. They are linen modules because the backbone (`sparda_jax.model.DecoderLayer`) is
linen and parameters stay plain pytrees an optimizer can split.

    Forecast        h [B, T, D], positions [B, T] -> F [B, T, K, Dh]       params {"kernel": [D, K, Dh]}
    BlockSelector   queries, k [B, S, K, Dh], positions -> ids [B, K, T, topk]           no params
    SparseAttention q, k, v, ids, positions (, bias) -> out [B, T, H, Dh]                 no params

A model with L layers has L Forecasts: entry l selects layer l's blocks (F0_cur on h_0 for
l = 0, F_{l-1} on h_{l-1} otherwise). `forecast_module_params` and `forecast_params_from_modules`
convert between that list and the functional layout `{"f0_cur": {"kernel": [D, K, Dh]},
"f": {"kernel": [L-1, D, K, Dh]}}` (`sparda_jax.forecast`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import flax.linen as linen
import jax.numpy as jnp

from .attention import sparse_attention
from .compress import compress_keys
from .config import IMPLEMENTATION_NAMES, ConfigError, ModelConfig, SparseConfig
from .forecast import forecast_from_hidden
from .model import rope_tables
from .select import compress_cis, nosa_refine, select_blocks_forecast, select_blocks_infllmv2

__all__ = ["Forecast", "BlockSelector", "SparseAttention", "forecast_module_params",
           "forecast_params_from_modules"]


def _check_implementation(module: str, op: str, implementation: str | None) -> None:
    allowed = IMPLEMENTATION_NAMES[op]
    if implementation is not None and implementation not in allowed:
        raise ConfigError(f"{module}.implementation: must be None or one of {allowed}, got {implementation!r}")


class Forecast(linen.Module):
    """One Forecast projection: F = RoPE(h W), W [D, K, Dh] (no bias), RoPE at each token's position.

    __call__(h, positions): h [B, T, D] a layer's normed input (`DecoderLayer.project`'s h),
    positions int [B, T] -> F [B, T, K, Dh] in `dtype` (the product is taken in `dtype`, RoPE
    in float32, as `forecast_from_hidden`). Parameters: {"kernel": [D, K, Dh]} in
    `param_dtype`, initialized normal(config.forecast.init_std) like `init_forecast`.
    """

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @linen.compact
    def __call__(self, h, positions):
        c = self.config
        if h.ndim != 3 or h.shape[-1] != c.hidden_size:
            raise ValueError(f"h must be [B, T, {c.hidden_size}], got {h.shape}")
        if positions.shape != h.shape[:2]:
            raise ValueError(f"positions must be [B, T] = {h.shape[:2]}, got {positions.shape}")
        kernel = self.param("kernel", linen.initializers.normal(c.forecast.init_std),
                            (c.hidden_size, c.num_kv_heads, c.head_dim), self.param_dtype)
        cos, sin = rope_tables(c, positions)
        return forecast_from_hidden(h, kernel, cos, sin, self.dtype)


class BlockSelector(linen.Module):
    """The block ids each query's KV head reads: InfLLM-V2 (`source="queries"`) or SparDA
    (`source="forecast"`), optionally followed by NOSA's query-agnostic stage.

    __call__(queries, k, positions, cis=None):
      queries  [B, T, H, Dh] the layer's own post-RoPE queries (source "queries"), or
               [B, T, K, Dh] Forecast queries (source "forecast");
      k        [B, S, K, Dh] the layer's post-RoPE keys at positions 0..S-1 (compressed here
               with `compress_keys(k, sparse.kernel_size, sparse.kernel_stride)`);
      positions int [B, T] the queries' positions;
      cis      None, or NOSA's per-token cis [B, S, K]: then the first stage keeps
               `sparse.nosa_qk_topk` blocks and `nosa_refine` fills up to `sparse.topk`.
    Returns int32 [B, K, T, sparse.topk], ascending ids, -1 padded (`sparda_jax.select`), over
    ceil(S / sparse.block_size) blocks. Raises ConfigError for an unknown `implementation`
    (None or a name of IMPLEMENTATION_NAMES["select"]) and ValueError for cis without
    `sparse.nosa_qk_topk`. Selection is discrete: no gradient flows to the queries.
    """

    sparse: SparseConfig
    source: Literal["queries", "forecast"] = "queries"
    implementation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        _check_implementation("BlockSelector", "select", self.implementation)
        if self.source not in ("queries", "forecast"):
            raise ConfigError(f"BlockSelector.source: must be 'queries' or 'forecast', got {self.source!r}")

    def __call__(self, queries, k, positions, cis=None):
        sp = self.sparse
        if cis is not None and sp.nosa_qk_topk is None:
            raise ValueError("BlockSelector: cis (NOSA) needs sparse.nosa_qk_topk")
        stage1 = dataclasses.replace(sp, topk=sp.nosa_qk_topk) if cis is not None else sp
        n_blocks = -(-k.shape[1] // sp.block_size)
        kc = compress_keys(k, sp.kernel_size, sp.kernel_stride)
        select = select_blocks_infllmv2 if self.source == "queries" else select_blocks_forecast
        ids = select(queries, kc, positions, stage1, n_blocks=n_blocks, implementation=self.implementation)
        if cis is not None:
            ids = nosa_refine(ids, compress_cis(cis, sp), positions, sp, n_blocks=n_blocks)
        return ids


class SparseAttention(linen.Module):
    """Block-sparse GQA attention over selected blocks (`sparda_jax.attention.sparse_attention`).

    __call__(q, k, v, block_ids, positions, bias=None): q [B, T, H, Dh]; k, v [B, S, K, Dh]
    at positions 0..S-1; block_ids int [B, K, T, n] (-1 padding); positions int [B, T];
    bias None or NOSA's cis [B, S, K], added to each key's logit. Returns [B, T, H, Dh] in q's
    dtype. Raises ConfigError for an unknown `implementation` (None or a name of
    IMPLEMENTATION_NAMES["sparse_attention"]).
    """

    block_size: int = 64
    implementation: str | None = None

    def __post_init__(self):
        super().__post_init__()
        _check_implementation("SparseAttention", "sparse_attention", self.implementation)

    def __call__(self, q, k, v, block_ids, positions, bias=None):
        return sparse_attention(q, k, v, block_ids, positions, block_size=self.block_size, bias=bias,
                                implementation=self.implementation)


def forecast_module_params(forecast: dict) -> tuple[dict, ...]:
    """Functional Forecast params -> L `Forecast` parameter trees {"kernel": [D, K, Dh]}; entry l
    selects layer l (F0_cur, then F_0 .. F_{L-2}). Apply one as
    `Forecast(config).apply({"params": p}, h, positions)`."""
    f0 = forecast["f0_cur"]["kernel"]
    f = forecast["f"]["kernel"]
    return ({"kernel": f0},) + tuple({"kernel": f[i]} for i in range(f.shape[0]))


def forecast_params_from_modules(modules: Sequence[dict]) -> dict:
    """The inverse of `forecast_module_params`: L trees {"kernel": [D, K, Dh]} (entry l selects
    layer l) -> {"f0_cur": {"kernel": [D, K, Dh]}, "f": {"kernel": [L-1, D, K, Dh]}}. Raises
    ValueError for fewer than two entries or kernels of different shapes."""
    kernels = [m["kernel"] for m in modules]
    if len(kernels) < 2:
        raise ValueError(f"a model has at least two layers' Forecasts, got {len(kernels)}")
    if len({tuple(k.shape) for k in kernels}) != 1:
        raise ValueError(f"Forecast kernels differ in shape: {[tuple(k.shape) for k in kernels]}")
    return {"f0_cur": {"kernel": kernels[0]}, "f": {"kernel": jnp.stack(kernels[1:])}}

