"""HF safetensors loaders on small checkpoints written here: MiniCPM (muP + LongRoPE),
sharded Llama in bfloat16, NOSA (cis), and the errors a user can hit."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from numpy_llama import llama_forward
from sparda_jax import load_pretrained
from sparda_jax.io import CheckpointError

L, D, H, K, DH, F, V = 2, 32, 4, 2, 8, 48, 64


def _weights(seed, *, tied=False, cis=False):
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)
    w = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}
    if not tied:
        w["lm_head.weight"] = r(V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + r(D), p + "post_attention_layernorm.weight": 1 + r(D),
                  p + "self_attn.q_proj.weight": r(H * DH, D), p + "self_attn.k_proj.weight": r(K * DH, D),
                  p + "self_attn.v_proj.weight": r(K * DH, D), p + "self_attn.o_proj.weight": r(D, H * DH),
                  p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                  p + "mlp.down_proj.weight": r(D, F)})
        if cis:
            w[p + "self_attn.A"] = r(K) * 3
            w[p + "self_attn.delta.weight"] = r(K, K * DH)
    return w


def _config(arch="LlamaForCausalLM", **extra):
    c = {"architectures": [arch], "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": K,
         "num_hidden_layers": L, "intermediate_size": F, "vocab_size": V, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": [2, 3]}
    c.update(extra)
    return c


def _write(dirpath, cfg, weights, shards=1, dtype=np.float32):
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(cfg))
    cast = {k: v.astype(dtype) for k, v in weights.items()}
    if shards == 1:
        save_file(cast, str(dirpath / "model.safetensors"))
        return
    names = sorted(cast)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: cast[n] for n in part}, str(dirpath / fname))
        weight_map.update({n: fname for n in part})
    (dirpath / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


TOKENS = [5, 17, 3, 60, 22, 9, 41, 0, 33, 12, 7]


def _ours(path, **kw):
    m = load_pretrained(path, **kw)
    with jax.default_matmul_precision("highest"):
        return m, np.asarray(m.logits(jnp.asarray([TOKENS], jnp.int32))[0], np.float64)


def test_minicpm_mup_longrope(tmp_path):
    factors = [1.0 + 0.5 * i for i in range(DH // 2)]
    cfg = _config("MiniCPMForCausalLM", scale_emb=12, scale_depth=1.4, dim_model_base=8,
                  max_position_embeddings=512,
                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * (DH // 2),
                                "long_factor": factors, "original_max_position_embeddings": 128},
                  sparse_config={"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
                                 "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192})
    w = _weights(0)
    _write(tmp_path / "minicpm", cfg, w)
    m, ours = _ours(tmp_path / "minicpm")
    c = m.config
    assert c.arch == "minicpm" and c.sparse.topk == 96 and c.sparse.local_blocks == 32
    mag = math.sqrt(1 + math.log(512 / 128) / math.log(128))  # 512 > 128: long factors
    ref = llama_forward(w, TOKENS, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=DH, eps=1e-6, theta=1e4,
                        rope_factors=factors, rope_magnitude=mag, scale_emb=12,
                        residual_scale=1.4 / math.sqrt(L), logit_scale=8 / D)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())


def test_llama_sharded_bf16_tied(tmp_path):
    w = _weights(1, tied=True)
    _write(tmp_path / "llama", _config(tie_word_embeddings=True), w, shards=3, dtype=ml_dtypes.bfloat16)
    m, ours = _ours(tmp_path / "llama")
    assert m.config.tie_embeddings and m.config.eos_token_ids == (2, 3)
    w16 = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in w.items()}
    ref = llama_forward(w16, TOKENS, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=DH, eps=1e-6, theta=1e4,
                        tied=True)
    # weights are exactly bf16 values; the compute is float32
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())


def test_nosa_cis_bias(tmp_path):
    w = _weights(2, cis=True)
    _write(tmp_path / "nosa", _config(), w)
    m, ours = _ours(tmp_path / "nosa")
    assert m.config.arch == "nosa" and m.config.sparse.nosa_qk_topk == 33
    ref = llama_forward(w, TOKENS, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=DH, eps=1e-6, theta=1e4, cis=True)
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())
    # cis really is in play: without it the logits differ
    plain = llama_forward(w, TOKENS, n_layers=L, n_heads=H, n_kv_heads=K, head_dim=DH, eps=1e-6, theta=1e4)
    assert np.abs(plain - ref).max() > 1e-2


def test_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known model name"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "empty")

    w = _weights(3)
    _write(tmp_path / "arch", _config("GPTNeoXForCausalLM"), w)
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_pretrained(tmp_path / "arch")

    bad = dict(w)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((F + 1, D), np.float32)
    _write(tmp_path / "shape", _config(), bad)
    with pytest.raises(CheckpointError, match=r"up_proj.weight.*shape \(49, 32\).*expects \(48, 32\)"):
        load_pretrained(tmp_path / "shape")

    missing = {k: v for k, v in w.items() if k != "model.norm.weight"}
    _write(tmp_path / "missing", _config(), missing)
    with pytest.raises(CheckpointError, match="no tensor 'model.norm.weight'"):
        load_pretrained(tmp_path / "missing")

    _write(tmp_path / "shard", _config(), w, shards=2)
    next((tmp_path / "shard").glob("model-00002*")).unlink()
    with pytest.raises(CheckpointError, match="shard .* missing"):
        load_pretrained(tmp_path / "shard")

    _write(tmp_path / "rope", _config(rope_scaling={"type": "yarn", "factor": 4.0}), w)
    with pytest.raises(CheckpointError, match="rope_scaling type 'yarn'"):
        load_pretrained(tmp_path / "rope")

    nan = dict(w)
    nan["model.layers.1.self_attn.o_proj.weight"] = np.where(np.eye(D, H * DH) > 0, np.nan, w[
        "model.layers.1.self_attn.o_proj.weight"]).astype(np.float32)
    _write(tmp_path / "nan", _config(), nan, shards=2)
    with pytest.raises(CheckpointError, match=r"model-0000\d-of-00002.safetensors: tensor "
                                              r"'model.layers.1.self_attn.o_proj.weight' has 32 non-finite"):
        load_pretrained(tmp_path / "nan")

    _write(tmp_path / "json", _config(), w)
    (tmp_path / "json" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(CheckpointError, match=r"json/config.json: not valid JSON"):
        load_pretrained(tmp_path / "json")

    (tmp_path / "x.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_pretrained(tmp_path / "x.bin")
    (tmp_path / "x.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_pretrained(tmp_path / "x.gguf")


def test_converted_checkpoints_are_cached(tmp_path, monkeypatch):
    from sparda_jax import api
    from sparda_jax.io.weights_cache import entry_path

    w = _weights(4)
    _write(tmp_path / "m", _config(), w)
    cache = tmp_path / "cache"
    first = load_pretrained(tmp_path / "m", cache_dir=cache)
    entry = entry_path(tmp_path / "m", np.float32, cache)
    assert entry.is_file()

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(api, "load_hf", no_conversion)
    second = load_pretrained(tmp_path / "m", cache_dir=cache)
    assert second.config == first.config
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(a, b)
    assert entry_path(tmp_path / "m", jnp.bfloat16, cache) != entry  # another dtype, another entry
    monkeypatch.undo()
    entry.write_bytes(b"torn")  # an unreadable entry is rebuilt from the checkpoint, not trusted
    third = load_pretrained(tmp_path / "m", cache_dir=cache)
    np.testing.assert_array_equal(jax.tree.leaves(third.params)[0], jax.tree.leaves(first.params)[0])
    assert entry.stat().st_size > 1000
    # a changed checkpoint is a new entry
    w["model.norm.weight"] = w["model.norm.weight"] + 1
    _write(tmp_path / "m", _config(), w)
    assert entry_path(tmp_path / "m", np.float32, cache) != entry


def test_the_weights_cache_keeps_to_its_size_and_is_shared_by_clones(tmp_path):
    """Entries past the bound go least recently used first (the one just written stays), and a
    copy of the same file in another folder (another clone's venv) maps to the same entry."""
    import os
    import shutil

    from sparda_jax.io import weights_cache as wc

    folder = tmp_path / "weights"
    folder.mkdir()
    for i, t in enumerate((100, 200, 300)):
        p = folder / f"m{i}.pkl"
        p.write_bytes(b"\0" * 1000)
        os.utime(p, (t, t))
    wc.prune(folder, keep=folder / "m0.pkl", max_bytes=2000)
    assert sorted(p.name for p in folder.glob("*.pkl")) == ["m0.pkl", "m2.pkl"]  # m1: oldest not kept
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.gguf").write_bytes(b"gguf")
    shutil.copy2(tmp_path / "a" / "x.gguf", tmp_path / "b" / "x.gguf")  # same name, size, mtime
    assert wc.entry_path(tmp_path / "a" / "x.gguf", np.float32, tmp_path) == \
        wc.entry_path(tmp_path / "b" / "x.gguf", np.float32, tmp_path)
