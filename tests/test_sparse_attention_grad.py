"""Gradients of block-sparse attention (the custom VJP of `sparse_attention`, its jnp backward)
against autodiff of an independent dense attention masked to the same blocks, in float32; the
backward's memory bound; the Mosaic backend (interpret mode) under the same VJP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import BF16_PAIR_PREFILL, rel_error

from sparda_jax.ops.sparse_attention import (sparse_attention, sparse_attention_backward_reference,
                                             sparse_attention_reference, sparse_attention_reference_with_lse)

BS = 64
# float32 throughout: the two sides sum the same products over up to n * 64 keys (and the
# dense side over S keys with exact zeros) in different orders; each carries ~sqrt(N) * 6e-8
# relative rounding of the gradient's scale, ~1e-6 here, so 1e-5 of the scale has headroom.
RTOL = 1e-5
ATOL_OF_SCALE = 1e-5


def _mask(ids, pos, s):
    """The visibility of block-sparse attention built directly: [B, K, Tq, S] bool, key j seen
    by query t iff its block j // 64 is among the row's ids (-1 = none, repeats irrelevant),
    j <= q_positions[b, t] and j < S."""
    b, kh, tq, _ = ids.shape
    m = np.zeros((b, kh, tq, s), bool)
    for bi in range(b):
        for h in range(kh):
            for t in range(tq):
                for blk in set(ids[bi, h, t].tolist()) - {-1}:
                    m[bi, h, t, blk * BS:(blk + 1) * BS] = True
                m[bi, h, t, int(pos[bi, t]) + 1:] = False
    return m


def _masked_dense(q, k, v, bias, mask):
    """Dense GQA softmax attention over a given visibility mask [B, K, Tq, S]; rows with nothing
    visible give zeros. Plain jnp, differentiated by autodiff."""
    b, tq, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    logits = jnp.einsum("BTKGD,BSKD->BKGTS", q.reshape(b, tq, kh, g, d), k) / math.sqrt(d)
    if bias is not None:
        logits = logits + jnp.transpose(bias, (0, 2, 1))[:, :, None, None, :]
    vis = jnp.asarray(mask)[:, :, None]
    logits = jnp.where(vis, logits, -1e30)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) * vis
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("BKGTS,BSKD->BTKGD", p, v).reshape(b, tq, h, d)


def _case(seed, g, d, *, kh=2, b=2, t=70, s=300, n=5, bias=False, dtype=jnp.float32):
    """Chunked prefill on ragged sequences: sequence 0 ends at S - 1 (S not a multiple of 64:
    a partial last block), sequence 1 is 45 tokens shorter (its later keys are never visible);
    T queries at each sequence's last T positions (T not a multiple of the chunk). Ids in any
    order with -1 anywhere, duplicates and blocks in the future (invisible); query 5 selects
    nothing, query 6 one block repeated."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(sh), dtype) for sh in
               ((b, t, kh * g, d), (b, s, kh, d), (b, s, kh, d)))
    lengths = np.array([s, s - 45, s - 3][:b])
    pos = (lengths[:, None] - t + np.arange(t)[None]).astype(np.int32)
    nb = -(-s // BS)
    ids = rng.integers(-1, nb, (b, kh, t, n)).astype(np.int32)
    ids[..., 0] = pos[:, None, :] // BS                        # the own block, mostly
    ids[:, :, 5] = -1
    ids[:, :, 6] = ids[:, :, 6, :1]
    cis = jnp.asarray(rng.standard_normal((b, s, kh)), jnp.float32) if bias else None
    w = jnp.asarray(rng.standard_normal((b, t, kh * g, d)), jnp.float32)   # the loss's weights
    return q, k, v, cis, ids, pos, w


def _out_and_grads(attend, q, k, v, cis, w, *extra):
    """Under one jax.jit: out = attend(q, k, v, bias, *extra) and the gradients of
    sum(w * out) in q, k, v (and bias), by jax.vjp; extra (ids, positions) are traced."""
    def run(q_, k_, v_, b_, w_, *extra_):
        diff = (q_, k_, v_) + (() if b_ is None else (b_,))
        out, pull = jax.vjp(lambda *a: attend(*a[:3], a[3] if len(a) > 3 else None, *extra_), *diff)
        return out, pull(w_.astype(out.dtype))
    return jax.jit(run)(q, k, v, cis, w, *extra)


def _assert_grads_close(got, want):
    assert len(got) == len(want)
    for name, a, r in zip("q k v bias".split(), got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=RTOL, atol=ATOL_OF_SCALE * scale,
                                   err_msg=f"d{name}")


@pytest.mark.parametrize("g,d,bias", [(1, 64, True), (3, 128, False), (4, 64, True)])
def test_grads_match_masked_dense_autodiff(g, d, bias):
    """The custom VJP under jax.jit (ids and positions traced) against autodiff of the masked
    dense attention; the forward too."""
    q, k, v, cis, ids, pos, w = _case(g + d, g, d, bias=bias)
    mask = _mask(ids, pos, k.shape[1])
    assert not mask[:, :, 5].any() and mask[1, :, :, -45:].sum() == 0    # the case has what it claims
    sparse = lambda q_, k_, v_, b_, ids_, pos_: sparse_attention(q_, k_, v_, ids_, pos_, bias=b_, implementation="xla")
    dense = lambda q_, k_, v_, b_: _masked_dense(q_, k_, v_, b_, mask)
    with jax.default_matmul_precision("highest"):
        out, got = _out_and_grads(sparse, q, k, v, cis, w, jnp.asarray(ids), jnp.asarray(pos))
        want_out, want = _out_and_grads(dense, q, k, v, cis, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=RTOL, atol=ATOL_OF_SCALE)
    _assert_grads_close(got, want)
    assert (np.asarray(got[0][:, 5]) == 0).all()                         # query 5 saw nothing


def test_jit_grad_equals_autodiff_of_the_reference():
    """jax.jit(jax.grad(...)) through the custom VJP gives what autodiff through the plain jnp
    forward gave before it (the same chunked forward, differentiated op by op)."""
    q, k, v, cis, ids, pos, w = _case(1, 3, 64, bias=True, b=1, t=24, s=130, n=3)

    def loss(attend, q_, k_, v_, b_):
        return jnp.sum(w * attend(q_, k_, v_, jnp.asarray(ids), jnp.asarray(pos), bias=b_))

    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.grad(functools.partial(loss, functools.partial(sparse_attention, implementation="xla")),
                               argnums=(0, 1, 2, 3)))(q, k, v, cis)
        want = jax.jit(jax.grad(functools.partial(loss, sparse_attention_reference), argnums=(0, 1, 2, 3)))(q, k, v, cis)
    _assert_grads_close(got, want)


def test_lse_is_the_log_partition_of_the_visible_logits():
    q, k, v, cis, ids, pos, _ = _case(2, 4, 64, bias=True, t=20, s=200)
    mask = _mask(ids, pos, k.shape[1])
    out, lse = sparse_attention_reference_with_lse(q, k, v, jnp.asarray(ids), jnp.asarray(pos), bias=cis)
    b, t, h, d = q.shape
    qd, kd, bd = (np.asarray(x, np.float64) for x in (q, k, cis))
    logits = np.einsum("BTKGD,BSKD->BKGTS", qd.reshape(b, t, 2, h // 2, d), kd) / math.sqrt(d)
    logits += bd.transpose(0, 2, 1)[:, :, None, None, :]
    vis = np.broadcast_to(mask[:, :, None], logits.shape)
    with np.errstate(divide="ignore"):
        want = np.log(np.sum(np.where(vis, np.exp(logits), 0), axis=-1))          # [B, K, G, T]
    want = want.transpose(0, 3, 1, 2).reshape(b, t, h)
    assert lse.shape == (b, t, h) and lse.dtype == jnp.float32
    assert np.isneginf(np.asarray(lse[:, 5])).all()                  # query 5 sees nothing
    np.testing.assert_allclose(np.asarray(lse), want, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(sparse_attention_reference(
        q, k, v, jnp.asarray(ids), jnp.asarray(pos), bias=cis)), rtol=1e-6, atol=1e-6)


def test_backward_memory_is_bounded():
    """The compiled gradient at Tq = S = 32K holds O(chunk * selected keys) temporaries besides
    a few [T, D] arrays, far below one [Tq, S] float32 matrix (4 GiB): no dense scores and no
    per-query gathered K/V (autodiff of the chunked forward keeps those, ~2 GiB at 16K)."""
    b, t, kh, d, n = 1, 32768, 1, 64, 4
    q = kv = jax.ShapeDtypeStruct((b, t, kh, d), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, kh, t, n), jnp.int32)
    pos = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q_, k_, v_, ids_, pos_):
        return jnp.sum(sparse_attention(q_, k_, v_, ids_, pos_, implementation="xla"))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    temp = grad.lower(q, kv, kv, ids, pos).compile().memory_analysis().temp_size_in_bytes
    dense_scores, t_by_d = t * t * 4, t * d * 4
    assert temp < dense_scores / 64 and temp < 16 * t_by_d, (temp, dense_scores, t_by_d)


def test_mosaic_interpret_under_the_vjp():
    """The Mosaic backend (interpret mode, bf16: the prefill kernel forward, its lse from jnp,
    the backward kernels) gives the "xla" backend's gradients within bf16 rounding. G = 3
    (padded to 4 rows per token), head dim 128, ragged, -1 padding, duplicate ids."""
    q, k, v, cis, ids, pos, w = _case(3, 3, 128, kh=1, b=2, t=12, s=150, n=3, dtype=jnp.bfloat16)
    ids, pos = jnp.asarray(ids), jnp.asarray(pos)
    grads = {}
    for impl in ("mosaic_gpu_interpret", "xla"):
        attend = lambda q_, k_, v_, b_, impl=impl: sparse_attention(q_, k_, v_, ids, pos, bias=b_, implementation=impl)
        grads[impl] = _out_and_grads(attend, q, k, v, cis, w)[1]
    for name, a, r in zip("q k v".split(), grads["mosaic_gpu_interpret"], grads["xla"]):
        assert a.dtype == r.dtype and bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
        assert rel_error(a, r) < BF16_PAIR_PREFILL, name


def test_backward_rejects_mismatched_residuals():
    q, k, v, _, ids, pos, _ = _case(4, 1, 64, t=8, s=64, n=2)
    ids, pos = jnp.asarray(ids), jnp.asarray(pos)
    out, lse = jnp.zeros_like(q), jnp.zeros(q.shape[:3], jnp.float32)
    with pytest.raises(ValueError, match="lse"):
        sparse_attention_backward_reference(q, k, v, ids, pos, out, lse[..., :1], out)
    with pytest.raises(ValueError, match="bias"):
        sparse_attention_backward_reference(q, k, v, ids, pos, out, lse, out, bias=jnp.zeros((2, 63, 2)))
