"""The FFI backends of the KV copy: "cuda" (csrc/gather_blocks.cu) and its CPU twin "host_ffi"
(csrc/gather_blocks_host.cc), built on first use and cached by source hash, registered as XLA
custom calls, and the calls themselves.

"cuda": the GPU reads a pinned-host pool over UVA with a bounded persistent grid of
`KVCopyConfig.num_ctas` CTAs (built with nvcc against `jax.ffi.include_dir()`). "host_ffi": the
same targets, operands, aliasing and start/wait bookkeeping with synchronous memcpy copies
(built with the host C++ compiler), so the FFI path and what XLA does to it run on a CPU.

No call is marked has_side_effect: a jit with an effect misses JAX's C++ dispatch path on every
call. Data alone orders them: the wait consumes the start's cache, and the caller the wait's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.config import ConfigError, check_int

from .reference import block_bytes

__all__ = ["KVCopyConfig", "FFI_IMPLEMENTATIONS", "TARGETS", "nvcc_path", "build_library", "build_in_background", "build_host_library", "library_cache_dir",
           "on_cuda", "memory_type", "MEMORY_TYPES", "unaliased", "host_copies_in_flight",
           "reset_host_copies_in_flight"]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "gather_blocks.cu"
HOST_SOURCE = CSRC / "gather_blocks_host.cc"
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_80,code=sm_80")
HOST_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
# XLA custom-call target -> symbol in the library (the CPU twin's carry the suffix "Host")
TARGETS = {"sparda_gather_blocks": "SpardaGatherBlocks", "sparda_scatter_blocks": "SpardaScatterBlocks",
           "sparda_gather_start": "SpardaGatherStart", "sparda_gather_wait": "SpardaGatherWait"}
FFI_IMPLEMENTATIONS = ("cuda", "host_ffi")


@dataclasses.dataclass(frozen=True)
class KVCopyConfig:
    """The CUDA copy kernel's tuning (the CPU twin checks the same rules and ignores the values).

    num_ctas: CTAs of the copy's persistent grid (its share of the SMs), 1..1024.
    threads: threads per CTA, each with four 16-byte loads in flight: a multiple of 32 in
      32..1024 (256 keep 16 KB of reads in flight per CTA).
    """

    num_ctas: int = 16
    threads: int = 256

    def __post_init__(self):
        check_int("KVCopyConfig", "num_ctas", self.num_ctas, lo=1, hi=1024)
        check_int("KVCopyConfig", "threads", self.threads, lo=32, hi=1024)
        if self.threads % 32:
            raise ConfigError(f"KVCopyConfig.threads: must be a multiple of 32 in 32..1024, got {self.threads}")


def on_cuda(dev=None) -> bool:
    """`dev` (None: the default device) is a CUDA GPU."""
    dev = jax.devices()[0] if dev is None else dev
    return dev.platform == "gpu" and "cuda" in getattr(dev.client, "platform_version", "").lower()


def nvcc_path() -> str | None:
    """nvcc from $NVCC, PATH or $CUDA_HOME/bin (default /usr/local/cuda), or None."""
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def library_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the built libraries are kept: cache_dir, else the package's cache folder
    (`sparda_jax.runtime.default_cache_dir`: $SPARDA_JAX_CACHE_DIR or ~/.cache/sparda-jax)."""
    from sparda_jax.runtime import default_cache_dir

    return Path(cache_dir) if cache_dir else default_cache_dir()


_BUILD_LOCK = threading.Lock()  # one build at a time: a second caller waits, then finds the file


def _compile(compiler: str, flags, source: Path, name: str, cache_dir, force: bool) -> Path:
    """source -> a shared library in the cache, keyed by source, the headers beside it, flags and
    the FFI headers' location."""
    with _BUILD_LOCK:
        return _compile_locked(compiler, flags, source, name, cache_dir, force)


def _compile_locked(compiler: str, flags, source: Path, name: str, cache_dir, force: bool) -> Path:
    include = jax.ffi.include_dir()
    local = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + local + " ".join(flags).encode() + include.encode()).hexdigest()[:16]
    cache_dir = library_cache_dir(cache_dir)
    out = cache_dir / f"{name}_{key}.so"
    if out.is_file() and not force:
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [compiler, *flags, "-I", include, "-o", str(tmp), str(source)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{Path(compiler).name} failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
    tmp.replace(out)  # atomic: concurrent builders never see a partial file
    return out


def build_library(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Compile csrc/gather_blocks.cu (sm_90 and sm_80) into a shared library; the cached path.
    Raises RuntimeError without nvcc or when it fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or CUDA_HOME); the CUDA KV copy needs it, "
                           "implementation='xla' does not")
    return _compile(nvcc, NVCC_FLAGS, SOURCE, "libsparda_gather", cache_dir, force)


_BACKGROUND: list[threading.Thread] = []  # the one background build this process started


def build_in_background(device=None) -> threading.Thread | None:
    """On a CUDA `device` (None: the default one), start `build_library` on a daemon thread, once
    a process, so that a cold first run's nvcc (seconds) overlaps the model's load and the first
    compiles; the first use of the library waits for it (the build lock). None, and nothing
    started, off CUDA, without nvcc or when started before. A failed build is left for the first
    use to raise."""
    if _BACKGROUND or not on_cuda(device) or nvcc_path() is None:
        return None

    def build():
        try:
            build_library()
        except Exception:  # noqa: BLE001 - raised again, with its cause, where the library is needed
            pass

    t = threading.Thread(target=build, name="sparda-copy-library-build", daemon=True)
    _BACKGROUND.append(t)
    t.start()
    return t


def build_host_library(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Compile csrc/gather_blocks_host.cc (the CPU twin) with $CXX, c++ or g++; the cached path."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX); implementation='host_ffi' needs one")
    return _compile(cxx, HOST_FLAGS, HOST_SOURCE, "libsparda_gather_host", cache_dir, force)


@functools.cache
def _cuda_library() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(build_library()))
    lib.sparda_memory_type.argtypes, lib.sparda_memory_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.sparda_unaliased.argtypes, lib.sparda_unaliased.restype = [ctypes.c_int], ctypes.c_int64
    return lib


@functools.cache
def _host_library() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(build_host_library()))
    lib.sparda_host_copies_in_flight.restype = ctypes.c_int64
    lib.sparda_unaliasedHost.argtypes, lib.sparda_unaliasedHost.restype = [ctypes.c_int], ctypes.c_int64
    return lib


@functools.cache
def register(implementation: str) -> None:
    """Register the custom-call targets of "cuda" (platform CUDA) or "host_ffi" (cpu), once."""
    if implementation == "host_ffi":
        lib, platform, suffix = _host_library(), "cpu", "Host"
    else:
        lib, platform, suffix = _cuda_library(), "CUDA", ""
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol + suffix)), platform=platform)


def _like(arrays, memory=False):
    if memory:  # a host pool's result stays in its memory space
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, _memory_space=jax.typeof(a).memory_space) for a in arrays)
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def _check_vectors(arrays, block_ndim):
    sizes = block_bytes(arrays, block_ndim)
    if (sizes % 16).any():
        raise ValueError(f"the FFI copies move 16-byte vectors: block bytes {sizes.tolist()} must be multiples of 16")
    return sizes


def copy_call(target: str, src, dst, froms, tos, *, config: KVCopyConfig, block_ndim, host_result=False, **attrs):
    """One copy custom call (src, dst, *froms, *tos) -> tos, each `to` aliased to its result.
    `register` must have run for the implementation."""
    n = len(tos)
    sizes = _check_vectors(tos, block_ndim)
    call = jax.ffi.ffi_call(target, _like(tos, host_result), input_output_aliases={2 + n + j: j for j in range(n)})
    return tuple(call(src.astype(jnp.int32), dst.astype(jnp.int32), *froms, *tos, num_ctas=np.int32(config.num_ctas),
                      block_bytes=sizes, threads=np.int32(config.threads), **attrs))


def wait_call(caches, src, dst, after):
    """The wait custom call (src, dst, *afters, *caches) -> caches, each aliased. after: an array
    or a pytree of them (>= 1), operands that order the wait and are never read: no kernel joins
    them."""
    afters = jax.tree.leaves(after)
    if not afters:
        raise ValueError("a wait needs at least one `after` array")
    n = len(afters)
    call = jax.ffi.ffi_call("sparda_gather_wait", _like(caches),
                            input_output_aliases={2 + n + j: j for j in range(len(caches))})
    return tuple(call(src.astype(jnp.int32), dst.astype(jnp.int32), *afters, *caches))


MEMORY_TYPES = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}  # cudaMemoryType


def memory_type(x: jax.Array) -> str:
    """Where CUDA places the buffer of a single-device array on a CUDA GPU
    (cudaPointerGetAttributes): "host" (page-locked host memory, what the copy kernels read over
    UVA), "device", "managed" or "unregistered" (pageable host memory). An array's memory kind
    says where JAX asked for it; this says where it is. Builds the CUDA library; raises
    ValueError for a sharded array, RuntimeError if the query fails."""
    if len(x.addressable_shards) != 1:
        raise ValueError(f"memory_type: a single-device array, got {len(x.addressable_shards)} shards")
    code = _cuda_library().sparda_memory_type(ctypes.c_void_p(x.addressable_data(0).unsafe_buffer_pointer()))
    if code < 0:
        raise RuntimeError("memory_type: cudaPointerGetAttributes failed for the array's buffer")
    return MEMORY_TYPES.get(code, f"unknown ({code})")


def unaliased(implementation: str, *, reset: bool = False) -> tuple[int, int]:
    """(calls, bytes) of the "cuda" or "host_ffi" handlers that copied an unaliased output first
    (`kv_copy.unaliased_copies`)."""
    lib, suffix = (_host_library(), "Host") if implementation == "host_ffi" else (_cuda_library(), "")
    out = int(getattr(lib, "sparda_unaliased" + suffix)(0)), int(getattr(lib, "sparda_unaliased" + suffix)(1))
    if reset:
        getattr(lib, "sparda_reset_unaliased" + suffix)()
    return out


def host_copies_in_flight() -> int:
    """"host_ffi": starts not yet matched by their wait (0 between engine steps)."""
    return int(_host_library().sparda_host_copies_in_flight())


def reset_host_copies_in_flight() -> None:
    """"host_ffi": forget unmatched starts (after a test provoked one)."""
    _host_library().sparda_host_reset_in_flight()
