"""The KV copy in plain jnp: the semantics every backend of `kv_copy.api` must reproduce.

A copy moves whole blocks by two task lists of equal length: task i moves block src[i] of the
`from` side to block dst[i] of the `to` side, for one array or for a tuple of 1..MAX_PAYLOADS
arrays (a layer's K, V and NOSA's cis) moved by the same tasks. Blocks are the trailing
`block_ndim` dims (None: all but the first), numbered in row-major order of the dims before
them. A task with an index out of range on either side (e.g. -1) is skipped; later tasks win.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["gather_blocks_reference", "scatter_blocks_reference", "MAX_PAYLOADS", "check_payloads", "block_bytes"]

MAX_PAYLOADS = 4  # kMaxPayloads of csrc/copy_tasks.h


def _nd(a, block_ndim) -> int:
    """Block dims of `a`: the trailing `block_ndim` (None: all but the first)."""
    nd = a.ndim - 1 if block_ndim is None else block_ndim
    if not 1 <= nd < a.ndim:
        raise ValueError(f"block_ndim {block_ndim} leaves no block index dims in shape {a.shape}")
    return nd


def _n_blocks(a, block_ndim) -> int:
    return int(np.prod(a.shape[:a.ndim - _nd(a, block_ndim)]))


def _check(pool, src, dst, cache, block_ndim):
    bp, bc = pool.shape[pool.ndim - _nd(pool, block_ndim):], cache.shape[cache.ndim - _nd(cache, block_ndim):]
    if bp != bc:
        raise ValueError(f"pool blocks {bp} and cache slots {bc} differ")
    if pool.dtype != cache.dtype:
        raise TypeError(f"pool ({pool.dtype}) and cache ({cache.dtype}) dtypes differ")
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be equal 1-D index arrays, got {src.shape}, {dst.shape}")


def _as_tuple(x) -> tuple[tuple, bool]:
    """(payloads, one): a single array as a 1-tuple, with `one` set so the result can be one too."""
    return ((x,), True) if not isinstance(x, (tuple, list)) else (tuple(x), False)


def check_payloads(pool, cache, src, dst, block_ndim=None):
    """(pools, caches, one): the payloads as equal tuples, checked; `one` when the caller passed
    single arrays (the result is then a single array too). Raises ValueError / TypeError."""
    pools, one = _as_tuple(pool)
    caches, one_cache = _as_tuple(cache)
    if one != one_cache:
        raise TypeError("pool and cache must both be arrays or both be tuples of payloads")
    if len(pools) != len(caches) or not 1 <= len(pools) <= MAX_PAYLOADS:
        raise ValueError(f"a copy takes 1..{MAX_PAYLOADS} payloads, as many pools as caches; got {len(pools)} pools "
                         f"and {len(caches)} caches")
    for p, c in zip(pools, caches):
        _check(p, src, dst, c, block_ndim)
    n_pool, n_cache = [_n_blocks(p, block_ndim) for p in pools], [_n_blocks(c, block_ndim) for c in caches]
    if len(set(n_pool)) > 1 or len(set(n_cache)) > 1:
        raise ValueError(f"the payloads of one copy must have the same number of blocks: pools {n_pool}, "
                         f"caches {n_cache}")
    return pools, caches, one


def block_bytes(arrays, block_ndim=None) -> np.ndarray:
    """int64 [len(arrays)]: the bytes of one block of each array."""
    return np.array([int(np.prod(a.shape[a.ndim - _nd(a, block_ndim):])) * jnp.dtype(a.dtype).itemsize
                     for a in arrays], np.int64)


def _on_host(x) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def _as_blocks(a, block_ndim):
    """a viewed as [blocks, *block] (the blocks in row-major order of the leading dims)."""
    nd = _nd(a, block_ndim)
    return a.reshape(-1, *a.shape[a.ndim - nd:])


def _gather_one(pool, src, dst, cache, block_ndim):
    p = jax.device_put(pool, jax.memory.Space.Device) if _on_host(pool) else pool
    p, c = _as_blocks(p, block_ndim), _as_blocks(cache, block_ndim)
    ok = (src >= 0) & (src < p.shape[0]) & (dst >= 0)
    rows = p[jnp.clip(src, 0, p.shape[0] - 1)]
    return c.at[jnp.where(ok, dst, c.shape[0])].set(rows, mode="drop").reshape(cache.shape)


def gather_blocks_reference(pool, src, dst, cache, *, block_ndim: int | None = None):
    """cache[dst[i]] = pool[src[i]] for every task i in range -> the updated cache (or tuple of
    caches). pool [n_pool, *block] (any memory kind; a host pool is brought to the device
    whole), src/dst int32 [n], cache [n_slots, *block] of pool's dtype."""
    pools, caches, one = check_payloads(pool, cache, src, dst, block_ndim)
    out = tuple(_gather_one(p, src, dst, c, block_ndim) for p, c in zip(pools, caches))
    return out[0] if one else out


def _scatter_one(cache, src, dst, pool, block_ndim):
    on_host = _on_host(pool)
    p = jax.device_put(pool, jax.memory.Space.Device) if on_host else pool
    p, c = _as_blocks(p, block_ndim), _as_blocks(cache, block_ndim)
    ok = (src >= 0) & (src < c.shape[0]) & (dst >= 0)
    rows = c[jnp.clip(src, 0, c.shape[0] - 1)].astype(p.dtype)
    p = p.at[jnp.where(ok, dst, p.shape[0])].set(rows, mode="drop").reshape(pool.shape)
    return jax.device_put(p, jax.memory.Space.Host) if on_host else p


def scatter_blocks_reference(cache, src, dst, pool, *, block_ndim: int | None = None):
    """pool[dst[i]] = cache[src[i]] for every task i in range -> the updated pool (or tuple of
    pools), in the pool's memory kind. src indexes the cache's slots, dst the pool's blocks."""
    pools, caches, one = check_payloads(pool, cache, dst, src, block_ndim)
    out = tuple(_scatter_one(c, src, dst, p, block_ndim) for c, p in zip(caches, pools))
    return out[0] if one else out
