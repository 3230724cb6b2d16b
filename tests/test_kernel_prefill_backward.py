"""The Mosaic GPU block-sparse prefill backward kernels against the jnp backward (and the
forward kernel's lse against the reference's): the transposed metadata against plain numpy,
the kernels in interpret mode on the CPU, the Hopper lowering on the CPU, and compiled on the
GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import (INTERPRET, PLAIN_ERROR_FLOOR, ROUNDED_P_FACTOR, gpu, interpret, lower_for_hopper,
                         rel_error)
from test_kernel_prefill import _case

from sparda_jax.ops.sparse_attention.prefill import build_prefill_meta, sparse_prefill_attention
from sparda_jax.ops.sparse_attention.prefill_backward import build_transposed_meta, sparse_prefill_attention_backward
from sparda_jax.ops.sparse_attention.reference import (sparse_attention_backward_reference,
                                                       sparse_attention_reference_with_lse)


def test_transposed_meta_lists_the_tiles_of_each_block():
    rng = np.random.default_rng(0)
    b, kh, t, n, tt, nb = 2, 2, 64, 5, 8, 12
    ids = rng.integers(-1, nb + 2, (b, kh, t, n)).astype(np.int32)    # ids >= nb select nothing
    ids[0, 0, :, :] = -1                                              # a head that selects nothing
    tm = jax.tree.map(np.asarray, build_transposed_meta(build_prefill_meta(jnp.asarray(ids), tt, nb), nb))
    for bi in range(b):
        for h in range(kh):
            for j in range(nb):
                tiles, bits = [], []
                for i in range(t // tt):
                    rows = ids[bi, h, i * tt:(i + 1) * tt]
                    mask = sum(1 << r for r in range(tt) if j in rows[r])
                    if mask:
                        tiles.append(i)
                        bits.append(mask)
                lo, hi = int(tm.offsets[bi, h, j]), int(tm.offsets[bi, h, j + 1])
                np.testing.assert_array_equal(tm.tiles[bi, h, lo:hi], tiles)
                np.testing.assert_array_equal(tm.bits[bi, h, lo:hi], np.array(bits, np.uint32).view(np.int32))
    assert int(tm.offsets[0, 0, -1]) == 0


def _grads_case(seed, g, d, dtype, *, bias, kernel_forward=None, **kw):
    """kernel_forward: "interpret" or "compiled": out and lse from the prefill kernel so run;
    None: from the jnp reference."""
    q, k, v, ids, pos, cis = _case(seed, g, d, dtype, bias=bias, **kw)
    ids = ids.at[:, :, 7, 1:].set(ids[:, :, 7, :1])                   # query 7: one block repeated
    if kernel_forward:
        fwd = functools.partial(sparse_prefill_attention, bias=cis, return_lse=True,
                                interpret=INTERPRET if kernel_forward == "interpret" else None)
        out, lse = jax.jit(fwd)(q, k, v, ids, pos)
    else:
        out, lse = sparse_attention_reference_with_lse(q, k, v, ids, pos, bias=cis)
    dout = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), dtype)
    return q, k, v, ids, pos, cis, out, lse, dout


def _check_lse(q, k, v, ids, pos, cis, out, lse, dout):
    """The forward kernel's lse against the f32 reference's: f32 logits of the same rounded
    inputs, approximate exp2/log2 (approx_math) ~1e-6 relative. Query 3 selects nothing."""
    f32 = lambda x: x.astype(jnp.float32)
    want = sparse_attention_reference_with_lse(f32(q), f32(k), f32(v), ids, pos, bias=cis)[1]
    assert np.isneginf(np.asarray(lse[:, 3])).all()
    got, want = np.delete(np.asarray(lse), 3, axis=1), np.delete(np.asarray(want), 3, axis=1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _check_grads(got, q, k, v, ids, pos, cis, out, lse, dout):
    """Each gradient against the f32 jnp backward on the same rounded inputs; the jnp backward
    in the kernel's dtype (f32 arithmetic, rounded results) gives the plain error, and the
    kernel rounds P and dS to 16 bits for its matmuls (kernel_base.ROUNDED_P_FACTOR)."""
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        exact = sparse_attention_backward_reference(f32(q), f32(k), f32(v), ids, pos, f32(out), lse, f32(dout),
                                                    bias=cis)
        plain = sparse_attention_backward_reference(q, k, v, ids, pos, out, lse, dout, bias=cis)
    for name, a, e, p, like in zip("q k v bias".split(), got, exact, plain, (q, k, v, cis)):
        if like is None:
            assert a is None
            continue
        assert a.shape == like.shape and a.dtype == (jnp.float32 if name == "bias" else like.dtype), name
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
        err, base = rel_error(a, e), rel_error(p, e)
        assert err <= ROUNDED_P_FACTOR * max(base, PLAIN_ERROR_FLOOR), (name, err, base)


def test_interpret_matches_the_jnp_backward_without_races():
    """Both kernels in interpret mode, under the race detector (the barrier protocol of their
    double buffers), fed the forward kernel's out and lse, against the jnp backward. Ragged
    offsets (T and S not multiples of 64, two sequence lengths), -1 padding, a query with no
    block (3) and one with a repeated block (7), f16, bias, G = 16 (4 tokens per tile). G = 3
    (padded to 4), bf16, head dim 128 without bias runs through the VJP in
    test_sparse_attention_grad."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    args = _grads_case(80, 16, 64, jnp.float16, bias=True, kh=1, t=12, s=200, n=3, kernel_forward="interpret")
    q, k, v, ids, pos, cis, out, lse, dout = args
    _check_lse(*args)
    f = functools.partial(sparse_prefill_attention_backward, bias=cis, interpret=interpret(detect_races=True))
    got = jax.jit(f)(q, k, v, ids, pos, out, lse, dout)
    assert not gpu_callbacks.get_races().races_found
    _check_grads(got, *args)
    assert (np.asarray(got[0][:, 3], np.float32) == 0).all()          # query 3 saw nothing


def test_gpu_form_lowers_for_hopper():
    """The compiled form (A operands from registers, accumulators in place) through the Mosaic
    GPU lowering for sm_90 on the CPU; the forward with its lse output too."""
    q, k, v, ids, pos, cis, out, lse, dout = _grads_case(0, 16, 128, jnp.bfloat16, bias=True, t=70, s=256, n=3)
    lower_for_hopper(functools.partial(sparse_prefill_attention_backward, bias=cis), q, k, v, ids, pos, out, lse, dout)
    lower_for_hopper(functools.partial(sparse_prefill_attention, bias=cis, return_lse=True), q, k, v, ids, pos)


def test_rejects_mismatched_residuals():
    q, k, v, ids, pos, _, out, lse, dout = _grads_case(0, 3, 64, jnp.bfloat16, bias=False, t=8, s=64, n=2)
    with pytest.raises(ValueError, match="lse"):
        sparse_prefill_attention_backward(q, k, v, ids, pos, out, lse[..., :1], dout)
    with pytest.raises(TypeError, match="bf16/f16"):
        sparse_prefill_attention_backward(q.astype(jnp.float32), k, v, ids, pos, out, lse, dout)


@gpu
@pytest.mark.parametrize("g,d,bias", [(16, 128, True), (3, 64, False)])
def test_compiled_matches_the_jnp_backward(g, d, bias):
    args = _grads_case(g + d, g, d, jnp.bfloat16, bias=bias, t=300, s=1000, n=6, kernel_forward="compiled")
    q, k, v, ids, pos, cis, out, lse, dout = args
    _check_lse(*args)
    got = jax.jit(functools.partial(sparse_prefill_attention_backward, bias=cis))(q, k, v, ids, pos, out, lse, dout)
    _check_grads(got, *args)
