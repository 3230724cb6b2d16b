"""The SparDA selector as Pallas Mosaic GPU kernels (Hopper): Forecast block scores, then a
top-k without sort. The reference is `reference.select_blocks_forecast_reference`.

1. `block_scores`: per tile of 64 tokens x 64 blocks, the Forecast logits f.kc^T against the
   compressed keys and the max-pool onto 64-token blocks, without cross-lane shuffles: kc is
   re-laid in XLA into P = r + left "phase planes" (`phase_kc`: plane o, row kb = chunk r*kb+o),
   so the pool is an elementwise max over P wgmma outputs. Invisible chunks are -inf; the
   candidate / forced rules of `reference.finalize_topk` are applied in the kernel.
2. `select_topk` (`topk_select_rows`): many rows per CTA (8 at 2048 blocks, more for shorter
   rows, fewer where a short prompt has few rows). Scores map to monotone int32 keys; a 32-step
   bisection finds the k-th key, a bisection over ids breaks ties towards lower ids (lax.top_k's
   order), and k masked-min reductions emit the ids in ascending order, -1 padded; every
   reduction stays inside one warp.

`forecast_select` chains them with the layout of the reference selector.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic.gpu.fragmented_array import Tiling

from sparda_jax.config import SparseConfig
from sparda_jax.ops._dispatch import lowered_once

__all__ = ["phase_kc", "with_forced", "block_scores", "topk_select_rows", "rows_per_cta", "MIN_CTAS", "select_topk",
           "topk_reference", "forecast_select", "MAX_BLOCKS"]

MAX_BLOCKS = 2048  # one top-k row is 8 x 256 scores (TMA boxes hold <= 256 per dimension)

MMA_T = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))



def phase_kc(kc, nbp, *, block_size=64, kernel_size=32, kernel_stride=16):
    """XLA side. kc [B,Nc,K,D] -> kcp [B,K,P,nbp,D]: phase o (o = -left..r-1) row kb = chunk r*kb+o
    (zeros where absent). Block kb pools chunks r*kb-left .. r*kb+r-1 (MiniCPM: 4kb-1 .. 4kb+3),
    so pooling becomes an elementwise max over P matmul outputs -- no cross-lane shuffles."""
    B, Nc, K, D = kc.shape
    r, left = block_size // kernel_stride, (kernel_size - 1) // kernel_stride
    offs = tuple(range(-left, r))
    kb = jnp.arange(nbp)
    planes = []
    for o in offs:
        c = r * kb + o
        g = jnp.take(kc, jnp.clip(c, 0, Nc - 1), axis=1)
        planes.append(jnp.where(((c >= 0) & (c < Nc))[None, :, None, None], g, 0))
    return jnp.stack(planes, 0).transpose(1, 3, 0, 2, 4), offs


def with_forced(best, blk, qblk, init_blocks, local_blocks):
    """A tile's block scores as stored: +inf for the forced blocks (the first init_blocks and the
    local window before each query's own block), -inf for the future ones, else best."""
    cand = blk <= qblk
    forced = cand & ((blk < init_blocks) | (blk >= qblk - local_blocks))
    return jnp.where(forced, jnp.inf, jnp.where(cand, best, -jnp.inf))


def block_scores(f_r, kcp, pos, *, offs, block_size=64, kernel_size=32, kernel_stride=16,
                                  init_blocks=1, local_blocks=32, interpret=None):
    """f_r [B,K,T,D] bf16 (one Forecast head per KV group; T % 64 == 0), kcp from phase_kc,
    pos [B,T] int32 (-1 = padding) -> [B,K,T,NBp] f32 block scores: -inf = not a candidate
    (future block / no visible chunk), +inf = forced (init + local window + own block)."""
    B, K, T, D = f_r.shape
    P, NBp = kcp.shape[2], kcp.shape[3]
    r = block_size // kernel_stride
    scale = 1.0 / math.sqrt(D)
    L = plgpu.Layout.WGMMA

    def forecast_block_scores(f_ref, kc_ref, pos_ref, o_ref, f_smem, pos_smem, out_smem, bar):
        b, h = lax.axis_index("b"), lax.axis_index("h")
        t0 = lax.axis_index("t") * 64
        plgpu.copy_gmem_to_smem(f_ref.at[b, h, pl.ds(t0, 64)], f_smem, bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, pl.ds(t0, 64)], pos_smem, bar)
        plgpu.barrier_wait(bar)                                   # barrier with num_arrivals=2
        p_row = plgpu.load(pos_smem, layout=L.reduce(1))          # (64,) one position per row
        p2 = lax.broadcast_in_dim(p_row, (64, 64), [0])
        qblk = jnp.where(p2 >= 0, p2 // block_size, -1)

        def step(idx, *kc_smems):
            (j,) = idx
            slot = lax.rem(j, 2)
            blk = j * 64 + plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=L)
            best = None
            for pi, o in enumerate(offs):
                def mm(acc_ref, pi=pi):
                    plgpu.wgmma(acc_ref, f_smem, kc_smems[pi].T)
                    return acc_ref[...]
                lg = pl.run_scoped(mm, plgpu.ACC((64, 64), jnp.float32)) * scale
                c = r * blk + o
                vis = (c >= 0) & (c * kernel_stride + (kernel_size - 1) <= p2)
                lg = jnp.where(vis, lg, -jnp.inf)
                best = lg if best is None else jnp.maximum(best, lg)
            s = with_forced(best, blk, qblk, init_blocks, local_blocks)
            # manual double-buffered output (emit_pipeline out_specs use predicated stores,
            # which interpret mode rejects)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)         # the store from step j-2 has read its slot
            out_smem.at[slot][...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[slot], o_ref.at[b, h, pl.ds(t0, 64), pl.ds(j * 64, 64)])

        plgpu.emit_pipeline(
                step, grid=(NBp // 64,),
                in_specs=[plgpu.BlockSpec((64, D), lambda j: (j, 0), transforms=MMA_T)] * P,  # one 2-D TMA per phase
                max_concurrent_steps=2,
        )(*[kc_ref.at[b, h, p] for p in range(P)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
            forecast_block_scores, out_type=jax.ShapeDtypeStruct((B, K, T, NBp), jnp.float32),
            grid=(B, K, T // 64), grid_names=("b", "h", "t"),
            scratch_types=(plgpu.SMEM((64, D), f_r.dtype, transforms=MMA_T),
                                          plgpu.SMEM((64,), jnp.int32),
                                          plgpu.SMEM((2, 64, 64), jnp.float32),
                                          plgpu.Barrier(num_arrivals=2)),
            interpret=interpret)(f_r, kcp, pos)



INT_MIN = -2**31
KEY_NEG_INF = int(np.array([-np.inf], np.float32).view(np.int32)[0] ^ 0x7FFFFFFF)

def f32_key(x):                    # monotone f32 -> int32 (NaN not handled)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)

def floor_avg(a, b):               # (a + b) // 2 without int32 overflow
    return (a >> 1) + (b >> 1) + (a & b & 1)

def _rows_layout(rt, nbp):
    """Register layout of an (rt, nbp) tile: warp w holds rows w*rt/4 .. (w+1)*rt/4 - 1 whole,
    its 32 lanes split the columns in pairs. A row never spans warps, so axis-1 reductions are
    in-thread adds plus 5 lane shuffles: no SMEM round trip, no warpgroup barrier."""
    return plgpu.Layout.TILED(Tiling(((rt, 64), (rt // 4, 64), (2,))), warp_dims=(-5,), lane_dims=(-2,),
                              vector_dim=-1)


CTA_SCORES = 16384  # scores one CTA (one warpgroup) holds in registers: 128 per thread
ROWS_PER_CTA = (8, 16, 32, 64, 128, 256)  # the row counts the lowering accepts
MIN_CTAS = 512  # ~4 per SM of an H100/H200: fewer left the top-k latency-bound (docs/decisions.md)


def rows_per_cta(nbp, n_rows=None):
    """Rows per CTA of `topk_select_rows`: the largest of ROWS_PER_CTA with rows x nbp <=
    CTA_SCORES; the lowering rejects other row counts (48: "Tiling does not apply"; 4: "not
    canonical"). Given n_rows, halved (down to 8) while the grid would have fewer than MIN_CTAS
    CTAs: a short prompt's few rows then spread over every SM."""
    rt = max(r for r in ROWS_PER_CTA if r == ROWS_PER_CTA[0] or r * nbp <= CTA_SCORES)
    while n_rows is not None and rt > 8 and n_rows < MIN_CTAS * rt:
        rt //= 2
    return rt


def topk_select_rows(scores, k, *, rows=None, interpret=None):
    """The top-k of many rows per CTA. scores [R, NBp] f32 (NBp % 64 == 0,
    NBp <= 2048; R % rows == 0; -inf: not a candidate, +inf: forced) ->
    [R, k] int32 ids, ascending, ties to the lower id, -1 padded (== lax.top_k + sort).

    One CTA (one warpgroup) holds RT = rows (default `rows_per_cta(NBp, R)`) whole rows in
    registers, 128 scores per thread at most, so the grid has R / RT CTAs and rows are not padded
    to 2048. Value bisection, id bisection for ties, masked-min compaction; every
    step works on all RT rows at once and each reduction is row-wise inside one warp
    (see `_rows_layout`). Per row: 32 + ceil(log2 NBp) + 1 + k row reductions, so the kernel is
    instruction bound; it reads NBp*4 and writes k*4 bytes a row.
    """
    R, nbp = scores.shape
    if nbp % 64 or nbp > MAX_BLOCKS:
        raise ValueError(f"rows of {nbp} scores: need a multiple of 64, at most {MAX_BLOCKS}")
    rt = rows_per_cta(nbp, R) if rows is None else rows
    if rt not in ROWS_PER_CTA or rt * nbp > CTA_SCORES:
        raise ValueError(f"rows per CTA {rt}: need one of {ROWS_PER_CTA} with rows x {nbp} scores <= {CTA_SCORES}")
    if R % rt:
        raise ValueError(f"{R} rows: need a multiple of {rt} rows per CTA")
    lay = _rows_layout(rt, nbp)
    n_id_steps = max(1, math.ceil(math.log2(nbp + 1)))

    def topk_rows(s_ref, o_ref, s_smem, o_smem, bar):
        i = lax.axis_index("r")
        plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(i * rt, rt)], s_smem, bar)  # contiguous: one bulk copy
        plgpu.barrier_wait(bar)
        key = f32_key(plgpu.load(s_smem, layout=lay))
        ids = plgpu.broadcasted_iota(jnp.int32, (rt, nbp), 1, layout=lay)
        count = lambda m: jnp.sum(m.astype(jnp.int32), axis=1)          # (rt,) row counts
        row = lambda v: lax.broadcast_in_dim(v, (rt, nbp), [0])
        full = lambda x: jnp.full((rt,), x, jnp.int32)

        def bis_val(_, c):
            lo, hi = c
            mid = floor_avg(lo, hi)
            ok = count(key >= row(mid)) >= k
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        T, _ = lax.fori_loop(0, 32, bis_val, (full(INT_MIN), full(0x7F800001)))
        T2 = row(T)
        tie = key == T2
        need = k - count(key > T2)

        def bis_id(_, c):
            lo, hi = c
            mid = floor_avg(lo, hi)
            ok = count(tie & (ids <= row(mid))) >= need
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
        _, I = lax.fori_loop(0, n_id_steps, bis_id, (full(-1), full(nbp - 1)))
        sel = ((key > T2) | (tie & (ids <= row(I)))) & (key != KEY_NEG_INF)
        BIG = jnp.int32(2**31 - 1)
        vals = jnp.where(sel, ids, BIG)

        def emit(j, prev):
            nxt = jnp.min(jnp.where(vals > row(prev), vals, BIG), axis=1)
            o_smem.at[j][...] = jnp.where(nxt == BIG, -1, nxt)
            return nxt
        lax.fori_loop(0, k, emit, full(-1))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[i])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
            topk_rows, out_type=jax.ShapeDtypeStruct((R // rt, k, rt), jnp.int32),
            grid=(R // rt,), grid_names=("r",),
            scratch_types=(plgpu.SMEM((rt, nbp), jnp.float32), plgpu.SMEM((k, rt), jnp.int32), plgpu.Barrier()),
            interpret=interpret)(scores)
    return out.transpose(0, 2, 1).reshape(R, k)   # [R/RT, k, RT]: slot-major in SMEM, one bulk store


@lowered_once("k", "interpret")
def select_topk(scores, k, *, interpret=None):
    """scores [R, NB] f32 (-inf: not a candidate, +inf: forced) -> [R, k] int32 ids ascending,
    ties to the lower id, -1 padded (`topk_select_rows` on rows padded to its tile)."""
    R, nb = scores.shape
    if nb > MAX_BLOCKS:
        raise ValueError(f"{nb} blocks exceed the kernel's row of {MAX_BLOCKS} (context > 128K)")
    nbp = -(-max(nb, k) // 64) * 64     # >= k keeps the bisection's invariant simple
    rt = rows_per_cta(nbp, R)
    rp = -(-R // rt) * rt
    rows = jnp.pad(scores, ((0, rp - R), (0, nbp - nb)), constant_values=-jnp.inf)
    return topk_select_rows(rows, k, rows=rt, interpret=interpret)[:R]


def topk_reference(scores, k):
    """The tail of `reference.finalize_topk` on rows [R, NB]: same contract as
    `select_topk`."""
    vals, idx = lax.top_k(scores, k) if scores.shape[-1] >= k else lax.top_k(
        jnp.pad(scores, ((0, 0), (0, k - scores.shape[-1])), constant_values=-jnp.inf), k)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(vals == -jnp.inf, big, idx.astype(jnp.int32)), axis=-1)
    return jnp.where(idx == big, -1, idx)


@lowered_once("sparse", "n_blocks", "interpret")
def forecast_select(f, kc, q_positions, sparse: SparseConfig, *, n_blocks: int, interpret=None):
    """Same contract as `reference.select_blocks_forecast_reference`: f [B, Tq, K, D]
    (bf16/f16), kc [B, N_c, K, D], q_positions [B, Tq] -> int32 [B, K, Tq, topk]."""
    b, tq, kh, d = f.shape
    if f.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the Mosaic GPU selector takes bf16/f16 Forecasts, got {f.dtype}")
    if d % 64:
        raise ValueError(f"head dim ({d}) must be a multiple of 64")
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks exceed the kernel's row of {MAX_BLOCKS} (context > 128K)")
    tp = -(-tq // 64) * 64
    nbp = -(-n_blocks // 64) * 64
    f_r = jnp.pad(f, ((0, 0), (0, tp - tq), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - tq)), constant_values=-1)
    kcp, offs = phase_kc(kc.astype(f.dtype), nbp, block_size=sparse.block_size, kernel_size=sparse.kernel_size,
                         kernel_stride=sparse.kernel_stride)
    scores = block_scores(f_r, kcp, pos, offs=offs, block_size=sparse.block_size, kernel_size=sparse.kernel_size,
                          kernel_stride=sparse.kernel_stride, init_blocks=sparse.init_blocks,
                          local_blocks=sparse.local_blocks, interpret=interpret)[:, :, :tq, :n_blocks]
    ids = select_topk(scores.reshape(b * kh * tq, n_blocks), sparse.topk, interpret=interpret)
    return ids.reshape(b, kh, tq, sparse.topk)
