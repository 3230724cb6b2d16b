"""ForecastConfig.source: which state the Forecast selecting layer l reads (SparDA's previous
layer's input, or the ablations: the previous layer's state after its attention, the layer's
own input), in the forward, the training loss and the Forecast file."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import get_preset, init_forecast, init_model
from sparda_jax.attention import dense_attention
from sparda_jax.compress import compress_keys
from sparda_jax.config import ConfigError
from sparda_jax.forecast import forecast_from_hidden
from sparda_jax.io import CheckpointError
from sparda_jax.io.forecast_file import forecast_file_source, load_forecast, save_forecast
from sparda_jax.losses import layer_loss
from sparda_jax.model import DecoderLayer, embed, per_layer, rope_tables
from sparda_jax.modes import decode_step, forward, prefill
from sparda_jax.select import select_blocks_forecast_reference

TINY = get_preset("tiny")
T = 256


def _with_source(source):
    return TINY.replace(forecast=dataclasses.replace(TINY.forecast, source=source))


@pytest.fixture(scope="module")
def setup():
    params = init_model(TINY, jax.random.key(0))
    forecast = init_forecast(TINY, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, T), 0, TINY.vocab_size)
    return params, forecast, tokens


class _States(NamedTuple):  # a tap that hands each layer's view states back
    def __call__(self, view):
        return {"h": view.h, "h_prev": view.h_prev, "mid_prev": view.mid_prev, "k": view.k}


def _hand_loop(params, tokens):
    """Each dense layer by its Flax methods, written out: every layer's normed input h and its
    normed state after attention (the MLP's input)."""
    c = TINY
    pos = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    cos, sin = rope_tables(c, pos)
    layer = DecoderLayer(c)
    x = embed(params, tokens, c)
    hs, mids = [], []
    for lp in per_layer(params["layers"]):
        v = {"params": lp}
        h, q, k, vv = layer.apply(v, x, cos, sin, method="project")
        x_mid = x + c.residual_scale * layer.apply(v, dense_attention(q, k, vv), method=lambda m, a: m.o_proj(a))
        mid = layer.apply(v, x_mid, method=lambda m, a: m.mlp_norm(a))
        x = x_mid + c.residual_scale * layer.apply(v, mid, method=lambda m, a: m.mlp(a))
        hs.append(h)
        mids.append(mid)
    return hs, mids


def test_layer_view_states_match_a_written_out_layer_loop(setup):
    params, _, tokens = setup
    _, aux = forward(params, tokens, TINY, mode="dense", tap=_States(), return_logits=False)
    hs, mids = _hand_loop(params, tokens)
    v = aux["tap"]
    for l in range(TINY.num_layers):
        np.testing.assert_allclose(v["h"][l], hs[l], rtol=2e-5, atol=2e-5)
        prev_h = hs[l - 1] if l else jnp.zeros_like(hs[0])
        prev_mid = mids[l - 1] if l else jnp.zeros_like(mids[0])
        np.testing.assert_allclose(v["h_prev"][l], prev_h, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(v["mid_prev"][l], prev_mid, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(v["mid_prev"][1] - v["h"][1]).max()) > 1e-2  # mid is not the next input


@pytest.mark.parametrize("source", ["prev_input", "prev_mid", "own_input"])
def test_sparda_selection_reads_the_state_its_source_names(setup, source):
    """The forward's sparda selection equals the reference selector run on the state the
    source names (from the same run's views): F0_cur on h at layer 0 (every layer for
    own_input), else F_{l-1} on h_prev or mid_prev."""
    params, forecast, tokens = setup
    c = _with_source(source)
    _, aux = forward(params, tokens, c, mode="sparda", forecast=forecast, tap=_States(), collect_selection=True,
                     return_logits=False)
    pos = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    cos, sin = rope_tables(c, pos)
    v, sp = aux["tap"], c.sparse
    for l in range(c.num_layers):
        kernel = forecast["f0_cur"]["kernel"] if l == 0 else forecast["f"]["kernel"][l - 1]
        state = {"prev_input": v["h_prev"][l], "prev_mid": v["mid_prev"][l], "own_input": v["h"][l]}[source]
        f = forecast_from_hidden(v["h"][l] if l == 0 else state, kernel, cos, sin, jnp.float32)
        ref = select_blocks_forecast_reference(f, compress_keys(v["k"][l], sp.kernel_size, sp.kernel_stride), pos, sp,
                                               n_blocks=T // sp.block_size)
        np.testing.assert_array_equal(np.sort(aux["ids"][l], -1), np.sort(ref, -1), err_msg=f"layer {l}")


def test_the_sources_select_differently_and_train_on_their_state(setup):
    """The three sources give three selections; the training loss of prev_mid is the loss of the
    Forecast on the written-out loop's post-attention states."""
    from sparda_jax.train.objective import forecast_loss

    params, forecast, tokens = setup
    ids = {s: forward(params, tokens, _with_source(s), mode="sparda", forecast=forecast, collect_selection=True)[1]["ids"]
           for s in ("prev_input", "prev_mid", "own_input")}
    assert (ids["prev_mid"] != ids["prev_input"]).any() and (ids["own_input"] != ids["prev_input"]).any()
    c = _with_source("prev_mid")
    _, per_layer_kl = forecast_loss(forecast, params, tokens, c)
    hs, mids = _hand_loop(params, tokens)
    pos = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    cos, sin = rope_tables(c, pos)
    _, aux = forward(params, tokens, c, mode="dense", return_q=True, return_kv=True)
    for l in (0, 2):
        kernel = forecast["f0_cur"]["kernel"] if l == 0 else forecast["f"]["kernel"][l - 1]
        f = forecast_from_hidden(hs[0] if l == 0 else mids[l - 1], kernel, cos, sin, jnp.float32)
        kl, rows = layer_loss(f, aux["q"][l], aux["k"][l], pos, c.sparse, c.forecast)
        np.testing.assert_allclose(per_layer_kl[l], kl / rows, rtol=1e-4)


def test_only_the_forward_runs_an_ablation_source(setup):
    params, forecast, tokens = setup
    c = _with_source("prev_mid")
    _, state = prefill(params, tokens, jnp.full((2,), T), c, cache_size=T + 8, mode="sparda", forecast=forecast)
    with pytest.raises(NotImplementedError, match="prev_mid"):
        decode_step(params, tokens[:, -1], jnp.full((2,), T), state, c, mode="sparda", forecast=forecast)
    from sparda_jax.infer.engine import EngineConfig, engine_prefill

    with pytest.raises(NotImplementedError, match="prev_mid"):
        engine_prefill(params, tokens, jnp.full((2,), T), c, EngineConfig(system="sparda"), cache_size=T + 8,
                       forecast=forecast)
    with pytest.raises(ConfigError, match="source"):
        _with_source("next_input")


def test_forecast_file_records_its_source(setup, tmp_path):
    _, forecast, _ = setup
    mid = _with_source("prev_mid")
    path = save_forecast(tmp_path / "f.safetensors", forecast, mid)
    assert forecast_file_source(path) == "prev_mid"
    load_forecast(path, mid)
    with pytest.raises(CheckpointError, match="reads 'prev_mid'"):
        load_forecast(path, TINY)  # would run it on the wrong state
    assert forecast_file_source(save_forecast(tmp_path / "g.safetensors", forecast, TINY)) == "prev_input"
