"""The Mosaic GPU block-sparse decode kernel against its jnp reference: interpret mode on the
CPU, the Hopper lowering on the CPU, compiled on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax.kernels.sparse_decode import INTERPRET, sparse_decode_attention, sparse_decode_attention_reference


def _case(seed, g, d, k_heads=2, b=2, s=512, n=6):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, k_heads * g, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, k_heads, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, k_heads, d)), jnp.bfloat16)
    pos = jnp.asarray([s - 1, s // 2 + 44], jnp.int32)[:b]  # inside a block, not a multiple of 64
    ids = np.full((b, k_heads, n), -1, np.int32)
    for bi in range(b):
        own = int(pos[bi]) // 64
        for h in range(k_heads):
            cnt = [n, 3, 1, n - 1][(bi * k_heads + h) % 4]  # ragged lists, -1 padding
            ids[bi, h, :cnt] = sorted(rng.choice(own, cnt - 1, replace=False).tolist()) + [own]
    return q, k, v, jnp.asarray(ids), pos


def _rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("g,d", [(3, 64), (16, 128)])
def test_interpret_matches_reference(g, d):
    q, k, v, ids, pos = _case(g, g, d)
    f32 = lambda x: x.astype(jnp.float32)
    exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)  # the jnp path in bf16
    out = jax.jit(functools.partial(sparse_decode_attention, n_split=3, interpret=INTERPRET))(q, k, v, ids, pos)
    assert out.shape == q.shape and out.dtype == q.dtype
    # the kernel rounds P to bf16 before PV and its output to bf16: allow 3x the plain path's
    # error (its output rounding alone), as FlashAttention's tests do
    assert _rel(out, exact) <= 3 * max(_rel(plain, exact), 1e-3), (_rel(out, exact), _rel(plain, exact))


def test_gpu_variant_lowers_for_hopper():
    """The compiled variant (P from registers, accumulator in place) through the Mosaic GPU
    lowering for sm_90, on the CPU: catches layout, TMA, SMEM and wgmma errors early."""
    q, k, v, ids, pos = _case(0, 16, 128)
    jax.jit(sparse_decode_attention).trace(q, k, v, ids, pos).lower(lowering_platforms=("cuda",))


def test_rejects_unsupported_inputs():
    q, k, v, ids, pos = _case(0, 3, 64)
    with pytest.raises(TypeError, match="bf16"):
        sparse_decode_attention(q.astype(jnp.float32), k, v, ids, pos)
    with pytest.raises(ValueError, match="multiples of 64"):
        sparse_decode_attention(q, k[:, :500], v[:, :500], ids, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("g,d", [(3, 64), (16, 128)])
def test_compiled_matches_reference(g, d):
    q, k, v, ids, pos = _case(g, g, d, s=4096, n=24)
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    out = jax.jit(sparse_decode_attention)(q, k, v, ids, pos)
    assert _rel(out, exact) <= 3 * max(_rel(plain, exact), 1e-3)


def test_dispatch_through_sparse_attention():
    from sparda_jax import sparse_attention

    q, k, v, ids, pos = _case(5, 3, 64)
    got = sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], implementation="mosaic_gpu_interpret")
    ref = sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], implementation="xla")
    assert _rel(got, ref) < 5e-3  # both bf16 outputs; the kernel also rounds P to bf16
    with pytest.raises(NotImplementedError, match="no bias"):  # Tq > 1 goes to the prefill kernel
        sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], bias=jnp.ones(k.shape[:3]),
                         implementation="mosaic_gpu")


def test_default_split_count():
    from sparda_jax.kernels.sparse_decode import default_n_split

    assert default_n_split(64, 2, 96, num_sms=132) == 4     # 512 CTAs already: the measured 4
    assert default_n_split(16, 2, 96, num_sms=132) == 9     # 2 CTAs per SM
    assert default_n_split(1, 2, 96, num_sms=132) == 16     # capped
    assert default_n_split(1, 2, 3, num_sms=132) == 3       # never more splits than blocks
