"""The Mosaic GPU block-sparse decode kernel against its jnp reference: interpret mode on the
CPU, the Hopper lowering on the CPU, compiled on the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import (BF16_MODEL, BF16_PAIR_DECODE, INTERPRET, assert_attention_close, gpu, lower_for_hopper,
                         mosaic_kernel_modules, rel_error)

from sparda_jax.config import ConfigError
from sparda_jax.ops.sparse_attention.decode import (DecodeConfig, sparse_decode_attention,
                                                    sparse_decode_attention_reference)


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


@pytest.mark.parametrize("g,d,stages", [(3, 64, 4), (16, 128, 4), (16, 128, 2), (3, 64, 3)])
def test_interpret_matches_reference(g, d, stages):
    # n = 6 blocks over 3 splits: 2 per split, fewer than a ring of 3 or 4 can hold, and the ragged
    # rows (1 or 3 blocks) leave splits with 0 or 1; `long` below fills the ring past one turn
    q, k, v, ids, pos = _case(g + stages, g, d)
    f32 = lambda x: x.astype(jnp.float32)
    exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)  # the jnp path in bf16
    out = jax.jit(functools.partial(sparse_decode_attention, config=DecodeConfig(n_split=3, stages=stages),
                                    interpret=INTERPRET))(q, k, v, ids, pos)
    assert_attention_close(out, exact, plain, q)


@pytest.mark.parametrize("n_split", [5, 16])
def test_windows_clamped_to_the_list_end(n_split):
    # 24 blocks (a multiple of 4: the lists go to the kernel unpadded) over 5 splits of 5, whose
    # last window (from 20, 8 wide) is moved back to end at 24, and over 16 splits of 2, whose
    # last four have no entries and windows past the list
    q, k, v, ids, pos = _case(5, 3, 64, s=4096, n=24)
    f32 = lambda x: x.astype(jnp.float32)
    exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    out = jax.jit(functools.partial(sparse_decode_attention, config=DecodeConfig(n_split=n_split, stages=2),
                                    interpret=INTERPRET))(q, k, v, ids, pos)
    assert_attention_close(out, exact, plain, q)


def test_split_pass_then_combine_is_the_kernel():
    """The benchmark's split-pass-only variant: its outputs, combined, are the kernel's result
    (bit for bit: the same ops), and each split's partial output is normalised on its own."""
    from sparda_jax.ops.sparse_attention.decode import combine_splits, sparse_decode_split_pass

    q, k, v, ids, pos = _case(11, 3, 64)
    kw = dict(config=DecodeConfig(n_split=3), interpret=INTERPRET)
    o, lse = jax.jit(functools.partial(sparse_decode_split_pass, **kw))(q, k, v, ids, pos)
    assert o.shape == (2, 2, 3, 3, 64) and lse.shape == (2, 2, 3, 3) and o.dtype == jnp.float32
    full = jax.jit(functools.partial(sparse_decode_attention, **kw))(q, k, v, ids, pos)
    np.testing.assert_array_equal(np.asarray(combine_splits(o, lse).reshape(q.shape).astype(q.dtype)),
                                  np.asarray(full))
    # a row with one valid block (ids [own]) fills one split; the others are empty (lse -inf)
    assert np.isfinite(np.asarray(lse)).sum() < lse.size


def test_ring_turns_several_times_in_interpret_mode():
    """One split walking 13 blocks through a ring of 3 and 4: every slot is refilled several times,
    so a wrong slot or barrier phase reads a stale block."""
    q, k, v, _, _ = _case(11, 3, 64, s=1024)
    pos = jnp.asarray([1023, 1000], jnp.int32)  # own blocks 15 and 15 (1000 is not a block end)
    rng = np.random.default_rng(11)
    ids = jnp.asarray([[np.r_[np.sort(rng.choice(15, 13, replace=False)), 15] for _ in range(2)] for _ in range(2)],
                      jnp.int32)  # [B=2, K=2, 14]: 13 earlier blocks and the query's own
    f32 = lambda x: x.astype(jnp.float32)
    exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    for stages in (3, 4):
        out = jax.jit(functools.partial(sparse_decode_attention, config=DecodeConfig(n_split=1, stages=stages),
                                        interpret=INTERPRET))(q, k, v, ids, pos)
        assert_attention_close(out, exact, plain, q)


@pytest.mark.parametrize("stages", [2, 4])
def test_gpu_variant_lowers_for_hopper(stages):
    """The compiled variant (P from registers, accumulator in place) through the Mosaic GPU
    lowering for sm_90, on the CPU: catches layout, TMA, SMEM and wgmma errors early."""
    q, k, v, ids, pos = _case(0, 16, 128)
    lower_for_hopper(functools.partial(sparse_decode_attention, config=DecodeConfig(stages=stages)), q, k, v, ids, pos)
    from sparda_jax.ops.sparse_attention.decode import paged_sparse_decode_attention

    q, kp, vp, slots, ids, pos, _ = _paged(0, 16, 128)
    lower_for_hopper(functools.partial(paged_sparse_decode_attention, config=DecodeConfig(stages=stages)),
                     q, kp, vp, slots, ids, pos)


def test_one_kernel_module_for_every_layer():
    # the engine calls the kernel once per layer in a Python loop; every call site must carry the
    # same module, or the GPU runtime compiles the kernel again for each layer on the first step
    from sparda_jax.ops.sparse_attention.decode import paged_sparse_decode_attention

    q, kp, vp, slots, ids, pos, _ = _paged(0, 3, 64)

    def layers(q):
        for _ in range(3):
            q = paged_sparse_decode_attention(q, kp, vp, slots, ids, pos)
        return q

    assert mosaic_kernel_modules(lower_for_hopper(layers, q)) == 1


def test_rejects_unsupported_inputs():
    q, k, v, ids, pos = _case(0, 3, 64)
    with pytest.raises(ConfigError, match="DecodeConfig.stages: must be >= 2"):
        DecodeConfig(stages=1)
    with pytest.raises(ConfigError, match="DecodeConfig.n_split"):
        DecodeConfig(n_split=0)
    with pytest.raises(TypeError, match="bf16"):
        sparse_decode_attention(q.astype(jnp.float32), k, v, ids, pos)
    with pytest.raises(ValueError, match="multiples of 64"):
        sparse_decode_attention(q, k[:, :500], v[:, :500], ids, pos)


@gpu
@pytest.mark.parametrize("g,d,n_split,stages", [(3, 64, None, 4), (16, 128, None, 4), (16, 128, 2, 4), (3, 64, 5, 2),
                                                (16, 128, 2, 2)])
def test_compiled_matches_reference(g, d, n_split, stages):
    # the default split count gives 2 blocks per split here (the last splits empty, their windows
    # clamped); 5 splits clamp a last window with entries; 2 splits turn the ring several times
    q, k, v, ids, pos = _case(g, g, d, s=4096, n=24)
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    out = jax.jit(functools.partial(sparse_decode_attention, config=DecodeConfig(n_split, stages)))(q, k, v, ids, pos)
    assert_attention_close(out, exact, plain, q)


def test_dispatch_through_sparse_attention():
    from sparda_jax import sparse_attention

    q, k, v, ids, pos = _case(5, 3, 64)
    got = sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], implementation="mosaic_gpu_interpret")
    ref = sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], implementation="xla")
    assert rel_error(got, ref) < BF16_PAIR_DECODE
    with pytest.raises(NotImplementedError, match="no bias"):  # Tq > 1 goes to the prefill kernel
        sparse_attention(q[:, None], k, v, ids[:, :, None], pos[:, None], bias=jnp.ones(k.shape[:3]),
                         implementation="mosaic_gpu_interpret")
    # None falls back to the reference where the kernel cannot run (here: f32, and no Hopper GPU)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    np.testing.assert_array_equal(
        sparse_attention(q32[:, None], k32, v32, ids[:, :, None], pos[:, None]),
        sparse_attention(q32[:, None], k32, v32, ids[:, :, None], pos[:, None], implementation="xla"))
    with pytest.raises(NotImplementedError, match="bf16/f16"):
        sparse_attention(q32[:, None], k32, v32, ids[:, :, None], pos[:, None], implementation="mosaic_gpu_interpret")
    # a cache of a partial last block: not the kernel's (None falls back to the reference there)
    cut = k.shape[1] - 16
    with pytest.raises(NotImplementedError, match="whole 64-token blocks"):
        sparse_attention(q[:, None], k[:, :cut], v[:, :cut], ids[:, :, None], jnp.minimum(pos, cut - 1)[:, None],
                         implementation="mosaic_gpu_interpret")


def test_default_split_count():
    from sparda_jax.ops.sparse_attention.decode import default_n_split

    assert default_n_split(96) == 4     # no grid given: the measured 4
    assert default_n_split(3) == 3      # never more splits than blocks
    # minicpm4.1 (2 KV heads) on the H200's 132 SMs: two CTAs per SM in one wave at batch 16
    assert default_n_split(96, 16 * 2, sms=132) == 8
    assert default_n_split(96, 64 * 2, sms=132) == 4     # at least 4 (batch 64 measured 0.89-0.97)
    assert default_n_split(96, 1 * 2, sms=132) == 16     # at most 16
    assert default_n_split(5, 2, sms=132) == 5
    # one CTA per SM fits at 3+ stages or head dim 256: the grid is one wave of those
    assert default_n_split(96, 16 * 2, sms=132, stages=3) == 4
    assert default_n_split(96, 8 * 2, sms=132, head_dim=256) == 8


@pytest.mark.parametrize("n", [6, 96, 2048, 16384])
def test_two_ctas_fit_an_sm(n):
    """At 2 stages and D = 128 the kernel's SMEM (checked by Mosaic GPU's own budget check under an
    artificial limit) leaves room for a second CTA on a Hopper SM, contiguous and paged, up to a
    block list of 16384 (1M tokens: each CTA holds only its split's window of the list). Before
    the output staging reused the rings' SMEM the kernel needed 118808 B, and every CTA had an
    SM to itself."""
    from jax.experimental.mosaic.gpu import core as mgpu_core
    from sparda_jax.ops.sparse_attention.decode import (CTAS_PER_SM, SMEM_PER_SM, SMEM_RESERVED_PER_CTA,
                                                  paged_sparse_decode_attention)

    limit = SMEM_PER_SM // CTAS_PER_SM - SMEM_RESERVED_PER_CTA
    b, kh, g, d = 16, 2, 16, 128
    sds = jax.ShapeDtypeStruct
    q, pos = sds((b, kh * g, d), jnp.bfloat16), sds((b,), jnp.int32)
    ids = sds((b, kh, n), jnp.int32)
    kv = sds((b, max(n, 8) * 64, kh, d), jnp.bfloat16)
    pool = sds((b, kh, n, 64, d), jnp.bfloat16)
    with mgpu_core.artificial_shared_memory_limit(limit):
        lower_for_hopper(functools.partial(sparse_decode_attention, config=DecodeConfig(stages=2)), q, kv, kv, ids, pos)
        lower_for_hopper(functools.partial(paged_sparse_decode_attention, config=DecodeConfig(stages=2)),
                         q, pool, pool, ids, ids, pos)
    with pytest.raises(ValueError, match="exceeds available shared memory"):  # the check does bite
        with mgpu_core.artificial_shared_memory_limit(limit):
            lower_for_hopper(functools.partial(sparse_decode_attention, config=DecodeConfig(stages=3)),
                             q, kv, kv, ids, pos)


def _paged(seed, g, d, n_slots=10):
    """The contiguous case scattered into a block cache: each selected block in a random slot."""
    q, k, v, ids, pos = _case(seed, g, d)
    b, s, kh, _ = k.shape
    rng = np.random.default_rng(seed)
    kb = np.asarray(k, np.float32).reshape(b, s // 64, 64, kh, d).transpose(0, 3, 1, 2, 4)
    vb = np.asarray(v, np.float32).reshape(b, s // 64, 64, kh, d).transpose(0, 3, 1, 2, 4)
    k_pool = rng.standard_normal((b, kh, n_slots, 64, d)).astype(np.float32)  # stale slots: never read
    v_pool = rng.standard_normal((b, kh, n_slots, 64, d)).astype(np.float32)
    slots = np.full(ids.shape, -1, np.int32)
    for bi in range(b):
        for h in range(kh):
            row = np.asarray(ids)[bi, h]
            free = rng.permutation(n_slots)
            for j, blk in enumerate(row):
                if blk >= 0:
                    slots[bi, h, j] = free[j]
                    k_pool[bi, h, free[j]], v_pool[bi, h, free[j]] = kb[bi, h, blk], vb[bi, h, blk]
    cast = lambda x: jnp.asarray(x, jnp.bfloat16)
    return q, cast(k_pool), cast(v_pool), jnp.asarray(slots), ids, pos, (k, v)


@pytest.mark.parametrize("g,d", [(3, 64), (16, 128)])
def test_paged_interpret_matches_the_contiguous_reference(g, d):
    from sparda_jax.ops.sparse_attention.decode import (paged_sparse_decode_attention,
                                                  paged_sparse_decode_attention_reference)

    q, kp, vp, slots, ids, pos, (k, v) = _paged(g + 20, g, d)
    f32 = lambda x: x.astype(jnp.float32)
    exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)  # independent of the slots
    np.testing.assert_allclose(paged_sparse_decode_attention_reference(f32(q), f32(kp), f32(vp), slots, ids, pos),
                               exact, atol=1e-5)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    out = jax.jit(functools.partial(paged_sparse_decode_attention, config=DecodeConfig(n_split=3),
                                    interpret=INTERPRET))(q, kp, vp, slots, ids, pos)
    # same bound as the contiguous kernel
    assert_attention_close(out, exact, plain, q)


@gpu
def test_paged_compiled_matches_reference():
    from sparda_jax.ops.sparse_attention.decode import paged_sparse_decode_attention

    q, kp, vp, slots, ids, pos, (k, v) = _paged(7, 16, 128)
    f32 = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        exact = sparse_decode_attention_reference(f32(q), f32(k), f32(v), ids, pos)
    plain = sparse_decode_attention_reference(q, k, v, ids, pos)
    out = jax.jit(paged_sparse_decode_attention)(q, kp, vp, slots, ids, pos)
    assert_attention_close(out, exact, plain, q)


def test_paged_dispatch():
    from sparda_jax.attention import paged_sparse_attention

    q, kp, vp, slots, ids, pos, _ = _paged(3, 3, 64)
    args = (q[:, None], kp, vp, slots[:, :, None], ids[:, :, None], pos[:, None])
    got = paged_sparse_attention(*args, implementation="mosaic_gpu_interpret")
    assert rel_error(got, paged_sparse_attention(*args, implementation="xla")) < BF16_PAIR_DECODE
    with pytest.raises(NotImplementedError, match="no bias"):
        paged_sparse_attention(*args, bias_pool=jnp.ones(kp.shape[:4]), implementation="mosaic_gpu_interpret")


@gpu
def test_engine_attends_through_the_paged_kernel():
    # On the CPU the interpreter cannot run inside the engine's jit (its lowering fails on the
    # interpreter's callbacks there), so the engine-level check is compiled, on the GPU. The
    # implementation applies to every sparse attention of the run (the prefill kernel too, which
    # takes head dim 128 only).
    from engine_runs import sparda_bf16_decode

    from sparda_jax import SparseConfig, get_preset

    sp = SparseConfig(local_blocks=1, topk=4, dense_len=0)
    cfg = get_preset("tiny").replace(num_layers=2, head_dim=128, sparse=sp)
    # 70 steps cross block boundaries: completed blocks go to the host
    run = dict(tok_len=400, lengths=[320, 301], cache_size=448, steps=70)
    outs = {impl: sparda_bf16_decode(cfg, sparse_attention=impl, **run) for impl in ("mosaic_gpu", "xla")}
    assert rel_error(outs["mosaic_gpu"], outs["xla"]) < BF16_MODEL
