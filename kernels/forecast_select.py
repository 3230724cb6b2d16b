"""The SparDA selector as Pallas Mosaic GPU kernels (Hopper): Forecast block scores, then a
top-k without sort.

1. `block_scores`: per tile of 64 tokens x 64 blocks, the Forecast logits f.kc^T against the
   compressed keys and the max-pool onto 64-token blocks, without cross-lane shuffles: kc is
   re-laid in XLA into P = r + left "phase planes" (`phase_kc`: plane o, row kb = chunk r*kb+o),
   so the pool is an elementwise max over P wgmma outputs. Invisible chunks are -inf; the
   candidate / forced rules of `sparda_jax.select.finalize_topk` are applied in the kernel.
2. `topk_select`: one row (<= 2048 block scores, viewed as 8 x 256) per CTA. Scores map to
   monotone int32 keys; a 32-step bisection finds the k-th key, a 12-step bisection over ids
   breaks ties towards lower ids (lax.top_k's order), and k masked-min reductions emit the ids
   in ascending order, -1 padded.

`forecast_select` chains them with the layout of `sparda_jax.select.select_blocks_forecast`,
which is the reference. Drafted and checked in interpret mode and by the CPU lowering check
(docs/mosaic-gpu-notes.md section 4); not yet run on hardware.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparda_jax.config import SparseConfig

__all__ = ["phase_kc", "block_scores", "topk_select", "forecast_select", "MAX_BLOCKS"]

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

    def body(f_ref, kc_ref, pos_ref, o_ref, f_smem, pos_smem, out_smem, bar):
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
            cand = blk <= qblk
            forced = cand & ((blk < init_blocks) | (blk >= qblk - local_blocks))
            s = jnp.where(forced, jnp.inf, jnp.where(cand, best, -jnp.inf))
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
            body, out_type=jax.ShapeDtypeStruct((B, K, T, NBp), jnp.float32),
            grid=(B, K, T // 64), grid_names=("b", "h", "t"),
            scratch_types=(plgpu.SMEM((64, D), f_r.dtype, transforms=MMA_T),
                                          plgpu.SMEM((64,), jnp.int32),
                                          plgpu.SMEM((2, 64, 64), jnp.float32),
                                          plgpu.Barrier(num_arrivals=2)),
            interpret=interpret)(f_r, kcp, pos)



R8, C256 = 8, 256                  # a 2048-score row viewed as (8, 256): TMA boxes are <= 256 per dim
INT_MIN = -2**31
KEY_NEG_INF = int(np.array([-np.inf], np.float32).view(np.int32)[0] ^ 0x7FFFFFFF)

def f32_key(x):                    # monotone f32 -> int32 (NaN not handled)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)

def floor_avg(a, b):               # (a + b) // 2 without int32 overflow
    return (a >> 1) + (b >> 1) + (a & b & 1)

def topk_select(scores, k, *, interpret=None):
    """scores [R,8,256] f32 (-inf: not a candidate, +inf: forced) -> [R,k] int32 ids, ascending,
    ties to the lower id, -1 where fewer than k candidates  (== lax.top_k + sort, finalize_topk)."""
    R = scores.shape[0]
    def body(s_ref, o_ref, s_smem, o_smem, bar):
        r = lax.axis_index("r")
        plgpu.copy_gmem_to_smem(s_ref.at[r], s_smem, bar)
        plgpu.barrier_wait(bar)
        key = f32_key(s_smem[...])                                        # (8,256) int32 in registers
        ids = (lax.broadcasted_iota(jnp.int32, (R8, C256), 0) * C256
                      + lax.broadcasted_iota(jnp.int32, (R8, C256), 1))
        count = lambda m: jnp.sum(m.astype(jnp.int32))                    # full reduction -> scalar
        # 1) T = max{t : #(key >= t) >= k}; 32 halvings cover the int32 range
        def bis_val(_, c):
            lo, hi = c
            mid = floor_avg(lo, hi)
            ok = count(key >= mid) >= k
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
        T, _ = lax.fori_loop(0, 32, bis_val, (jnp.int32(INT_MIN), jnp.int32(0x7F800001)))
        need = k - count(key > T)                                         # ties still to take (>= 1)
        # 2) I = min{i : #(key == T and id <= i) >= need}  -> ties go to the lowest ids
        def bis_id(_, c):
            lo, hi = c
            mid = floor_avg(lo, hi)
            ok = count((key == T) & (ids <= mid)) >= need
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
        _, I = lax.fori_loop(0, 12, bis_id, (jnp.int32(-1), jnp.int32(R8 * C256 - 1)))
        sel = ((key > T) | ((key == T) & (ids <= I))) & (key != KEY_NEG_INF)
        # 3) ascending compaction: k masked-min reductions, one scalar SMEM store each
        BIG = jnp.int32(2**31 - 1)
        def emit(j, prev):
            nxt = jnp.min(jnp.where(sel & (ids > prev), ids, BIG))
            o_smem[j] = jnp.where(nxt == BIG, -1, nxt)
            return nxt
        lax.fori_loop(0, k, emit, jnp.int32(-1))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[r])
        plgpu.wait_smem_to_gmem(0)
    return plgpu.kernel(
            body, out_type=jax.ShapeDtypeStruct((R, k), jnp.int32),
            grid=(R,), grid_names=("r",),
            scratch_types=(plgpu.SMEM((R8, C256), jnp.float32), plgpu.SMEM((k,), jnp.int32), plgpu.Barrier()),
            interpret=interpret)(scores)


def forecast_select(f, kc, q_positions, sparse: SparseConfig, *, n_blocks: int, interpret=None):
    """Same contract as `sparda_jax.select.select_blocks_forecast` (no NOSA): f [B, Tq, K, D]
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
    rows = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, MAX_BLOCKS - n_blocks)), constant_values=-jnp.inf)
    ids = topk_select(rows.reshape(b * kh * tq, R8, C256), sparse.topk, interpret=interpret)
    return ids.reshape(b, kh, tq, sparse.topk)
