"""The backward of block-sparse prefill attention in Pallas Mosaic GPU (Hopper).

The rows, tiles and union metadata are the forward kernel's (`prefill.py`): q, dO, lse and
delta = rowsum(dO * O) are reordered to rows t*Gp + g of a KV head, a tile is 64 rows. Two
kernels, neither with a race:

- **dq** (grid B x K x tiles): a tile walks the union of its tokens' blocks like the forward,
  recomputes P = exp2(S - lse) from the saved lse, dP = dO V^T, dS = P (dP - delta) and
  accumulates dS K in registers; each tile writes its own rows.
- **dk, dv, dbias** (grid B x K x blocks): a KV block walks the tiles whose union holds it (the
  transposed index, `build_transposed_meta`, built in XLA by one sort), in the transposed
  orientation S^T = K Q^T, and accumulates P^T dO, dS^T Q and the row sums of dS^T; each CTA
  writes its own block, so dk/dv need no atomics.

bf16/f16, head dim a multiple of 64, 64-token blocks; f32 accumulators, P and dS rounded to
q's dtype for the wgmmas (FlashAttention's choice).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparda_jax.ops._dispatch import lowered_once

from .prefill import (BS, INTERPRET, LOG2E, MMA_T, ROWS, PrefillMeta, _check, _pad_tokens, _pv, _row_vectors,
                      build_prefill_meta, fetch_block, padded_group, tile_tokens_for)

__all__ = ["sparse_prefill_attention_backward", "build_transposed_meta", "TransposedMeta"]


class TransposedMeta(NamedTuple):
    """Per KV block, the tiles whose union holds it (the dk/dv kernel's walk).

    tiles   int32 [B, K, NT * U]  tile index of each (tile, block) union entry, sorted by block
                                   then tile (unused tail: 0);
    bits    int32 [B, K, NT * U]  that entry's selection bits (bit i: token i of the tile);
    offsets int32 [B, K, NB + 1]  block j's entries are [offsets[j], offsets[j + 1]).
    """
    tiles: jax.Array
    bits: jax.Array
    offsets: jax.Array


def build_transposed_meta(meta: PrefillMeta, n_blocks: int) -> TransposedMeta:
    """The forward's per-tile union (`build_prefill_meta`, ids < n_blocks) -> per block."""
    b, kh, nt, u = meta.uids.shape
    big = jnp.int32(2**31 - 1)
    tile = lax.broadcasted_iota(jnp.int32, meta.uids.shape, 2)
    key = jnp.where(meta.uids >= 0, meta.uids * nt + tile, big).reshape(b, kh, nt * u)
    key, bits = lax.sort((key, meta.ubits.reshape(b, kh, nt * u)), dimension=2, num_keys=1)
    bounds = jnp.arange(n_blocks + 1, dtype=jnp.int32) * nt
    offsets = jax.vmap(jax.vmap(lambda k: jnp.searchsorted(k, bounds, side="left")))(key).astype(jnp.int32)
    valid = key < big
    return TransposedMeta(jnp.where(valid, key % nt, 0), jnp.where(valid, bits, 0), offsets)


# ------------------------------------------------------------------------------------ kernels

def _mm(a_ref, b_ref):
    """a_ref @ b_ref -> (64, 64) f32 in registers."""
    def fn(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref)
        return acc_ref[...]
    return pl.run_scoped(fn, plgpu.ACC((ROWS, BS), jnp.float32))


def _zeros(d):
    return plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)


def _dq_kernel(q_r, do_r, lse_r, delta_r, k, v, bias_r, meta, pos, *, gp, a_via_smem, acc_in_place, interpret):
    b_, kh, _, d = q_r.shape
    nt = meta.n_union.shape[2]
    tile_tok = ROWS // gp
    dtype = q_r.dtype
    scale = 1.0 / math.sqrt(d)
    scale_log2 = LOG2E * scale
    has_bias = bias_r is not None
    row_l = plgpu.Layout.WGMMA.reduce(1)

    def sparse_attention_dq(*refs):
        if has_bias:
            (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, bias_ref, uid_ref, ubit_ref, nu_ref, pos_ref, dq_ref,
             q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, b_smem, a_smem, q_bar, kv_bar) = refs
        else:
            (q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, uid_ref, ubit_ref, nu_ref, pos_ref, dq_ref,
             q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, a_smem, q_bar, kv_bar) = refs
        b, h, tt = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        nu = nu_ref[b, h, tt]
        rows = pl.ds(tt * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(do_ref.at[b, h, rows], do_smem, q_bar)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem, q_bar)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem, q_bar)

        def fetch(j, slot):
            fetch_block(uid_ref[b, h, tt, j], slot, b, h, k_ref, v_ref, k_smem, v_smem, kv_bar,
                        (bias_ref, b_smem) if has_bias else None)

        @pl.when(nu > 0)
        def _():
            fetch(0, 0)

        tok_tile, rpos = _row_vectors(tt * tile_tok, gp, pos_ref, b)
        plgpu.barrier_wait(q_bar)
        lse = plgpu.load(lse_smem, layout=row_l)
        delta = plgpu.load(delta_smem, layout=row_l)

        def step(j, dq):
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < nu)
            def _():
                fetch(j + 1, 1 - slot)
            plgpu.barrier_wait(kv_bar.at[slot])
            blk, bits = uid_ref[b, h, tt, j], ubit_ref[b, h, tt, j]
            s = _mm(q_smem, k_smem.at[slot].T) * scale_log2
            if has_bias:
                s = s + lax.broadcast_in_dim(plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)),
                                             (ROWS, BS), [1])
            picked = (lax.shift_right_logical(bits, tok_tile) & 1) == 1
            last = jnp.where(picked, rpos - blk * BS, -1)
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BS), 1, layout=plgpu.Layout.WGMMA)
            visible = col <= lax.broadcast_in_dim(last, (ROWS, BS), [0])
            p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(lse, (ROWS, BS), [0])), 0.0)
            dp = _mm(do_smem, v_smem.at[slot].T)
            ds = p * (dp - lax.broadcast_in_dim(delta, (ROWS, BS), [0]))
            return _pv(dq, ds, k_smem.at[slot], a_smem, p_via_smem=a_via_smem, acc_in_place=acc_in_place,
                        dtype=dtype)

        dq = lax.fori_loop(0, nu, step, _zeros(d))
        q_smem[...] = (dq * scale).astype(dtype)           # dq leaves through q's buffer
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    args = (q_r, do_r, lse_r, delta_r, k, v) + ((bias_r,) if has_bias else ()) + (
        meta.uids, meta.ubits, meta.n_union, pos)
    scratch = [plgpu.SMEM((ROWS, d), dtype, transforms=MMA_T), plgpu.SMEM((ROWS, d), dtype, transforms=MMA_T),
               plgpu.SMEM((ROWS,), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32),
               plgpu.SMEM((2, BS, d), dtype, transforms=MMA_T), plgpu.SMEM((2, BS, d), dtype, transforms=MMA_T)]
    if has_bias:
        scratch.append(plgpu.SMEM((2, BS), jnp.float32))
    scratch += [plgpu.SMEM((ROWS, BS) if a_via_smem else (8, BS), dtype, transforms=MMA_T),
                plgpu.Barrier(num_arrivals=4),
                plgpu.Barrier(num_arrivals=3 if has_bias else 2, num_barriers=2)]
    return plgpu.kernel(
        sparse_attention_dq,
        out_type=jax.ShapeDtypeStruct(q_r.shape, dtype),
        grid=(b_, kh, nt), grid_names=("b", "h", "t"),
        scratch_types=tuple(scratch),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*args)


def _dkv_kernel(q_r, do_r, lse_r, delta_r, pos_r, k, v, bias_r, tmeta, *, gp, a_via_smem, acc_in_place, interpret):
    b_, kh, _, d = q_r.shape
    sp = k.shape[1]
    nb = sp // BS
    dtype = q_r.dtype
    scale = 1.0 / math.sqrt(d)
    scale_log2 = LOG2E * scale
    has_bias = bias_r is not None
    col_l = plgpu.Layout.WGMMA.reduce(0)

    def sparse_attention_dkdv(*refs):
        if has_bias:
            (q_ref, do_ref, lse_ref, delta_ref, pos_ref, k_ref, v_ref, bias_ref, tile_ref, bit_ref, off_ref,
             dk_ref, dv_ref, db_ref,
             k_smem, v_smem, b_smem, q_smem, do_smem, lse_smem, delta_smem, pos_smem, a_smem, kv_bar, q_bar) = refs
        else:
            (q_ref, do_ref, lse_ref, delta_ref, pos_ref, k_ref, v_ref, tile_ref, bit_ref, off_ref,
             dk_ref, dv_ref,
             k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pos_smem, a_smem, kv_bar, q_bar) = refs
        b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
        first, n_tiles = off_ref[b, h, j], off_ref[b, h, j + 1] - off_ref[b, h, j]
        keys = pl.ds(pl.multiple_of(j * BS, BS), BS)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem, kv_bar)
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem, kv_bar)
        if has_bias:
            plgpu.copy_gmem_to_smem(bias_ref.at[b, h, keys], b_smem, kv_bar)

        def fetch(e, slot):
            rows = pl.ds(pl.multiple_of(tile_ref[b, h, first + e] * ROWS, ROWS), ROWS)
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[b, h, rows], do_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot], q_bar.at[slot])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, h, rows], pos_smem.at[slot], q_bar.at[slot])

        @pl.when(n_tiles > 0)
        def _():
            fetch(0, 0)

        plgpu.barrier_wait(kv_bar)
        # the token (inside its tile) of each column: a (64,) vector in the column layout
        col_tok = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=col_l) // gp

        def step(e, carry):
            dk, dv, db = carry
            slot = lax.rem(e, 2)

            @pl.when(e + 1 < n_tiles)
            def _():
                fetch(e + 1, 1 - slot)
            plgpu.barrier_wait(q_bar.at[slot])
            bits = bit_ref[b, h, first + e]
            picked = (lax.shift_right_logical(bits, col_tok) & 1) == 1
            # last visible key offset inside this block per column; -1: none
            last = jnp.where(picked, plgpu.load(pos_smem.at[slot], layout=col_l) - j * BS, -1)
            key = plgpu.broadcasted_iota(jnp.int32, (BS, ROWS), 0, layout=plgpu.Layout.WGMMA)
            visible = key <= lax.broadcast_in_dim(last, (BS, ROWS), [1])
            st = _mm(k_smem, q_smem.at[slot].T) * scale_log2          # S^T: keys x query rows
            if has_bias:
                st = st + lax.broadcast_in_dim(plgpu.load(b_smem, layout=plgpu.Layout.WGMMA.reduce(1)),
                                               (BS, ROWS), [0])
            lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=col_l), (BS, ROWS), [1])
            delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=col_l), (BS, ROWS), [1])
            pt = jnp.where(visible, jnp.exp2(st - lse), 0.0)
            dpt = _mm(v_smem, do_smem.at[slot].T)
            dst = pt * (dpt - delta)
            dv = _pv(dv, pt, do_smem.at[slot], a_smem, p_via_smem=a_via_smem, acc_in_place=acc_in_place,
                      dtype=dtype)
            dk = _pv(dk, dst, q_smem.at[slot], a_smem, p_via_smem=a_via_smem, acc_in_place=acc_in_place,
                      dtype=dtype)
            if has_bias:
                db = db + dst.sum(axis=1)
            return dk, dv, db

        db0 = plgpu.layout_cast(jnp.zeros((BS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)) if has_bias else None
        dk, dv, db = lax.fori_loop(0, n_tiles, step, (_zeros(d), _zeros(d), db0))
        k_smem[...] = (dk * scale).astype(dtype)           # dk, dv leave through k's and v's buffers
        v_smem[...] = dv.astype(dtype)
        if has_bias:
            b_smem[...] = db
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, keys, h])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, keys, h])
        if has_bias:
            plgpu.copy_smem_to_gmem(b_smem, db_ref.at[b, h, keys])
        plgpu.wait_smem_to_gmem(0)

    args = (q_r, do_r, lse_r, delta_r, pos_r, k, v) + ((bias_r,) if has_bias else ()) + (
        tmeta.tiles, tmeta.bits, tmeta.offsets)
    scratch = [plgpu.SMEM((BS, d), dtype, transforms=MMA_T), plgpu.SMEM((BS, d), dtype, transforms=MMA_T)]
    if has_bias:
        scratch.append(plgpu.SMEM((BS,), jnp.float32))
    scratch += [plgpu.SMEM((2, ROWS, d), dtype, transforms=MMA_T), plgpu.SMEM((2, ROWS, d), dtype, transforms=MMA_T),
                plgpu.SMEM((2, ROWS), jnp.float32), plgpu.SMEM((2, ROWS), jnp.float32),
                plgpu.SMEM((2, ROWS), jnp.int32),
                plgpu.SMEM((BS, ROWS) if a_via_smem else (8, ROWS), dtype, transforms=MMA_T),
                plgpu.Barrier(num_arrivals=3 if has_bias else 2),
                plgpu.Barrier(num_arrivals=5, num_barriers=2)]
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    if has_bias:
        out_type.append(jax.ShapeDtypeStruct(bias_r.shape, jnp.float32))
    return plgpu.kernel(
        sparse_attention_dkdv,
        out_type=tuple(out_type),
        grid=(b_, kh, nb), grid_names=("b", "h", "j"),
        scratch_types=tuple(scratch),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*args)


# ------------------------------------------------------------------------------------ wrapper

@lowered_once("interpret", "a_via_smem", "acc_in_place")
def sparse_prefill_attention_backward(q, k, v, block_ids, q_positions, out, lse, dout, *, bias=None,
                                      interpret=None, a_via_smem: bool | None = None,
                                      acc_in_place: bool | None = None):
    """The gradients of `prefill.sparse_prefill_attention` (and of the jnp reference, whose
    math it is), from the forward's out and lse.

    q [B, T, H, D]; k, v [B, S, K, D] (bf16/f16); block_ids int [B, K, T, n] (64-token blocks,
    -1 = none, any order, repeats count once); q_positions int [B, T]; bias optional float
    [B, S, K]; out [B, T, H, D]; lse [B, T, H] float32 natural log-sum-exp (-inf: no visible
    key; `reference.sparse_attention_reference_with_lse`); dout [B, T, H, D].
    Returns (dq, dk, dv, dbias) in the dtypes of q, k, v and float32 (dbias None without bias).

    interpret: None (compiled, GPU), True or a plgpu.InterpretGPUParams (CPU interpreter).
    a_via_smem / acc_in_place: default to what the mode supports (interpret: True / False).
    Raises TypeError for dtypes other than bf16/f16, ValueError for unsupported shapes.
    """
    _check(q, k, v, block_ids, q_positions, bias)
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (b, t, h):
        raise ValueError(f"out and dout must be {q.shape} and lse {(b, t, h)}; got {out.shape}, {dout.shape}, "
                         f"{lse.shape}")
    if interpret is True:
        interpret = INTERPRET
    if a_via_smem is None:
        a_via_smem = interpret is not None
    if acc_in_place is None:
        acc_in_place = interpret is None
    g = h // kh
    gp = padded_group(g)
    tt = tile_tokens_for(g)
    nb = -(-s // BS)
    if s % BS:
        k, v = (jnp.pad(x, ((0, 0), (0, nb * BS - s), (0, 0), (0, 0))) for x in (k, v))
        if bias is not None:
            bias = jnp.pad(bias, ((0, 0), (0, nb * BS - s), (0, 0)))
    tpad = -t % tt
    tp = t + tpad
    ids = _pad_tokens(block_ids.astype(jnp.int32), tt)
    pos = jnp.pad(jnp.minimum(q_positions.astype(jnp.int32), s - 1), ((0, 0), (0, tpad)), constant_values=-1)
    meta = build_prefill_meta(ids, tt, nb)
    tmeta = build_transposed_meta(meta, nb)

    def rows(x, dtype):                                     # [B, T, H, ...] -> [B, K, Tp * Gp, ...]
        x = x.astype(dtype).reshape(b, t, kh, g, *x.shape[3:])
        x = jnp.pad(x, [(0, 0), (0, tpad), (0, 0), (0, gp - g)] + [(0, 0)] * (x.ndim - 4))
        return jnp.moveaxis(x, 2, 1).reshape(b, kh, tp * gp, *x.shape[4:])

    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)       # [B, T, H]
    # log2 units; rows with nothing visible (-inf) and padded rows (+inf) get P = 0
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse.astype(jnp.float32) * LOG2E)
    lse_r = rows(lse2, jnp.float32)
    lse_r = jnp.where(rows(jnp.ones((b, t, h), jnp.float32), jnp.float32) > 0, lse_r, jnp.inf)
    q_r, do_r, delta_r = rows(q, q.dtype), rows(dout, q.dtype), rows(delta, jnp.float32)
    bias_r = None if bias is None else jnp.transpose(bias.astype(jnp.float32) * LOG2E, (0, 2, 1))
    kw = dict(gp=gp, a_via_smem=a_via_smem, acc_in_place=acc_in_place, interpret=interpret)
    dq_r = _dq_kernel(q_r, do_r, lse_r, delta_r, k, v, bias_r, meta, pos, **kw)
    pos_r = jnp.broadcast_to(pos[:, None, :, None], (b, kh, tp, gp)).reshape(b, kh, tp * gp)  # each row's position
    res = _dkv_kernel(q_r, do_r, lse_r, delta_r, pos_r, k, v, bias_r, tmeta, **kw)
    dq = dq_r.reshape(b, kh, tp, gp, d)[:, :, :t, :g].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    dk, dv = res[0][:, :s], res[1][:, :s]
    dbias = None if bias is None else jnp.transpose(res[2], (0, 2, 1))[:, :s]
    return dq, dk, dv, dbias
