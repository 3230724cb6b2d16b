"""Block selection in plain jnp: the reference of every selection backend, and the
selectors that only XLA runs (NOSA's query-agnostic stage, InfiniGen's).

Output layout (all selectors): int32 [B, K, Tq, topk], per (sequence, KV head, query) the
selected 64-token block ids in ascending order, then -1 padding. All G query heads of a GQA
group share their KV head's row.

Pipeline per query at position p (docs/algorithm.md):
  chunk scores [.., N_c]  (-inf where chunk c is not yet complete: c*s + l - 1 > p)
  -> block scores [.., N_b] (max over the chunks whose windows overlap the block; for
     l=32, s=16, B=64 that is chunks 4k-1..4k+3, MiniCPM's max-pool (5, 4, pad 1))
  -> forced blocks (+inf): init blocks and the local window q_blk - local_blocks .. q_blk
  -> future blocks (k > q_blk) and blocks without a visible chunk are never chosen
  -> top `topk` (forced included), ascending, -1 padded.
Ties go to the lower block id (lax.top_k's order).

Queries are processed in chunks (`q_chunk`) so memory is O(q_chunk * N_c), never [T, T].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparda_jax.compress import chunk_visible, compress_keys
from sparda_jax.config import SparseConfig

from ..dense_attention.reference import NEG_INF

__all__ = [
    "n_blocks_for",
    "pool_to_blocks",
    "finalize_topk",
    "infllmv2_chunk_scores",
    "forecast_chunk_scores",
    "select_blocks_infllmv2_reference",
    "select_blocks_forecast_reference",
    "nosa_refine",
    "infinigen_chunk_scores",
    "select_blocks_infinigen_reference",
    "compress_cis",
]

INF = jnp.inf


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
    if left == 0:
        return jnp.max(grouped, axis=-1)
    # the block before's last `left` chunks beside each block's own: one reduction (one kernel)
    prev = jnp.pad(grouped[..., :-1, r - left:], [(0, 0)] * (x.ndim - 1) + [(1, 0), (0, 0)], constant_values=-INF)
    return jnp.max(jnp.concatenate([prev, grouped], axis=-1), axis=-1)


def finalize_topk(block_scores: jax.Array, q_positions: jax.Array, topk: int,
                  sparse: SparseConfig, force: bool = True) -> jax.Array:
    """Block scores [B, K, tq, N_b] -> ids [B, K, tq, topk] (forced, causal, sorted, -1 padded):
    lax.top_k, then a sort of the ids."""
    nb = block_scores.shape[-1]
    q_blk = jnp.where(q_positions >= 0, q_positions // sparse.block_size, -1)[:, None, :, None]
    k = jnp.arange(nb).reshape(1, 1, 1, nb)
    candidate = k <= q_blk
    s = jnp.where(candidate, block_scores, -INF)
    if force:
        forced = candidate & ((k < sparse.init_blocks) | (k >= q_blk - sparse.local_blocks))
        s = jnp.where(forced, INF, s)
    if nb < topk:
        s = jnp.pad(s, [(0, 0)] * 3 + [(0, topk - nb)], constant_values=-INF)
    vals, idx = jax.lax.top_k(s, topk)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.where(vals == -INF, big, idx.astype(jnp.int32))
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == big, -1, idx)


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


def _check_sparse(sparse) -> None:
    if not isinstance(sparse, SparseConfig):
        raise TypeError(f"sparse must be a SparseConfig, got {type(sparse).__name__}")


def _check(x, kc, q_positions, heads_name):
    if x.ndim != 4 or kc.ndim != 4:
        raise ValueError(f"expected [B, Tq, {heads_name}, D] and kc [B, N_c, K, D]; got {x.shape}, {kc.shape}")
    if x.shape[0] != kc.shape[0] or x.shape[-1] != kc.shape[-1]:
        raise ValueError(f"batch or head dim mismatch: {x.shape} vs kc {kc.shape}")
    if heads_name == "H" and x.shape[2] % kc.shape[2]:
        raise ValueError(f"query heads ({x.shape[2]}) must be a multiple of KV heads ({kc.shape[2]}): "
                         f"q {x.shape} vs kc {kc.shape}")
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


def check_infllmv2(q, kc, q_positions, sparse, kc_coarse, n_blocks) -> int:
    """The InfLLM-V2 selectors' input checks (module `_check`, exact LSE or kc_coarse); returns
    the row length n_blocks."""
    _check_sparse(sparse)
    _check(q, kc, q_positions, "H")
    if not sparse.exact_lse and kc_coarse is None:
        raise ValueError("sparse.exact_lse=False needs kc_coarse (keys compressed with "
                         "coarse_lse_kernel / coarse_lse_stride)")
    return n_blocks or n_blocks_for(kc.shape[1], sparse)


def select_blocks_infllmv2_reference(q, kc, q_positions, sparse: SparseConfig, *, kc_coarse=None,
                                     n_blocks: int | None = None, q_chunk: int = 128,
                                     finalize=finalize_topk) -> jax.Array:
    """InfLLM-V2 selection from the true queries, in jnp. q [B, Tq, H, D], kc [B, N_c, K, D] ->
    int32 [B, K, Tq, sparse.topk]. Exact LSE unless `kc_coarse` is given (see
    `infllmv2_chunk_scores`); `sparse.exact_lse=False` without kc_coarse is a ValueError.
    finalize: the last stage, `finalize_topk` or a kernel of its signature."""
    nb = check_infllmv2(q, kc, q_positions, sparse, kc_coarse, n_blocks)

    def one(qc, pc):
        s = infllmv2_chunk_scores(qc, kc, pc, sparse, kc_coarse if not sparse.exact_lse else None)
        return finalize(pool_to_blocks(s, nb, sparse), pc, sparse.topk, sparse)

    return _map_query_chunks(one, q_chunk, q, q_positions)


def select_blocks_forecast_reference(f, kc, q_positions, sparse: SparseConfig, *, n_blocks: int | None = None,
                                     q_chunk: int = 512, finalize=finalize_topk) -> jax.Array:
    """SparDA selection from the Forecast, in jnp. f [B, Tq, K, D] -> int32 [B, K, Tq, sparse.topk].
    finalize: the last stage, as in `select_blocks_infllmv2_reference`."""
    _check_sparse(sparse)
    _check_forecast(f, kc, q_positions)
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)

    def one(fc, pc):
        s = forecast_chunk_scores(fc, kc, pc, sparse)
        return finalize(pool_to_blocks(s, nb, sparse), pc, sparse.topk, sparse)

    return _map_query_chunks(one, q_chunk, f, q_positions)


def _check_forecast(f, kc, q_positions):
    _check(f, kc, q_positions, "K")
    if f.shape[2] != kc.shape[2]:
        raise ValueError(f"the Forecast has one head per KV head: f {f.shape} vs kc {kc.shape}")


def compress_cis(cis, sparse: SparseConfig) -> jax.Array:
    """NOSA: per-token cis [B, T, K] -> mean-pooled like the keys, [B, N_c, K] float32."""
    return compress_keys(cis.astype(jnp.float32)[..., None], sparse.kernel_size, sparse.kernel_stride)[..., 0]


def block_mask(ids, n_blocks: int) -> jax.Array:
    """ids int [..., n] (-1 padded) -> bool [..., n_blocks]: which blocks the ids name."""
    blocks = jnp.arange(n_blocks).reshape((1,) * ids.ndim + (n_blocks,))
    return jnp.any(ids[..., None] == blocks, axis=-2)


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
        chosen = block_mask(idc, n_blocks)
        return finalize_topk(jnp.where(chosen, INF, cb), pc, sparse.topk, sparse, force=False)

    return _map_query_chunks(one, q_chunk, qk_t, q_positions)


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


def select_blocks_infinigen_reference(qp, pk, q_positions, sparse: SparseConfig, *, head_dim: int,
                                      n_blocks: int | None = None, q_chunk: int = 64,
                                      finalize=finalize_topk) -> jax.Array:
    """Top-k blocks from InfiniGen's speculated token scores (see `infinigen_chunk_scores`).
    finalize: the last stage, as in `select_blocks_infllmv2_reference`."""
    nb = n_blocks or -(-pk.shape[1] // sparse.block_size)

    def one(qc, pc):
        return finalize(infinigen_chunk_scores(qc, pk, pc, sparse, nb, head_dim), pc, sparse.topk, sparse)

    return _map_query_chunks(one, q_chunk, qp, q_positions)
