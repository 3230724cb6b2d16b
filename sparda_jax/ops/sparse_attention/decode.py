"""Block-sparse decode attention in Pallas Mosaic GPU (Hopper).

One query token per sequence over its selected 64-token blocks, read from the contiguous
cache [B, S, K, D] by block id. Grid (B, K, n_split): each CTA (one warpgroup) copies its
split's window of the block list into SMEM, walks it with a ring of `stages` TMA buffers
(stages - 1 blocks in flight), computes QK^T and PV with wgmma (the G query heads of a group
padded to the 64 rows wgmma needs: decode is bound by reading K/V, not by the tensor cores),
keeps an online softmax in the log2 domain, and writes a partial output with its log-sum-exp;
the combine over splits runs in XLA. At 2 stages two CTAs fit an SM (the output staging reuses
the rings' SMEM).

`sparse_decode_attention_reference` is the plain-jnp reference with the same signature.
Tuning: `DecodeConfig` (splits per (sequence, KV head), K/V buffers per CTA). bf16/f16 only (wgmma operands); head dim a multiple of 64; the cache length a
multiple of 64 (TMA boxes of whole blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sparda_jax.config import check_int
from sparda_jax.ops._dispatch import lowered_once

__all__ = ["DecodeConfig", "sparse_decode_attention", "sparse_decode_attention_reference", "paged_sparse_decode_attention",
           "sparse_decode_split_pass", "combine_splits",
           "paged_sparse_decode_attention_reference", "default_n_split", "DEFAULT_SPLITS", "DEFAULT_STAGES", "INTERPRET"]

# Interpret mode (CPU): wgmma's A operand must come from SMEM and the accumulator cannot be
# updated in place there, so the kernel has switches for those two (both lower for the GPU).
INTERPRET = plgpu.InterpretGPUParams()




BS, GP = 64, 64          # tokens per KV block; query rows per CTA (wgmma needs M % 64 == 0)
MMA_T = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # bf16: 8 x 64 elems = 128 B

# K/V buffers per CTA (stages - 1 blocks in flight). 2 measured fastest; at 2 stages two CTAs
# share an SM (see SMEM_PER_SM), at 3 or more one CTA has the SM to itself.
DEFAULT_STAGES = 2


def sparse_decode_partial(q_pad, k, v, ids, n_valid, pos, *, n_split, slots=None, stages: int = DEFAULT_STAGES,
                                                    p_via_smem=False, acc_in_place=True, interpret=None):
    """q_pad [B,K,GP,D] bf16 (rows >= G zero); k, v [B,S,K,D] bf16, or with `slots` the block
    cache's pools viewed as [B,K,n_slots*64,D] (block ids[j] sits in slot slots[j]); ids [B,K,n]
    int32 (ascending, -1 padded, unique); n_valid [B,K] int32; pos [B] int32 (query position).
    -> o [B,K,n_split,GP,D] f32 (normalised per split), lse [B,K,n_split,GP] f32 (log2 units).
    Interpret mode needs p_via_smem=True, acc_in_place=False."""
    if stages < 2:
        raise ValueError(f"stages must be >= 2 (a block in flight while one is read), got {stages}")
    paged = slots is not None
    B, K, _, D = q_pad.shape
    n = ids.shape[-1]
    per = -(-n // n_split)
    dtype = q_pad.dtype
    scale_log2 = math.log2(math.e) / math.sqrt(D)

    # Each CTA copies the window of its block list that holds its `per` entries into SMEM, from a
    # 16-byte boundary (the bulk copy's alignment: 4 int32): W entries from start rounded down to
    # 4, or from n_pad - W where that window would run past the list (only splits with no entries
    # or the last ones: the clamped window still ends at n_pad >= n). The lists are padded (-1) to
    # n_pad, a multiple of 4: no pad at all, and no kernel, when n is one. Two CTAs still share an
    # SM up to ~3800 blocks a split (paged: two windows of 4 B an entry).
    W = -(-max((s * per) % 4 + per for s in range(n_split)) // 4) * 4
    n_pad = max(-(-n // 4) * 4, W)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, n_pad - n)), constant_values=-1)
    ids = pad(ids)
    slots = pad(slots) if paged else ids  # unused when contiguous: the cache is addressed by block id

    def sparse_attention_decode(q_ref, k_ref, v_ref, ids_ref, slots_ref, nv_ref, pos_ref, o_ref, lse_ref,
                                q_smem, ids_smem, slots_smem, q_bar, ids_bar, kv_bar):
        b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        start = s * per
        # this split's window of the block list (and slots) in SMEM: each step reads two entries,
        # and a GMEM load in the loop would put its latency between one block's wgmmas and the
        # next block's copy (a bulk copy, in bounds by the padding and the clamp; a tiled TMA box
        # holds <= 256)
        w0 = pl.multiple_of(jnp.minimum(lax.div(start, 4) * 4, n_pad - W), 4)
        in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS
        plgpu.copy_gmem_to_smem(ids_ref.at[b, h, pl.ds(w0, W)], ids_smem, ids_bar, oob_mode=in_bounds)
        if paged:
            plgpu.copy_gmem_to_smem(slots_ref.at[b, h, pl.ds(w0, W)], slots_smem, ids_bar, oob_mode=in_bounds)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
        end = jnp.minimum(start + per, nv_ref[b, h])          # scalar loads from GMEM, while the copies fly
        p_b = pos_ref[b]
        plgpu.barrier_wait(ids_bar)

        def main_loop(k_smem, v_smem, p_smem):
            def fetch(j, slot):                               # one barrier, two arrivals (K and V)
                if paged:
                    rows = pl.ds(pl.multiple_of(jnp.maximum(slots_smem[j - w0], 0) * BS, BS), BS)
                    k_src, v_src = k_ref.at[b, h, rows], v_ref.at[b, h, rows]
                else:
                    rows = pl.ds(pl.multiple_of(jnp.maximum(ids_smem[j - w0], 0) * BS, BS), BS)
                    k_src, v_src = k_ref.at[b, rows, h], v_ref.at[b, rows, h]
                plgpu.copy_gmem_to_smem(k_src, k_smem.at[slot], kv_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], kv_bar.at[slot])

            for i in range(stages - 1):                       # fill the ring: blocks start .. start+stages-2
                @pl.when(start + i < end)
                def _():
                    fetch(start + i, i)
            plgpu.barrier_wait(q_bar)

            row_l = plgpu.Layout.WGMMA.reduce(1)
            m0 = plgpu.layout_cast(jnp.full((GP,), -jnp.inf, jnp.float32), row_l)
            l0 = plgpu.layout_cast(jnp.zeros((GP,), jnp.float32), row_l)
            a0 = plgpu.layout_cast(jnp.zeros((GP, D), jnp.float32), plgpu.Layout.WGMMA)

            def step(j, carry):
                acc, m_i, l_i = carry
                slot = lax.rem(j - start, stages)
                @pl.when(j + stages - 1 < end)                  # refill the slot step j-1 read (free: both
                def _():                                        # of its wgmmas were awaited)
                    fetch(j + stages - 1, lax.rem(j - start + stages - 1, stages))
                plgpu.barrier_wait(kv_bar.at[slot])
                blk = ids_smem[j - w0]

                def qk_fn(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)   # (64,D) @ (D,64); K^T via ref transpose
                    return acc_ref[...]                               # deref awaits the wgmma
                qk = pl.run_scoped(qk_fn, plgpu.ACC((GP, BS), jnp.float32))

                tok = blk * BS + plgpu.broadcasted_iota(jnp.int32, (GP, BS), 1, layout=plgpu.Layout.WGMMA)
                sc = jnp.where(tok <= p_b, qk * scale_log2, -jnp.inf)
                m_new = jnp.maximum(m_i, sc.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no (-inf) - (-inf)
                alpha = jnp.exp2(m_i - m_safe)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_safe, sc.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if p_via_smem:                                  # interpret mode: wgmma A must be a ref
                    p_smem[...] = p.astype(dtype)
                    plgpu.commit_smem()
                    a_op = p_smem
                else:                                           # A from registers (as attention_mgpu.py)
                    a_op = p.astype(dtype)
                if acc_in_place:                                # FA3 style; not supported by interpret
                    def pv_fn(acc_ref):
                        plgpu.wgmma(acc_ref, a_op, v_smem.at[slot])
                    acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
                else:
                    def pv_fn(acc_ref):
                        plgpu.wgmma(acc_ref, a_op, v_smem.at[slot])
                        return acc_ref[...]
                    acc = acc + pl.run_scoped(pv_fn, plgpu.ACC((GP, D), jnp.float32))
                return acc, m_new, l_i

            return lax.fori_loop(start, end, step, (a0, m0, l0))   # dynamic trip count

        # The rings live only in the loop's scope and the output staging only in the epilogue's,
        # which reuses their SMEM: one scope for both needed 118808 B, over the 115712 B with which
        # two CTAs share an SM (228 KB, 1 KB reserved per CTA), so every CTA ran alone on its SM
        acc, m_i, l_i = pl.run_scoped(
            main_loop,
            plgpu.SMEM((stages, BS, D), dtype, transforms=MMA_T),   # K ring
            plgpu.SMEM((stages, BS, D), dtype, transforms=MMA_T),   # V ring
            # P staging, read only with p_via_smem (interpret mode): 8 rows otherwise
            plgpu.SMEM((GP if p_via_smem else 8, BS), dtype, transforms=MMA_T))
        nonempty = l_i > 0
        l_safe = jnp.where(nonempty, l_i, 1.0)

        def epilogue(o_smem, lse_smem):
            plgpu.commit_smem()   # every warp is past its last wgmma on the rings this space held
            o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            lse_smem[...] = jnp.where(nonempty, m_i + jnp.log2(l_safe), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, s])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, s])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(epilogue, plgpu.SMEM((GP, D), jnp.float32), plgpu.SMEM((GP,), jnp.float32))

    return plgpu.kernel(
            sparse_attention_decode,
            out_type=(jax.ShapeDtypeStruct((B, K, n_split, GP, D), jnp.float32),
                                jax.ShapeDtypeStruct((B, K, n_split, GP), jnp.float32)),
            grid=(B, K, n_split), grid_names=("b", "h", "s"),
            scratch_types=(
                    plgpu.SMEM((GP, D), dtype, transforms=MMA_T),        # q
                    plgpu.SMEM((W,), jnp.int32),                         # block ids (window)
                    plgpu.SMEM((W if paged else 4,), jnp.int32),         # slots (paged)
                    plgpu.Barrier(),                                     # q
                    plgpu.Barrier(num_arrivals=2 if paged else 1),       # ids and slots
                    plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # K/V ring
            ),
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=interpret,
    )(q_pad, k, v, ids, slots, n_valid, pos)


DEFAULT_SPLITS = 4
MAX_SPLITS = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning of the decode kernels, validated on construction (ConfigError names the field).

    n_split: KV splits per (sequence, KV head), each one CTA (None: `default_n_split` for the grid);
    stages: K/V buffers per CTA, stages - 1 blocks in flight (>= 2).
    """

    n_split: int | None = None
    stages: int = DEFAULT_STAGES

    def __post_init__(self):
        check_int("DecodeConfig", "n_split", self.n_split, lo=1, none_ok=True)
        check_int("DecodeConfig", "stages", self.stages, lo=2)


# Hopper: 228 KB of SMEM per SM, 1 KB of it reserved per resident CTA. The kernel at 2 stages
# (D = 128) needs 87072 B, so two CTAs share an SM; `test_two_ctas_fit_an_sm` holds it to that.
SMEM_PER_SM, SMEM_RESERVED_PER_CTA = 228 * 1024, 1024
CTAS_PER_SM = 2
H200_SMS = 132


def default_n_split(n_blocks: int, pairs: int | None = None, sms: int | None = None, *,
                    stages: int = DEFAULT_STAGES, head_dim: int = 128) -> int:
    """KV splits per (sequence, KV head): enough CTAs to fill every SM with as many CTAs as fit
    on one (`CTAS_PER_SM` at 2 stages and head dim <= 128, else 1) when the grid's (sequence,
    KV head) `pairs` are few; at least DEFAULT_SPLITS, at most MAX_SPLITS, never more than there
    are blocks. sms: the GPU's SM count (None: the first GPU's, else H200_SMS). Each CTA walks
    its blocks one after another, so a small grid leaves SMs idle."""
    if pairs is None:
        return max(1, min(DEFAULT_SPLITS, n_blocks))
    sms = sms or _gpu_sms()
    per_sm = CTAS_PER_SM if stages <= 2 and head_dim <= 128 else 1
    want = max(DEFAULT_SPLITS, min(MAX_SPLITS, per_sm * sms // max(1, pairs)))
    return max(1, min(want, n_blocks))


def _gpu_sms() -> int:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend (CPU, interpret mode)
        return H200_SMS
    return int(getattr(gpus[0], "core_count", 0) or H200_SMS)


@lowered_once("config", "interpret")
def sparse_decode_attention(q, k, v, ids, pos, *, config: DecodeConfig | None = None, interpret=None):
    """q [B,H,D]; k, v [B,S,K,D]; ids [B,K,n] int32 (ascending, unique, -1 padded at the end);
    pos [B] int32 (each query's position) -> [B,H,D]. config: the kernel's tuning
    (`DecodeConfig()` when None). interpret: None (compiled, GPU) or `INTERPRET` (CPU)."""
    config = DecodeConfig() if config is None else config
    _check(q, k, v, ids, pos)
    return _decode(q, k, v, ids, pos, None, k.shape[2], config.n_split, config.stages, interpret)


@lowered_once("config", "interpret")
def paged_sparse_decode_attention(q, k_pool, v_pool, slots, ids, pos, *, config: DecodeConfig | None = None,
                                  interpret=None):
    """The same over the engine's block cache: k_pool, v_pool [B,K,n_slots,64,D]; block ids[b,k,j]
    sits in slot slots[b,k,j] (ids ascending, unique, -1 padded at the end; slots aligned with
    them). -> [B,H,D]. Causality comes from the block ids and pos."""
    config = DecodeConfig() if config is None else config
    b, kh, n_slots, bs, d = k_pool.shape
    if v_pool.shape != k_pool.shape or bs != BS:
        raise ValueError(f"k_pool/v_pool must be [B, K, n_slots, {BS}, D]; got {k_pool.shape}, {v_pool.shape}")
    if slots.shape != ids.shape:
        raise ValueError(f"slots {slots.shape} and ids {ids.shape} must align")
    flat = lambda p: p.reshape(b, kh, n_slots * bs, d)
    # the contiguous layout's checks, with the pool seen as a cache of n_slots blocks
    as_cache = lambda p: jax.ShapeDtypeStruct((b, n_slots * bs, kh, d), p.dtype)
    _check(q, as_cache(k_pool), as_cache(v_pool), ids, pos)
    return _decode(q, flat(k_pool), flat(v_pool), ids, pos, slots.astype(jnp.int32), kh, config.n_split,
                   config.stages, interpret)


def _decode(q, k, v, ids, pos, slots, K, n_split, stages, interpret):
    o, lse = _split_pass(q, k, v, ids, pos, slots, K, n_split, stages, interpret)
    return combine_splits(o, lse).reshape(q.shape).astype(q.dtype)


def _split_pass(q, k, v, ids, pos, slots, K, n_split, stages, interpret):
    """The kernel's pass over the blocks: per (sequence, KV head, split) the normalised partial
    output o [B, K, n_split, G, D] f32 and its log-sum-exp lse [B, K, n_split, G] (log2)."""
    if n_split is None:
        n_split = default_n_split(ids.shape[-1], ids.shape[0] * ids.shape[1], stages=stages, head_dim=q.shape[-1])
    kw = dict(p_via_smem=True, acc_in_place=False) if interpret is not None else {}
    kw["interpret"] = interpret
    B, H, D = q.shape
    G = H // K
    q_pad = jnp.zeros((B, K, GP, D), q.dtype).at[:, :, :G].set(q.reshape(B, K, G, D))
    n_valid = jnp.sum(ids >= 0, axis=-1).astype(jnp.int32)
    o, lse = sparse_decode_partial(q_pad, k, v, ids, n_valid, pos, n_split=n_split, slots=slots, stages=stages, **kw)
    return o[:, :, :, :G], lse[:, :, :, :G]


@lowered_once("config", "interpret")
def sparse_decode_split_pass(q, k, v, ids, pos, *, config: DecodeConfig | None = None, interpret=None):
    """`sparse_decode_attention` without its combine (the benchmark times the two apart):
    (o [B, K, n_split, G, D] f32, lse [B, K, n_split, G] f32, log2); `combine_splits(o, lse)`
    then gives the attention [B, K, G, D]."""
    config = DecodeConfig() if config is None else config
    _check(q, k, v, ids, pos)
    return _split_pass(q, k, v, ids, pos, None, k.shape[2], config.n_split, config.stages, interpret)


def combine_splits(o, lse):
    """The splits' partial outputs o [B, K, S, G, D] with their log2-sum-exps lse [B, K, S, G]
    -> the attention [B, K, G, D] f32 (an empty split, lse -inf, weighs 0)."""
    m = jnp.max(lse, axis=2, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp2(lse - m)[..., None]                        # 0 for empty splits
    # the weights ride as one more lane of o: one reduction gives numerator and denominator
    # (two reductions were two kernels, every layer of every decode step)
    t = jnp.sum(jnp.concatenate([w * o, w], axis=-1), axis=2)
    return t[..., :-1] / jnp.maximum(t[..., -1:], 1e-30)


def _check(q, k, v, ids, pos):
    b, h, d = q.shape
    if k.shape != v.shape or k.ndim != 4 or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k, v must be [B, S, K, D] matching q {q.shape}; got {k.shape}, {v.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"the Mosaic GPU decode kernel takes bf16/f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if d % 64 or k.shape[1] % BS:
        raise ValueError(f"head dim ({d}) and cache length ({k.shape[1]}) must be multiples of 64")
    if h % k.shape[2] or h // k.shape[2] > GP:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({k.shape[2]}), at most {GP} per group")
    if ids.shape[:2] != (b, k.shape[2]) or ids.ndim != 3 or pos.shape != (b,):
        raise ValueError(f"ids must be [B, K, n] and pos [B]; got {ids.shape}, {pos.shape}")


def sparse_decode_attention_reference(q, k, v, ids, pos, *, config=None, interpret=None):
    """The plain-jnp reference with the kernel's signature (config and interpret are ignored)."""
    from .reference import sparse_attention_reference

    out = sparse_attention_reference(q[:, None], k, v, ids[:, :, None], pos[:, None], block_size=BS)
    return out[:, 0]


def paged_sparse_decode_attention_reference(q, k_pool, v_pool, slots, ids, pos, *, config=None, interpret=None):
    """The plain-jnp reference with the paged kernel's signature (config and interpret are ignored)."""
    from .reference import paged_sparse_attention_reference

    out = paged_sparse_attention_reference(q[:, None], k_pool, v_pool, slots[:, :, None], ids[:, :, None],
                                           pos[:, None], block_size=BS)
    return out[:, 0]
