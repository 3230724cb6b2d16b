"""LoRA adapters of the attention projections: their shapes, their merge into a backbone's
weights, and their small safetensors file (`sparda finetune` writes it, the preset
"smollm2-135m-sparse" reads the one shipped in the package).

An adapter holds, per target projection t of every layer, A [L, in, r] and B [L, r, out] (in /
out: the kernel's input / output axes flattened; q/k/v: in = D, o: out = D); the merged kernel
is W + (alpha / r) * A @ B, reshaped to W's shape.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ..config import ConfigError, ModelConfig, check_float, check_instance, check_int
from .convert import CheckpointError

__all__ = ["TARGETS", "LoraConfig", "adapter_shapes", "merge_adapter", "save_adapter", "load_adapter",
           "adapter_path", "FORMAT"]

TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
FORMAT = "sparda-lora-v1"
_WEIGHTS = Path(__file__).resolve().parent.parent / "weights"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the update is scaled by alpha / r, so that a change of rank keeps the
    update's size at the same learning rate), and the target projections: a tuple of distinct
    names out of TARGETS."""

    rank: int = 32
    alpha: float = 64.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        c = "LoraConfig"
        check_int(c, "rank", self.rank, lo=1)
        check_float(c, "alpha", self.alpha, lo=0, lo_open=True)
        check_instance(c, "targets", self.targets, tuple)
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"{c}.targets: must be distinct names out of {TARGETS}, at least one; got "
                              f"{self.targets!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _in_out(config: ModelConfig) -> dict[str, tuple[int, int]]:
    c = config
    return {"q_proj": (c.hidden_size, c.num_heads * c.head_dim),
            "k_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
            "v_proj": (c.hidden_size, c.num_kv_heads * c.head_dim),
            "o_proj": (c.num_heads * c.head_dim, c.hidden_size)}


def adapter_shapes(config: ModelConfig, lora: LoraConfig) -> dict[str, dict[str, tuple[int, int, int]]]:
    """{target: {"a": (L, in, r), "b": (L, r, out)}} for the config's layers."""
    io, n, r = _in_out(config), config.num_layers, lora.rank
    return {t: {"a": (n, io[t][0], r), "b": (n, r, io[t][1])} for t in lora.targets}


def merge_adapter(params: dict, adapter: dict, lora: LoraConfig) -> dict:
    """params with every target kernel replaced by W + lora.scale * A @ B (computed in float32,
    stored in W's dtype); every other leaf is params' own. Differentiable in adapter. params:
    the stacked tree (`model.init_params`' layout). Raises TypeError for layered params,
    ValueError for an adapter whose targets or shapes do not fit them."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        raise TypeError("merge_adapter takes the stacked parameter tree, not layered_params'")
    if set(adapter) != set(lora.targets):
        raise ValueError(f"the adapter holds {sorted(adapter)}, its LoraConfig names {sorted(lora.targets)}")
    new = dict(layers)
    for t in lora.targets:
        w, a, b = layers[t]["kernel"], adapter[t]["a"], adapter[t]["b"]
        n, fan_in = w.shape[0], int(np.prod(w.shape[1:1 + (2 if t == "o_proj" else 1)]))
        fan_out = int(np.prod(w.shape[1:])) // fan_in
        if a.shape != (n, fan_in, lora.rank) or b.shape != (n, lora.rank, fan_out):
            raise ValueError(f"adapter {t}: A {a.shape} and B {b.shape} do not fit the kernel {w.shape} at rank "
                             f"{lora.rank} (need {(n, fan_in, lora.rank)} and {(n, lora.rank, fan_out)})")
        delta = jnp.einsum("LIR,LRO->LIO", a.astype(jnp.float32), b.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST) * lora.scale
        new[t] = {**layers[t], "kernel": (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)}
    return {**params, "layers": new}


def save_adapter(path: str | Path, adapter: dict, config: ModelConfig, lora: LoraConfig, *,
                 metadata: dict | None = None, dtype: str = "bfloat16") -> Path:
    """Write the adapter (bf16 by default: 7.4 MB for SmolLM2-135M at rank 32) with the model's
    name, rank, alpha and targets in the file's metadata and `metadata` as JSON under "extra".
    Raises ValueError for tensors of other shapes than the config's at this rank."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    shapes = adapter_shapes(config, lora)
    if set(adapter) != set(shapes):
        raise ValueError(f"the adapter holds {sorted(adapter)}, its LoraConfig names {sorted(shapes)}")
    tensors = {}
    for t, parts in shapes.items():
        for part, shape in parts.items():
            arr = np.asarray(adapter[t][part], np.float32)
            if arr.shape != shape:
                raise ValueError(f"adapter {t}.{part} has shape {arr.shape}, {config.name} at rank {lora.rank} "
                                 f"needs {shape}")
            tensors[f"{t}.{part}"] = arr.astype(np_dtype)
    meta = {"format": FORMAT, "model": config.name, "rank": str(lora.rank), "alpha": repr(float(lora.alpha)),
            "targets": json.dumps(list(lora.targets)), "extra": json.dumps(metadata or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_adapter(path: str | Path, config: ModelConfig) -> tuple[dict, LoraConfig]:
    """Read an adapter file for `config`. Returns (float32 adapter tree, its LoraConfig).

    Raises FileNotFoundError for a missing file, and CheckpointError (a ValueError) naming the
    file for one that is not safetensors or not an adapter file, was trained on another model
    (its metadata's name is not config.name), holds other tensors or shapes than its rank and
    targets give, or (naming the tensor too) holds a NaN or inf.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"adapter file not found: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not an adapter file (format {meta.get('format')!r}, expected "
                                      f"{FORMAT!r})")
            arrays = {n: np.asarray(f.get_tensor(n), np.float32) for n in f.keys()}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' SafetensorError (a corrupt or foreign file), OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    if meta.get("model") != config.name:
        raise CheckpointError(f"{path}: an adapter for {meta.get('model')!r}, not for {config.name!r}")
    try:
        lora = LoraConfig(rank=int(meta["rank"]), alpha=float(meta["alpha"]), targets=tuple(json.loads(meta["targets"])))
    except (KeyError, ValueError, TypeError) as e:  # ConfigError is a ValueError
        raise CheckpointError(f"{path}: unreadable adapter metadata ({type(e).__name__}: {e})") from e
    shapes = adapter_shapes(config, lora)
    want = {f"{t}.{p}": s for t, parts in shapes.items() for p, s in parts.items()}
    if set(arrays) != set(want):
        raise CheckpointError(f"{path}: holds tensors {sorted(arrays)}; rank {lora.rank} adapters of "
                              f"{list(lora.targets)} are {sorted(want)}")
    for name, shape in want.items():
        if arrays[name].shape != shape:
            raise CheckpointError(f"{path}: {name} has shape {arrays[name].shape}, {config.name!r} at rank "
                                  f"{lora.rank} needs {shape}")
        bad = int(arrays[name].size - np.count_nonzero(np.isfinite(arrays[name])))
        if bad:
            raise CheckpointError(f"{path}: tensor {name} has {bad} non-finite values (NaN or inf)")
    adapter = {t: {p: jnp.asarray(arrays[f"{t}.{p}"]) for p in ("a", "b")} for t in lora.targets}
    return adapter, lora


def adapter_path(name: str) -> Path:
    """Where the package keeps the adapter of the preset `name` (the file may be absent)."""
    return _WEIGHTS / f"adapter-{name}.safetensors"
