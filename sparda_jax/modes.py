"""The backbone run in every attention mode, for prefill and for decode (device KV cache).

Modes (SPEC.md section 6; the offload variants of the engine build on these):
  dense      full causal attention
  sparse     InfLLM-V2: each layer selects its blocks from its own queries
  sparda     the Forecast: layer l's blocks come from F_{l-1} (F0_cur at layer 0)
  infinigen  training-free cross-layer speculation: layer l's blocks come from layer l-1's
             normed input times layer l's query weights, skewed and cut to a few columns
             (`sparda_jax.infinigen`), scored against partial keys; layer 0 uses InfLLM-V2
NOSA models (arch "nosa") add the query-agnostic cis stage after the mode's selector, and
cis as an attention bias. Below `sparse.dense_len` keys, attention is dense (MiniCPM4); a
batch decides by its longest sequence.

The layers are one `lax.scan` whose carry holds the previous layer's normed input; layer 0,
which selects differently in sparda and infinigen, is told apart by a traced flag.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .attention import dense_attention, sparse_attention
from .compress import CompressedKeys, compress_keys
from .config import ModelConfig
from .forecast import forecast_from_hidden, selector_kernels
from .model import (DecoderLayer, KVCache, check_layers, check_tokens, embed, layer_params, per_layer, rope_tables,
                    stacked, unembed)
from .select import (compress_cis, nosa_refine, select_blocks_forecast, select_blocks_infinigen,
                     select_blocks_infllmv2)

__all__ = ["MODES", "Mode", "LayerView", "forward", "prefill", "decode_step", "DecodeState", "layered_state",
           "stacked_state", "forward_cached"]

Mode = Literal["dense", "sparse", "sparda", "infinigen"]
MODES: tuple[str, ...] = ("dense", "sparse", "sparda", "infinigen")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static per-call choices (hashable: part of the jit cache key)."""

    config: ModelConfig
    mode: str
    dense: bool
    dtype: jnp.dtype
    dense_impl: str | None
    sparse_impl: str | None
    collect: bool  # return each layer's selection and the InfLLM-V2 oracle's
    select_impl: str | None = None  # the selectors' `implementation=` (sparda_jax.select)


def _validate(config: ModelConfig, mode: str, forecast, infinigen):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "sparda" and forecast is None:
        raise ValueError("mode 'sparda' needs forecast params (sparda_jax.forecast.init_forecast "
                         "or a trained Forecast)")
    if mode == "infinigen" and infinigen is None:
        raise ValueError("mode 'infinigen' needs its offline setup (sparda_jax.infinigen.infinigen_setup)")
    if not config.sparse.exact_lse and mode in ("sparse", "infinigen"):
        raise NotImplementedError("the coarse-LSE option is available through select_blocks_infllmv2 "
                                  "(kc_coarse); the model runs exact LSE")


class KeySide(struct.PyTreeNode):
    """What selection and attention read of one layer's past: keys/values at positions 0..S-1,
    their compressed keys, NOSA's per-token and compressed cis, InfiniGen's partial keys."""

    k: jax.Array
    v: jax.Array
    kc: jax.Array | None
    cis: jax.Array | None
    cis_c: jax.Array | None
    pk: jax.Array | None


def select_for_mode(c: ModelConfig, mode: str, q, keys: KeySide, positions, sel_in, first, n_blocks: int,
                    implementation: str | None = None, topk_implementation: str = "xla"):
    """The block ids [B, K, T, topk] that `mode` selects for one layer (NOSA's cis stage
    included). sel_in: `selector_input`'s output; first: traced bool, layer 0;
    implementation, topk_implementation: the InfLLM-V2 and Forecast selectors' (InfiniGen's is
    jnp only)."""
    sp = c.sparse
    stage1 = dataclasses.replace(sp, topk=sp.nosa_qk_topk) if c.has_cis else sp
    own = lambda: select_blocks_infllmv2(q, keys.kc, positions, stage1, n_blocks=n_blocks,
                                         implementation=implementation, topk_implementation=topk_implementation)
    if mode == "sparse":
        ids = own()
    elif mode == "sparda":
        ids = select_blocks_forecast(sel_in, keys.kc, positions, stage1, n_blocks=n_blocks,
                                     implementation=implementation, topk_implementation=topk_implementation)
    else:  # infinigen: layer 0 selects from its own queries, later layers from the partial queries
        ids = jax.lax.cond(first, own, lambda: select_blocks_infinigen(sel_in, keys.pk, positions, stage1,
                                                                       head_dim=c.head_dim, n_blocks=n_blocks))
    if c.has_cis:
        ids = nosa_refine(ids, keys.cis_c, positions, sp, n_blocks=n_blocks)
    return ids


def _attend(plan: _Plan, q, keys: KeySide, positions, sel_in, first, n_blocks: int):
    """Selection + attention for one layer. `first` is a traced bool (layer 0).
    Returns (attn [B, T, H, Dh], ids or None, oracle or None)."""
    c = plan.config
    sp = c.sparse
    if plan.dense:
        out = dense_attention(q, keys.k, keys.v, positions if q.shape[1] != keys.k.shape[1] else None,
                              bias=keys.cis, implementation=plan.dense_impl)
        return out, None, None
    ids = select_for_mode(c, plan.mode, q, keys, positions, sel_in, first, n_blocks, plan.select_impl)
    stage1 = dataclasses.replace(sp, topk=sp.nosa_qk_topk) if c.has_cis else sp
    oracle = None
    if plan.collect:
        oracle = ids if plan.mode == "sparse" else select_blocks_infllmv2(q, keys.kc, positions, stage1,
                                                                         n_blocks=n_blocks)
        if c.has_cis and plan.mode != "sparse":
            oracle = nosa_refine(oracle, keys.cis_c, positions, sp, n_blocks=n_blocks)
    out = sparse_attention(q, keys.k, keys.v, ids, positions, block_size=sp.block_size, bias=keys.cis,
                           implementation=plan.sparse_impl)
    return out, ids, oracle


def _selector_input(plan: _Plan, layer, lp, h, h_prev, sel_kernel, ig_proj, cos, sin, first):
    if plan.dense:
        return None
    return selector_input(plan.config, plan.mode, plan.dtype, layer, lp, h, h_prev, sel_kernel, ig_proj, cos, sin,
                          first)


def selector_input(c: ModelConfig, mode: str, dtype, layer, lp, h, h_prev, sel_kernel, ig_proj, cos, sin, first):
    """sparda: the Forecast that selects this layer (F0_cur on h at layer 0, else F_{l-1} on
    h_prev); infinigen: the partial queries (unused at layer 0); else None."""
    if mode == "sparda":
        return forecast_from_hidden(jnp.where(first, h, h_prev), sel_kernel, cos, sin, dtype)
    if mode == "infinigen":
        q_spec = layer.apply(lp, h_prev, cos, sin, method="query")  # layer l's W_q on layer l-1's input
        qg = q_spec.reshape(*q_spec.shape[:2], c.num_kv_heads, c.group_size, c.head_dim)
        return jnp.einsum("BTKGD,KDR->BTKGR", qg.astype(jnp.float32), ig_proj).reshape(
            *q_spec.shape[:2], c.num_heads, -1)
    return None


def _per_layer_xs(params, forecast, infinigen):
    """Per-layer inputs: backbone params (stacked or a tuple: `model.layered_params`), the selector
    kernel (sparda), the InfiniGen projection."""
    sel = selector_kernels(forecast) if forecast is not None else None
    ig = infinigen.proj if infinigen is not None else None
    return params["layers"], sel, ig


# ----------------------------------------------------------------------------------- prefill

class LayerView(NamedTuple):
    """What a `tap` sees of one layer during `forward` (all traced arrays).

    h, h_prev: this and the previous layer's normed input [B, T, D] (h_prev is 0 at layer 0);
    q [B, T, H, Dh], k, v [B, T, K, Dh]: post-RoPE queries and keys, values; positions [B, T];
    cos, sin: RoPE tables; sel: this layer's selector kernel (F0_cur or F_{l-1}) or None;
    first: a traced bool, true at layer 0.
    """

    h: jax.Array
    h_prev: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    sel: jax.Array | None
    first: jax.Array


@functools.partial(jax.jit, static_argnames=("plan", "return_kv", "return_q", "tap", "return_logits"))
def _forward(params, tokens, forecast, infinigen, *, plan: _Plan, return_kv: bool, return_q: bool, tap=None,
             return_logits: bool = True, logits_at=None):
    c = plan.config
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_tables(c, positions)
    layer = DecoderLayer(c, dtype=plan.dtype)
    lps, sels, igs = _per_layer_xs(params, forecast, infinigen)
    n_blocks = -(-t // c.sparse.block_size)

    def run(x, h_prev, lp, sel, ig, positions_, first):
        # Masks built from positions alone are the same in every layer: XLA hoists them out of
        # the layer loop and materializes them for all query chunks at once ([T, T]-sized: 64 GiB
        # at 32K in the training step). Tying positions to this layer's input keeps them inside.
        positions, x = jax.lax.optimization_barrier((positions_, x))
        v = {"params": lp}
        h, q, k, vv = layer.apply(v, x, cos, sin, method="project")
        cis = layer.apply(v, vv, method="cis") if c.has_cis else None
        keys = KeySide(k, vv, None if plan.dense else compress_keys(k, c.sparse.kernel_size, c.sparse.kernel_stride),
                        cis, compress_cis(cis, c.sparse) if (c.has_cis and not plan.dense) else None,
                        jnp.einsum("BSKD,KDR->BSKR", k.astype(jnp.float32), ig) if ig is not None else None)
        sel_in = _selector_input(plan, layer, v, h, h_prev, sel, ig, cos, sin, first)
        attn, ids, oracle = _attend(plan, q, keys, positions, sel_in, first, n_blocks)
        x = layer.apply(v, x, attn, method="finish")
        aux = {}
        if return_kv:
            aux["k"], aux["v"] = k, vv
            if cis is not None:
                aux["cis"] = cis
        if return_q:
            aux["q"] = q
        if plan.collect:
            aux["ids"], aux["oracle"] = ids, oracle
        if tap is not None:
            aux["tap"] = tap(LayerView(h, h_prev, q, k, vv, positions, cos, sin, sel, first))
        return x, h, aux

    x = embed(params, tokens, c, plan.dtype)

    def body(carry, xs):
        x, h_prev = carry
        lp, sel, ig, first = xs
        x, h, aux = run(x, h_prev, lp, sel, ig, positions, first)
        return (x, h), aux

    first = jnp.arange(c.num_layers) == 0
    (x, _), aux = jax.lax.scan(body, (x, jnp.zeros_like(x)), (stacked(lps), sels, igs, first))
    if logits_at is not None:  # only these rows reach the LM head ([B, T, vocab] is huge at long T)
        x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
    return (unembed(params, x, c) if return_logits else None), aux


def _make_plan(config, mode, t_kv, dtype, dense_impl, sparse_impl, collect, select_impl=None):
    dense = mode == "dense" or t_kv < config.sparse.dense_len
    return _Plan(config, mode, dense, jnp.dtype(dtype), dense_impl, sparse_impl, collect and not dense, select_impl)


def forward(params, tokens, config: ModelConfig, *, mode: Mode = "dense", forecast=None, infinigen=None,
            dtype=jnp.float32, dense_impl: str | None = None, sparse_impl: str | None = None,
            select_impl: str | None = None, return_kv: bool = False, return_q: bool = False,
            collect_selection: bool = False, tap=None, return_logits: bool = True, logits_at=None):
    """Prefill-style forward over whole sequences from position 0 in any mode.

    tokens int [B, T] -> float32 logits [B, T, vocab], and with return_kv / collect_selection
    a dict of per-layer arrays with a leading L axis: k, v [L, B, T, K, Dh] (and NOSA's cis
    [L, B, T, K]); q [L, B, T, H, Dh] (post-RoPE queries); ids, oracle [L, B, K, T, topk]
    (the mode's selection and the InfLLM-V2 selection from the layer's true queries).
    tap: a hashable function of a `LayerView` whose per-layer outputs come back stacked as
    aux["tap"] (the Forecast's training loss is one); return_logits=False skips the LM head;
    dense_impl, sparse_impl, select_impl: the `implementation=` of dense attention, block-sparse
    attention and the selectors (None: the platform's fastest validated path);
    logits_at int [B, n] computes logits only at those positions ([B, n, vocab]).
    """
    _validate(config, mode, forecast, infinigen)
    check_layers(params, config)
    tokens = jnp.asarray(tokens)
    check_tokens(tokens, None)
    plan = _make_plan(config, mode, tokens.shape[1], dtype, dense_impl, sparse_impl, collect_selection, select_impl)
    logits, aux = _forward(params, tokens, forecast, infinigen, plan=plan, return_kv=return_kv,
                           return_q=return_q, tap=tap, return_logits=return_logits,
                           logits_at=None if logits_at is None else jnp.asarray(logits_at, jnp.int32))
    if return_kv or return_q or collect_selection or tap is not None:
        return logits, aux
    return logits


# ------------------------------------------------------------------------------------ decode

class DecodeState(struct.PyTreeNode):
    """Everything decode reads of the past, per layer (leading L axis), on the device.

    kv      KVCache k, v [L, B, S, K, Dh] (slot = absolute position)
    ckeys   CompressedKeys, kc [L, B, N_max, K, Dh] and the ring buffer (sparse modes)
    cis     [L, B, S, K] NOSA per-token cis; ccis compressed cis as CompressedKeys with Dh = 1
    pk      [L, B, S, K, r] InfiniGen partial keys
    """

    kv: KVCache
    ckeys: CompressedKeys | None = None
    cis: jax.Array | None = None
    ccis: CompressedKeys | None = None
    pk: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.kv.size


def layered_state(state: DecodeState) -> tuple[DecodeState, ...]:
    """The state as one DecodeState per layer, each without the leading L axis: `decode_step`
    then runs its layers as a Python loop that updates each layer's buffers in place. Stacked,
    the scan over layers slices each layer's K/V out of the state and writes it back into a new
    stack, and XLA copied the whole state on top (three full copies of [L, B, S, K, Dh] a step in
    the CPU HLO; Dense+ and Sparse+ decode ran at 2.6-2.8 ms a layer on the H200 at batch 8, 128K,
    where their attention reads 0.4 ms). Slicing here copies once."""
    return per_layer(state)


def stacked_state(layers: tuple[DecodeState, ...]) -> DecodeState:
    """The inverse of `layered_state`."""
    return stacked(layers)


def _build_state(config: ModelConfig, aux, lengths, cache_size: int, infinigen, sparse_state: bool) -> DecodeState:
    sp = config.sparse
    t = aux["k"].shape[2]
    pad = ((0, 0), (0, 0), (0, cache_size - t), (0, 0), (0, 0))
    kv = KVCache(jnp.pad(aux["k"], pad), jnp.pad(aux["v"], pad))
    ckeys = ccis = cis = pk = None
    if sparse_state:
        ckeys = jax.vmap(lambda k: CompressedKeys.from_keys(k, cache_size, sp.kernel_size, sp.kernel_stride,
                                                            lengths=lengths))(aux["k"])
    if config.has_cis:
        cis = jnp.pad(aux["cis"], pad[:4])
        if sparse_state:
            ccis = jax.vmap(lambda c: CompressedKeys.from_keys(c[..., None].astype(jnp.float32), cache_size,
                                                               sp.kernel_size, sp.kernel_stride, lengths=lengths)
                            )(aux["cis"])
    if infinigen is not None:
        pk = jnp.einsum("LBSKD,LKDR->LBSKR", kv.k.astype(jnp.float32), infinigen.proj)
    return DecodeState(kv, ckeys, cis, ccis, pk)


def prefill(params, tokens, lengths, config: ModelConfig, *, cache_size: int, mode: Mode = "dense",
            forecast=None, infinigen=None, dtype=jnp.float32, dense_impl=None, sparse_impl=None, select_impl=None):
    """Run right-padded prompts tokens [B, T] (real lengths [B]) and build the decode state
    with room for `cache_size` positions. Returns (logits of each last real token [B, V], state).

    The state always carries compressed keys when the mode is sparse, even if this prefill
    itself ran dense (short prompt): decode may cross dense_len.
    """
    if cache_size < tokens.shape[1]:
        raise ValueError(f"cache_size ({cache_size}) < prompt length ({tokens.shape[1]})")
    lengths = jnp.asarray(lengths, jnp.int32)
    logits, aux = forward(params, tokens, config, mode=mode, forecast=forecast, infinigen=infinigen, dtype=dtype,
                          dense_impl=dense_impl, sparse_impl=sparse_impl, select_impl=select_impl, return_kv=True,
                          logits_at=(lengths - 1)[:, None])
    last = logits[:, 0]
    state = _build_state(config, aux, lengths, cache_size, infinigen if mode == "infinigen" else None,
                         mode != "dense")
    return last, state


def _decode_layer(plan: _Plan, layer, cos, sin, positions, n_blocks: int, x, h_prev, lp, sel, ig, st: DecodeState,
                  first):
    """One layer of a decode step on that layer's state (no L axis): (x, h, new layer state)."""
    c = plan.config
    rows = jnp.arange(x.shape[0])[:, None]
    pos0 = positions[:, 0]
    v = {"params": lp}
    h, q, k, vv = layer.apply(v, x, cos, sin, method="project")
    ck = st.kv.k.at[rows, positions].set(k.astype(st.kv.k.dtype))
    cv = st.kv.v.at[rows, positions].set(vv.astype(st.kv.v.dtype))
    new = st.replace(kv=KVCache(ck, cv))
    cis = cis_c = pk = kc = None
    if c.has_cis:
        cis = st.cis.at[rows, positions].set(layer.apply(v, vv, method="cis"))
        new = new.replace(cis=cis)
    if st.ckeys is not None:
        ckeys = st.ckeys.append(k[:, 0], pos0)
        new, kc = new.replace(ckeys=ckeys), ckeys.kc
        if c.has_cis:
            ccis = st.ccis.append(cis[rows[:, 0], pos0][..., None], pos0)
            new, cis_c = new.replace(ccis=ccis), ccis.kc[..., 0]
    if st.pk is not None:
        pk = st.pk.at[rows, positions].set(jnp.einsum("BTKD,KDR->BTKR", k.astype(jnp.float32), ig))
        new = new.replace(pk=pk)
    keys = KeySide(ck.astype(q.dtype), cv.astype(q.dtype), kc, cis, cis_c, pk)
    sel_in = _selector_input(plan, layer, v, h, h_prev, sel, ig, cos, sin, first)
    attn, _, _ = _attend(plan, q, keys, positions, sel_in, first, n_blocks)
    return layer.apply(v, x, attn, method="finish"), h, new


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def _decode(params, tokens, positions, state, forecast, infinigen, *, plan: _Plan):
    """state: a stacked DecodeState (the layers run as a scan: one layer compiled) or a tuple of
    per-layer ones (`layered_state`: a Python loop, each layer's buffers updated in place)."""
    c = plan.config
    sp = c.sparse
    cos, sin = rope_tables(c, positions)
    layer = DecoderLayer(c, dtype=plan.dtype)
    lps, sels, igs = _per_layer_xs(params, forecast, infinigen)
    x = embed(params, tokens, c, plan.dtype)
    h_prev = jnp.zeros_like(x)
    if isinstance(state, tuple):
        n_blocks = -(-state[0].kv.k.shape[1] // sp.block_size)
        at = lambda t, i: None if t is None else jax.tree.map(lambda a: a[i], t)
        new_state = []
        for i, st in enumerate(state):
            x, h_prev, st = _decode_layer(plan, layer, cos, sin, positions, n_blocks, x, h_prev, layer_params(lps, i),
                                          at(sels, i), at(igs, i), st, jnp.asarray(i == 0))
            new_state.append(st)
        return unembed(params, x, c)[:, 0], tuple(new_state)
    n_blocks = -(-state.size // sp.block_size)

    def body(carry, xs):
        x, h_prev = carry
        lp, sel, ig, st, first = xs
        x, h, st = _decode_layer(plan, layer, cos, sin, positions, n_blocks, x, h_prev, lp, sel, ig, st, first)
        return (x, h), st

    first = jnp.arange(c.num_layers) == 0
    (x, _), new_state = jax.lax.scan(body, (x, h_prev), (stacked(lps), sels, igs, state, first))
    return unembed(params, x, c)[:, 0], new_state


decode_program = _decode  # the jitted step of a `decode_step_plan`


def decode_step(params, tokens, positions, state: DecodeState, config: ModelConfig, *, mode: Mode = "dense",
                forecast=None, infinigen=None, dtype=jnp.float32, dense: bool | None = None,
                dense_impl=None, sparse_impl=None, select_impl=None):
    """One token per sequence: tokens int [B], positions int [B] (where each token goes).
    Returns (logits [B, V], new state). `dense` (static) overrides the dense_len rule, which
    is otherwise applied to the longest sequence (host-side: positions must be concrete).
    state: a DecodeState from `prefill`, or its `layered_state` (faster: no copy of the state;
    the new state comes back in the layout given)."""
    plan = decode_step_plan(params, positions, state, config, mode=mode, forecast=forecast, infinigen=infinigen,
                            dtype=dtype, dense=dense, dense_impl=dense_impl, sparse_impl=sparse_impl,
                            select_impl=select_impl)
    return decode_program(params, tokens[:, None], positions[:, None], state, forecast, infinigen, plan=plan)


def decode_step_plan(params, positions, state, config: ModelConfig, *, mode: Mode = "dense", forecast=None,
                     infinigen=None, dtype=jnp.float32, dense: bool | None = None, dense_impl=None, sparse_impl=None,
                     select_impl=None) -> _Plan:
    """`decode_step`'s checks and its static plan, for callers that trace the step themselves
    (`decode_program(params, tokens[:, None], positions[:, None], state, ..., plan=plan)`, as
    the engine's device loop does). positions: every position the plan will decode (host-side)."""
    _validate(config, mode, forecast, infinigen)
    check_layers(params, config)
    if dense is None:
        dense = mode == "dense" or int(np.max(np.asarray(positions))) + 1 < config.sparse.dense_len
    plan = _Plan(config, mode, bool(dense), jnp.dtype(dtype), dense_impl, sparse_impl, False, select_impl)
    if isinstance(state, tuple) and len(state) != config.num_layers:
        raise ValueError(f"a layered decode state needs one DecodeState per layer ({config.num_layers}), "
                         f"got {len(state)}")
    if not plan.dense and (state[0] if isinstance(state, tuple) else state).ckeys is None:
        raise ValueError("this decode state has no compressed keys: prefill it with a sparse mode")
    return plan


def forward_cached(params, tokens, positions, cache: KVCache, config: ModelConfig, *, dtype=jnp.float32,
                   attention_impl: str | None = None):
    """Dense decode against a plain KVCache (kept for callers that need no selection)."""
    logits, state = decode_step(params, tokens[:, 0], positions[:, 0], DecodeState(cache), config, dtype=dtype,
                                dense=True, dense_impl=attention_impl)
    return logits[:, None], state.kv
