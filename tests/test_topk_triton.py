"""The selectors' top-k stage as a Triton kernel (`ops/block_select/topk_triton.py`) against
`reference.finalize_topk`: random rows with ties, -inf and forced blocks, interpreted on the
CPU and compiled on a GPU; the selectors' "triton" backends against "xla"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu
from kernel_base import gpu, padded_block_accesses

from sparda_jax import SparseConfig
from sparda_jax.compress import compress_keys
from sparda_jax.ops.block_select.reference import finalize_topk
from sparda_jax.ops.block_select.topk_triton import MAX_BLOCKS, finalize_topk_triton
from sparda_jax.select import select_blocks_forecast, select_blocks_infinigen, select_blocks_infllmv2

SP = SparseConfig(block_size=64, init_blocks=1, local_blocks=8, topk=24, dense_len=0)  # SmolLM2's budget


def _rows(seed: int, b: int, kh: int, tq: int, nb: int):
    """Block scores drawn from 5 values (ties everywhere), a sixth of them -inf, and query
    positions from before the first block to past the last one, -1 (padding) included."""
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 5, (b, kh, tq, nb)).astype(np.float32)
    s[rng.random(s.shape) < 1 / 6] = -np.inf
    pos = rng.integers(-1, nb * SP.block_size + 10, (b, tq)).astype(np.int32)
    pos[0, 0] = nb * SP.block_size - 1  # the last block's own query: every block a candidate
    return jnp.asarray(s), jnp.asarray(pos)


def _check(interpret: bool, seed: int, b, kh, tq, nb, topk, force):
    s, pos = _rows(seed, b, kh, tq, nb)
    want = finalize_topk(s, pos, topk, SP, force=force)
    got = finalize_topk_triton(s, pos, topk, SP, force=force, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("b,kh,tq,nb,topk", [(1, 3, 1, 65, 24), (2, 3, 1, 129, 24), (2, 2, 3, 20, 24),
                                             (1, 2, 2, 7, 5), (3, 1, 1, 33, 32), (1, 1, 1, 256, 96)])
@pytest.mark.parametrize("force", [True, False])
def test_interpreted_equals_finalize_topk(b, kh, tq, nb, topk, force):
    """SmolLM2's 4K and 8K decode rows, fewer blocks than the budget, sizes that are not powers
    of two, the envelope's longest row; ties go to the lower block id as in lax.top_k."""
    _check(True, nb + topk, b, kh, tq, nb, topk, force)


def test_triton_top_k_masks_its_padded_rows():
    """The row of 65 blocks and the 24 ids are padded to 128 and 32 inside the kernel: every
    access goes through a mask (compiled, a plain store wrote the padding over the next row's ids
    on an H100 at 16e5709; the interpreter cannot show it)."""
    s, pos = _rows(0, 1, 3, 1, 65)
    fn = lambda s, pos: finalize_topk_triton(s, pos, 24, SP, interpret=True)
    padded, unmasked = padded_block_accesses(fn, s, pos)
    assert len(padded) == 2 and unmasked == []  # the scores (65 in 128) and the ids (24 in 32)


def _decode_case(seed, t=1200, kh=3, g=3, d=64, b=2):
    ks = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(ks[0], (b, t, kh, d))
    q = jax.random.normal(ks[1], (b, 1, kh * g, d))
    f = jax.random.normal(ks[2], (b, 1, kh, d))
    pos = jnp.array([[t - 1], [t // 2]], jnp.int32)[:b]
    return q, f, k, compress_keys(k, 32, 16), pos


def test_selectors_triton_backend_selects_what_xla_selects():
    sp = SparseConfig(block_size=64, init_blocks=1, local_blocks=2, topk=8, dense_len=0)
    q, f, k, kc, pos = _decode_case(0)
    for select, args, kw in ((select_blocks_forecast, (f, kc, pos, sp), {}),
                             (select_blocks_infllmv2, (q, kc, pos, sp), {}),
                             (select_blocks_infinigen, (q[..., :16], k[..., :16], pos, sp), {"head_dim": 64})):
        want = select(*args, implementation="xla", **kw)
        got = select(*args, implementation="triton_interpret", **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=select.__name__)


def test_triton_top_k_envelope():
    s, pos = _rows(0, 1, 1, 1, MAX_BLOCKS + 1)
    with pytest.raises(NotImplementedError, match="rows of"):
        finalize_topk_triton(s, pos, 24, SP, interpret=True)
    sp = SparseConfig(block_size=64, init_blocks=1, local_blocks=2, topk=8, dense_len=0)
    q, f, k, kc, pos = _decode_case(1, t=(MAX_BLOCKS + 1) * 64)
    with pytest.raises(NotImplementedError, match="rows of"):
        select_blocks_forecast(f, kc, pos, sp, implementation="triton_interpret")
    if not has_gpu():
        q, f, k, kc, pos = _decode_case(2)
        with pytest.raises(NotImplementedError, match="GPU"):
            select_blocks_forecast(f, kc, pos, sp, implementation="triton")


@gpu
@pytest.mark.parametrize("b,kh,tq,nb,topk", [(1, 3, 1, 65, 24), (8, 3, 1, 129, 24), (2, 2, 3, 20, 24),
                                             (1, 2, 2, 7, 5), (2, 2, 1, 256, 96)])
def test_compiled_equals_finalize_topk(b, kh, tq, nb, topk):
    """Compiled: the same ids as the reference, at SmolLM2's 4K and 8K decode rows (batch 1 and
    8), fewer blocks than the budget, sizes that are not powers of two (masked edge blocks) and
    the envelope's longest row."""
    for force in (True, False):
        _check(False, nb + topk, b, kh, tq, nb, topk, force)
