"""The copy engine: move KV blocks between a pinned-host pool and device cache slots.

`gather_blocks(pool, src, dst, cache, implementation=...)`: cache[dst[t]] = pool[src[t]]. pool
and cache are one array each, or equal tuples of payloads (a layer's K, V and cis) moved by the
same task lists in one launch (the synchronous modes: one launch per layer instead of three).
  "cuda"  the XLA FFI custom call of kernels/copy/gather_blocks.cu: the GPU reads the host pool
          over UVA with a bounded persistent grid of `num_ctas` CTAs (built with nvcc against
          `jax.ffi.include_dir()` on first use, cached by source hash);
  "xla"   the reference with the same semantics, plain jnp (runs anywhere; on a GPU it brings
          the whole pool to the device first, so it is only a reference there);
  "host_ffi" the CPU twin of the "cuda" custom calls (kernels/copy/gather_blocks_host.cc, built
          with the host C++ compiler): the same targets, operands, aliasing and start/wait
          bookkeeping, with synchronous memcpy copies. It runs the engine's FFI path on the CPU,
          so CI sees what XLA does to those calls inside the engine's jit;
  None    "cuda" on a CUDA GPU, else "xla".

`gather_blocks_start` / `gather_blocks_wait`: the same gather split in two, so that it runs
beside the kernels XLA issues between them (the copy of layer l+1 during layer l's compute):
the start launches it on a high-priority side stream and returns, the wait makes XLA's stream
wait for it. `after` (an array computed by the work the copy should hide behind) pins the
wait's place in XLA's schedule. With "xla" the start is the whole gather and the wait returns
its input: the same numbers, no overlap.

`scatter_blocks(cache, src, dst, pool)`: the reverse, device slots written into the host pool
in place (a completed block's write-back).

Knobs of the CUDA kernel (attributes of every call): `num_ctas`, `threads` per CTA, and `group`
(> 1: a CTA moves that many blocks as one range, 16 loads per thread in flight). Measured on the
H200, neither more threads nor groups made a CTA faster (bench/results/copy_pipeline*.json).
`gather_blocks_dma_start` is an experiment: the start through the DMA engines
(cudaMemcpyBatchAsync); at 16 KB per block it moved 3 GB/s.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["gather_blocks", "gather_blocks_reference", "gather_blocks_start", "gather_blocks_wait", "scatter_blocks",
           "scatter_blocks_reference", "build_library", "build_host_library", "host_copies_in_flight",
           "reset_host_copies_in_flight", "FFI_IMPLEMENTATIONS", "nvcc_path", "paper_num_ctas", "autotune_num_ctas",
           "pick_num_ctas", "lane_ctas", "MAX_PAYLOADS", "gather_blocks_dma_start", "mark", "trace", "read_trace",
           "unaliased_copies", "doorbell_timeline", "resolve_implementation", "DOORBELL_MARKS", "COPY_THREADS",
           "COPY_GROUP", "doorbell_serve", "gather_blocks_ring", "gather_blocks_ring_wait", "memory_type", "MEMORY_TYPES"]

SOURCE = Path(__file__).resolve().parent / "copy" / "gather_blocks.cu"
HOST_SOURCE = SOURCE.with_name("gather_blocks_host.cc")
HOST_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
# XLA custom-call target -> symbol in the library
TARGETS = {"sparda_gather_blocks": "SpardaGatherBlocks", "sparda_gather_start": "SpardaGatherStart",
           "sparda_gather_wait": "SpardaGatherWait", "sparda_scatter_blocks": "SpardaScatterBlocks",
           "sparda_gather_dma_start": "SpardaGatherDmaStart", "sparda_mark": "SpardaMark",
           # the synchronous gather and the write-back, recordable into XLA's command buffers
           "sparda_gather_blocks_graph": "SpardaGatherBlocksGraph",
           "sparda_scatter_blocks_graph": "SpardaScatterBlocksGraph",
           # the doorbell copies: a persistent server, and rings and waits XLA may record into its graphs
           "sparda_doorbell_serve": "SpardaDoorbellServe", "sparda_doorbell_ring": "SpardaDoorbellRing",
           "sparda_doorbell_wait": "SpardaDoorbellWait"}
# Threads per copy CTA, each with 4 16-byte loads in flight (gather_blocks.cu's kUnroll): 256
# threads keep 16 KB of reads in flight per CTA, so 16 CTAs reach the bulk PCIe rate
# (bench/results/decode_overlap.json: 49 of 52 GB/s); more threads per CTA carry the same bytes
# in fewer CTAs (fewer SMs taken from the layer's kernels)
COPY_THREADS = 256
# Tasks (blocks) a CTA copies as one range, 16 loads per thread in flight when > 1 (1: the
# 4-deep kernel); measured in bench/results/copy_pipeline_group.json
COPY_GROUP = 1
NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_80,code=sm_80")


def paper_num_ctas(batch: int, gpu: str = "H100") -> int:
    """The paper's CTA quota: 16 below batch 32 (A100: 64), else 32."""
    return 16 if batch < (64 if gpu.upper().startswith("A100") else 32) else 32


CTA_CANDIDATES = (8, 16, 32, 64)


def pick_num_ctas(seconds: dict[int, float], tolerance: float = 0.03) -> int:
    """The fewest CTAs within `tolerance` of the fastest measured gather: every CTA the copy
    holds is an SM that attention and FFN lose, so a near-tie goes to fewer."""
    best = min(seconds.values())
    return min(c for c, t in seconds.items() if t <= best * (1 + tolerance))


@functools.cache
def autotune_num_ctas(n_tasks: int, block_shape: tuple[int, ...], dtype: str = "bfloat16",
                      candidates: tuple[int, ...] = CTA_CANDIDATES, repeats: int = 10) -> int:
    """Time the CUDA gather of `n_tasks` random blocks from a pinned-host pool (4x as many
    blocks) for each CTA count and return `pick_num_ctas` of the medians; cached per shape.
    GPU only, and outside jit (it runs the gather). On the H200 the best count moved with the
    size: 32 at 1 and 32 MiB, 64 at 8 MiB (bench/results/copy.json)."""
    import time

    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    n_pool = 4 * n_tasks
    pool = jax.device_put(rng.standard_normal((n_pool, *block_shape), dtype=np.float32).astype(dtype),
                          SingleDeviceSharding(dev, memory_kind="pinned_host"))
    src = jnp.asarray(rng.choice(n_pool, n_tasks, replace=False).astype(np.int32))
    dst = jnp.arange(n_tasks, dtype=jnp.int32)
    cache = jnp.zeros((n_tasks, *block_shape), dtype)
    seconds = {}
    for c in candidates:
        f = jax.jit(functools.partial(gather_blocks, num_ctas=c, implementation="cuda"))
        jax.block_until_ready(f(pool, src, dst, cache))  # compile outside the timing
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(pool, src, dst, cache))
            ts.append(time.perf_counter() - t0)
        seconds[c] = float(np.median(ts))
    return pick_num_ctas(seconds)


def nvcc_path() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _compile(compiler: str, flags, source: Path, name: str, cache_dir, force: bool) -> Path:
    """source -> a shared library in the cache, keyed by source, the headers beside it (the
    rules the CUDA and CPU handlers share), flags and the FFI headers' location."""
    include = jax.ffi.include_dir()
    local = b"".join(h.read_bytes() for h in sorted([*source.parent.glob("*.h"), *source.parent.glob("*.cuh")]))
    key = hashlib.sha256(source.read_bytes() + local + " ".join(flags).encode() + include.encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir or os.environ.get("SPARDA_CACHE", Path.home() / ".cache" / "sparda-jax"))
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
    """Compile gather_blocks.cu into a shared library (cached by source hash and flags)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set NVCC or CUDA_HOME); the CUDA copy engine needs it, "
                           "implementation='xla' does not")
    return _compile(nvcc, NVCC_FLAGS, SOURCE, "libsparda_gather", cache_dir, force)


def build_host_library(cache_dir: str | Path | None = None, *, force: bool = False) -> Path:
    """Compile gather_blocks_host.cc (the CPU twin) with the host C++ compiler, cached alike."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX); implementation='host_ffi' needs one")
    return _compile(cxx, HOST_FLAGS, HOST_SOURCE, "libsparda_gather_host", cache_dir, force)


@functools.cache
def _host_library() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(build_host_library()))
    lib.sparda_host_copies_in_flight.restype = ctypes.c_int64
    return lib


def host_copies_in_flight() -> int:
    """"host_ffi": starts not yet matched by their wait (0 between engine steps)."""
    return int(_host_library().sparda_host_copies_in_flight())


def reset_host_copies_in_flight() -> None:
    """"host_ffi": forget unmatched starts (after a test provoked one)."""
    _host_library().sparda_host_reset_in_flight()


@functools.cache
def _register(implementation: str) -> None:
    if implementation == "host_ffi":
        lib, platform, suffix = _host_library(), "cpu", "Host"
    else:
        lib, platform, suffix = _cuda_library(), "CUDA", ""
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol + suffix)), platform=platform)


def _doorbell_init(implementation: str) -> None:
    """The doorbell's device memory, made outside any XLA execution (no allocation may happen
    while XLA records a graph, and XLA may record the rings before the serve has run). Once per
    device; the CPU twin needs none."""
    if implementation == "cuda":
        from sparda_jax.runtime import MODULE_LOADING, lazy_module_loading

        if lazy_module_loading():
            warnings.warn(f"doorbell copies with CUDA's lazy kernel loading: a kernel first loaded while the step's "
                          f"server spins (a cuBLAS or XLA kernel on the first step) can deadlock until the "
                          f"doorbell's ~10 s watchdog stops the CUDA context. Export {MODULE_LOADING}=EAGER, or "
                          "call sparda_jax.runtime.set_eager_module_loading() before JAX first uses the GPU.",
                          stacklevel=3)
        err = _cuda_library().sparda_doorbell_init()
        if err != 0:
            raise RuntimeError(f"sparda_doorbell_init failed: cudaError_t {err}")


MAX_PAYLOADS = 4  # kMaxPayloads of copy_tasks.h


def _nd(a, block_ndim) -> int:
    """Block dims of `a`: the trailing `block_ndim` (None: all but the first)."""
    nd = a.ndim - 1 if block_ndim is None else block_ndim
    if not 1 <= nd < a.ndim:
        raise ValueError(f"block_ndim {block_ndim} leaves no block index dims in shape {a.shape}")
    return nd


def _n_blocks(a, block_ndim) -> int:
    return int(np.prod(a.shape[:a.ndim - _nd(a, block_ndim)]))


def _check(pool, src, dst, cache, block_ndim):
    bp, bc = pool.shape[pool.ndim - _nd(pool, block_ndim):], cache.shape[cache.ndim - _nd(cache, block_ndim):]
    if bp != bc:
        raise ValueError(f"pool blocks {bp} and cache slots {bc} differ")
    if pool.dtype != cache.dtype:
        raise TypeError(f"pool ({pool.dtype}) and cache ({cache.dtype}) dtypes differ")
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be equal 1-D index arrays, got {src.shape}, {dst.shape}")


def _as_tuple(x) -> tuple[tuple, bool]:
    """(payloads, one): a single array as a 1-tuple, with `one` set so the result can be one too."""
    return ((x,), True) if not isinstance(x, (tuple, list)) else (tuple(x), False)


def _payloads(pool, cache, src, dst, block_ndim=None):
    """(pools, caches, one): the payloads as equal tuples, checked; `one` when the caller passed
    single arrays (the result is then a single array too)."""
    pools, one = _as_tuple(pool)
    caches, one_cache = _as_tuple(cache)
    if one != one_cache:
        raise TypeError("pool and cache must both be arrays or both be tuples of payloads")
    if len(pools) != len(caches) or not 1 <= len(pools) <= MAX_PAYLOADS:
        raise ValueError(f"a copy takes 1..{MAX_PAYLOADS} payloads, as many pools as caches; got {len(pools)} pools "
                         f"and {len(caches)} caches")
    for p, c in zip(pools, caches):
        _check(p, src, dst, c, block_ndim)
    n_pool, n_cache = [_n_blocks(p, block_ndim) for p in pools], [_n_blocks(c, block_ndim) for c in caches]
    if len(set(n_pool)) > 1 or len(set(n_cache)) > 1:
        raise ValueError(f"the payloads of one copy must have the same number of blocks: pools {n_pool}, "
                         f"caches {n_cache}")
    return pools, caches, one


def _as_blocks(a, block_ndim):
    """a viewed as [blocks, *block] (the blocks in row-major order of the leading dims)."""
    nd = _nd(a, block_ndim)
    return a.reshape(-1, *a.shape[a.ndim - nd:])


def _gather_one(pool, src, dst, cache, block_ndim):
    p = jax.device_put(pool, jax.memory.Space.Device) if _on_host(pool) else pool
    p, c = _as_blocks(p, block_ndim), _as_blocks(cache, block_ndim)
    ok = (src >= 0) & (src < p.shape[0]) & (dst >= 0)
    rows = p[jnp.clip(src, 0, p.shape[0] - 1)]
    return c.at[jnp.where(ok, dst, c.shape[0])].set(rows, mode="drop").reshape(cache.shape)


def gather_blocks_reference(pool, src, dst, cache, *, block_ndim: int | None = None):
    """cache[dst[i]] = pool[src[i]] for every i with both indices in range (a task with a
    negative or too large index is skipped, as the kernels do; in order, later tasks win);
    payload by payload for tuples. Blocks are the trailing `block_ndim` dims (None: all but the
    first), numbered in row-major order of the dims before them."""
    pools, caches, one = _payloads(pool, cache, src, dst, block_ndim)
    out = tuple(_gather_one(p, src, dst, c, block_ndim) for p, c in zip(pools, caches))
    return out[0] if one else out


def _on_host(x) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


FFI_IMPLEMENTATIONS = ("cuda", "host_ffi")


def resolve_implementation(implementation: str | None) -> str:
    """The copy implementation a call with `implementation` runs: None is "cuda" on a GPU, "xla"
    elsewhere; refuses unknown names and the CPU twin off the CPU backend."""
    if implementation is None:
        implementation = "cuda" if jax.default_backend() == "gpu" else "xla"
    if implementation not in ("cuda", "host_ffi", "xla"):
        raise ValueError(f"unknown implementation {implementation!r}; expected 'cuda', 'host_ffi' or 'xla'")
    if implementation == "host_ffi" and jax.default_backend() != "cpu":
        raise ValueError("implementation='host_ffi' is the CPU twin of 'cuda'; it runs on the CPU backend only")
    return implementation


def _block_bytes(arrays, block_ndim=None) -> np.ndarray:
    return np.array([int(np.prod(a.shape[a.ndim - _nd(a, block_ndim):])) * jnp.dtype(a.dtype).itemsize
                     for a in arrays], np.int64)


def lane_ctas(num_ctas: int, caches, *, block_ndim: int | None = None) -> list[int]:
    """The CTA quota split over payloads copied side by side (one `gather_blocks_start` each, on
    lanes of their own), by their bytes per block: K and V half each, NOSA's 256-byte cis one
    CTA; at least one each."""
    sizes = _block_bytes(caches, block_ndim)
    return [max(1, round(num_ctas * int(b) / int(sizes.sum()))) for b in sizes]


def _like(arrays, memory=False):
    if memory:  # a host pool's result stays in its memory space
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, _memory_space=jax.typeof(a).memory_space) for a in arrays)
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def _copy_call(target: str, src, dst, froms, tos, *, host_result=False, **attrs):
    """One custom call (src, dst, *froms, *tos) -> tos, each `to` aliased to its result.

    No call is marked has_side_effect, the start and wait neither: a jit with an effect misses
    JAX's C++ dispatch path on every call, and the Python one cost ~3.5 ms of host time before a
    decode step's first launch on the H200 (bench/results/decode_profile.json: a SparDA step at
    batch 8 took 4.9 ms of host time, Sparse's 2.9). Data alone orders them and keeps them alive:
    the wait consumes the start's caches, the engine consumes the wait's (its last, task-free
    wait through an optimization barrier)."""
    n = len(tos)
    call = jax.ffi.ffi_call(target, _like(tos, host_result), input_output_aliases={2 + n + j: j for j in range(n)})
    return tuple(call(src.astype(jnp.int32), dst.astype(jnp.int32), *froms, *tos, **attrs))


def gather_blocks(pool, src, dst, cache, *, num_ctas: int = 16, threads: int = COPY_THREADS, group: int = COPY_GROUP,
                  block_ndim: int | None = None, implementation: str | None = None, in_graph: bool = False):
    """pool [n_pool, *block] (pinned host for "cuda"), src/dst int32 [n], cache [n_slots, *block]
    (device) -> the updated cache; or tuples of pools and caches (payloads, one launch) -> the
    tuple of caches. Blocks are whole trailing dims; their byte size must be a multiple of 16
    for "cuda". block_ndim: with it, pool and cache may be [..., *block] (the last block_ndim
    dims a block; blocks numbered in row-major order of the dims before them), passed to the
    custom call as they are: a reshape around an aliased custom call made XLA copy the whole
    cache before it and again after (copy insertion does not see through the bitcast).
    in_graph: the call's variant that XLA may record into its command buffers (CUDA graphs)
    instead of cutting its graph there; the same copy (not yet timed on the GPU)."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = _payloads(pool, cache, src, dst, block_ndim)
    _register(implementation)
    out = _copy_call("sparda_gather_blocks_graph" if in_graph else "sparda_gather_blocks", src, dst, pools, caches, num_ctas=np.int32(num_ctas),
                     block_bytes=_block_bytes(caches, block_ndim), threads=np.int32(threads), group=np.int32(group))
    return out[0] if one else out


def gather_blocks_start(pool, src, dst, cache, *, num_ctas: int = 16, resident: bool = True, lane: int = 0,
                        threads: int = COPY_THREADS, group: int = COPY_GROUP, block_ndim: int | None = None,
                        implementation: str | None = None):
    """Start `gather_blocks`; returns the cache (or tuple of caches) being written. Nothing may
    read it before `gather_blocks_wait(cache, src, dst, after)` with the same src and dst.
    resident: XLA's stream goes on only once every copy CTA holds its SM (else a persistent GEMM
    issued next can hold all SMs and the copy waits for it). lane (0..MAX_PAYLOADS-1): the side
    stream; copies on one lane run in order, on different lanes side by side. The engine starts
    each payload as its own copy on its own lane: a start of several payloads (one launch) lost
    its buffer between start and wait inside the engine's jit on the H200."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = _payloads(pool, cache, src, dst, block_ndim)
    _register(implementation)
    out = _copy_call("sparda_gather_start", src, dst, pools, caches,
                     num_ctas=np.int32(num_ctas), block_bytes=_block_bytes(caches, block_ndim), resident=np.int32(resident),
                     lane=np.int32(lane), threads=np.int32(threads), group=np.int32(group))
    return out[0] if one else out


def gather_blocks_dma_start(pool, src, dst, cache, *, lane: int = 0, block_ndim: int | None = None,
                            implementation: str | None = None):
    """EXPERIMENT, not used by the engine: `gather_blocks_start` through the DMA copy engines
    (cudaMemcpyBatchAsync, one copy per block and payload; no SM is used). Its task lists must be
    on the host first, so the start waits for XLA's stream to produce them (a host-side sync).
    Completed by `gather_blocks_wait`."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = _payloads(pool, cache, src, dst, block_ndim)
    _register(implementation)
    out = _copy_call("sparda_gather_dma_start", src, dst, pools, caches, num_ctas=np.int32(1),
                     block_bytes=_block_bytes(caches, block_ndim), lane=np.int32(lane))
    return out[0] if one else out


def mark(x, mark_id: int, *, implementation: str | None = None):
    """Diagnostics: x itself, with a point on XLA's stream after whatever produced x. With
    `trace(True)` on the GPU, "mark<id>" joins the timeline of the asynchronous starts' copies
    (`read_trace`); otherwise nothing is recorded. The reference is the identity."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return x
    _register(implementation)
    call = jax.ffi.ffi_call("sparda_mark", jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    return call(x, id=np.int32(mark_id))


@functools.cache
def _cuda_library() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(str(build_library()))
    lib.sparda_trace_read.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    lib.sparda_memory_type.argtypes, lib.sparda_memory_type.restype = [ctypes.c_void_p], ctypes.c_int
    return lib


MEMORY_TYPES = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}  # cudaMemoryType


def memory_type(x: jax.Array) -> str:
    """Where CUDA places the buffer of a single-device array on a CUDA GPU (cudaPointerGetAttributes):
    "host" (page-locked host memory, what the copy kernels read over UVA), "device", "managed" or
    "unregistered" (pageable host memory). An array's memory kind says where JAX asked for it;
    this says where it is."""
    if len(x.addressable_shards) != 1:
        raise ValueError(f"memory_type: a single-device array, got {len(x.addressable_shards)} shards")
    code = _cuda_library().sparda_memory_type(ctypes.c_void_p(x.addressable_data(0).unsafe_buffer_pointer()))
    if code < 0:
        raise RuntimeError("memory_type: cudaPointerGetAttributes failed for the array's buffer")
    return MEMORY_TYPES.get(code, f"unknown ({code})")


def trace(on: bool) -> None:
    """Diagnostics for the CUDA copy engine: record (True) or not (False, the default) a timing
    event where each asynchronous start's copy begins and ends on its lane ("copy<lane>+",
    "copy<lane>-") and at each `mark`. Starts the timeline afresh."""
    lib = _cuda_library()
    lib.sparda_trace_reset()
    lib.sparda_trace_enable(int(bool(on)))


def read_trace() -> list[tuple[str, float]]:
    """The recorded timeline, in recording order: (label, ms after the first event)."""
    lib = _cuda_library()
    out, buf, ms = [], ctypes.create_string_buffer(32), ctypes.c_float()
    for i in range(lib.sparda_trace_count()):
        if lib.sparda_trace_read(i, buf, 32, ctypes.byref(ms)) != 0:
            raise RuntimeError(f"trace entry {i} could not be read")
        out.append((buf.value.decode(), float(ms.value)))
    return out


DOORBELL_MARKS = ("ring", "copy_begin", "copy_end", "wait_begin", "wait_end")


def doorbell_timeline(n_jobs: int, implementation: str | None = None) -> dict[str, np.ndarray]:
    """Diagnostics: the last doorbell step's timeline, read after it finished. For each of its
    jobs 0..n_jobs-1, in us after the server began: where XLA's stream ran the ring ("ring") and
    reached the wait ("wait_begin") and left it ("wait_end"), and when the server took the job up
    ("copy_begin", as its CTA 0 saw it) and finished it ("copy_end", its last CTA). On the GPU
    these are %globaltimer readings (ticks of ~1 us unless a profiler refines them); the CPU
    twin's are its host clock (it copies inside the ring). A ring may precede the server (< 0).
    NaN for jobs beyond the last step's count and marks never written."""
    implementation = resolve_implementation(implementation)
    if implementation not in FFI_IMPLEMENTATIONS:
        raise ValueError(f"the doorbell timeline needs an FFI implementation {FFI_IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    lib, name = ((_host_library(), "sparda_doorbell_timelineHost") if implementation == "host_ffi"
                 else (_cuda_library(), "sparda_doorbell_timeline"))
    out = np.zeros((n_jobs, len(DOORBELL_MARKS)), np.float64)
    err = getattr(lib, name)(ctypes.c_int(n_jobs), out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)))
    if err != 0:
        raise RuntimeError(f"{name} failed ({err}: -1 is no doorbell step served yet, or n_jobs outside 1..256)")
    return {m: out[:, i] / 1e3 for i, m in enumerate(DOORBELL_MARKS)}


def unaliased_copies(implementation: str | None = None, *, reset: bool = False) -> tuple[int, int]:
    """Diagnostics: (calls, bytes) of the copy engine's handlers that XLA gave an output buffer
    apart from its aliased input, so that the handler first copied the whole cache or pool on
    XLA's stream, since the process started or the last reset. Expected (0, 0): every call
    updates its buffers in place. "xla" has no handlers: (0, 0)."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return 0, 0
    lib, suffix = (_host_library(), "Host") if implementation == "host_ffi" else (_cuda_library(), "")
    read = getattr(lib, "sparda_unaliased" + suffix)
    read.restype, read.argtypes = ctypes.c_int64, [ctypes.c_int]
    out = int(read(0)), int(read(1))
    if reset:
        getattr(lib, "sparda_reset_unaliased" + suffix)()
    return out


def gather_blocks_wait(cache, src, dst, after, *, implementation: str | None = None):
    """The cache (or tuple of caches) once the copy started into it is complete. src, dst: the
    start's (kept alive for the copy); after: any array the wait must follow in XLA's schedule."""
    return _wait_call("sparda_gather_wait", cache, src, dst, after, implementation)


def _wait_call(target: str, cache, src, dst, after, implementation, **attrs):
    """One wait custom call (src, dst, after, *caches) -> caches, each aliased to its result."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return cache
    _register(implementation)
    caches, one = _as_tuple(cache)
    n = len(caches)
    call = jax.ffi.ffi_call(target, _like(caches), input_output_aliases={3 + j: j for j in range(n)})
    out = tuple(call(src.astype(jnp.int32), dst.astype(jnp.int32), after, *caches, **attrs))
    return out[0] if one else out


def doorbell_serve(src, *, n_jobs: int, num_ctas: int = 16, threads: int = COPY_THREADS,
                   implementation: str | None = None):
    """Launch this step's doorbell server: `num_ctas` CTAs that copy the jobs `n_jobs` rings
    post (`gather_blocks_ring`, jobs 0..n_jobs-1, in order, each once), on a stream of their own,
    and stay resident until the last. Returns src (aliased), to feed the step's first ring: the
    server is then launched before any wait spins. A step that rings fewer jobs leaves the server
    waiting: the GPU's watchdog stops the context after ~10 s; the CPU twin
    raises at the next serve."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return src
    if not 1 <= n_jobs <= 256:
        raise ValueError(f"n_jobs must be in 1..256, got {n_jobs}")
    _register(implementation)
    _doorbell_init(implementation)
    call = jax.ffi.ffi_call("sparda_doorbell_serve", jax.ShapeDtypeStruct(src.shape, jnp.int32),
                            input_output_aliases={0: 0})
    return call(src.astype(jnp.int32), n_jobs=np.int32(n_jobs), num_ctas=np.int32(num_ctas), threads=np.int32(threads))


def gather_blocks_ring(pool, src, dst, cache, *, job: int, block_ndim: int | None = None,
                       implementation: str | None = None):
    """Post `gather_blocks`'s copy as job `job` of the served step; returns the cache (or tuple
    of caches) being written, which nothing may read before `gather_blocks_ring_wait`. A kernel
    of one thread on XLA's stream, which XLA may record into its CUDA graphs: unlike
    `gather_blocks_start`, it does not cut them."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = _payloads(pool, cache, src, dst, block_ndim)
    _register(implementation)
    out = _copy_call("sparda_doorbell_ring", src, dst, pools, caches, block_bytes=_block_bytes(caches, block_ndim),
                     job=np.int32(job))
    return out[0] if one else out


def gather_blocks_ring_wait(cache, src, dst, after, *, job: int, implementation: str | None = None):
    """`gather_blocks_wait` for a ring: XLA's stream waits (a one-thread kernel, recordable into
    its graphs) until job `job` is copied."""
    return _wait_call("sparda_doorbell_wait", cache, src, dst, after, implementation, job=np.int32(job))


def _scatter_one(cache, src, dst, pool, block_ndim):
    on_host = _on_host(pool)
    p = jax.device_put(pool, jax.memory.Space.Device) if on_host else pool
    p, c = _as_blocks(p, block_ndim), _as_blocks(cache, block_ndim)
    ok = (src >= 0) & (src < c.shape[0]) & (dst >= 0)
    rows = c[jnp.clip(src, 0, c.shape[0] - 1)].astype(p.dtype)
    p = p.at[jnp.where(ok, dst, p.shape[0])].set(rows, mode="drop").reshape(pool.shape)
    return jax.device_put(p, jax.memory.Space.Host) if on_host else p


def scatter_blocks_reference(cache, src, dst, pool, *, block_ndim: int | None = None):
    """pool[dst[i]] = cache[src[i]] for every i with both indices in range (later tasks win);
    payload by payload for tuples (blocks as in `gather_blocks_reference`)."""
    pools, caches, one = _payloads(pool, cache, dst, src, block_ndim)
    out = tuple(_scatter_one(c, src, dst, p, block_ndim) for c, p in zip(caches, pools))
    return out[0] if one else out


def scatter_blocks(cache, src, dst, pool, *, num_ctas: int = 16, threads: int = COPY_THREADS, group: int = COPY_GROUP,
                   block_ndim: int | None = None, implementation: str | None = None, in_graph: bool = False):
    """cache [n_slots, *block] (device), src/dst int32 [n], pool [n_pool, *block] (pinned host
    for "cuda") -> the pool with pool[dst[i]] = cache[src[i]]; or tuples (payloads, one launch)
    -> the tuple of pools. "cuda" writes only those blocks, over UVA, into the pool's own memory
    (it is aliased to the output); the reference moves the whole pool to the device and back.
    in_graph: as `gather_blocks`'."""
    implementation = resolve_implementation(implementation)
    if implementation == "xla":
        return scatter_blocks_reference(cache, src, dst, pool, block_ndim=block_ndim)
    pools, caches, one = _payloads(pool, cache, dst, src, block_ndim)
    _register(implementation)
    out = _copy_call("sparda_scatter_blocks_graph" if in_graph else "sparda_scatter_blocks", src, dst, caches, pools, host_result=True, num_ctas=np.int32(num_ctas),
                     block_bytes=_block_bytes(caches, block_ndim), threads=np.int32(threads), group=np.int32(group))
    return out[0] if one else out
