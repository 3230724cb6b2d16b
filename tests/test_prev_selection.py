"""The previous-layer probe's counts against a set-by-set NumPy count."""

import jax.numpy as jnp
import numpy as np

from sparda_jax import SparseConfig
from sparda_jax.eval.prev_selection import prev_selection_counts


def test_counts_match_sets():
    sp = SparseConfig(block_size=4, init_blocks=1, local_blocks=1, topk=5, dense_len=0, kernel_size=4, kernel_stride=2)
    rng = np.random.default_rng(0)
    L, B, K, T, n, nb = 3, 2, 2, 24, 5, 6
    pos = np.tile(np.arange(T), (B, 1))

    def draw():  # n distinct candidate blocks a row, some rows -1 padded
        out = np.full((L, B, K, T, n), -1)
        for idx in np.ndindex(L, B, K, T):
            c = pos[idx[1], idx[3]] // sp.block_size + 1
            m = rng.integers(1, min(c, n) + 1)
            out[idx][:m] = rng.choice(c, m, replace=False)
        return out

    ids, oracle = draw(), draw()
    got = np.asarray(prev_selection_counts(jnp.asarray(ids), jnp.asarray(oracle), jnp.asarray(pos), sp, nb))
    want = np.zeros((L - 1, 6), np.int64)
    for l in range(1, L):
        for b, k, t in np.ndindex(B, K, T):
            qb = pos[b, t] // sp.block_size
            content = {x for x in range(qb + 1) if not (x < sp.init_blocks or x >= qb - sp.local_blocks)}
            s = set(ids[l, b, k, t]) & content
            o = set(oracle[l, b, k, t]) & content
            p = set(ids[l - 1, b, k, t])
            miss, left = o - s, content - s
            want[l - 1] += [len(o), len(o & s), len(miss), len(miss & p), len(left), len(left & p)]
    np.testing.assert_array_equal(got, want)
