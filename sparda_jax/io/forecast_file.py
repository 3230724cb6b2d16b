"""Forecast weights as a small safetensors file, and the trained Forecasts shipped in the package."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ..config import ModelConfig
from .convert import CheckpointError

__all__ = ["save_forecast", "load_forecast", "forecast_file_source", "shipped_forecast_path", "default_forecast"]

_WEIGHTS = Path(__file__).resolve().parent.parent / "weights"


def _shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"f0_cur": (c.hidden_size, c.num_kv_heads, c.head_dim),
            "f": (c.num_layers - 1, c.hidden_size, c.num_kv_heads, c.head_dim)}


def save_forecast(path: str | Path, forecast: dict, config: ModelConfig, *, metadata: dict | None = None,
                  dtype: str = "bfloat16") -> Path:
    """Write {"f0_cur", "f"} kernels (bf16 by default: 6.6 MB for SmolLM2-135M)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {"f0_cur": np.asarray(forecast["f0_cur"]["kernel"], np.float32).astype(np_dtype),
               "f": np.asarray(forecast["f"]["kernel"], np.float32).astype(np_dtype)}
    for name, shape in _shapes(config).items():
        if tensors[name].shape != shape:
            raise ValueError(f"Forecast {name} has shape {tensors[name].shape}, {config.name} needs {shape}")
    meta = {"model": config.name, "format": "sparda-forecast-v1", "source": config.forecast.source,
            "extra": json.dumps(metadata or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def load_forecast(path: str | Path, config: ModelConfig) -> dict:
    """Read a Forecast file and check it against the config. Returns float32 params.

    Raises FileNotFoundError for a missing file, and CheckpointError (a ValueError) naming the
    file for one that is not safetensors, holds other tensors or shapes, (naming the tensor
    too) holds a NaN or inf: such a Forecast would select blocks at random, or was trained on
    another input state than `config.forecast.source` (`forecast_file_source` reads it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Forecast file not found: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if names != {"f0_cur", "f"}:
                raise CheckpointError(f"{path}: not a Forecast file (tensors {sorted(names)})")
            arrays = {n: np.asarray(f.get_tensor(n), np.float32) for n in names}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' SafetensorError (a corrupt or foreign file), OSError
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    for name, shape in _shapes(config).items():
        if tuple(arrays[name].shape) != shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(arrays[name].shape)}, model "
                                  f"{config.name!r} needs {shape} (trained for {meta.get('model', '?')!r})")
        bad = int(np.size(arrays[name]) - np.count_nonzero(np.isfinite(arrays[name])))
        if bad:
            raise CheckpointError(f"{path}: tensor {name} has {bad} non-finite values (NaN or inf)")
    source = meta.get("source", "prev_input")  # files before the field: SparDA's input
    if source != config.forecast.source:
        raise CheckpointError(f"{path}: this Forecast reads {source!r}, the config's forecast.source is "
                              f"{config.forecast.source!r}; set it to the file's (forecast_file_source)")
    out = {n: jnp.asarray(a) for n, a in arrays.items()}
    return {"f0_cur": {"kernel": out["f0_cur"]}, "f": {"kernel": out["f"]}}


def forecast_file_source(path: str | Path) -> str:
    """The input state a Forecast file was trained on (`ForecastConfig.source`); "prev_input"
    for files written before it was recorded. Unreadable files: CheckpointError, as load_forecast."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Forecast file not found: {path}")
    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("source", "prev_input")
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def shipped_forecast_path(config: ModelConfig) -> Path | None:
    p = _WEIGHTS / f"forecast-{config.name}.safetensors"
    return p if p.is_file() else None


def default_forecast(config: ModelConfig, key=None) -> tuple[dict, bool]:
    """The trained Forecast shipped for this model if there is one, else a random (untrained)
    one. Returns (params, trained)."""
    path = shipped_forecast_path(config)
    if path is not None:
        return load_forecast(path, config), True
    import jax

    from ..forecast import init_forecast

    return init_forecast(config, jax.random.key(0) if key is None else key), False
