"""Block selection: the InfLLM-V2 selector, the SparDA Forecast selector, and NOSA's combine.

Output layout (all selectors): int32 [B, K, Tq, topk], per (sequence, KV head, query) the
selected 64-token block ids in ascending order, then -1 padding. All G query heads of a GQA
group share their KV head's row.

Pipeline per query at position p (SPEC.md sections 2, 3, 6):
  chunk scores [.., N_c]  (-inf where chunk c is not yet complete: c*s + l - 1 > p)
  -> block scores [.., N_b] (max over the chunks whose windows overlap the block; for
     l=32, s=16, B=64 that is chunks 4k-1..4k+3, MiniCPM's max-pool (5, 4, pad 1))
  -> forced blocks (+inf): init blocks and the local window q_blk - local_blocks .. q_blk
  -> future blocks (k > q_blk) and blocks without a visible chunk are never chosen
  -> top `topk` (forced included), ascending, -1 padded.
Ties go to the lower block id (lax.top_k's order).

Queries are processed in chunks (`q_chunk`) so memory is O(q_chunk * N_c), never [T, T].

The InfLLM-V2 and Forecast selectors take `implementation=`: "xla" (the jnp code here, the
reference), "mosaic_gpu" / "mosaic_gpu_interpret" (kernels/forecast_select.py and
kernels/infllmv2_select.py: scoring fused with the pooling and the forced/causal rules, a
top-k without sort), None = "mosaic_gpu" for prefill where it ran correct on an H200 and was
faster (bench/results/select.json, fd748c4: 2.5x the XLA Forecast selector and 3.1x the XLA InfLLM-V2
selector at 128K; Hopper, bf16/f16, head dim 128, <= 2048 blocks), XLA elsewhere (decode
included, where XLA was faster).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from .attention import NEG_INF, hopper_gpu
from .compress import chunk_visible, compress_keys
from .config import SparseConfig

__all__ = [
    "n_blocks_for",
    "pool_to_blocks",
    "finalize_topk",
    "topk_by_count",
    "TOPK_IMPLEMENTATIONS",
    "infllmv2_chunk_scores",
    "forecast_chunk_scores",
    "select_blocks_infllmv2",
    "select_blocks_forecast",
    "select_blocks_nosa",
    "nosa_refine",
    "select_blocks_infinigen",
    "infinigen_chunk_scores",
    "compress_cis",
]

INF = jnp.inf
# `finalize_topk`'s top-k: lax.top_k, ranks by counting in XLA, or the sort-free Mosaic kernel
# (compiled, or interpreted on the CPU)
TOPK_IMPLEMENTATIONS = ("xla", "xla_count", "mosaic_gpu", "mosaic_gpu_interpret")


def n_blocks_for(n_chunks: int, sparse: SparseConfig) -> int:
    """Blocks that queries consistent with `n_chunks` compressed keys can reach.

    kc built from T keys has N_c = (T - l)//s + 1 chunks, so T < N_c*s + l and every query
    position p <= T - 1 lies in a block < (N_c*s + l - 2)//B + 1.
    """
    return (n_chunks * sparse.kernel_stride + sparse.kernel_size - 2) // sparse.block_size + 1


def pool_to_blocks(scores: jax.Array, n_blocks: int, sparse: SparseConfig) -> jax.Array:
    """Chunk scores [..., N_c] (-inf = invisible) -> block scores [..., n_blocks] (max over
    the chunks overlapping each block; -inf where none is visible)."""
    r = sparse.block_size // sparse.kernel_stride
    left = (sparse.kernel_size - 1) // sparse.kernel_stride  # chunks starting before the block
    need = n_blocks * r
    n = scores.shape[-1]
    if n >= need:
        x = scores[..., :need]
    else:
        x = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, need - n)], constant_values=-INF)
    # block kb pools chunks r*kb - left .. r*kb + r - 1: its own r chunks (a reshape and a max)
    # and the last `left` of the block before. Not lax.reduce_window, which XLA's GPU backend runs
    # slowly; max is exact, so the values are the same
    # (SparseConfig keeps kernel_size <= block_size, so left < r)
    grouped = x.reshape(*x.shape[:-1], n_blocks, r)
    own = jnp.max(grouped, axis=-1)
    if left == 0:
        return own
    prev = jnp.max(grouped[..., r - left:], axis=-1)
    prev = jnp.pad(prev[..., :-1], [(0, 0)] * (x.ndim - 1) + [(1, 0)], constant_values=-INF)
    return jnp.maximum(own, prev)


def finalize_topk(block_scores: jax.Array, q_positions: jax.Array, topk: int,
                  sparse: SparseConfig, force: bool = True, topk_implementation: str = "xla") -> jax.Array:
    """Block scores [B, K, tq, N_b] -> ids [B, K, tq, topk] (forced, causal, sorted, -1 padded).

    topk_implementation: "xla" (lax.top_k, then a sort of the ids: XLA sorts whole rows for
    k > 16), "xla_count" (`topk_by_count`: no sort, N_b^2 comparisons a row; tried for decode,
    slower on the H200) or "mosaic_gpu" / "mosaic_gpu_interpret"
    (the sort-free Mosaic top-k of kernels/forecast_select.py, `select_topk(implementation="rows")`,
    on the masked scores; <= 2048 blocks). All give the same ids."""
    if topk_implementation not in TOPK_IMPLEMENTATIONS:
        raise ValueError(f"unknown top-k implementation {topk_implementation!r}")
    nb = block_scores.shape[-1]
    q_blk = jnp.where(q_positions >= 0, q_positions // sparse.block_size, -1)[:, None, :, None]
    k = jnp.arange(nb).reshape(1, 1, 1, nb)
    candidate = k <= q_blk
    s = jnp.where(candidate, block_scores, -INF)
    if force:
        forced = candidate & ((k < sparse.init_blocks) | (k >= q_blk - sparse.local_blocks))
        s = jnp.where(forced, INF, s)
    if topk_implementation == "xla_count":
        return topk_by_count(s, topk)
    if topk_implementation != "xla":
        from sparda_jax.kernels.forecast_select import MAX_BLOCKS, select_topk

        if nb > MAX_BLOCKS:
            # at T = 128K kc's length admits 2049 blocks (n_blocks_for), one more than the kernel's row
            raise ValueError(f"the Mosaic top-k takes rows of <= {MAX_BLOCKS} blocks, got {nb}: pass "
                             f"n_blocks=T // {sparse.block_size} to the selector (the engine does)")
        rows = select_topk(s.reshape(-1, nb).astype(jnp.float32), topk, implementation="rows",
                           interpret=_interpret(topk_implementation))
        return rows.reshape(s.shape[:-1] + (topk,))
    if nb < topk:
        s = jnp.pad(s, [(0, 0)] * 3 + [(0, topk - nb)], constant_values=-INF)
    vals, idx = jax.lax.top_k(s, topk)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.where(vals == -INF, big, idx.astype(jnp.int32))
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, -1, idx)


def topk_by_count(s: jax.Array, topk: int) -> jax.Array:
    """Scores [..., N] -> the ids of the `topk` largest, ascending, -1 padded; -inf never chosen;
    ties to the lower id (lax.top_k's order). Without a sort: an element's rank is the number
    of elements ahead of it (larger, or equal at a lower id), the chosen are those ranked below
    topk, and an id's place in the output is the number of chosen ids below it. Three fused
    comparisons and sums of N^2 (rank, place) and topk x N (output) elements a row, each one
    parallel XLA reduction, meant to beat the sort-based top-k at decode (one CTA a row: 21.6 us
    for 16 rows of 2048 blocks, bench/results/layer_breakdown_2e96975.json). It did not: 1.3-1.6x
    slower in the decode selectors at 128K (bench/results/select_decode_count.json), so it is a
    tested option, not a default. Scores must not be NaN."""
    n = s.shape[-1]
    lead = (1,) * (s.ndim - 1)
    i = jnp.arange(n)
    lower = (i[None, :] < i[:, None]).reshape(lead + (n, n))  # column j is a lower id than row i
    # compare in lax.top_k's total order, where -0.0 < +0.0: float32 bits mapped to monotone int32
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    si, sj = key[..., :, None], key[..., None, :]
    rank = jnp.sum((sj > si) | ((sj == si) & lower), axis=-1)  # [..., N]
    chosen = (rank < topk) & (s > -INF)
    place = jnp.sum(chosen[..., None, :] & lower, axis=-1)  # chosen ids below each id
    slot = jnp.where(chosen, place, -1)[..., None, :] == jnp.arange(topk).reshape(lead + (topk, 1))  # [..., topk, N]
    return (jnp.sum(jnp.where(slot, (i + 1).reshape(lead + (1, n)), 0), axis=-1) - 1).astype(jnp.int32)


def infllmv2_chunk_scores(q, kc, q_positions, sparse: SparseConfig, kc_coarse=None) -> jax.Array:
    """q [B, tq, H, D], kc [B, N_c, K, D] -> [B, K, tq, N_c] float32: per query head a softmax
    over the visible chunks, summed over the G heads of the group (not divided by G);
    -inf where invisible.

    kc_coarse: MiniCPM4's approximation. Each head's log-sum-exp is taken over these coarser
    compressed keys (window sparse.coarse_lse_kernel, stride sparse.coarse_lse_stride) instead
    of over kc; where no coarse chunk is visible yet, the exact LSE is used.
    """
    b, tq, h, d = q.shape
    n, kh = kc.shape[1], kc.shape[2]
    g = h // kh
    scale = 1.0 / math.sqrt(d)
    qg = q.astype(jnp.float32).reshape(b, tq, kh, g, d)
    logits = jnp.einsum("BTKGD,BNKD->BKGTN", qg, kc.astype(jnp.float32)) * scale
    vis = chunk_visible(jnp.arange(n), q_positions, sparse.kernel_size, sparse.kernel_stride)
    vis = vis[:, None, None]  # [B, 1, 1, tq, N]
    masked = jnp.where(vis, logits, NEG_INF)
    m = jnp.max(masked, axis=-1, keepdims=True)
    e = jnp.exp(masked - m) * vis
    lse = m + jnp.log(jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30))
    if kc_coarse is not None:
        n2 = kc_coarse.shape[1]
        l2 = jnp.einsum("BTKGD,BNKD->BKGTN", qg, kc_coarse.astype(jnp.float32)) * scale
        vis2 = chunk_visible(jnp.arange(n2), q_positions, sparse.coarse_lse_kernel,
                             sparse.coarse_lse_stride)[:, None, None]
        m2 = jnp.max(jnp.where(vis2, l2, NEG_INF), axis=-1, keepdims=True)
        s2 = jnp.sum(jnp.exp(jnp.where(vis2, l2, NEG_INF) - m2) * vis2, axis=-1, keepdims=True)
        any2 = jnp.any(vis2, axis=-1, keepdims=True)
        lse = jnp.where(any2, m2 + jnp.log(jnp.maximum(s2, 1e-30)), lse)
    p = jnp.exp(masked - lse) * vis
    return jnp.where(vis[:, 0], jnp.sum(p, axis=2), -INF)


def forecast_chunk_scores(f, kc, q_positions, sparse: SparseConfig) -> jax.Array:
    """f [B, tq, K, D] (one head per group), kc [B, N_c, K, D] -> raw logits [B, K, tq, N_c]
    float32, -inf where invisible. No softmax: it is monotone per row and the max-pool keeps
    the order, so ranking raw logits selects the same blocks."""
    d = f.shape[-1]
    logits = jnp.einsum("BTKD,BNKD->BKTN", f.astype(jnp.float32), kc.astype(jnp.float32)) / math.sqrt(d)
    vis = chunk_visible(jnp.arange(kc.shape[1]), q_positions, sparse.kernel_size, sparse.kernel_stride)
    return jnp.where(vis[:, None], logits, -INF)


def _check(x, kc, q_positions, heads_name):
    if x.ndim != 4 or kc.ndim != 4:
        raise ValueError(f"expected [B, Tq, {heads_name}, D] and kc [B, N_c, K, D]; got {x.shape}, {kc.shape}")
    if x.shape[0] != kc.shape[0] or x.shape[-1] != kc.shape[-1]:
        raise ValueError(f"batch or head dim mismatch: {x.shape} vs kc {kc.shape}")
    if q_positions.shape != x.shape[:2]:
        raise ValueError(f"q_positions must be [B, Tq] = {x.shape[:2]}, got {q_positions.shape}")
    if not jnp.issubdtype(q_positions.dtype, jnp.integer):
        raise TypeError(f"q_positions must be integer, got {q_positions.dtype}")


def _map_query_chunks(fn, q_chunk: int, *arrays):
    """Apply fn to query chunks of arrays [B, Tq, ...] and concatenate the outputs along the
    Tq axis of their [B, K, Tq, ...] layout."""
    tq = arrays[0].shape[1]
    c = max(1, min(q_chunk, tq))
    n = -(-tq // c)
    pad = n * c - tq

    def split(a, fill):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(a.shape[0], n, c, *a.shape[2:]), 1, 0)

    # padded queries get position -1: no candidate blocks, rows of -1, sliced away below
    xs = tuple(split(a, -1 if jnp.issubdtype(a.dtype, jnp.integer) else 0) for a in arrays)
    out = jax.lax.map(lambda args: fn(*args), xs)  # [n, B, K, c, ...]
    out = jnp.moveaxis(out, 0, 2)  # [B, K, n, c, ...]
    out = out.reshape(*out.shape[:2], n * c, *out.shape[4:])
    return out[:, :, :tq]


SelectImpl = Literal["xla", "mosaic_gpu", "mosaic_gpu_interpret"]
MOSAIC_MAX_BLOCKS = 2048  # the kernels' top-k row (128K tokens of 64-token blocks)


def _select_impl(implementation, x, nb: int, exact: bool = True) -> str:
    if implementation is not None:
        if implementation not in ("xla", "mosaic_gpu", "mosaic_gpu_interpret"):
            raise ValueError(f"unknown selection implementation {implementation!r}")
        return implementation
    ok = (exact and x.shape[1] > 1 and x.dtype in (jnp.bfloat16, jnp.float16) and x.shape[-1] == 128
          and nb <= MOSAIC_MAX_BLOCKS and hopper_gpu())
    return "mosaic_gpu" if ok else "xla"


def _interpret(implementation):
    if implementation != "mosaic_gpu_interpret":
        return None
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams()


def select_blocks_infllmv2(q, kc, q_positions, sparse: SparseConfig, *, kc_coarse=None,
                           n_blocks: int | None = None, q_chunk: int = 128,
                           implementation: SelectImpl | None = None,
                           topk_implementation: SelectImpl = "xla") -> jax.Array:
    """InfLLM-V2 selection from the true queries. q [B, Tq, H, D], kc [B, N_c, K, D] ->
    int32 [B, K, Tq, sparse.topk]. Exact LSE unless `kc_coarse` is given (see
    `infllmv2_chunk_scores`); `sparse.exact_lse=False` without kc_coarse is an error.
    implementation: see the module docstring (the kernels take exact LSE only).
    topk_implementation: the XLA path's top-k (`finalize_topk`)."""
    _check(q, kc, q_positions, "H")
    if not sparse.exact_lse and kc_coarse is None:
        raise ValueError("sparse.exact_lse=False needs kc_coarse (keys compressed with "
                         "coarse_lse_kernel / coarse_lse_stride)")
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)
    impl = _select_impl(implementation, q, nb, exact=sparse.exact_lse)
    if impl != "xla":
        from sparda_jax.kernels.infllmv2_select import infllmv2_select

        return infllmv2_select(q, kc.astype(q.dtype), q_positions, sparse, n_blocks=nb, interpret=_interpret(impl))

    def one(qc, pc):
        s = infllmv2_chunk_scores(qc, kc, pc, sparse, kc_coarse if not sparse.exact_lse else None)
        return finalize_topk(pool_to_blocks(s, nb, sparse), pc, sparse.topk, sparse,
                             topk_implementation=topk_implementation)

    return _map_query_chunks(one, q_chunk, q, q_positions)


def select_blocks_forecast(f, kc, q_positions, sparse: SparseConfig, *, n_blocks: int | None = None,
                           q_chunk: int = 512, implementation: SelectImpl | None = None,
                           topk_implementation: SelectImpl = "xla") -> jax.Array:
    """SparDA selection from the Forecast. f [B, Tq, K, D] -> int32 [B, K, Tq, sparse.topk].
    implementation: see the module docstring. topk_implementation: the XLA path's top-k
    (`finalize_topk`)."""
    _check(f, kc, q_positions, "K")
    if f.shape[2] != kc.shape[2]:
        raise ValueError(f"the Forecast has one head per KV head: f {f.shape} vs kc {kc.shape}")
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)
    impl = _select_impl(implementation, f, nb)
    if impl != "xla":
        from sparda_jax.kernels.forecast_select import forecast_select

        return forecast_select(f, kc.astype(f.dtype), q_positions, sparse, n_blocks=nb, interpret=_interpret(impl))

    def one(fc, pc):
        s = forecast_chunk_scores(fc, kc, pc, sparse)
        return finalize_topk(pool_to_blocks(s, nb, sparse), pc, sparse.topk, sparse,
                             topk_implementation=topk_implementation)

    return _map_query_chunks(one, q_chunk, f, q_positions)


def compress_cis(cis, sparse: SparseConfig) -> jax.Array:
    """NOSA: per-token cis [B, T, K] -> mean-pooled like the keys, [B, N_c, K] float32."""
    return compress_keys(cis.astype(jnp.float32)[..., None], sparse.kernel_size, sparse.kernel_stride)[..., 0]


def nosa_refine(qk_ids, cis_c, q_positions, sparse: SparseConfig, *, n_blocks: int,
                q_chunk: int = 128) -> jax.Array:
    """NOSA's query-agnostic stage: the stage-1 blocks `qk_ids` [B, K, Tq, n1] get +inf in the
    block-pooled compressed cis scores `cis_c` [B, N_c, K] (see `compress_cis`, visibility as
    for keys), and the final set is their top `sparse.topk`. -> int32 [B, K, Tq, topk]."""
    cis_t = jnp.transpose(cis_c.astype(jnp.float32), (0, 2, 1))  # [B, K, N_c]
    qk_t = jnp.moveaxis(qk_ids, 2, 1)  # [B, Tq, K, n1] so it chunks along Tq

    def one(idc, pc):
        idc = jnp.moveaxis(idc, 1, 2)  # [B, K, tq, n1]
        vis = chunk_visible(jnp.arange(cis_t.shape[-1]), pc, sparse.kernel_size, sparse.kernel_stride)
        cb = pool_to_blocks(jnp.where(vis[:, None], cis_t[:, :, None, :], -INF), n_blocks, sparse)
        chosen = jnp.any(idc[..., None] == jnp.arange(n_blocks).reshape(1, 1, 1, 1, n_blocks), axis=-2)
        return finalize_topk(jnp.where(chosen, INF, cb), pc, sparse.topk, sparse, force=False)

    return _map_query_chunks(one, q_chunk, qk_t, q_positions)


def select_blocks_nosa(q, kc, cis_c, q_positions, sparse: SparseConfig, *, n_blocks: int | None = None,
                       q_chunk: int = 128) -> jax.Array:
    """NOSA's two stages. Query-aware: the InfLLM-V2 selection with budget
    `sparse.nosa_qk_topk` (forced blocks included); query-agnostic: `nosa_refine`.
    -> int32 [B, K, Tq, sparse.topk]."""
    _check(q, kc, q_positions, "H")
    if sparse.nosa_qk_topk is None:
        raise ValueError("select_blocks_nosa needs sparse.nosa_qk_topk")
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)
    stage1 = dataclasses.replace(sparse, topk=sparse.nosa_qk_topk)
    qk_ids = select_blocks_infllmv2(q, kc, q_positions, stage1, n_blocks=nb, q_chunk=q_chunk)
    return nosa_refine(qk_ids, cis_c, q_positions, sparse, n_blocks=nb, q_chunk=q_chunk)


def infinigen_chunk_scores(qp, pk, q_positions, sparse: SparseConfig, n_blocks: int, head_dim: int) -> jax.Array:
    """InfiniGen, block-adapted. qp [B, tq, H, r] partial (skewed) queries, pk [B, S, K, r]
    partial keys -> block scores [B, K, tq, n_blocks]: per head a softmax over the visible
    tokens (j <= p), summed over the group, max-pooled over each block's tokens."""
    b, tq, h, r = qp.shape
    s, kh = pk.shape[1], pk.shape[2]
    g = h // kh
    logits = jnp.einsum("BTKGR,BSKR->BKGTS", qp.astype(jnp.float32).reshape(b, tq, kh, g, r),
                        pk.astype(jnp.float32)) / math.sqrt(head_dim)
    vis = (jnp.arange(s).reshape(1, 1, s) <= q_positions[:, :, None])[:, None, None]  # [B,1,1,tq,S]
    masked = jnp.where(vis, logits, NEG_INF)
    p = jnp.exp(masked - jnp.max(masked, axis=-1, keepdims=True)) * vis
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    tok = jnp.where(vis[:, 0], jnp.sum(p, axis=2), -INF)  # [B, K, tq, S]
    pad = n_blocks * sparse.block_size - s
    tok = jnp.pad(tok, [(0, 0)] * 3 + [(0, max(pad, 0))], constant_values=-INF)[..., : n_blocks * sparse.block_size]
    return jnp.max(tok.reshape(b, kh, tq, n_blocks, sparse.block_size), axis=-1)


def select_blocks_infinigen(qp, pk, q_positions, sparse: SparseConfig, *, head_dim: int,
                            n_blocks: int | None = None, q_chunk: int = 64) -> jax.Array:
    """Top-k blocks from InfiniGen's speculated token scores (see `infinigen_chunk_scores`)."""
    nb = n_blocks or -(-pk.shape[1] // sparse.block_size)

    def one(qc, pc):
        return finalize_topk(infinigen_chunk_scores(qc, pk, pc, sparse, nb, head_dim), pc, sparse.topk, sparse)

    return _map_query_chunks(one, q_chunk, qp, q_positions)
