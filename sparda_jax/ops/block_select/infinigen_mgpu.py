"""InfiniGen's speculated block selection as Pallas Mosaic GPU kernels (Hopper).

Reference: `reference.select_blocks_infinigen_reference` (same contract and output layout). Per KV group of
G query heads, a query at position p scores each visible token j <= p with
`sum_g exp(qp_g . pk_j / sqrt(head_dim) - lse_g(p))`, lse over the visible tokens; a block takes
the max over its tokens; the forced / causal rules and the top-k follow. The XLA reference
materialises those f32 scores for every (head, query, token); these kernels keep them in registers.

1. `infllmv2_mgpu.head_lse` with one-token chunks (kernel size 1, stride 1) and InfiniGen's
   scale 1/sqrt(head_dim): per query head the LSE over the visible tokens. The partial dims are
   zero-padded to 64 (one 128-byte swizzle row; zeros add nothing to a dot product).
2. `block_scores`: one CTA per (batch, KV head, 64 tokens); per 64-block tile up to the tile's
   last own block, a pipeline over the 64 token offsets o: plane o of the tile holds token
   64 * blk + o of each of its 64 blocks (`token_planes`), so a step is G wgmmas of 64x64x64 and
   a running max over o is each block's max over its tokens. Later tiles are written as -inf.
3. the top-k: `forecast_mgpu.select_topk`.

The wgmma operands are 16-bit: the partial queries' dtype (bf16 or f16), the f32 partial keys
rounded to it; the XLA reference scores in f32, so exact near-ties at the top-k boundary may
differ. Only 64-token blocks (a plane per token of a block); G <= `MAX_GROUP` heads per KV head
(their queries stay in shared memory).
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

from .forecast_mgpu import MAX_BLOCKS, MMA_T, select_topk, with_forced
from .infllmv2_mgpu import head_lse, layout_q, query_tile, store_future, tile_store

__all__ = ["token_planes", "block_scores", "block_scores_reference", "infinigen_select", "PARTIAL_DIM", "MAX_GROUP"]

BS = 64           # tokens per block: one plane per token offset
PARTIAL_DIM = 64  # partial dims are padded to this (the wgmma's K and the 128-byte swizzle, 16-bit)
MAX_GROUP = 16    # G query slabs of 64 x 64 x 2 bytes in shared memory: 128 KiB of Hopper's 227


def token_planes(pk, nbp: int):
    """pk [B, S, K, D] -> [B, K, 64 * nbp, D]: row o * nbp + blk is token 64 * blk + o (zeros past S)."""
    b, s, kh, d = pk.shape
    pk = jnp.pad(pk, ((0, 0), (0, nbp * BS - s), (0, 0), (0, 0)))
    return pk.reshape(b, nbp, BS, kh, d).transpose(0, 3, 2, 1, 4).reshape(b, kh, BS * nbp, d)


def block_scores(q_r, planes, lse, pos, *, n_tokens, scale, init_blocks=1, local_blocks=32, interpret=None):
    """q_r [B, K, Tt, G*64, D] (`layout_q` of the partial queries), planes [B, K, 64 * NBp, D]
    (`token_planes`), lse [B, K, Tt, G, 64] (`head_lse` over the tokens, same scale), pos
    [B, Tt*64] -> [B, K, Tt*64, NBp] f32: per query and block the max over the block's visible
    tokens (j <= p, j < n_tokens) of sum_g exp(scale * q_g . k_j - lse_g); -inf = not a
    candidate, +inf = forced."""
    B, K, Tt, GR, D = q_r.shape
    G = GR // 64
    NBp = planes.shape[2] // BS
    nbt = NBp // 64
    scale = float(scale)
    L = plgpu.Layout.WGMMA

    def infinigen_block_scores(q_ref, pl_ref, lse_ref, pos_ref, o_ref, q_smem, lse_smem, pos_smem, out_smem, bar):
        b, h, t = (lax.axis_index(n) for n in ("b", "h", "t"))
        t0 = t * 64
        for g in range(G):
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, t, pl.ds(g * 64, 64)], q_smem.at[g], bar)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, t], lse_smem, bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, pl.ds(t0, 64)], pos_smem, bar)
        plgpu.barrier_wait(bar)
        p2, qblk, nj = query_tile(pos_smem, BS, nbt)

        store = tile_store(o_ref, out_smem, b, h, t0)

        @pl.loop(0, nj)
        def _(j):
            blk = j * 64 + plgpu.broadcasted_iota(jnp.int32, (64, 64), 1, layout=L)

            def step(idx, k_smem, best):
                (o,) = idx
                s = None
                for g in range(G):
                    lg = pl.run_scoped(lambda acc, g=g: (plgpu.wgmma(acc, q_smem.at[g], k_smem.T), acc[...])[1],
                                       plgpu.ACC((64, 64), jnp.float32)) * scale
                    lse_g = plgpu.load(lse_smem.at[g], layout=L.reduce(1))
                    e = jnp.exp(lg - lax.broadcast_in_dim(lse_g, (64, 64), [0]))
                    s = e if s is None else s + e
                tok = blk * BS + o
                # invisible tokens may hold exp(...) = inf (lse ignores them): masked here
                return jnp.maximum(best, jnp.where((tok <= p2) & (tok < n_tokens), s, -jnp.inf))

            best = plgpu.emit_pipeline(
                    step, grid=(BS,),
                    in_specs=[plgpu.BlockSpec((64, D), lambda o: (o * nbt + j, 0), transforms=MMA_T)],
                    max_concurrent_steps=2,
                    init_carry=plgpu.layout_cast(jnp.full((64, 64), -jnp.inf, jnp.float32), L),
            )(pl_ref.at[b, h])
            store(j, with_forced(best, blk, qblk, init_blocks, local_blocks))

        store_future(store, nj, nbt)

    return plgpu.kernel(
            infinigen_block_scores, out_type=jax.ShapeDtypeStruct((B, K, Tt * 64, NBp), jnp.float32),
            grid=(B, K, Tt), grid_names=("b", "h", "t"),
            scratch_types=(plgpu.SMEM((G, 64, D), q_r.dtype, transforms=MMA_T),
                           plgpu.SMEM((G, 64), jnp.float32), plgpu.SMEM((64,), jnp.int32),
                           plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=G + 2)),
            interpret=interpret)(q_r, planes, lse, pos)


def block_scores_reference(q_r, planes, lse, pos, *, n_tokens, scale, init_blocks=1, local_blocks=32,
                           interpret=None):
    """jnp twin of `block_scores` (same signature; `interpret` ignored)."""
    del interpret
    B, K, Tt, GR, D = q_r.shape
    G = GR // 64
    NBp = planes.shape[2] // BS
    qf = q_r.astype(jnp.float32).reshape(B, K, Tt, G, 64, D)
    kf = planes.astype(jnp.float32).reshape(B, K, BS, NBp, D)
    lg = jnp.einsum("BKTGRD,BKOND->BKTGRON", qf, kf) * float(scale)
    e = jnp.exp(lg - lse[..., None, None]).sum(axis=3)            # [B, K, Tt, 64, O, NBp]
    p2 = pos.reshape(B, 1, Tt, 64, 1, 1)
    tok = jnp.arange(NBp).reshape(1, 1, 1, 1, 1, NBp) * BS + jnp.arange(BS).reshape(1, 1, 1, 1, BS, 1)
    best = jnp.max(jnp.where((tok <= p2) & (tok < n_tokens), e, -jnp.inf), axis=4)
    q2 = pos.reshape(B, 1, Tt, 64, 1)
    qblk = jnp.where(q2 >= 0, q2 // BS, -1)
    blk = jnp.arange(NBp).reshape(1, 1, 1, 1, NBp)
    cand = blk <= qblk
    forced = cand & ((blk < init_blocks) | (blk >= qblk - local_blocks))
    s = jnp.where(forced, jnp.inf, jnp.where(cand, best, -jnp.inf))
    return s.reshape(B, K, Tt * 64, NBp)


@lowered_once("sparse", "head_dim", "n_blocks", "interpret")
def infinigen_select(qp, pk, q_positions, sparse: SparseConfig, *, head_dim: int, n_blocks: int, interpret=None):
    """Same contract as `reference.select_blocks_infinigen_reference`: qp [B, Tq, H, r] partial
    queries in bf16/f16 (the wgmma operands' dtype; pk is rounded to it), pk [B, S, K, r] partial
    keys (r <= 64), q_positions [B, Tq] -> int32 [B, K, Tq, sparse.topk]."""
    b, tq, h, r = qp.shape
    s, kh = pk.shape[1], pk.shape[2]
    if sparse.block_size != BS:
        raise NotImplementedError(f"the Mosaic GPU InfiniGen selector takes {BS}-token blocks, got {sparse.block_size}")
    if qp.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"the Mosaic GPU InfiniGen selector takes bf16/f16 partial queries, got {qp.dtype}")
    if r > PARTIAL_DIM or pk.shape[-1] != r:
        raise ValueError(f"partial dims ({r}, keys {pk.shape[-1]}) must match and be <= {PARTIAL_DIM}")
    if h % kh or pk.shape[0] != b or q_positions.shape != (b, tq):
        raise ValueError(f"shapes: qp {qp.shape}, pk {pk.shape}, q_positions {q_positions.shape}")
    if h // kh > MAX_GROUP:
        raise ValueError(f"{h // kh} query heads per KV head exceed the kernel's {MAX_GROUP}")
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"{n_blocks} blocks exceed the kernel's row of {MAX_BLOCKS} (context > 128K)")
    tp = -(-tq // 64) * 64
    nbp = -(-max(n_blocks, -(-s // BS)) // 64) * 64
    pad_r = ((0, 0), (0, 0), (0, 0), (0, PARTIAL_DIM - r))
    scale = 1.0 / math.sqrt(head_dim)  # InfiniGen's logits: the full head dim's, not the partial one's
    q_r = layout_q(jnp.pad(qp, pad_r), kh, tp)
    k = jnp.pad(pk, pad_r).astype(qp.dtype)
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - tq)), constant_values=-1)
    ncp = max(64, -(-s // 64) * 64)
    kc_r = jnp.pad(k, ((0, 0), (0, ncp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    lse = head_lse(q_r, kc_r, pos, n_chunks=s, kernel_size=1, kernel_stride=1, scale=scale, interpret=interpret)
    scores = block_scores(q_r, token_planes(k, nbp), lse, pos, n_tokens=s, scale=scale,
                          init_blocks=sparse.init_blocks, local_blocks=sparse.local_blocks,
                          interpret=interpret)[:, :, :tq, :n_blocks]
    ids = select_topk(scores.reshape(b * kh * tq, n_blocks), sparse.topk, interpret=interpret)
    return ids.reshape(b, kh, tq, sparse.topk)
