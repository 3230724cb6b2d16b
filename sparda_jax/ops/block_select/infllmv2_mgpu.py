"""The InfLLM-V2 selector as Pallas Mosaic GPU kernels (Hopper), exact-LSE variant.

Reference: `reference.select_blocks_infllmv2_reference` (same contract and output layout).
Per KV group of G query heads, a query at position p scores compressed chunk c with
`S(p, c) = sum_g exp(q_g . kc_c / sqrt(D) - lse_g(p))`, lse over the visible chunks; blocks take
the max over their chunks; forced / causal rules and the top-k follow.

1. `head_lse`: one CTA per (batch, KV head, 64 tokens, head g). wgmma q_g (64, D) . kc^T over
   64-chunk tiles, online max / sum, only over the tiles a query of the tile can see (a traced
   pipeline length, so causal prefill reads about half of kc). Cost: 2*D*64*64 flops per tile,
   H * T * N_c * D * 2 / 2 flops in all (causal), kc read once per CTA from L2.
2. `block_scores`: one CTA per (batch, KV head, 64 tokens); a pipeline over 64-block tiles
   (P = 5 phase planes of kc, `forecast_mgpu.phase_kc`) up to the tile's last own block, and
   inside each step a loop over the G heads (q_g double-buffered through TMA) accumulating
   exp(logit - lse_g) per phase plane; the block score is the elementwise max of the P sums
   (max-pool without shuffles), then -inf for non-candidates and +inf for forced blocks as in
   `finalize_topk`. Tiles past the tile's last block are written as -inf without any matmul.
   Cost: G * P wgmmas of 64x64xD per (64 tokens, 64 blocks) tile, i.e. 5/4 of a dense q.kc^T,
   halved by causality; q re-read G * 16 KiB (D = 128) per step from L2.
   SMEM (D = 128): q 2 x 16 KiB, kc 5 planes x 2 stages x 16 KiB, one 16 KiB output tile.
3. the top-k: `forecast_mgpu.select_topk`.

MiniCPM4's coarse-LSE approximation (`sparse.exact_lse=False`) stays XLA-only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparda_jax.config import SparseConfig
from sparda_jax.ops._dispatch import lowered_once
from sparda_jax.compress import chunk_visible

from .forecast_mgpu import MAX_BLOCKS, MMA_T, phase_kc, select_topk, with_forced

__all__ = ["layout_q", "head_lse", "head_lse_reference", "query_tile", "tile_store", "store_future", "block_scores",
           "block_scores_reference", "infllmv2_select"]

NEG = -1e30  # finite: an online max that starts at -inf gives exp(-inf + inf) = NaN


def layout_q(q, kv_heads, tp):
    """q [B, Tq, H, D] -> [B, K, Tp/64, G*64, D]: each 64-token tile holds its G heads' (64, D)
    slabs contiguously, so one CTA streams them with 2-D TMA copies (padded tokens are zeros)."""
    b, tq, h, d = q.shape
    g = h // kv_heads
    q = jnp.pad(q, ((0, 0), (0, tp - tq), (0, 0), (0, 0)))
    q = q.reshape(b, tp // 64, 64, kv_heads, g, d).transpose(0, 3, 1, 4, 2, 5)
    return q.reshape(b, kv_heads, tp // 64, g * 64, d)


def _vis(c, p2, n_chunks, kernel_size, kernel_stride):
    return (c >= 0) & (c < n_chunks) & (c * kernel_stride + (kernel_size - 1) <= p2)


def head_lse(q_r, kc_r, pos, *, n_chunks, kernel_size=32, kernel_stride=16, scale=None, interpret=None):
    """q_r [B, K, Tt, G*64, D] (`layout_q`), kc_r [B, K, Ncp, D] (Ncp % 64 == 0, rows >= n_chunks
    ignored), pos [B, Tt*64] int32 (-1 = padding) -> lse [B, K, Tt, G, 64] f32: per query head the
    log-sum-exp of scale * q.kc (scale None: 1/sqrt(D)) over the chunks visible at its position
    (about NEG where none)."""
    B, K, Tt, GR, D = q_r.shape
    G, Ncp = GR // 64, kc_r.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    L = plgpu.Layout.WGMMA

    def infllmv2_head_lse(q_ref, kc_ref, pos_ref, o_ref, q_smem, pos_smem, lse_smem, bar):
        b, h, t, g = (lax.axis_index(n) for n in ("b", "h", "t", "g"))
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, t, pl.ds(g * 64, 64)], q_smem, bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, pl.ds(t * 64, 64)], pos_smem, bar)
        plgpu.barrier_wait(bar)
        p_row = plgpu.load(pos_smem, layout=L.reduce(1))
        p2 = lax.broadcast_in_dim(p_row, (64, 64), [0])
        # chunk tiles a row of this tile can see; at least one so the pipeline is never empty
        last = jnp.maximum(jnp.max(p_row) - (kernel_size - 1), 0) // kernel_stride
        nt = jnp.clip(last // 64 + 1, 1, Ncp // 64)

        def step(idx, kc_smem, carry):
            (j,) = idx
            m, l = carry
            lg = pl.run_scoped(lambda acc: (plgpu.wgmma(acc, q_smem, kc_smem.T), acc[...])[1],
                               plgpu.ACC((64, 64), jnp.float32)) * scale
            c = j * 64 + plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=L)
            vis = _vis(c, p2, n_chunks, kernel_size, kernel_stride)
            m_new = jnp.maximum(m, jnp.max(jnp.where(vis, lg, NEG), axis=1))
            e = jnp.where(vis, jnp.exp(lg - lax.broadcast_in_dim(m_new, (64, 64), [0])), 0.0)
            return m_new, l * jnp.exp(m - m_new) + jnp.sum(e, axis=1)

        init = (plgpu.layout_cast(jnp.full((64,), NEG, jnp.float32), L.reduce(1)),
                plgpu.layout_cast(jnp.zeros((64,), jnp.float32), L.reduce(1)))
        m, l = plgpu.emit_pipeline(
                step, grid=(nt,), in_specs=[plgpu.BlockSpec((64, D), lambda j: (j, 0), transforms=MMA_T)],
                max_concurrent_steps=2, init_carry=init)(kc_ref.at[b, h])
        lse_smem[...] = m + jnp.log(jnp.maximum(l, 1e-30))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem, o_ref.at[b, h, t, g])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
            infllmv2_head_lse, out_type=jax.ShapeDtypeStruct((B, K, Tt, G, 64), jnp.float32),
            grid=(B, K, Tt, G), grid_names=("b", "h", "t", "g"),
            scratch_types=(plgpu.SMEM((64, D), q_r.dtype, transforms=MMA_T), plgpu.SMEM((64,), jnp.int32),
                           plgpu.SMEM((64,), jnp.float32), plgpu.Barrier(num_arrivals=2)),
            interpret=interpret)(q_r, kc_r, pos)


def head_lse_reference(q_r, kc_r, pos, *, n_chunks, kernel_size=32, kernel_stride=16, scale=None, interpret=None):
    """jnp twin of `head_lse` (same signature; `interpret` ignored)."""
    del interpret
    B, K, Tt, GR, D = q_r.shape
    G = GR // 64
    qf = q_r.astype(jnp.float32).reshape(B, K, Tt, G, 64, D)
    kc = kc_r[:, :, :n_chunks].astype(jnp.float32)
    lg = jnp.einsum("BKTGRD,BKND->BKTGRN", qf, kc) * (1.0 / math.sqrt(D) if scale is None else float(scale))
    vis = chunk_visible(jnp.arange(n_chunks), pos.reshape(B, Tt, 64), kernel_size, kernel_stride)
    vis = vis[:, None, :, None]                                   # [B, 1, Tt, 1, 64, N]
    masked = jnp.where(vis, lg, NEG)
    m = jnp.max(masked, axis=-1, initial=NEG)
    s = jnp.sum(jnp.where(vis, jnp.exp(masked - m[..., None]), 0.0), axis=-1)
    return m + jnp.log(jnp.maximum(s, 1e-30))


def query_tile(pos_smem, block_size, n_tiles):
    """Inside a block-scores kernel, once pos_smem holds the query tile's 64 positions: (p2, qblk,
    nj), the positions and each query's own block broadcast over 64 block columns (-1: padding),
    and the block tiles up to the tile's last own block (1..n_tiles); later ones are all future."""
    p_row = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(1))
    p2 = lax.broadcast_in_dim(p_row, (64, 64), [0])
    qblk = jnp.where(p2 >= 0, p2 // block_size, -1)
    nj = jnp.clip(jnp.maximum(jnp.max(p_row), 0) // block_size // 64 + 1, 1, n_tiles)
    return p2, qblk, nj


def tile_store(o_ref, out_smem, b, h, t0):
    """Inside a block-scores kernel: store(j, s) writes s [64 queries, 64 blocks] f32 (WGMMA
    layout) to o_ref[b, h, t0:t0+64, 64j:64j+64] through out_smem, once the previous store has
    read it out."""
    def store(j, s):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[...] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_ref.at[b, h, pl.ds(t0, 64), pl.ds(j * 64, 64)])
    return store


def store_future(store, nj, nbt):
    """Block tiles nj..nbt-1 hold only future blocks of the query tile: -inf; then every store
    is waited for."""
    @pl.loop(nj, nbt)
    def _(j):
        store(j, plgpu.layout_cast(jnp.full((64, 64), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA))
    plgpu.wait_smem_to_gmem(0)


def block_scores(q_r, kcp, lse, pos, *, offs, n_chunks, block_size=64, kernel_size=32, kernel_stride=16,
                 init_blocks=1, local_blocks=32, interpret=None):
    """q_r [B, K, Tt, G*64, D] (`layout_q`), kcp [B, K, P, NBp, D] (`phase_kc`), lse [B, K, Tt, G, 64]
    (`head_lse`), pos [B, Tt*64] -> [B, K, Tt*64, NBp] f32 block scores: the max over each block's
    chunks of the group score sum_g exp(logit_g - lse_g); -inf = not a candidate, +inf = forced."""
    B, K, Tt, GR, D = q_r.shape
    G = GR // 64
    P, NBp = kcp.shape[2], kcp.shape[3]
    r = block_size // kernel_stride
    scale = 1.0 / math.sqrt(D)
    L = plgpu.Layout.WGMMA

    def infllmv2_block_scores(q_ref, kc_ref, lse_ref, pos_ref, o_ref, q_smem, lse_smem, pos_smem, out_smem, bar, qbar):
        b, h, t = (lax.axis_index(n) for n in ("b", "h", "t"))
        t0 = t * 64
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, t], lse_smem, bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, pl.ds(t0, 64)], pos_smem, bar)
        plgpu.barrier_wait(bar)
        p2, qblk, nj = query_tile(pos_smem, block_size, NBp // 64)

        def q_copy(g, slot):
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, t, pl.ds(g * 64, 64)], q_smem.at[slot], qbar.at[slot])

        store = tile_store(o_ref, out_smem, b, h, t0)

        def step(idx, *kc_smems):
            (j,) = idx
            q_copy(0, 0)

            def head(g, accs):
                slot = lax.rem(g, 2)

                @pl.when(g + 1 < G)
                def _():
                    q_copy(g + 1, 1 - slot)                          # its slot's wgmmas (head g-1) are done
                plgpu.barrier_wait(qbar.at[slot])
                lse_g = plgpu.load(lse_smem.at[g], layout=L.reduce(1))
                lse2 = lax.broadcast_in_dim(lse_g, (64, 64), [0])
                out = []
                for pi in range(P):
                    lg = pl.run_scoped(
                            lambda acc, pi=pi: (plgpu.wgmma(acc, q_smem.at[slot], kc_smems[pi].T), acc[...])[1],
                            plgpu.ACC((64, 64), jnp.float32)) * scale
                    out.append(accs[pi] + jnp.exp(lg - lse2))
                return tuple(out)

            zero = plgpu.layout_cast(jnp.zeros((64, 64), jnp.float32), L)
            accs = lax.fori_loop(0, G, head, (zero,) * P)
            blk = j * 64 + plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=L)
            best = None
            for pi, o in enumerate(offs):
                # invisible chunks may hold exp(...) = inf (lse ignores them): masked here
                v = jnp.where(_vis(r * blk + o, p2, n_chunks, kernel_size, kernel_stride), accs[pi], -jnp.inf)
                best = v if best is None else jnp.maximum(best, v)
            store(j, with_forced(best, blk, qblk, init_blocks, local_blocks))

        plgpu.emit_pipeline(
                step, grid=(nj,),
                in_specs=[plgpu.BlockSpec((64, D), lambda j: (j, 0), transforms=MMA_T)] * P,
                max_concurrent_steps=2,
        )(*[kc_ref.at[b, h, p] for p in range(P)])

        store_future(store, nj, NBp // 64)

    return plgpu.kernel(
            infllmv2_block_scores, out_type=jax.ShapeDtypeStruct((B, K, Tt * 64, NBp), jnp.float32),
            grid=(B, K, Tt), grid_names=("b", "h", "t"),
            scratch_types=(plgpu.SMEM((2, 64, D), q_r.dtype, transforms=MMA_T),
                           plgpu.SMEM((G, 64), jnp.float32), plgpu.SMEM((64,), jnp.int32),
                           plgpu.SMEM((64, 64), jnp.float32),
                           plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_barriers=2)),
            interpret=interpret)(q_r, kcp, lse, pos)


def block_scores_reference(q_r, kcp, lse, pos, *, offs, n_chunks, block_size=64, kernel_size=32,
                           kernel_stride=16, init_blocks=1, local_blocks=32, interpret=None):
    """jnp twin of `block_scores` (same signature; `interpret` ignored)."""
    del interpret
    B, K, Tt, GR, D = q_r.shape
    G = GR // 64
    P, NBp = kcp.shape[2], kcp.shape[3]
    r = block_size // kernel_stride
    qf = q_r.astype(jnp.float32).reshape(B, K, Tt, G, 64, D)
    lg = jnp.einsum("BKTGRD,BKPND->BKTGRPN", qf, kcp.astype(jnp.float32)) / math.sqrt(D)
    e = jnp.exp(lg - lse[..., None, None]).sum(axis=3)   # [B,K,Tt,64,P,NBp]
    p2 = pos.reshape(B, 1, Tt, 64, 1, 1)
    blk = jnp.arange(NBp).reshape(1, 1, 1, 1, 1, NBp)
    c = r * blk + jnp.asarray(offs).reshape(1, 1, 1, 1, P, 1)
    best = jnp.max(jnp.where(_vis(c, p2, n_chunks, kernel_size, kernel_stride), e, -jnp.inf), axis=4)
    q2 = p2[..., 0]
    qblk = jnp.where(q2 >= 0, q2 // block_size, -1)
    blk = blk[..., 0, :]
    cand = blk <= qblk
    forced = cand & ((blk < init_blocks) | (blk >= qblk - local_blocks))
    s = jnp.where(forced, jnp.inf, jnp.where(cand, best, -jnp.inf))
    return s.reshape(B, K, Tt * 64, NBp)


@lowered_once("sparse", "n_blocks", "interpret")
def infllmv2_select(q, kc, q_positions, sparse: SparseConfig, *, n_blocks: int, interpret=None):
    """Same contract as `reference.select_blocks_infllmv2_reference` with exact LSE: q [B, Tq, H, D]
    (bf16/f16), kc [B, N_c, K, D], q_positions [B, Tq] -> int32 [B, K, Tq, sparse.topk]."""
    b, tq, h, d = q.shape
    n, kh = kc.shape[1], kc.shape[2]
    if not sparse.exact_lse:
        raise NotImplementedError("the coarse-LSE approximation (sparse.exact_lse=False) is XLA-only: "
                                  "use implementation='xla' with kc_coarse")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the Mosaic GPU selector takes bf16/f16 queries, got {q.dtype}")
    if d % 64 or kc.shape[-1] != d:
        raise ValueError(f"head dim ({d}, kc {kc.shape[-1]}) must match and be a multiple of 64")
    if h % kh or kc.shape[0] != b or q_positions.shape != (b, tq):
        raise ValueError(f"shapes: q {q.shape}, kc {kc.shape}, q_positions {q_positions.shape}")
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks exceed the kernel's row of {MAX_BLOCKS} (context > 128K)")
    tp = -(-tq // 64) * 64
    nbp = -(-n_blocks // 64) * 64
    ncp = max(64, -(-n // 64) * 64)
    kc = kc.astype(q.dtype)
    q_r = layout_q(q, kh, tp)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - tq)), constant_values=-1)
    kc_r = jnp.pad(kc, ((0, 0), (0, ncp - n), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    geo = dict(kernel_size=sparse.kernel_size, kernel_stride=sparse.kernel_stride)
    lse = head_lse(q_r, kc_r, pos, n_chunks=n, interpret=interpret, **geo)
    kcp, offs = phase_kc(kc, nbp, block_size=sparse.block_size, **geo)
    scores = block_scores(q_r, kcp, lse, pos, offs=offs, n_chunks=n, block_size=sparse.block_size,
                          init_blocks=sparse.init_blocks, local_blocks=sparse.local_blocks,
                          interpret=interpret, **geo)[:, :, :tq, :n_blocks]
    ids = select_topk(scores.reshape(b * kh * tq, n_blocks), sparse.topk, interpret=interpret)
    return ids.reshape(b, kh, tq, sparse.topk)
