"""One decoder layer, any mode, any source of keys and values.

`layer_step` is the single per-layer pipeline, project -> append -> select -> attend -> finish,
that prefill (`modes.forward`), the cached decode (`modes.decode_step`) and the offload engine
(`infer.engine`) run. What differs between them is the KV source they hand it:

  PromptKV     the layer's own keys and values: prefill over whole sequences
  DecodeState  one layer's decode state on the device (slot = absolute position)
  OffloadKV    (infer.engine) the layer's paged host pool behind a device block cache

A source is a pytree with `append` (write the new tokens' payloads, return what selection reads
as a `KeySide`) and `attend` (attention over the selected blocks). The engine's prefetch is one
more argument: the next layer's source, whose copy the step starts before its own attention.
`run_layers` is the one loop over layers: a `lax.scan` (one layer compiled) or, where buffers
must be updated in place or copies are in flight across layers, a Python loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from .attention import dense_attention, sparse_attention
from .compress import CompressedKeys, compress_keys
from .config import Implementations, ModelConfig
from .forecast import forecast_from_hidden
from .model import DecoderLayer, KVCache
from .select import (compress_cis, nosa_refine, select_blocks_forecast, select_blocks_infinigen,
                     select_blocks_infllmv2)

__all__ = ["MODES", "Plan", "Ctx", "LayerIn", "Projected", "KeySide", "PromptKV", "DecodeState", "layer_step",
           "select_blocks", "run_layers"]

MODES: tuple[str, ...] = ("dense", "sparse", "sparda", "infinigen")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static choices of one compiled call (hashable: part of the jit cache key).

    dense: full attention in every layer (mode "dense", or fewer keys than `sparse.dense_len`);
    collect: also return each layer's selection and the InfLLM-V2 oracle's (prefill only).
    """

    config: ModelConfig
    mode: str
    dense: bool
    dtype: Any
    implementations: Implementations = Implementations()
    collect: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")

    @property
    def stage1(self):
        """The query-aware stage's budget (NOSA's cis stage refines it to `topk`)."""
        sp = self.config.sparse
        return dataclasses.replace(sp, topk=sp.nosa_qk_topk) if self.config.has_cis else sp


class Ctx(NamedTuple):
    """What every layer of one call shares: the layer module, RoPE tables for the query
    positions [B, T], and the number of key blocks."""

    layer: DecoderLayer
    cos: jax.Array
    sin: jax.Array
    positions: jax.Array
    n_blocks: int


class LayerIn(NamedTuple):
    """One layer's inputs: its params, the selector kernel that picks its blocks (sparda:
    F0_cur at layer 0, else F_{l-1}), InfiniGen's projection, first (layer 0; a bool or a
    traced one), and dense (one of `sparse.dense_layers`: a bool, a traced one, or None when
    the model has none)."""

    params: Any
    sel: jax.Array | None = None
    ig: jax.Array | None = None
    first: Any = False
    dense: Any = None


class Projected(NamedTuple):
    """The layer's normed input h [B, T, D], post-RoPE q [B, T, H, Dh] and k, v [B, T, K, Dh],
    and NOSA's cis [B, T, K] (None elsewhere)."""

    h: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    cis: jax.Array | None


class KeySide(struct.PyTreeNode):
    """What selection and attention read of one layer's past: keys and values at positions
    0..S-1, compressed keys, NOSA's per-token and compressed cis, InfiniGen's partial keys.
    A field a source does not hold is None (the offload source holds no contiguous K/V)."""

    k: jax.Array | None = None
    v: jax.Array | None = None
    kc: jax.Array | None = None
    cis: jax.Array | None = None
    cis_c: jax.Array | None = None
    pk: jax.Array | None = None


def project(plan: Plan, ctx: Ctx, lin: LayerIn, x) -> Projected:
    v = {"params": lin.params}
    h, q, k, vv = ctx.layer.apply(v, x, ctx.cos, ctx.sin, method="project")
    cis = ctx.layer.apply(v, vv, method="cis") if plan.config.has_cis else None
    return Projected(h, q, k, vv, cis)


def partial_keys(k, ig):
    """InfiniGen's partial keys: k [B, T, K, Dh] through the layer's skew [K, Dh, r]."""
    return jnp.einsum("BTKD,KDR->BTKR", k.astype(jnp.float32), ig)


def selector_input(plan: Plan, ctx: Ctx, lin: LayerIn, h, h_prev):
    """sparda: the Forecast that selects this layer (F0_cur on h at layer 0, else F_{l-1} on
    h_prev, the previous layer's state its `forecast.source` names; "own_input": on h in every
    layer); infinigen: the partial queries of layer l's W_q on layer l-1's input; else None."""
    c = plan.config
    if plan.mode == "sparda":
        first = True if c.forecast.source == "own_input" else lin.first
        src = h if first is True else h_prev if first is False else jnp.where(first, h, h_prev)
        return forecast_from_hidden(src, lin.sel, ctx.cos, ctx.sin, plan.dtype)
    if plan.mode == "infinigen" and lin.first is not True:  # layer 0 selects from its own queries
        q_spec = ctx.layer.apply({"params": lin.params}, h_prev, ctx.cos, ctx.sin, method="query")
        qg = q_spec.reshape(*q_spec.shape[:2], c.num_kv_heads, c.group_size, c.head_dim)
        return jnp.einsum("BTKGD,KDR->BTKGR", qg.astype(jnp.float32), lin.ig).reshape(*q_spec.shape[:2],
                                                                                        c.num_heads, -1)
    return None


def select_blocks(plan: Plan, ctx: Ctx, lin: LayerIn, q, h, h_prev, keys: KeySide):
    """The block ids [B, K, T, topk] that the plan's mode selects for one layer, NOSA's cis
    stage included. InfiniGen's layer 0 selects from its own queries (`lin.first`)."""
    c, stage1 = plan.config, plan.stage1
    impl = plan.implementations.select
    own = lambda: select_blocks_infllmv2(q, keys.kc, ctx.positions, stage1, n_blocks=ctx.n_blocks,
                                         implementation=impl)
    sel_in = selector_input(plan, ctx, lin, h, h_prev)
    if plan.mode == "sparse":
        ids = own()
    elif plan.mode == "sparda":
        ids = select_blocks_forecast(sel_in, keys.kc, ctx.positions, stage1, n_blocks=ctx.n_blocks,
                                     implementation=impl)
    else:
        # a Mosaic selector scores in the model's 16-bit dtype; XLA's in f32
        later = lambda: select_blocks_infinigen(sel_in, keys.pk, ctx.positions, stage1, head_dim=c.head_dim,
                                                n_blocks=ctx.n_blocks, implementation=impl, kernel_dtype=plan.dtype)
        ids = own() if lin.first is True else later() if lin.first is False else jax.lax.cond(lin.first, own, later)
    if c.has_cis:
        ids = nosa_refine(ids, keys.cis_c, ctx.positions, c.sparse, n_blocks=ctx.n_blocks)
    return ids


def oracle_blocks(plan: Plan, ctx: Ctx, q, keys: KeySide):
    """The InfLLM-V2 selection from the layer's true queries (what recall is measured against)."""
    c = plan.config
    ids = select_blocks_infllmv2(q, keys.kc, ctx.positions, plan.stage1, n_blocks=ctx.n_blocks)
    return nosa_refine(ids, keys.cis_c, ctx.positions, c.sparse, n_blocks=ctx.n_blocks) if c.has_cis else ids


def attend_device(plan: Plan, ctx: Ctx, q, ids, keys: KeySide, dense=None):
    """Attention over keys held contiguously on the device: dense (ids None, or a dense layer),
    or over the blocks `ids`. dense: the layer's `LayerIn.dense`; a traced one (a scanned
    stack with dense layers) picks between the two in the program."""

    def full():
        qpos = ctx.positions if q.shape[1] != keys.k.shape[1] else None
        return dense_attention(q, keys.k, keys.v, qpos, bias=keys.cis,
                               implementation=plan.implementations.dense_attention)

    def blocks():
        return sparse_attention(q, keys.k, keys.v, ids, ctx.positions, block_size=plan.config.sparse.block_size,
                                bias=keys.cis, implementation=plan.implementations.sparse_attention)

    if ids is None or dense is True:
        return full()
    if dense is None or dense is False:
        return blocks()
    return jax.lax.cond(dense, full, blocks)


class PromptKV(struct.PyTreeNode):
    """Prefill's source: the layer's keys and values are its own projections of the whole
    sequence (positions 0..T-1); nothing is stored."""

    def append(self, plan: Plan, ctx: Ctx, lin: LayerIn, p: Projected, read=None):
        sparse = not plan.dense
        c = plan.config
        keys = KeySide(p.k, p.v,
                       compress_keys(p.k, c.sparse.kernel_size, c.sparse.kernel_stride) if sparse else None,
                       p.cis, compress_cis(p.cis, c.sparse) if (sparse and c.has_cis) else None,
                       partial_keys(p.k, lin.ig) if lin.ig is not None else None)
        return self, keys, read

    def attend(self, plan: Plan, ctx: Ctx, q, ids, keys: KeySide, p: Projected, pending=None, after=None,
               dense=None):
        return attend_device(plan, ctx, q, ids, keys, dense), self, {}


class DecodeState(struct.PyTreeNode):
    """Everything decode reads of the past, on the device. Stacked over layers (a leading L
    axis on every leaf) or, as a source of `layer_step`, one layer's (no L axis):

    kv      KVCache k, v [(L,) B, S, K, Dh] (slot = absolute position)
    ckeys   CompressedKeys, kc [(L,) B, N_max, K, Dh] and the newest keys' group sums (sparse modes)
    cis     [(L,) B, S, K] NOSA per-token cis; ccis compressed cis as CompressedKeys, Dh = 1
    pk      [(L,) B, S, K, r] InfiniGen partial keys
    """

    kv: KVCache
    ckeys: CompressedKeys | None = None
    cis: jax.Array | None = None
    ccis: CompressedKeys | None = None
    pk: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.kv.k.shape[-3]

    def append(self, plan: Plan, ctx: Ctx, lin: LayerIn, p: Projected, read=None):
        """Write one token per sequence (T = 1) at ctx.positions [B, 1]: one write per row,
        so the scatters are declared unique and sorted."""
        rows = jnp.arange(p.k.shape[0])[:, None]
        pos, pos0 = ctx.positions, ctx.positions[:, 0]
        put = lambda buf, val: buf.at[rows, pos].set(val.astype(buf.dtype), unique_indices=True,
                                                     indices_are_sorted=True)
        new = self.replace(kv=KVCache(put(self.kv.k, p.k), put(self.kv.v, p.v)))
        kc = cis_c = pk = None
        if p.cis is not None:
            new = new.replace(cis=put(self.cis, p.cis))
        if self.ckeys is not None:
            new = new.replace(ckeys=self.ckeys.append(p.k[:, 0], pos0))
            kc = new.ckeys.kc
            if p.cis is not None:
                new = new.replace(ccis=self.ccis.append(p.cis[:, 0, :, None].astype(jnp.float32), pos0))
                cis_c = new.ccis.kc[..., 0]
        if self.pk is not None:
            new = new.replace(pk=put(self.pk, partial_keys(p.k, lin.ig)))
            pk = new.pk
        dt = p.q.dtype
        keys = KeySide(new.kv.k.astype(dt), new.kv.v.astype(dt), kc, new.cis, cis_c, pk)
        return new, keys, read

    def attend(self, plan: Plan, ctx: Ctx, q, ids, keys: KeySide, p: Projected, pending=None, after=None,
               dense=None):
        return attend_device(plan, ctx, q, ids, keys, dense), self, {}


class StepOut(NamedTuple):
    """What `layer_step` returns besides the layer's output: its projections, its selection
    (None when dense), the oracle's (with plan.collect), the prefetch started for the next
    layer (engine), the source's counters, and the normed state after attention (the MLP's
    input; what a "prev_mid" Forecast of the next layer reads)."""

    p: Projected
    ids: jax.Array | None
    oracle: jax.Array | None
    started: Any
    info: dict
    mid: jax.Array


def layer_step(plan: Plan, ctx: Ctx, lin: LayerIn, x, h_prev, src, *, pending=None, prefetch=None):
    """One decoder layer: x [B, T, D] -> (x, src, StepOut).

    h_prev: the previous layer's state the selector reads (its normed input; for a sparda plan
    whose `forecast.source` is "prev_mid", its `StepOut.mid`); zeros at layer 0.
    src: the layer's KV source (`PromptKV`, `DecodeState`, the engine's `OffloadKV`).
    pending: this layer's selection and copy, started by the previous layer (the engine's
    prefetch); the layer then selects nothing itself. prefetch: (next layer's source, its
    LayerIn): select the next layer's blocks from this layer's h and start their copy before
    this layer attends (the source's `prefetch`).
    """
    p = project(plan, ctx, lin, x)
    src, keys, read = src.append(plan, ctx, lin, p, read=None if pending is None else pending.ids)
    ids = oracle = None
    if pending is not None:
        ids = read  # the prefetched ids, ordered before this layer's append by the source
    elif not plan.dense and lin.dense is not True:
        # a traced `lin.dense` selects in every layer of the stack; a dense one attends to all keys
        ids = select_blocks(plan, ctx, lin, p.q, p.h, h_prev, keys)
        if plan.collect:
            oracle = ids if plan.mode == "sparse" else oracle_blocks(plan, ctx, p.q, keys)
    q, started = p.q, None
    if prefetch is not None:
        nxt, nxt_lin = prefetch
        started, q = nxt.prefetch(plan, ctx, nxt_lin, p.h, q)
    attn, src, info = src.attend(plan, ctx, q, ids, keys, p, pending=pending, after=started, dense=lin.dense)
    x, mid = ctx.layer.apply({"params": lin.params}, x, attn, method="finish_mid")
    return x, src, StepOut(p, ids, oracle, started, info, mid)


def run_layers(body: Callable, carry, xs, *, unroll: bool):
    """The loop over layers: body(carry, xs_l) -> (carry, ys_l).

    unroll False: `lax.scan` over xs stacked on a leading layer axis (one layer compiled).
    unroll True: a Python loop over xs given as a tuple of per-layer trees; each layer's
    buffers are then updated in place (a scan slices and restacks them, a copy per step) and
    nothing in flight crosses a loop carry. ys come back stacked (scan) or as a tuple.
    """
    if not unroll:
        return jax.lax.scan(body, carry, xs)
    ys = []
    for xs_l in xs:
        carry, y = body(carry, xs_l)
        ys.append(y)
    return carry, tuple(ys)
