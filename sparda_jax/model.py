"""The backbone: Llama layout with MiniCPM's muP scales and LongRoPE.

Flax linen modules define the parameters and the per-layer math; the model is run by pure
functions over explicit pytrees (`sparda_jax.modes`), with the layers stacked on a leading
axis and scanned. A layer is split in two stages so that selection can sit between
them: `DecoderLayer.project` (norm, Q/K/V, RoPE) and `DecoderLayer.finish` (output projection,
residual, MLP). Parameter tree:

    embed/embedding [V, D]            layers/q_proj/kernel [L, D, H, Dh]
    final_norm/scale [D]              layers/k_proj/kernel, v_proj/kernel [L, D, K, Dh]
    lm_head/kernel [D, V] (untied)    layers/o_proj/kernel [L, H, Dh, D]
                                      layers/{attn_norm,mlp_norm}/scale [L, D]
                                      layers/mlp/{gate_proj,up_proj}/kernel [L, D, F]
                                      layers/mlp/down_proj/kernel [L, F, D]
    NOSA only:                        layers/cis_delta/kernel [L, K*Dh, K]
                                      layers/cis_A [L, K]
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .attention import dense_attention
from .config import ModelConfig
from .programs import stored_jit

__all__ = [
    "RMSNorm",
    "MLP",
    "DecoderLayer",
    "KVCache",
    "rope_tables",
    "apply_rope",
    "init_params",
    "embed",
    "unembed",
    "param_count",
    "layered_params",
    "layer_params",
    "per_layer",
    "stacked",
    "check_tokens",
    "check_token_ids",
]

Dtype = Any
_DENSE_INIT = nn.initializers.normal(0.02)


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.reshape((1,) * (x.ndim - 1) + (-1,))).astype(x.dtype)


class _Kernel(nn.Module):
    """One projection's weight, named like nn.Dense's ("<name>/kernel"), so the loaders and
    checkpoints see the same tree."""

    shape: tuple[int, int]

    @nn.compact
    def __call__(self):
        return self.param("kernel", _DENSE_INIT, self.shape, jnp.float32)


# Tokens per FFN chunk. The FFN's [tokens, intermediate] activations dominate a long prefill's
# memory (MiniCPM4.1-8B, batch 4 x 128K: 16 GiB each for gate, up and their product, one layer);
# mapping over chunks keeps them at chunk x intermediate, and 16K rows still fill the GEMMs.
MLP_CHUNK_TOKENS = 16384


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), over chunks of MLP_CHUNK_TOKENS tokens."""

    intermediate_size: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d, f = x.shape[-1], self.intermediate_size
        wg, wu, wd = (_Kernel(s, name=n)().astype(self.dtype)
                      for n, s in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))))

        def ffn(h):  # what nn.Dense(dtype=self.dtype) computes, with the weights in hand
            h = h.astype(self.dtype)
            return (jax.nn.silu(h @ wg) * (h @ wu)) @ wd

        lead, n = x.shape[:-1], math.prod(x.shape[:-1])
        if n <= MLP_CHUNK_TOKENS:
            return ffn(x)
        c = MLP_CHUNK_TOKENS
        flat = jnp.pad(x.reshape(n, d), ((0, -n % c), (0, 0)))
        y = jax.lax.map(ffn, flat.reshape(-1, c, d)).reshape(-1, d)[:n]
        return y.reshape(*lead, d)


# ---------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(config: ModelConfig) -> tuple[jax.Array, float]:
    """Per-pair inverse frequencies [Dh/2] and the cos/sin magnitude factor.

    LongRoPE (MiniCPM): the frequencies are divided by per-pair factors, long ones when the
    model's context exceeds the original one, and cos/sin are multiplied by
    sqrt(1 + ln(scale) / ln(original_max)), scale = max_position_embeddings / original_max.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    lr = config.longrope
    if lr is None:
        return inv, 1.0
    orig = lr.original_max_position_embeddings
    use_long = config.max_position_embeddings > orig
    factors = jnp.asarray(lr.long_factor if use_long else lr.short_factor, jnp.float32)
    scale = config.max_position_embeddings / orig
    mag = math.sqrt(1.0 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    return inv / factors, mag


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, Dh/2] (float32) for int positions [B, T]."""
    inv, mag = rope_inv_freq(config)
    ang = positions.astype(jnp.float32)[..., None] * inv.reshape((1,) * positions.ndim + (-1,))
    return jnp.cos(ang) * mag, jnp.sin(ang) * mag


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF Llama layout) on x [B, T, N, Dh]; computed in float32."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ------------------------------------------------------------------------------------- layers

class DecoderLayer(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32

    def setup(self):
        c = self.config
        proj = lambda heads: nn.DenseGeneral((heads, c.head_dim), use_bias=False, dtype=self.dtype,
                                             kernel_init=_DENSE_INIT)
        self.attn_norm = RMSNorm(c.rms_eps)
        self.q_proj = proj(c.num_heads)
        self.k_proj = proj(c.num_kv_heads)
        self.v_proj = proj(c.num_kv_heads)
        self.o_proj = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                                      kernel_init=_DENSE_INIT)
        self.mlp_norm = RMSNorm(c.rms_eps)
        self.mlp = MLP(c.intermediate_size, dtype=self.dtype)
        if c.has_cis:
            # NOSA's query-agnostic importance: cis = A * softplus(W_delta . v), A zero-initialized
            # so a fresh model starts as its backbone.
            self.cis_delta = nn.Dense(c.num_kv_heads, use_bias=False, dtype=jnp.float32,
                                      kernel_init=_DENSE_INIT)
            self.cis_A = self.param("cis_A", nn.initializers.zeros, (c.num_kv_heads,), jnp.float32)

    def project(self, x, cos, sin):
        """x [B, T, D] -> (h, q [B,T,H,Dh], k [B,T,K,Dh], v): h is the normed input (the
        Forecast reads it too); q and k carry RoPE."""
        h = self.attn_norm(x)
        q = apply_rope(self.q_proj(h), cos, sin)
        k = apply_rope(self.k_proj(h), cos, sin)
        return h, q, k, self.v_proj(h)

    def query(self, h, cos, sin):
        """Queries from an already normed input h (InfiniGen feeds the previous layer's)."""
        return apply_rope(self.q_proj(h), cos, sin)

    def cis(self, v):
        """NOSA: v [B, T, K, Dh] -> cis [B, T, K] float32 (an additive attention-logit bias per key)."""
        flat = v.reshape(*v.shape[:2], -1).astype(jnp.float32)
        return self.cis_A[None, None, :] * jax.nn.softplus(self.cis_delta(flat))

    def finish(self, x, attn):
        """attn [B, T, H, Dh] -> the layer's output [B, T, D]."""
        return self.finish_mid(x, attn)[0]

    def finish_mid(self, x, attn):
        """-> (the layer's output, its normed state after attention, the MLP's input) [B, T, D]."""
        r = self.config.residual_scale
        x = x + r * self.o_proj(attn).astype(x.dtype)
        mid = self.mlp_norm(x)
        return x + r * self.mlp(mid).astype(x.dtype), mid

    def __call__(self, x, cos, sin):
        _, q, k, v = self.project(x, cos, sin)
        bias = self.cis(v) if self.config.has_cis else None
        return self.finish(x, dense_attention(q, k, v, bias=bias))


class _Embed(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        return nn.Embed(c.vocab_size, c.hidden_size, embedding_init=_DENSE_INIT, name="embed")(tokens)


# ------------------------------------------------------------------------------------- params

def init_params(config: ModelConfig, key: jax.Array, param_dtype: Dtype = jnp.float32) -> dict:
    """Random weights (normal, std 0.02; norms 1) for any config."""
    c = config
    k_emb, k_layers, k_head = jax.random.split(key, 3)
    x = jnp.zeros((1, 1, c.hidden_size), jnp.float32)
    pos = jnp.zeros((1, 1), jnp.int32)
    cos, sin = rope_tables(c, pos)
    layer = DecoderLayer(c)
    layers = jax.vmap(lambda k: layer.init(k, x, cos, sin)["params"])(
        jax.random.split(k_layers, c.num_layers))
    params = {
        "embed": {"embedding": _DENSE_INIT(k_emb, (c.vocab_size, c.hidden_size), jnp.float32)},
        "layers": layers,
        "final_norm": {"scale": jnp.ones((c.hidden_size,), jnp.float32)},
    }
    if not c.tie_embeddings:
        params["lm_head"] = {"kernel": _DENSE_INIT(k_head, (c.hidden_size, c.vocab_size), jnp.float32)}
    return jax.tree.map(lambda a: a.astype(param_dtype), params)


def param_count(tree) -> int:
    return sum(int(a.size) for a in jax.tree.leaves(tree))


def per_layer(tree):
    """A pytree stacked along a leading layer axis -> a tuple of per-layer pytrees. None and a
    tuple (already per layer) come back as they are. One program: eager, every slice would be a
    program of its own, traced and looked up in the compilation cache in every process."""
    if tree is None or isinstance(tree, tuple):
        return tree
    return _per_layer(tree)


@stored_jit
def _per_layer(tree):
    n = int(jax.tree.leaves(tree)[0].shape[0])
    return tuple(jax.tree.map(lambda a, i=i: a[i], tree) for i in range(n))


def stacked(layers):
    """The inverse of `per_layer`: per-layer pytrees stacked on a leading L axis. None and a
    stacked tree come back as they are."""
    if layers is None or not isinstance(layers, tuple):
        return layers
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def layered_params(params: dict) -> dict:
    """`params` with "layers" as a tuple of per-layer trees (no leading L axis), each leaf its
    own buffer. The decode paths that run the layers as a Python loop (the offload engine, a
    layered `modes.decode_step`) then give each layer's weights to its GEMMs as they are. Taken
    from the stack, a layer's weights are a slice, and XLA may copy a slice that feeds a cuBLAS
    call every step (docs/decisions.md, "Per-layer weights in the engine's loop").
    Slicing here copies once, so the weights are held twice while the caller keeps the stacked
    tree. The scans (prefill, training, a stacked decode state) stack a layered tree back inside
    their jit (`stacked`): a copy of the weights per call."""
    return {**params, "layers": per_layer(params["layers"])}


def layer_params(layers, i: int):
    """Layer i's parameters from either layout (from the stack: a slice)."""
    if isinstance(layers, tuple):
        return layers[i]
    return jax.tree.map(lambda a: a[i], layers)


def commit_to_params_device(tree, params):
    """tree with every uncommitted jax.Array placed (committed) on the device of params' first
    leaf; other leaves as they are. A decode step's state after one step is the step's own
    committed output, and a jit's compile key holds whether each argument is committed: a state
    handed over uncommitted would compile the step twice."""
    device = next(iter(jax.tree.leaves(params)[0].devices()))
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) and not x.committed else x,
                        tree)


def check_layers(params, config: ModelConfig):
    layers = params["layers"]
    n = len(layers) if isinstance(layers, tuple) else int(jax.tree.leaves(layers)[0].shape[0])
    if n != config.num_layers:
        raise ValueError(f"params hold {n} layers, the config {config.num_layers}")


# ------------------------------------------------------------------------------------ forward

def embed(params, tokens, config: ModelConfig, dtype: Dtype = jnp.float32) -> jax.Array:
    x = jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(jnp.float32)
    return (x * config.scale_emb).astype(dtype)


def unembed(params, x, config: ModelConfig) -> jax.Array:
    """Final norm, muP logit scale, LM head (tied or not) -> float32 logits."""
    h = RMSNorm(config.rms_eps).apply({"params": params["final_norm"]}, x)
    h = h.astype(jnp.float32) * config.logit_scale
    if config.tie_embeddings:
        w = params["embed"]["embedding"].astype(jnp.float32).T
    else:
        w = params["lm_head"]["kernel"].astype(jnp.float32)
    return jnp.einsum("BTD,DV->BTV", h, w, preferred_element_type=jnp.float32)


@struct.dataclass
class KVCache:
    """Device KV cache, one slot per absolute position: k, v [L, B, S, K, Dh]."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, size: int, dtype: Dtype = jnp.float32) -> "KVCache":
        shape = (config.num_layers, batch, size, config.num_kv_heads, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def size(self) -> int:
        return self.k.shape[2]


def check_tokens(tokens, positions, vocab_size: int | None = None):
    """Raise unless tokens is int [B, T] (and positions, if given, of the same shape). With
    vocab_size, concrete tokens (not traced under jit: no host round trip there) must lie in
    [0, vocab_size): ValueError naming the first id outside it, since an embedding lookup past
    the table gives NaN or clamped rows, not an error."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int [B, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer, got {tokens.dtype}")
    if positions is not None and positions.shape != tokens.shape:
        raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if (vocab_size is not None and tokens.size and not isinstance(tokens, jax.core.Tracer)
            and getattr(tokens, "is_fully_addressable", True)):
        check_token_ids(tokens, vocab_size)


def check_token_ids(ids, vocab_size: int) -> None:
    """ids: an integer array (NumPy, or JAX: reduced on its device, two scalars come back) ->
    ValueError naming an id outside [0, vocab_size) (the smallest if negative, else the largest)."""
    xp = jnp if isinstance(ids, jax.Array) else np
    ids = ids if xp is jnp else np.asarray(ids)
    if not ids.size:
        return
    with jax.ensure_compile_time_eval():  # concrete ids inside a trace (a closed-over array) reduce eagerly
        lo, hi = int(xp.min(ids)), int(xp.max(ids))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")
