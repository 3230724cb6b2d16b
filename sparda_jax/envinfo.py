"""Provenance for result files: where and from which commit a number came."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import jax

__all__ = ["environment"]

# variables that change what a timed run measures (XLA's command buffers, the CUDA launch queues and kernel loading,
# the compilation cache): recorded with each result so that two JSONs say how they differ
_RUN_VARIABLES = ("XLA_FLAGS", "CUDA_SCALE_LAUNCH_QUEUES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
                  "JAX_COMPILATION_CACHE_DIR", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    dev = jax.devices()[0]
    # The GPU machine gets a copy of the working tree whose .git (if any) is not this one's:
    # scripts/device_setup.sh exports SPARDA_COMMIT from a .commit file written before the call,
    # and it wins over whatever git says there.
    pinned = os.environ.get("SPARDA_COMMIT")
    status = None if pinned else _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": pinned or _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "variables": {k: os.environ[k] for k in _RUN_VARIABLES if k in os.environ},
    }
