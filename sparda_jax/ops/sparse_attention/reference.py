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

__all__ = ["sparse_attention_reference", "sparse_attention_reference_with_lse", "sparse_attention_backward_reference",
           "paged_sparse_attention_reference", "check_block_ids"]


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


def _visible(ic, pc, *, block_size: int, kv_len):
    """ic [B, K, c, n] block ids (-1 = none); pc [B, c] -> [B, K, c, n, bs] bool: the key exists
    (position < kv_len), its block is selected and it is at or before the query's position."""
    tok = ic[..., None] * block_size + jnp.arange(block_size).reshape(1, 1, 1, 1, -1)  # [B, K, c, n, bs]
    return (ic[..., None] >= 0) & (tok <= pc[:, None, :, None, None]) & (tok < kv_len)


def _logits(qc, ks, bias_s):
    """qc [B, c, H, D]; ks [B, K, c, n, bs, D]; bias_s None or [B, K, c, n, bs] ->
    [B, K, G, c, n, bs] float32 (scale 1/sqrt(D), bias added; unmasked)."""
    b, c, h, d = qc.shape
    kh = ks.shape[1]
    qg = qc.astype(jnp.float32).reshape(b, c, kh, h // kh, d)
    logits = jnp.einsum("BTKGD,BKTNSD->BKGTNS", qg, ks.astype(jnp.float32)) / math.sqrt(d)
    if bias_s is not None:
        logits = logits + bias_s.astype(jnp.float32)[:, :, None]
    return logits


def _attend_blocks(qc, pc, ic, ks, vs, bias_s, *, block_size: int, kv_len, with_lse: bool = False):
    """Attention of a query chunk over gathered blocks.

    qc [B, c, H, D]; pc [B, c]; ic [B, K, c, n] block ids (-1 = none); ks, vs
    [B, K, c, n, bs, D]; bias_s None or [B, K, c, n, bs]; kv_len: keys at positions >= kv_len
    do not exist. -> [B, c, H, D] float32, and with_lse also the log-sum-exp of each row's
    visible logits, [B, c, H] float32 (-inf for a row with no visible key).
    """
    b, c, h, d = qc.shape
    ok = _visible(ic, pc, block_size=block_size, kv_len=kv_len)[:, :, None]  # [B, K, 1, c, n, bs]
    logits = jnp.where(ok, _logits(qc, ks, bias_s), NEG_INF)
    m = jnp.max(logits, axis=(-2, -1), keepdims=True)
    p = jnp.exp(logits - m) * ok
    total = jnp.sum(p, axis=(-2, -1), keepdims=True)
    out = jnp.einsum("BKGTNS,BKTNSD->BTKGD", p / jnp.maximum(total, 1e-30), vs.astype(jnp.float32))
    out = out.reshape(b, c, h, d)
    if not with_lse:
        return out
    lse = jnp.where(total > 0, m + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)[..., 0, 0]  # [B, K, G, c]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, c, h)


def _chunked(chunk: int, q, q_positions, *per_kv, per_query=()):
    """Split the query axis into chunks of c = min(chunk, Tq) (the tail padded: positions -1,
    ids -1, other per-query arrays 0). -> (c, n, qs [n, B, c, H, D], ps [n, B, c], per_kv
    chunks [n, B, K, c, ...], per_query chunks [n, B, c, ...]). per_kv arrays are
    [B, K, Tq, ...], per_query arrays [B, Tq, ...]."""
    tq = q.shape[1]
    c = min(chunk, tq)
    n = -(-tq // c)
    pad = n * c - tq

    def split_q(a, fill=0):  # [B, Tq, ...] -> [n, B, c, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(a.shape[0], n, c, *a.shape[2:]), 1, 0)

    kv = [jnp.moveaxis(jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3), constant_values=-1)
                       .reshape(a.shape[0], a.shape[1], n, c, *a.shape[3:]), 2, 0) for a in per_kv]
    return c, n, split_q(q), split_q(q_positions, -1), kv, [split_q(a) for a in per_query]


def _unchunk(x, tq: int):
    """[n, B, c, ...] -> [B, Tq, ...] (the padded tail dropped)."""
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])[:, :tq]


def _map_chunks(fn, chunk: int, q, q_positions, *per_kv):
    """Run fn(qc, pc, *per_kv_chunks) over query chunks; fn returns arrays (or a tuple of them)
    [B, c, ...], gathered back to [B, Tq, ...]. per_kv arrays are [B, K, Tq, ...]."""
    _, _, qs, ps, rest, _ = _chunked(chunk, q, q_positions, *per_kv)
    out = jax.lax.map(lambda args: fn(*args), (qs, ps, *rest))
    return jax.tree.map(lambda x: _unchunk(x, q.shape[1]), out)


def _blocked(k, v, bias, block_size: int):
    """k, v [B, S, K, D] -> [B, nb, bs, K, D] (zero padded to whole blocks); bias None or
    [B, S, K] -> None or [B, nb, bs, K] float32."""
    b, s, kh, d = k.shape
    nb = -(-s // block_size)
    pad = nb * block_size - s
    kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block_size, kh, d)
    vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block_size, kh, d)
    biasb = None
    if bias is not None:
        biasb = jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, pad), (0, 0))).reshape(b, nb, block_size, kh)
    return kb, vb, biasb


def _gather_index(b: int, kh: int, ic, nb: int):
    """Index tuple into a [B, nb, bs, K, ...] array for ids ic [B, K, c, n] (padding clipped to
    block 0; its keys are masked) -> gathered [B, K, c, n, bs, ...]."""
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(kh)[None, :, None, None]
    return bi, jnp.clip(ic, 0, nb - 1), slice(None), hi


def _check_bias(k, bias):
    if bias is not None and bias.shape != k.shape[:3]:
        raise ValueError(f"bias must be [B, S, K] = {k.shape[:3]}, got {bias.shape}")


def sparse_attention_reference(q, k, v, block_ids, q_positions, *, block_size: int = 64, bias=None,
                               chunk: int = 32):
    """Block-sparse GQA attention in plain jnp: each query attends to the tokens of its KV
    head's selected blocks (ids < 0 are padding, repeated ids count once) that are at or
    before its position. Chunked over queries: memory O(chunk * n * block_size).

    q [B, Tq, H, D]; k, v [B, S, K, D]; block_ids int [B, K, Tq, n]; q_positions int [B, Tq];
    bias optional float [B, S, K] added to each key's logit (NOSA's cis).
    Returns [B, Tq, H, D] in q's dtype; a query with no visible key gets zeros.
    """
    return _reference(q, k, v, block_ids, q_positions, block_size=block_size, bias=bias, chunk=chunk,
                      with_lse=False)


def sparse_attention_reference_with_lse(q, k, v, block_ids, q_positions, *, block_size: int = 64, bias=None,
                                        chunk: int = 32):
    """`sparse_attention_reference` that also returns the log-sum-exp of each query head's
    visible logits (scaled q.k + bias, natural log): (out [B, Tq, H, D] in q's dtype,
    lse [B, Tq, H] float32, -inf for a query with no visible key). The residual of the backward
    (`sparse_attention_backward_reference`)."""
    return _reference(q, k, v, block_ids, q_positions, block_size=block_size, bias=bias, chunk=chunk,
                      with_lse=True)


def _reference(q, k, v, block_ids, q_positions, *, block_size, bias, chunk, with_lse):
    check_qkv(q, k, v, q_positions)
    check_block_ids(q, k, block_ids)
    _check_bias(k, bias)
    b, s, kh, _ = k.shape
    kb, vb, biasb = _blocked(k, v, bias, block_size)
    nb = kb.shape[1]

    def one_chunk(qc, pc, ic):
        idx = _gather_index(b, kh, ic, nb)
        return _attend_blocks(qc, pc, ic, kb[idx], vb[idx], None if biasb is None else biasb[idx],
                              block_size=block_size, kv_len=s, with_lse=with_lse)

    res = _map_chunks(one_chunk, chunk, q, q_positions, _dedupe(block_ids))
    return (res[0].astype(q.dtype), res[1]) if with_lse else res.astype(q.dtype)


def sparse_attention_backward_reference(q, k, v, block_ids, q_positions, out, lse, dout, *, block_size: int = 64,
                                        bias=None, chunk: int = 32):
    """The gradients of `sparse_attention_reference` in plain jnp, FlashAttention style: per
    chunk of queries the probabilities are recomputed from `lse`, dq is produced for the chunk
    and dk, dv (and dbias) are scatter-added into the rows of the selected blocks. Ids are
    deduplicated as in the forward; padding (-1) and invisible keys contribute nothing.
    Memory O(chunk * n * block_size) besides the inputs and gradients: never [Tq, S].

    q, k, v, block_ids, q_positions, bias: the forward's inputs; out [B, Tq, H, D] and lse
    [B, Tq, H] its outputs (`sparse_attention_reference_with_lse`, or any backend's output
    with that lse); dout [B, Tq, H, D] the output's cotangent.
    Returns (dq, dk, dv, dbias) in the dtypes of q, k, v and bias (dbias None without bias);
    the arithmetic is float32.
    """
    check_qkv(q, k, v, q_positions)
    check_block_ids(q, k, block_ids)
    _check_bias(k, bias)
    b, tq, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != (b, tq, h):
        raise ValueError(f"out and dout must be {q.shape} and lse {(b, tq, h)}; got {out.shape}, {dout.shape}, "
                         f"{lse.shape}")
    scale = 1.0 / math.sqrt(d)
    kb, vb, biasb = _blocked(k, v, bias, block_size)
    nb = kb.shape[1]
    kb, vb = kb.astype(jnp.float32), vb.astype(jnp.float32)
    c, _, qs, ps, (ids,), (os_, dos, ls) = _chunked(chunk, q, q_positions, _dedupe(block_ids),
                                                      per_query=(out, dout, lse))

    def one_chunk(acc, args):
        dk, dv, dbias = acc
        qc, pc, ic, oc, doc, lc = args
        idx = _gather_index(b, kh, ic, nb)
        ks, vs = kb[idx], vb[idx]                                  # [B, K, c, n, bs, D]
        ok = _visible(ic, pc, block_size=block_size, kv_len=s)[:, :, None]   # [B, K, 1, c, n, bs]
        logits = _logits(qc, ks, None if biasb is None else biasb[idx])     # [B, K, G, c, n, bs]
        lg = jnp.moveaxis(lc.reshape(b, c, kh, g), 1, 3)[..., None, None]   # [B, K, G, c, 1, 1]
        # exp may overflow where a row has no visible key (lse = -inf): masked by the where
        p = jnp.where(ok, jnp.exp(logits - lg), 0.0)
        dog = doc.astype(jnp.float32).reshape(b, c, kh, g, d)
        delta = jnp.sum(dog * oc.astype(jnp.float32).reshape(b, c, kh, g, d), axis=-1)  # [B, c, K, G]
        delta = jnp.moveaxis(delta, 1, 3)[..., None, None]                # [B, K, G, c, 1, 1]
        dp = jnp.einsum("BTKGD,BKTNSD->BKGTNS", dog, vs)
        ds = p * (dp - delta)                                      # d logits
        dqc = jnp.einsum("BKGTNS,BKTNSD->BTKGD", ds, ks).reshape(b, c, h, d) * scale
        qg = qc.astype(jnp.float32).reshape(b, c, kh, g, d)
        dk = dk.at[idx].add(jnp.einsum("BKGTNS,BTKGD->BKTNSD", ds, qg) * scale)
        dv = dv.at[idx].add(jnp.einsum("BKGTNS,BTKGD->BKTNSD", p, dog))
        if dbias is not None:
            dbias = dbias.at[idx].add(jnp.sum(ds, axis=2))
        return (dk, dv, dbias), dqc

    zeros = jnp.zeros(kb.shape, jnp.float32)
    acc0 = (zeros, zeros, None if biasb is None else jnp.zeros(biasb.shape, jnp.float32))
    (dk, dv, dbias), dqs = jax.lax.scan(one_chunk, acc0, (qs, ps, ids, os_, dos, ls))
    unblock = lambda x: x.reshape(b, nb * block_size, *x.shape[3:])[:, :s]
    dq = _unchunk(dqs, tq).astype(q.dtype)
    dbias = None if bias is None else unblock(dbias).astype(bias.dtype)
    return dq, unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), dbias


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
