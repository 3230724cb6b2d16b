"""The Mosaic GPU InfiniGen selector (token-level head LSE, block scores over token planes, top-k)
against the jnp selector: interpret mode and the Hopper lowering on the CPU, compiled on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import INTERPRET, assert_ids_equal, gpu, lower_for_hopper

from sparda_jax import SparseConfig
from sparda_jax.ops.block_select import infinigen_mgpu as gk
from sparda_jax.ops.block_select import infllmv2_mgpu as ik
from sparda_jax.ops.block_select.reference import finalize_topk, infinigen_chunk_scores
from sparda_jax.ops.block_select.reference import select_blocks_infinigen_reference as select_blocks_infinigen


def _case(seed, *, s, tq=None, kh=2, g=3, r=13, b=2, zero_keys=False):
    """Partial keys of s tokens (bf16 values, so the kernel's bf16 cast is exact); tq queries per
    sequence at ragged positions: sequence i's queries end at s - 1 - 7 * i."""
    tq = tq or s
    ks = jax.random.split(jax.random.key(seed), 2)
    pk = jax.random.normal(ks[0], (b, s, kh, r)).astype(jnp.bfloat16).astype(jnp.float32)
    if zero_keys:
        pk = jnp.zeros_like(pk)
    qp = (3 * jax.random.normal(ks[1], (b, tq, kh * g, r))).astype(jnp.bfloat16).astype(jnp.float32)
    ends = s - 1 - 7 * jnp.arange(b, dtype=jnp.int32)
    pos = ends[:, None] - (tq - 1) + jnp.arange(tq, dtype=jnp.int32)[None]
    return qp, pk, pos


def _select(qp, pk, pos, sp, nb, head_dim=64):
    fn = functools.partial(gk.infinigen_select, sparse=sp, head_dim=head_dim, n_blocks=nb, interpret=INTERPRET)
    return jax.jit(fn)(qp, pk, pos)


@pytest.mark.parametrize("g,s,tq", [(3, 400, 150), (4, 4160, 64)])  # 4160: a second 64-block tile
def test_kernels_match_their_references(g, s, tq):
    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(g + s, s=s, tq=tq, g=g)
    b, tq = pos.shape
    kh, r = pk.shape[2], pk.shape[3]
    nb = -(-s // 64)
    tp, nbp, ncp = -(-tq // 64) * 64, -(-nb // 64) * 64, -(-s // 64) * 64
    pad = ((0, 0), (0, 0), (0, 0), (0, gk.PARTIAL_DIM - r))
    q_r = ik.layout_q(jnp.pad(qp, pad).astype(jnp.bfloat16), kh, tp)
    k = jnp.pad(pk, pad).astype(jnp.bfloat16)
    pos_p = jnp.pad(pos, ((0, 0), (0, tp - tq)), constant_values=-1)
    kc_r = jnp.pad(k, ((0, 0), (0, ncp - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    lse = ik.head_lse_reference(q_r, kc_r, pos_p, n_chunks=s, kernel_size=1, kernel_stride=1)
    planes = gk.token_planes(k, nbp)
    kw = dict(n_tokens=s, init_blocks=sp.init_blocks, local_blocks=sp.local_blocks)
    got = np.asarray(jax.jit(functools.partial(gk.block_scores, interpret=INTERPRET, **kw))(q_r, planes, lse, pos_p))
    ref = np.asarray(gk.block_scores_reference(q_r, planes, lse, pos_p, **kw))
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(got[~fin], ref[~fin])
    # f32 sums of G exps in another order; values are <= G, so an absolute bound fits
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-6, atol=2e-6)
    # the twin equals InfiniGen's jnp scores with the rules of finalize_topk
    scores = infinigen_chunk_scores(qp, pk, pos, sp, nb, head_dim=64)
    np.testing.assert_array_equal(np.asarray(finalize_topk(jnp.asarray(ref[:, :, :tq, :nb]), pos, sp.topk, sp)),
                                  np.asarray(finalize_topk(scores, pos, sp.topk, sp)))


@pytest.mark.parametrize("g,s,tq,local,topk", [(4, 300, 130, 2, 7), (3, 400, 100, 1, 6)])
def test_selects_what_the_jnp_selector_selects(g, s, tq, local, topk):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    qp, pk, pos = _case(100 + g, s=s, tq=tq, g=g)
    nb = -(-s // 64)
    ref = select_blocks_infinigen(qp, pk, pos, sp, head_dim=64, n_blocks=nb)
    # exact here: the bf16 inputs are exact and the scores differ from the reference by ulps only
    assert_ids_equal(_select(qp, pk, pos, sp, nb), ref)


@pytest.mark.parametrize("local,topk,zero_keys", [(1, 40, False), (1, 5, True)])
def test_edge_rows(local, topk, zero_keys):
    """Rows with fewer candidates than topk (-1 padding); all keys equal (every block ties)."""
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    qp, pk, pos = _case(7, s=520, tq=150, zero_keys=zero_keys)
    nb = -(-520 // 64)
    assert_ids_equal(_select(qp, pk, pos, sp, nb), select_blocks_infinigen(qp, pk, pos, sp, head_dim=64, n_blocks=nb))


def test_refuses_what_it_cannot_run():
    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(1, s=128, r=80, b=1)
    with pytest.raises(ValueError, match="partial dims"):
        gk.infinigen_select(qp, pk, pos, sp, head_dim=128, n_blocks=2)


def test_lowers_for_hopper_at_realistic_size():
    # MiniCPM4 geometry at 16K tokens: 32 query heads on 2 KV heads, 26 partial dims, topk 96
    sp = SparseConfig(local_blocks=32, topk=96, dense_len=0)
    t = 16384
    qp = jax.ShapeDtypeStruct((1, t, 32, 26), jnp.float32)
    pk = jax.ShapeDtypeStruct((1, t, 2, 26), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32)
    lower_for_hopper(functools.partial(gk.infinigen_select, sparse=sp, head_dim=128, n_blocks=t // 64), qp, pk, pos)


@gpu
@pytest.mark.parametrize("t,kh,g,r,local,topk", [(16384, 2, 16, 26, 32, 96), (4096, 3, 3, 13, 8, 24)])
def test_compiled_matches_jnp_selector(t, kh, g, r, local, topk):
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    qp, pk, pos = _case(2, s=t, kh=kh, g=g, r=r, b=1)
    nb = t // 64
    fn = functools.partial(gk.infinigen_select, sparse=sp, head_dim=64, n_blocks=nb)
    got = jax.jit(fn)(qp, pk, pos)
    ref = select_blocks_infinigen(qp, pk, pos, sp, head_dim=64, n_blocks=nb)
    assert_ids_equal(got, ref)


def test_dispatch_takes_the_kernel_by_name_only():
    """None runs the XLA reference; "mosaic_gpu_interpret" the kernels, on bf16 partial queries
    only (a forced name raises for f32, which the XLA path keeps)."""
    from sparda_jax.select import select_blocks_infinigen as dispatch

    sp = SparseConfig(local_blocks=1, topk=5, dense_len=0)
    qp, pk, pos = _case(11, s=200, tq=70, b=1)
    ref = select_blocks_infinigen(qp, pk, pos, sp, head_dim=64)
    assert_ids_equal(dispatch(qp, pk, pos, sp, head_dim=64), ref)
    assert_ids_equal(dispatch(qp.astype(jnp.bfloat16), pk, pos, sp, head_dim=64, implementation="mosaic_gpu_interpret"),
                     ref)
    with pytest.raises(NotImplementedError, match="bf16"):
        dispatch(qp, pk, pos, sp, head_dim=64, implementation="mosaic_gpu_interpret")


def test_a_bf16_model_selects_the_same_through_the_kernel():
    """`forward(mode="infinigen")` in bf16 with the selection forced to the interpreted kernels
    gives the XLA selection's ids in every layer (the partial queries reach both in bf16)."""
    import dataclasses

    from sparda_jax import Implementations, forward, get_preset, init_model
    from sparda_jax.infinigen import infinigen_setup

    c = get_preset("tiny").replace(num_layers=2, head_dim=64)
    c = c.replace(sparse=dataclasses.replace(c.sparse, block_size=64, local_blocks=1, topk=3, dense_len=0,
                                             kernel_size=32, kernel_stride=16))
    params = init_model(c, jax.random.key(0))
    ig = infinigen_setup(params, c, jax.random.randint(jax.random.key(1), (1, 192), 0, c.vocab_size))
    tokens = jax.random.randint(jax.random.key(2), (1, 320), 0, c.vocab_size)
    runs = [forward(params, tokens, c, mode="infinigen", infinigen=ig, dtype=jnp.bfloat16, collect_selection=True,
                    implementations=Implementations(select=impl))[1]["ids"] for impl in ("xla", "mosaic_gpu_interpret")]
    np.testing.assert_array_equal(np.asarray(runs[1]), np.asarray(runs[0]))
