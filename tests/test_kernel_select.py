"""The Mosaic GPU Forecast selector (block scores + top-k without sort) and the selection op's
dispatch against the jnp selector: interpret mode and the Hopper lowering on the CPU, compiled
on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import INTERPRET, assert_ids_equal, gpu, lower_for_hopper, mosaic_kernel_modules

from sparda_jax import SparseConfig
from sparda_jax.compress import compress_keys
from sparda_jax.ops.block_select.forecast_mgpu import (MIN_CTAS, forecast_select, rows_per_cta, select_topk,
                                                       topk_reference, topk_select_rows)
from sparda_jax.ops.block_select.reference import n_blocks_for, select_blocks_forecast_reference
from sparda_jax.select import select_blocks_forecast


def _case(seed, t=640, kh=2, d=64, b=1):
    ks = jax.random.split(jax.random.key(seed), 2)
    k = jax.random.normal(ks[0], (b, t, kh, d)).astype(jnp.bfloat16)
    f = jax.random.normal(ks[1], (b, t, kh, d)).astype(jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return f, compress_keys(k, 32, 16), pos


@pytest.mark.parametrize("d,local", [(64, 1), (128, 2)])
def test_interpret_selects_what_the_jnp_selector_selects(d, local):
    sp = SparseConfig(local_blocks=local, topk=local + 5, dense_len=0)
    f, kc, pos = _case(d, d=d)
    nb = n_blocks_for(kc.shape[1], sp)
    ref = select_blocks_forecast_reference(f, kc, pos, sp, n_blocks=nb)
    got = jax.jit(functools.partial(forecast_select, sparse=sp, n_blocks=nb, interpret=INTERPRET))(f, kc, pos)
    assert_ids_equal(got, ref)


def _edge_rows(seed, rows, nb, k):
    s = np.random.default_rng(seed).standard_normal((rows, nb)).astype(np.float32)
    s[0, k // 2:] = -np.inf                  # fewer candidates than k: -1 padding
    s[1, :3] = np.inf                        # forced blocks
    s[2] = np.round(s[2] * 2) / 2            # heavy ties: lower ids first
    s[3, :] = -np.inf                        # nothing: all -1
    s[4, : min(nb, k + 10)] = np.inf         # more forced than k: the lowest ids
    s[5, ::3] = 0.25                         # ties straddling the k-th place
    return jnp.asarray(s)


@pytest.mark.parametrize("nb,k,rows", [(2048, 20, 11), (300, 7, 37), (64, 5, 6), (40, 48, 6)])
def test_topk_rows_matches_lax_top_k(nb, k, rows):
    # (40, 48): rows shorter than k; rows not a multiple of the kernel's rows per CTA
    s = _edge_rows(nb, rows, nb, k)
    got = jax.jit(functools.partial(select_topk, k=k, interpret=INTERPRET))(s)
    assert_ids_equal(got, topk_reference(s, k))


def test_rows_per_cta_spreads_a_short_prompt_over_the_grid():
    # SmolLM2 prefill (3 KV heads, 64 or 128 blocks): a 4K prompt's 12288 rows would be 48 CTAs of
    # 256; at least MIN_CTAS CTAs unless rows reach 8. Long prompts keep the register cap.
    assert rows_per_cta(64) == 256 and rows_per_cta(128) == 128 and rows_per_cta(2048) == 8
    assert rows_per_cta(64, 3 * 4096) == 16 and rows_per_cta(128, 3 * 8192) == 32
    assert rows_per_cta(64, 8 * 3 * 4096) == 128 and rows_per_cta(2048, 6) == 8
    for nbp, n in ((64, 12288), (128, 24576), (512, 4 * 8 * 32768), (64, 100)):
        rt = rows_per_cta(nbp, n)
        assert rt == 8 or n >= MIN_CTAS * rt
        assert rt * nbp <= 16384


@pytest.mark.parametrize("rows", [8, 32, 256])
def test_topk_rows_per_cta_is_only_a_tiling(rows):
    s = _edge_rows(rows, 256, 64, 24)
    got = jax.jit(functools.partial(topk_select_rows, k=24, rows=rows, interpret=INTERPRET))(s)
    assert_ids_equal(got, topk_reference(s, 24))


@pytest.mark.parametrize("rows,nbp,n", [(12, 64, 48), (512, 64, 512), (256, 128, 256), (8, 64, 12)])
def test_topk_refuses_a_tiling_it_cannot_run(rows, nbp, n):
    with pytest.raises(ValueError, match="rows per CTA|multiple of"):
        topk_select_rows(jnp.zeros((n, nbp), jnp.float32), 4, rows=rows, interpret=INTERPRET)


def test_topk_lowers_for_hopper_at_prefill_128k():
    # batch 4 x 2 KV heads x 128K queries, 2048 blocks, topk 96: shapes only, nothing allocated
    s = jax.ShapeDtypeStruct((4 * 2 * 131072, 2048), jnp.float32)
    lower_for_hopper(functools.partial(select_topk, k=96), s)


def test_kernels_lower_for_hopper():
    sp = SparseConfig(local_blocks=2, topk=12, dense_len=0)
    f, kc, pos = _case(1, t=1024, d=128)
    nb = n_blocks_for(kc.shape[1], sp)
    lower_for_hopper(functools.partial(forecast_select, sparse=sp, n_blocks=nb), f, kc, pos)


def test_one_kernel_module_per_kernel_for_every_layer():
    # called once per layer in one program: each of the selector's kernels (scores, top-k) is
    # one module at every call site (see test_kernel_decode's twin)
    sp = SparseConfig(local_blocks=2, topk=12, dense_len=0)
    f, kc, pos = _case(1, t=1024, d=128)
    nb = n_blocks_for(kc.shape[1], sp)
    one = lower_for_hopper(lambda f: forecast_select(f, kc, pos, sp, n_blocks=nb), f)
    three = lower_for_hopper(lambda f: [forecast_select(f + i, kc, pos, sp, n_blocks=nb) for i in range(3)], f)
    assert mosaic_kernel_modules(three) == mosaic_kernel_modules(one) == 2


@gpu
@pytest.mark.parametrize("t,kh,d,local,topk,b", [(16384, 2, 128, 32, 96, 2),   # minicpm4.1-8b's budget
                                                 (4096, 3, 64, 8, 24, 1)])     # SmolLM2-135M's layer
def test_compiled_matches_jnp_selector(t, kh, d, local, topk, b):
    """SmolLM2's row guards the selectors' routing of head dim 64 to the compiled kernels."""
    sp = SparseConfig(local_blocks=local, topk=topk, dense_len=0)
    f, kc, pos = _case(2, t=t, kh=kh, d=d, b=b)
    nb = n_blocks_for(kc.shape[1], sp)
    ref = select_blocks_forecast_reference(f, kc, pos, sp, n_blocks=nb)
    got = jax.jit(functools.partial(forecast_select, sparse=sp, n_blocks=nb))(f, kc, pos)
    assert float(jnp.mean(got == ref)) > 0.999  # f32 sums in another order may swap exact near-ties


@gpu
@pytest.mark.parametrize("rows", [8, 16, 32, 64, 128, 256])
def test_compiled_topk_every_rows_per_cta(rows):
    s = jax.random.normal(jax.random.key(rows), (3 * 4096, 64))
    s = s.at[:6].set(_edge_rows(1, 6, 64, 24))
    got = jax.jit(functools.partial(topk_select_rows, k=24, rows=rows))(s)
    assert_ids_equal(got, topk_reference(s, 24))


@gpu
def test_compiled_topk_is_exact():
    # the top-k of given scores has no float reordering: ids must be equal exactly
    rows, nb, k = 65536, 2048, 96
    s = jax.random.normal(jax.random.key(3), (rows, nb))
    s = s.at[:6].set(_edge_rows(0, 6, nb, k))
    got = jax.jit(functools.partial(select_topk, k=k))(s)
    assert_ids_equal(got, topk_reference(s, k))


def test_selectors_dispatch_to_the_kernels_and_modes_pass_it_on():
    # select_blocks_*(implementation=...) reaches the kernels; modes.forward(implementations=...)
    # reaches the selectors: with the interpreter, both equal the jnp path id for id.

    from sparda_jax import get_preset, init_forecast, init_model
    from sparda_jax.config import Implementations
    from sparda_jax.modes import forward
    from sparda_jax.select import select_blocks_infllmv2

    sp = SparseConfig(local_blocks=1, topk=4, dense_len=0)
    f, kc, pos = _case(11, t=320, d=64)
    for fn, x in ((select_blocks_forecast, f), (select_blocks_infllmv2, jnp.repeat(f, 2, axis=2))):
        ref = fn(x, kc, pos, sp, implementation="xla")
        assert_ids_equal(fn(x, kc, pos, sp, implementation="mosaic_gpu_interpret"), ref)
        # None falls back to the reference where the kernels cannot run (here: no Hopper GPU)
        assert_ids_equal(fn(x, kc, pos, sp), ref)
        with pytest.raises(NotImplementedError, match="bf16/f16"):
            fn(x.astype(jnp.float32), kc, pos, sp, implementation="mosaic_gpu_interpret")
    with pytest.raises(ValueError, match="unknown select implementation"):
        select_blocks_forecast(f, kc, pos, sp, implementation="rows")
    tiny = get_preset("tiny")
    cfg = tiny.replace(num_layers=2, head_dim=64, sparse=sp)
    params, fcst = init_model(cfg, jax.random.key(0)), init_forecast(cfg, jax.random.key(1))
    tok = jax.random.randint(jax.random.key(2), (1, 320), 0, cfg.vocab_size)
    run = lambda impl: forward(params, tok, cfg, mode="sparda", forecast=fcst, dtype=jnp.bfloat16,
                               implementations=Implementations(select=impl), collect_selection=True)[1]["ids"]
    np.testing.assert_array_equal(run("mosaic_gpu_interpret"), run("xla"))


def _decode_case(seed, t, b, kh=2, d=64, h=4):
    """One query per sequence at spread positions (one early: fewer candidates than topk)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (b, t, kh, d)).astype(jnp.bfloat16)
    f = jax.random.normal(ks[1], (b, 1, kh, d)).astype(jnp.bfloat16)
    q = jax.random.normal(ks[2], (b, 1, h, d)).astype(jnp.bfloat16)
    pos = jnp.linspace(100, t - 1, b).astype(jnp.int32)[:, None]
    return f, q, compress_keys(k, 32, 16), pos


def _host_topk(bs, pos, sp):
    """finalize_topk's contract in numpy: causal, init and local blocks forced, the top scores with
    ties to the lower id (a stable sort), ids ascending, -1 padded. Also the masked scores."""
    bs = np.array(bs, np.float32)
    nb = bs.shape[-1]
    k = np.arange(nb)
    ids = np.full(bs.shape[:-1] + (sp.topk,), -1, np.int32)
    for b, h, i in np.ndindex(*bs.shape[:-1]):
        qb = int(pos[b, i]) // sp.block_size
        s = bs[b, h, i]
        s[k > qb] = -np.inf
        s[(k <= qb) & ((k < sp.init_blocks) | (k >= qb - sp.local_blocks))] = np.inf
        top = np.argsort(-s, kind="stable")[:sp.topk]
        top = np.sort(top[s[top] > -np.inf])
        ids[b, h, i, :len(top)] = top
    return ids, bs


def _picked_scores(ids, masked):
    return np.sort(np.where(ids >= 0, np.take_along_axis(masked, np.maximum(ids, 0), -1), -np.inf), -1)


@pytest.mark.parametrize("nb,topk", [(2048, 96), (300, 24), (50, 24), (20, 24)])
def test_finalize_topk_keeps_the_contract(nb, topk):
    """finalize_topk against the host contract: pooled scores from a few values, so ties at the
    k-th place are common, invisible chunks, rows with fewer candidates than topk; and the
    Mosaic top-k on the same masked scores."""
    from sparda_jax.select import finalize_topk

    sp = SparseConfig(local_blocks=min(8, topk - 2), topk=topk, dense_len=0)
    rng = np.random.default_rng(nb + topk)
    bs = np.round(rng.standard_normal((3, 2, 4, nb)) * 3).astype(np.float32) / 4 + 0.125  # no zeros
    bs[rng.random(bs.shape) < 0.1] = -np.inf
    pos = rng.integers(0, nb * sp.block_size, (3, 4)).astype(np.int32)
    pos[0, 0] = 5 * sp.block_size  # fewer candidates than topk
    want, masked = _host_topk(bs, pos, sp)
    assert (want[0, :, 0] == -1).any()
    got = jax.jit(functools.partial(finalize_topk, topk=topk, sparse=sp))(jnp.asarray(bs), jnp.asarray(pos))
    assert_ids_equal(got, want)
    rows = jax.jit(functools.partial(select_topk, k=topk, interpret=INTERPRET))(jnp.asarray(masked.reshape(-1, nb)))
    assert_ids_equal(rows.reshape(want.shape), want)


@gpu
def test_compiled_topk_kernel_breaks_pooled_ties_as_the_contract():
    # decode-shaped rows at 128K, batch 8, the engine's budget (96 with 33 forced) and 2048 blocks
    # a row. The scores are max-pooled, so equal scores at the k-th place occur. The kernel breaks
    # them to the lower id, as its contract and a host stable sort do: equal ids exactly.
    # lax.top_k's order among ties on the GPU is not part of its contract, so XLA's ids must only
    # pick the same scores. Both top-ks read one scores array.
    from sparda_jax.select import finalize_topk, forecast_chunk_scores, infllmv2_chunk_scores, pool_to_blocks

    sp = SparseConfig(local_blocks=32, topk=96, dense_len=0)
    t = 131072
    nb = t // sp.block_size
    f, q, kc, pos = _decode_case(6, t=t, b=8, d=128, h=32)
    for chunk_scores, x in ((forecast_chunk_scores, f), (infllmv2_chunk_scores, q)):
        bs = jax.jit(lambda x, c=chunk_scores: pool_to_blocks(c(x, kc, pos, sp), nb, sp))(x)
        ref = jax.jit(functools.partial(finalize_topk, topk=sp.topk, sparse=sp))(bs, pos)
        want, masked = _host_topk(bs, np.asarray(pos), sp)
        got = jax.jit(functools.partial(select_topk, k=sp.topk))(jnp.asarray(masked.reshape(-1, nb)))
        assert_ids_equal(got.reshape(want.shape), want)
        np.testing.assert_array_equal(_picked_scores(np.asarray(ref), masked), _picked_scores(want, masked))
