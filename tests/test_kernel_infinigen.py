"""The Mosaic GPU InfiniGen selector (token-level head LSE, block scores over token planes, top-k)
against the jnp selector: interpret mode and the Hopper lowering on the CPU, compiled on the GPU.

Inputs are bf16 values held in f32, so the kernels' 16-bit operands are exact and the XLA
reference, which scores in f32, ranks the same numbers (up to the order of f32 sums)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import (INTERPRET, assert_ids_equal, assert_same_up_to_near_ties, gpu, lower_for_hopper,
                         ranked_chunk_scores)

from sparda_jax import SparseConfig
from sparda_jax.ops.block_select import infinigen_mgpu as gk
from sparda_jax.ops.block_select import infllmv2_mgpu as ik
from sparda_jax.ops.block_select.reference import finalize_topk, infinigen_chunk_scores
from sparda_jax.ops.block_select.reference import select_blocks_infinigen_reference as select_blocks_infinigen


def _case(seed, *, s, tq=None, kh=2, g=3, r=13, b=2, zero_keys=False):
    """Partial keys of s tokens and bf16 partial queries (values exact in bf16); tq queries per
    sequence at ragged positions: sequence i's queries end at s - 1 - 7 * i."""
    tq = tq or s
    ks = jax.random.split(jax.random.key(seed), 2)
    pk = jax.random.normal(ks[0], (b, s, kh, r)).astype(jnp.bfloat16).astype(jnp.float32)
    if zero_keys:
        pk = jnp.zeros_like(pk)
    qp = (3 * jax.random.normal(ks[1], (b, tq, kh * g, r))).astype(jnp.bfloat16)
    ends = s - 1 - 7 * jnp.arange(b, dtype=jnp.int32)
    pos = ends[:, None] - (tq - 1) + jnp.arange(tq, dtype=jnp.int32)[None]
    return qp, pk, pos


def _select(qp, pk, pos, sp, nb, head_dim=64):
    fn = functools.partial(gk.infinigen_select, sparse=sp, head_dim=head_dim, n_blocks=nb, interpret=INTERPRET)
    return jax.jit(fn)(qp, pk, pos)


def _free_rows(ids, pos, sp) -> int:
    """Rows whose top-k holds a block that is not forced: where the scores decided something."""
    ids, qblk = np.asarray(ids), np.asarray(pos // sp.block_size)[:, None, :, None]
    free = (ids >= 0) & (ids >= sp.init_blocks) & (ids < qblk - sp.local_blocks)
    return int(np.any(free, axis=-1).sum())


@pytest.mark.parametrize("g,s,tq,head_dim", [(3, 400, 150, 64), (4, 4160, 64, 128)])  # 4160: a second 64-block tile
def test_kernels_match_their_references(g, s, tq, head_dim):
    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(g + s, s=s, tq=tq, g=g)
    b, tq = pos.shape
    kh, r = pk.shape[2], pk.shape[3]
    nb = -(-s // 64)
    tp, nbp, ncp = -(-tq // 64) * 64, -(-nb // 64) * 64, -(-s // 64) * 64
    scale = 1 / math.sqrt(head_dim)
    pad = ((0, 0), (0, 0), (0, 0), (0, gk.PARTIAL_DIM - r))
    q_r = ik.layout_q(jnp.pad(qp, pad), kh, tp)
    k = jnp.pad(pk, pad).astype(jnp.bfloat16)
    pos_p = jnp.pad(pos, ((0, 0), (0, tp - tq)), constant_values=-1)
    kc_r = jnp.pad(k, ((0, 0), (0, ncp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    geo = dict(n_chunks=s, kernel_size=1, kernel_stride=1, scale=scale)
    lse = jax.jit(functools.partial(ik.head_lse, interpret=INTERPRET, **geo))(q_r, kc_r, pos_p)
    lse_ref = ik.head_lse_reference(q_r, kc_r, pos_p, **geo)
    seen = np.broadcast_to(np.asarray(pos_p >= 0).reshape(b, 1, tp // 64, 1, 64), lse.shape)  # rows with a token
    # online vs two-pass f32 sums over <= 4160 tokens: a few ulp of the lse
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(lse_ref)[seen], rtol=2e-6, atol=2e-6)
    planes = gk.token_planes(k, nbp)
    kw = dict(n_tokens=s, scale=scale, init_blocks=sp.init_blocks, local_blocks=sp.local_blocks)
    got = np.asarray(jax.jit(functools.partial(gk.block_scores, interpret=INTERPRET, **kw))(q_r, planes, lse_ref,
                                                                                           pos_p))
    ref = np.asarray(gk.block_scores_reference(q_r, planes, lse_ref, pos_p, **kw))
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(got[~fin], ref[~fin])
    # f32 sums of G exps in another order; values are <= G, so an absolute bound fits
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6, atol=2e-6)
    # the twin equals InfiniGen's jnp scores with the rules of finalize_topk
    scores = infinigen_chunk_scores(qp, pk, pos, sp, nb, head_dim=head_dim)
    np.testing.assert_array_equal(np.asarray(finalize_topk(jnp.asarray(ref[:, :, :tq, :nb]), pos, sp.topk, sp)),
                                  np.asarray(finalize_topk(scores, pos, sp.topk, sp)))


@pytest.mark.parametrize("g,s,tq,head_dim,topk", [(4, 900, 130, 64, 7), (3, 700, 100, 128, 6)])
def test_selects_what_the_jnp_selector_selects(g, s, tq, head_dim, topk):
    sp = SparseConfig(local_blocks=1, topk=topk, dense_len=0)
    qp, pk, pos = _case(100 + g, s=s, tq=tq, g=g)
    nb = -(-s // 64)
    ref = select_blocks_infinigen(qp, pk, pos, sp, head_dim=head_dim, n_blocks=nb)
    assert _free_rows(ref, pos, sp) == np.prod(ref.shape[:-1])  # every row ranks scores, not only forced blocks
    # exact here: the scores differ from the reference by ulps only and no selection boundary of
    # these seeds sits that close to a tie
    assert_ids_equal(_select(qp, pk, pos, sp, nb, head_dim), ref)


@pytest.mark.parametrize("local,topk,zero_keys,n_blocks", [
    (1, 40, False, None),   # rows with fewer candidates than topk: -1 padding
    (1, 5, True, None),     # all keys equal: every visible block ties, lower ids first
    (1, 5, False, 100),     # a row of 100 blocks past 9 of tokens: the second tile is written -inf
])
def test_edge_rows(local, topk, zero_keys, n_blocks):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    qp, pk, pos = _case(7, s=520, tq=150, zero_keys=zero_keys)
    nb = n_blocks or -(-520 // 64)
    assert_ids_equal(_select(qp, pk, pos, sp, nb), select_blocks_infinigen(qp, pk, pos, sp, head_dim=64, n_blocks=nb))


def test_refuses_what_it_cannot_run():
    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(1, s=128, r=80, b=1)
    with pytest.raises(ValueError, match="partial dims"):
        gk.infinigen_select(qp, pk, pos, sp, head_dim=128, n_blocks=2)
    qp, pk, pos = _case(1, s=128, b=1)
    with pytest.raises(TypeError, match="bf16/f16"):
        gk.infinigen_select(qp.astype(jnp.float32), pk, pos, sp, head_dim=64, n_blocks=2)
    qp, pk, pos = _case(1, s=128, kh=1, g=gk.MAX_GROUP + 1, b=1)
    with pytest.raises(ValueError, match="query heads per KV head"):
        gk.infinigen_select(qp, pk, pos, sp, head_dim=64, n_blocks=2)


def test_lowers_for_hopper_at_realistic_size():
    # MiniCPM4 geometry at 16K tokens: 32 query heads on 2 KV heads, 26 partial dims, topk 96
    sp = SparseConfig(local_blocks=32, topk=96, dense_len=0)
    t = 16384
    qp = jax.ShapeDtypeStruct((1, t, 32, 26), jnp.bfloat16)
    pk = jax.ShapeDtypeStruct((1, t, 2, 26), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)
    lower_for_hopper(functools.partial(gk.infinigen_select, sparse=sp, head_dim=128, n_blocks=t // 64), qp, pk, pos)


def test_dispatch():
    """None runs the XLA reference here (f32 partial queries, or no Hopper GPU); "mosaic_gpu_interpret"
    the kernels, on partial queries in kernel_dtype (default: their own), which must be 16-bit."""
    from sparda_jax.select import select_blocks_infinigen as dispatch

    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(11, s=640, tq=70, b=1)
    qf = qp.astype(jnp.float32)
    ref = select_blocks_infinigen(qf, pk, pos, sp, head_dim=64)
    assert _free_rows(ref, pos, sp) > 0
    assert_ids_equal(dispatch(qf, pk, pos, sp, head_dim=64), ref)
    kernel = functools.partial(dispatch, implementation="mosaic_gpu_interpret")
    assert_ids_equal(kernel(qp, pk, pos, sp, head_dim=64), ref)
    assert_ids_equal(kernel(qf, pk, pos, sp, head_dim=64, kernel_dtype=jnp.bfloat16), ref)
    with pytest.raises(NotImplementedError, match="bf16"):
        kernel(qf, pk, pos, sp, head_dim=64)


def test_a_bf16_model_selects_the_same_through_the_kernel():
    """`forward(mode="infinigen")` in bf16 with the selection forced to the interpreted kernels
    gives the XLA selection's ids, on rows where the scores choose blocks: exactly in layer 0
    (InfLLM-V2's own selection), and in layer 1 up to the few rows where rounding the f32 partial
    keys to bf16 (8 mantissa bits) swaps blocks at the top-k boundary; a wrong scale or mask
    would change a large share of rows."""
    import dataclasses

    from sparda_jax import Implementations, forward, get_preset, init_model
    from sparda_jax.infinigen import infinigen_setup

    c = get_preset("tiny").replace(num_layers=2, head_dim=64)
    sp = dataclasses.replace(c.sparse, block_size=64, local_blocks=1, topk=6, dense_len=0, kernel_size=32,
                             kernel_stride=16)
    c = c.replace(sparse=sp)
    params = init_model(c, jax.random.key(0))
    ig = infinigen_setup(params, c, jax.random.randint(jax.random.key(1), (1, 192), 0, c.vocab_size))
    tokens = jax.random.randint(jax.random.key(2), (1, 640), 0, c.vocab_size)
    runs = [forward(params, tokens, c, mode="infinigen", infinigen=ig, dtype=jnp.bfloat16, collect_selection=True,
                    implementations=Implementations(select=impl))[1]["ids"] for impl in ("xla", "mosaic_gpu_interpret")]
    pos = jnp.arange(640)[None]
    xla, kernel = (np.asarray(x) for x in runs)
    assert _free_rows(xla[1], pos, sp) > 300  # layer 1 (InfiniGen's speculation) chooses by score
    np.testing.assert_array_equal(kernel[0], xla[0])
    differ = np.any(kernel[1] != xla[1], axis=-1)
    assert differ.mean() <= 0.01, differ.mean()


@gpu
@pytest.mark.parametrize("t,kh,g,r,head_dim,local,topk", [(16384, 2, 16, 26, 128, 32, 96),   # minicpm4.1-8b
                                                          (8192, 3, 3, 13, 64, 8, 24)])     # SmolLM2: two tiles
def test_compiled_matches_jnp_selector(t, kh, g, r, head_dim, local, topk):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    qp, pk, pos = _case(2, s=t, kh=kh, g=g, r=r, b=1)
    nb = t // 64
    got = jax.jit(functools.partial(gk.infinigen_select, sparse=sp, head_dim=head_dim, n_blocks=nb))(qp, pk, pos)
    qf = qp.astype(jnp.float32)
    ref = select_blocks_infinigen(qf, pk, pos, sp, head_dim=head_dim, n_blocks=nb)
    scores = ranked_chunk_scores(lambda x, p: infinigen_chunk_scores(x, pk, p, sp, nb, head_dim), qf, pos, sp,
                                 chunk=64)
    assert_same_up_to_near_ties(got, ref, scores, rtol=1e-5)
