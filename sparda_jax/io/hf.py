"""HF safetensors checkpoints: MiniCPM4-style (muP, LongRoPE, sparse_config) and
Llama/NOSA-style, single-file or sharded (`model.safetensors.index.json`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..config import LongRoPEConfig, ModelConfig, SparseConfig
from .convert import CheckpointError, params_from_hf
from .tokenizer import Tokenizer, tokenizer_from_file

__all__ = ["load_hf", "config_from_hf", "SafetensorsIndex"]

_ARCHS = {
    "MiniCPMForCausalLM": "minicpm",
    "LlamaForCausalLM": "llama",
    "NOSAForCausalLM": "nosa",
}


def _arch_of(cfg: dict, path: Path) -> str:
    names = cfg.get("architectures") or []
    for n in names:
        if n in _ARCHS:
            return _ARCHS[n]
    model_type = cfg.get("model_type")
    if model_type in ("minicpm", "llama"):
        return model_type
    raise CheckpointError(f"{path}: unknown architecture {names or model_type!r}; supported: "
                          f"{', '.join(_ARCHS)}")


def _sparse_from_hf(sc: dict | None, default: SparseConfig) -> SparseConfig:
    """MiniCPM's `sparse_config`: window_size in tokens, topk in content blocks (the local
    window comes on top)."""
    if not sc:
        return default
    block = int(sc.get("block_size", default.block_size))
    window = int(sc.get("window_size", (default.local_blocks + 1) * block))
    local = window // block  # the query's own block is forced on top of these
    init = int(sc.get("init_blocks", default.init_blocks))
    topk = int(sc.get("topk", default.topk - default.forced_blocks)) + local
    return SparseConfig(
        block_size=block, init_blocks=init, local_blocks=local, topk=max(topk, init + local + 1),
        kernel_size=int(sc.get("kernel_size", default.kernel_size)),
        kernel_stride=int(sc.get("kernel_stride", default.kernel_stride)),
        # MiniCPM writes -1 for "always sparse"
        dense_len=max(0, int(sc.get("dense_len", default.dense_len))),
    )


def config_from_hf(cfg: dict, path: Path | str = "config.json", name: str | None = None,
                   has_cis: bool = False) -> ModelConfig:
    """ModelConfig from an HF config.json dict. NOSA checkpoints declare a plain Llama
    architecture; they are recognized by their cis tensors (`has_cis`)."""
    path = Path(path)
    arch = "nosa" if has_cis else _arch_of(cfg, path)

    def need(key):
        if key not in cfg:
            raise CheckpointError(f"{path}: config.json has no {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rs = cfg.get("rope_scaling")
    longrope = None
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "longrope":
            raise CheckpointError(f"{path}: unsupported rope_scaling type {kind!r} (supported: longrope)")
        longrope = LongRoPEConfig(tuple(map(float, rs["short_factor"])), tuple(map(float, rs["long_factor"])),
                                  int(rs["original_max_position_embeddings"]))
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    muP = arch == "minicpm" and cfg.get("use_mup", True)
    kw = {}
    if arch == "nosa":
        kw["sparse"] = _nosa_sparse_from_hf(cfg)
    elif cfg.get("sparse_config"):
        kw["sparse"] = _sparse_from_hf(cfg["sparse_config"], SparseConfig())
    return ModelConfig(
        name=name or cfg.get("_name_or_path") or path.parent.name,
        arch=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(need("intermediate_size")),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        longrope=longrope,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        scale_emb=float(cfg.get("scale_emb", 1.0)) if muP else 1.0,
        scale_depth=float(cfg["scale_depth"]) if muP and "scale_depth" in cfg else None,
        dim_model_base=int(cfg["dim_model_base"]) if muP and "dim_model_base" in cfg else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        source=f"HF config.json at {path}",
        **kw,
    )


def _nosa_sparse_from_hf(cfg: dict) -> SparseConfig:
    """NOSA's HF config carries no sparse budgets we could find; use the released code's
    defaults (the nosa-8b preset) unless the config has a sparse_config."""
    from ..config import get_preset

    default = get_preset("nosa-8b").sparse
    sc = cfg.get("sparse_config")
    if not sc:
        return default
    base = _sparse_from_hf(sc, default)
    return dataclasses.replace(base, nosa_qk_topk=int(sc.get("qk_topk", default.nosa_qk_topk)))


class SafetensorsIndex:
    """Tensor lookup by name over one or many .safetensors files (lazy, one tensor at a time)."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
            self.files = {name: directory / f for name, f in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="flax") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        for f in set(self.files.values()):
            if not f.is_file():
                raise CheckpointError(f"{directory}: shard {f.name} named in the index is missing")
        self._open: dict[Path, object] = {}

    def __call__(self, name: str) -> np.ndarray:
        f = self.files[name]  # KeyError -> a clear CheckpointError upstream
        if f not in self._open:
            # framework="flax": safetensors' numpy backend cannot read bfloat16.
            self._open[f] = safe_open(str(f), framework="flax")
        return np.asarray(self._open[f].get_tensor(name))

    def names(self) -> list[str]:
        return sorted(self.files)


def load_hf(directory: str | Path, dtype=np.float32, progress: bool = False) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Load an HF checkpoint directory: (config, params as numpy, tokenizer or None)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    index = SafetensorsIndex(directory)
    config = config_from_hf(raw, cfg_path, name=directory.name,
                            has_cis="model.layers.0.self_attn.A" in index.files)
    params = params_from_hf(index, config, dtype=dtype, progress=progress,
                            source=lambda name: str(index.files.get(name, directory)))
    tok = None
    if (directory / "tokenizer.json").is_file():
        tok_cfg = {}
        if (directory / "tokenizer_config.json").is_file():
            tok_cfg = json.loads((directory / "tokenizer_config.json").read_text())
        tok = tokenizer_from_file(directory / "tokenizer.json", bos_id=config.bos_token_id,
                                  eos_ids=config.eos_token_ids, chat_template=tok_cfg.get("chat_template"))
    return config, params, tok
