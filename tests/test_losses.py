"""Forecast training targets: partition KL, fine teacher, student, exclusions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import ForecastConfig, SparseConfig
from sparda_jax.compress import compress_keys
from sparda_jax.losses import (check_grids, excluded_positions, layer_loss, partition_kl, student_probs,
                               teacher_scores)


def test_partition_kl_spec_example():
    t = jnp.array([0.40, 0.30, 0.20, 0.10])
    s = jnp.array([0.35, 0.25, 0.15, 0.25])
    # k = 2 keeps positions 0, 1 and merges the rest: (0.40, 0.30, 0.30) vs (0.35, 0.25, 0.40)
    expected = 0.40 * math.log(0.40 / 0.35) + 0.30 * math.log(0.30 / 0.25) + 0.30 * math.log(0.30 / 0.40)
    assert float(partition_kl(t, s, 2)) == pytest.approx(expected, rel=1e-6)


def test_partition_kl_penalizes_mass_outside_the_set():
    t = jnp.array([0.40, 0.30, 0.20, 0.10])
    inside_same = jnp.array([0.40, 0.30, 0.15, 0.15])  # same inside ratios, same outside mass
    moved_out = jnp.array([0.20, 0.15, 0.35, 0.30])    # same inside ratio 4:3, more mass outside
    a, b = float(partition_kl(t, inside_same, 2)), float(partition_kl(t, moved_out, 2))
    assert a == pytest.approx(0.0, abs=1e-7)
    assert b > 0.1
    # keeping only the top two and renormalizing would call both students perfect
    top2 = lambda p: p[:2] / p[:2].sum()
    assert float(jnp.sum(top2(t) * jnp.log(top2(t) / top2(moved_out)))) == pytest.approx(0.0, abs=1e-7)


def test_partition_kl_without_the_rest_bucket():
    t = jnp.array([0.40, 0.30, 0.20, 0.10])
    s = jnp.array([0.35, 0.25, 0.15, 0.25])
    tk, sk = (0.40 / 0.70, 0.30 / 0.70), (0.35 / 0.60, 0.25 / 0.60)  # both renormalized over {0, 1}
    expected = sum(a * math.log(a / b) for a, b in zip(tk, sk))
    # a small KL from float32 terms of ~0.1 that cancel: the error is ~1e-7 of the terms, absolute
    assert float(partition_kl(t, s, 2, rest=False)) == pytest.approx(expected, abs=1e-7)
    # its blind spot, the reason the bucket exists: mass moved out of the kept set costs nothing
    moved_out = jnp.array([0.20, 0.15, 0.35, 0.30])
    assert float(partition_kl(t, moved_out, 2, rest=False)) == pytest.approx(0.0, abs=1e-7)


def test_partition_kl_scale_invariance_and_empty_rows():
    rng = np.random.default_rng(0)
    t = jnp.asarray(rng.random((3, 7)))
    s = jnp.asarray(rng.random((3, 7)))
    np.testing.assert_allclose(partition_kl(3 * t, s, 3), partition_kl(t, 5 * s, 3), rtol=1e-5)
    z = partition_kl(jnp.zeros((2, 5)), jnp.ones((2, 5)), 2)
    np.testing.assert_array_equal(z, 0.0)
    assert bool(jnp.all(partition_kl(t, s, 3) >= -1e-7))


def _teacher_loop(q, k, p, *, l, s, lf, sf, n_c):
    """NumPy loops: fine compression, per-head softmax over visible fine windows, group sum,
    coarse c = max over fine windows inside tokens [c*s, c*s + l)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, tq, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    t = k.shape[1]
    nf = (t - lf) // sf + 1
    kf = np.stack([k[:, j * sf: j * sf + lf].mean(1) for j in range(nf)], 1)
    out = np.zeros((b, kh, tq, n_c))
    for bi in range(b):
        for i in range(tq):
            pos = int(p[bi, i])
            vis = [j for j in range(nf) if j * sf + lf - 1 <= pos]
            for m in range(kh):
                fine = np.zeros(nf)
                for hh in range(m * g, (m + 1) * g):
                    if not vis:
                        continue
                    z = np.array([q[bi, i, hh] @ kf[bi, j, m] / math.sqrt(d) for j in vis])
                    e = np.exp(z - z.max())
                    fine[vis] += e / e.sum()
                for c in range(n_c):
                    if c * s + l - 1 > pos:
                        continue
                    inside = [j for j in range(nf) if j * sf >= c * s and j * sf + lf <= c * s + l]
                    out[bi, m, i, c] = max(fine[j] for j in inside)
    return out


def test_teacher_matches_loop_reference():
    sp = SparseConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=1, topk=4, dense_len=0)
    fc = ForecastConfig(teacher_kernel_size=2, teacher_kernel_stride=1, supervision_k=4)
    ks = jax.random.split(jax.random.key(0), 3)
    b, t, kh, g, d = 2, 60, 2, 3, 8
    k = jax.random.normal(ks[0], (b, t, kh, d))
    q = jax.random.normal(ks[1], (b, 7, kh * g, d)) * 2
    pos = jnp.array([[5, 9, 20, 33, 41, 50, 59], [0, 7, 8, 30, 31, 47, 58]], jnp.int32)
    n_c = (t - 8) // 4 + 1
    ours = teacher_scores(q, k, pos, sp, fc, n_c)
    np.testing.assert_allclose(ours, _teacher_loop(q, k, pos, l=8, s=4, lf=2, sf=1, n_c=n_c), atol=1e-6)


def test_student_is_a_distribution_over_visible_positions():
    sp = SparseConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=1, topk=4, dense_len=0)
    ks = jax.random.split(jax.random.key(1), 2)
    f = jax.random.normal(ks[0], (1, 4, 2, 8))
    kc = jax.random.normal(ks[1], (1, 12, 2, 8))
    pos = jnp.array([[7, 8, 20, 55]], jnp.int32)
    p = student_probs(f, kc, pos, sp)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    # position 7: only chunk 0 (tokens 0..7) is complete; position 20: chunks 0..3
    assert float(p[0, 0, 0, 0]) == pytest.approx(1.0) and float(p[0, 0, 2, 4:].sum()) == 0.0


def test_excluded_positions_hand_case():
    # block 16, chunk c covers [4c, 4c + 8): chunk 3 (12..19) touches blocks 0 and 1.
    sp = SparseConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=1, topk=4, dense_len=0)
    ex = excluded_positions(15, jnp.array([[63]]), sp)[0, 0]  # q_blk 3: local blocks 2, 3
    # excluded: chunks touching block 0 (c = 0..3) or blocks >= 2 (c >= 7: 28..35 touches block 2)
    np.testing.assert_array_equal(np.flatnonzero(~np.asarray(ex)), [4, 5, 6])


def test_grids_must_tile():
    with pytest.raises(ValueError, match="tile"):
        check_grids(SparseConfig(), ForecastConfig(teacher_kernel_size=3, teacher_kernel_stride=2))


def test_layer_loss_chunk_invariant_with_gradient():
    sp = SparseConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=1, topk=4, dense_len=0)
    fc = ForecastConfig(supervision_k=4)
    ks = jax.random.split(jax.random.key(2), 3)
    b, t, kh, g, d = 1, 96, 2, 2, 8
    q = jax.random.normal(ks[0], (b, t, kh * g, d))
    k = jax.random.normal(ks[1], (b, t, kh, d))
    f = jax.random.normal(ks[2], (b, t, kh, d))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    loss = lambda f, c: layer_loss(f, q, k, pos, sp, fc, q_chunk=c)
    (a, rows_a), (b_, rows_b) = loss(f, 7), loss(f, 96)
    assert int(rows_a) == int(rows_b) > 0
    assert float(a) == pytest.approx(float(b_), rel=1e-5)
    grad = jax.grad(lambda f: loss(f, 16)[0])(f)
    assert bool(jnp.all(jnp.isfinite(grad))) and float(jnp.abs(grad).sum()) > 0
    # no gradient reaches the teacher's inputs
    gq = jax.grad(lambda q: layer_loss(f, q, k, pos, sp, fc)[0])(q)
    np.testing.assert_array_equal(gq, 0.0)


def test_layer_loss_fused_gradient_equals_autodiff_of_the_plain_loss():
    # layer_loss computes d/df chunk by chunk in its forward pass (custom VJP); the reference is
    # jax.grad of the same objective written without chunks, over the whole sequence at once.
    sp = SparseConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=1, topk=4, dense_len=0)
    fc = ForecastConfig(supervision_k=5)
    ks = jax.random.split(jax.random.key(7), 4)
    b, t, kh, g, d = 2, 83, 2, 3, 8
    q = jax.random.normal(ks[0], (b, t, kh * g, d))
    k = jax.random.normal(ks[1], (b, t, kh, d))
    f = jax.random.normal(ks[2], (b, t, kh, d))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kc = compress_keys(k, sp.kernel_size, sp.kernel_stride)
    n_c = kc.shape[1]

    def plain(f):
        keep = ~excluded_positions(n_c, pos, sp)[:, None]
        teacher = teacher_scores(q, k, pos, sp, fc, n_c) * keep
        kl = partition_kl(teacher, student_probs(f, kc, pos, sp) * keep, fc.supervision_k)
        return jnp.sum(jnp.where(jnp.sum(teacher, -1) > 0, kl, 0.0))

    want_val, want_grad = jax.value_and_grad(plain)(f)
    ct = jax.random.uniform(ks[3], ()) + 0.5                 # a cotangent other than 1
    got_val, pull = jax.vjp(lambda f: layer_loss(f, q, k, pos, sp, fc, q_chunk=16)[0], f)
    (got_grad,) = pull(ct)
    assert float(got_val) == pytest.approx(float(want_val), rel=1e-5)
    # f32 sums in another order: relative error ~1e-6, far below any real gradient difference
    np.testing.assert_allclose(got_grad, ct * want_grad, rtol=1e-4, atol=1e-6 * float(jnp.abs(want_grad).max()))
    assert float(jnp.abs(want_grad).sum()) > 0
