"""Key compression: the mean of each full window of `kernel_size` tokens at `stride`.

Chunk c covers tokens [c*stride, c*stride + kernel_size); only full windows exist, so a
sequence of T tokens has N_c = (T - kernel_size) // stride + 1 chunks (0 if T < kernel_size).
Chunk c is visible to a query at position p iff c*stride + kernel_size - 1 <= p.

Decode keeps the compressed keys incrementally (`CompressedKeys`): the key sums of the last
kernel_size tokens in groups of gcd(kernel_size, stride); when the token at position p completes
a window (p + 1 - kernel_size is a non-negative multiple of stride) the window's mean is written
as chunk (p + 1 - kernel_size) / stride. This gives MiniCPM's tail buffer's chunks (emit the mean
of l_c tokens, drop s_c) without reading the full cache, which in offload mode lives in host
memory.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["num_chunks", "chunk_slots", "group_tokens", "compress_keys", "CompressedKeys", "chunk_visible"]


def num_chunks(t: int, kernel_size: int, stride: int) -> int:
    return 0 if t < kernel_size else (t - kernel_size) // stride + 1


def chunk_slots(max_len: int, kernel_size: int, stride: int) -> int:
    """Chunks `CompressedKeys` holds for `max_len` positions: num_chunks(max_len), plus one that
    never becomes visible when (max_len - kernel_size) is not a multiple of stride (`append`
    writes each step's partial window to the next chunk, which must exist)."""
    if max_len < kernel_size:
        return 1
    return -(-(max_len - kernel_size) // stride) + 1


def group_tokens(kernel_size: int, stride: int) -> int:
    """The tokens of one group `CompressedKeys` sums in decode: gcd(kernel_size, stride), so a
    window is kernel_size / group whole groups."""
    return math.gcd(kernel_size, stride)


def chunk_visible(chunks: jax.Array, positions: jax.Array, kernel_size: int, stride: int) -> jax.Array:
    """chunks int [N] and positions int [...] -> bool [..., N]: the chunk's window is complete
    at or before the position."""
    end = chunks * stride + (kernel_size - 1)
    return end.reshape((1,) * positions.ndim + (-1,)) <= positions[..., None]


def compress_keys(k: jax.Array, kernel_size: int = 32, stride: int = 16) -> jax.Array:
    """k [B, T, K, D] -> kc [B, N_c, K, D] (the dtype of k; means accumulated in float32)."""
    if k.ndim != 4:
        raise ValueError(f"k must be [B, T, K, D], got shape {k.shape}")
    if kernel_size < 1 or stride < 1:
        raise ValueError(f"kernel_size and stride must be >= 1, got {kernel_size}, {stride}")
    b, t, h, d = k.shape
    n = num_chunks(t, kernel_size, stride)
    if n == 0:
        return jnp.zeros((b, 0, h, d), k.dtype)
    # Sums of strided slices, not lax.reduce_window: XLA may lower a summing reduce_window to
    # a convolution with a dense [N, T] window matrix, a T^2 buffer (32 GiB at 32K tokens).
    kf = k.astype(jnp.float32)
    if kernel_size % stride == 0:
        # stride-sized group sums, then kernel_size / stride consecutive groups per chunk
        groups = kf[:, : (t // stride) * stride].reshape(b, t // stride, stride, h, d).sum(axis=2)
        acc = sum(groups[:, j: j + n] for j in range(kernel_size // stride))
    else:
        acc = sum(kf[:, j: j + (n - 1) * stride + 1: stride] for j in range(kernel_size))
    return (acc / kernel_size).astype(k.dtype)


@struct.dataclass
class CompressedKeys:
    """Incremental compressed keys of one layer.

    kc   [B, N_max, K, D]  chunk c valid iff its window ends at or before the last appended
                           position (use `num_chunks(position + 1, ...)`); the rest is stale.
                           N_max = chunk_slots(max_len, ...).
    sums m arrays [B, K, D] float32: the key sums of the last m groups of g tokens, g =
         gcd(kernel_size, stride), m = kernel_size / g. Group j (tokens [j*g, (j+1)*g)) sits in
         sums[j % m]; the newest may be partial. A window is m whole groups, so its mean is
         sum(sums) / kernel_size once its last token is in.
    """

    kc: jax.Array
    sums: tuple
    kernel_size: int = struct.field(pytree_node=False)
    stride: int = struct.field(pytree_node=False)

    @classmethod
    def from_keys(cls, k: jax.Array, max_len: int, kernel_size: int = 32, stride: int = 16,
                  lengths: jax.Array | None = None) -> "CompressedKeys":
        """Seed from prefill keys k [B, T, K, D] (positions 0..T-1) with room for `max_len`
        tokens. `lengths` [B] (default T) are the real lengths of right-padded sequences.

        Chunks whose window reaches into a sequence's padding are stale, but a chunk becomes
        visible only when its window completes, and `append` rewrites it at that moment. The
        group sums count each sequence's own keys only.
        """
        b, t, h, d = k.shape
        n_max = chunk_slots(max_len, kernel_size, stride)
        kc = compress_keys(k, kernel_size, stride)
        kc = jnp.pad(kc, ((0, 0), (0, n_max - kc.shape[1]), (0, 0), (0, 0)))
        if lengths is None:
            lengths = jnp.full((b,), t, jnp.int32)
        g = group_tokens(kernel_size, stride)
        m, n_groups = kernel_size // g, -(-t // g)
        kf = jnp.where(jnp.arange(t)[None, :, None, None] < lengths[:, None, None, None], k.astype(jnp.float32), 0)
        groups = jnp.pad(kf, ((0, 0), (0, n_groups * g - t), (0, 0), (0, 0))).reshape(b, n_groups, g, h, d).sum(2)
        last = (lengths - 1) // g  # the newest group of each sequence, -1 for an empty one
        sums = []
        for i in range(m):
            j = last - (last - i) % m  # the newest group <= last in slot i
            s = jnp.take_along_axis(groups, jnp.clip(j, 0, n_groups - 1)[:, None, None, None], axis=1)[:, 0]
            sums.append(jnp.where((j >= 0)[:, None, None], s, 0.0))
        return cls(kc, tuple(sums), kernel_size, stride)

    def append(self, k_new: jax.Array, positions: jax.Array) -> "CompressedKeys":
        """Append one key per sequence: k_new [B, K, D] at positions int [B] (< max_len), each one
        past the sequence's last (a position appended again counts its key twice, unless it starts
        a group of g tokens, where its group restarts).

        Every step writes sum(sums) / kernel_size to chunk ceil(start / stride), start = position
        + 1 - kernel_size (0 if negative): the mean of the window it completes when start is a
        multiple of stride, else a value for the next chunk, not yet visible, which its own
        completion rewrites. Indices are then always in range, and the group sums are updated
        element by element, in place: the step is one elementwise kernel and one write, with no
        bounds check (a decode step's launch count is its cost at small sizes: docs/decisions.md)."""
        l, s = self.kernel_size, self.stride
        g, m = group_tokens(l, s), len(self.sums)
        rows = jnp.arange(k_new.shape[0])
        kf = k_new.astype(jnp.float32)
        fresh = (positions % g == 0)[:, None, None]  # the token starts a group: its slot restarts
        slot = (positions // g) % m
        sums = tuple(jnp.where((slot == i)[:, None, None], jnp.where(fresh, kf, x + kf), x)
                     for i, x in enumerate(self.sums))
        mean = (sum(sums) / l).astype(self.kc.dtype)
        c = jnp.clip(-(-(positions + 1 - l) // s), 0, self.kc.shape[1] - 1)
        # one row each, in row order: unique and sorted; c < N_max by chunk_slots
        kc = self.kc.at[rows, c].set(mean, mode="promise_in_bounds", unique_indices=True,
                                     indices_are_sorted=True)
        return self.replace(kc=kc, sums=sums)
