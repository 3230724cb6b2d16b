"""Dense causal GQA attention in plain jnp: the reference of every dense backend.

Shapes: q [B, Tq, H, D]; k, v [B, S, K, D] with keys at absolute positions 0..S-1;
q_positions int32 [B, Tq]. Query i of sequence b sees key j iff j <= q_positions[b, i].
q_positions=None means causal prefill: the queries are the keys' own tokens (Tq == S).
H = K * G (GQA: query head h reads KV head h // G). The softmax scale is 1/sqrt(D).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["dense_attention_reference", "NEG_INF", "resolve_positions", "check_qkv"]

# A large finite negative instead of -inf: -inf turns a fully masked row into NaN (inf - inf);
# with a finite value the row stays finite and we zero it explicitly.
NEG_INF = -1e30

def resolve_positions(q, k, q_positions):
    if q_positions is not None:
        return q_positions
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q_positions=None means causal prefill and needs Tq == S; got "
                         f"Tq={q.shape[1]}, S={k.shape[1]}")
    return jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])


def check_qkv(q, k, v, q_positions):
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
    q_positions = resolve_positions(q, k, q_positions)
    check_qkv(q, k, v, q_positions)
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
