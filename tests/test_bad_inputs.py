"""Bad inputs to the configs and the ops: each must raise its error type with a message that
names the problem (for configs, `Class.field`), before any work. One good construction per
config shows the checks do not refuse valid values."""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax.config import (ConfigError, ForecastConfig, Implementations, LongRoPEConfig, ModelConfig,
                               SparseConfig, get_preset)
from sparda_jax.infer.engine import EngineConfig
from sparda_jax.infer.generate import SamplingConfig
from sparda_jax.kernels.kv_copy import KVCopyConfig
from sparda_jax.ops.block_select.api import select_blocks_forecast, select_blocks_infllmv2, select_blocks_nosa
from sparda_jax.ops.sparse_attention.api import paged_sparse_attention, sparse_attention
from sparda_jax.ops.sparse_attention.decode import DecodeConfig
from sparda_jax.io.adapter_file import LoraConfig
from sparda_jax.train.finetune import FinetuneConfig
from sparda_jax.train.objective import ForecastLossTap, TrainConfig

TINY = get_preset("tiny")
NAN, INF = math.nan, math.inf


# ------------------------------------------------------------------------------ op inputs (tiny)

def _attention_inputs(ids):
    """q [1, 1, 2, 8] at position 255 over k, v [1, 256, 1, 8]: 4 blocks of 64."""
    q = jnp.ones((1, 1, 2, 8), jnp.float32)
    k = v = jnp.ones((1, 256, 1, 8), jnp.float32)
    return q, k, v, jnp.asarray(ids, jnp.int32).reshape(1, 1, 1, -1), jnp.array([[255]], jnp.int32)


def _select_inputs(heads, kv_heads):
    """q [1, 4, heads, 8] and compressed keys kc [1, 8, kv_heads, 8] for TINY.sparse."""
    q = jnp.ones((1, 4, heads, 8), jnp.float32)
    kc = jnp.ones((1, 8, kv_heads, 8), jnp.float32)
    return q, kc, jnp.arange(4, dtype=jnp.int32)[None] + 20


@functools.cache
def _tiny_params():
    from sparda_jax.api import init_model

    return init_model(TINY, jax.random.key(0))


def _tiny_model():
    from sparda_jax.api import Pretrained

    return Pretrained(TINY, _tiny_params(), None)


def _forward(tokens):
    from sparda_jax import forward

    return forward(_tiny_params(), jnp.asarray(tokens, jnp.int32), TINY)


def _generate(prompts, **kw):
    from sparda_jax.infer.generate import generate

    return generate(_tiny_params(), TINY, prompts, SamplingConfig(max_new_tokens=2), **kw)


def _forecast_file(kind: str):
    """load_forecast on a file of random bytes, or on one of the tiny model's shapes whose tensor f is NaN."""
    from safetensors.numpy import save_file

    from sparda_jax.io.forecast_file import load_forecast

    path = Path(tempfile.mkdtemp()) / f"{kind}.safetensors"
    if kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        f = np.zeros((2, 64, 2, 16), np.float32)
        f[1, 3] = NAN
        save_file({"f0_cur": np.zeros((64, 2, 16), np.float32), "f": f}, str(path))
    return load_forecast(path, TINY)


def _paged(block_size):
    q = jnp.ones((1, 1, 2, 8), jnp.float32)
    pool = jnp.ones((1, 1, 2, 64, 8), jnp.float32)
    ids = jnp.zeros((1, 1, 1, 2), jnp.int32)
    return paged_sparse_attention(q, pool, pool, ids, ids, jnp.array([[10]], jnp.int32), block_size=block_size)


# (id, call, error type, message fragment: a regex)
BAD = [
    # SparseConfig
    ("sparse.topk=40.5", lambda: SparseConfig(topk=40.5), ConfigError, r"SparseConfig\.topk: must be an int"),
    ("sparse.topk='96'", lambda: SparseConfig(topk="96"), ConfigError, r"SparseConfig\.topk: must be an int"),
    ("sparse.topk=True", lambda: SparseConfig(topk=True), ConfigError, r"SparseConfig\.topk: must be an int"),
    ("sparse.local_blocks=None", lambda: SparseConfig(local_blocks=None), ConfigError,
     r"SparseConfig\.local_blocks: must be an int"),
    ("sparse.block_size=64.0", lambda: SparseConfig(block_size=64.0), ConfigError, r"SparseConfig\.block_size"),
    ("sparse.dense_len=-1", lambda: SparseConfig(dense_len=-1), ConfigError, r"SparseConfig\.dense_len: must be >= 0"),
    ("sparse.exact_lse=1", lambda: SparseConfig(exact_lse=1), ConfigError, r"SparseConfig\.exact_lse: must be a bool"),
    ("sparse.nosa_qk_topk=40.0", lambda: SparseConfig(nosa_qk_topk=40.0), ConfigError,
     r"SparseConfig\.nosa_qk_topk: must be an int or None"),
    # LongRoPEConfig
    ("longrope.factor=nan", lambda: LongRoPEConfig((1.0, NAN), (1.0, 1.0), 1024), ConfigError,
     r"LongRoPEConfig\.short_factor\[1\]: must be finite"),
    ("longrope.factor=list", lambda: LongRoPEConfig([1.0], (1.0,), 1024), ConfigError,
     r"LongRoPEConfig\.short_factor: must be a tuple"),
    ("longrope.factor='1'", lambda: LongRoPEConfig((1.0,), ("1",), 1024), ConfigError,
     r"LongRoPEConfig\.long_factor\[0\]: must be a number"),
    ("longrope.original=1024.0", lambda: LongRoPEConfig((1.0,), (1.0,), 1024.0), ConfigError,
     r"LongRoPEConfig\.original_max_position_embeddings: must be an int"),
    # ForecastConfig
    ("forecast.supervision_k=8.0", lambda: ForecastConfig(supervision_k=8.0), ConfigError,
     r"ForecastConfig\.supervision_k: must be an int"),
    ("forecast.init_std=nan", lambda: ForecastConfig(init_std=NAN), ConfigError, r"ForecastConfig\.init_std: must be finite"),
    ("forecast.init_std=inf", lambda: ForecastConfig(init_std=INF), ConfigError, r"ForecastConfig\.init_std: must be finite"),
    # ModelConfig
    ("model.vocab_size=256.0", lambda: TINY.replace(vocab_size=256.0), ConfigError, r"ModelConfig\.vocab_size: must be an int"),
    ("model.num_layers='3'", lambda: TINY.replace(num_layers="3"), ConfigError, r"ModelConfig\.num_layers: must be an int"),
    ("model.rms_eps=nan", lambda: TINY.replace(rms_eps=NAN), ConfigError, r"ModelConfig\.rms_eps: must be finite"),
    ("model.rope_theta=inf", lambda: TINY.replace(rope_theta=INF), ConfigError, r"ModelConfig\.rope_theta: must be finite"),
    ("model.scale_depth=nan", lambda: TINY.replace(scale_depth=NAN), ConfigError, r"ModelConfig\.scale_depth"),
    ("model.dim_model_base=256.0", lambda: TINY.replace(dim_model_base=256.0), ConfigError,
     r"ModelConfig\.dim_model_base: must be an int or None"),
    ("model.tie_embeddings='no'", lambda: TINY.replace(tie_embeddings="no"), ConfigError,
     r"ModelConfig\.tie_embeddings: must be a bool"),
    ("model.bos_token_id=-1", lambda: TINY.replace(bos_token_id=-1), ConfigError, r"ModelConfig\.bos_token_id: must be >= 0"),
    ("model.eos_token_ids past vocab", lambda: TINY.replace(eos_token_ids=(256,)), ConfigError,
     r"ModelConfig\.eos_token_ids\[0\]: must be <= 255"),
    ("model.eos_token_ids=[2]", lambda: TINY.replace(eos_token_ids=[2]), ConfigError,
     r"ModelConfig\.eos_token_ids: must be a tuple"),
    ("model.sparse=None", lambda: TINY.replace(sparse=None), ConfigError, r"ModelConfig\.sparse: must be a SparseConfig"),
    ("model.forecast=dict", lambda: TINY.replace(forecast={}), ConfigError, r"ModelConfig\.forecast: must be a ForecastConfig"),
    ("model.name=None", lambda: TINY.replace(name=None), ConfigError, r"ModelConfig\.name: must be a str"),
    # Implementations
    ("implementations.select=1", lambda: Implementations(select=1), ConfigError, r"Implementations\.select"),
    ("implementations.kv_copy='CUDA'", lambda: Implementations(kv_copy="CUDA"), ConfigError, r"Implementations\.kv_copy"),
    # SamplingConfig
    ("sampling.temperature=nan", lambda: SamplingConfig(temperature=NAN), ConfigError,
     r"SamplingConfig\.temperature: must be finite"),
    ("sampling.temperature=inf", lambda: SamplingConfig(temperature=INF), ConfigError,
     r"SamplingConfig\.temperature: must be finite"),
    ("sampling.temperature='0.7'", lambda: SamplingConfig(temperature="0.7"), ConfigError,
     r"SamplingConfig\.temperature: must be a number"),
    ("sampling.temperature=-1", lambda: SamplingConfig(temperature=-1.0), ConfigError,
     r"SamplingConfig\.temperature: must be >= 0"),
    ("sampling.top_p=nan", lambda: SamplingConfig(top_p=NAN), ConfigError, r"SamplingConfig\.top_p: must be finite"),
    ("sampling.top_p=0", lambda: SamplingConfig(top_p=0.0), ConfigError, r"SamplingConfig\.top_p: must be > 0"),
    ("sampling.top_p=1.5", lambda: SamplingConfig(top_p=1.5), ConfigError, r"SamplingConfig\.top_p: must be <= 1"),
    ("sampling.max_new_tokens=8.0", lambda: SamplingConfig(max_new_tokens=8.0), ConfigError,
     r"SamplingConfig\.max_new_tokens: must be an int"),
    ("sampling.max_new_tokens=0", lambda: SamplingConfig(max_new_tokens=0), ConfigError,
     r"SamplingConfig\.max_new_tokens: must be >= 1"),
    ("sampling.max_new_tokens=-3", lambda: SamplingConfig(max_new_tokens=-3), ConfigError,
     r"SamplingConfig\.max_new_tokens: must be >= 1"),
    ("sampling.seed=1.5", lambda: SamplingConfig(seed=1.5), ConfigError, r"SamplingConfig\.seed: must be an int"),
    ("sampling.seed=-1", lambda: SamplingConfig(seed=-1), ConfigError, r"SamplingConfig\.seed: must be >= 0"),
    # EngineConfig
    ("engine.system=None", lambda: EngineConfig(None), ConfigError, r"EngineConfig.system"),
    ("engine.n_slots=4.0", lambda: EngineConfig(n_slots=4.0), ConfigError, r"EngineConfig\.n_slots: must be an int"),
    ("engine.n_slots=0", lambda: EngineConfig(n_slots=0), ConfigError, r"EngineConfig\.n_slots: must be >= 1"),
    ("engine.reuse=1", lambda: EngineConfig(reuse=1), ConfigError, r"EngineConfig\.reuse: must be a bool"),
    ("engine.num_ctas='fast'", lambda: EngineConfig(num_ctas="fast"), ConfigError, r"EngineConfig\.num_ctas"),
    ("engine.num_ctas=16.0", lambda: EngineConfig(num_ctas=16.0), ConfigError, r"EngineConfig\.num_ctas: must be an int"),
    ("engine.num_ctas=2048", lambda: EngineConfig(num_ctas=2048), ConfigError, r"EngineConfig\.num_ctas: must be <= 1024"),
    ("engine.implementations=str", lambda: EngineConfig(implementations="xla"), ConfigError,
     r"EngineConfig\.implementations: must be a Implementations"),
    # KVCopyConfig
    ("kv_copy.num_ctas=4.0", lambda: KVCopyConfig(num_ctas=4.0), ConfigError, r"KVCopyConfig\.num_ctas: must be an int"),
    ("kv_copy.threads='256'", lambda: KVCopyConfig(threads="256"), ConfigError, r"KVCopyConfig\.threads: must be an int"),
    ("kv_copy.threads=48", lambda: KVCopyConfig(threads=48), ConfigError, r"KVCopyConfig\.threads: must be a multiple of 32"),
    # Mosaic kernels' tuning
    ("decode.stages=2.0", lambda: DecodeConfig(stages=2.0), ConfigError, r"DecodeConfig\.stages: must be an int"),
    ("decode.stages=1", lambda: DecodeConfig(stages=1), ConfigError, r"DecodeConfig\.stages: must be >= 2"),
    ("decode.n_split=1.5", lambda: DecodeConfig(n_split=1.5), ConfigError, r"DecodeConfig\.n_split: must be an int or None"),
    # training
    ("train.steps=10.0", lambda: TrainConfig(steps=10.0), ConfigError, r"TrainConfig\.steps: must be an int"),
    ("train.lr=nan", lambda: TrainConfig(lr=NAN), ConfigError, r"TrainConfig\.lr: must be finite"),
    ("train.lr=0", lambda: TrainConfig(lr=0.0), ConfigError, r"TrainConfig\.lr: must be > 0"),
    ("train.b1=1", lambda: TrainConfig(b1=1.0), ConfigError, r"TrainConfig\.b1: must be < 1"),
    ("train.clip=inf", lambda: TrainConfig(clip=INF), ConfigError, r"TrainConfig\.clip: must be finite"),
    ("train.seed=0.5", lambda: TrainConfig(seed=0.5), ConfigError, r"TrainConfig\.seed: must be an int"),
    ("train.batch%micro_batch", lambda: TrainConfig(batch=6, micro_batch=4), ConfigError,
     r"TrainConfig\.batch: .* multiple of micro_batch"),
    ("train.backbone_mode='fast'", lambda: TrainConfig(backbone_mode="fast"), ConfigError, r"TrainConfig\.backbone_mode"),
    ("tap.q_chunk=0", lambda: ForecastLossTap(TINY, q_chunk=0), ConfigError, r"ForecastLossTap\.q_chunk: must be >= 1"),
    # fine-tuning
    ("lora.rank=0", lambda: LoraConfig(rank=0), ConfigError, r"LoraConfig\.rank: must be >= 1"),
    ("lora.alpha=0", lambda: LoraConfig(alpha=0.0), ConfigError, r"LoraConfig\.alpha: must be > 0"),
    ("lora.targets=list", lambda: LoraConfig(targets=["q_proj"]), ConfigError, r"LoraConfig\.targets: must be a tuple"),
    ("lora.targets=mlp", lambda: LoraConfig(targets=("q_proj", "gate_proj")), ConfigError, r"LoraConfig\.targets: must be distinct"),
    ("lora.targets=repeat", lambda: LoraConfig(targets=("q_proj", "q_proj")), ConfigError, r"LoraConfig\.targets"),
    ("finetune.dense_weight=1.5", lambda: FinetuneConfig(dense_weight=1.5), ConfigError,
     r"FinetuneConfig\.dense_weight: must be <= 1"),
    ("finetune.lora=dict", lambda: FinetuneConfig(lora={"rank": 4}), ConfigError, r"FinetuneConfig\.lora: must be a LoraConfig"),
    ("finetune.batch%micro_batch", lambda: FinetuneConfig(batch=6, micro_batch=4), ConfigError,
     r"FinetuneConfig\.batch: .* multiple of micro_batch"),
    ("finetune.dtype=float16", lambda: FinetuneConfig(dtype="float16"), ConfigError, r"FinetuneConfig\.dtype"),
    # token ids and lengths against the model
    ("forward token id 10**6", lambda: _forward([[1, 10**6]]), ValueError,
     r"token id 1000000 is outside the vocabulary \[0, 256\)"),
    ("forward token id -1", lambda: _forward([[-1, 5]]), ValueError, r"token id -1 is outside the vocabulary"),
    ("generate token id 10**6", lambda: _generate([[1, 10**6]]), ValueError,
     r"token id 1000000 is outside the vocabulary \[0, 256\)"),
    ("generate engine token id 256", lambda: _generate([[3], [1, 256]], engine=EngineConfig("sparse")), ValueError,
     r"token id 256 is outside the vocabulary \[0, 256\)"),
    ("logits token id 256", lambda: _tiny_model().logits([[1, 256]]), ValueError,
     r"token id 256 is outside the vocabulary"),
    ("logits past the context", lambda: _tiny_model().logits(np.ones((1, 4097), np.int32)), ValueError,
     r"4097 tokens exceed the model's context of 4096"),
    # Forecast files
    ("forecast file of random bytes", lambda: _forecast_file("random"), ValueError,
     r"random\.safetensors: not a readable safetensors file"),
    ("forecast file with NaN", lambda: _forecast_file("nan"), ValueError,
     r"nan\.safetensors: tensor f has 32 non-finite values"),
    # sparse_attention
    ("sparse_attention id 99 of 4 blocks", lambda: sparse_attention(*_attention_inputs([0, 99])), ValueError,
     r"block ids .* must be < 4 .*got 99"),
    ("sparse_attention id 4 of 4 blocks", lambda: sparse_attention(*_attention_inputs([4, -1])), ValueError,
     r"must be < 4 .*got 4"),
    ("sparse_attention block_size=0", lambda: sparse_attention(*_attention_inputs([0, 1]), block_size=0), ValueError,
     r"block_size must be an int >= 1, got 0"),
    ("sparse_attention block_size=64.0", lambda: sparse_attention(*_attention_inputs([0, 1]), block_size=64.0),
     ValueError, r"block_size must be an int >= 1"),
    ("paged_sparse_attention block_size=0", lambda: _paged(0), ValueError, r"block_size must be an int >= 1, got 0"),
    # block selection
    ("select_blocks_infllmv2 3 heads over 2", lambda: select_blocks_infllmv2(*_select_inputs(3, 2), TINY.sparse),
     ValueError, r"query heads \(3\) must be a multiple of KV heads \(2\).*\(1, 4, 3, 8\).*\(1, 8, 2, 8\)"),
    ("select_blocks_nosa 3 heads over 2",
     lambda: select_blocks_nosa(*_select_inputs(3, 2)[:2], jnp.ones((1, 8, 2)), _select_inputs(3, 2)[2],
                                get_preset("tiny-nosa").sparse),
     ValueError, r"query heads \(3\) must be a multiple of KV heads \(2\)"),
    ("select_blocks_infllmv2 sparse=None", lambda: select_blocks_infllmv2(*_select_inputs(4, 2), None), TypeError,
     r"sparse must be a SparseConfig, got NoneType"),
    ("select_blocks_forecast sparse=None", lambda: select_blocks_forecast(*_select_inputs(2, 2), None), TypeError,
     r"sparse must be a SparseConfig, got NoneType"),
]


@pytest.mark.parametrize("call,error,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises(call, error, message):
    with pytest.raises(error, match=message) as info:
        call()
    if error is ConfigError:
        assert isinstance(info.value, ValueError)  # callers catching ValueError keep working


GOOD = [
    ("sparse", lambda: SparseConfig(block_size=np.int64(16), init_blocks=0, local_blocks=0, topk=1, kernel_size=8,
                                    kernel_stride=4, dense_len=0, exact_lse=np.bool_(False), nosa_qk_topk=1)),
    ("longrope", lambda: LongRoPEConfig((1, 2.5), (np.float32(1.0), 3.0), 1024)),
    ("forecast", lambda: ForecastConfig(teacher_kernel_size=2, teacher_kernel_stride=2, supervision_k=1, init_std=1)),
    ("model", lambda: TINY.replace(rms_eps=np.float32(1e-6), rope_theta=10000, scale_depth=1.4, dim_model_base=32,
                                   bos_token_id=0, eos_token_ids=(255, np.int32(1)))),
    ("implementations", lambda: Implementations("xla", "mosaic_gpu", None, "cuda")),
    ("sampling", lambda: SamplingConfig(temperature=1, top_p=1.0, max_new_tokens=1, seed=2**32 - 1)),
    ("engine", lambda: EngineConfig("sparse", n_slots=np.int64(8), reuse=False, num_ctas="auto")),
    ("engine ctas", lambda: EngineConfig(num_ctas=1024)),
    ("kv_copy", lambda: KVCopyConfig(num_ctas=np.int32(1), threads=32)),
    ("decode", lambda: DecodeConfig(n_split=1, stages=3)),
    ("train", lambda: TrainConfig(seq_len=128, batch=4, micro_batch=2, steps=1, lr=1, weight_decay=0, b1=0, b2=0.5,
                                  seed=0, backbone_mode="sparse")),
    ("tap", lambda: ForecastLossTap(TINY, "bfloat16", 1)),
    ("lora", lambda: LoraConfig(rank=np.int64(2), alpha=1, targets=("o_proj",))),
    ("finetune", lambda: FinetuneConfig(lora=LoraConfig(rank=1), dense_weight=1, seq_len=128, batch=4, micro_batch=2,
                                        steps=1, lr=1, weight_decay=0, b1=0, b2=0.5, dtype="float32", seed=0)),
]


@pytest.mark.parametrize("make", [g[1] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_config_accepted(make):
    make()


def test_every_preset_is_valid():
    from sparda_jax.config import PRESETS

    for cfg in PRESETS.values():
        assert ModelConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) == cfg


def test_sparse_attention_accepts_the_last_block():
    """ids up to n_blocks - 1 pass the range check, and the result is that of the reference."""
    from sparda_jax.ops.sparse_attention.reference import sparse_attention_reference

    q, k, v, ids, pos = _attention_inputs([3, -1])
    k = jax.random.normal(jax.random.key(0), k.shape)
    out = sparse_attention(q, k, v, ids, pos, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sparse_attention_reference(q, k, v, ids, pos)))


def test_sparse_attention_traced_ids_are_not_checked():
    """Under jit the ids are traced: no host round trip, no error (the contract says ids < n_blocks)."""
    q, k, v, ids, pos = _attention_inputs([0, 99])
    out = jax.jit(lambda i: sparse_attention(q, k, v, i, pos, implementation="xla"))(ids)
    assert out.shape == q.shape


def test_generate_clamps_the_budget_to_the_cache(monkeypatch):
    """A budget far past the prompt's blocks runs with the budget clamped to the cache's blocks
    (the selection, padded with -1 past the visible blocks, is the same), so nothing is sized by
    the budget asked for: the same tokens as with the budget set to the cache's blocks."""
    import dataclasses

    from sparda_jax.infer import engine as engine_mod
    from sparda_jax.infer.generate import generate

    seen = []
    real = engine_mod.engine_prefill_staged

    def spy(params, tokens, lengths, config, engine, **kw):
        seen.append((config.sparse.topk, kw["cache_size"]))
        assert config.sparse.topk <= 64, "unclamped budget"  # fail before allocating for it
        return real(params, tokens, lengths, config, engine, **kw)

    monkeypatch.setattr(engine_mod, "engine_prefill_staged", spy)
    with_topk = lambda k: TINY.replace(sparse=dataclasses.replace(TINY.sparse, topk=k))
    prompt = [list(np.random.default_rng(1).integers(1, 256, 38))]
    sampling = SamplingConfig(max_new_tokens=8)
    eng = EngineConfig("sparse")
    huge = generate(_tiny_params(), with_topk(100000), prompt, sampling, engine=eng)
    cache_blocks = -(-(64 + 8) // TINY.sparse.block_size)  # the prompt padded to 64, plus 8 new tokens
    assert seen == [(cache_blocks, cache_blocks * TINY.sparse.block_size)]  # the cache in whole blocks
    exact = generate(_tiny_params(), with_topk(cache_blocks), prompt, sampling, engine=eng)
    assert huge == exact and len(huge[0]) == 8
    # a budget below the cache's blocks is left alone
    seen.clear()
    generate(_tiny_params(), TINY, prompt, sampling, engine=eng)
    assert seen == [(TINY.sparse.topk, cache_blocks * TINY.sparse.block_size)]
