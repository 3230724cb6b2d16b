"""The attention-mass oracle (`eval.bound`): the selection that keeps the most of each layer's
own attention at the sparse mode's budget, and the model run with it."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import get_preset, init_model
from sparda_jax.modes import forward
from sparda_jax.select import select_blocks_infllmv2
from sparda_jax.compress import compress_keys

from sparda_jax.eval.bound import attention_mass_topk, oracle_forward

TINY = get_preset("tiny")  # blocks of 16, 1 init + 1 local block, topk 4


def _mass_kept(q, k, pos, ids, block_size):
    """float64 [B, K, T]: the group-summed causal attention mass on the blocks `ids` holds."""
    q, k, ids = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(ids)
    b, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    out = np.zeros((b, kh, t))
    for bi in range(b):
        for kv in range(kh):
            for i in range(t):
                p = int(pos[bi, i])
                keep = set(int(x) for x in ids[bi, kv, i] if x >= 0)
                for hh in range(kv * g, kv * g + g):
                    z = k[bi, :p + 1, kv] @ q[bi, i, hh] / math.sqrt(d)
                    w = np.exp(z - z.max())
                    w /= w.sum()
                    out[bi, kv, i] += sum(w[j] for j in range(p + 1) if j // block_size in keep)
    return out


def test_the_oracle_keeps_at_least_the_mass_infllmv2_keeps():
    """Per row, the oracle's blocks hold at least as much of the row's attention as InfLLM-V2's
    (both keep the forced blocks and topk in all); its ids follow the selectors' layout."""
    sp = TINY.sparse
    rng = np.random.default_rng(3)
    b, t, kh, g, d = 2, 96, 2, 2, 16
    q = jnp.asarray(3 * rng.standard_normal((b, t, kh * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, kh, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    nb = t // sp.block_size
    ours = attention_mass_topk(q, k, pos, sp, n_blocks=nb, q_chunk=40)  # chunks that do not divide T
    theirs = select_blocks_infllmv2(q, compress_keys(k, sp.kernel_size, sp.kernel_stride), pos, sp, n_blocks=nb)
    assert ours.shape == theirs.shape == (b, kh, t, sp.topk)
    mine, other = _mass_kept(q, k, pos, ours, sp.block_size), _mass_kept(q, k, pos, theirs, sp.block_size)
    assert np.all(mine >= other - 1e-9)
    choice = np.arange(t) // sp.block_size + 1 > sp.topk  # rows with more visible blocks than the budget
    assert np.mean((mine > other + 1e-6)[..., choice]) > 0.2  # strictly more on many: not the same choice
    ids = np.asarray(ours)
    for bi, kv, i in [(0, 0, 95), (1, 1, 50), (0, 1, 20)]:
        row = ids[bi, kv, i]
        kept = row[row >= 0]
        qb = i // sp.block_size
        assert list(kept) == sorted(kept) and 0 in kept and qb in kept and max(kept) <= qb
        assert len(kept) == min(sp.topk, qb + 1)


def test_with_every_block_kept_the_oracle_model_is_the_dense_model():
    """A budget of all blocks leaves the oracle nothing to choose: its logits are dense mode's."""
    cfg = TINY.replace(sparse=dataclasses.replace(TINY.sparse, topk=8))
    params = init_model(cfg, jax.random.key(0))
    tok = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 128)), jnp.int32)
    logits, ids = oracle_forward(params, tok, cfg)
    assert ids.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 128, 8)
    np.testing.assert_allclose(logits, forward(params, tok, cfg, mode="dense"), rtol=2e-5, atol=2e-5)
    # at the tiny preset's budget it differs from dense, and from InfLLM-V2's sparse mode
    small, _ = oracle_forward(params, tok, TINY)
    dense, sparse = (forward(params, tok, TINY, mode=m) for m in ("dense", "sparse"))
    assert float(jnp.abs(small - dense).max()) > 1e-3 and float(jnp.abs(small - sparse).max()) > 1e-3


def test_oracle_in_no_layer_is_the_sparse_mode_and_in_some_layers_lies_between():
    """oracle_layers=() chooses every layer's blocks as the sparse mode does (InfLLM-V2 from the
    layer's own queries): the same logits and ids as `forward(mode="sparse")`; the oracle in one
    layer gives other logits than either end, and a layer index outside the model is refused."""
    params = init_model(TINY, jax.random.key(0))
    tok = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 192)), jnp.int32)
    none, ids = oracle_forward(params, tok, TINY, oracle_layers=())
    sparse, aux = forward(params, tok, TINY, mode="sparse", collect_selection=True)
    np.testing.assert_allclose(none, sparse, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(ids, aux["ids"])
    every, _ = oracle_forward(params, tok, TINY)
    one, ids1 = oracle_forward(params, tok, TINY, oracle_layers=(1,))
    assert float(jnp.abs(one - none).max()) > 1e-3 and float(jnp.abs(one - every).max()) > 1e-3
    np.testing.assert_array_equal(ids1[0], ids[0])  # layer 0 unchanged: same input, same choice
    with pytest.raises(ValueError, match="outside 0..2"):
        oracle_forward(params, tok, TINY, oracle_layers=(3,))


def test_a_larger_budget_in_some_layers_keeps_their_choice_and_at_every_block_is_dense():
    """layer_topk: InfLLM-V2's choice with another budget in those layers. Every layer at the
    block count attends to every visible block (the dense mode's logits); one layer at a larger
    budget keeps the blocks of the smaller one (same input: the layers before are unchanged)
    and pads the others' rows with -1. A budget under the forced blocks, or a layer also in
    oracle_layers, is refused."""
    params = init_model(TINY, jax.random.key(0))
    tok = jnp.asarray(np.random.default_rng(3).integers(0, TINY.vocab_size, (2, 192)), jnp.int32)
    n_blocks = 192 // TINY.sparse.block_size
    every, _ = oracle_forward(params, tok, TINY, oracle_layers=(), layer_topk=tuple((i, n_blocks) for i in range(3)))
    np.testing.assert_allclose(every, forward(params, tok, TINY, mode="dense"), rtol=2e-5, atol=2e-5)
    _, ids = oracle_forward(params, tok, TINY, oracle_layers=())
    _, wide = oracle_forward(params, tok, TINY, oracle_layers=(), layer_topk=((1, 8),))
    k = TINY.sparse.topk
    assert wide.shape[-1] == 8
    np.testing.assert_array_equal(wide[0, ..., :k], ids[0])
    assert bool(jnp.all(wide[0, ..., k:] == -1))
    small, big = np.asarray(ids[1]), np.asarray(wide[1])
    for row_s, row_b in zip(small.reshape(-1, k), big.reshape(-1, 8)):
        assert set(row_s[row_s >= 0]) <= set(row_b[row_b >= 0])
    with pytest.raises(ValueError, match="forced blocks"):
        oracle_forward(params, tok, TINY, oracle_layers=(), layer_topk=((1, 1),))
    with pytest.raises(ValueError, match="not in oracle_layers"):
        oracle_forward(params, tok, TINY, oracle_layers=(1,), layer_topk=((1, 8),))
