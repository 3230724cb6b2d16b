"""Will a generation's state fit this machine? Checked before any allocation.

`memory_report` (infer.engine) sizes the state from the config, batch and context; `feasibility`
sets it, with the weights, against the device allocator's limit and the host's physical memory.
On a backend without a device limit (the CPU), device and host state share the host's memory.
"""

from __future__ import annotations

import os

import jax

from sparda_jax.config import ModelConfig

from .engine import memory_report

__all__ = ["HOST_MARGIN", "DEVICE_MARGIN", "host_memory_bytes", "device_memory_limit", "feasibility",
           "check_fits", "InsufficientMemory"]

# Not all physical memory can be pinned (the OS, the process, XLA's host buffers): a state that
# needs more than this fraction of it is reported as not fitting.
HOST_MARGIN = 0.85
# Activations and work buffers beside the state and weights (fraction of the allocator limit).
DEVICE_MARGIN = 0.9


class InsufficientMemory(ValueError):
    """The state a call would allocate exceeds the device's or the host's memory."""


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_limit() -> int | None:
    """The device allocator's limit (what this process may use), None where unknown (CPU, and
    XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async, whose stats report a limit of 0)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends do not implement it
        return None
    return stats.get("bytes_limit") or None


def feasibility(full: ModelConfig, system: str, *, batch: int, context: int, weights: int, n_slots: int | None = None,
                dtype="bfloat16", host_bytes: int | None = None, device_bytes: int | None = None) -> dict:
    """Does the model's state for (system, batch, context), with `weights` bytes of weights, fit?
    Returns {"fits", "reason", the bytes needed and available, "memory_report"}."""
    rep = memory_report(full, batch=batch, context=context, system=system, n_slots=n_slots, dtype=dtype)
    host_bytes = host_memory_bytes() if host_bytes is None else host_bytes
    device_bytes = device_memory_limit() if device_bytes is None else device_bytes
    dev_need = rep["device total"] + weights
    # without a device limit the "device" is the host: both shares count against its memory
    host_need = rep["host total"] + (dev_need if device_bytes is None else 0)
    host_ok = host_need <= HOST_MARGIN * host_bytes
    dev_ok = device_bytes is None or dev_need <= DEVICE_MARGIN * device_bytes
    why = []
    if not host_ok:
        why.append(f"host needs {host_need / 1e9:.1f} GB > {HOST_MARGIN} x {host_bytes / 1e9:.1f} GB")
    if not dev_ok:
        why.append(f"device needs {dev_need / 1e9:.1f} GB (state + weights) > {DEVICE_MARGIN} x "
                   f"{device_bytes / 1e9:.1f} GB allocator limit")
    return {"fits": bool(host_ok and dev_ok), "reason": "; ".join(why) or None,
            "host_need_bytes": host_need, "device_need_bytes": dev_need, "weights_bytes": weights,
            "host_bytes": host_bytes, "device_limit_bytes": device_bytes, "memory_report": rep,
            "layers": full.num_layers}


def check_fits(config: ModelConfig, system: str, *, batch: int, context: int, weights: int, **kw) -> dict:
    """`feasibility`, raising InsufficientMemory (with the bytes) where the state does not fit."""
    f = feasibility(config, system, batch=batch, context=context, weights=weights, **kw)
    if not f["fits"]:
        raise InsufficientMemory(f"batch {batch} x {context} tokens in system {system!r} of {config.name} does not fit "
                                 f"this machine: {f['reason']}; use a smaller batch or context")
    return f
