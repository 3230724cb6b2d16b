"""Block-sparse prefill attention in Pallas Mosaic GPU (Hopper).

Every query token attends to its own selected 64-token blocks (one list per KV head, shared by
the G query heads of the group), causally inside a block (key pos <= query pos), with an
optional per-key logit bias (NOSA's cis). Design:

- **Rows.** q is reordered in XLA to q_r [B, K, T*Gp, D], row = t*Gp + g, the group padded to
  Gp = a power of two >= max(G, 4) (G=3 -> 4: 25% idle rows; wgmma wants 64-row tiles and a
  token must not straddle two of them). A CTA tile is one warpgroup of 64 rows: 64//Gp tokens x
  Gp heads.
- **Union.** A tile walks the UNION of its tokens' block lists (`build_prefill_meta`, XLA: one
  sort + segment ops, like splash attention's MaskInfo); each union entry carries an int32 of
  selection bits (bit i: token i of the tile picked the block), so the mask is built in
  registers from two scalars and an iota, never read from memory.
- **Pipeline.** K/V (and the bias) of the next union block are double-buffered by TMA in a
  fori_loop over the traced trip count |union|.
- Online softmax in the log2 domain with f32 state; P is rounded to q.dtype for the PV wgmma.

The efficiency depends on the union size (`union_stats`): a tile computes 64 rows x |union| x
64 logits, of which only the selected ones are useful.

bf16/f16 only (wgmma operands; f32 is a TypeError so callers can fall back), head dim a
multiple of 64 (128-byte swizzle), 64-token blocks.
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

__all__ = ["sparse_prefill_attention", "sparse_prefill_attention_reference", "build_prefill_meta",
           "PrefillMeta", "union_stats", "tile_tokens_for", "padded_group", "INTERPRET"]

# Interpret mode (CPU). It does not support wgmma with A from registers nor in-place
# accumulation (pl.run_state), so the kernel has switches for those two; both forms lower.
INTERPRET = plgpu.InterpretGPUParams()

BS = 64                       # tokens per KV block
ROWS = 64                     # query rows per CTA tile (one warpgroup; wgmma M)
MMA_T = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 16-bit: 8 x 64 = 128 B rows
LOG2E = math.log2(math.e)


def padded_group(g: int) -> int:
    """Rows per token in the kernel: a power of two >= max(g, 4) that divides 64 (a tile then
    holds <= 16 tokens). Raises ValueError for g > 64."""
    gp = 4
    while gp < g:
        gp *= 2
    if gp > ROWS:
        raise ValueError(f"at most {ROWS} query heads per KV head, got {g}")
    return gp


def tile_tokens_for(g: int) -> int:
    """Tokens per CTA tile (those share one walk over the union of their blocks): 64 // padded_group(g)."""
    return ROWS // padded_group(g)


# ------------------------------------------------------------------------------ metadata (XLA)

class PrefillMeta(NamedTuple):
    """Per tile of `tile_tokens` consecutive tokens, per (batch, KV head); NT = T // tile_tokens.

    uids    int32 [B, K, NT, U]  union of the tile's block ids, ascending, -1 padded
                                  (U = tile_tokens * n, the worst case);
    ubits   int32 [B, K, NT, U]  bit i set iff token i of the tile selected uids[..., u];
    n_union int32 [B, K, NT]     |union| (the kernel's trip count).
    """
    uids: jax.Array
    ubits: jax.Array
    n_union: jax.Array


def build_prefill_meta(block_ids, tile_tokens: int, n_blocks: int | None = None) -> PrefillMeta:
    """block_ids int [B, K, T, n] (-1 = none; any order, repeats allowed) -> PrefillMeta.
    T must be a multiple of tile_tokens (<= 32: one int32 of bits). Ids >= n_blocks (when
    given) or < 0 are dropped: they select no key."""
    b, kh, t, n = block_ids.shape
    if t % tile_tokens or not 1 <= tile_tokens <= 32:
        raise ValueError(f"T ({t}) must be a multiple of tile_tokens ({tile_tokens}), which must be <= 32")
    nt, u = t // tile_tokens, tile_tokens * n
    ids = block_ids.astype(jnp.int32).reshape(b, kh, nt, tile_tokens, n)
    ok = ids >= 0
    if n_blocks is not None:
        ok &= ids < n_blocks
    tok = lax.broadcasted_iota(jnp.int32, ids.shape, 3)
    big = jnp.int32(2**31 - 1)
    # (block, token) packed in one key: sorting it groups each block's tokens together.
    key = jnp.sort(jnp.where(ok, ids * tile_tokens + tok, big).reshape(b, kh, nt, u), axis=-1)
    valid = key < big
    prev = jnp.concatenate([jnp.full_like(key[..., :1], -1), key[..., :-1]], axis=-1)
    fresh = valid & (key != prev)                          # repeated (block, token) pairs count once
    blk = key // tile_tokens
    prev_blk = jnp.concatenate([jnp.full_like(blk[..., :1], -1), blk[..., :-1]], axis=-1)
    first = valid & (blk != prev_blk)                      # first entry of each union block
    seg = jnp.where(valid, jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1, u - 1)
    bit = jnp.where(fresh, jnp.left_shift(jnp.int32(1), key % tile_tokens), 0)
    flat = lambda x: x.reshape(-1, u)

    def row(seg_u, first_u, blk_u, bit_u):
        uid = jnp.full((u,), -1, jnp.int32).at[seg_u].max(jnp.where(first_u, blk_u, -1))
        # distinct (block, token) pairs set distinct bits of a segment, so add == or
        ubit = jnp.zeros((u,), jnp.int32).at[seg_u].add(bit_u)
        return uid, ubit

    uids, ubits = jax.vmap(row)(flat(seg), flat(first), flat(blk), flat(bit))
    uids, ubits = uids.reshape(b, kh, nt, u), ubits.reshape(b, kh, nt, u)
    return PrefillMeta(uids, jnp.where(uids >= 0, ubits, 0), jnp.sum(first, axis=-1, dtype=jnp.int32))


def union_stats(block_ids, g: int) -> dict:
    """How much of the kernel's work is useful, for the benchmark. block_ids [B, K, T, n]; g:
    query heads per KV head.

    tile_tokens: tokens per tile (`tile_tokens_for(g)`); mean_union: blocks a tile walks (mean
    |union| over tiles); mean_selected: blocks per token; efficiency: mean_selected /
    mean_union (1.0 when neighbouring tokens pick the same blocks); row_fill: G / padded group
    (idle rows). Causal masking inside blocks is not counted.
    """
    tt = tile_tokens_for(g)
    ids = _pad_tokens(jnp.asarray(block_ids, jnp.int32), tt)
    mean_sel = float(jnp.mean(jnp.sum(ids >= 0, axis=-1).astype(jnp.float32)))
    union = float(jnp.mean(build_prefill_meta(ids, tt).n_union.astype(jnp.float32)))
    return dict(tile_tokens=tt, mean_union=union, mean_selected=mean_sel, efficiency=mean_sel / max(union, 1e-9),
                row_fill=g / padded_group(g))


def _pad_tokens(ids, tt):
    pad = -ids.shape[2] % tt
    return jnp.pad(ids, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-1) if pad else ids


# ------------------------------------------------------------------------------------- kernel

def _row_vectors(tile_tok0, gp, pos_ref, b):
    """Per-row (64,) vectors of the tile: the token's index inside the tile (selects its bit)
    and its query position (scalar reads from GMEM, once per tile)."""
    row2 = plgpu.broadcasted_iota(jnp.int32, (ROWS, BS), 0, layout=plgpu.Layout.WGMMA)
    tok = row2.max(axis=1) // gp                           # a (64,) vector in the row layout
    pos = jnp.full_like(tok, -1)
    for i in range(ROWS // gp):
        pos = jnp.where(tok == i, pos_ref[b, tile_tok0 + i], pos)
    return tok, pos


def _softmax_step(qk, blk, bits, tok_tile, pos, bias_col, carry, scale_log2):
    """Mask one (64 rows, 64 keys) block and fold it into the online softmax (log2 domain).
    Returns p (f32) and the new (acc rescaled, m, l); the caller adds p @ V to acc."""
    acc, m_i, l_i = carry
    picked = (lax.shift_right_logical(bits, tok_tile) & 1) == 1
    # last visible key offset inside this block per row; -1: none (not picked, or in the future)
    last = jnp.where(picked, pos - blk * BS, -1)
    col = plgpu.broadcasted_iota(jnp.int32, (ROWS, BS), 1, layout=plgpu.Layout.WGMMA)
    visible = col <= lax.broadcast_in_dim(last, (ROWS, BS), [0])
    s = qk * scale_log2
    if bias_col is not None:
        s = s + lax.broadcast_in_dim(bias_col, (ROWS, BS), [1])
    # -inf marks invisible keys; m_safe keeps rows without any visible key yet at exactly zero
    # weight (no -inf - -inf), and they end as zeros because l stays 0.
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, (acc, m_new, l_i)


def fetch_block(blk, slot, b, h, k_ref, v_ref, k_smem, v_smem, bar, bias=None):
    """Start the TMA copies of KV block `blk` (padding -1 reads block 0) of (b, KV head h) into
    `slot` of the SMEM rings, all arriving on bar[slot]; bias: (bias_ref, its SMEM ring) or None."""
    keys = pl.ds(pl.multiple_of(jnp.maximum(blk, 0) * BS, BS), BS)
    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], bar.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], bar.at[slot])
    if bias is not None:
        plgpu.copy_gmem_to_smem(bias[0].at[b, h, keys], bias[1].at[slot], bar.at[slot])


def _pv(acc, p, v_smem, p_smem, *, p_via_smem, acc_in_place, dtype):
    if p_via_smem:                                          # interpret mode: wgmma A must be a ref
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()
        a_op = p_smem
    else:                                                   # A from registers (attention_mgpu.py)
        a_op = p.astype(dtype)
    if acc_in_place:                                        # FA3 style; interpret cannot run it
        def pv_fn(acc_ref):
            plgpu.wgmma(acc_ref, a_op, v_smem)
        return pl.run_state(pv_fn)(plgpu.ACC.init(acc))

    def pv_fn(acc_ref):
        plgpu.wgmma(acc_ref, a_op, v_smem)
        return acc_ref[...]
    return acc + pl.run_scoped(pv_fn, plgpu.ACC((ROWS, acc.shape[1]), jnp.float32))


def _qk(q_smem, k_smem):
    def qk_fn(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.T)             # (64, D) @ (D, 64); K^T by ref transpose
        return acc_ref[...]                                 # the deref awaits the wgmma
    return pl.run_scoped(qk_fn, plgpu.ACC((ROWS, BS), jnp.float32))


def _init_carry(d):
    rl = plgpu.Layout.WGMMA.reduce(1)
    return (plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), rl),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rl))


def _normalize(acc, l_i, dtype):
    l_safe = jnp.where(l_i > 0, l_i, 1.0)                   # rows with nothing visible: zeros
    return (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)


def _prefill(q_r, k, v, bias_r, meta, pos, *, gp, p_via_smem, acc_in_place, interpret, with_lse=False):
    """One warpgroup of 64 rows per CTA; K/V (and bias) double-buffered by TMA in a fori_loop."""
    b_, kh, _, d = q_r.shape
    nt = meta.n_union.shape[2]
    tile_tok = ROWS // gp
    dtype = q_r.dtype
    scale_log2 = LOG2E / math.sqrt(d)
    has_bias = bias_r is not None

    def sparse_attention_prefill(*refs):
        lse_ref = lse_smem = None
        if with_lse:                                        # the lse output and its SMEM buffer
            refs = list(refs)
            lse_smem = refs.pop()
            lse_ref = refs.pop(9 if has_bias else 8)   # after the inputs and o
        if has_bias:
            (q_ref, k_ref, v_ref, bias_ref, uid_ref, ubit_ref, nu_ref, pos_ref, o_ref,
             q_smem, k_smem, v_smem, b_smem, p_smem, q_bar, kv_bar) = refs
        else:
            (q_ref, k_ref, v_ref, uid_ref, ubit_ref, nu_ref, pos_ref, o_ref,
             q_smem, k_smem, v_smem, p_smem, q_bar, kv_bar) = refs
        b, h, tt = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("t")
        nu = nu_ref[b, h, tt]
        rows = pl.ds(tt * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_smem, q_bar)

        def fetch(j, slot):                                 # one barrier per slot, 2-3 arrivals
            fetch_block(uid_ref[b, h, tt, j], slot, b, h, k_ref, v_ref, k_smem, v_smem, kv_bar,
                        (bias_ref, b_smem) if has_bias else None)

        @pl.when(nu > 0)
        def _():
            fetch(0, 0)

        tok_tile, rpos = _row_vectors(tt * tile_tok, gp, pos_ref, b)
        plgpu.barrier_wait(q_bar)

        def step(j, carry):
            slot = lax.rem(j, 2)

            @pl.when(j + 1 < nu)       # the other slot is free: step j-1's wgmmas were awaited
            def _():
                fetch(j + 1, 1 - slot)
            plgpu.barrier_wait(kv_bar.at[slot])
            blk, bits = uid_ref[b, h, tt, j], ubit_ref[b, h, tt, j]
            qk = _qk(q_smem, k_smem.at[slot])
            bias_col = None
            if has_bias:
                bias_col = plgpu.load(b_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            p, carry = _softmax_step(qk, blk, bits, tok_tile, rpos, bias_col, carry, scale_log2)
            acc, m_i, l_i = carry
            acc = _pv(acc, p, v_smem.at[slot], p_smem, p_via_smem=p_via_smem,
                      acc_in_place=acc_in_place, dtype=dtype)
            return acc, m_i, l_i

        acc, m_i, l_i = lax.fori_loop(0, nu, step, _init_carry(d))   # traced trip count
        q_smem[...] = _normalize(acc, l_i, dtype)          # o leaves through q's buffer
        if with_lse:                                        # log2 units; -inf: nothing visible
            lse_smem[...] = m_i + jnp.log2(l_i)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h, rows])
        if with_lse:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    args = (q_r, k, v) + ((bias_r,) if has_bias else ()) + (meta.uids, meta.ubits, meta.n_union, pos)
    scratch = [plgpu.SMEM((ROWS, d), dtype, transforms=MMA_T),                # q in, o out
               plgpu.SMEM((2, BS, d), dtype, transforms=MMA_T),               # K double buffer
               plgpu.SMEM((2, BS, d), dtype, transforms=MMA_T)]               # V double buffer
    if has_bias:
        scratch.append(plgpu.SMEM((2, BS), jnp.float32))
    scratch += [plgpu.SMEM((ROWS, BS) if p_via_smem else (8, BS), dtype, transforms=MMA_T),  # P
                plgpu.Barrier(),
                plgpu.Barrier(num_arrivals=3 if has_bias else 2, num_barriers=2)]
    out_type = jax.ShapeDtypeStruct(q_r.shape, dtype)
    if with_lse:
        scratch.append(plgpu.SMEM((ROWS,), jnp.float32))
        out_type = (out_type, jax.ShapeDtypeStruct(q_r.shape[:3], jnp.float32))
    return plgpu.kernel(
        sparse_attention_prefill,
        out_type=out_type,
        grid=(b_, kh, nt), grid_names=("b", "h", "t"),
        scratch_types=tuple(scratch),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*args)


# ------------------------------------------------------------------------------------ wrapper

def _check(q, k, v, block_ids, q_positions, bias):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, T, H, D] and k, v [B, S, K, D]; got {q.shape}, {k.shape}, {v.shape}")
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k, v {k.shape} do not match q {q.shape} in batch or head dim")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"the Mosaic GPU prefill kernel takes bf16/f16 q, k, v (wgmma operands); "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if d % 64:
        raise ValueError(f"head dim ({d}) must be a multiple of 64 (128-byte swizzled wgmma tiles)")
    if h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kh})")
    padded_group(h // kh)
    if block_ids.shape[:3] != (b, kh, t) or block_ids.ndim != 4:
        raise ValueError(f"block_ids must be [B, K, T, n] = [{b}, {kh}, {t}, n]; got {block_ids.shape}")
    if not jnp.issubdtype(block_ids.dtype, jnp.integer) or not jnp.issubdtype(q_positions.dtype, jnp.integer):
        raise TypeError(f"block_ids and q_positions must be integer; got {block_ids.dtype}, {q_positions.dtype}")
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions must be [B, T] = {(b, t)}; got {q_positions.shape}")
    if bias is not None and bias.shape != (b, s, kh):
        raise ValueError(f"bias must be [B, S, K] = {(b, s, kh)}; got {bias.shape}")


@lowered_once("interpret", "p_via_smem", "acc_in_place", "return_lse")
def sparse_prefill_attention(q, k, v, block_ids, q_positions, *, bias=None, interpret=None,
                             meta: PrefillMeta | None = None, p_via_smem: bool | None = None,
                             acc_in_place: bool | None = None, return_lse: bool = False):
    """q [B, T, H, D]; k, v [B, S, K, D]; block_ids int [B, K, T, n] (64-token blocks; -1 =
    none; any order, repeats allowed); q_positions int [B, T]; bias optional float [B, S, K]
    added to each key's logit. -> [B, T, H, D] in q.dtype; a query with no visible key gets zeros.
    return_lse: also return lse [B, T, H] float32, the natural log-sum-exp of each query head's
    visible logits (-inf where none is visible), the backward's residual.

    interpret: None (compiled, GPU), True or a plgpu.InterpretGPUParams (CPU interpreter).
    meta: a precomputed `build_prefill_meta(block_ids padded to the tile, tile_tokens_for(G),
    n_blocks)` (layers that share a selection can reuse it).
    p_via_smem / acc_in_place: default to what the mode supports (interpret: True / False).
    Raises TypeError for dtypes other than bf16/f16, ValueError for unsupported shapes.
    """
    _check(q, k, v, block_ids, q_positions, bias)
    if interpret is True:
        interpret = INTERPRET
    if p_via_smem is None:
        p_via_smem = interpret is not None
    if acc_in_place is None:
        acc_in_place = interpret is None
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    gp = padded_group(g)
    tt = tile_tokens_for(g)
    nb = -(-s // BS)
    # Whole blocks for TMA; the padded keys stay invisible because positions are clamped below S.
    if s % BS:
        k, v = (jnp.pad(x, ((0, 0), (0, nb * BS - s), (0, 0), (0, 0))) for x in (k, v))
        if bias is not None:
            bias = jnp.pad(bias, ((0, 0), (0, nb * BS - s), (0, 0)))
    tpad = -t % tt
    ids = _pad_tokens(block_ids.astype(jnp.int32), tt)
    pos = jnp.pad(jnp.minimum(q_positions.astype(jnp.int32), s - 1), ((0, 0), (0, tpad)), constant_values=-1)
    if meta is None:
        meta = build_prefill_meta(ids, tt, nb)
    tp = t + tpad
    q5 = jnp.pad(q.reshape(b, t, kh, g, d), ((0, 0), (0, tpad), (0, 0), (0, gp - g), (0, 0)))
    q_r = q5.transpose(0, 2, 1, 3, 4).reshape(b, kh, tp * gp, d)      # row = t * Gp + g
    bias_r = None
    if bias is not None:                                    # [B, K, S] rows, log2 units
        bias_r = jnp.transpose(bias.astype(jnp.float32) * LOG2E, (0, 2, 1))
    res = _prefill(q_r, k, v, bias_r, meta, pos, gp=gp, p_via_smem=p_via_smem, acc_in_place=acc_in_place,
                   interpret=interpret, with_lse=return_lse)
    o_r = res[0] if return_lse else res
    o = o_r.reshape(b, kh, tp, gp, d)[:, :, :t, :g].transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
    if not return_lse:
        return o
    lse = res[1].reshape(b, kh, tp, gp)[:, :, :t, :g].transpose(0, 2, 1, 3).reshape(b, t, h)
    return o, lse / LOG2E


def sparse_prefill_attention_reference(q, k, v, block_ids, q_positions, *, bias=None, interpret=None, meta=None,
                                       p_via_smem=None, acc_in_place=None):
    """The plain-jnp reference with the kernel's signature (the kernel-only options are ignored)."""
    from .reference import sparse_attention_reference

    return sparse_attention_reference(q, k, v, block_ids, q_positions, block_size=BS, bias=bias)
