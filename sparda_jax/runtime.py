"""Process-level settings the GPU runtime reads once, when CUDA starts.

CUDA's launch queues. A full-depth decode step of minicpm4.1-8b enqueues ~1400 kernels (32
layers of ~45), more than CUDA's default launch queues hold. Once a queue is full, each further
launch (kernel, or graph node) waits on the host for the device to drain it, so the host can
no longer run ahead of the device (docs/decisions.md, "CUDA's launch queues at 4x").
CUDA reads the variable when it initialises, so it has to be set before JAX first touches the
GPU: `set_launch_queues` sets it, and refuses once JAX already runs on a GPU.

The compilation cache. `enable_compilation_cache` keeps XLA's compiled programs on disk, so a
second process (a second `sparda generate`, a test worker) loads what an earlier one compiled.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

__all__ = ["LAUNCH_QUEUES", "LAUNCH_QUEUE_SCALES", "CACHE_DIR_VARIABLE", "default_cache_dir", "write_result",
           "enable_compilation_cache", "writable_dir", "set_launch_queues", "warn_if_default_launch_queues"]

CACHE_DIR_VARIABLE = "SPARDA_JAX_CACHE_DIR"

LAUNCH_QUEUES = "CUDA_SCALE_LAUNCH_QUEUES"
# the multipliers CUDA accepts for the variable
LAUNCH_QUEUE_SCALES = ("0.25x", "0.5x", "2x", "4x")
_warned = False


def _cuda_driver_started() -> bool:
    """Whether anything in this process (JAX, a CUDA library loaded by ctypes, ...) has
    initialised the CUDA driver: then it has read its environment. Loading libcuda does not
    initialise it; cuCtxGetCurrent answers CUDA_SUCCESS only after a successful cuInit
    (CUDA_ERROR_NOT_INITIALIZED before; a stub driver or a machine without a GPU, other errors)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver: nothing reads the variable
        return False
    ctx = ctypes.c_void_p()
    return lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0


def _gpu_started() -> bool:
    from jax._src import xla_bridge  # no public query; this one has existed since jax 0.4

    if xla_bridge.backends_are_initialized():
        import jax

        if any(d.platform == "gpu" for d in jax.devices()):
            return True
    return _cuda_driver_started()


def set_launch_queues(scale: str = "4x", *, override: bool = False) -> str:
    """Set CUDA's launch-queue multiplier for this process (before JAX's first GPU use).

    A value already in the environment wins unless `override`. Returns the value in effect.
    Raises RuntimeError when JAX already runs on a GPU and the value would change: CUDA has
    read the variable by then, so setting it would silently do nothing. (Without a GPU the
    variable is set and does nothing.)"""
    if scale not in LAUNCH_QUEUE_SCALES:
        raise ValueError(f"launch-queue scale must be one of {LAUNCH_QUEUE_SCALES}, got {scale!r}")
    return _set_before_cuda(LAUNCH_QUEUES, scale, override=override, setter="set_launch_queues")


def _set_before_cuda(name: str, value: str, *, override: bool = False, setter: str) -> str:
    """Set a variable CUDA reads once, when it starts: a value already in the environment wins
    unless `override`; refused (RuntimeError) once JAX runs on a GPU and the value would change,
    since CUDA would silently ignore it."""
    current = os.environ.get(name)
    if current is not None and not override:
        return current
    if current != value and _gpu_started():
        raise RuntimeError(f"{name} must be set before JAX first uses the GPU (CUDA reads it when it "
                           f"starts): call {setter}() first, or export {name}={value}")
    os.environ[name] = value
    return value


def warn_if_default_launch_queues(n_layers: int) -> None:
    """Once per process: a deep offload decode on the GPU with CUDA's default launch queues."""
    global _warned  # a once-per-process warning flag, not state any result depends on
    if _warned or LAUNCH_QUEUES in os.environ or n_layers < 16:
        return
    _warned = True
    warnings.warn(f"{n_layers}-layer offload decode with CUDA's default launch queues: the host blocks once they "
                  f"fill (~1400 launches a step at 32 layers). Export {LAUNCH_QUEUES}=4x, or call "
                  "sparda_jax.runtime.set_launch_queues() before JAX first uses the GPU.", stacklevel=3)


def default_cache_dir() -> Path:
    """$SPARDA_JAX_CACHE_DIR, else $XDG_CACHE_HOME/sparda-jax (default ~/.cache/sparda-jax)."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return Path(os.environ[CACHE_DIR_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparda-jax"


def writable_dir(directory: str | os.PathLike, what: str) -> Path:
    """`directory`, created if need be and checked writable; OSError naming it (as `what`'s
    directory) otherwise."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OSError(f"the {what} directory {d} is not writable: {e}") from e
    return d


def enable_compilation_cache(directory: str | os.PathLike | None = None, *, min_compile_s: float = 0.0) -> Path:
    """Keep compiled programs under `directory`/xla (None: `default_cache_dir()`) for later
    processes; programs that took less than `min_compile_s` to compile are not stored. Returns
    the directory. Raises OSError naming it when it cannot be created or written."""
    import jax

    d = writable_dir(directory if directory is not None else default_cache_dir() / "xla", "compilation cache")
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d


def write_result(path, text: str) -> Path:
    """Write a finished run's result to `path`; if that fails (checked writable at the start,
    but a disk can fill or a folder vanish), to a file of the same name and a time stamp in the
    working directory, else in the temporary directory, with a warning: never lost."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p
    except OSError as e:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for folder in (Path.cwd(), Path(tempfile.gettempdir())):
            alt = folder / f"{p.stem}-{stamp}{p.suffix}"
            try:
                alt.write_text(text)
            except OSError:
                continue
            print(f"sparda: warning: could not write {p} ({e.strerror or e}); wrote {alt} instead", file=sys.stderr)
            return alt
        raise
