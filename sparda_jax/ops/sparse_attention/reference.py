"""Block-sparse GQA attention in plain jnp: the reference of every sparse backend.

q [B, Tq, H, D]; k, v [B, S, K, D] (or, paged, pools [B, K, n_slots, block_size, D]);
block_ids int [B, K, Tq, n]: per (sequence, KV head, query) the selected blocks (-1 = padding,
repeats count once); q_positions int [B, Tq]. Query i sees the tokens of its blocks at or
before q_positions[b, i]. H = K * G; the softmax scale is 1/sqrt(D).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..dense_attention.reference import NEG_INF, check_qkv

__all__ = ["sparse_attention_reference", "paged_sparse_attention_reference", "check_block_ids"]


def check_block_ids(q, k, block_ids):
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
    check_qkv(q, k, v, q_positions)
    check_block_ids(q, k, block_ids)
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
