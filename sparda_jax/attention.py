"""Attention cores: dense causal attention, and (later) block-sparse attention.

Shapes: q [B, Tq, H, D]; k, v [B, S, K, D] with keys at absolute positions 0..S-1;
q_positions int32 [B, Tq]. Query i of sequence b sees key j iff j <= q_positions[b, i].
q_positions=None means causal prefill: the queries are the keys' own tokens (Tq == S).
H = K * G (GQA: query head h reads KV head h // G). The softmax scale is 1/sqrt(D).

Every core takes an explicit `implementation=`; None picks the fastest correct one for the
platform. The plain-jnp paths are the references the kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["dense_attention", "dense_attention_reference", "NEG_INF"]

# A large finite negative instead of -inf: -inf turns a fully masked row into NaN (inf - inf);
# with a finite value the row stays finite and we zero it explicitly.
NEG_INF = -1e30

DenseImpl = Literal["xla", "cudnn"]


def _resolve_positions(q, k, q_positions):
    if q_positions is not None:
        return q_positions
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q_positions=None means causal prefill and needs Tq == S; got "
                         f"Tq={q.shape[1]}, S={k.shape[1]}")
    return jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])


def _check_qkv(q, k, v, q_positions):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, heads, D]; got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    b, tq, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} does not match q {q.shape} in batch or head dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({k.shape[2]})")
    if q_positions.shape != (b, tq):
        raise ValueError(f"q_positions must be [B, Tq] = {(b, tq)}, got {q_positions.shape}")
    if not jnp.issubdtype(q_positions.dtype, jnp.integer):
        raise TypeError(f"q_positions must be integer, got {q_positions.dtype}")


def dense_attention_reference(q, k, v, q_positions=None, *, bias=None, chunk: int = 512):
    """Causal GQA attention in plain jnp, chunked over queries (memory O(chunk * S)).

    bias: optional float [B, S, K] added to the logits of each key (NOSA's cis).
    Fully masked rows return zeros.
    """
    q_positions = _resolve_positions(q, k, q_positions)
    _check_qkv(q, k, v, q_positions)
    # Masks that depend on positions alone are loop-invariant inside a layer loop: XLA hoists
    # them and materializes every chunk's at once ([T, T]-sized). Tie them to q to keep them here.
    q_positions, q = jax.lax.optimization_barrier((q_positions, q))
    b, tq, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    scale = 1.0 / math.sqrt(d)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    key_pos = jnp.arange(s, dtype=jnp.int32)

    def one_chunk(args):
        qc, pc = args  # [B, c, H, D], [B, c]
        qg = qc.astype(jnp.float32).reshape(b, qc.shape[1], kh, g, d)
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", qg, kf) * scale
        if bias is not None:
            logits = logits + jnp.transpose(bias.astype(jnp.float32), (0, 2, 1))[:, :, None, None, :]
        visible = key_pos[None, None, :] <= pc[:, :, None]  # [B, c, S]
        logits = jnp.where(visible[:, None, None], logits, NEG_INF)
        m = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.exp(logits - m) * visible[:, None, None]
        denom = jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum("BKGTS,BSKD->BTKGD", p / jnp.maximum(denom, 1e-30), vf)
        return out.reshape(b, qc.shape[1], h, d)

    c = min(chunk, tq)
    n = -(-tq // c)
    pad = n * c - tq
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pp = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)
    qs = jnp.moveaxis(qp.reshape(b, n, c, h, d), 1, 0)
    ps = jnp.moveaxis(pp.reshape(b, n, c), 1, 0)
    out = jax.lax.map(one_chunk, (qs, ps))  # [n, B, c, H, D]
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, d)[:, :tq]
    return out.astype(q.dtype)


def _cudnn_ok(q, q_positions, bias) -> bool:
    on_gpu = jax.default_backend() == "gpu"
    return (on_gpu and bias is None and q.dtype in (jnp.bfloat16, jnp.float16)
            and (q_positions is None or q.shape[1] == 1))


def dense_attention(q, k, v, q_positions=None, *, bias=None,
                    implementation: DenseImpl | None = None):
    """Causal GQA attention. See the module docstring for shapes.

    implementation:
      "xla"   the chunked jnp reference (any platform, any query layout, bias allowed);
      "cudnn" `jax.nn.dot_product_attention(implementation="cudnn")`, for two layouts:
              causal prefill (q_positions None) and decode (Tq == 1, key j visible iff
              j <= q_positions[b, 0]);
      None    cudnn where it applies (GPU, bf16/f16, no bias, one of the two layouts), else xla.
    """
    if implementation is None:
        implementation = "cudnn" if _cudnn_ok(q, q_positions, bias) else "xla"
    if implementation == "xla":
        return dense_attention_reference(q, k, v, q_positions, bias=bias)
    if implementation != "cudnn":
        raise ValueError(f"unknown dense attention implementation {implementation!r}")
    if bias is not None:
        raise ValueError("the cudnn path takes no per-key bias; use implementation='xla'")
    if q_positions is None:
        _check_qkv(q, k, v, _resolve_positions(q, k, None))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    _check_qkv(q, k, v, q_positions)
    if q.shape[1] != 1:
        raise ValueError(f"cudnn dense attention with explicit positions needs Tq == 1 (decode), "
                         f"got Tq={q.shape[1]}; use implementation='xla'")
    lengths = (q_positions[:, 0] + 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                        implementation="cudnn")


# ------------------------------------------------------------------------- block-sparse attention

SparseImpl = Literal["xla", "mosaic_gpu", "mosaic_gpu_interpret"]


def hopper_gpu() -> bool:
    """The default device is a Hopper GPU (compute capability 9.x), where the Mosaic GPU kernels
    run (wgmma, TMA)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def _mosaic_attention_ok(q, k, v, block_size: int, bias) -> bool:
    """The shapes the Mosaic attention kernels were validated for on the H200."""
    decode = q.shape[1] == 1
    dims = (64, 128) if decode else (128,)
    return (block_size == 64 and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype
            and v.dtype == q.dtype and q.shape[-1] in dims and not (decode and bias is not None) and hopper_gpu())


def _check_block_ids(q, k, block_ids):
    b, tq, h, _ = q.shape
    kh = k.shape[2]
    if block_ids.ndim != 4 or block_ids.shape[:3] != (b, kh, tq):
        raise ValueError(f"block_ids must be [B, K, Tq, n] = [{b}, {kh}, {tq}, n], got {block_ids.shape}")
    if not jnp.issubdtype(block_ids.dtype, jnp.integer):
        raise TypeError(f"block_ids must be integer, got {block_ids.dtype}")


def _dedupe(ids):
    """Blank (-1) padding and every id equal to an earlier one in its row, keeping the
    alignment of the row (the paged path indexes slots by position in the row)."""
    n = ids.shape[-1]
    earlier = jnp.tril(jnp.ones((n, n), bool), k=-1).reshape((1,) * (ids.ndim - 1) + (n, n))  # j < i
    dup = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier, axis=-1)
    return jnp.where(dup | (ids < 0), -1, ids.astype(jnp.int32))


def _attend_blocks(qc, pc, ic, ks, vs, bias_s, *, block_size: int, kv_len):
    """Attention of a query chunk over gathered blocks.

    qc [B, c, H, D]; pc [B, c]; ic [B, K, c, n] block ids (-1 = none); ks, vs
    [B, K, c, n, bs, D]; bias_s None or [B, K, c, n, bs]; kv_len: keys at positions >= kv_len
    do not exist. -> [B, c, H, D] float32.
    """
    b, c, h, d = qc.shape
    kh = ks.shape[1]
    g = h // kh
    tok = ic[..., None] * block_size + jnp.arange(block_size).reshape(1, 1, 1, 1, -1)  # [B, K, c, n, bs]
    ok = (ic[..., None] >= 0) & (tok <= pc[:, None, :, None, None]) & (tok < kv_len)
    qg = qc.astype(jnp.float32).reshape(b, c, kh, g, d)
    logits = jnp.einsum("BTKGD,BKTNSD->BKGTNS", qg, ks.astype(jnp.float32)) / math.sqrt(d)
    if bias_s is not None:
        logits = logits + bias_s.astype(jnp.float32)[:, :, None]
    ok = ok[:, :, None]  # [B, K, 1, c, n, bs]
    logits = jnp.where(ok, logits, NEG_INF)
    m = jnp.max(logits, axis=(-2, -1), keepdims=True)
    p = jnp.exp(logits - m) * ok
    denom = jnp.maximum(jnp.sum(p, axis=(-2, -1), keepdims=True), 1e-30)
    out = jnp.einsum("BKGTNS,BKTNSD->BTKGD", p / denom, vs.astype(jnp.float32))
    return out.reshape(b, c, h, d)


def _map_chunks(fn, chunk: int, q, q_positions, *per_kv):
    """Run fn(qc, pc, *per_kv_chunks) over query chunks. per_kv arrays are [B, K, Tq, ...]."""
    b, tq, h, d = q.shape
    c = min(chunk, tq)
    n = -(-tq // c)
    pad = n * c - tq
    qs = jnp.moveaxis(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, h, d), 1, 0)
    ps = jnp.moveaxis(jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1).reshape(b, n, c), 1, 0)
    rest = [jnp.moveaxis(jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3), constant_values=-1)
                         .reshape(a.shape[0], a.shape[1], n, c, *a.shape[3:]), 2, 0) for a in per_kv]
    out = jax.lax.map(lambda args: fn(*args), (qs, ps, *rest))  # [n, B, c, H, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * c, h, d)[:, :tq]


def sparse_attention_reference(q, k, v, block_ids, q_positions, *, block_size: int = 64, bias=None,
                               chunk: int = 32):
    """Block-sparse GQA attention in plain jnp: each query attends to the tokens of its KV
    head's selected blocks (ids < 0 are padding, repeated ids count once) that are at or
    before its position. Chunked over queries: memory O(chunk * n * block_size).

    q [B, Tq, H, D]; k, v [B, S, K, D]; block_ids int [B, K, Tq, n]; q_positions int [B, Tq];
    bias optional float [B, S, K] added to each key's logit (NOSA's cis).
    Returns [B, Tq, H, D] in q's dtype; a query with no visible key gets zeros.
    """
    _check_qkv(q, k, v, q_positions)
    _check_block_ids(q, k, block_ids)
    b, tq, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    nb = -(-s // block_size)
    pad = nb * block_size - s
    kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block_size, kh, d)
    vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block_size, kh, d)
    biasb = None
    if bias is not None:
        biasb = jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, pad), (0, 0))).reshape(b, nb, block_size, kh)
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(kh)[None, :, None, None]

    def one_chunk(qc, pc, ic):
        safe = jnp.clip(ic, 0, nb - 1)
        bias_s = None if biasb is None else biasb[bi, safe, :, hi]
        return _attend_blocks(qc, pc, ic, kb[bi, safe, :, hi], vb[bi, safe, :, hi], bias_s,
                              block_size=block_size, kv_len=s)

    return _map_chunks(one_chunk, chunk, q, q_positions, _dedupe(block_ids)).astype(q.dtype)


def paged_sparse_attention_reference(q, k_pool, v_pool, slots, block_ids, q_positions, *, block_size: int = 64,
                                     bias_pool=None, chunk: int = 32):
    """Block-sparse attention reading K/V through a slot table (the engine's block cache).

    q [B, Tq, H, D]; k_pool, v_pool [B, K, n_slots, bs, D]; slots and block_ids int
    [B, K, Tq, n]: entry i of a row says that block block_ids[i] sits in slot slots[i]
    (block id < 0: padding); bias_pool optional [B, K, n_slots, bs]. Causality comes from the
    block ids. Same result as `sparse_attention_reference` on the contiguous cache.
    """
    b, tq, h, d = q.shape
    kh, n_slots = k_pool.shape[1], k_pool.shape[2]
    if k_pool.shape != v_pool.shape or k_pool.shape[:2] != (b, kh) or k_pool.shape[3:] != (block_size, d):
        raise ValueError(f"k_pool/v_pool must be [B, K, n_slots, {block_size}, {d}], got {k_pool.shape}, {v_pool.shape}")
    if slots.shape != block_ids.shape or block_ids.shape[:3] != (b, kh, tq):
        raise ValueError(f"slots and block_ids must both be [B, K, Tq, n]; got {slots.shape}, {block_ids.shape}")
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(kh)[None, :, None, None]

    def one_chunk(qc, pc, ic, sc):
        safe = jnp.clip(sc, 0, n_slots - 1)
        bias_s = None if bias_pool is None else bias_pool[bi, hi, safe]
        return _attend_blocks(qc, pc, ic, k_pool[bi, hi, safe], v_pool[bi, hi, safe], bias_s,
                              block_size=block_size, kv_len=jnp.iinfo(jnp.int32).max)

    ids = _dedupe(block_ids)
    return _map_chunks(one_chunk, chunk, q, q_positions, ids, slots).astype(q.dtype)


def paged_sparse_attention(q, k_pool, v_pool, slots, block_ids, q_positions, *, block_size: int = 64,
                           bias_pool=None, implementation: SparseImpl | None = None):
    """Block-sparse attention through a slot table (see `paged_sparse_attention_reference`).

    implementation: "xla" the reference; "mosaic_gpu" / "mosaic_gpu_interpret" the paged Mosaic
    GPU decode kernel (Tq == 1, no bias, 64-token blocks, bf16/f16, block ids ascending and
    unique with -1 padding at the end, as the selectors emit them); None the kernel where
    `sparse_attention` would pick it for decode, else the reference.
    """
    if implementation is None:
        ok = q.shape[1] == 1 and _mosaic_attention_ok(q, k_pool, v_pool, block_size, bias_pool)
        implementation = "mosaic_gpu" if ok else "xla"
    if implementation == "xla":
        return paged_sparse_attention_reference(q, k_pool, v_pool, slots, block_ids, q_positions,
                                                block_size=block_size, bias_pool=bias_pool)
    if implementation not in ("mosaic_gpu", "mosaic_gpu_interpret"):
        raise ValueError(f"unknown sparse attention implementation {implementation!r}")
    if q.shape[1] != 1 or bias_pool is not None or block_size != 64:
        raise NotImplementedError("the paged Mosaic GPU kernel covers decode (Tq == 1, 64-token blocks, no bias); "
                                  "use implementation='xla'")
    from sparda_jax.kernels.sparse_decode import INTERPRET, paged_sparse_decode_attention

    out = paged_sparse_decode_attention(q[:, 0], k_pool, v_pool, slots[:, :, 0], block_ids[:, :, 0].astype(jnp.int32),
                                        q_positions[:, 0].astype(jnp.int32),
                                        interpret=INTERPRET if implementation.endswith("interpret") else None)
    return out[:, None]


def sparse_attention(q, k, v, block_ids, q_positions, *, block_size: int = 64, bias=None,
                     implementation: SparseImpl | None = None):
    """Block-sparse attention over the selected blocks (see `sparse_attention_reference`).

    implementation:
      "xla"                  the jnp reference (any platform, any layout of block_ids);
      "mosaic_gpu"           the Pallas Mosaic GPU kernels (Hopper; bf16/f16, head dim a multiple
                             of 64, 64-token blocks): Tq == 1 goes to the decode kernel
                             (kernels/sparse_decode.py; no bias, block ids as the selectors emit
                             them: ascending, unique, -1 padding at the end); Tq > 1 goes to the
                             prefill kernel (kernels/sparse_prefill.py; bias allowed, any order of
                             block ids). Both are verified in interpret mode and lowered for sm_90
                             on the CPU, not yet run on hardware;
      "mosaic_gpu_interpret" the same kernels run by the Mosaic GPU interpreter (CPU; tests);
      None                   "mosaic_gpu" where it ran correct on an H200 and beat the reference
                             (bench/results/attention.json: prefill ~10x, decode ~2x): a Hopper
                             GPU, bf16/f16, 64-token blocks, head dim 128 (decode also 64), no
                             bias in decode; the reference everywhere else.
    """
    if implementation is None:
        implementation = "mosaic_gpu" if _mosaic_attention_ok(q, k, v, block_size, bias) else "xla"
    if implementation == "xla":
        return sparse_attention_reference(q, k, v, block_ids, q_positions, block_size=block_size, bias=bias)
    if implementation in ("mosaic_gpu", "mosaic_gpu_interpret"):
        _check_qkv(q, k, v, q_positions)
        _check_block_ids(q, k, block_ids)
        interpret = implementation.endswith("interpret")
        if block_size != 64:
            raise NotImplementedError(f"the Mosaic GPU kernels take 64-token blocks, got {block_size}; "
                                      "use implementation='xla'")
        if q.shape[1] > 1:
            from sparda_jax.kernels.sparse_prefill import sparse_prefill_attention

            return sparse_prefill_attention(q, k, v, block_ids, q_positions.astype(jnp.int32), bias=bias,
                                            interpret=True if interpret else None)
        from sparda_jax.kernels.sparse_decode import INTERPRET, sparse_decode_attention

        if bias is not None:
            raise NotImplementedError("the Mosaic GPU decode kernel (Tq == 1) takes no bias; "
                                      "use implementation='xla'")
        out = sparse_decode_attention(q[:, 0], k, v, block_ids[:, :, 0].astype(jnp.int32),
                                      q_positions[:, 0].astype(jnp.int32),
                                      interpret=INTERPRET if interpret else None)
        return out[:, None]
    raise ValueError(f"unknown sparse attention implementation {implementation!r}")
