"""The Mosaic GPU InfLLM-V2 selector (head LSE, G-head block scores, top-k) against the jnp
selector: interpret mode and the Hopper lowering on the CPU, compiled on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import (INTERPRET, assert_ids_equal, assert_same_up_to_near_ties, gpu, lower_for_hopper,
                         ranked_chunk_scores)

from sparda_jax import SparseConfig
from sparda_jax.compress import compress_keys
from sparda_jax.ops.block_select import infllmv2_mgpu as ik
from sparda_jax.ops.block_select.forecast_mgpu import phase_kc
from sparda_jax.ops.block_select.reference import (finalize_topk, infllmv2_chunk_scores, n_blocks_for, pool_to_blocks,
                                                   select_blocks_infllmv2_reference)


def _case(seed, *, t, tq=None, kh=2, g=3, d=64, b=2, zero_keys=False):
    """Keys for t tokens; tq queries per sequence at ragged positions: sequence i's queries end at
    t - 1 - 7*i (so tiles straddle block edges differently) and tq need not be a multiple of 64."""
    tq = tq or t
    ks = jax.random.split(jax.random.key(seed), 2)
    k = jax.random.normal(ks[0], (b, t, kh, d)).astype(jnp.bfloat16)
    if zero_keys:
        k = jnp.zeros_like(k)
    q = jax.random.normal(ks[1], (b, tq, kh * g, d)).astype(jnp.bfloat16)
    ends = t - 1 - 7 * jnp.arange(b, dtype=jnp.int32)
    pos = ends[:, None] - (tq - 1) + jnp.arange(tq, dtype=jnp.int32)[None]
    return q, compress_keys(k, 32, 16), pos


def _select(q, kc, pos, sp, nb, **kw):
    fn = functools.partial(ik.infllmv2_select, sparse=sp, n_blocks=nb, interpret=INTERPRET, **kw)
    return jax.jit(fn)(q, kc, pos)


@pytest.mark.parametrize("g,d,t,tq", [(3, 64, 600, None), (16, 128, 330, 200)])
def test_kernels_match_their_references(g, d, t, tq):
    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    q, kc, pos = _case(g + d, t=t, tq=tq, g=g, d=d)
    b, tq = pos.shape
    n, kh = kc.shape[1], kc.shape[2]
    nb = n_blocks_for(n, sp)
    tp, nbp, ncp = -(-tq // 64) * 64, -(-nb // 64) * 64, -(-n // 64) * 64
    q_r = ik.layout_q(q, kh, tp)
    pos_p = jnp.pad(pos, ((0, 0), (0, tp - tq)), constant_values=-1)
    kc_r = jnp.pad(kc, ((0, 0), (0, ncp - n), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    lse = jax.jit(functools.partial(ik.head_lse, n_chunks=n, interpret=INTERPRET))(q_r, kc_r, pos_p)
    lse_ref = ik.head_lse_reference(q_r, kc_r, pos_p, n_chunks=n)
    seen = np.broadcast_to(np.asarray(pos_p >= 31).reshape(b, 1, tp // 64, 1, 64),
                           (b, kh, tp // 64, g, 64)).reshape(lse.shape)   # rows with a visible chunk
    # online vs two-pass f32 sums over <= 40 chunks: a few ulp of the lse
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], rtol=2e-6, atol=2e-6)
    kcp, offs = phase_kc(kc, nbp)
    kw = dict(offs=offs, n_chunks=n, init_blocks=sp.init_blocks, local_blocks=sp.local_blocks)
    s = jax.jit(functools.partial(ik.block_scores, interpret=INTERPRET, **kw))(q_r, kcp, lse_ref, pos_p)
    s_ref = np.asarray(ik.block_scores_reference(q_r, kcp, lse_ref, pos_p, **kw))
    s = np.asarray(s)
    fin = np.isfinite(s_ref)
    np.testing.assert_array_equal(s[~fin], s_ref[~fin])
    # f32 sums of G exps in another order; values are <= G, so an absolute bound fits
    np.testing.assert_allclose(s[fin], s_ref[fin], rtol=1e-6, atol=2e-6)
    # the kernel pipeline equals the project's jnp selector on the same shapes
    scores = pool_to_blocks(infllmv2_chunk_scores(q, kc, pos, sp), nb, sp)
    ours = np.asarray(s)[:, :, :tq, :nb]
    ref_rows = np.asarray(finalize_topk(jnp.asarray(ours), pos, sp.topk, sp))
    np.testing.assert_array_equal(ref_rows, np.asarray(finalize_topk(scores, pos, sp.topk, sp)))


@pytest.mark.parametrize("g,d,t,tq,local,topk", [
    (3, 64, 640, None, 2, 7),
    (16, 128, 300, 130, 1, 6),
    (3, 64, 400, 100, 1, 6),
])
def test_selects_what_the_jnp_selector_selects(g, d, t, tq, local, topk):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    q, kc, pos = _case(100 + g, t=t, tq=tq, g=g, d=d)
    nb = n_blocks_for(kc.shape[1], sp)
    ref = select_blocks_infllmv2_reference(q, kc, pos, sp, n_blocks=nb)
    # exact here: the scores differ from the reference by ulps only (test above) and no
    # selection boundary of these seeds sits that close to a tie
    assert_ids_equal(_select(q, kc, pos, sp, nb), ref)


@pytest.mark.parametrize("local,topk,zero_keys", [
    (1, 40, False),   # early rows have fewer candidates than topk: -1 padding
    (4, 6, False),    # forced blocks fill topk (SparseConfig forbids more; the top-k tests cover it)
    (1, 5, True),     # all keys equal: every visible block ties, lower ids first
])
def test_edge_rows(local, topk, zero_keys):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    q, kc, pos = _case(7, t=520, tq=150, g=3, d=64, zero_keys=zero_keys)
    nb = n_blocks_for(kc.shape[1], sp)
    ref = select_blocks_infllmv2_reference(q, kc, pos, sp, n_blocks=nb)
    assert_ids_equal(_select(q, kc, pos, sp, nb), ref)


def test_coarse_lse_is_xla_only():
    sp = SparseConfig(topk=4, local_blocks=1, dense_len=0, exact_lse=False)
    q, kc, pos = _case(1, t=128, g=3, d=64, b=1)
    with pytest.raises(NotImplementedError, match="XLA-only"):
        ik.infllmv2_select(q, kc, pos, sp, n_blocks=n_blocks_for(kc.shape[1], sp))


def test_lowers_for_hopper_at_realistic_size():
    # MiniCPM4 geometry at 16K tokens: 32 query heads on 2 KV heads, D 128, topk 96
    sp = SparseConfig(local_blocks=32, topk=96, dense_len=0)
    t, n = 16384, (16384 - 32) // 16 + 1
    q = jax.ShapeDtypeStruct((1, t, 32, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((1, n, 2, 128), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)
    lower_for_hopper(functools.partial(ik.infllmv2_select, sparse=sp, n_blocks=n_blocks_for(n, sp)), q, kc, pos)


@gpu
@pytest.mark.parametrize("t,kh,g,d,local,topk", [(16384, 2, 16, 128, 32, 96),   # minicpm4.1-8b's budget
                                                 (4096, 3, 3, 64, 8, 24)])      # SmolLM2-135M's layer
def test_compiled_matches_jnp_selector(t, kh, g, d, local, topk):
    """The compiled selector against the jnp one; SmolLM2's row guards the selectors' routing of
    head dim 64 to the compiled kernels."""
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    q, kc, pos = _case(2, t=t, kh=kh, g=g, d=d, b=1)
    nb = n_blocks_for(kc.shape[1], sp)
    ref = select_blocks_infllmv2_reference(q, kc, pos, sp, n_blocks=nb)
    got = jax.jit(functools.partial(ik.infllmv2_select, sparse=sp, n_blocks=nb))(q, kc, pos)
    scores = ranked_chunk_scores(lambda x, p: pool_to_blocks(infllmv2_chunk_scores(x, kc, p, sp), nb, sp), q, pos,
                                 sp, chunk=128)
    assert_same_up_to_near_ties(got, ref, scores, rtol=1e-5)


@pytest.mark.parametrize("op", ["infllmv2", "forecast"])
def test_selection_passes_gradients_around_the_kernels(op):
    # the kernels have no JVP rule; the block choice is a top-k, which carries no gradient, so the
    # selection op must stop the gradient at its inputs (a loss that selects under jax.grad, as
    # `sparda finetune` does, failed on the GPU once the kernels served head dim 64)
    from sparda_jax.ops.block_select import select_blocks_forecast, select_blocks_infllmv2
    sp = SparseConfig(local_blocks=1, topk=4, dense_len=0)
    q, kc, pos = _case(5, t=384, kh=2, g=1, d=64, b=1)
    nb = n_blocks_for(kc.shape[1], sp)
    select = select_blocks_infllmv2 if op == "infllmv2" else select_blocks_forecast

    def loss(q, kc):  # gradient through the inputs' other use; the ids only gate it
        ids = select(q, kc, pos, sp, n_blocks=nb, implementation="mosaic_gpu_interpret")
        return jnp.sum(q.astype(jnp.float32) ** 2) * jnp.mean(ids >= 0) + jnp.sum(kc.astype(jnp.float32))

    gq, gkc = jax.grad(loss, argnums=(0, 1))(q, kc)
    ids = select(q, kc, pos, sp, n_blocks=nb, implementation="xla")
    np.testing.assert_allclose(np.asarray(gq, np.float32), np.asarray(2 * q.astype(jnp.float32) * jnp.mean(ids >= 0)),
                               rtol=1e-2)  # bf16 gradient of a bf16 input: 8 mantissa bits
    np.testing.assert_array_equal(np.asarray(gkc, np.float32), 1.0)
