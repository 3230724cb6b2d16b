"""Sparse-attention fine-tuning (`train.finetune`, `sparda finetune`): the LoRA merge, its
gradients against autodiff of a dense attention masked to the same blocks, training, the adapter
file and its errors, resume, and the "smollm2-135m-sparse" preset."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from sparda_jax import get_preset, init_model
from sparda_jax.api import Pretrained
from sparda_jax.config import ConfigError, Implementations
from sparda_jax.io import CheckpointError
from sparda_jax.io import adapter_file
from sparda_jax.io.adapter_file import LoraConfig, load_adapter, merge_adapter, save_adapter
from sparda_jax.modes import forward
from sparda_jax.train.finetune import (FinetuneConfig, finetune, finetune_loss, finetune_step, init_adapter,
                                       init_adapter_state)

from byte_tokenizer import ByteTokenizer

TINY = get_preset("tiny")
LORA = LoraConfig(rank=4, alpha=8.0)
T = 96  # past the tiny budget's 4 blocks of 16 tokens: sparse differs from dense
FC = FinetuneConfig(lora=LORA, seq_len=T, batch=2, micro_batch=2, steps=30, lr=1e-2, dtype="float32")


@pytest.fixture(scope="module")
def tiny_params():
    return init_model(TINY, jax.random.key(0))


def _random_adapter(seed, scale=0.05):
    """An adapter of A ~ N(0, 1 / in) and B ~ N(0, scale^2), as after some training: every
    factor matters."""
    rng = np.random.default_rng(seed)
    return {t: {"a": jnp.asarray(rng.standard_normal(s["a"]) / math.sqrt(s["a"][1]), jnp.float32),
                "b": jnp.asarray(scale * rng.standard_normal(s["b"]), jnp.float32)}
            for t, s in adapter_file.adapter_shapes(TINY, LORA).items()}


def _tokens(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(0, TINY.vocab_size, shape), jnp.int32)


def _as_finetune_places(tree):
    """tree replicated on the one-device mesh, as `finetune` places the backbone and the state (a
    step compiled for these placements serves the tests that run `finetune` too)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from sparda_jax.train.run import make_mesh

    return jax.device_put(tree, NamedSharding(make_mesh(1), P()))


def test_zero_init_adapter_is_the_base_model_and_merge_is_lora(tiny_params):
    tok = _tokens(2, (2, T))
    base = _as_finetune_places(tiny_params)  # the evaluation of `finetune` then reuses these compiled forwards
    merged = merge_adapter(base, _as_finetune_places(init_adapter(TINY, LORA, jax.random.key(1))), LORA)
    for mode in ("dense", "sparse"):
        np.testing.assert_array_equal(forward(merged, tok, TINY, mode=mode), forward(base, tok, TINY, mode=mode))
    # a trained adapter: each target's projection of an input x is x W + (alpha / r) (x A) B
    ad = _random_adapter(3)
    merged = merge_adapter(tiny_params, ad, LORA)
    x = np.random.default_rng(0).standard_normal((5, TINY.hidden_size))
    c = TINY
    for t in LORA.targets:
        w = np.asarray(tiny_params["layers"][t]["kernel"][1], np.float64)
        a, b = (np.asarray(ad[t][p][1], np.float64) for p in ("a", "b"))
        m = np.asarray(merged["layers"][t]["kernel"][1], np.float64)
        xin = x if t != "o_proj" else np.random.default_rng(1).standard_normal((5, c.num_heads, c.head_dim))
        flat_in = xin.reshape(5, -1)
        want = flat_in @ w.reshape(flat_in.shape[1], -1) + 2.0 * (flat_in @ a) @ b
        got = flat_in @ m.reshape(flat_in.shape[1], -1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name in ("mlp", "attn_norm", "mlp_norm"):  # nothing else is touched
        for u, v in zip(jax.tree.leaves(merged["layers"][name]), jax.tree.leaves(tiny_params["layers"][name])):
            assert u is v


def test_steps_lower_the_sparse_loss_and_touch_only_the_adapter(tiny_params):
    from sparda_jax.train.run import make_mesh, shard_batch

    before = jax.tree.map(np.asarray, tiny_params)
    backbone = _as_finetune_places(tiny_params)
    state = _as_finetune_places(init_adapter_state(init_adapter(TINY, LORA, jax.random.key(1)), FC))
    batch = shard_batch(make_mesh(1), np.asarray(_tokens(4, (1, 2, T))), (1, 2, T))  # one fixed batch: the loss must fall
    losses = []
    for _ in range(FC.steps):
        state, m = finetune_step(state, backbone, batch, config=TINY, fc=FC)
        losses.append(float(m["loss"]))
        assert float(m["nll_sparse"]) == losses[-1]
    assert losses[-1] < losses[0] - 0.15, losses
    assert int(state.step) == FC.steps
    for u, v in zip(jax.tree.leaves(backbone), jax.tree.leaves(before)):
        np.testing.assert_array_equal(u, v)
    # the optimizer holds the adapter's parameters (Adam's two moments) and nothing of the backbone
    shapes = sorted(a.shape for a in jax.tree.leaves(state.adapter))
    moments = sorted(a.shape for a in jax.tree.leaves(state.opt_state) if a.ndim > 0)
    assert moments == sorted(shapes * 2)


def _log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_distill_is_the_kl_from_the_base_models_dense_distribution(tiny_params):
    """objective "distill": the loss is KL(base model, dense || merged model, sparse), checked in
    float64 NumPy from the two forwards' logits; zero for the dense mode of a fresh adapter (the
    merged weights are the base); and steps on one batch lower it."""
    import dataclasses

    tok = _tokens(6, (2, T))
    fc = dataclasses.replace(FC, objective="distill")
    ad = _random_adapter(7)
    loss, parts = finetune_loss(ad, tiny_params, tok, config=TINY, fc=fc)
    lt = _log_softmax64(forward(tiny_params, tok, TINY, mode="dense"))[:, :-1]
    student = forward(merge_adapter(tiny_params, ad, LORA), tok, TINY, mode="sparse")
    want = np.mean(np.sum(np.exp(lt) * (lt - _log_softmax64(student)[:, :-1]), axis=-1))
    assert set(parts) == {"kl_sparse", "nll_sparse"} and float(loss) == float(parts["kl_sparse"])
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)  # float32 log-softmax over 256 classes
    nll = -np.mean(np.take_along_axis(_log_softmax64(student)[:, :-1], np.asarray(tok)[:, 1:, None], -1))
    np.testing.assert_allclose(float(parts["nll_sparse"]), nll, rtol=1e-5)
    _, p0 = finetune_loss(init_adapter(TINY, LORA, jax.random.key(1)), tiny_params, tok, config=TINY,
                          fc=dataclasses.replace(fc, dense_weight=0.5))
    assert abs(float(p0["kl_dense"])) < 1e-7 and float(p0["kl_sparse"]) > 1e-5
    state = init_adapter_state(ad, fc)  # a perturbed adapter: training takes it back toward the base
    batch = tok[None]
    kls = []
    for _ in range(10):
        state, m = finetune_step(state, tiny_params, batch, config=TINY, fc=fc)
        kls.append(float(m["kl_sparse"]))
    assert kls[-1] < 0.7 * kls[0], kls
    with pytest.raises(ValueError, match="objective"):
        dataclasses.replace(fc, objective="kl")


def test_adapter_file_roundtrip_and_errors(tmp_path):
    ad = _random_adapter(7)
    path = save_adapter(tmp_path / "a.safetensors", ad, TINY, LORA, metadata={"steps": 3})
    back, lora = load_adapter(path, TINY)
    assert lora == LORA
    for a, b in zip(jax.tree.leaves(ad), jax.tree.leaves(back)):  # stored as bf16
        np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), b)
    with pytest.raises(FileNotFoundError, match="none.safetensors"):
        load_adapter(tmp_path / "none.safetensors", TINY)
    with pytest.raises(CheckpointError, match=r"a\.safetensors: an adapter for 'tiny', not for 'smollm2-135m'"):
        load_adapter(path, get_preset("smollm2-135m"))
    meta = {"format": adapter_file.FORMAT, "model": "tiny", "rank": "4", "alpha": "8.0",
            "targets": json.dumps(list(LORA.targets)), "extra": "{}"}
    tensors = {f"{t}.{p}": np.asarray(ad[t][p]) for t in LORA.targets for p in ("a", "b")}
    wrong = dict(tensors, **{"k_proj.b": tensors["k_proj.b"][:, :, :-1]})
    save_file(wrong, str(tmp_path / "shape.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=r"shape\.safetensors: k_proj\.b has shape \(3, 4, 31\)"):
        load_adapter(tmp_path / "shape.safetensors", TINY)
    save_file(tensors, str(tmp_path / "rank.safetensors"), metadata=dict(meta, rank="8"))
    with pytest.raises(CheckpointError, match=r"rank\.safetensors: q_proj\.a has shape .* at rank 8"):
        load_adapter(tmp_path / "rank.safetensors", TINY)
    nan = dict(tensors, **{"o_proj.a": np.where(np.arange(tensors["o_proj.a"].size).reshape(tensors["o_proj.a"].shape)
                                               == 5, np.nan, tensors["o_proj.a"]).astype(np.float32)})
    save_file(nan, str(tmp_path / "nan.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=r"nan\.safetensors: tensor o_proj\.a has 1 non-finite"):
        load_adapter(tmp_path / "nan.safetensors", TINY)
    save_file({"f": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not an adapter file"):
        load_adapter(tmp_path / "other.safetensors", TINY)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"junk\.safetensors: not a readable safetensors"):
        load_adapter(tmp_path / "junk.safetensors", TINY)


def test_smollm2_adapter_fits_in_10_mb_at_the_default_rank(tmp_path):
    c = get_preset("smollm2-135m")
    lora = LoraConfig()
    zero = jax.tree.map(jnp.zeros, adapter_file.adapter_shapes(c, lora), is_leaf=lambda x: isinstance(x, tuple))
    size = save_adapter(tmp_path / "a.safetensors", zero, c, lora, metadata={"train": {"steps": 10 ** 6}}).stat().st_size
    # 30 layers x r x (576 + 576 + 2 x (576 + 192) + 576 + 576) bf16 values, plus the header
    assert 30 * lora.rank * 3840 * 2 < size <= 10 * 10 ** 6, size


def test_resume_matches_uninterrupted_run(tmp_path, tiny_params):
    model = Pretrained(TINY, tiny_params, ByteTokenizer())
    fc = FinetuneConfig(**{**FC.__dict__, "steps": 6})  # equal to FC (steps aside): its step is compiled already
    kw = dict(save_every=2, keep=2, eval_every=3, eval_len=T, eval_seqs=2, progress=False, log=lambda s: None)
    finetune(model, fc, tmp_path / "a", **kw)
    finetune(model, FinetuneConfig(**{**fc.__dict__, "steps": 3}), tmp_path / "b", **kw)  # "interrupted" at 3
    finetune(model, fc, tmp_path / "b", **kw)  # resumes from step 3
    load = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    a, b = load("a"), load("b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-6)
    ev = [r for r in a if "heldout_sparse" in r]
    assert [r["step"] for r in ev] == [1, 3, 6]
    assert all(r["heldout_sparse"] > 0 and r["heldout_dense"] > 0 and r["heldout_sparse"] != r["heldout_dense"]
               for r in ev)
    assert (tmp_path / "a" / "metrics.png").stat().st_size > 1000
    ad_a, _ = load_adapter(tmp_path / "a" / "adapter.safetensors", TINY)
    ad_b, _ = load_adapter(tmp_path / "b" / "adapter.safetensors", TINY)
    for x, y in zip(jax.tree.leaves(ad_a), jax.tree.leaves(ad_b)):
        np.testing.assert_array_equal(x, y)
    # the record holds the adapter's settings; a resume with another rank is refused
    assert json.loads((tmp_path / "a" / "config.json").read_text())["train"]["lora"]["targets"] == list(LORA.targets)
    other = FinetuneConfig(**{**fc.__dict__, "lora": LoraConfig(rank=2, alpha=8.0), "steps": 7})
    with pytest.raises(ValueError, match=r"train\.lora\.rank: 4 -> 2"):
        finetune(model, other, tmp_path / "a", **kw)


def test_cli_finetune_runs_with_the_configs_defaults(tmp_path, tiny_params, monkeypatch, capsys):
    from sparda_jax import cli

    args = cli.build_parser().parse_args(["finetune", "--out", str(tmp_path)])
    import inspect

    d, run = FinetuneConfig(), inspect.signature(finetune).parameters
    assert (args.seq_len, args.batch, args.micro_batch, args.steps, args.lr, args.train_dtype, args.rank,
            args.dense_weight, 2 * args.rank, args.objective) == (d.seq_len, d.batch, d.micro_batch, d.steps, d.lr,
                                                                  d.dtype, d.lora.rank, d.dense_weight, d.lora.alpha,
                                                                  d.objective)
    assert all(getattr(args, k) == run[k].default for k in ("save_every", "keep", "eval_every", "eval_seqs"))
    monkeypatch.setattr(cli, "_load", lambda args: Pretrained(TINY, tiny_params, ByteTokenizer()))
    # settings equal to FC's: the step compiled for it runs here too
    rc = cli.main(["--no-compile-cache", "finetune", "--out", str(tmp_path / "run"), "--seq-len", str(T), "--steps",
                   "2", "--batch", "2", "--micro-batch", "2", "--lr", "1e-2", "--train-dtype", "float32", "--rank", "4",
                   "--eval-every", "0", "--save-every", "1"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    rec = json.loads((tmp_path / "run" / "config.json").read_text())["train"]
    assert rec["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(LORA.targets)} and rec["dense_weight"] == 0.0


def test_adapted_preset_merges_its_adapter_and_refuses_a_missing_one(tmp_path, monkeypatch, capsys):
    """load_pretrained(<adapted preset>) is its base with the package's adapter merged and the
    preset's name; without the file it fails before loading the base, naming the file and the
    command that makes it (here "smollm2-135m-sparse" itself, and through `sparda train`)."""
    from sparda_jax import api, cli
    from test_hf_checkpoints import _config, _weights, _write

    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setattr(adapter_file, "_WEIGHTS", weights)
    with pytest.raises(FileNotFoundError, match=r"adapter-smollm2-135m-sparse\.safetensors.*sparda finetune"):
        api.load_pretrained("smollm2-135m-sparse")
    assert cli.main(["--no-compile-cache", "train", "--model", "smollm2-135m-sparse", "--out", str(tmp_path / "t")]) == 2
    assert "is missing" in capsys.readouterr().err

    _write(tmp_path / "base", _config(), _weights(0))  # a small HF checkpoint as the base
    monkeypatch.setitem(api.ADAPTED_PRESETS, "small-sparse", str(tmp_path / "base"))
    base = api.load_pretrained(tmp_path / "base")
    lora = LoraConfig(rank=2, alpha=3.0)
    shapes = adapter_file.adapter_shapes(base.config, lora)
    rng = np.random.default_rng(0)
    ad = {t: {p: jnp.asarray(rng.standard_normal(s), jnp.float32) for p, s in parts.items()}
          for t, parts in shapes.items()}
    save_adapter(weights / "adapter-small-sparse.safetensors", ad, base.config, lora)
    m = api.load_pretrained("small-sparse")
    assert m.config.name == "small-sparse" and m.config.replace(name=base.config.name) == base.config
    a, b = (np.asarray(ad["v_proj"][p]).astype(ml_dtypes.bfloat16).astype(np.float64) for p in ("a", "b"))
    w = np.asarray(base.params["layers"]["v_proj"]["kernel"], np.float64)
    want = w + 1.5 * np.einsum("lir,lro->lio", a, b).reshape(w.shape)
    np.testing.assert_allclose(m.params["layers"]["v_proj"]["kernel"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(m.params["layers"]["mlp"]["up_proj"]["kernel"],
                                  base.params["layers"]["mlp"]["up_proj"]["kernel"])
    from sparda_jax.io.forecast_file import shipped_forecast_path

    assert shipped_forecast_path(m.config) is None  # its own Forecast, none shipped: not the base's


def test_adapter_argument_merges_a_given_file_into_a_base_or_a_preset(tmp_path, monkeypatch, capsys):
    """load_pretrained(..., adapter=FILE) merges that file (the preset's own adapter is not read:
    here there is none), keeps the model's name, and refuses a missing file before loading and a
    file trained on another base model; the CLI's --adapter reaches it."""
    import hashlib

    from sparda_jax import api, cli
    from test_hf_checkpoints import _config, _weights, _write

    monkeypatch.setattr(adapter_file, "_WEIGHTS", tmp_path / "empty")  # no package adapter at all
    _write(tmp_path / "base", _config(), _weights(0))
    monkeypatch.setitem(api.ADAPTED_PRESETS, "small-sparse", str(tmp_path / "base"))
    base = api.load_pretrained(tmp_path / "base")
    lora = LoraConfig(rank=2, alpha=2.0)
    rng = np.random.default_rng(1)
    ad = {t: {p: jnp.asarray(rng.standard_normal(s), jnp.float32) for p, s in parts.items()}
          for t, parts in adapter_file.adapter_shapes(base.config, lora).items()}
    path = tmp_path / "run" / "adapter.safetensors"
    path.parent.mkdir()
    save_adapter(path, ad, base.config, lora)
    want = api._merged(base, path, "x").params["layers"]["q_proj"]["kernel"]
    assert not np.allclose(want, base.params["layers"]["q_proj"]["kernel"])
    for name, expect in ((tmp_path / "base", base.config.name), ("small-sparse", "small-sparse")):
        m = api.load_pretrained(name, adapter=path)
        assert m.config.name == expect
        np.testing.assert_array_equal(m.params["layers"]["q_proj"]["kernel"], want)
        assert m.adapter == f"adapter.safetensors (sha256 {hashlib.sha256(path.read_bytes()).hexdigest()})"
    assert base.adapter is None
    for name in (tmp_path / "base", "small-sparse"):
        with pytest.raises(FileNotFoundError, match="adapter file not found"):
            api.load_pretrained(name, adapter=tmp_path / "nope.safetensors")
    other = base.config.replace(name="another-model")
    save_adapter(tmp_path / "other.safetensors", ad, other, lora)
    with pytest.raises(ValueError, match="not for"):
        api.load_pretrained(tmp_path / "base", adapter=tmp_path / "other.safetensors")
    seen = {}
    monkeypatch.setattr(api, "load_pretrained", lambda *a, **k: seen.update(k) or base)
    args = cli.build_parser().parse_args(["eval", "--adapter", str(path)])
    cli._load(args)
    assert seen["adapter"] == str(path)


def test_shipped_sparse_native_adapter_copies_better_under_sparse_attention():
    """The adapter shipped for smollm2-135m-sparse (trained on the H200, train/results/smollm2-sparse-8k)
    makes the model retrieve under InfLLM-V2 sparse attention: on the Python docs (text it never
    trained on), 1024 tokens, a budget that still selects (1 + 2 forced blocks, topk 8), the copy
    NLL of a repeated 256-token passage per sequence. Measured on the CPU: 1.13 / 0.93 nats for the
    base model, 0.32 / 0.46 with the adapter (held-out domains at 4K: 1.38 -> 0.25, eval/results/sparse_native)."""
    import dataclasses

    from sparda_jax import api
    from sparda_jax.eval.copy import eval_copy

    nll = {}
    for name in ("smollm2-135m", "smollm2-135m-sparse"):
        m = api.load_pretrained(name)
        # the preset attends densely in layer 18 (ADAPTED_DENSE_LAYERS); here the adapter alone is compared
        assert m.config.sparse.dense_layers == {"smollm2-135m": (), "smollm2-135m-sparse": (18,)}[name]
        cfg = m.config.replace(sparse=dataclasses.replace(m.config.sparse, local_blocks=2, topk=8, dense_layers=()))
        r = eval_copy(api.Pretrained(cfg, m.params, m.tokenizer, m.dtype), lengths=(1024,), samples=2,
                      modes=("sparse",), progress=False)
        nll[name] = np.array(r["rows"][0]["copy_nll_per_sample"])
    assert np.all(nll["smollm2-135m-sparse"] < nll["smollm2-135m"] - 0.3), nll
    assert adapter_file.adapter_path("smollm2-135m-sparse").stat().st_size <= 10 * 10**6  # the 10 MB


def _masked_dense_backend(calls):
    """A sparse_attention backend with the registry's signature: a plain softmax attention over
    every key, masked to the keys of the selected blocks at or before the query's position,
    differentiated by JAX's autodiff (no custom VJP, no chunking)."""

    def run(q, k, v, block_ids, q_positions, *, block_size, bias, config):
        calls.append(q.shape)
        b, tq, h, d = q.shape
        s, kh = k.shape[1], k.shape[2]
        key_block = (jnp.arange(s) // block_size)[None, None, None, None, :]
        vis = (block_ids[..., None] == key_block).any(axis=-2)  # [B, K, Tq, S]
        vis = vis & (jnp.arange(s)[None, None, None, :] <= q_positions[:, None, :, None])
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", q.reshape(b, tq, kh, h // kh, d), k) / math.sqrt(d)
        p = jax.nn.softmax(jnp.where(vis[:, :, None], logits, -jnp.inf), axis=-1)
        return jnp.einsum("BKGTS,BSKD->BTKGD", p, v).reshape(b, tq, h, d).astype(q.dtype)

    return run


def test_gradients_match_autodiff_of_dense_masked_attention(tiny_params, monkeypatch):
    """The adapter's gradient through the whole model in sparse mode (sparse_attention's custom
    VJP and chunked backward) equals autodiff through the same model with attention computed
    densely under a mask of the same selected blocks (the selection does not depend on how
    attention is computed). float32: ~1e-6 relative apart."""
    from sparda_jax.ops.sparse_attention.api import BACKENDS

    ad, tok = _as_finetune_places(_random_adapter(3)), _tokens(2, (2, T))
    base = _as_finetune_places(tiny_params)
    # the masks matter: sparse-mode logits are far from dense ones
    merged = merge_adapter(base, ad, LORA)
    sparse, dense = (forward(merged, tok, TINY, mode=m) for m in ("sparse", "dense"))
    assert float(jnp.abs(sparse - dense).max()) > 0.1 * float(jnp.std(dense))
    # the dense weight mixes the dense mode's NLL of the same merged weights in
    mixed, parts = finetune_loss(ad, base, tok, config=TINY, fc=FinetuneConfig(
        lora=LORA, seq_len=T, batch=2, micro_batch=2, dtype="float32", dense_weight=0.25))
    assert float(mixed) == pytest.approx(0.75 * float(parts["nll_sparse"]) + 0.25 * float(parts["nll_dense"]), rel=1e-6)

    loss_of = lambda impl: jax.jit(jax.value_and_grad(
        lambda a: finetune_loss(a, base, tok, config=TINY, fc=FC, implementations=impl)[0]))
    l_vjp, g_vjp = loss_of(Implementations())(ad)
    assert float(l_vjp) == pytest.approx(float(parts["nll_sparse"]), rel=1e-6)
    calls = []
    monkeypatch.setitem(BACKENDS.backends, "xla", _masked_dense_backend(calls))
    jax.clear_caches()  # no program traced with the real backend may stand in for the patched one
    try:
        l_ref, g_ref = loss_of(Implementations(sparse_attention="xla"))(ad)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert len(calls) >= 1  # the reference did run the masked attention
    np.testing.assert_allclose(float(l_vjp), float(l_ref), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_vjp), jax.tree.leaves(g_ref)):
        scale = float(jnp.abs(b).max())
        assert scale > 0, path
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))


def _copies_brute_force(tokens, n, min_gap):
    """Prediction t is a copy when tokens[t+1-n : t+2] occurred ending at e' <= t+1 - min_gap, e' >= n."""
    b, t = tokens.shape
    out = np.zeros((b, t - 1), bool)
    for r in range(b):
        seen = {}
        for e in range(n, t):
            key = tuple(tokens[r, e - n:e + 1])
            seen.setdefault(key, e)
            out[r, e - 1] = seen[key] <= e - min_gap
    return out


def test_copy_positions_mark_what_a_long_range_copy_predicts():
    from sparda_jax.train.finetune import copy_positions

    rng = np.random.default_rng(0)
    tok = rng.integers(0, 50_000, (2, 3000))
    tok[0, 2000:2100] = tok[0, 300:400]            # a 100-token span repeated 1600 tokens later
    tok[1, 1100:1140] = tok[1, 200:240]            # and one 900 later: inside the gap, not a copy
    got = np.asarray(copy_positions(jnp.asarray(tok), n=8, min_gap=1024))
    want = np.zeros_like(got)
    want[0, 2007:2099] = True                       # predictions of tokens 2008..2099: a full 9-gram
    np.testing.assert_array_equal(got, want)
    small = rng.integers(0, 3, (2, 700))            # a 3-token vocabulary: repeats everywhere
    np.testing.assert_array_equal(np.asarray(copy_positions(jnp.asarray(small), n=4, min_gap=100)),
                                  _copies_brute_force(small, 4, 100))


def test_copy_weight_adds_the_sparse_nll_of_the_copied_tokens(tiny_params):
    import dataclasses

    from sparda_jax.train.finetune import copy_positions

    tok = np.array(_tokens(8, (2, T)))
    tok[:, 66:96] = tok[:, 2:32]                    # a 30-token copy 64 tokens after its source
    tok = jnp.asarray(tok)
    fc = dataclasses.replace(FC, objective="distill", copy_weight=0.5)
    ad = _random_adapter(9)
    with pytest.MonkeyPatch.context() as mp:  # the window of the tiny model is short: a small gap
        from sparda_jax.train import finetune as ft
        mp.setattr(ft, "copy_positions", lambda t: copy_positions(t, min_gap=64))
        loss, parts = finetune_loss(ad, tiny_params, tok, config=TINY, fc=fc)
    mask = np.asarray(copy_positions(tok, min_gap=64))
    assert mask.sum() == 2 * (30 - 8)
    student = forward(merge_adapter(tiny_params, ad, LORA), tok, TINY, mode="sparse")
    nll = -np.take_along_axis(_log_softmax64(student)[:, :-1], np.asarray(tok)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(float(parts["nll_copy"]), nll[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(parts["kl_sparse"]) + 0.5 * nll[mask].mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="copy_weight"):
        dataclasses.replace(fc, copy_weight=-1.0)


def _selection_kl_brute_force(q, k, pos, sp, fine, kept_k):
    """`losses.selection_alignment` in float64 loops: per (batch, KV head, row), the group-summed
    softmax over visible compressed keys (student, coarse grid; teacher, fine grid max-pooled onto
    each coarse window's tokens), init / local windows dropped, then the KL over the teacher's
    kept_k largest positions plus one bucket for the rest, both sides renormalized."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, r, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh

    def comp(size, stride):
        n = (s - size) // stride + 1
        return np.stack([k[:, c * stride:c * stride + size].mean(1) for c in range(n)], 1), n  # [B, N, K, D]

    kc, n_c = comp(sp.kernel_size, sp.kernel_stride)
    kf, n_f = comp(*fine)
    total, rows = 0.0, 0
    for bi in range(b):
        for kv in range(kh):
            for i in range(r):
                p = int(pos[bi, i])

                def group_probs(keys, n, size, stride):
                    vis = np.array([c * stride + size - 1 <= p for c in range(n)])
                    out = np.zeros(n)
                    for hh in range(kv * g, kv * g + g):
                        z = keys[bi, :, kv] @ q[bi, i, hh] / math.sqrt(d)
                        e = np.where(vis, np.exp(z - z[vis].max()), 0.0)
                        out += e / e.sum()
                    return out, vis

                stu, cvis = group_probs(kc, n_c, sp.kernel_size, sp.kernel_stride)
                fin, _ = group_probs(kf, n_f, *fine)
                tea = np.zeros(n_c)
                for c in range(n_c):
                    inside = [j for j in range(n_f) if j * fine[1] >= c * sp.kernel_stride
                              and j * fine[1] + fine[0] <= c * sp.kernel_stride + sp.kernel_size]
                    tea[c] = max(fin[j] for j in inside) if cvis[c] else 0.0
                first = np.arange(n_c) * sp.kernel_stride // sp.block_size
                last = (np.arange(n_c) * sp.kernel_stride + sp.kernel_size - 1) // sp.block_size
                keep = (first >= sp.init_blocks) & (last < p // sp.block_size - sp.local_blocks)
                tea, stu = tea * keep, stu * keep
                if tea.sum() == 0:
                    continue
                tea, stu = tea / tea.sum(), stu / stu.sum()
                top = np.argsort(-tea, kind="stable")[:kept_k]
                top = top[tea[top] > 0]
                rest = np.ones(n_c, bool)
                rest[top] = False
                rest_t, rest_s = tea[rest].sum(), stu[rest].sum()
                kl = float(np.sum(tea[top] * np.log(tea[top] / stu[top])))
                if rest_t > 0:
                    kl += rest_t * math.log(rest_t / rest_s)
                total, rows = total + kl, rows + 1
    return total, rows


def test_selection_alignment_against_a_brute_force_reference():
    """The model's own InfLLM-V2 scores against its own fine attention: the value equals a float64
    loop over rows; a fine grid equal to the coarse one makes teacher and student the same (KL 0);
    the gradient reaches q and k through the student alone (the teacher is held fixed)."""
    import dataclasses

    from sparda_jax.losses import selection_alignment

    sp, fc = TINY.sparse, TINY.forecast  # blocks of 16, windows (8, 4), 1 init + 1 local block
    rng = np.random.default_rng(5)
    b, s, kh, g, d = 2, 96, 2, 2, 16
    q = jnp.asarray(rng.standard_normal((b, 5, kh * g, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.float32)
    # 40 and 33: nothing visible past the forced blocks (block 0, and the own and previous block)
    pos = jnp.asarray([[40, 50, 63, 80, 95], [95, 70, 48, 64, 33]], jnp.int32)
    fine = dataclasses.replace(fc, teacher_kernel_size=2, teacher_kernel_stride=1)
    total, rows = selection_alignment(q, k, pos, sp, fine)
    want, want_rows = _selection_kl_brute_force(q, k, pos, sp, (2, 1), fc.supervision_k)
    assert int(rows) == want_rows == kh * (2 * 5 - 2)
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    assert want > 0.1
    same = dataclasses.replace(fc, teacher_kernel_size=sp.kernel_size, teacher_kernel_stride=sp.kernel_stride)
    assert abs(float(selection_alignment(q, k, pos, sp, same)[0])) < 1e-5
    gq, gk = jax.grad(lambda q, k: selection_alignment(q, k, pos, sp, fine)[0], argnums=(0, 1))(q, k)
    assert float(jnp.abs(gq).max()) > 0 and float(jnp.abs(gk).max()) > 0
    # the teacher is a constant: the gradient is that of the KL to a frozen teacher
    from sparda_jax.losses import excluded_positions, partition_kl, teacher_scores

    n_c = (s - sp.kernel_size) // sp.kernel_stride + 1
    keep = ~excluded_positions(n_c, pos, sp)[:, None]
    frozen = teacher_scores(q, k, pos, sp, fine, n_c) * keep
    coarse = dataclasses.replace(fc, teacher_kernel_size=sp.kernel_size, teacher_kernel_stride=sp.kernel_stride)

    def to_frozen(q, k):
        kl = partition_kl(frozen, teacher_scores(q, k, pos, sp, coarse, n_c) * keep, fc.supervision_k)
        return jnp.sum(jnp.where(jnp.sum(frozen, -1) > 0, kl, 0.0))

    hq, hk = jax.grad(to_frozen, argnums=(0, 1))(q, k)
    np.testing.assert_allclose(gq, hq, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gk, hk, rtol=1e-5, atol=1e-7)


def test_select_weight_adds_each_layers_selection_kl_and_training_lowers_it(tiny_params):
    """select_kl is the mean over layers of `selection_alignment` at `selection_rows`, computed
    from the sparse forward's own queries and keys (here taken from `forward`'s return_q and
    return_kv, another route); the loss adds select_weight times it; steps with the term
    dominant lower it (the adapter reaches the selection)."""
    import dataclasses

    from sparda_jax.losses import selection_alignment
    from sparda_jax.train.finetune import selection_rows

    # q and k 16x larger: attention as peaked as a trained model's (the init's is near uniform,
    # where coarse and fine scores agree and the term is ~1e-5)
    layers = dict(tiny_params["layers"])
    for t in ("q_proj", "k_proj"):
        layers[t] = {"kernel": 16 * tiny_params["layers"][t]["kernel"]}
    tiny_params = {**tiny_params, "layers": layers}
    tok = _tokens(11, (2, T))
    ad = _random_adapter(12)
    fc = dataclasses.replace(FC, select_weight=0.5, select_rows=16)
    loss, parts = finetune_loss(ad, tiny_params, tok, config=TINY, fc=fc)
    plain, _ = finetune_loss(ad, tiny_params, tok, config=TINY, fc=FC)
    np.testing.assert_allclose(float(loss), float(plain) + 0.5 * float(parts["select_kl"]), rtol=1e-6)
    merged = merge_adapter(tiny_params, ad, LORA)
    _, aux = forward(merged, tok, TINY, mode="sparse", return_q=True, return_kv=True)
    rows = np.asarray(selection_rows(T, TINY.sparse, 16))
    assert rows[0] == (1 + 1 + 1) * 16 and rows[-1] < T and len(set(rows)) == 16
    fine = dataclasses.replace(TINY.forecast, teacher_kernel_size=2, teacher_kernel_stride=1)
    per_layer = []
    for l in range(TINY.num_layers):
        kl, n = selection_alignment(aux["q"][l][:, rows], aux["k"][l], jnp.broadcast_to(jnp.asarray(rows), (2, 16)),
                                    TINY.sparse, fine)
        per_layer.append(float(kl) / int(n))
    np.testing.assert_allclose(float(parts["select_kl"]), np.mean(per_layer), rtol=1e-5)
    # select_layers: the mean over those layers only
    aimed = dataclasses.replace(fc, select_layers=(0, 2))
    _, parts_aimed = finetune_loss(ad, tiny_params, tok, config=TINY, fc=aimed)
    np.testing.assert_allclose(float(parts_aimed["select_kl"]), (per_layer[0] + per_layer[2]) / 2, rtol=1e-5)
    for bad in ((2, 0), (1, 1), (-1,), [1]):
        with pytest.raises(ConfigError, match="select_layers"):
            dataclasses.replace(fc, select_layers=bad)
    with pytest.raises(ConfigError, match="select_weight > 0"):
        dataclasses.replace(FC, select_layers=(1,))
    # the term is learnable through the adapter: a fixed batch, the selection term dominant
    from sparda_jax.train.run import make_mesh, shard_batch

    fc = dataclasses.replace(FC, select_weight=20.0, select_rows=16)
    state = _as_finetune_places(init_adapter_state(init_adapter(TINY, LORA, jax.random.key(1)), fc))
    batch = shard_batch(make_mesh(1), np.asarray(tok)[None], (1, 2, T))
    seen = []
    for _ in range(15):
        state, m = finetune_step(state, _as_finetune_places(tiny_params), batch, config=TINY, fc=fc)
        seen.append(float(m["select_kl"]))
    assert seen[-1] < 0.8 * seen[0], seen  # 0.64 -> 0.48 when written
    with pytest.raises(ValueError, match="select_rows 200"):
        selection_rows(T, TINY.sparse, 200)


def test_finetune_starts_from_an_adapter_file(tmp_path, tiny_params):
    """init_from: the run's first step starts at that adapter (its step-1 loss is the file's
    adapter's loss), its sha256 is recorded; another rank is refused before any work; the CLI's
    --init-adapter shipped names the package's adapter for the base model."""
    import hashlib

    from sparda_jax import cli

    model = Pretrained(TINY, tiny_params, ByteTokenizer())
    ad = _random_adapter(21)
    path = save_adapter(tmp_path / "start.safetensors", ad, TINY, LORA, dtype="float32")
    fc = FinetuneConfig(**{**FC.__dict__, "steps": 1})
    kw = dict(save_every=1, eval_every=0, eval_len=T, progress=False, log=lambda s: None)
    finetune(model, fc, tmp_path / "run", init_from=path, **kw)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    from sparda_jax.train.run import step_batch, training_data, make_mesh

    data = training_data(model, T, fc.seed, None, __import__("sparda_jax.train.augment", fromlist=["x"]).RetrievalMix())
    batch = np.asarray(step_batch(data, make_mesh(1), 0, batch=2, micro_batch=2, seq_len=T))[0]
    want, _ = finetune_loss(ad, tiny_params, jnp.asarray(batch), config=TINY, fc=fc)
    np.testing.assert_allclose(first["loss"], float(want), rtol=1e-5)
    rec = json.loads((tmp_path / "run" / "config.json").read_text())["init"]
    assert rec == {"file": "start.safetensors", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    other = FinetuneConfig(**{**fc.__dict__, "lora": LoraConfig(rank=2, alpha=8.0)})
    with pytest.raises(ValueError, match="rank=4"):
        finetune(model, other, tmp_path / "other", init_from=path, **kw)
    assert not (tmp_path / "other" / "config.json").exists()
    smol = Pretrained(get_preset("smollm2-135m"), {}, None)
    assert cli._init_adapter_path("shipped", smol) == adapter_file.adapter_path("smollm2-135m-sparse")
    with pytest.raises(SystemExit, match="no adapter is shipped"):
        cli._init_adapter_path("shipped", model)


def test_training_through_dense_layers(tiny_params):
    """Fine-tuning a config with dense layers differentiates through the scan's choice between
    dense and block-sparse attention: with every layer dense the sparse loss and its adapter
    gradient are the dense mode's; with one dense layer the loss lies apart from both."""
    import dataclasses

    tok = _tokens(11, (2, T))
    ad = _random_adapter(12)
    with_dense = lambda layers: TINY.replace(sparse=dataclasses.replace(TINY.sparse, dense_layers=layers))
    loss = lambda cfg, fc: jax.value_and_grad(lambda a: finetune_loss(a, tiny_params, tok, config=cfg, fc=fc)[0])(ad)
    every, g_every = loss(with_dense((0, 1, 2)), FC)
    dense, g_dense = loss(TINY, dataclasses.replace(FC, dense_weight=1.0))  # the dense-only control
    np.testing.assert_allclose(float(every), float(dense), rtol=1e-5)
    # the same float32 ops but in another program (the cond's branch): sums may round apart
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7), g_every, g_dense)
    one, _ = loss(with_dense((1,)), FC)
    sparse, _ = loss(TINY, FC)
    assert abs(float(one) - float(sparse)) > 1e-5 and abs(float(one) - float(dense)) > 1e-5
