"""The offload inference engine: KV of layers 1..L-1 in host memory, a device block cache.

Where data lives (SPEC.md section 5):
  host    full K/V of layers 1..L-1, paged in blocks: [L-1, B, K, nb, bs, Dh] (a block of one
          KV head is one contiguous 16 KB run for MiniCPM4's Dh=128 in bf16), in the
          `pinned_host` memory kind where the backend has it
  device  layer 0's K/V (contiguous), compressed keys of every layer, InfiniGen's partial keys,
          and the block cache: slots [B, K, n_slots, bs, Dh] per layer with their table
          [L-1, B, K, n_slots] (the block id each slot holds, -1 empty)

Decode, per layer l >= 1: select blocks (the mode's selector), keep the resident ones, copy
the missing ones from the host into free slots (`blockcache.assign_slots`), write the new
token's K/V into its block's slot, attend through the slot table. In `sparda` the copy for
layer l+1 is issued during layer l (its Forecast F_l is known there) and carried to the next
iteration of the layer scan; `sparda_sync` copies at layer l. The numbers are the same; what
differs is when the copy runs: with the CUDA copy engine, `sparda` starts layer l+1's copy on
a side stream before layer l's attention and waits for it in layer l+1
(`gather_blocks_start` / `gather_blocks_wait`; the layer loop is unrolled then, see
`_engine_decode`). A block reaches the host when prefill writes it or when decode completes
it (its last token written, written back by `scatter_blocks`); until then it lives in its
slot, always resident because the local window forces it.

Modes: dense_resident and sparse_resident run `sparda_jax.modes` with all KV on the device;
sparse, infinigen, sparda_sync and sparda are the offload modes.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import SingleDeviceSharding

from sparda_jax.attention import paged_sparse_attention, sparse_attention
from sparda_jax.config import ModelConfig
from sparda_jax.model import (DecoderLayer, check_layers, embed, layer_params, per_layer, rope_tables, stacked,
                              unembed)
from sparda_jax.modes import (KeySide, decode_program, decode_step_plan, layered_state, prefill, select_for_mode,
                              selector_input)
from sparda_jax.runtime import warn_if_default_launch_queues
from sparda_jax.select import TOPK_IMPLEMENTATIONS

from sparda_jax.kernels.copy_engine import (COPY_GROUP, FFI_IMPLEMENTATIONS, autotune_num_ctas, doorbell_serve,
                                            gather_blocks, gather_blocks_ring, gather_blocks_ring_wait,
                                            gather_blocks_start, gather_blocks_wait, lane_ctas, memory_type,
                                            paper_num_ctas, resolve_implementation, scatter_blocks)

from .blockcache import assign_slots
from .generate import sample_next

__all__ = ["ENGINE_MODES", "OFFLOAD_MODES", "OffloadState", "engine_prefill", "engine_decode_step",
           "engine_decode_steps", "engine_generate_steps", "selector_of", "memory_report", "per_layer", "stacked"]

OFFLOAD_MODES = ("sparse", "infinigen", "sparda_sync", "sparda")
RESIDENT_MODES = {"dense_resident": "dense", "sparse_resident": "sparse"}
ENGINE_MODES = tuple(RESIDENT_MODES) + OFFLOAD_MODES


def selector_of(mode: str) -> str:
    """The `sparda_jax.modes` mode whose selection an engine mode uses."""
    if mode in RESIDENT_MODES:
        return RESIDENT_MODES[mode]
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"unknown engine mode {mode!r}; expected one of {', '.join(ENGINE_MODES)}")
    return {"sparse": "sparse", "infinigen": "infinigen", "sparda_sync": "sparda", "sparda": "sparda"}[mode]


class OffloadState(struct.PyTreeNode):
    """Per-token payloads travel together as dicts keyed "k", "v" and, for NOSA, "cis":

    l0     layer 0 on the device, contiguous: k, v [B, S, K, Dh], cis [B, S, K]
    host   layers 1..L-1 in host memory, paged: k, v [L-1, B, K, nb, bs, Dh], cis [L-1, B, K, nb, bs]
    cache  the device block cache, one dict per layer 1..L-1: k, v [B, K, n_slots, bs, Dh], cis
           [B, K, n_slots, bs, 1]
    table  [L-1, B, K, n_slots] int32 block id per slot (-1 empty)
    ckeys  compressed keys, one per layer 0..L-1; ccis NOSA's compressed cis (Dh = 1), per layer;
           pk InfiniGen's partial keys, one [B, S, K, r] per layer

    The per-layer state is a tuple of buffers, not one stacked array: a decode step updates each
    layer's cache and keys in place, and a stacked array would go through a slice and a restack
    (a copy of every layer's cache and keys) every step. On the H200 those copies took ~0.8 of the
    2.1 busy ms of SparDA's compute stream at batch 16 and 128K, 4 layers
    (bench/results/profiles/decode_sparda_T131072_B16_8517789.trace.json.gz:
    input_concatenate_fusion, MemcpyD2D, memcpy128).
    """

    l0: dict
    host: dict
    cache: tuple
    table: jax.Array
    ckeys: tuple
    ccis: tuple | None
    pk: tuple | None

    @property
    def size(self) -> int:
        return self.l0["k"].shape[1]


def host_sharding():
    """Where the engine's host pools go: the pinned_host memory kind where the backend has it."""
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    return SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else None)


def _on_cuda(dev) -> bool:
    return dev.platform == "gpu" and "cuda" in getattr(dev.client, "platform_version", "").lower()


def host_pool(x) -> jax.Array:
    """x as one of the engine's host pools: in the pinned_host memory kind where the backend has
    it. On a CUDA GPU the buffer is checked to be page-locked host memory (`memory_type`): XLA's VMM
    allocator, which its command-buffer update modes other than ALWAYS_UPDATE force, placed
    pinned_host arrays in device memory on the H200 (bench/results/decode_update_*.json, f43841a: a
    "host" -> device copy at 1064-1233 GB/s). The engine would then read its KV from the device
    and report offload numbers that are not. (That placement was read off the bandwidth; the
    check itself has run on the H200 under the default allocator only.) The query uses the CUDA
    copy library, built with nvcc on first use; without nvcc the pool is left unchecked, with a
    warning."""
    sharding = host_sharding()
    out = jax.device_put(x, sharding)
    if out.size == 0 or sharding.memory_kind != "pinned_host" or not _on_cuda(next(iter(sharding.device_set))):
        return out  # an empty buffer may have no address; off CUDA there is nothing to ask
    try:
        where = memory_type(out)
    except (RuntimeError, OSError) as e:  # no nvcc or no CUDA library: say so, do not stop the engine
        warnings.warn(f"the host KV pool's placement was not checked ({e}); if XLA's VMM allocator is on "
                      "(--xla_gpu_command_buffer_update_mode), it may be in device memory", stacklevel=2)
        return out
    if where != "host":
        raise RuntimeError(
            f"the host KV pool asked for pinned_host memory but CUDA places it in {where} memory, so the "
            "offload would not offload. XLA's VMM allocator, which --xla_gpu_command_buffer_update_mode "
            "other than ALWAYS_UPDATE forces (XLA_FLAGS), did this on the H200: run without that flag")
    return out


def _to_blocks(x, bs: int):
    """[L, B, S, K, Dh] -> [L, B, K, nb, bs, Dh]."""
    l, b, s, k, d = x.shape
    nb = s // bs
    return x.reshape(l, b, nb, bs, k, d).transpose(0, 1, 4, 2, 3, 5)


def engine_prefill(params, tokens, lengths, config: ModelConfig, *, mode: str, cache_size: int, n_slots: int | None = None,
                   forecast=None, infinigen=None, dtype=jnp.float32):
    """Prefill with all KV on the device (as the paper does), then move layers 1..L-1 to the
    host and set up the block cache. Returns (last logits [B, V], state).

    Resident modes return a `sparda_jax.modes.DecodeState` per layer (`layered_state`: decode
    updates each layer's K/V in place); offload modes an `OffloadState`.
    `cache_size` is rounded up to whole blocks; n_slots defaults to the budget `topk`.
    """
    sel = selector_of(mode)
    bs = config.sparse.block_size
    cache_size = -(-cache_size // bs) * bs
    last, st = prefill(params, tokens, lengths, config, cache_size=cache_size, mode=sel, forecast=forecast,
                       infinigen=infinigen, dtype=dtype)
    if mode in RESIDENT_MODES:
        return last, layered_state(st)
    n_slots = config.sparse.topk if n_slots is None else n_slots
    if n_slots < config.sparse.topk:
        raise ValueError(f"n_slots ({n_slots}) must be >= the block budget topk ({config.sparse.topk})")
    full = {"k": st.kv.k, "v": st.kv.v}
    if config.has_cis:
        full["cis"] = st.cis[..., None]  # a trailing unit axis: every payload is [..., tokens, K, X]
    host = {n: host_pool(_to_blocks(a[1:], bs)) for n, a in full.items()}
    b, kh = tokens.shape[0], config.num_kv_heads
    cache = tuple({n: jnp.zeros((b, kh, n_slots, bs, a.shape[-1]), a.dtype) for n, a in full.items()}
                  for _ in range(config.num_layers - 1))
    state = OffloadState({n: a[0] for n, a in full.items()}, host, cache,
                         jnp.full((config.num_layers - 1, b, kh, n_slots), -1, jnp.int32), per_layer(st.ckeys),
                         per_layer(st.ccis), per_layer(st.pk))
    return last, state


COPY_STARTS = ("lanes", "one", "graph", "doorbell")
GRAPH_SCHEDULINGS = ("LHS", "SERIALIZE", "CONCURRENT_REGIONS", "CONCURRENT")


@dataclasses.dataclass(frozen=True)
class _EnginePlan:
    config: ModelConfig
    mode: str
    dtype: jnp.dtype
    reuse: bool
    copy_impl: str  # "cuda" (kernels/copy), "host_ffi" (its CPU twin) or "xla" (the reference)
    num_ctas: int
    attention_impl: str | None = None  # `paged_sparse_attention`'s implementation
    copy_group: int = COPY_GROUP  # tasks a copy CTA moves as one range (`gather_blocks`' group)
    # sparda's prefetch: "lanes" one asynchronous start per payload on its own lane, "one" every
    # payload in one start, "graph" the synchronous in-graph gather left to XLA's graph to overlap,
    # "doorbell" every payload as one job of a persistent server, rung and waited on in-graph
    copy_start: str = "lanes"
    # FOR TIMING ONLY (see `engine_decode_step`): no copy task moves data; the outputs are wrong
    skip_copies: bool = False
    # the synchronous gather and the write-back as the custom calls XLA may record into its CUDA graphs
    copy_in_graph: bool = True
    # XLA's xla_gpu_command_buffer_scheduling_mode for the step (None: XLA's own, except that
    # copy_start "graph" needs CONCURRENT: see `_scheduling`)
    graph_scheduling: str | None = None
    # the selectors' top-k (`sparda_jax.select.finalize_topk`): "xla" (lax.top_k and a sort of
    # the ids), "xla_count" (ranks by counting, no sort) or "mosaic_gpu" (the sort-free Mosaic
    # kernel; "mosaic_gpu_interpret" on the CPU)
    topk_impl: str = "xla"


def _copy_tasks(plan, host: dict, layer, a, ids, n_slots: int):
    """The task lists of one layer's copy: task (b, k, i) copies block ids[b, k, i] into slot
    a.slots[b, k, i] when a.copy says so (-1: no task). The CUDA engine reads the whole pool
    in place (only the wanted blocks cross PCIe), so its sources index all layers; the
    reference slices the layer first. plan.skip_copies: every task a no-op (src -1), here,
    where every copy's tasks are made, so that the step keeps its launches and bookkeeping."""
    b, kh, nb = host["k"].shape[1:4]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(kh)[None, :, None]
    dst = jnp.where(a.copy, (bi * kh + hi) * n_slots + a.slots, -1).reshape(-1)
    if plan.copy_impl in FFI_IMPLEMENTATIONS:  # one pool of every layer: the offset is in the ids
        src = jnp.where(a.copy, (((layer - 1) * b + bi) * kh + hi) * nb + ids, -1).reshape(-1)
    else:
        src = jnp.where(a.copy, (bi * kh + hi) * nb + ids, -1).reshape(-1)
    if plan.skip_copies:
        src = jnp.full_like(src, -1)
    return src.astype(jnp.int32), dst.astype(jnp.int32)


# Blocks are the trailing (bs, X) dims of the caches [B, K, n_slots, bs, X] and pools [L-1, B, K,
# nb, bs, X]: the copy calls take them unreshaped (`block_ndim`), since a reshape around an
# aliased custom call made XLA copy the whole cache (or pool) before the call and after it.
BLOCK_NDIM = 2


def _pool(plan, h, layer):
    """The pool the layer's tasks index: the whole pool for the custom calls (their tasks carry
    the layer's offset), the layer's own for the reference."""
    return h if plan.copy_impl in FFI_IMPLEMENTATIONS else h[layer - 1]


def _serve_first(plan, src, job, n_jobs: int):
    """The doorbell's step begins with its first job: the server is launched on the way to it."""
    if plan.copy_start == "doorbell" and job == 0:
        return doorbell_serve(src, n_jobs=n_jobs, num_ctas=plan.num_ctas, implementation=plan.copy_impl)
    return src


def _gather_blocks(plan, host: dict, layer, src, dst, cache_l: dict, *, start: bool = False,
                   job: int | None = None) -> dict:
    """Copy the tasks (src, dst) of layer `layer` (1-based; host index layer - 1) from the
    host pools [L-1, B, K, nb, bs, X] into the layer's cache slots [B, K, n_slots, bs, X], every
    payload with the same task list: in one copy (one launch for K, V and cis), or with start
    (`_wait_blocks` completes it) as one copy per payload, each on its own side-stream lane with
    its share of the CTA quota, running side by side (see `gather_blocks_start`)."""
    names = list(cache_l)
    caches = [cache_l[n] for n in names]
    pools = [_pool(plan, host[n], layer) for n in names]
    kw = dict(group=plan.copy_group, block_ndim=BLOCK_NDIM, implementation=plan.copy_impl)
    if start and plan.copy_start == "doorbell":  # job: the layer's place among the step's rings
        out = gather_blocks_ring(tuple(pools), src, dst, tuple(caches), job=job, block_ndim=BLOCK_NDIM,
                                 implementation=plan.copy_impl)
    elif start and plan.copy_start == "one":
        out = gather_blocks_start(tuple(pools), src, dst, tuple(caches), num_ctas=plan.num_ctas, lane=0, **kw)
    elif start:
        out = [gather_blocks_start(p, src, dst, f, num_ctas=c, lane=j, **kw)
               for j, (p, f, c) in enumerate(zip(pools, caches,
                                                 lane_ctas(plan.num_ctas, caches, block_ndim=BLOCK_NDIM)))]
    else:
        out = gather_blocks(tuple(pools), src, dst, tuple(caches), num_ctas=plan.num_ctas, in_graph=plan.copy_in_graph,
                            **kw)
    return dict(zip(names, out))


def _after_start(started: dict, x):
    """(x, token): x ordered after the copy starts into `started` (XLA schedules by data alone),
    and a token that must reach a wait (`_wait_blocks(..., after=token)` or `join_tokens`).
    The barrier holds a one-element slice of each started cache, not the cache: a cache that
    passes through a barrier is copied by XLA before its wait (copy insertion, for the wait's
    in-place output), and that copy would read the buffer while the side stream writes it
    ("no copy in flight", seen with the host_ffi twin and on the H200). The slices' reads race
    with the copy, harmlessly: their values are never used. The token is those slices out of the
    barrier: XLA drops the outputs of an optimization barrier that nothing uses, and with the
    slices gone the barrier no longer follows the starts (the optimized HLO had one-element
    barriers of x alone, so the starts could be scheduled anywhere before their waits)."""
    marks = [jax.lax.slice(c, (0,) * c.ndim, (1,) * c.ndim) for c in started.values()]  # no reshape (BLOCK_NDIM)
    marks, x = jax.lax.optimization_barrier((marks, x))
    return x, join_tokens(*marks)


def join_tokens(*tokens) -> jax.Array:
    """One small f32 array of every element of the (small) tokens given: a wait's `after` that
    follows all of them. Whole tokens, never a slice of one: XLA folds a slice of a concatenation
    to the operands it keeps, and an element dropped so is a barrier output unused."""
    return jnp.concatenate([t.reshape(-1).astype(jnp.float32) for t in tokens if t is not None])


def _wait_blocks(plan, cache: dict, src, dst, after, job: int | None = None) -> dict:
    """The caches of a copy started with (src, dst) (doorbell: rung as `job`) once it is
    complete; `after` orders the wait after it."""
    if plan.copy_start == "doorbell":
        names = list(cache)
        out = gather_blocks_ring_wait(tuple(cache[n] for n in names), src, dst, after, job=job,
                                      implementation=plan.copy_impl)
        return dict(zip(names, out))
    if plan.copy_start == "one":  # one start of every payload: one wait
        names = list(cache)
        out = gather_blocks_wait(tuple(cache[n] for n in names), src, dst, after, implementation=plan.copy_impl)
        return dict(zip(names, out))
    return {n: gather_blocks_wait(c, src, dst, after, implementation=plan.copy_impl) for n, c in cache.items()}


def _own_slot(slots, ids, pos, bs: int):
    """[B, K]: the slot of the block that position pos [B] falls in, which the selection always
    holds (the own block is forced)."""
    own = ids == (pos // bs)[:, None, None]  # [B, K, n]
    return jnp.sum(jnp.where(own, slots, 0), axis=-1)


def _write_token(cache_l: dict, slots, ids, pos, new: dict, bs: int, *, slot_of=_own_slot) -> dict:
    """Write the new token's payloads (each [B, K, X] at positions pos [B]) into the slot of
    its block (`slot_of`: scripts/probes/write_token_ab.py passes a variant)."""
    b, kh = ids.shape[:2]
    slot = slot_of(slots, ids, pos, bs)  # [B, K]
    bi = jnp.arange(b)[:, None]
    hi = jnp.arange(kh)[None, :]
    off = (pos % bs)[:, None]
    # one write per (sequence, KV head), in that order: unique and sorted
    return {n: c.at[bi, hi, slot, off].set(new[n].astype(c.dtype), unique_indices=True, indices_are_sorted=True)
            for n, c in cache_l.items()}


class _Fetched(struct.PyTreeNode):
    """One layer's selection and its cache after the copy (or with the copy in flight): what
    `sparda` carries to the next layer, and what the synchronous modes compute in place."""

    ids: jax.Array       # [B, K, n]
    slots: jax.Array     # [B, K, n]
    cache: dict          # payload -> [B, K, n_slots, bs, X]
    table: jax.Array     # [B, K, n_slots]
    n_copies: jax.Array
    src: jax.Array       # the copy's task lists (kept alive until its wait)
    dst: jax.Array
    token: jax.Array | None = None  # a started copy's order token (`_after_start`), for its wait


def _fetch(plan: _EnginePlan, ids, table, cache_l: dict, host: dict, layer, pos, *, start: bool = False,
           active=True, job: int | None = None) -> _Fetched:
    """Select slots for `ids` and copy the missing blocks; `active` False turns the copy into
    no tasks (the prefetch past the last layer). job: a started copy's place among the step's
    (layer - 1, for the doorbell)."""
    if not plan.reuse:
        # the no-reuse baseline copies every selected block, except the one being written:
        # its newest tokens exist only in its slot until the block completes
        table = jnp.where(table == (pos // plan.config.sparse.block_size)[:, None, None], table, -1)
    a = assign_slots(table, ids)
    src, dst = _copy_tasks(plan, host, layer, a, ids, table.shape[-1])
    src = jnp.where(active, src, -1)
    if start:
        src = _serve_first(plan, src, job, plan.config.num_layers - 1)
    cache = _gather_blocks(plan, host, layer, src, dst, cache_l, start=start, job=job)
    return _Fetched(ids, a.slots, cache, a.table, jnp.where(active, a.n_copies, 0), src, dst)


def _own_buffer(x: jax.Array) -> jax.Array:
    """x, read through a buffer of the step's own instead of the input's.

    The positions are read in every layer (RoPE, the new token's writes, the selection's
    causal rules, the attention kernel), and a decode step's inputs are new buffers every step;
    XLA re-records each of its CUDA graphs whose commands read an allocation that has moved. Here
    one op reads the input and writes a temporary; the barrier keeps XLA from folding the round
    trip back onto the input. Measured on the H200: it does not stop the re-recordings (every
    graph of a 4-layer SparDA step is re-recorded at every step with it, without it, and with
    one input buffer for all steps: the moving allocations are the step's own,
    bench/results/graph_updates/), but at full depth it cut SparDA's host time a step from
    9.8-10.8 to 7.5-7.8 ms in one call, its device step within that call's noise
    (bench/results/decode_queues_shell*.json)."""
    return jax.lax.optimization_barrier(x + 1) - 1


def _engine_decode_impl(params, tokens, positions, state: OffloadState, forecast, infinigen, *, plan: _EnginePlan):
    c = plan.config
    sp = c.sparse
    bs = sp.block_size
    sel_mode = selector_of(plan.mode)
    prefetch = plan.mode == "sparda"
    # the CUDA copy of layer l+1 runs on its own stream during layer l (start ... wait); the
    # reference copy is complete when it returns
    async_copy = prefetch and plan.copy_impl in FFI_IMPLEMENTATIONS and plan.copy_start != "graph"
    pos = _own_buffer(positions)
    qpos = pos[:, None]
    cos, sin = rope_tables(c, qpos)
    layer = DecoderLayer(c, dtype=plan.dtype)
    rows = jnp.arange(tokens.shape[0])[:, None]
    n_blocks = -(-state.size // bs)
    sels = None if forecast is None else jnp.concatenate([forecast["f0_cur"]["kernel"][None],
                                                          forecast["f"]["kernel"]], axis=0)
    igs = None if infinigen is None else infinigen.proj
    lps = params["layers"]  # stacked, or per layer (`model.layered_params`: no weight is sliced, so none is copied)
    cis_c = lambda cc: None if cc is None else cc.kc[..., 0]

    def project(x, lp, l, ckeys_l, ccis_l, pk_l, read=None):
        """Q/K/V (and NOSA's cis) of the new token; the per-layer device state appended. read:
        what the previous layer's prefetch computed from this layer's compressed keys before
        the append (its block ids): the appended values pass an optimization barrier with it, so
        the in-place append follows that read by data; unordered, XLA copied the compressed keys
        twice to keep the old ones for it."""
        v = {"params": lp}
        h, q, k, vv = layer.apply(v, x, cos, sin, method="project")
        new = {"k": k[:, 0], "v": vv[:, 0]}
        if c.has_cis:
            new["cis"] = layer.apply(v, vv, method="cis")[:, 0, :, None]  # [B, K, 1]
        k_c, cis_c_new = new["k"], new.get("cis")
        if read is not None:  # `read` comes back out: a barrier output nothing uses is dropped, and its order
            k_c, cis_c_new, read = jax.lax.optimization_barrier((k_c, cis_c_new, read))
        ckeys_l = ckeys_l.append(k_c, pos)
        if c.has_cis:
            ccis_l = ccis_l.append(cis_c_new, pos)
        if pk_l is not None:
            pk_l = pk_l.at[rows, qpos].set(jnp.einsum("BTKD,KDR->BTKR", k.astype(jnp.float32), igs[l]),
                                           unique_indices=True, indices_are_sorted=True)
        return v, h, q, new, ckeys_l, ccis_l, pk_l, read

    def select(mode, v, h, h_prev, q, l, kc, cc, pk_l, first):
        sel_in = selector_input(c, mode, plan.dtype, layer, v, h, h_prev, None if sels is None else sels[l],
                                None if igs is None else igs[l], cos, sin, first)
        keys = KeySide(None, None, kc, None, cis_c(cc), pk_l)
        return select_for_mode(c, mode, q, keys, qpos, sel_in, first, n_blocks,
                               topk_implementation=plan.topk_impl)[:, :, 0]

    def prefetch_next(h, l_next, table, cache_l, ckeys_next, ccis_next, active=True, job=None):
        """sparda: F_l (kernel l+1) against layer l+1's compressed keys, before layer l+1 has
        appended its new key (that chunk lies in the forced local window, so the choice is
        the same). job: l (the copy of layer l+1 is the step's l-th start)."""
        ids = select("sparda", None, h, h, None, l_next, ckeys_next.kc, ccis_next, None, False)
        return _fetch(plan, ids, table, cache_l, state.host, l_next, pos, start=async_copy, active=active, job=job)

    # layer 0: on the device, contiguous
    ccis = state.ccis or (None,) * c.num_layers
    pks = state.pk or (None,) * c.num_layers
    x = embed(params, tokens[:, None], c, plan.dtype)
    v0, h0, q0, new0, ck0, cc0, pk0, _ = project(x, layer_params(lps, 0), 0, state.ckeys[0], ccis[0], pks[0])
    l0 = {n: a.at[rows, qpos].set(new0[n][:, None].astype(a.dtype), unique_indices=True, indices_are_sorted=True)
          for n, a in state.l0.items()}
    ids0 = select(sel_mode, v0, h0, h0, q0, 0, ck0.kc, cc0, pk0, True)
    pre = None
    if prefetch:  # layer 1's copy runs during layer 0's attention and FFN
        pre = prefetch_next(h0, 1, state.table[0], state.cache[0], state.ckeys[1], ccis[1], job=0)
        if async_copy:
            q0, tok = _after_start(pre.cache, q0)
            pre = pre.replace(token=tok)
    attn = sparse_attention(q0, l0["k"].astype(q0.dtype), l0["v"].astype(q0.dtype), ids0[:, :, None], qpos,
                            block_size=bs, bias=l0["cis"][..., 0] if "cis" in l0 else None)
    x = layer.apply(v0, x, attn, method="finish")

    def body(carry, xs):
        """Layer l = xs["l"]; xs holds its slices (and, for prefetch, layer l+1's as n_*; the
        unrolled loop gives the last layer none: nothing is prefetched past it)."""
        x, h_prev, pre = carry
        l = xs["l"]
        v, h, q, new, ck, cc, pk_l, read = project(x, xs["lp"], l, xs["ckeys"], xs["ccis"], xs["pk"],
                                                   read=pre.ids if prefetch else None)
        if prefetch:
            own, new_pre = pre.replace(ids=read), None
            if "n_cache" in xs:
                new_pre = prefetch_next(h, jnp.minimum(l + 1, c.num_layers - 1), xs["n_table"], xs["n_cache"],
                                        xs["n_ckeys"], xs["n_ccis"], active=l + 1 < c.num_layers,
                                        job=l)  # a Python int: the doorbell's path is the unrolled loop
            if async_copy:
                # issue layer l+1's copy before this layer's attention and FFN, then wait for
                # this layer's (started one layer earlier) as late as possible: after both starts'
                # barriers (their tokens) and this layer's projection
                after = [own.token]
                if new_pre is not None:
                    q, tok = _after_start(new_pre.cache, q)
                    new_pre = new_pre.replace(token=tok)
                    after.append(tok)
                after.append(q.reshape(-1)[:1])
                own = own.replace(cache=_wait_blocks(plan, own.cache, own.src, own.dst, join_tokens(*after),
                                                     job=l - 1))
        else:
            ids = select(sel_mode, v, h, h_prev, q, l, ck.kc, cc, pk_l, False)
            own = _fetch(plan, ids, xs["table"], xs["cache"], state.host, l, pos)
            new_pre = None
        cache_l = _write_token(own.cache, own.slots, own.ids, pos, new, bs)
        attn = paged_sparse_attention(
            q, cache_l["k"].astype(q.dtype), cache_l["v"].astype(q.dtype), own.slots[:, :, None], own.ids[:, :, None],
            qpos, block_size=bs, bias_pool=cache_l["cis"][..., 0] if "cis" in cache_l else None,
            implementation=plan.attention_impl)
        x = layer.apply(v, x, attn, method="finish")
        out = dict(ckeys=ck, ccis=cc, pk=pk_l, table=own.table, cache=cache_l, n_copies=own.n_copies,
                   selected=jnp.sum(own.ids >= 0))
        return (x, h, new_pre), out

    if plan.copy_impl in FFI_IMPLEMENTATIONS:
        # a Python loop, not a scan, around the copy custom calls, over the per-layer buffers of
        # the state (each updated in place). With copies in flight across layers it is needed for
        # correctness: a loop carry may be copied by XLA, and a copy of a buffer the side stream is
        # still writing would read it half-written (not scan(unroll=...) either: a scan of one trip,
        # 2 layers, is a while loop whatever unroll says, and the H200 and the host_ffi twin lost
        # the start's buffer there). The synchronous modes take it for speed: in a scan the layers'
        # cache slices went through 57 device-to-device copies and 10 copy kernels a step, 1.9 of
        # 5.7 busy ms of a Sparse step of 4 layers at batch 8 on the H200; unrolled, SparDA's step
        # had 8 and 0.2 ms (bench/results/decode_profile_74bb579.json)
        carry, steps = (x, h0, pre), []
        for i in range(c.num_layers - 1):
            l = i + 1
            xs = dict(l=l, lp=layer_params(lps, l), ckeys=state.ckeys[l], ccis=ccis[l], pk=pks[l],
                      table=state.table[i], cache=state.cache[i])
            if prefetch and l + 1 < c.num_layers:
                xs.update(n_table=state.table[i + 1], n_cache=state.cache[i + 1], n_ckeys=state.ckeys[l + 1],
                          n_ccis=ccis[l + 1])
            carry, y = body(carry, xs)
            steps.append(y)
        (x, _, pre) = carry
        ys = {k: tuple(y[k] for y in steps) for k in steps[0]}
    else:  # the reference copies (copy_impl "xla"): one scan over the layers' stacked slices
        # `nxt` gives iteration l the slices of layer l+1 (the last iteration gets a dummy)
        nxt = lambda a: jnp.concatenate([a[1:], a[-1:]], axis=0)
        tail = lambda t: None if t is None else stacked(t[1:])  # per-layer tuples of layers 0..L-1
        cache_s = stacked(state.cache)
        xs = dict(l=jnp.arange(1, c.num_layers), lp=jax.tree.map(lambda a: a[1:], stacked(lps)), ckeys=tail(state.ckeys),
                  ccis=tail(state.ccis), pk=tail(state.pk), table=state.table, cache=cache_s)
        if prefetch:
            xs.update(n_table=nxt(state.table), n_cache=jax.tree.map(nxt, cache_s),
                      n_ckeys=jax.tree.map(nxt, tail(state.ckeys)),
                      n_ccis=None if state.ccis is None else jax.tree.map(nxt, tail(state.ccis)))
        (x, _, pre), ys = jax.lax.scan(body, (x, h0, pre), xs)
        ys = {k: (per_layer(v) if k in ("ckeys", "ccis", "pk", "cache") else v) for k, v in ys.items()}
    stack = lambda a: a if isinstance(a, jax.Array) else jnp.stack(a)
    opt = lambda first, rest: None if first is None else (first,) + tuple(rest)
    new = state.replace(l0=l0, cache=tuple(ys["cache"]), table=stack(ys["table"]), ckeys=(ck0,) + tuple(ys["ckeys"]),
                        ccis=opt(cc0, ys["ccis"]), pk=opt(pk0, ys["pk"]))
    new = _flush_completed(plan, new, pos, bs)
    # each layer's copies are counted once, by the iteration that consumes them
    stats = {"copied_blocks": jnp.sum(stack(ys["n_copies"])), "selected_blocks": jnp.sum(stack(ys["selected"]))}
    return unembed(params, x, c)[:, 0], new, stats


def _engine_decode_loop_impl(params, tokens, positions, state, forecast, infinigen, keys=None, *, plan,
                             sampling=None):
    """n decode steps in one program; plan: an `_EnginePlan` (offload modes) or the resident
    modes' `sparda_jax.modes` plan.
    sampling None: tokens, positions [n, B]; step i decodes tokens[i] at positions[i]. Returns
    (logits [n, B, V] float32, state, stats).
    sampling (temperature, top_p): tokens [B], the first token; positions [n, B]; keys [n]. Step
    i + 1 decodes the token `sample_next` drew from step i's logits with keys[i]. Returns (the
    drawn tokens [n, B] int32, state, stats).
    stats: copied_blocks and selected_blocks per step, [n] each.

    Why one program: a decode step called from Python is one XLA execution, and XLA re-records
    each of its CUDA graphs whose buffers the allocator placed elsewhere than at the last call.
    At full depth a third or fourth allocation of SparDA's step moved at nearly every call, and
    re-recording its 1405-command graph then took 4-10 ms of host time, about the device's whole
    step (bench/results/graph_updates/: claims32_*.log.gz, sparda32_step_b30a6b0.log.gz). Inside
    one program every buffer keeps its address for all n steps, and a loop of static trip count
    runs its body n times with no host sync (XLA's WhileThunk reads no predicate back when it
    knows the trip count). Nothing is in flight across iterations: every copy a step starts is
    waited on in that step."""
    n, b = positions.shape

    def step(i, tok, st, copied, selected):
        if isinstance(plan, _EnginePlan):
            lg, st, stats = _engine_decode_impl(params, tok, positions[i], st, forecast, infinigen, plan=plan)
            copied, selected = copied.at[i].set(stats["copied_blocks"]), selected.at[i].set(stats["selected_blocks"])
        else:
            lg, st = decode_program(params, tok[:, None], positions[i][:, None], st, forecast, infinigen, plan=plan)
        return lg, st, copied, selected

    def body(i, carry):
        st, tok, out, copied, selected = carry  # tok: the drawn token (sampling), else unused
        lg, st, copied, selected = step(i, tok if sampling else tokens[i], st, copied, selected)
        if sampling:
            tok = sample_next(lg, keys[i], *sampling)
        return st, tok, out.at[i].set(tok if sampling else lg), copied, selected

    first = tokens if sampling else tokens[0]
    out = jnp.zeros((n, b), jnp.int32) if sampling else jnp.zeros((n, b, plan.config.vocab_size), jnp.float32)
    zeros = jnp.zeros((n,), jnp.int32)
    state, _, out, copied, selected = jax.lax.fori_loop(0, n, body, (state, first, out, zeros, zeros))
    return out, state, {"copied_blocks": copied, "selected_blocks": selected}


_DECODE_JIT = dict(static_argnames=("plan",), donate_argnames=("state",))


@functools.cache
def _compiled(impl, scheduling: str | None):
    """impl jitted with XLA's command-buffer scheduling `scheduling` (a compile option of this
    program alone, not a process-wide XLA_FLAGS; None: XLA's own)."""
    opts = {} if scheduling is None else {"compiler_options": {"xla_gpu_command_buffer_scheduling_mode": scheduling}}
    if impl is _engine_decode_loop_impl:
        opts["static_argnames"] = ("plan", "sampling")
    return jax.jit(impl, **{**_DECODE_JIT, **opts})


_engine_decode = _compiled(_engine_decode_impl, None)  # the step under XLA's own graph scheduling


def _scheduling(plan: _EnginePlan) -> str | None:
    """copy_start "graph" issues layer l+1's gather as an ordinary command of the step's CUDA
    graph, with no data dependency on layer l's attention and FFN. XLA's default scheduling
    (LHS) serializes a graph's commands unless its latency-hiding scheduler paired them as
    async work, so the gather would run between layer l's kernels instead of beside them;
    CONCURRENT builds the graph's edges from buffer use alone, so the gather may run on the
    side, as the asynchronous starts do, without leaving the graph. (On the H200 it did not:
    4 layers, random traffic, step / (compute alone + copies alone) 0.97, decode_graph4.json.)"""
    if plan.graph_scheduling is not None:
        return plan.graph_scheduling
    return "CONCURRENT" if plan.mode == "sparda" and plan.copy_start == "graph" else None


def _decode_program(plan, loop: bool = False):
    """The jitted step of an offload plan, or with loop n steps of any plan (`engine_decode_steps`)."""
    scheduling = _scheduling(plan) if isinstance(plan, _EnginePlan) else None
    return _compiled(_engine_decode_loop_impl if loop else _engine_decode_impl, scheduling)


def _flush_completed(plan: _EnginePlan, state: OffloadState, pos, bs: int) -> OffloadState:
    """Blocks whose last token was written this step go from their slot to the host. Each
    layer's slot of the written block is gathered into one small staging array ((L-1) x B x K
    blocks, every step: no branch), which one write-back moves into the pool; the CUDA engine
    writes just the completed blocks into the pinned pool in place, the reference moves the pool
    to the device and back."""
    done = (pos % bs) == bs - 1  # [B]
    blk = pos // bs
    slot = jnp.argmax(state.table == blk[None, :, None, None], axis=-1)  # [L-1, B, K]
    l1, b, kh = slot.shape
    nb = state.host["k"].shape[3]
    row = jnp.arange(l1 * b * kh).reshape(l1, b, kh)  # (layer, sequence, KV head)
    bi, hi = jnp.arange(b)[:, None], jnp.arange(kh)[None, :]
    src = jnp.where(done[None, :, None], row, -1).reshape(-1).astype(jnp.int32)
    dst = (row * nb + blk[None, :, None]).reshape(-1).astype(jnp.int32)
    names = list(state.host)
    staged = tuple(jnp.stack([c[n][bi, hi, slot[i]] for i, c in enumerate(state.cache)])
                   .reshape(l1 * b * kh, *state.host[n].shape[4:]).astype(state.host[n].dtype) for n in names)
    pools = tuple(state.host[n] for n in names)
    out = scatter_blocks(staged, src, dst, pools, num_ctas=plan.num_ctas, block_ndim=BLOCK_NDIM, in_graph=plan.copy_in_graph,
                         implementation=plan.copy_impl)
    return state.replace(host=dict(zip(names, out)))


def engine_decode_step(params, tokens, positions, state, config: ModelConfig, *, mode: str, forecast=None,
                       infinigen=None, dtype=jnp.float32, reuse: bool = True, copy_impl: str | None = None,
                       num_ctas: int | str | None = None, attention_impl: str | None = None,
                       skip_copies: bool = False, copy_group: int = COPY_GROUP, copy_start: str = "lanes",
                       copy_in_graph: bool = True, graph_scheduling: str | None = None, topk_impl: str = "xla"):
    """One token per sequence in any engine mode. Returns (logits [B, V], state, stats) where
    stats counts the blocks copied from the host and the blocks selected (layers >= 1).

    params: stacked, or `sparda_jax.model.layered_params(params)` (made once, before the decode
    loop). Per layer, no weight is sliced inside the step, so XLA copies none. On the H200 that
    removed one o_proj copy a layer, a gain within timing noise (bench/results/decode_weights_*.json).

    copy_impl: "cuda" (the UVA gather of kernels/copy), "host_ffi" (the same custom calls'
    CPU twin, for testing their use on the CPU), "xla" (the reference); None picks cuda on a
    GPU. num_ctas: the copy kernel's CTA quota: None the paper's heuristic (16 below
    batch 32, else 32), "auto" the fastest (fewest on a near-tie) of 8..64 CTAs timed once on
    this GPU for a layer's worst-case copy (every slot of every sequence and KV head).
    attention_impl: the block-cache attention's (`sparda_jax.attention.paged_sparse_attention`;
    None: the paged Mosaic kernel where it applies, else the reference).
    skip_copies: FOR TIMING ONLY. Every host -> device copy task is disabled (src -1): the copy
    kernels launch and the block table and slots are assigned as usual (stats count the copies
    that would have run), but no block moves, so the cache is stale and the logits are wrong;
    the step's time is that of everything but the data movement. The write-back of completed
    blocks runs as usual. copy_group: tasks a copy CTA moves as one range (`gather_blocks`).
    copy_start ("sparda" with the CUDA copy): "lanes" starts K and V as copies of their own on two
    side streams, "one" starts them as one copy (one launch, the whole CTA quota), "graph" issues
    layer l+1's copy as the synchronous in-graph gather right after its selection (needs
    copy_in_graph) and compiles the step with XLA's CONCURRENT graph scheduling, so that the
    copy may run beside layer l's work inside one CUDA graph, with no start or wait to cut it.
    An experiment: on the H200 it ran serially, slower than "lanes" (bench/results/decode_graph4.json).
    "doorbell": a persistent server grid launched once a step copies each layer's blocks (every
    payload one job), posted and waited on by one-thread kernels on XLA's stream that XLA may
    record into its graphs (`kernels.copy_engine.doorbell_serve`); built, not yet timed on a GPU.
    graph_scheduling: XLA's command-buffer scheduling mode for the step ("LHS", "SERIALIZE",
    "CONCURRENT_REGIONS", "CONCURRENT"); None: XLA's own, or CONCURRENT for copy_start "graph".
    copy_in_graph (default): the synchronous gather (sparse, infinigen, sparda_sync) and every
    mode's write-back as custom calls declared safe for XLA's command buffers, so that XLA need
    not cut its CUDA graph at each. The same copies (equal tokens and logits on the CPU twin and
    on the H200); at full depth, batch 8, 128K it took Sparse's whole step into one graph and
    its host time from 10.4 to 6.2 ms (bench/results/decode_depth_graph.json against
    decode_b8_32layers.json, two calls). The asynchronous starts and waits of "sparda" stay cuts.
    False: the calls of before, cut points of XLA's graphs.
    topk_impl: the selectors' top-k, "xla", "xla_count" or "mosaic_gpu" (Hopper; "mosaic_gpu_interpret"
    on the CPU): the same ids (`sparda_jax.select.finalize_topk`); the offload modes only."""
    plan, state = _step_plan(params, positions, state, config, mode=mode, forecast=forecast, infinigen=infinigen,
                             dtype=dtype, reuse=reuse, copy_impl=copy_impl, num_ctas=num_ctas,
                             attention_impl=attention_impl, skip_copies=skip_copies, copy_group=copy_group,
                             copy_start=copy_start, copy_in_graph=copy_in_graph, graph_scheduling=graph_scheduling,
                             topk_impl=topk_impl)
    if mode in RESIDENT_MODES:  # a stacked state was split once (`_step_plan`); the layered one comes back
        logits, st = decode_program(params, tokens[:, None], positions[:, None], state, forecast, infinigen, plan=plan)
        return logits, st, {"copied_blocks": 0, "selected_blocks": 0}
    return _decode_program(plan)(params, tokens, positions, state, forecast, infinigen, plan=plan)


def engine_decode_steps(params, tokens, positions, state, config: ModelConfig, *, mode: str, forecast=None,
                        infinigen=None, dtype=jnp.float32, **options):
    """n decode steps in one device program: tokens and positions int [n, B], step i decodes
    tokens[i] at positions[i] (the tokens are given, as in scoring a continuation or in a
    benchmark). Returns (logits [n, B, V] float32, state, stats) with stats' counters per step
    ([n] each). The same steps, logits and state as n calls of `engine_decode_step`, whose
    keyword options (reuse, copy_impl, num_ctas, copy_start, ...) it takes.

    Why: each call from Python is one XLA execution, and at full depth XLA re-recorded SparDA's
    CUDA graph at nearly every call, for longer than the device took for the step (see
    `_engine_decode_loop_impl`); here the buffers keep their addresses for all n steps."""
    positions = _loop_positions(positions)
    if np.shape(tokens) != positions.shape:
        raise ValueError(f"engine_decode_steps takes tokens of the positions' shape {positions.shape}, "
                         f"got {np.shape(tokens)}")
    return _loop(params, tokens, positions, None, state, config, mode, forecast, infinigen, dtype, None, options)


def engine_generate_steps(params, tokens, positions, keys, state, config: ModelConfig, *, mode: str,
                          temperature: float = 0.0, top_p: float = 1.0, forecast=None, infinigen=None,
                          dtype=jnp.float32, **options):
    """n decode steps in one device program, each fed the token the last one drew: tokens int
    [B], the first token of each sequence; positions int [n, B], where step i writes its token;
    keys [n] (`jax.random.split`), step i's draw. Step i decodes its token and draws the next
    with `infer.generate.sample_next(logits, keys[i], temperature, top_p)` (greedy at
    temperature 0). Returns (the drawn tokens [n, B] int32, state, stats per step ([n] each)):
    the tokens n calls of `engine_decode_step` and `sample_next` give, with the keys given, and
    without a host round trip between steps (see `engine_decode_steps`). Options as there."""
    positions = _loop_positions(positions)
    if np.shape(tokens) != positions.shape[1:]:
        raise ValueError(f"engine_generate_steps takes one first token per sequence {positions.shape[1:]}, "
                         f"got {np.shape(tokens)}")
    if len(keys) != positions.shape[0]:
        raise ValueError(f"engine_generate_steps takes one key per step ({positions.shape[0]}), got {len(keys)}")
    return _loop(params, tokens, positions, keys, state, config, mode, forecast, infinigen, dtype,
                 (float(temperature), float(top_p)), options)


def _loop_positions(positions) -> np.ndarray:
    positions = np.asarray(positions)  # host-side checks need it concrete, as engine_decode_step's
    if positions.ndim != 2 or positions.shape[0] < 1:
        raise ValueError(f"positions of n >= 1 steps take the shape [n, B], got {positions.shape}")
    return positions


def _loop(params, tokens, positions, keys, state, config, mode, forecast, infinigen, dtype, sampling, options):
    tokens = jnp.asarray(tokens)
    if not (jnp.issubdtype(tokens.dtype, jnp.integer) and np.issubdtype(positions.dtype, np.integer)):
        raise TypeError(f"tokens and positions must be integers, got {tokens.dtype} and {positions.dtype}")
    plan, state = _step_plan(params, positions, state, config, mode=mode, forecast=forecast, infinigen=infinigen,
                             dtype=dtype, **options)
    return _decode_program(plan, loop=True)(params, tokens.astype(jnp.int32), jnp.asarray(positions, jnp.int32),
                                            state, forecast, infinigen, keys, plan=plan, sampling=sampling)


def _step_plan(params, positions, state, config: ModelConfig, *, mode: str, forecast, infinigen, dtype, **options):
    """(plan, state): the checks of a decode step (every position in `positions`) and its static
    plan; a resident mode's stacked state comes back split per layer (`layered_state`)."""
    sel = selector_of(mode)
    check_layers(params, config)
    batch = np.shape(positions)[-1]
    if mode in RESIDENT_MODES:  # nothing is copied: the copy options do not apply
        state = layered_state(state)
        if state[0].kv.k.shape[0] != batch:
            raise ValueError(f"the state holds {state[0].kv.k.shape[0]} sequences, the step {batch}")
        return decode_step_plan(params, positions, state, config, mode=sel, forecast=forecast, infinigen=infinigen,
                                dtype=dtype), state
    if not isinstance(state, OffloadState):
        raise TypeError(f"mode {mode!r} needs an OffloadState from engine_prefill")
    if state.l0["k"].shape[0] != batch:
        raise ValueError(f"the state holds {state.l0['k'].shape[0]} sequences, the step {batch}")
    if int(np.max(np.asarray(positions))) + 1 < config.sparse.dense_len:  # host-side: no device op per step
        raise NotImplementedError("offload modes decode sparse only; below dense_len use a resident mode")
    if mode == "sparda" and config.sparse.local_blocks * config.sparse.block_size < config.sparse.kernel_size:
        raise ValueError("prefetching needs the local window to cover the newest compressed chunk "
                         "(local_blocks * block_size >= kernel_size)")
    return decode_plan(config, mode, state.cache, dtype=dtype, **options), state


def decode_plan(config: ModelConfig, mode: str, cache: dict, *, dtype=jnp.float32, reuse: bool = True,
                copy_impl: str | None = None, num_ctas: int | str | None = None, attention_impl: str | None = None,
                skip_copies: bool = False, copy_group: int = COPY_GROUP, copy_start: str = "lanes",
                copy_in_graph: bool = True, graph_scheduling: str | None = None,
                topk_impl: str = "xla") -> _EnginePlan:
    """The frozen plan `engine_decode_step` runs with (its defaults resolved) for an offload
    state's block cache `cache` (per layer {payload: [B, K, n_slots, bs, X]}); public so that a
    benchmark can copy with exactly the engine's implementation and CTA quota."""
    batch = int(cache[0]["k"].shape[0])
    copy_impl = resolve_implementation(copy_impl)
    if copy_impl == "cuda":
        warn_if_default_launch_queues(config.num_layers)
    if num_ctas is None:
        num_ctas = paper_num_ctas(batch)
    elif num_ctas == "auto":  # timed once per copy size on this GPU (cached)
        c = cache[0]["k"]
        num_ctas = autotune_num_ctas(int(c.shape[0] * c.shape[1] * c.shape[2]), tuple(c.shape[3:]), str(c.dtype)) \
            if copy_impl == "cuda" else paper_num_ctas(batch)
    if copy_start not in COPY_STARTS:
        raise ValueError(f"copy_start must be one of {COPY_STARTS}, got {copy_start!r}")
    if copy_start == "doorbell" and not 2 <= config.num_layers <= 257:
        raise ValueError(f"copy_start 'doorbell' serves 1..256 jobs a step, one per offloaded layer; "
                         f"got {config.num_layers} layers")
    if copy_start == "graph" and not copy_in_graph:
        raise ValueError("copy_start 'graph' is the in-graph gather: it needs copy_in_graph=True")
    if graph_scheduling is not None and graph_scheduling not in GRAPH_SCHEDULINGS:
        raise ValueError(f"graph_scheduling must be None or one of {GRAPH_SCHEDULINGS}, got {graph_scheduling!r}")
    if topk_impl not in TOPK_IMPLEMENTATIONS:  # said here, before a trace
        raise ValueError(f"topk_impl must be one of {TOPK_IMPLEMENTATIONS}, got {topk_impl!r}")
    return _EnginePlan(config, mode, jnp.dtype(dtype), reuse, copy_impl, num_ctas, attention_impl, copy_group,
                       copy_start, skip_copies, bool(copy_in_graph), graph_scheduling, topk_impl)


def memory_report(config: ModelConfig, *, batch: int, context: int, n_slots: int | None = None,
                  dtype=jnp.bfloat16, mode: str = "sparda") -> dict:
    """Bytes per component for a batch at a context length (what `engine_prefill` allocates)."""
    it = jnp.dtype(dtype).itemsize
    bs, kh, d, L = config.sparse.block_size, config.num_kv_heads, config.head_dim, config.num_layers
    s = -(-context // bs) * bs
    n_slots = config.sparse.topk if n_slots is None else n_slots
    kv_layer = 2 * batch * s * kh * d * it
    n_c = max(1, (s - config.sparse.kernel_size) // config.sparse.kernel_stride + 1)
    rep = {
        "device: layer 0 K/V": kv_layer,
        "device: compressed keys": L * batch * n_c * kh * d * it,
        "device: block cache": 2 * (L - 1) * batch * kh * n_slots * bs * d * it,
    }
    if mode in RESIDENT_MODES:
        rep = {"device: K/V, all layers": L * kv_layer}
    else:
        rep["host: K/V of layers 1..L-1"] = (L - 1) * kv_layer
        if config.has_cis:  # NOSA: one float32 per token and KV head, beside K and V
            rep["host: cis of layers 1..L-1"] = (L - 1) * batch * s * kh * 4
            rep["device: block cache"] += (L - 1) * batch * kh * n_slots * bs * 4
    rep["device total"] = sum(v for k, v in rep.items() if k.startswith("device"))
    rep["host total"] = sum(v for k, v in rep.items() if k.startswith("host"))
    return rep

