"""The Mosaic GPU block-sparse prefill kernel against its jnp reference: the union metadata
against plain numpy, the kernel in interpret mode on the CPU, the Hopper lowering on the CPU,
and compiled on the GPU at MiniCPM size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_base import BF16_PAIR_PREFILL, INTERPRET, assert_attention_close, gpu, interpret, lower_for_hopper, rel_error

from sparda_jax.ops.sparse_attention.decode import DecodeConfig
from sparda_jax.ops.sparse_attention.prefill import (build_prefill_meta, sparse_prefill_attention,
                                                     sparse_prefill_attention_reference, tile_tokens_for,
                                                     union_stats)


def _ids(rng, pos, kh, n, drop_own=()):
    """Selector-like lists: the own block plus random earlier ones, ascending, unique, -1
    padded, ragged counts. Tokens in drop_own select nothing (all -1)."""
    b, t = pos.shape
    ids = np.full((b, kh, t, n), -1, np.int32)
    for bi in range(b):
        for h in range(kh):
            for ti in range(t):
                if ti in drop_own:
                    continue
                own = int(pos[bi, ti]) // 64
                cnt = int(rng.integers(1, min(n, own + 1) + 1))
                ids[bi, h, ti, :cnt] = sorted(rng.choice(own, cnt - 1, replace=False).tolist()) + [own]
    return ids


def _case(seed, g, d, dtype, *, kh=2, b=2, t=100, s=300, n=5, bias=False):
    """Chunked prefill with ragged offsets: T queries at the last T positions of each sequence
    (sequence 1 is shorter), T and S not multiples of 64 or of the tile."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, kh * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kh, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kh, d)), dtype)
    length = np.array([s, s - 37, s - 5, s][:b])
    pos = (length[:, None] - t + np.arange(t)[None]).astype(np.int32)
    ids = _ids(rng, pos, kh, n, drop_own=(3,))   # token 3 sees nothing: its output must be 0
    cis = jnp.asarray(rng.standard_normal((b, s, kh)), jnp.float32) if bias else None
    return q, k, v, jnp.asarray(ids), jnp.asarray(pos), cis


def _numpy_union(ids, tt):
    b, kh, t, n = ids.shape
    out = []
    for bi in range(b):
        for h in range(kh):
            for i in range(t // tt):
                rows = ids[bi, h, i * tt:(i + 1) * tt]
                u = sorted({int(x) for x in rows.ravel() if x >= 0})
                out.append(((bi, h, i), u, [sum(1 << r for r in range(tt) if blk in rows[r]) for blk in u]))
    return out


@pytest.mark.parametrize("tt", [4, 8, 32])
def test_meta_is_the_union_of_the_tile(tt):
    rng = np.random.default_rng(tt)
    b, kh, t, n = 2, 2, 64, 6
    ids = rng.integers(-1, 12, (b, kh, t, n)).astype(np.int32)   # any order, repeats, -1 anywhere
    ids[0, 0, :tt] = -1                                           # an empty tile
    meta = jax.jit(build_prefill_meta, static_argnums=1)(jnp.asarray(ids), tt)
    for (bi, h, i), u, bits in _numpy_union(ids, tt):
        assert int(meta.n_union[bi, h, i]) == len(u)
        np.testing.assert_array_equal(meta.uids[bi, h, i, :len(u)], u)
        assert (np.asarray(meta.uids[bi, h, i, len(u):]) == -1).all()
        np.testing.assert_array_equal(meta.ubits[bi, h, i, :len(u)], np.array(bits, np.uint32).view(np.int32))


def test_meta_drops_out_of_range_blocks():
    ids = jnp.asarray([[[[0, 5], [2, 9]] * 2]], jnp.int32)       # [1, 1, 4, 2]; blocks >= 4 do not exist
    meta = build_prefill_meta(ids, 4, n_blocks=4)
    np.testing.assert_array_equal(meta.uids[0, 0, 0, :2], [0, 2])
    np.testing.assert_array_equal(meta.ubits[0, 0, 0, :2], [0b0101, 0b1010])
    assert int(meta.n_union[0, 0, 0]) == 2


def test_union_stats():
    pos = np.broadcast_to(np.arange(256, dtype=np.int32), (1, 256))
    same = np.broadcast_to(np.array([0, 1, -1], np.int32), (1, 2, 256, 3))
    st = union_stats(same, 16)                                       # every token picks {0, 1}
    assert st["tile_tokens"] == 4 == tile_tokens_for(16) and st["mean_union"] == 2.0 and st["efficiency"] == 1.0
    ids = _ids(np.random.default_rng(0), pos, 2, 4)
    st = union_stats(ids, 3)                                         # G=3 -> 4 rows per token
    union = np.mean([len(u) for _, u, _ in _numpy_union(ids, 16)])
    selected = np.mean(np.sum(ids >= 0, -1))
    assert st["tile_tokens"] == 16 and st["row_fill"] == 0.75
    assert st["mean_union"] == pytest.approx(union)                  # a tile of 64 rows: 16 tokens
    assert st["mean_selected"] == pytest.approx(selected)
    assert st["efficiency"] == pytest.approx(selected / union) and st["efficiency"] < 1


def _check_against_reference(out, q, k, v, ids, pos, cis):
    f32 = lambda x: x.astype(jnp.float32)
    # f32 reference on the same rounded inputs; `plain` is the jnp path in q's dtype
    # (kernel_base.ROUNDED_P_FACTOR says why the kernel may carry 3x its error)
    with jax.default_matmul_precision("highest"):
        exact = sparse_prefill_attention_reference(f32(q), f32(k), f32(v), ids, pos, bias=cis)
        plain = sparse_prefill_attention_reference(q, k, v, ids, pos, bias=cis)
    assert_attention_close(out, exact, plain, q)
    return exact


@pytest.mark.parametrize("g,d,dtype,bias", [
    (16, 64, jnp.float16, True),
    (3, 128, jnp.bfloat16, False),
])
def test_interpret_matches_reference(g, d, dtype, bias):
    q, k, v, ids, pos, cis = _case(g + d, g, d, dtype, bias=bias)
    f = jax.jit(functools.partial(sparse_prefill_attention, interpret=INTERPRET))
    out = f(q, k, v, ids, pos, bias=cis)
    _check_against_reference(out, q, k, v, ids, pos, cis)
    assert (np.asarray(out[:, 3], np.float32) == 0).all()          # token 3 selected nothing


def test_interpret_causal_prefill_from_position_zero():
    """Plain prefill (positions 0..T-1, S = T): the first block is partly in the future of
    most of its tokens, the causal mask inside blocks does the work."""
    rng = np.random.default_rng(7)
    b, t, kh, g, d = 1, 150, 1, 16, 64
    q, k, v = (jnp.asarray(rng.standard_normal(sh), jnp.bfloat16) for sh in
               ((b, t, kh * g, d), (b, t, kh, d), (b, t, kh, d)))
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    ids = jnp.asarray(_ids(rng, pos, kh, 3))
    out = jax.jit(functools.partial(sparse_prefill_attention, interpret=INTERPRET))(q, k, v, ids, jnp.asarray(pos))
    _check_against_reference(out, q, k, v, ids, jnp.asarray(pos), None)


def test_interpret_race_detector_finds_nothing():
    """The barrier protocol of the K/V double buffer under the interpreter's race detector."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    q, k, v, ids, pos, cis = _case(1, 16, 64, jnp.bfloat16, b=1, t=24, s=200, n=3, bias=True)
    f = functools.partial(sparse_prefill_attention, interpret=interpret(detect_races=True))
    out = jax.jit(f)(q, k, v, ids, pos, bias=cis)
    assert not gpu_callbacks.get_races().races_found
    _check_against_reference(out, q, k, v, ids, pos, cis)


def test_gpu_form_lowers_for_hopper():
    """The compiled form (P from registers, accumulator in place) through the Mosaic GPU
    lowering for sm_90 on the CPU: layouts, TMA shapes, wgmma rules, the SMEM budget."""
    for g, d, dtype, bias in ((16, 128, jnp.bfloat16, True), (3, 64, jnp.float16, False)):
        q, k, v, ids, pos, cis = _case(0, g, d, dtype, bias=bias, t=70, s=256, n=3)
        lower_for_hopper(sparse_prefill_attention, q, k, v, ids, pos, bias=cis)


def test_rejects_unsupported_inputs():
    q, k, v, ids, pos, _ = _case(0, 3, 64, jnp.bfloat16, t=8, s=64, n=2)
    with pytest.raises(TypeError, match="bf16/f16"):
        sparse_prefill_attention(q.astype(jnp.float32), k, v, ids, pos)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse_prefill_attention(q[..., :32], k[..., :32], v[..., :32], ids, pos)
    with pytest.raises(ValueError, match="block_ids"):
        sparse_prefill_attention(q, k, v, ids[:, :1], pos)
    with pytest.raises(ValueError, match="bias"):
        sparse_prefill_attention(q, k, v, ids, pos, bias=jnp.zeros((2, 63, 2)))
    from sparda_jax import sparse_attention

    for impl in ("xla", "mosaic_gpu_interpret"):                    # the prefill kernel takes no tuning
        with pytest.raises(ValueError, match="prefill kernel has none"):
            sparse_attention(q, k, v, ids, pos, implementation=impl, config=DecodeConfig())


def test_dispatch_through_sparse_attention():
    from sparda_jax import sparse_attention

    q, k, v, ids, pos, cis = _case(5, 3, 64, jnp.bfloat16, t=40, s=200, n=3, bias=True)
    got = sparse_attention(q, k, v, ids, pos, bias=cis, implementation="mosaic_gpu_interpret")
    ref = sparse_attention(q, k, v, ids, pos, bias=cis, implementation="xla")
    assert rel_error(got, ref) < BF16_PAIR_PREFILL


@gpu
def test_compiled_matches_reference_minicpm_size():
    """MiniCPM4 layer shape at 8K with InfLLM-V2's own selection (96 blocks: 1 init + 33
    local + 62 by content) on random q/k."""
    from sparda_jax import SparseConfig
    from sparda_jax.compress import compress_keys
    from sparda_jax.select import select_blocks_infllmv2

    b, t, h, kh, d = 1, 8192, 32, 2, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, sh).astype(jnp.bfloat16)
               for kk, sh in zip(ks, ((b, t, h, d), (b, t, kh, d), (b, t, kh, d))))
    cis = jax.random.normal(ks[3], (b, t, kh)) * 0.5
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    sp = SparseConfig(dense_len=0)
    ids = jax.jit(functools.partial(select_blocks_infllmv2, sparse=sp))(q, compress_keys(k, 32, 16), pos)
    for bias in (None, cis):
        out = jax.jit(sparse_prefill_attention)(q, k, v, ids, pos, bias=bias)
        _check_against_reference(out, q, k, v, ids, pos, bias)
    print(union_stats(ids, h // kh))


@gpu
def test_compiled_matches_reference_smollm2_size():
    """SmolLM2-135M's layer shape (9 query heads on 3 KV heads, head dim 64) at 4K with its
    InfLLM-V2 selection (1 init + 8 local + 15 by content): the head dim the compiled kernel
    must pass before `sparse_attention` routes head dim 64 to it."""
    from sparda_jax import SparseConfig
    from sparda_jax.compress import compress_keys
    from sparda_jax.select import select_blocks_infllmv2

    b, t, h, kh, d = 2, 4096, 9, 3, 64
    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, sh).astype(jnp.bfloat16)
               for kk, sh in zip(ks, ((b, t, h, d), (b, t, kh, d), (b, t, kh, d))))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    sp = SparseConfig(local_blocks=8, topk=24, dense_len=0)
    ids = jax.jit(functools.partial(select_blocks_infllmv2, sparse=sp))(q, compress_keys(k, 32, 16), pos)
    out = jax.jit(sparse_prefill_attention)(q, k, v, ids, pos)
    _check_against_reference(out, q, k, v, ids, pos, None)
    print(union_stats(ids, h // kh))
