"""Backbone properties on random weights: causality, cache equivalence, GQA, RoPE, configs."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpy_llama import rope_angles
from sparda_jax import (ConfigError, KVCache, ModelConfig, SparseConfig, dense_attention, forward,
                        forward_cached, get_preset, init_model, param_count, preset_names)
from sparda_jax.attention import dense_attention_reference
from sparda_jax.config import LongRoPEConfig
from sparda_jax.model import rope_inv_freq

TINY = get_preset("tiny")


def _tokens(key, b, t, vocab):
    return jax.random.randint(key, (b, t), 0, vocab, dtype=jnp.int32)


@pytest.fixture(scope="module")
def tiny_params():
    return init_model(TINY, jax.random.key(0))


# ------------------------------------------------------------------------------------ configs

@pytest.mark.parametrize("name", preset_names())
def test_presets_are_valid_and_count_params(name):
    c = get_preset(name)
    shapes = jax.eval_shape(lambda: init_model(c, jax.random.key(0)))
    n = param_count(shapes)
    expected = {"smollm2-135m": 134_515_008}  # SmolLM2-135M's published count (tied head)
    if name in expected:
        assert n == expected[name]
    if name.startswith("minicpm4.1"):
        assert 8.1e9 < n < 8.3e9  # "8B"


@pytest.mark.parametrize("field,value,word", [
    ("topk", 3, "topk"),                # fewer than the 1 + 7 + 1 forced blocks
    ("block_size", 40, "block_size"),   # not a multiple of the stride 16
    ("kernel_size", 8, "kernel_size"),  # smaller than the stride
    ("local_blocks", -1, "local_blocks"),
    ("nosa_qk_topk", 30, "nosa_qk_topk"),  # beyond topk
])
def test_invalid_sparse_config_names_field(field, value, word):
    base = get_preset("smollm2-135m").sparse
    with pytest.raises(ConfigError, match=f"SparseConfig.{word}"):
        dataclasses.replace(base, **{field: value})


def test_invalid_model_config_names_field():
    with pytest.raises(ConfigError, match="ModelConfig.num_kv_heads"):
        TINY.replace(num_kv_heads=3)
    with pytest.raises(ConfigError, match="ModelConfig.arch"):
        TINY.replace(arch="gpt2")
    with pytest.raises(ConfigError, match="ModelConfig.longrope"):
        TINY.replace(longrope=LongRoPEConfig((1.0,) * 3, (1.0,) * 3, 1024))
    with pytest.raises(ConfigError, match="ModelConfig.sparse"):
        TINY.replace(arch="nosa")  # NOSA needs the query-aware budget
    with pytest.raises(ConfigError):
        get_preset("no-such-model")


# ---------------------------------------------------------------------------------- attention

def _naive_attention(q, k, v, pos, bias=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, tq, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for i in range(tq):
            n = int(pos[bi, i]) + 1
            for hh in range(h):
                s = k[bi, :n, hh // g] @ q[bi, i, hh] / math.sqrt(d)
                if bias is not None:
                    s = s + np.asarray(bias, np.float64)[bi, :n, hh // g]
                p = np.exp(s - s.max())
                out[bi, i, hh] = p @ v[bi, :n, hh // g] / p.sum()
    return out


@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_attention_reference_matches_naive(with_bias):
    ks = jax.random.split(jax.random.key(1), 5)
    b, s, kh, g, d = 2, 37, 2, 3, 8
    q = jax.random.normal(ks[0], (b, 5, kh * g, d))
    k = jax.random.normal(ks[1], (b, s, kh, d))
    v = jax.random.normal(ks[2], (b, s, kh, d))
    pos = jax.random.randint(ks[3], (b, 5), 0, s)
    bias = jax.random.normal(ks[4], (b, s, kh)) if with_bias else None
    out = dense_attention_reference(q, k, v, pos, bias=bias, chunk=2)  # chunking with a ragged tail
    np.testing.assert_allclose(out, _naive_attention(q, k, v, pos, bias), atol=2e-6)


def test_dense_attention_fully_masked_rows_are_zero():
    q = jnp.ones((1, 2, 2, 4))
    k = v = jnp.ones((1, 3, 1, 4))
    out = dense_attention_reference(q, k, v, jnp.array([[-1, 0]], jnp.int32))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, 0], 0.0)


def test_dense_attention_rejects_bad_shapes():
    q = jnp.ones((1, 4, 3, 8))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        dense_attention(q, jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)))
    with pytest.raises(ValueError, match="q_positions"):
        dense_attention(q, jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="Tq == S"):
        dense_attention(q, jnp.ones((1, 5, 1, 8)), jnp.ones((1, 5, 1, 8)))


# -------------------------------------------------------------------------------------- model

def test_causality_gradients_after_t_are_zero(tiny_params):
    """d logits[t] / d embedding[s] == 0 for s > t."""
    tokens = _tokens(jax.random.key(2), 1, 12, TINY.vocab_size)
    t = 5

    def out_at_t(emb):
        p = dict(tiny_params, embed={"embedding": emb})
        return forward(p, tokens, TINY)[0, t].sum()

    g = jax.grad(out_at_t)(tiny_params["embed"]["embedding"])  # [V, D]
    later = np.asarray(tokens[0, t + 1:])
    earlier = np.asarray(tokens[0, : t + 1])
    only_later = np.setdiff1d(later, earlier)
    assert only_later.size > 0
    np.testing.assert_array_equal(np.asarray(g)[only_later], 0.0)
    assert np.abs(np.asarray(g)[earlier]).sum() > 0


def test_cached_decode_matches_full_forward(tiny_params):
    """Token-by-token decode from an empty KVCache equals the full causal forward."""
    b, t = 2, 12
    tokens = _tokens(jax.random.key(3), b, t, TINY.vocab_size)
    full = forward(tiny_params, tokens, TINY)
    cache = KVCache.zeros(TINY, b, 16)
    for i in range(t):
        step, cache = forward_cached(tiny_params, tokens[:, i:i + 1], jnp.full((b, 1), i, jnp.int32),
                                     cache, TINY)
        np.testing.assert_allclose(step[:, 0], full[:, i], atol=1e-5)


def test_return_kv_matches_the_decode_cache(tiny_params):
    tokens = _tokens(jax.random.key(4), 1, 10, TINY.vocab_size)
    logits, aux = forward(tiny_params, tokens, TINY, return_kv=True)
    assert aux["k"].shape == (TINY.num_layers, 1, 10, TINY.num_kv_heads, TINY.head_dim)
    cache = KVCache.zeros(TINY, 1, 10)
    for i in range(10):
        _, cache = forward_cached(tiny_params, tokens[:, i:i + 1], jnp.full((1, 1), i, jnp.int32), cache, TINY)
    np.testing.assert_allclose(cache.k, aux["k"], atol=1e-5)
    np.testing.assert_allclose(cache.v, aux["v"], atol=1e-5)


def test_ffn_in_chunks_equals_numpy_swiglu(monkeypatch):
    """The FFN maps over token chunks past MLP_CHUNK_TOKENS (a long prefill's memory); a ragged
    last chunk (2 x 13 tokens in chunks of 7) is padded and cut. Against float64 NumPy SwiGLU,
    chunked and whole, with the nn.Dense parameter names the loaders write."""
    import sparda_jax.model as model

    x = jax.random.normal(jax.random.key(5), (2, 13, 16), jnp.float32)
    mlp = model.MLP(24)
    params = mlp.init(jax.random.key(6), x)
    p = {k: np.asarray(v["kernel"], np.float64) for k, v in params["params"].items()}
    assert set(p) == {"gate_proj", "up_proj", "down_proj"} and p["gate_proj"].shape == (16, 24)
    x64 = np.asarray(x, np.float64)
    g = x64 @ p["gate_proj"]
    want = (g / (1 + np.exp(-g)) * (x64 @ p["up_proj"])) @ p["down_proj"]
    whole = mlp.apply(params, x)
    monkeypatch.setattr(model, "MLP_CHUNK_TOKENS", 7)
    chunked = mlp.apply(params, x)
    for got in (whole, chunked):  # f32 GEMMs of 16-24 terms: ~1e-6 relative
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv(tiny_params):
    """A GQA model equals the MHA model whose K/V projections repeat each KV head G times."""
    g = TINY.group_size
    mha = TINY.replace(num_kv_heads=TINY.num_heads)
    p = jax.tree.map(lambda a: a, tiny_params)
    layers = dict(p["layers"])
    for name in ("k_proj", "v_proj"):
        layers[name] = {"kernel": jnp.repeat(layers[name]["kernel"], g, axis=2)}
    p["layers"] = layers
    tokens = _tokens(jax.random.key(5), 2, 9, TINY.vocab_size)
    np.testing.assert_allclose(forward(tiny_params, tokens, TINY), forward(p, tokens, mha), atol=1e-5)


def test_bf16_forward_close_to_f32(tiny_params):
    tokens = _tokens(jax.random.key(6), 2, 16, TINY.vocab_size)
    f32 = forward(tiny_params, tokens, TINY)
    bf = forward(jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params), tokens, TINY,
                 dtype=jnp.bfloat16)
    assert bf.dtype == jnp.float32
    rel = float(jnp.linalg.norm(bf - f32) / jnp.linalg.norm(f32))
    assert rel < 2e-2, rel  # bf16 operands: relative error between 1e-3 and 1e-2 (docs/decisions.md, "Tolerances for low-precision operands")


def test_forward_rejects_bad_tokens(tiny_params):
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        forward(tiny_params, jnp.zeros((4,), jnp.int32), TINY)
    with pytest.raises(TypeError, match="integer"):
        forward(tiny_params, jnp.zeros((1, 4), jnp.float32), TINY)


# --------------------------------------------------------------------------------------- RoPE

def test_longrope_frequencies_and_magnitude():
    factors = tuple(1.0 + i for i in range(TINY.head_dim // 2))
    lr = LongRoPEConfig(factors, tuple(2 * f for f in factors), original_max_position_embeddings=1024)
    short = TINY.replace(longrope=lr, max_position_embeddings=1024)
    long = TINY.replace(longrope=lr, max_position_embeddings=4096)
    plain, m0 = rope_inv_freq(TINY)
    inv_s, m_s = rope_inv_freq(short)
    inv_l, m_l = rope_inv_freq(long)
    np.testing.assert_allclose(inv_s, np.asarray(plain) / np.array(factors), rtol=1e-6)
    np.testing.assert_allclose(inv_l, np.asarray(plain) / (2 * np.array(factors)), rtol=1e-6)
    assert m0 == 1.0 and m_s == 1.0
    assert m_l == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))
    # and against the NumPy helper the HF-checkpoint tests use
    cos_ref, _ = rope_angles(8, TINY.head_dim, TINY.rope_theta, lr.long_factor, m_l)
    from sparda_jax.model import rope_tables

    cos, _ = rope_tables(long, jnp.arange(8, dtype=jnp.int32)[None])
    np.testing.assert_allclose(cos[0], cos_ref, atol=1e-6)


def test_minicpm41_preset_uses_short_factors_without_magnitude_change():
    c = get_preset("minicpm4.1-8b")
    assert c.max_position_embeddings == c.longrope.original_max_position_embeddings
    _, mag = rope_inv_freq(c)
    assert mag == 1.0
    assert len(c.longrope.short_factor) == 64
    assert c.residual_scale == pytest.approx(1.4 / math.sqrt(32))
    assert c.logit_scale == pytest.approx(256 / 4096)


def test_sparse_budget_of_minicpm_matches_spec():
    s = get_preset("minicpm4.1-8b").sparse
    assert (s.forced_blocks, s.topk, s.topk - s.forced_blocks) == (34, 96, 62)
    assert isinstance(s, SparseConfig)
    assert isinstance(get_preset("nosa-8b"), ModelConfig)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True])
def test_cudnn_dense_matches_reference(decode):
    """cuDNN's error against a float32 reference is at most a small multiple of the error of
    the plain jnp path run in bf16 (a tolerance with a reason: FlashAttention's test rule)."""
    ks = jax.random.split(jax.random.key(8), 4)
    b, s, kh, g, d = 2, 512, 2, 4, 64
    tq = 1 if decode else s
    q = jax.random.normal(ks[0], (b, tq, kh * g, d))
    k = jax.random.normal(ks[1], (b, s, kh, d))
    v = jax.random.normal(ks[2], (b, s, kh, d))
    pos = jnp.array([[300], [511]], jnp.int32) if decode else None
    with jax.default_matmul_precision("highest"):
        exact = dense_attention_reference(q, k, v, pos)
    bf = lambda a: a.astype(jnp.bfloat16)
    cud = dense_attention(bf(q), bf(k), bf(v), pos, implementation="cudnn").astype(jnp.float32)
    plain = dense_attention_reference(bf(q), bf(k), bf(v), pos).astype(jnp.float32)
    err = lambda a: float(jnp.linalg.norm(a - exact) / jnp.linalg.norm(exact))
    assert err(cud) <= 2 * err(plain) + 1e-3, (err(cud), err(plain))
