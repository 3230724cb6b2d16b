"""The Flax modules (sparda_jax.nn) against the functional core: a two-layer model assembled from
them computes `sparda_jax.forward`'s logits and selections, and the Forecast's training gradient."""

from __future__ import annotations

import functools

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import BlockSelector, Forecast, SparseAttention, forward, get_preset, init_forecast, init_model
from sparda_jax.config import ConfigError, ModelConfig
from sparda_jax.forecast import forecast_from_hidden, selector_kernels
from sparda_jax.losses import layer_loss
from sparda_jax.model import DecoderLayer, RMSNorm, per_layer, rope_tables
from sparda_jax.nn import forecast_module_params, forecast_params_from_modules
from train.objective import forecast_loss

# Two layers of the tiny preset: blocks of 16 tokens, topk 4 (1 init + 1 local + own + 1 chosen),
# dense_len 0. At T = 128 a query in the last block has 8 candidate blocks and reads 4.
TWO = get_preset("tiny").replace(num_layers=2)
TWO_NOSA = get_preset("tiny-nosa").replace(num_layers=2)  # topk 5, of which 4 query-aware
T = 128

# Both paths run the same float32 operations in the same order; they differ only in how XLA
# fuses the unrolled module model versus the scanned functional one (reassociated reductions,
# a few float32 ulps per op on values of order 1). 2e-5 is far above that and far below any
# change of selection (one different block moves logits by > 1e-3, test_modes).
ATOL = RTOL = 2e-5


class Toy(linen.Module):
    """A user's own two-layer model built from the modules and the backbone's DecoderLayer.
    mode "sparse": each layer selects from its own queries; "sparda": layer l's Forecast selects
    layer l + 1 (and "forecast_0", F0_cur, layer 0). Parameters named embed, layer_<l>,
    forecast_<l> (selects layer l), final_norm, lm_head."""

    config: ModelConfig
    mode: str

    @linen.compact
    def __call__(self, tokens):
        c = self.config
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        cos, sin = rope_tables(c, positions)
        x = linen.Embed(c.vocab_size, c.hidden_size, name="embed")(tokens) * c.scale_emb
        f_next = None
        for l in range(c.num_layers):
            layer = DecoderLayer(c, name=f"layer_{l}")
            h, q, k, v = layer.project(x, cos, sin)
            cis = layer.cis(v) if c.has_cis else None
            if self.mode == "sparse":
                ids = BlockSelector(c.sparse, source="queries")(q, k, positions, cis)
            else:
                f = Forecast(c, name="forecast_0")(h, positions) if l == 0 else f_next
                if l + 1 < c.num_layers:  # computed here, a layer ahead: what lets SparDA prefetch
                    f_next = Forecast(c, name=f"forecast_{l + 1}")(h, positions)
                ids = BlockSelector(c.sparse, source="forecast")(f, k, positions, cis)
                self.sow("intermediates", "forecast", f)
            self.sow("intermediates", "q", q)
            self.sow("intermediates", "k", k)
            self.sow("intermediates", "ids", ids)
            attn = SparseAttention(c.sparse.block_size)(q, k, v, ids, positions, bias=cis)
            x = layer.finish(x, attn)
        h = RMSNorm(c.rms_eps, name="final_norm")(x).astype(jnp.float32) * c.logit_scale
        return linen.Dense(c.vocab_size, use_bias=False, name="lm_head")(h)


def _toy_params(params, forecast=None):
    p = {"embed": params["embed"], "final_norm": params["final_norm"], "lm_head": params["lm_head"]}
    p.update({f"layer_{i}": lp for i, lp in enumerate(per_layer(params["layers"]))})
    if forecast is not None:
        p.update({f"forecast_{i}": fp for i, fp in enumerate(forecast_module_params(forecast))})
    return p


def _setup(config, seed=0):
    # jitted: one compile instead of op-by-op dispatch of every initializer
    params = jax.jit(functools.partial(init_model, config))(jax.random.key(seed))
    if config.has_cis:  # A is zero at init; make cis matter
        layers = dict(params["layers"], cis_A=jax.random.normal(jax.random.key(seed + 1),
                                                                params["layers"]["cis_A"].shape))
        params = dict(params, layers=layers)
    forecast = jax.jit(functools.partial(init_forecast, config))(jax.random.key(seed + 2))
    tokens = jax.random.randint(jax.random.key(seed + 3), (2, T), 0, config.vocab_size)
    return params, forecast, tokens


@pytest.fixture(scope="module")
def two():
    return _setup(TWO)


def test_forecast_module_is_the_functional_projection(two):
    _, forecast, _ = two
    mods = forecast_module_params(forecast)
    assert len(mods) == TWO.num_layers
    back = forecast_params_from_modules(mods)
    assert jax.tree.structure(back) == jax.tree.structure(forecast)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(forecast)):
        np.testing.assert_array_equal(a, b)
    h = jax.random.normal(jax.random.key(7), (2, 40, TWO.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(100, 140, dtype=jnp.int32), (2, 40))
    cos, sin = rope_tables(TWO, positions)
    fwd = jax.jit(Forecast(TWO).apply)
    for l, p in enumerate(mods):
        got = fwd({"params": p}, h, positions)
        want = forecast_from_hidden(h, selector_kernels(forecast)[l], cos, sin)
        assert got.shape == (2, 40, TWO.num_kv_heads, TWO.head_dim)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)  # jit vs eager: fused differently
    init = Forecast(TWO).init(jax.random.key(0), h, positions)["params"]
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, mods[0])


def _check_same_shapes(toy, p, tokens):
    """The toy's own parameter layout (traced, not computed) is the converted functional one."""
    init = jax.eval_shape(toy.init, jax.random.key(0), tokens)["params"]
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, p)


def _check_selection_and_logits(config, inter, aux, logits, want):
    ids = jnp.stack(inter["intermediates"]["ids"])
    np.testing.assert_array_equal(ids, aux["ids"])
    # the selection is sparse: the last block's queries see 8 blocks and read topk of them
    assert int(jnp.max(jnp.sum(ids >= 0, axis=-1))) == config.sparse.topk < T // config.sparse.block_size
    np.testing.assert_allclose(logits, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("mode,nosa", [("sparda", False), ("sparse", True)])
def test_toy_model_matches_forward(two, mode, nosa):
    config = TWO_NOSA if nosa else TWO
    params, forecast, tokens = _setup(TWO_NOSA) if nosa else two
    toy = Toy(config, mode)
    p = _toy_params(params, forecast if mode == "sparda" else None)
    _check_same_shapes(toy, p, tokens)
    logits, inter = jax.jit(lambda v, x: toy.apply(v, x, mutable="intermediates"))({"params": p}, tokens)
    want, aux = forward(params, tokens, config, mode=mode, forecast=forecast, collect_selection=True)
    _check_selection_and_logits(config, inter, aux, logits, want)


def test_sparse_toy_model_matches_forward_and_its_gradient(two):
    """Sparse mode (InfLLM-V2): logits, selections, and jax.grad of a logits loss w.r.t. the
    backbone through BlockSelector and SparseAttention, against the functional path."""
    params, _, tokens = two
    toy = Toy(TWO, "sparse")
    _check_same_shapes(toy, _toy_params(params), tokens)
    w = jax.random.normal(jax.random.key(11), (2, T, TWO.vocab_size))

    def module_loss(p):
        logits, inter = toy.apply({"params": p}, tokens, mutable="intermediates")
        return jnp.sum(logits * w), (logits, inter)

    def functional_loss(p):
        logits, aux = forward(p, tokens, TWO, mode="sparse", collect_selection=True)
        return jnp.sum(logits * w), (logits, aux)

    (_, (logits, inter)), got = jax.jit(jax.value_and_grad(module_loss, has_aux=True))(_toy_params(params))
    (_, (want, aux)), want_grad = jax.value_and_grad(functional_loss, has_aux=True)(params)
    _check_selection_and_logits(TWO, inter, aux, logits, want)
    for (path, g), wl in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(_toy_params(want_grad))):
        scale = float(jnp.max(jnp.abs(wl)))
        assert scale > 0, path
        np.testing.assert_allclose(g, wl, atol=ATOL * scale, rtol=RTOL, err_msg=str(path))


def test_forecast_gradient_matches_the_training_objective(two):
    """The Forecast's loss (partition KL per layer, `train.objective.forecast_loss`) through the
    modules gives the functional path's gradient. Logits get none: selection is discrete."""
    params, forecast, tokens = two
    # an untrained Forecast (std 0.02) scores every chunk alike and its loss is ~1e-4, a difference of
    # O(1) terms; scaled to std 1 its scores are peaked and the loss and gradient are O(1)
    forecast = jax.tree.map(lambda a: a * 50.0, forecast)
    toy = Toy(TWO, "sparda")
    frozen = _toy_params(params)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)

    @jax.jit
    def module_loss(fmods):
        p = dict(jax.lax.stop_gradient(frozen), **{f"forecast_{i}": m for i, m in enumerate(fmods)})
        _, inter = toy.apply({"params": p}, tokens, mutable="intermediates")
        it = inter["intermediates"]
        total = 0.0
        for f, q, k in zip(it["forecast"], it["q"], it["k"]):
            kl, rows = layer_loss(f, q, k, positions, TWO.sparse, TWO.forecast)
            total = total + kl / jnp.maximum(rows, 1).astype(jnp.float32)
        return total

    fmods = forecast_module_params(forecast)
    got_loss, got = jax.value_and_grad(module_loss)(fmods)
    (want_loss, _), want = jax.value_and_grad(
        lambda fc: forecast_loss(fc, params, tokens, TWO, backbone_mode="sparda"), has_aux=True)(forecast)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    got = forecast_params_from_modules(got)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(w))) > 1e-4  # a real gradient, not zeros on both sides
        np.testing.assert_allclose(g, w, atol=ATOL * float(jnp.max(jnp.abs(w))), rtol=RTOL)


def test_unknown_implementation_and_source_raise():
    sp = TWO.sparse
    with pytest.raises(ConfigError, match="BlockSelector.implementation"):
        BlockSelector(sp, implementation="cudnn")  # a dense-attention backend, not a selector
    with pytest.raises(ConfigError, match="BlockSelector.source"):
        BlockSelector(sp, source="keys")
    with pytest.raises(ConfigError, match="SparseAttention.implementation"):
        SparseAttention(implementation="host_ffi")
    k = jnp.zeros((1, 64, TWO.num_kv_heads, TWO.head_dim))
    q = jnp.zeros((1, 64, TWO.num_heads, TWO.head_dim))
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    with pytest.raises(ValueError, match="nosa_qk_topk"):
        BlockSelector(sp).apply({}, q, k, pos, jnp.zeros((1, 64, TWO.num_kv_heads)))

