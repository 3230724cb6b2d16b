"""Compression, selection and block-sparse attention against the independent NumPy reference
(tests/selection_ref.py), hand-worked cases, and properties."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import selection_ref as ref
from sparda_jax import SparseConfig
from sparda_jax.attention import dense_attention_reference, sparse_attention
from sparda_jax.compress import CompressedKeys, compress_keys, num_chunks
from sparda_jax.select import (compress_cis, pool_to_blocks, select_blocks_forecast, select_blocks_infllmv2,
                               select_blocks_nosa)

# Small geometries with real choice: (block, kernel, stride). (16, 8, 4) is MiniCPM's shape
# scaled by 4 (overlap window 4k-1..4k+3); (8, 8, 4) has kernel == block.
GEOMS = [(16, 8, 4), (8, 8, 4), (16, 16, 4)]


def _sparse(block, kernel, stride, **kw):
    base = dict(block_size=block, kernel_size=kernel, kernel_stride=stride, init_blocks=1, local_blocks=1,
                topk=5, dense_len=0)
    base.update(kw)
    return SparseConfig(**base)


def _kw(s: SparseConfig):
    return dict(block_size=s.block_size, init_blocks=s.init_blocks, local_blocks=s.local_blocks, topk=s.topk,
                kernel_size=s.kernel_size, stride=s.kernel_stride)


def _rand(key, shape, scale=1.0):
    return jax.random.normal(key, shape, jnp.float32) * scale


def _positions(key, b, tq, t):
    """Random distinct positions in [0, t), ragged (not multiples of the block size)."""
    keys = jax.random.split(key, b)
    return jnp.stack([jnp.sort(jax.random.permutation(k, t)[:tq]) for k in keys]).astype(jnp.int32)


# --------------------------------------------------------------------------------- compression

@pytest.mark.parametrize("t,kernel,stride", [(37, 8, 4), (8, 8, 4), (5, 8, 4), (64, 32, 16), (50, 6, 3)])
def test_compress_keys_matches_reference(t, kernel, stride):
    k = _rand(jax.random.key(t), (2, t, 3, 4))
    ours = compress_keys(k, kernel, stride)
    assert ours.shape[1] == num_chunks(t, kernel, stride)
    np.testing.assert_allclose(ours, ref.compress_keys_ref(np.asarray(k), kernel, stride), atol=1e-6)


# kernel a multiple of stride (groups of stride tokens), not one (groups of gcd 2), equal (one group)
@pytest.mark.parametrize("kernel,stride", [(8, 4), (6, 4), (4, 4)])
def test_incremental_compression_matches_full(kernel, stride):
    t0, t1 = 13, 40
    k = _rand(jax.random.key(0), (2, t1, 2, 4))
    lengths = jnp.array([13, 9], jnp.int32)  # ragged prompts, right-padded to t0
    # padding slots hold garbage that must never leak into a visible chunk
    prompt = jnp.where(jnp.arange(t0)[None, :, None, None] < lengths[:, None, None, None], k[:, :t0], 99.0)
    state = CompressedKeys.from_keys(prompt, t1, kernel, stride, lengths=lengths)
    pos = lengths
    for _ in range(t1 - t0):
        state = state.append(k[jnp.arange(2), pos], pos)
        pos = pos + 1
    for b in range(2):
        n = num_chunks(int(pos[b]), kernel, stride)
        full = compress_keys(k[b:b + 1, : int(pos[b])], kernel, stride)
        np.testing.assert_allclose(state.kc[b:b + 1, :n], full, atol=1e-6)


# ---------------------------------------------------------------------------- hand-worked cases

def _hand_setup():
    """block 4, kernel 4, stride 2, one KV head, D=2. Tokens 8..11 carry 10*e0, all else 0.

    Chunk c covers tokens [2c, 2c+4): kc[3] (tokens 6..9) = 5 e0, kc[4] (8..11) = 10 e0,
    kc[5] (10..13) = 5 e0, every other chunk 0. Block k overlaps chunks 2k-1..2k+1, so block
    1 -> max(kc[1..3]) = 5, block 2 -> max(kc[3..5]) = 10, block 3 -> max(kc[5..7]) = 5, blocks
    0, 4, 5 -> 0 (with q = f = e0 the logit of chunk c is kc[c][0] / sqrt(2)).
    """
    t = 24
    k = np.zeros((1, t, 1, 2), np.float32)
    k[0, 8:12, 0, 0] = 10.0
    kc = compress_keys(jnp.asarray(k), 4, 2)
    sparse = SparseConfig(block_size=4, kernel_size=4, kernel_stride=2, init_blocks=1, local_blocks=1, topk=4,
                          dense_len=0)
    return kc, sparse


def test_hand_worked_infllmv2_and_forecast():
    kc, sparse = _hand_setup()
    np.testing.assert_allclose(kc[0, :, 0, 0], [0, 0, 0, 5, 10, 5, 0, 0, 0, 0, 0])
    # p=23: q_blk 5; forced {0} (init) and {4, 5} (local 1 + own block); one content block out of
    # {1, 2, 3}: block 2 (score from chunk 4 = 10) beats 1 and 3 (5) -> [0, 2, 4, 5].
    # p=9: q_blk 2; forced {0, 1, 2}; no other candidate -> [0, 1, 2, -1].
    # p=3: q_blk 0; only block 0 -> [0, -1, -1, -1].
    pos = jnp.array([[23, 9, 3]], jnp.int32)
    expected = [[0, 2, 4, 5], [0, 1, 2, -1], [0, -1, -1, -1]]
    q = jnp.broadcast_to(jnp.array([1.0, 0.0]), (1, 3, 1, 2))
    np.testing.assert_array_equal(select_blocks_infllmv2(q, kc, pos, sparse)[0, 0], expected)
    np.testing.assert_array_equal(select_blocks_forecast(q, kc, pos, sparse)[0, 0], expected)
    # a Forecast pointing the other way (f = -e0) prefers the zero-score blocks: at p=23 the
    # candidates 1 and 3 score -5/sqrt2, block 2 -10/sqrt2; the tie 1 vs 3 goes to the lower id.
    np.testing.assert_array_equal(select_blocks_forecast(-q, kc, pos, sparse)[0, 0, 0], [0, 1, 4, 5])


def test_hand_worked_chunk_visibility():
    """At p=10 chunk 4 (tokens 8..11) is not complete, so block 2's score comes from chunk 3 (5)
    only, tying block 1's (chunk 3 too): the tie goes to block 1.
    q_blk = 2, forced {0, 1, 2} already cover everything; raise topk and drop local to see it:
    local 0 -> forced {0, 2}; content candidates {1}: block 1 (chunk 3 visible: 6+4-1=9 <= 10)."""
    kc, sparse = _hand_setup()
    sparse = dataclasses.replace(sparse, local_blocks=0, topk=3)
    q = jnp.array([[[[1.0, 0.0]]]])
    np.testing.assert_array_equal(select_blocks_infllmv2(q, kc, jnp.array([[10]]), sparse)[0, 0, 0], [0, 1, 2])
    # at p=8 no chunk overlapping block 1 is complete except chunk 1 (2..5) and 2 (4..7): score 0,
    # still visible, so block 1 is chosen; at p=4 block 1 is the own block (forced).
    np.testing.assert_array_equal(select_blocks_infllmv2(q, kc, jnp.array([[8]]), sparse)[0, 0, 0], [0, 1, 2])


def test_pool_matches_minicpm_maxpool_geometry():
    # block 64, kernel 32, stride 16: block k = max over chunks 4k-1..4k+3
    s = SparseConfig()
    x = jnp.arange(40, dtype=jnp.float32)[None]
    pooled = pool_to_blocks(x, 10, s)[0]
    expected = [max(x[0, max(4 * k - 1, 0): 4 * k + 4]) if 4 * k - 1 < 40 else -np.inf for k in range(10)]
    np.testing.assert_array_equal(pooled, expected)


@pytest.mark.parametrize("geom", GEOMS)
def test_pool_matches_a_loop_on_random_scores(geom):
    """The reshape-and-max pool against a loop over each block's chunk window, on random scores
    with invisible (-inf) chunks, too few and too many chunks for the blocks."""
    block, kernel, stride = geom
    s = SparseConfig(block_size=block, kernel_size=kernel, kernel_stride=stride)
    r, left = block // stride, (kernel - 1) // stride
    rng = np.random.default_rng(block + kernel)
    for n, nb in [(7 * r + 1, 8), (8 * r, 8), (9 * r + 3, 8)]:
        x = rng.standard_normal((2, 3, n)).astype(np.float32)
        x[rng.random(x.shape) < 0.2] = -np.inf
        want = np.full((2, 3, nb), -np.inf, np.float32)
        for k in range(nb):
            lo, hi = max(r * k - left, 0), min(r * k + r, n)
            if lo < hi:
                want[..., k] = x[..., lo:hi].max(-1)
        np.testing.assert_array_equal(np.asarray(pool_to_blocks(jnp.asarray(x), nb, s)), want)


# ----------------------------------------------------------------------- random vs reference

@pytest.mark.parametrize("geom", GEOMS)
@pytest.mark.parametrize("g", [3, 2])
def test_infllmv2_matches_reference(geom, g):
    block, kernel, stride = geom
    b, t, kh, d = 2, 150, 2, 8
    ks = jax.random.split(jax.random.key(block * 10 + g), 4)
    k = _rand(ks[0], (b, t, kh, d))
    q = _rand(ks[1], (b, 23, kh * g, d), 2.0)
    pos = _positions(ks[2], b, 23, t)
    sparse = _sparse(block, kernel, stride, topk=6)
    kc = compress_keys(k, kernel, stride)
    ours = select_blocks_infllmv2(q, kc, pos, sparse, q_chunk=7)
    theirs = ref.select_infllmv2_ref(np.asarray(q), np.asarray(kc), np.asarray(pos), **_kw(sparse))
    np.testing.assert_array_equal(ours, theirs)


def test_infllmv2_coarse_lse_matches_reference():
    b, t, kh, g, d = 1, 170, 2, 3, 8
    ks = jax.random.split(jax.random.key(7), 3)
    k = _rand(ks[0], (b, t, kh, d))
    q = _rand(ks[1], (b, 31, kh * g, d), 2.0)
    pos = _positions(ks[2], b, 31, t)
    sparse = _sparse(16, 8, 4, topk=6, exact_lse=False, coarse_lse_kernel=32, coarse_lse_stride=16)
    kc = compress_keys(k, 8, 4)
    kc2 = compress_keys(k, 32, 16)
    ours = select_blocks_infllmv2(q, kc, pos, sparse, kc_coarse=kc2)
    theirs = ref.select_infllmv2_ref(np.asarray(q), np.asarray(kc), np.asarray(pos), **_kw(sparse),
                                     coarse_lse=(32, 16), k_raw=np.asarray(k))
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match="kc_coarse"):
        select_blocks_infllmv2(q, kc, pos, sparse)


@pytest.mark.parametrize("geom", GEOMS)
def test_forecast_matches_reference(geom):
    block, kernel, stride = geom
    b, t, kh, d = 2, 140, 3, 16
    ks = jax.random.split(jax.random.key(block + kernel), 3)
    kc = compress_keys(_rand(ks[0], (b, t, kh, d)), kernel, stride)
    f = _rand(ks[1], (b, 19, kh, d))
    pos = _positions(ks[2], b, 19, t)
    sparse = _sparse(block, kernel, stride, topk=7, local_blocks=2)
    ours = select_blocks_forecast(f, kc, pos, sparse, q_chunk=5)
    theirs = ref.select_forecast_ref(np.asarray(f), np.asarray(kc), np.asarray(pos), **_kw(sparse))
    np.testing.assert_array_equal(ours, theirs)


def test_nosa_matches_reference():
    block, kernel, stride = 16, 8, 4
    b, t, kh, g, d = 2, 160, 2, 2, 8
    ks = jax.random.split(jax.random.key(11), 4)
    k = _rand(ks[0], (b, t, kh, d))
    q = _rand(ks[1], (b, 17, kh * g, d), 2.0)
    cis = _rand(ks[2], (b, t, kh))
    pos = _positions(ks[3], b, 17, t)
    sparse = _sparse(block, kernel, stride, topk=7, nosa_qk_topk=5)
    kc = compress_keys(k, kernel, stride)
    ours = select_blocks_nosa(q, kc, compress_cis(cis, sparse), pos, sparse, q_chunk=6)
    nb = -(-t // block)
    qk_chunk = ref.infllmv2_chunk_scores_ref(np.asarray(q), np.asarray(kc), np.asarray(pos), kernel_size=kernel,
                                             stride=stride)
    qk_blocks = np.zeros((b, kh, 17, nb))
    for bi in range(b):
        for m in range(kh):
            for i in range(17):
                qk_blocks[bi, m, i] = ref.pool_chunks_to_blocks_ref(
                    qk_chunk[bi, m, i], int(pos[bi, i]), nb, block_size=block, kernel_size=kernel, stride=stride)
    cis_blocks = ref.cis_block_scores_ref(np.asarray(cis), nb, block_size=block, kernel_size=kernel, stride=stride,
                                          q_positions=np.asarray(pos))
    theirs = ref.nosa_select_ref(qk_blocks, cis_blocks, np.asarray(pos), block_size=block, init_blocks=1,
                                 local_blocks=1, qk_topk=5, topk=7)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("g,d", [(3, 16), (2, 8)])
def test_sparse_attention_matches_reference(with_bias, g, d):
    b, s, kh, tq, n, block = 2, 45, 2, 9, 4, 8
    ks = jax.random.split(jax.random.key(g * d + with_bias), 6)
    q = _rand(ks[0], (b, tq, kh * g, d))
    k = _rand(ks[1], (b, s, kh, d))
    v = _rand(ks[2], (b, s, kh, d))
    pos = _positions(ks[3], b, tq, s)
    nb = -(-s // block)
    ids = jax.random.randint(ks[4], (b, kh, tq, n), -1, nb)  # -1 padding and repeats included
    ids = ids.at[0, 0, 0].set(jnp.array([2, 2, -1, 0]))
    bias = _rand(ks[5], (b, s, kh)) if with_bias else None
    ours = sparse_attention(q, k, v, ids, pos, block_size=block, bias=bias)
    theirs = ref.sparse_attention_ref(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(ids), np.asarray(pos),
                                      None if bias is None else np.asarray(bias), block_size=block)
    np.testing.assert_allclose(ours, theirs, atol=2e-6)
    assert np.all(np.isfinite(ours))


def test_sparse_attention_bf16_error_is_bf16_sized():
    b, s, kh, g, d, tq, block = 1, 64, 2, 4, 16, 8, 8
    ks = jax.random.split(jax.random.key(3), 4)
    q, k, v = (_rand(kk, sh) for kk, sh in zip(ks, [(b, tq, kh * g, d), (b, s, kh, d), (b, s, kh, d)]))
    pos = jnp.arange(s - tq, s, dtype=jnp.int32)[None]
    ids = jnp.broadcast_to(jnp.array([0, 3, 6, 7]), (b, kh, tq, 4))
    exact = ref.sparse_attention_ref(*(np.asarray(a) for a in (q, k, v, ids, pos)), block_size=block)
    bf = sparse_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), ids, pos,
                          block_size=block)
    assert bf.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.asarray(bf, np.float64) - exact) / np.linalg.norm(exact)
    assert 1e-4 < rel < 1e-2, rel  # bf16 operands (docs/decisions.md, "Tolerances for low-precision operands": 1e-3..1e-2); > 1e-4 shows bf16 was used


def test_sparse_attention_rejects_bad_ids():
    q = jnp.ones((1, 3, 2, 4))
    k = v = jnp.ones((1, 8, 1, 4))
    pos = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="block_ids"):
        sparse_attention(q, k, v, jnp.zeros((1, 2, 3, 2), jnp.int32), pos, block_size=4)
    with pytest.raises(TypeError, match="integer"):
        sparse_attention(q, k, v, jnp.zeros((1, 1, 3, 2)), pos, block_size=4)


# ----------------------------------------------------------------------------------- properties

def test_topk_covering_all_blocks_reproduces_dense():
    b, t, kh, g, d, block = 2, 100, 2, 3, 8, 16
    ks = jax.random.split(jax.random.key(5), 4)
    q, k, v = _rand(ks[0], (b, t, kh * g, d)), _rand(ks[1], (b, t, kh, d)), _rand(ks[2], (b, t, kh, d))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    sparse = _sparse(block, 8, 4, topk=-(-t // block))
    ids = select_blocks_infllmv2(q, compress_keys(k, 8, 4), pos, sparse)
    out = sparse_attention(q, k, v, ids, pos, block_size=block)
    np.testing.assert_allclose(out, dense_attention_reference(q, k, v), atol=2e-6)


def test_selection_invariant_to_kv_head_order():
    b, t, kh, g, d = 1, 120, 3, 2, 8
    ks = jax.random.split(jax.random.key(9), 3)
    k = _rand(ks[0], (b, t, kh, d))
    q = _rand(ks[1], (b, 15, kh * g, d), 2.0)
    pos = _positions(ks[2], b, 15, t)
    sparse = _sparse(16, 8, 4, topk=6)
    perm = jnp.array([2, 0, 1])
    q_perm = q.reshape(b, 15, kh, g, d)[:, :, perm].reshape(b, 15, kh * g, d)
    base = select_blocks_infllmv2(q, compress_keys(k, 8, 4), pos, sparse)
    permuted = select_blocks_infllmv2(q_perm, compress_keys(k[:, :, perm], 8, 4), pos, sparse)
    np.testing.assert_array_equal(permuted, base[:, perm])
    f = q[:, :, ::g]
    np.testing.assert_array_equal(select_blocks_forecast(f[:, :, perm], compress_keys(k[:, :, perm], 8, 4), pos, sparse),
                                  select_blocks_forecast(f, compress_keys(k, 8, 4), pos, sparse)[:, perm])


def test_decode_with_incremental_keys_selects_as_prefill():
    b, t0, t1, kh, g, d = 1, 40, 90, 2, 2, 8
    sparse = _sparse(16, 8, 4, topk=5)
    ks = jax.random.split(jax.random.key(13), 2)
    k = _rand(ks[0], (b, t1, kh, d))
    q = _rand(ks[1], (b, t1, kh * g, d), 2.0)
    all_pos = jnp.arange(t1, dtype=jnp.int32)[None]
    prefill = select_blocks_infllmv2(q, compress_keys(k, 8, 4), all_pos, sparse)
    state = CompressedKeys.from_keys(k[:, :t0], t1, 8, 4)
    for p in range(t0, t1):
        pp = jnp.array([p], jnp.int32)
        state = state.append(k[:, p], pp)
        step = select_blocks_infllmv2(q[:, p:p + 1], state.kc, pp[:, None], sparse,
                                      n_blocks=-(-t1 // 16))
        np.testing.assert_array_equal(step[:, :, 0], prefill[:, :, p], err_msg=f"position {p}")
