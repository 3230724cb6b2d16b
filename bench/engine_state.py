"""Decode states for the benchmarks, built from random K/V instead of a prefill.

A 128K prefill of an 8B model takes minutes per batch; the decode benchmarks need only a state
whose layout and contents are what `infer.engine.engine_prefill` (offload) or
`sparda_jax.modes.prefill` (resident) would leave: K/V of `context` tokens, compressed keys
computed from those keys, layer 0 on the device, layers 1..L-1 in pinned host memory, an empty
block cache. K/V are random normal bf16 (never zeros: zeros hide unwritten data and can run
faster); each (layer, row) draws from its own key, so row 0 of a batch-B state equals row 0 of a
batch-1 state, which lets one batch-1 resident reference check every batch.

Feasibility: `feasibility` applies `infer.engine.memory_report` of the FULL model (all layers)
plus its weights to this machine's host memory and the device's allocator limit, whatever the
number of layers actually built: a benchmark that times fewer layers must still say whether the
full system fits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.compress import CompressedKeys
from sparda_jax.config import ModelConfig, get_preset
from sparda_jax.forecast import init_forecast
from sparda_jax.infinigen import InfiniGenParams
from sparda_jax.infer.engine import RESIDENT_SYSTEMS, OffloadLayer, OffloadState, host_pool, selector_of
from sparda_jax.infer.memory import DEVICE_MARGIN, HOST_MARGIN, device_memory_limit, feasibility, host_memory_bytes
from sparda_jax.model import KVCache, init_params
from sparda_jax.modes import DecodeState

__all__ = ["bench_config", "make_params", "correlated_embedding", "make_extras", "row_tokens", "build_state", "feasibility",
           "weights_bytes", "host_memory_bytes", "device_memory_limit", "block_bytes", "HOST_MARGIN",
           "DEVICE_MARGIN"]

BF16 = jnp.bfloat16


def bench_config(preset: str, layers: int | None) -> tuple[ModelConfig, ModelConfig]:
    """(the timed config with `layers` layers, the full preset)."""
    full = get_preset(preset)
    if layers is None or layers >= full.num_layers:
        return full, full
    if layers < 2:
        raise ValueError("the offload engine needs >= 2 layers (layer 0 stays on the device)")
    return full.replace(num_layers=layers), full


def make_params(config: ModelConfig, seed: int = 0):
    # made on the device in bf16, without a float32 copy of the backbone
    return jax.jit(functools.partial(init_params, config, param_dtype=BF16))(jax.random.key(seed))


def correlated_embedding(config: ModelConfig, rho: float, seed: int = 0) -> jax.Array:
    """An embedding table [V, D] bf16 whose rows are AR(1) along the row index: row i = rho row(i-1)
    + sqrt(1 - rho^2) fresh normal, std 0.02 as `init_params`. Tokens that count up through the
    rows then give inputs alike between neighbouring positions, as real hidden states are, with
    the model code unchanged (random tokens give independent ones)."""
    if not 0.0 <= rho < 1.0:  # also rejects NaN
        raise ValueError(f"input correlation rho must be in [0, 1), got {rho}")
    # imported here: the attention benchmark is not needed by the other users of this module
    from sparda_jax.bench.attention import correlated_normal

    shape = (1, config.vocab_size, config.hidden_size)  # one "batch row"; the AR(1) runs over axis 1
    return jax.jit(lambda k: (correlated_normal(k, shape, rho, jnp.float32)[0] * 0.02).astype(BF16))(
        jax.random.key(seed + 13))


def make_extras(config: ModelConfig, modes, seed: int = 0) -> dict:
    """forecast / infinigen keyword arguments per mode. InfiniGen's projection is a random
    orthonormal [Dh, r] per layer and head (r = 0.2 Dh, the paper's ratio): its calibration
    changes which blocks are chosen, not the time of choosing them."""
    sels = {selector_of(m) for m in modes}
    out = {"forecast": None, "infinigen": None}
    if "sparda" in sels:
        out["forecast"] = init_forecast(config, jax.random.key(seed + 11), param_dtype=BF16)
    if "infinigen" in sels:
        r = max(1, round(0.2 * config.head_dim))
        a = jax.random.normal(jax.random.key(seed + 12), (config.num_layers, config.num_kv_heads, config.head_dim,
                                                           config.head_dim), jnp.float32)
        q, _ = jnp.linalg.qr(a)
        out["infinigen"] = InfiniGenParams(q[..., :r])
    return out


def kwargs_for(extras: dict, mode: str) -> dict:
    sel = selector_of(mode)
    return {"forecast": extras["forecast"] if sel == "sparda" else None,
            "infinigen": extras["infinigen"] if sel == "infinigen" else None}


@functools.partial(jax.jit, static_argnames=("batch", "vocab"))
def row_tokens(key, step, *, batch: int, vocab: int):
    """Token ids [B] of decode step `step`, one key per row (row r is the same in every batch)."""
    k = jax.random.fold_in(key, step)
    return jax.vmap(lambda r: jax.random.randint(jax.random.fold_in(k, r), (), 0, vocab, jnp.int32))(
        jnp.arange(batch))


@functools.partial(jax.jit, static_argnames=("batch", "shape"))
def _rows_normal(key, layer, *, batch: int, shape):
    k = jax.random.fold_in(key, layer)
    return jax.vmap(lambda r: jax.random.normal(jax.random.fold_in(k, r), shape, BF16))(jnp.arange(batch))


def _layer_kv(seed: int, layer: int, batch: int, size: int, config: ModelConfig):
    """K, V [B, S, K, Dh] bf16 of one layer, random normal, one key per (layer, row)."""
    shape = (size, config.num_kv_heads, config.head_dim)
    k = _rows_normal(jax.random.key(seed * 1000 + 1), layer, batch=batch, shape=shape)
    v = _rows_normal(jax.random.key(seed * 1000 + 2), layer, batch=batch, shape=shape)
    return k, v


@functools.partial(jax.jit, static_argnames=("context", "size", "kernel_size", "stride"))
def _ckeys(k, *, context: int, size: int, kernel_size: int, stride: int):
    return CompressedKeys.from_keys(k[:, :context], size, kernel_size, stride)


@functools.partial(jax.jit, static_argnames=("bs",))
def _blocks(x, *, bs: int):
    """[B, S, K, Dh] -> [B, K, nb, bs, Dh] (the host pool's layout, engine._to_blocks)."""
    b, s, kh, d = x.shape
    return x.reshape(b, s // bs, bs, kh, d).transpose(0, 3, 1, 2, 4)


def build_state(config: ModelConfig, *, batch: int, context: int, mode: str, extra_tokens: int = 64,
                seed: int = 0, n_slots: int | None = None, infinigen: InfiniGenParams | None = None):
    """The state `engine_decode_step(mode=...)` takes after a prompt of `context` tokens in every
    row: an `OffloadState` for the offload systems, a `modes.DecodeState` per layer for the resident
    ones (`modes.layered_state`).
    Room for `extra_tokens` more positions (rounded up to whole blocks). A config with dense
    layers (`sparse.dense_layers`) is refused: every layer past 0 is built offloaded here."""
    sp = config.sparse
    if sp.dense_layers and mode not in RESIDENT_SYSTEMS:
        raise NotImplementedError(f"build_state lays out every layer 1..L-1 offloaded; dense layers "
                                  f"{sp.dense_layers} keep theirs on the device (use engine_prefill)")
    bs = sp.block_size
    size = -(-(context + extra_tokens) // bs) * bs
    sel = selector_of(mode)
    sparse_state = sel != "dense"
    ks, vs, cks, pks = [], [], [], []
    l0 = None
    for layer in range(config.num_layers):
        k, v = _layer_kv(seed, layer, batch, size, config)
        if sparse_state:
            cks.append(_ckeys(k, context=context, size=size, kernel_size=sp.kernel_size, stride=sp.kernel_stride))
        if sel == "infinigen":
            pks.append(jnp.einsum("BSKD,KDR->BSKR", k.astype(jnp.float32), infinigen.proj[layer]))
        if mode in RESIDENT_SYSTEMS:
            ks.append(k)
            vs.append(v)
        elif layer == 0:
            l0 = DecodeState(KVCache(k, v), cks[0] if cks else None, None, None, pks[0] if pks else None)
        else:
            ks.append(_blocks(k, bs=bs))
            vs.append(_blocks(v, bs=bs))
    if mode in RESIDENT_SYSTEMS:  # per layer, as `engine_prefill` returns it (no stacked copy ever made)
        return tuple(DecodeState(KVCache(ks[i], vs[i]), cks[i] if cks else None, None, None, pks[i] if pks else None)
                     for i in range(config.num_layers))
    if config.has_cis:
        raise NotImplementedError("the benchmark states carry no NOSA cis")
    n_slots = sp.topk if n_slots is None else n_slots
    host = {}
    for name, xs in (("k", ks), ("v", vs)):
        dev = jnp.stack(xs)
        xs.clear()  # one payload's pool on the device at a time
        host[name] = host_pool(dev)  # placed as engine_prefill places its pools, and checked
        del dev
    kh, d = config.num_kv_heads, config.head_dim
    layers = tuple(OffloadLayer({n: jnp.zeros((batch, kh, n_slots, bs, d), BF16) for n in ("k", "v")},
                                jnp.full((batch, kh, n_slots), -1, jnp.int32), cks[i], None, pks[i] if pks else None)
                   for i in range(1, config.num_layers))
    return OffloadState(l0, host, layers)


def block_bytes(config: ModelConfig, dtype=BF16) -> int:
    """Bytes one copy task moves: one KV head's block of K and of V."""
    return 2 * config.sparse.block_size * config.head_dim * jnp.dtype(dtype).itemsize


def weights_bytes(config: ModelConfig, dtype=BF16) -> int:
    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0), param_dtype=dtype))
    return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(shapes)))


