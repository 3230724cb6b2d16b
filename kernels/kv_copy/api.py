"""The KV copy: move KV blocks between a host pool and device cache slots, with one
`implementation=` argument per call.

Backends:
  "cuda"     the XLA FFI calls of csrc/gather_blocks.cu: the GPU reads the pinned-host pool over
             UVA with a bounded persistent grid of `KVCopyConfig.num_ctas` CTAs (CUDA GPU only);
  "host_ffi" their CPU twin (csrc/gather_blocks_host.cc): the same targets, operands, aliasing
             and start/wait bookkeeping with memcpy copies (CPU backend only; not in the
             default order, it exists to run the FFI path in CI);
  "xla"      `reference.py` (any platform; on a GPU it brings the whole pool to the device, so
             it is only a reference there).
None takes the first of DEFAULT_ORDER this platform runs ("cuda" on a CUDA GPU, else "xla"); a
named backend that cannot run here raises NotImplementedError.

The asynchronous gather is split in two so that it runs beside the kernels XLA issues between
them: `gather_blocks_start` launches one payload's copy on a high-priority side stream (its
`lane`) and returns, `gather_blocks_wait` makes XLA's stream wait for it. XLA schedules by data
alone, so `after_start` ties the start before the work it should hide behind and yields the
token the wait must take as `after`.
"""

from __future__ import annotations

import functools
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from . import cuda
from .cuda import FFI_IMPLEMENTATIONS, KVCopyConfig
from .reference import block_bytes, check_payloads, gather_blocks_reference, scatter_blocks_reference

__all__ = ["gather_blocks", "gather_blocks_start", "gather_blocks_wait", "scatter_blocks", "after_start",
           "join_tokens", "host_pool", "resolve_implementation", "unaliased_copies", "lane_ctas", "paper_num_ctas",
           "pick_num_ctas", "autotune_num_ctas", "IMPLEMENTATIONS", "DEFAULT_ORDER", "CTA_CANDIDATES"]

IMPLEMENTATIONS = ("xla", "host_ffi", "cuda")
DEFAULT_ORDER = ("cuda", "xla")


def _supported(name: str) -> None:
    """Raise NotImplementedError when backend `name` cannot run on this platform."""
    if name == "cuda" and not cuda.on_cuda():
        raise NotImplementedError("implementation='cuda' needs a CUDA GPU as the default device")
    if name == "host_ffi" and jax.default_backend() != "cpu":
        raise NotImplementedError("implementation='host_ffi' is the CPU twin of 'cuda'; it runs on the CPU backend only")


def resolve_implementation(implementation: str | None) -> str:
    """The backend a call with `implementation` runs: a valid name that this platform runs, or
    None -> the first of DEFAULT_ORDER that it runs. Raises ValueError for an unknown name,
    NotImplementedError for a backend this platform cannot run."""
    if implementation is None:
        for name in DEFAULT_ORDER:
            try:
                _supported(name)
                return name
            except NotImplementedError:
                continue
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown kv_copy implementation {implementation!r}; one of {IMPLEMENTATIONS}")
    _supported(implementation)
    return implementation


def gather_blocks(pool, src, dst, cache, *, block_ndim: int | None = None, config: KVCopyConfig | None = None,
                  implementation: str | None = None):
    """cache[dst[i]] = pool[src[i]] for every task i in range, in XLA's stream order -> the
    updated cache; or tuples of 1..4 pools and caches (payloads moved by the same tasks, one
    launch) -> the tuple of caches.

    pool [n_pool, *block] (pinned host for "cuda"), src/dst int32 [n], cache [n_slots, *block]
    (device), same dtype. block_ndim: the trailing dims that make a block (None: all but the
    first); pools and caches then pass unreshaped (a reshape around an aliased custom call
    makes XLA copy the whole buffer). The FFI backends need block bytes that are multiples of
    16 (ValueError otherwise). config: the CUDA kernel's tuning (None: defaults). Recordable
    into XLA's CUDA graphs."""
    impl = resolve_implementation(implementation)
    if impl == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = check_payloads(pool, cache, src, dst, block_ndim)
    cuda.register(impl)
    out = cuda.copy_call("sparda_gather_blocks", src, dst, pools, caches, config=config or KVCopyConfig(),
                         block_ndim=block_ndim)
    return out[0] if one else out


def scatter_blocks(cache, src, dst, pool, *, block_ndim: int | None = None, config: KVCopyConfig | None = None,
                   implementation: str | None = None):
    """pool[dst[i]] = cache[src[i]] for every task i in range -> the updated pool (or tuple of
    pools, as in `gather_blocks`), in the pool's memory kind. cache [n_slots, *block] (device),
    src indexes its slots, dst the pool's blocks. "cuda" writes only those blocks, over UVA,
    into the pool's own memory (aliased to the output; donate the pool); the reference moves
    the whole pool to the device and back. Recordable into XLA's CUDA graphs."""
    impl = resolve_implementation(implementation)
    if impl == "xla":
        return scatter_blocks_reference(cache, src, dst, pool, block_ndim=block_ndim)
    pools, caches, one = check_payloads(pool, cache, dst, src, block_ndim)
    cuda.register(impl)
    out = cuda.copy_call("sparda_scatter_blocks", src, dst, caches, pools, config=config or KVCopyConfig(),
                         block_ndim=block_ndim, host_result=True)
    return out[0] if one else out


def gather_blocks_start(pool, src, dst, cache, *, lane: int = 0, block_ndim: int | None = None,
                        config: KVCopyConfig | None = None, implementation: str | None = None):
    """Start `gather_blocks` (one pool and cache, or tuples of 1..4 payloads moved by one launch)
    on side-stream lane `lane` (0..3; copies on one lane run in order, on different lanes side
    by side) -> the cache (or tuple of caches) being written, which nothing may read before
    `gather_blocks_wait(cache, src, dst, after)` with the same caches, src and dst. XLA's stream
    goes on once every copy CTA holds its SM. "xla": the whole gather (its wait returns it as
    it is)."""
    impl = resolve_implementation(implementation)
    if not 0 <= lane < 4:
        raise ValueError(f"lane must be in 0..3, got {lane}")
    if impl == "xla":
        return gather_blocks_reference(pool, src, dst, cache, block_ndim=block_ndim)
    pools, caches, one = check_payloads(pool, cache, src, dst, block_ndim)
    cuda.register(impl)
    out = cuda.copy_call("sparda_gather_start", src, dst, pools, caches, config=config or KVCopyConfig(),
                         block_ndim=block_ndim, lane=np.int32(lane))
    return out[0] if one else out


def gather_blocks_wait(cache, src, dst, after, *, implementation: str | None = None):
    """The cache (or tuple of caches) a `gather_blocks_start` writes, once its copy is complete:
    every cache of a multi-payload start in one wait. src, dst: the start's (kept alive while the
    copy reads them); after: any array, or pytree of arrays, the wait must follow in XLA's
    schedule (`after_start`'s token, and more): operands of the wait, never read or joined."""
    impl = resolve_implementation(implementation)
    if impl == "xla":
        return cache
    cuda.register(impl)
    one = not isinstance(cache, (tuple, list))
    out = cuda.wait_call((cache,) if one else tuple(cache), src, dst, after)
    return out[0] if one else out


def after_start(started, x):
    """(x, token): x ordered after the copy starts that returned `started` (an array or a
    sequence or dict of them), and a token (a tuple of small arrays) that the starts' waits must
    take as `after` (with any more arrays to follow, as a tuple).

    The barrier holds a one-element slice of each started cache, never the cache: a cache
    passed through a barrier is copied by XLA ahead of its in-place wait, and that copy would
    read it while the side stream writes it. The token is those slices out of the barrier: XLA
    drops a barrier's unused outputs, and with them the order they gave."""
    caches = list(started.values()) if isinstance(started, dict) else (
        list(started) if isinstance(started, (tuple, list)) else [started])
    marks = [jax.lax.slice(c, (0,) * c.ndim, (1,) * c.ndim) for c in caches]  # no reshape (block_ndim)
    marks, x = jax.lax.optimization_barrier((marks, x))
    return x, tuple(marks)


def join_tokens(*tokens) -> jax.Array:
    """One small f32 array of every element of the (small) tokens given (arrays or pytrees of
    them; None skipped). A wait takes a pytree of its `after` arrays without this kernel; this is
    for an order that must be one array. Whole tokens, never a slice of one: XLA folds a slice of
    a concatenation to the operands it keeps."""
    return jnp.concatenate([t.reshape(-1).astype(jnp.float32) for t in jax.tree.leaves(tokens)])


def host_pool(x, device=None) -> jax.Array:
    """x placed as a host pool for the copies: in `device`'s (None: the default device's)
    pinned_host memory kind where the backend has one, else its default memory. On a CUDA GPU
    the buffer is checked to be page-locked host memory (`memory_type`): XLA's VMM allocator
    (forced by its command-buffer update modes other than ALWAYS_UPDATE) can place pinned_host
    arrays in device memory, and the copy would then be no offload. Raises RuntimeError if so;
    without nvcc the check is skipped with a warning. The allocator is the process's, so a device
    whose pool was found in host memory is not asked again: asking waits for the buffer, and so
    for the move, which would hold up a caller that does not need the pool yet."""
    dev = jax.devices()[0] if device is None else device
    kinds = {m.kind for m in dev.addressable_memories()}
    sharding = SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else None)
    out = jax.device_put(x, sharding)
    if out.size == 0 or sharding.memory_kind != "pinned_host" or not cuda.on_cuda(dev) or dev in _PINNED_CHECKED:
        return out  # an empty buffer may have no address; off CUDA there is nothing to ask
    try:
        where = cuda.memory_type(out)
    except (RuntimeError, OSError) as e:  # no nvcc or no CUDA library: say so, do not stop
        warnings.warn(f"the host pool's placement was not checked ({e}); if XLA's VMM allocator is on "
                      "(--xla_gpu_command_buffer_update_mode), it may be in device memory", stacklevel=2)
        return out
    if where != "host":
        raise RuntimeError(
            f"the host pool asked for pinned_host memory but CUDA places it in {where} memory, so the offload "
            "would not offload. XLA's VMM allocator, which --xla_gpu_command_buffer_update_mode other than "
            "ALWAYS_UPDATE forces (XLA_FLAGS), does this: run without that flag")
    _PINNED_CHECKED.add(dev)
    return out


_PINNED_CHECKED: set = set()  # devices whose pinned_host buffers CUDA placed in host memory (`host_pool`)


def unaliased_copies(implementation: str | None = None, *, reset: bool = False) -> tuple[int, int]:
    """(calls, bytes) of the FFI handlers that XLA gave an output buffer apart from its aliased
    input, so that the handler first copied the whole cache or pool, since the process started
    or the last reset. Expected (0, 0): every call updates its buffers in place. "xla": (0, 0)."""
    impl = resolve_implementation(implementation)
    return cuda.unaliased(impl, reset=reset) if impl in FFI_IMPLEMENTATIONS else (0, 0)


def lane_ctas(num_ctas: int, caches, *, block_ndim: int | None = None) -> list[int]:
    """The CTA quota split over payloads started side by side (one `gather_blocks_start` each,
    on lanes of their own), by their bytes per block, at least one each: K and V half each,
    NOSA's 256-byte cis one."""
    sizes = block_bytes(caches, block_ndim)
    return [max(1, round(num_ctas * int(b) / int(sizes.sum()))) for b in sizes]


def paper_num_ctas(batch: int, gpu: str = "H100") -> int:
    """The paper's CTA quota: 16 below batch 32 (A100: below 64), else 32."""
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
    """Time the "cuda" gather of `n_tasks` random blocks from a pinned-host pool (4x as many
    blocks) for each CTA count and return `pick_num_ctas` of the medians; cached per shape.
    CUDA GPU only, outside jit (it runs the gather)."""
    rng = np.random.default_rng(0)
    n_pool = 4 * n_tasks
    pool = host_pool(rng.standard_normal((n_pool, *block_shape), dtype=np.float32).astype(dtype))
    src = jnp.asarray(rng.choice(n_pool, n_tasks, replace=False).astype(np.int32))
    dst = jnp.arange(n_tasks, dtype=jnp.int32)
    cache = jnp.zeros((n_tasks, *block_shape), dtype)
    seconds = {}
    for c in candidates:
        f = jax.jit(functools.partial(gather_blocks, config=KVCopyConfig(num_ctas=c), implementation="cuda"))
        jax.block_until_ready(f(pool, src, dst, cache))  # compile outside the timing
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(pool, src, dst, cache))
            ts.append(time.perf_counter() - t0)
        seconds[c] = float(np.median(ts))
    return pick_num_ctas(seconds)
