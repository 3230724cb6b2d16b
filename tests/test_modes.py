"""The backbone in every mode: consistency with dense, prefill vs decode, metrics, InfiniGen."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import forecast_param_count, forward, get_preset, init_forecast, init_model
from sparda_jax.compress import compress_keys
from sparda_jax.infinigen import infinigen_setup
from sparda_jax.metrics import attention_mass, block_recall
from sparda_jax.model import layered_params
from sparda_jax.modes import decode_step, layered_state, prefill, stacked_state
from sparda_jax.select import select_blocks_infllmv2

TINY = get_preset("tiny")        # blocks of 16, init 1, local 1, topk 4
TINY_NOSA = get_preset("tiny-nosa")
SPARSE_MODES = ["sparse", "sparda", "infinigen"]


def _setup(config, seed=0):
    params = init_model(config, jax.random.key(seed))
    if config.has_cis:  # A is zero at init; make cis matter
        layers = dict(params["layers"])
        layers["cis_A"] = jax.random.normal(jax.random.key(seed + 1), layers["cis_A"].shape)
        params = dict(params, layers=layers)
    forecast = init_forecast(config, jax.random.key(seed + 2))
    calib = jax.random.randint(jax.random.key(seed + 3), (1, 96), 0, config.vocab_size)
    ig = infinigen_setup(params, config, calib)
    return params, forecast, ig


@pytest.fixture(scope="module")
def tiny():
    return _setup(TINY)


@pytest.fixture(scope="module")
def tiny_nosa():
    return _setup(TINY_NOSA)


def _run(config, setup, tokens, mode, **kw):
    params, forecast, ig = setup
    return forward(params, tokens, config, mode=mode, forecast=forecast, infinigen=ig, **kw)


@pytest.mark.parametrize("mode", SPARSE_MODES)
@pytest.mark.parametrize("nosa", [False, True])
def test_full_budget_equals_dense(tiny, tiny_nosa, mode, nosa):
    config, setup = (TINY_NOSA, tiny_nosa) if nosa else (TINY, tiny)
    t = 64  # 4 blocks of 16
    full = config.replace(sparse=dataclasses.replace(config.sparse, topk=4, **({"nosa_qk_topk": 4} if nosa else {})))
    tokens = jax.random.randint(jax.random.key(1), (2, t), 0, config.vocab_size)
    dense = _run(config, setup, tokens, "dense")
    sparse = _run(full, setup, tokens, mode)
    np.testing.assert_allclose(sparse, dense, atol=1e-5)


@pytest.mark.parametrize("mode", SPARSE_MODES)
def test_tight_budget_differs_from_dense(tiny, mode):
    tokens = jax.random.randint(jax.random.key(2), (1, 160), 0, TINY.vocab_size)
    dense = _run(TINY, tiny, tokens, "dense")
    sparse = _run(TINY, tiny, tokens, mode)
    # the first 4 blocks (64 tokens) see everything; later tokens do not
    np.testing.assert_allclose(sparse[:, :64], dense[:, :64], atol=1e-5)
    assert float(jnp.abs(sparse[:, 100:] - dense[:, 100:]).max()) > 1e-3


def _with_dense_layers(config, layers):
    return config.replace(sparse=dataclasses.replace(config.sparse, dense_layers=layers))


@pytest.mark.parametrize("mode", SPARSE_MODES)
@pytest.mark.parametrize("nosa", [False, True])
def test_every_layer_dense_equals_dense(tiny, tiny_nosa, mode, nosa):
    """A sparse mode whose every layer is in `dense_layers` is the dense mode (a tight budget,
    160 tokens: the sparse mode itself differs, `test_tight_budget_differs_from_dense`)."""
    config, setup = (TINY_NOSA, tiny_nosa) if nosa else (TINY, tiny)
    tokens = jax.random.randint(jax.random.key(2), (2, 160), 0, config.vocab_size)
    dense = _run(config, setup, tokens, "dense")
    every = _run(_with_dense_layers(config, tuple(range(config.num_layers))), setup, tokens, mode)
    np.testing.assert_allclose(every, dense, atol=1e-5)


def test_one_dense_layer_is_that_layer_at_every_block(tiny):
    """dense_layers=(1,) in the sparse mode equals InfLLM-V2's choice elsewhere and a budget of
    every block in layer 1, as `eval.bound.oracle_forward` computes it (a Python loop over
    layers with per-layer budgets, no dense attention); it differs from the sparse mode."""
    from sparda_jax.eval.bound import oracle_forward

    params = tiny[0]
    t = 160
    tokens = jax.random.randint(jax.random.key(5), (2, t), 0, TINY.vocab_size)
    one = _run(_with_dense_layers(TINY, (1,)), tiny, tokens, "sparse")
    ref, _ = oracle_forward(params, tokens, TINY, oracle_layers=(), layer_topk=((1, t // 16),))
    np.testing.assert_allclose(one, ref, atol=1e-5)
    assert float(jnp.abs(one - _run(TINY, tiny, tokens, "sparse")).max()) > 1e-3
    # oracle_forward reads the config's dense layers too; it refuses to put the oracle in one
    same, _ = oracle_forward(params, tokens, _with_dense_layers(TINY, (1,)), oracle_layers=())
    np.testing.assert_allclose(same, one, atol=1e-5)
    with pytest.raises(ValueError, match="attend densely"):
        oracle_forward(params, tokens, _with_dense_layers(TINY, (1,)), oracle_layers=(1,))


def test_dense_layers_validated():
    from sparda_jax.config import ConfigError

    for bad, why in (((2, 1), "strictly increasing"), ((1, 1), "strictly increasing"), ([1], "must be"),
                     ((-1,), ">= 0"), ((1.0,), "must be an int")):
        with pytest.raises(ConfigError, match=why):
            dataclasses.replace(TINY.sparse, dense_layers=bad)
    with pytest.raises(ConfigError, match="past the last"):
        _with_dense_layers(TINY, (TINY.num_layers,))


@pytest.mark.parametrize("mode", ["dense"] + SPARSE_MODES)
@pytest.mark.parametrize("nosa,layered,per_layer_weights,dense_layer", [
    (False, False, False, False), (True, False, True, False), (True, True, True, False), (False, False, False, True),
    (True, True, False, True)])
def test_decode_matches_prefill(tiny, tiny_nosa, mode, nosa, layered, per_layer_weights, dense_layer):
    """Teacher-forced decode, one token at a time from a prefilled state, reproduces the
    prefill logits of the same mode at every position (ragged batch included). layered: the
    state split per layer (`layered_state`, the Python loop over layers; NOSA's for every
    field: K/V, compressed keys, cis and compressed cis, InfiniGen's partial keys).
    per_layer_weights: prefill and decode read `layered_params` (the scans stack them back).
    dense_layer: layer 1 in `sparse.dense_layers` (a scan's traced choice, a loop's static one)."""
    config, setup = (TINY_NOSA, tiny_nosa) if nosa else (TINY, tiny)
    if dense_layer:
        config = _with_dense_layers(config, (1,))
    params, forecast, ig = setup
    b, t0, t1 = 2, 70, 150
    tokens = jax.random.randint(jax.random.key(3), (b, t1), 0, config.vocab_size)
    full = _run(config, setup, tokens, mode)
    if per_layer_weights:
        params = layered_params(params)
        assert isinstance(params["layers"], tuple) and len(params["layers"]) == config.num_layers
    lengths = jnp.array([t0, t0 - 13], jnp.int32)
    prompt = jnp.where(jnp.arange(t0)[None] < lengths[:, None], tokens[:, :t0], 0)
    run = dict(mode=mode, forecast=forecast, infinigen=ig)
    last, state = prefill(params, prompt, lengths, config, cache_size=160, **run)
    np.testing.assert_allclose(last, full[jnp.arange(b), lengths - 1], atol=2e-5)
    if layered:
        stacked0 = jax.tree.map(np.asarray, state)
        state = layered_state(state)
        assert len(state) == config.num_layers and state[0].kv.k.shape == stacked0.kv.k.shape[1:]
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, stacked_state(state)), stacked0)
    pos = lengths
    for _ in range(t1 - t0):
        tok = tokens[jnp.arange(b), pos]
        logits, state = decode_step(params, tok, pos, state, config, **run)
        np.testing.assert_allclose(logits, full[jnp.arange(b), pos], atol=2e-5, err_msg=f"{mode} at {pos}")
        pos = pos + 1
    assert isinstance(state, tuple) == layered  # the layout given comes back


def test_model_selection_is_the_selector_on_its_own_q_and_k(tiny):
    tokens = jax.random.randint(jax.random.key(4), (1, 130), 0, TINY.vocab_size)
    _, aux = _run(TINY, tiny, tokens, "sparse", return_kv=True, return_q=True, collect_selection=True)
    pos = jnp.arange(130, dtype=jnp.int32)[None]
    for layer in (0, 2):
        kc = compress_keys(aux["k"][layer], TINY.sparse.kernel_size, TINY.sparse.kernel_stride)
        ids = select_blocks_infllmv2(aux["q"][layer], kc, pos, TINY.sparse, n_blocks=9)
        np.testing.assert_array_equal(ids, aux["ids"][layer])
    np.testing.assert_array_equal(aux["ids"], aux["oracle"])
    assert float(block_recall(aux["ids"][1], aux["oracle"][1], pos, TINY.sparse)) == 1.0


def test_untrained_forecast_recall_is_partial(tiny):
    tokens = jax.random.randint(jax.random.key(5), (1, 256), 0, TINY.vocab_size)
    _, aux = _run(TINY, tiny, tokens, "sparda", collect_selection=True)
    pos = jnp.arange(256, dtype=jnp.int32)[None]
    recalls = [float(block_recall(aux["ids"][i], aux["oracle"][i], pos, TINY.sparse)) for i in range(3)]
    assert all(0.0 <= r < 1.0 for r in recalls), recalls


def test_mode_errors(tiny):
    params, _, _ = tiny
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="needs forecast params"):
        forward(params, tokens, TINY, mode="sparda")
    with pytest.raises(ValueError, match="offline setup"):
        forward(params, tokens, TINY, mode="infinigen")
    with pytest.raises(ValueError, match="unknown mode"):
        forward(params, tokens, TINY, mode="quest")


def test_dense_len_switches_to_dense(tiny):
    cfg = TINY.replace(sparse=dataclasses.replace(TINY.sparse, dense_len=200))
    tokens = jax.random.randint(jax.random.key(6), (1, 160), 0, TINY.vocab_size)
    np.testing.assert_allclose(_run(cfg, tiny, tokens, "sparse"), _run(cfg, tiny, tokens, "dense"), atol=1e-6)


# ------------------------------------------------------------------------------ parts and metrics

def test_forecast_param_count_minicpm():
    assert forecast_param_count(get_preset("minicpm4.1-8b")) == 32 * 4096 * 256 == 33_554_432
    f = jax.eval_shape(lambda: init_forecast(TINY, jax.random.key(0)))
    assert f["f0_cur"]["kernel"].shape == (64, 2, 16)
    assert f["f"]["kernel"].shape == (2, 64, 2, 16)
    assert sum(a.size for a in jax.tree.leaves(f)) == forecast_param_count(TINY)


def test_infinigen_projection_is_orthonormal(tiny):
    ig = tiny[2]
    r = round(0.2 * TINY.head_dim)
    assert ig.proj.shape == (TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, r)
    gram = jnp.einsum("LKDR,LKDS->LKRS", ig.proj, ig.proj)
    np.testing.assert_allclose(gram, jnp.broadcast_to(jnp.eye(r), gram.shape), atol=1e-5)


def test_block_recall_hand_case():
    from sparda_jax import SparseConfig

    sp = SparseConfig(block_size=4, kernel_size=4, kernel_stride=2, init_blocks=1, local_blocks=1, topk=5, dense_len=0)
    pos = jnp.array([[23]])  # q_blk 5: forced {0, 4, 5}
    oracle = jnp.array([[[[0, 1, 2, 4, 5]]]])  # content {1, 2}
    ids = jnp.array([[[[0, 2, 3, 4, 5]]]])  # content {2, 3}: one of two hit
    assert float(block_recall(ids, oracle, pos, sp)) == 0.5
    assert float(block_recall(ids, oracle, pos, sp, exclude_forced=False)) == pytest.approx(0.8)


def test_attention_mass_all_and_none():
    ks = jax.random.split(jax.random.key(7), 2)
    q = jax.random.normal(ks[0], (1, 10, 4, 8))
    k = jax.random.normal(ks[1], (1, 40, 2, 8))
    pos = jnp.arange(30, 40, dtype=jnp.int32)[None]
    everything = jnp.broadcast_to(jnp.arange(5), (1, 2, 10, 5))
    assert float(attention_mass(q, k, everything, pos, block_size=8, chunk=3)) == pytest.approx(1.0, abs=1e-6)
    # only block 0: the mass of the first 8 keys, computed by hand
    only0 = jnp.full((1, 2, 10, 1), 0)
    logits = np.einsum("tkgd,skd->kgts", np.asarray(q[0]).reshape(10, 2, 2, 8), np.asarray(k[0])) / np.sqrt(8)
    mask = np.arange(40)[None, :] <= np.asarray(pos[0])[:, None]
    logits = np.where(mask, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = p[..., :8].sum(-1).mean()
    assert float(attention_mass(q, k, only0, pos, block_size=8)) == pytest.approx(expected, rel=1e-5)


def test_tile_union_and_blowup_against_python_sets():
    """The block union of neighbouring queries (what a prefill kernel tile walks), checked on
    random selections with -1 padding against Python sets."""
    from sparda_jax.metrics import tile_blowup, tile_union

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 12, size=(2, 3, 16, 5))
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[0, 0, :4] = -1  # a tile with nothing selected counts in neither mean
    for tile in (4, 8):
        got = np.asarray(tile_union(jnp.asarray(ids), tile=tile))
        ratios = []
        for b, k, j in np.ndindex(2, 3, 16 // tile):
            rows = ids[b, k, j * tile:(j + 1) * tile]
            union = {int(x) for x in rows.ravel() if x >= 0}
            assert got[b, k, j] == len(union)
            per_row = np.mean([(r >= 0).sum() for r in rows])
            if per_row > 0:
                ratios.append(len(union) / per_row)
        assert abs(float(tile_blowup(jnp.asarray(ids), tile=tile)) - np.mean(ratios)) < 1e-5


def test_layered_sparse_decode_copies_no_kv_buffer(tiny):
    """The compiled sparse decode step (CPU HLO) on a layered state moves no K/V-sized buffer
    (scatters of the new token into the donated per-layer caches only); on the stacked state,
    the scan copies and slices K/V-sized buffers (what made Dense+ and Sparse+ decode slow)."""
    import re

    from sparda_jax.modes import decode_program
    from sparda_jax.pipeline import Plan

    params, _, _ = tiny
    tokens = jax.random.randint(jax.random.key(5), (2, 100), 0, TINY.vocab_size)
    _, stacked = prefill(params, tokens, jnp.array([100, 90]), TINY, cache_size=256, mode="sparse")
    plan = Plan(TINY, "sparse", False, jnp.dtype(jnp.float32))
    per_layer = int(np.prod(stacked.kv.k.shape[1:]))

    def big_moves(state):
        txt = decode_program.lower(params, tokens[:, :1], jnp.array([[100], [90]]), state, None, None,
                            plan=plan).compile().as_text()
        found = []
        for m in re.finditer(r"=\s*\w+\[([\d,]*)\]\S*\s+(copy|dynamic-slice|dynamic-update-slice|concatenate)\(", txt):
            n = int(np.prod([int(x) for x in m.group(1).split(",") if x] or [1]))
            if n >= per_layer:
                found.append((m.group(2), m.group(1)))
        return found

    assert big_moves(stacked), "the stacked scan no longer moves K/V: this test needs a new witness"
    assert big_moves(layered_state(stacked)) == []


def test_prefill_checks_host_prompts_on_the_host(tiny, monkeypatch):
    """Prompts given as NumPy arrays are checked with NumPy: no device reduction is read back
    before the prefill's program is dispatched (a round trip that delayed every first token).
    Prompts on the device are still checked there; both give the same prefill."""
    import sparda_jax.model as M

    c, (params, forecast, _) = TINY, tiny
    seen, check = [], M.check_token_ids
    monkeypatch.setattr(M, "check_token_ids", lambda ids, v: seen.append(type(ids)) or check(ids, v))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 80), 0, c.vocab_size))
    lengths = np.array([80, 61], np.int32)
    last, _ = prefill(params, tokens, lengths, c, cache_size=96, mode="sparda", forecast=forecast)
    assert seen == [np.ndarray]
    ref, _ = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), c, cache_size=96, mode="sparda",
                     forecast=forecast)
    assert len(seen) == 2 and issubclass(seen[1], jax.Array)
    np.testing.assert_array_equal(np.asarray(last), np.asarray(ref))
    bad = tokens.copy()
    bad[1, 3] = c.vocab_size
    for given in (bad, jnp.asarray(bad)):
        with pytest.raises(ValueError, match=str(c.vocab_size)):
            prefill(params, given, lengths, c, cache_size=96, mode="sparda", forecast=forecast)
