"""Selection quality: block recall against an oracle selection, captured attention mass, and the
block union of neighbouring queries (what a prefill kernel tile walks)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .attention import NEG_INF
from .config import SparseConfig

__all__ = ["forced_mask", "recall_counts", "block_recall", "attention_mass", "tile_union", "tile_blowup"]


def forced_mask(ids, q_positions, sparse: SparseConfig):
    """Which entries of ids int [B, K, Tq, n] are forced blocks (init or local window)."""
    q_blk = (q_positions // sparse.block_size)[:, None, :, None]
    return (ids >= 0) & ((ids < sparse.init_blocks) | (ids >= q_blk - sparse.local_blocks))


def recall_counts(ids, oracle, q_positions, sparse: SparseConfig, *, exclude_forced: bool = True):
    """(hits, total): how many of the oracle's blocks the selection also chose, summed over rows.

    ids, oracle int [B, K, Tq, n] (-1 padded). With exclude_forced, the init and local blocks
    (always in both) are left out, so recall measures the content choice alone.
    """
    wanted = oracle >= 0
    if exclude_forced:
        wanted = wanted & ~forced_mask(oracle, q_positions, sparse)
    hit = jnp.any(oracle[..., :, None] == jnp.where(ids >= 0, ids, -2)[..., None, :], axis=-1) & wanted
    return jnp.sum(hit), jnp.sum(wanted)


def block_recall(ids, oracle, q_positions, sparse: SparseConfig, *, exclude_forced: bool = True) -> jax.Array:
    """Micro-averaged recall (NaN when the oracle chose no content block at all)."""
    hits, total = recall_counts(ids, oracle, q_positions, sparse, exclude_forced=exclude_forced)
    return jnp.where(total > 0, hits / jnp.maximum(total, 1), jnp.nan)


def attention_mass(q, k, ids, q_positions, *, block_size: int, chunk: int = 64) -> jax.Array:
    """Fraction of each query head's dense attention probability that falls inside its
    selected blocks, averaged over (B, H, Tq). q [B, Tq, H, D], k [B, S, K, D]."""
    b, tq, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    kf = k.astype(jnp.float32)
    blk = (jnp.arange(s) // block_size).reshape(1, 1, 1, 1, s)

    def one(args):
        qc, pc, ic = args  # [B, c, H, D], [B, c], [B, K, c, n]
        c = qc.shape[1]
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", qc.astype(jnp.float32).reshape(b, c, kh, g, d), kf) / math.sqrt(d)
        vis = (jnp.arange(s).reshape(1, 1, s) <= pc[:, :, None])[:, None, None]
        logits = jnp.where(vis, logits, NEG_INF)
        p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) * vis
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        inside = jnp.any(ic[..., None] == blk, axis=-2)  # [B, K, c, S]
        valid = (pc >= 0)[:, None, None, :]
        return jnp.sum(jnp.sum(p * inside[:, :, None], axis=-1) * valid), jnp.sum(valid) * h

    n = -(-tq // chunk)
    pad = n * chunk - tq
    qs = jnp.moveaxis(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, chunk, h, d), 1, 0)
    ps = jnp.moveaxis(jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1).reshape(b, n, chunk), 1, 0)
    is_ = jnp.moveaxis(jnp.pad(ids, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=-1)
                       .reshape(b, kh, n, chunk, ids.shape[-1]), 2, 0)
    mass, count = jax.lax.map(one, (qs, ps, is_))
    return jnp.sum(mass) / jnp.sum(count)


@functools.partial(jax.jit, static_argnames=("tile",))
def tile_union(ids, *, tile):
    """Distinct blocks selected by `tile` consecutive queries, [B, K, Tq // tile]: the blocks a
    prefill kernel tile of those queries must walk (sparda_jax/ops/sparse_attention/prefill.py)."""
    b, kh, t, n = ids.shape
    nt = t // tile
    x = jnp.sort(ids[:, :, : nt * tile].reshape(b, kh, nt, tile * n), axis=-1)
    first = jnp.concatenate([jnp.ones_like(x[..., :1], bool), x[..., 1:] != x[..., :-1]], axis=-1)
    return jnp.sum(first & (x >= 0), axis=-1)


def tile_blowup(ids, *, tile):
    """Mean over tiles of `tile` consecutive queries of (blocks in their union) / (blocks one of
    them selects, on average): 1 when neighbours choose the same blocks, `tile` when they share
    none. It scales the prefill kernel's work over the attended blocks (ids int [B, K, Tq, n])."""
    b, kh, t, n = ids.shape
    nt = t // tile
    per_row = jnp.sum(ids[:, :, : nt * tile] >= 0, axis=-1).reshape(b, kh, nt, tile).mean(-1)
    u = tile_union(ids, tile=tile)
    return jnp.sum(jnp.where(per_row > 0, u / jnp.maximum(per_row, 1), 0)) / jnp.maximum(jnp.sum(per_row > 0), 1)
