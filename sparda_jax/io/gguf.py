"""GGUF loader (llama architecture): weights dequantized by the `gguf` package, config and
tokenizer rebuilt from the file's metadata."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

from ..config import PRESETS, ModelConfig
from .convert import CheckpointError, params_from_hf
from .tokenizer import Tokenizer, tokenizer_from_gguf_vocab

__all__ = ["load_gguf", "unpermute_llamacpp", "GGUF_TO_HF"]

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_HF_TO_GGUF_LAYER = {v: k for k, v in GGUF_TO_HF.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL.items()}


def unpermute_llamacpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of attn_q / attn_k rows.

    llama.cpp stores each head's rows interleaved (pairs (2i, 2i+1) rotate together, GPT-J
    style); HF's rotate-half layout pairs (i, i + Dh/2). The converter applied
    reshape(H, 2, Dh/2, in).swapaxes(1, 2); this is its inverse.
    """
    out, inp = w.shape
    dh = out // n_heads
    return w.reshape(n_heads, dh // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config_from_metadata(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r} (supported: llama)")
    m = lambda k, d=None: _field(reader, f"llama.{k}", d)
    heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    vocab = m("vocab_size")
    if vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    fields = dict(
        arch="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(m("block_count")),
        num_heads=heads,
        num_kv_heads=int(m("attention.head_count_kv", heads)),
        head_dim=int(m("rope.dimension_count", hidden // heads)),
        intermediate_size=int(m("feed_forward_length")),
        rms_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(m("rope.freq_base", 10000.0)),
        max_position_embeddings=int(m("context_length", 4096)),
        tie_embeddings=tied,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    # A file that matches a preset's shape inherits the preset's name and sparse budgets.
    same = lambda a, b: math.isclose(a, b, rel_tol=1e-6) if isinstance(b, float) else a == b
    for preset in PRESETS.values():
        if all(same(getattr(preset, k), v) for k, v in fields.items()):
            return preset
    name = str(_field(reader, "general.name", path.stem))
    return ModelConfig(name=name, source=f"GGUF metadata of {path.name}", **fields)


def load_gguf(path: str | Path, dtype=np.float32, progress: bool = False) -> tuple[ModelConfig, dict, Tokenizer]:
    """Read a llama-architecture GGUF file: (config, params as numpy, tokenizer)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueErrors on bad magic etc.
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    config = _config_from_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def hf_name_to_gguf(name: str) -> tuple[str, str | None]:
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            return f"blk.{i}.{_HF_TO_GGUF_LAYER[rest]}", rest
        return _HF_TO_GGUF_GLOBAL[name], None

    def get(name: str) -> np.ndarray:
        gname, rest = hf_name_to_gguf(name)
        t = tensors.get(gname)
        if t is None:
            raise KeyError(name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if rest == "self_attn.q_proj.weight":
            w = unpermute_llamacpp(w, config.num_heads)
        elif rest == "self_attn.k_proj.weight":
            w = unpermute_llamacpp(w, config.num_kv_heads)
        return w

    params = params_from_hf(get, config, dtype=dtype, progress=progress, source=lambda name: str(path))
    tok = tokenizer_from_gguf_vocab(
        list(_field(reader, "tokenizer.ggml.tokens")),
        list(_field(reader, "tokenizer.ggml.merges")),
        list(_field(reader, "tokenizer.ggml.token_type")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "gpt2")),
        bos_id=config.bos_token_id,
        eos_ids=config.eos_token_ids,
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
    return config, params, tok
