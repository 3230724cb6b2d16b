"""The offload inference engine: KV of layers 1..L-1 in host memory, a device block cache.

Where data lives (docs/algorithm.md, "The offload pipeline"):
  host    full K/V of the offloaded layers (1..L-1 but the config's `sparse.dense_layers`),
          paged in blocks: [L_off, B, K, nb, bs, Dh] (a block of one KV head is one contiguous
          run), in the `pinned_host` memory kind where the backend has it
  device  the decode state (contiguous K/V and compressed keys) of layer 0 and of the dense
          layers, and per offloaded layer its compressed keys (InfiniGen: partial keys) and block
          cache: slots [B, K, n_slots, bs, Dh] with their table [B, K, n_slots] (the block id each
          slot holds, -1 empty)

Each layer is `sparda_jax.pipeline.layer_step`; layers 1..L-1 read through `OffloadKV`: select,
keep the resident blocks, copy the missing ones from the host into free slots
(`sparda_jax.ops.copy_plan`), write the new token into its block's slot, attend through the slot
table. In `sparda` the copy for layer l+1 is started during layer l (its Forecast F_l is known
there) and waited for in layer l+1; `sparda_sync` copies at layer l. A block reaches the host when
prefill writes it or when decode completes it (`scatter_blocks`); until then it lives in its slot,
always resident because the local window forces it.

Systems (`EngineConfig.system`): dense_resident and sparse_resident run `sparda_jax.modes` with all
KV on the device; sparse, infinigen, sparda_sync and sparda offload.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparda_jax.attention import paged_sparse_attention
from sparda_jax.compress import CompressedKeys
from sparda_jax.config import COPY_STARTS, ConfigError, Implementations, ModelConfig, check_bool, check_instance, check_int
from sparda_jax.model import (DecoderLayer, check_layers, commit_to_params_device, embed, per_layer, rope_tables,
                              stacked, unembed)
from sparda_jax.modes import (check_lead_forecast, decode_program, decode_step_plan, layer_inputs, layered_state,
                              prefill)
from sparda_jax.ops.copy_plan import plan_copies
from sparda_jax.pipeline import Ctx, DecodeState, KeySide, LayerIn, Plan, layer_step, partial_keys, run_layers, \
    select_blocks
from sparda_jax.programs import stored_jit
from sparda_jax.runtime import warn_if_default_launch_queues

from sparda_jax.kernels.kv_copy import (FFI_IMPLEMENTATIONS, KVCopyConfig, after_start, autotune_num_ctas,
                                        build_in_background, gather_blocks, gather_blocks_start, gather_blocks_wait, host_pool,
                                        lane_ctas, paper_num_ctas, resolve_implementation, scatter_blocks)
from sparda_jax.kernels.kv_copy.cuda import register as register_copy_targets

from .generate import sample_next

__all__ = ["SYSTEMS", "OFFLOAD_SYSTEMS", "COPY_STARTS", "EngineConfig", "OffloadState", "OffloadLayer", "engine_prefill",
           "engine_prefill_staged", "engine_offload", "StagedOffload",
           "engine_decode_step", "engine_decode_steps", "engine_generate_steps", "selector_of", "memory_report",
           "resolve", "offloaded_layers"]

OFFLOAD_SYSTEMS = ("sparse", "infinigen", "sparda_sync", "sparda")
RESIDENT_SYSTEMS = {"dense_resident": "dense", "sparse_resident": "sparse"}
SYSTEMS = tuple(RESIDENT_SYSTEMS) + OFFLOAD_SYSTEMS


def offloaded_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers whose KV lives in host memory: 1..L-1 but the dense ones. Their order is
    the host pools' leading axis."""
    return tuple(i for i in range(1, config.num_layers) if i not in config.sparse.dense_layers)


def selector_of(system: str) -> str:
    """The forward mode (`sparda_jax.modes`) whose selection an engine system uses."""
    if system in RESIDENT_SYSTEMS:
        return RESIDENT_SYSTEMS[system]
    if system not in OFFLOAD_SYSTEMS:
        raise ValueError(f"unknown engine system {system!r}; expected one of {', '.join(SYSTEMS)}")
    return {"sparse": "sparse", "infinigen": "infinigen", "sparda_sync": "sparda", "sparda": "sparda"}[system]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs one system.

    system: one of SYSTEMS. n_slots: block-cache slots per (sequence, KV head) and offloaded
    layer (None: the budget `sparse.topk`; at least the budget). reuse: keep copied blocks
    across steps (False: the no-reuse baseline, every selected block copied every step).
    num_ctas: the copy kernel's CTA quota: None the paper's rule (16 below batch 32, else 32),
    "auto" the fastest of 8..64 timed once on this GPU, or a number. implementations: each op's
    backend (`kv_copy` None: the CUDA copy on a CUDA GPU, else the jnp reference).
    copy_start: how sparda starts a layer's asynchronous copy: "one", every payload (K, V, cis)
    in one start and one wait (fewer custom calls a layer); "lanes", one start per payload on a
    side stream each, with its share of the quota.
    """

    system: str = "sparda"
    n_slots: int | None = None
    reuse: bool = True
    num_ctas: int | str | None = None
    implementations: Implementations = Implementations()
    copy_start: str = COPY_STARTS[0]

    def __post_init__(self):
        c = "EngineConfig"
        if self.copy_start not in COPY_STARTS:
            raise ConfigError(f"EngineConfig.copy_start: must be one of {COPY_STARTS}, got {self.copy_start!r}")
        if not isinstance(self.system, str) or self.system not in SYSTEMS:
            raise ConfigError(f"EngineConfig.system: must be one of {SYSTEMS}, got {self.system!r}")
        check_int(c, "n_slots", self.n_slots, lo=1, none_ok=True)
        check_bool(c, "reuse", self.reuse)
        if isinstance(self.num_ctas, str) and self.num_ctas != "auto":
            raise ConfigError(f"EngineConfig.num_ctas: must be None, 'auto' or an int in 1..1024, got {self.num_ctas!r}")
        if self.num_ctas != "auto":
            check_int(c, "num_ctas", self.num_ctas, lo=1, hi=1024, none_ok=True)
        check_instance(c, "implementations", self.implementations, Implementations)

    @property
    def selector(self) -> str:
        return selector_of(self.system)


class OffloadLayer(struct.PyTreeNode):
    """One offloaded layer's device state: cache (payload "k", "v", NOSA's "cis" ->
    [B, K, n_slots, bs, X]), table [B, K, n_slots] (block id per slot, -1 empty), compressed
    keys, NOSA's compressed cis (Dh = 1), InfiniGen's partial keys [B, S, K, r]."""

    cache: dict
    table: jax.Array
    ckeys: CompressedKeys
    ccis: CompressedKeys | None = None
    pk: jax.Array | None = None


class OffloadState(struct.PyTreeNode):
    """l0: layer 0's `DecodeState` on the device (contiguous K/V, never offloaded);
    host: payload -> pool [L_off, B, K, nb, bs, X] in host memory (X = Dh; 1 for NOSA's cis),
    one row per `offloaded_layers` entry; layers: one per layer 1..L-1, an `OffloadLayer`, or a
    dense layer's `DecodeState` on the device. Per-layer buffers, not stacked arrays: a step
    updates each in place, where a stack would be sliced and restacked (a copy) every step."""

    l0: DecodeState
    host: dict
    layers: tuple

    @property
    def size(self) -> int:
        return self.l0.size

    @property
    def offloaded(self) -> tuple[OffloadLayer, ...]:
        """The offloaded layers' states, in the host pools' row order."""
        return tuple(ly for ly in self.layers if isinstance(ly, OffloadLayer))


def _to_blocks(x, bs: int):
    """[L, B, S, K, Dh] -> [L, B, K, nb, bs, Dh]."""
    l, b, s, k, d = x.shape
    nb = s // bs
    return x.reshape(l, b, nb, bs, k, d).transpose(0, 1, 4, 2, 3, 5)


def engine_prefill(params, tokens, lengths, config: ModelConfig, engine: EngineConfig, *, cache_size: int,
                   forecast=None, infinigen=None, dtype=jnp.float32):
    """Prefill with all KV on the device, then move the offloaded layers (`offloaded_layers`) to
    the host and set up their block caches. Returns (last logits [B, V], state): for resident systems one
    `DecodeState` per layer (`layered_state`), for offload systems an `OffloadState`.
    `cache_size` is rounded up to whole blocks. `engine_prefill_staged` + `engine_offload`, in one."""
    last, staged = engine_prefill_staged(params, tokens, lengths, config, engine, cache_size=cache_size,
                                         forecast=forecast, infinigen=infinigen, dtype=dtype)
    return last, engine_offload(staged)


@dataclasses.dataclass(frozen=True)
class StagedOffload:
    """An offload system's prefilled state before its move to the host: layer 0's state, the
    offloaded layers' payloads in blocks (still on the device) and their `OffloadLayer`s."""
    layer0: Any
    blocks: dict
    layers: tuple
    params: Any  # their device is where the state is committed


def engine_prefill_staged(params, tokens, lengths, config: ModelConfig, engine: EngineConfig, *, cache_size: int,
                          forecast=None, infinigen=None, dtype=jnp.float32):
    """`engine_prefill` up to the move to the host: (last logits, staged), staged a resident
    system's final state or a `StagedOffload` for `engine_offload`. Between the two, a caller can
    sample the first token and start its read, which then does not wait for the move."""
    check_lead_forecast(config, engine.selector, "the engine")
    bs = config.sparse.block_size
    cache_size = -(-cache_size // bs) * bs
    if engine.system not in RESIDENT_SYSTEMS:
        # the host pools' placement check (and the CUDA copy) need the copy library: its first
        # build runs beside the prefill's compile
        build_in_background(next(iter(jax.tree.leaves(params)[0].devices())))
    last, st = prefill(params, tokens, lengths, config, cache_size=cache_size, mode=engine.selector,
                       forecast=forecast, infinigen=infinigen, dtype=dtype,
                       implementations=engine.implementations)
    if engine.system in RESIDENT_SYSTEMS:
        return last, layered_state(st)
    n_slots = config.sparse.topk if engine.n_slots is None else engine.n_slots
    if n_slots < config.sparse.topk:
        raise ConfigError(f"EngineConfig.n_slots: {n_slots} is below the block budget topk ({config.sparse.topk})")
    off = offloaded_layers(config)
    if not off:
        raise ValueError(f"every layer of {config.name} is dense (sparse.dense_layers): nothing to offload; "
                         f"use a resident system")
    # the empty block caches of the offloaded layers, stacked, made outside the layout program and
    # split inside it: a program's identical outputs (zeros made inside) may share one buffer on
    # the GPU, and the CUDA copy writes each layer's cache in place; slices of an argument never do
    _, b, _, kh, _ = st.kv.k.shape
    payloads = {"k": (st.kv.k.shape[-1], st.kv.k.dtype), "v": (st.kv.v.shape[-1], st.kv.v.dtype)}
    if config.has_cis:
        payloads["cis"] = (1, st.cis.dtype)
    empty = {n: jnp.zeros((len(off), b, kh, n_slots, bs, x), dt) for n, (x, dt) in payloads.items()}
    l0, blocks, offloaded = _offload_layout(st, empty, jnp.full((len(off), b, kh, n_slots), -1, jnp.int32), bs=bs,
                                            offloaded=off)
    del empty  # its slices are the caches now
    return last, StagedOffload(l0, blocks, offloaded, params)


def engine_offload(staged):
    """The state the decode steps take: a `StagedOffload`'s blocks moved into host pools
    (`host_pool`, asynchronous: the first step waits for them); any other state as it is."""
    if not isinstance(staged, StagedOffload):
        return staged
    host = {n: host_pool(a) for n, a in staged.blocks.items()}
    return commit_to_params_device(OffloadState(staged.layer0, host, staged.layers), staged.params)


@stored_jit(static_argnames=("bs", "offloaded"))
def _offload_layout(st, empty: dict, tables, *, bs: int, offloaded: tuple[int, ...]):
    """The prefill's stacked state laid out for the engine, as one program: layer 0's state, the
    offloaded layers' payloads in blocks (for the host pools), and per layer 1..L-1 an
    `OffloadLayer` of its slice of `empty` / `tables` and its compressed keys, or a dense layer's
    `DecodeState`. One program, not an op at a time: each eager slice would be a program of its
    own, traced and looked up in the compilation cache in every process."""
    full = {"k": st.kv.k, "v": st.kv.v}
    if "cis" in empty:
        full["cis"] = st.cis[..., None]  # a trailing unit axis: every payload is [..., tokens, K, X]
    layers = per_layer(st)
    rows = {layer: j for j, layer in enumerate(offloaded)}
    # slices (a gather's constant indices would be a value made inside the program)
    take = (lambda a: a[1:]) if offloaded == tuple(range(1, len(layers))) else (
        lambda a: jnp.concatenate([a[i:i + 1] for i in offloaded]))
    blocks = {n: _to_blocks(take(a), bs) for n, a in full.items()}
    out = tuple(OffloadLayer({n: e[rows[i]] for n, e in empty.items()}, tables[rows[i]], ly.ckeys, ly.ccis, ly.pk)
                if i in rows else ly for i, ly in enumerate(layers) if i > 0)
    return layers[0], blocks, out


@dataclasses.dataclass(frozen=True)
class _Run:
    """The static plan of an offload step: the pipeline's plan and the copy's resolved settings."""

    plan: Plan
    engine: EngineConfig
    copy: str  # the resolved kv_copy implementation
    num_ctas: int

    @property
    def async_copy(self) -> bool:
        """sparda's copy of layer l+1 runs on its own stream during layer l (start ... wait); the
        reference copy is complete when it returns."""
        return self.engine.system == "sparda" and self.copy in FFI_IMPLEMENTATIONS


# Blocks are the trailing (bs, X) dims of the caches [B, K, n_slots, bs, X] and pools [L-1, B, K,
# nb, bs, X]: the copy calls take them unreshaped, since a reshape around an aliased custom call
# made XLA copy the whole cache (or pool) before the call and after it.
BLOCK_NDIM = 2


def _gather_blocks(run: _Run, host: dict, row, src, dst, cache_l: dict, *, start: bool) -> dict:
    """Copy the tasks (src, dst) of the layer in pool row `row` from the host pools into the layer's
    cache slots, every payload by the same task list: synchronously in one call, or with start
    asynchronously (`EngineConfig.copy_start`: one start per payload on its own side-stream
    lane with its share of the CTA quota, or one start of every payload); `_wait_blocks`
    completes them."""
    names = list(cache_l)
    caches = [cache_l[n] for n in names]
    # the reference's layer keeps its leading dim (its blocks flatten in the same order): an
    # integer index squeezed a one-layer pool by a bitcast in host memory, which XLA's GPU
    # compiler refused ("Bitcast cannot have different memory spaces")
    pools = [host[n] if run.copy in FFI_IMPLEMENTATIONS else jax.lax.dynamic_slice_in_dim(host[n], row, 1)
             for n in names]
    kw = dict(block_ndim=BLOCK_NDIM, implementation=run.copy)
    if start and run.engine.copy_start == "lanes":
        ctas = lane_ctas(run.num_ctas, caches, block_ndim=BLOCK_NDIM)
        out = [gather_blocks_start(p, src, dst, c, lane=j, config=KVCopyConfig(num_ctas=n), **kw)
               for j, (p, c, n) in enumerate(zip(pools, caches, ctas))]
    else:
        copy = gather_blocks_start if start else gather_blocks
        out = copy(tuple(pools), src, dst, tuple(caches), config=KVCopyConfig(num_ctas=run.num_ctas), **kw)
    return dict(zip(names, out))


def _wait_blocks(run: _Run, cache: dict, src, dst, after) -> dict:
    """The caches of a started copy once it is complete; `after` orders the wait after it."""
    if run.engine.copy_start == "one":
        return dict(zip(cache, gather_blocks_wait(tuple(cache.values()), src, dst, after, implementation=run.copy)))
    return {n: gather_blocks_wait(c, src, dst, after, implementation=run.copy) for n, c in cache.items()}


def _own_slot(slots, ids, pos, bs: int):
    """[B, K]: the slot of the block that position pos [B] falls in, which the selection always
    holds (the own block is forced)."""
    own = ids == (pos // bs)[:, None, None]  # [B, K, n]
    return jnp.sum(jnp.where(own, slots, 0), axis=-1)


def _write_token(cache_l: dict, slots, ids, pos, new: dict, bs: int) -> dict:
    """Write the new token's payloads (each [B, K, X] at positions pos [B]) into the slot of its
    block; one write per (sequence, KV head), in that order: unique and sorted."""
    b, kh = ids.shape[:2]
    slot = _own_slot(slots, ids, pos, bs)  # [B, K]
    bi = jnp.arange(b)[:, None]
    hi = jnp.arange(kh)[None, :]
    off = (pos % bs)[:, None]
    return {n: c.at[bi, hi, slot, off].set(new[n].astype(c.dtype), unique_indices=True, indices_are_sorted=True)
            for n, c in cache_l.items()}


class Fetched(struct.PyTreeNode):
    """One layer's selection and its cache after the copy (or with the copy in flight): what
    `sparda` carries to the next layer."""

    ids: jax.Array       # [B, K, n]
    slots: jax.Array     # [B, K, n]
    cache: dict          # payload -> [B, K, n_slots, bs, X]
    table: jax.Array     # [B, K, n_slots]
    src: jax.Array       # the copy's task lists (kept alive until its wait; -1: no task)
    dst: jax.Array
    token: tuple | None = None  # a started copy's order token (`after_start`), for its wait


def _payloads(p) -> dict:
    """The new token's per-token payloads, each [B, K, X]."""
    new = {"k": p.k[:, 0], "v": p.v[:, 0]}
    if p.cis is not None:
        new["cis"] = p.cis[:, 0, :, None]
    return new


class OffloadKV(struct.PyTreeNode):
    """An offloaded layer of the offload state as a KV source of `pipeline.layer_step`: its
    `OffloadLayer` on the device, the host pools of every offloaded layer and its row there.
    active False turns its copies into no tasks (a scan's prefetch past the last layer)."""

    state: OffloadLayer
    host: dict
    row: Any
    active: Any = True
    run: _Run = struct.field(pytree_node=False, default=None)

    def append(self, plan: Plan, ctx: Ctx, lin: LayerIn, p, read=None):
        """Append the new token's compressed keys (and NOSA's cis, InfiniGen's partial key).
        read: the previous layer's prefetched ids, computed from these compressed keys before the
        append: the appended values pass a barrier with them, so the in-place append follows that
        read by data (unordered, XLA copied the compressed keys to keep the old ones for it)."""
        pos0 = ctx.positions[:, 0]
        new = _payloads(p)
        k_c, cis_c = new["k"], new.get("cis")
        if read is not None:
            k_c, cis_c, read = jax.lax.optimization_barrier((k_c, cis_c, read))
        st = self.state.replace(ckeys=self.state.ckeys.append(k_c, pos0))
        if cis_c is not None:
            st = st.replace(ccis=st.ccis.append(cis_c, pos0))
        if st.pk is not None:
            rows = jnp.arange(p.k.shape[0])[:, None]
            st = st.replace(pk=st.pk.at[rows, ctx.positions].set(partial_keys(p.k, lin.ig), unique_indices=True,
                                                                  indices_are_sorted=True))
        return self.replace(state=st), self._keys(st), read

    @staticmethod
    def _keys(st: OffloadLayer) -> KeySide:
        return KeySide(kc=st.ckeys.kc, cis_c=None if st.ccis is None else st.ccis.kc[..., 0], pk=st.pk)

    def fetch(self, ids, pos, *, start: bool = False) -> Fetched:
        """Assign slots for ids [B, K, n] and copy the missing blocks (start: asynchronously)."""
        run, st = self.run, self.state
        table = st.table
        if not run.engine.reuse:
            # the no-reuse baseline copies every selected block, except the one being written:
            # its newest tokens exist only in its slot until the block completes
            table = jnp.where(table == (pos // run.plan.config.sparse.block_size)[:, None, None], table, -1)
        # the CUDA copy reads the pool of every layer in place: its sources start at the layer's row
        b, kh, nb = self.host["k"].shape[1:4]
        offset = self.row * (b * kh * nb) if run.copy in FFI_IMPLEMENTATIONS else 0
        p = plan_copies(table, ids, offset, n_blocks=nb, implementation=run.plan.implementations.copy_plan)
        src, dst = jnp.where(self.active, p.src, -1).reshape(-1), p.dst.reshape(-1)
        cache = _gather_blocks(run, self.host, self.row, src, dst, st.cache, start=start)
        return Fetched(ids, p.slots, cache, p.table, src, dst)

    def prefetch(self, plan: Plan, ctx: Ctx, lin: LayerIn, h, q):
        """sparda: this (next) layer's blocks from the previous layer's h (its Forecast kernel in
        `lin.sel`), against the compressed keys before this layer appends its new key (that chunk
        lies in the forced local window, so the choice is the same); the copy is started.
        Returns (Fetched, q ordered after the start)."""
        ids = select_blocks(plan, ctx, lin._replace(first=False), None, h, h, self._keys(self.state))[:, :, 0]
        f = self.fetch(ids, ctx.positions[:, 0], start=self.run.async_copy)
        if self.run.async_copy:
            # one slice of each start's output orders q after that start
            q, tok = after_start(f.cache if self.run.engine.copy_start == "lanes" else f.cache["k"], q)
            f = f.replace(token=tok)
        return f, q

    def attend(self, plan: Plan, ctx: Ctx, q, ids, keys, p, pending: Fetched | None = None,
               after: Fetched | None = None, dense=None):
        """Copy (or wait for the prefetched copy), write the new token into its slot, attend
        through the slot table. Returns (attn, source, counters). A dense layer is never
        offloaded (its `DecodeState` stays on the device)."""
        if dense is not None and dense is not False:
            raise ValueError("a dense layer (sparse.dense_layers) cannot read through the block cache")
        pos = ctx.positions[:, 0]
        bs = plan.config.sparse.block_size
        if pending is None:
            f = self.fetch(ids[:, :, 0], pos)
        else:
            f = pending.replace(ids=ids)
            if self.run.async_copy:
                # wait as late as possible: after the next layer's start (its token) and this
                # layer's projection
                order = (pending.token, None if after is None else after.token, q)  # operands, no kernel
                f = f.replace(cache=_wait_blocks(self.run, f.cache, f.src, f.dst, order))
        cache = _write_token(f.cache, f.slots, f.ids, pos, _payloads(p), bs)
        attn = paged_sparse_attention(
            q, cache["k"].astype(q.dtype), cache["v"].astype(q.dtype), f.slots[:, :, None], f.ids[:, :, None],
            ctx.positions, block_size=bs, bias_pool=cache["cis"][..., 0] if "cis" in cache else None,
            implementation=plan.implementations.sparse_attention)
        # per-layer masks, summed once a step (`_engine_decode_impl`): a sum here is a kernel a layer
        info = {"copied_blocks": f.src >= 0, "selected_blocks": (f.ids >= 0).reshape(-1)}
        return attn, self.replace(state=self.state.replace(cache=cache, table=f.table)), info


def _own_buffer(x: jax.Array) -> jax.Array:
    """x, read through a buffer of the step's own instead of the input's. The positions are read
    in every layer, and a step's inputs are new buffers every call: with one reader of the input,
    XLA has fewer CUDA graphs to update when the input's buffer moves (docs/decisions.md, "The
    step's positions are read once")."""
    return jax.lax.optimization_barrier(x + 1) - 1


def _engine_decode_impl(params, tokens, positions, state: OffloadState, forecast, infinigen, *, run: _Run):
    """One offload decode step: layer 0 and the dense layers from their `DecodeState`, the
    others through `OffloadKV` (sparda: each layer starts the next offloaded one's copy), then
    the write-back of the blocks this step completed. Returns (logits [B, V], state, counters
    summed over the offloaded layers)."""
    plan = run.plan
    c = plan.config
    prefetch = run.engine.system == "sparda"
    rows = {layer: j for j, layer in enumerate(offloaded_layers(c))}
    # with the CUDA copy (or its CPU twin) the layers run as a Python loop: a copy in flight must
    # not cross a loop carry (XLA may copy a carry, reading a buffer the side stream still
    # writes), and the synchronous copies update each layer's buffers in place that way; so do
    # dense layers, whose sources (and static `LayerIn.dense`) differ from the others'
    unroll = run.copy in FFI_IMPLEMENTATIONS or bool(c.sparse.dense_layers)
    pos = _own_buffer(positions)
    cos, sin = rope_tables(c, pos[:, None])
    ctx = Ctx(DecoderLayer(c, dtype=plan.dtype), cos, sin, pos[:, None], -(-state.size // c.sparse.block_size))
    lins = layer_inputs(params, forecast, infinigen, unroll=True, dense_layers=c.sparse.dense_layers)
    n = c.num_layers
    kv = lambda slot: OffloadKV(slot[0], state.host, slot[1], slot[2], run)  # slot: (OffloadLayer, row, active)
    # the source of layer i >= 1 (a slot, or a dense layer's DecodeState), and the copy it starts
    src_of = lambda i: (state.layers[i - 1], rows[i], True) if i in rows else state.layers[i - 1]
    next_of = lambda i: ((src_of(i + 1), lins[i + 1]) if prefetch and i + 1 in rows else None)

    # layer 0: on the device, contiguous; in sparda it starts layer 1's copy
    x = embed(params, tokens[:, None], c, plan.dtype)
    first = next_of(0)
    x, l0, out0 = layer_step(plan, ctx, lins[0], x, None, state.l0,
                             prefetch=None if first is None else (kv(first[0]), first[1]))

    def body(carry, xs):
        x, h_prev, pending = carry
        lin, src, nxt = xs
        offload = isinstance(src, tuple)
        x, me, out = layer_step(plan, ctx, lin, x, h_prev, kv(src) if offload else src, pending=pending,
                                prefetch=None if nxt is None else (kv(nxt[0]), nxt[1]))
        return (x, out.p.h, out.started), ((me.state if offload else me), out.info)

    carry = (x, out0.p.h, out0.started)
    if unroll:
        xs = tuple((lins[i], src_of(i), next_of(i)) for i in range(1, n))
        (x, _, _), ys = run_layers(body, carry, xs, unroll=True)
        layers = tuple(y[0] for y in ys)
        counted = [y[1] for y in ys if y[1]]  # the offloaded layers' counters (a dense layer has none)
        info = {k: jnp.stack([d[k] for d in counted]) for k in counted[0]}
    else:  # the reference copy: one scan over layers 1..L-1 (rows 0..L-2); iteration l also gets layer
        # l+1's slices (the last iteration a dummy whose copy has no tasks)
        nxt = [min(i + 1, n - 1) for i in range(1, n)]
        xs = (stacked(lins[1:]), (stacked(state.layers), jnp.arange(n - 1), jnp.ones(n - 1, bool)),
              ((stacked(tuple(state.layers[j - 1] for j in nxt)), jnp.asarray(nxt) - 1, jnp.arange(2, n + 1) < n),
               stacked(tuple(lins[j] for j in nxt))) if prefetch else None)
        (x, _, _), (layers, info) = run_layers(body, carry, xs, unroll=False)
        layers = per_layer(layers)
    new = _flush_completed(run, state.replace(l0=l0, layers=tuple(layers)), pos)
    # each layer's copies are counted once, by the layer that consumes them
    stats = {k: jnp.sum(v) for k, v in info.items()}
    return unembed(params, x, c)[:, 0], new, stats


def _flush_completed(run: _Run, state: OffloadState, pos) -> OffloadState:
    """Blocks whose last token was written this step go from their slot to the host. Each
    layer's slot of the written block is gathered into one small staging array (L_off x B x K
    blocks, every step: no branch), which one write-back moves into the pools; the CUDA copy
    writes just the completed blocks into the pinned pool in place, the reference moves the pool
    to the device and back."""
    bs = run.plan.config.sparse.block_size
    done = (pos % bs) == bs - 1  # [B]
    blk = pos // bs
    offloaded = state.offloaded
    # one reduction over the stacked tables (a reduction per layer was a kernel per layer)
    tables = jnp.stack([ly.table for ly in offloaded])  # [L_off, B, K, n_slots]
    slot = jnp.argmax(tables == blk[None, :, None, None], axis=-1)  # [L_off, B, K]
    l1, b, kh = slot.shape
    nb = state.host["k"].shape[3]
    row = jnp.arange(l1 * b * kh).reshape(l1, b, kh)  # (layer, sequence, KV head)
    bi, hi = jnp.arange(b)[:, None], jnp.arange(kh)[None, :]
    src = jnp.where(done[None, :, None], row, -1).reshape(-1).astype(jnp.int32)
    dst = (row * nb + blk[None, :, None]).reshape(-1).astype(jnp.int32)
    names = list(state.host)
    staged = tuple(jnp.stack([ly.cache[n][bi, hi, slot[i]] for i, ly in enumerate(offloaded)])
                   .reshape(l1 * b * kh, *state.host[n].shape[4:]).astype(state.host[n].dtype) for n in names)
    pools = tuple(state.host[n] for n in names)
    out = scatter_blocks(staged, src, dst, pools, config=KVCopyConfig(num_ctas=run.num_ctas), block_ndim=BLOCK_NDIM,
                         implementation=run.copy)
    return state.replace(host=dict(zip(names, out)))


def _engine_decode_loop_impl(params, tokens, positions, state, forecast, infinigen, keys=None, *, run,
                             sampling=None):
    """n decode steps in one program; run: a `_Run` (offload systems) or the resident systems'
    `Plan`. sampling None: tokens, positions [n, B]; step i decodes tokens[i] at positions[i];
    returns (logits [n, B, V] float32, state, stats). sampling (temperature, top_p): tokens [B],
    the first token; step i + 1 decodes the token `sample_next` drew from step i's logits with
    keys[i]; returns (the drawn tokens [n, B] int32, state, stats). stats: copied_blocks and
    selected_blocks per step, [n] each.

    Why one program: each call from Python is one XLA execution, and XLA re-records each CUDA
    graph whose buffers the allocator moved since the last call; inside one program every buffer
    keeps its address, and a loop of static trip count runs with no host sync. Nothing is in
    flight across iterations: every copy a step starts is waited on in that step."""
    n, b = positions.shape

    def body(i, carry):
        st, tok, out, copied, selected = carry  # tok: the drawn token (sampling), else unused
        t = tok if sampling else tokens[i]
        if isinstance(run, _Run):
            lg, st, stats = _engine_decode_impl(params, t, positions[i], st, forecast, infinigen, run=run)
            copied, selected = copied.at[i].set(stats["copied_blocks"]), selected.at[i].set(stats["selected_blocks"])
        else:
            lg, st = decode_program(params, t[:, None], positions[i][:, None], st, forecast, infinigen, plan=run)
        if sampling:
            tok = sample_next(lg, keys[i], *sampling)
        return st, tok, out.at[i].set(tok if sampling else lg), copied, selected

    c = run.plan.config if isinstance(run, _Run) else run.config
    first = tokens if sampling else tokens[0]
    out = jnp.zeros((n, b), jnp.int32) if sampling else jnp.zeros((n, b, c.vocab_size), jnp.float32)
    zeros = jnp.zeros((n,), jnp.int32)
    state, _, out, copied, selected = jax.lax.fori_loop(0, n, body, (state, first, out, zeros, zeros))
    return out, state, {"copied_blocks": copied, "selected_blocks": selected}


_engine_decode = stored_jit(_engine_decode_impl, static_argnames=("run",), donate_argnames=("state",))
_engine_decode_loop = stored_jit(_engine_decode_loop_impl, static_argnames=("run", "sampling"),
                                 donate_argnames=("state",))


def resolve(params, positions, state, config: ModelConfig, engine: EngineConfig, *, forecast=None, infinigen=None,
            dtype=jnp.float32):
    """(static plan, state) of a decode step: its checks at `positions` (host-side: every
    position the plan will decode) and its plan with the engine's choices resolved (the copy's
    implementation and CTA quota). A resident system's stacked state comes back split per layer.
    Public so that a benchmark can copy with exactly the engine's settings."""
    check_layers(params, config)
    if engine.system in RESIDENT_SYSTEMS:  # nothing is copied: the copy settings do not apply
        state = layered_state(state)
        if state[0].kv.k.shape[0] != np.shape(positions)[-1]:
            raise ValueError(f"the state holds {state[0].kv.k.shape[0]} sequences, the step {np.shape(positions)[-1]}")
        plan = decode_step_plan(params, positions, state, config, mode=engine.selector, forecast=forecast, infinigen=infinigen, dtype=dtype,
                                implementations=engine.implementations)
        return plan, state
    if not isinstance(state, OffloadState):
        raise TypeError(f"system {engine.system!r} needs an OffloadState from engine_prefill")
    batch = int(state.l0.kv.k.shape[0])
    if np.shape(positions)[-1] != batch:
        raise ValueError(f"the state holds {batch} sequences, the step {np.shape(positions)[-1]}")
    if int(np.max(np.asarray(positions))) + 1 < config.sparse.dense_len:  # host-side: no device op per step
        raise NotImplementedError("offload systems decode sparse only; below dense_len use a resident system")
    sp = config.sparse
    if engine.system == "sparda" and sp.local_blocks * sp.block_size < sp.kernel_size:
        raise ValueError("prefetching needs the local window to cover the newest compressed chunk "
                         "(local_blocks * block_size >= kernel_size)")
    copy = resolve_implementation(engine.implementations.kv_copy)
    if copy in FFI_IMPLEMENTATIONS:  # here, not only while tracing: a stored program runs untraced
        register_copy_targets(copy)
    if copy == "cuda":
        warn_if_default_launch_queues(config.num_layers)
    num_ctas = engine.num_ctas
    if num_ctas is None or (num_ctas == "auto" and copy != "cuda"):
        num_ctas = paper_num_ctas(batch)
    elif num_ctas == "auto":  # timed once per copy size on this GPU (cached)
        c = state.offloaded[0].cache["k"]
        num_ctas = autotune_num_ctas(int(c.shape[0] * c.shape[1] * c.shape[2]), tuple(c.shape[3:]), str(c.dtype))
    plan = Plan(config, engine.selector, False, jnp.dtype(dtype), engine.implementations)
    return _Run(plan, engine, copy, int(num_ctas)), state


def engine_decode_step(params, tokens, positions, state, config: ModelConfig, engine: EngineConfig, *,
                       forecast=None, infinigen=None, dtype=jnp.float32):
    """One token per sequence (tokens, positions int [B]) in any engine system. Returns (logits
    [B, V], state, stats) where stats counts the blocks copied from the host and the blocks
    selected (layers >= 1). params: stacked, or `model.layered_params(params)` (made once,
    before the decode loop: the step then slices no weight)."""
    run, state = resolve(params, positions, state, config, engine, forecast=forecast, infinigen=infinigen,
                         dtype=dtype)
    if engine.system in RESIDENT_SYSTEMS:  # a stacked state was split once (`resolve`); the layered one comes back
        logits, st = decode_program(params, tokens[:, None], positions[:, None], state, forecast, infinigen, plan=run)
        return logits, st, {"copied_blocks": 0, "selected_blocks": 0}
    return _engine_decode(params, tokens, positions, state, forecast, infinigen, run=run)


def engine_decode_steps(params, tokens, positions, state, config: ModelConfig, engine: EngineConfig, *,
                        forecast=None, infinigen=None, dtype=jnp.float32):
    """n decode steps in one device program: tokens and positions int [n, B], step i decodes
    tokens[i] at positions[i] (the tokens are given, as in scoring a continuation or in a
    benchmark). Returns (logits [n, B, V] float32, state, stats) with stats' counters per step
    ([n] each): the same steps, logits and state as n calls of `engine_decode_step`."""
    positions = _loop_positions(positions)
    if np.shape(tokens) != positions.shape:
        raise ValueError(f"engine_decode_steps takes tokens of the positions' shape {positions.shape}, "
                         f"got {np.shape(tokens)}")
    return _loop(params, tokens, positions, None, state, config, engine, forecast, infinigen, dtype, None)


def engine_generate_steps(params, tokens, positions, keys, state, config: ModelConfig, engine: EngineConfig, *,
                          temperature: float = 0.0, top_p: float = 1.0, forecast=None, infinigen=None,
                          dtype=jnp.float32):
    """n decode steps in one device program, each fed the token the last one drew: tokens int
    [B], the first token of each sequence; positions int [n, B], where step i writes its token;
    keys [n] (`jax.random.split`), step i's draw (`infer.generate.sample_next`, greedy at
    temperature 0). Returns (the drawn tokens [n, B] int32, state, stats per step ([n] each)):
    what n calls of `engine_decode_step` and `sample_next` give with these keys, without a host
    round trip between steps."""
    positions = _loop_positions(positions)
    if np.shape(tokens) != positions.shape[1:]:
        raise ValueError(f"engine_generate_steps takes one first token per sequence {positions.shape[1:]}, "
                         f"got {np.shape(tokens)}")
    if len(keys) != positions.shape[0]:
        raise ValueError(f"engine_generate_steps takes one key per step ({positions.shape[0]}), got {len(keys)}")
    return _loop(params, tokens, positions, keys, state, config, engine, forecast, infinigen, dtype,
                 (float(temperature), float(top_p)))


def _loop_positions(positions) -> np.ndarray:
    positions = np.asarray(positions)  # host-side checks need it concrete, as engine_decode_step's
    if positions.ndim != 2 or positions.shape[0] < 1:
        raise ValueError(f"positions of n >= 1 steps take the shape [n, B], got {positions.shape}")
    return positions


def _loop(params, tokens, positions, keys, state, config, engine, forecast, infinigen, dtype, sampling):
    tokens = jnp.asarray(tokens)
    if not (jnp.issubdtype(tokens.dtype, jnp.integer) and np.issubdtype(positions.dtype, np.integer)):
        raise TypeError(f"tokens and positions must be integers, got {tokens.dtype} and {positions.dtype}")
    run, state = resolve(params, positions, state, config, engine, forecast=forecast, infinigen=infinigen,
                         dtype=dtype)
    return _engine_decode_loop(params, tokens.astype(jnp.int32), jnp.asarray(positions, jnp.int32), state, forecast,
                               infinigen, keys, run=run, sampling=sampling)


def memory_report(config: ModelConfig, *, batch: int, context: int, n_slots: int | None = None,
                  dtype=jnp.bfloat16, system: str = "sparda") -> dict:
    """Bytes per component for a batch at a context length (what `engine_prefill` allocates)."""
    it = jnp.dtype(dtype).itemsize
    bs, kh, d, L = config.sparse.block_size, config.num_kv_heads, config.head_dim, config.num_layers
    s = -(-context // bs) * bs
    n_slots = config.sparse.topk if n_slots is None else n_slots
    kv_layer = 2 * batch * s * kh * d * it
    n_c = max(1, (s - config.sparse.kernel_size) // config.sparse.kernel_stride + 1)
    off = len(offloaded_layers(config))
    rep = {
        "device: layer 0 K/V": kv_layer,
        "device: compressed keys": L * batch * n_c * kh * d * it,
        "device: block cache": 2 * off * batch * kh * n_slots * bs * d * it,
    }
    if off < L - 1:
        rep["device: dense layers' K/V"] = (L - 1 - off) * kv_layer
    if system in RESIDENT_SYSTEMS:
        rep = {"device: K/V, all layers": L * kv_layer}
    else:
        rep["host: K/V of the offloaded layers"] = off * kv_layer
        if config.has_cis:  # NOSA: one float32 per token and KV head, beside K and V
            rep["host: cis of the offloaded layers"] = off * batch * s * kh * 4
            rep["device: block cache"] += off * batch * kh * n_slots * bs * 4
            rep["device: cis of layer 0 and the dense layers"] = (L - off) * batch * s * kh * 4
    rep["device total"] = sum(v for k, v in rep.items() if k.startswith("device"))
    rep["host total"] = sum(v for k, v in rep.items() if k.startswith("host"))
    return rep
