"""The KV copy op (kernels/kv_copy): each call against its jnp reference on random inputs (the
"xla" reference itself against NumPy), the CPU twin of the CUDA custom calls, the config's
validation, the CUDA source's compile, and GPU equality."""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from sparda_jax.config import ConfigError
from sparda_jax.kernels.kv_copy import (KVCopyConfig, after_start, build_library, gather_blocks,
                                        gather_blocks_reference, gather_blocks_start, gather_blocks_wait,
                                        host_copies_in_flight, join_tokens, lane_ctas, nvcc_path, paper_num_ctas,
                                        pick_num_ctas, reset_host_copies_in_flight, resolve_implementation,
                                        scatter_blocks, scatter_blocks_reference, unaliased_copies)

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="no host C++ compiler for the host_ffi twin")


def _case(seed, n_pool=40, n_slots=12, n=9, block=(64, 128), dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 2)
    pool = jax.random.normal(ks[0], (n_pool, *block)).astype(dtype)
    cache = jax.random.normal(ks[1], (n_slots, *block)).astype(dtype)
    rng = np.random.default_rng(seed)
    src = rng.choice(n_pool, n, replace=False).astype(np.int32)
    src[[2, 5]] = -1  # no task
    dst = rng.choice(n_slots, n, replace=False).astype(np.int32)
    return pool, jnp.asarray(src), jnp.asarray(dst), cache


def _numpy_gather(pool, src, dst, cache):
    """cache[dst[i]] = pool[src[i]] for tasks with both indices in range, in order (NumPy)."""
    out = np.asarray(cache).copy()
    pool = np.asarray(pool)
    for s, d in zip(np.asarray(src), np.asarray(dst)):
        if 0 <= s < pool.shape[0] and 0 <= d < out.shape[0]:
            out[d] = pool[s]
    return out


def _numpy_scatter(cache, src, dst, pool):
    return _numpy_gather(cache, src, dst, pool)  # pool[dst[i]] = cache[src[i]]


def _out_of_range(src, dst, n_pool, n_slots):
    # tasks the kernels skip: an index past the end on either side
    src, dst = np.asarray(src).copy(), np.asarray(dst).copy()
    src[0], dst[1] = n_pool + 3, n_slots + 1
    return jnp.asarray(src), jnp.asarray(dst)


def _payload_case(seed, n_pool=40, n_slots=12, n=9):
    """K and V (bf16 blocks of 64 x 128) and NOSA's cis (f32 blocks of 64 x 1, 256 bytes): the
    engine's payloads, moved by one task list."""
    pool, src, dst, cache = _case(seed, n_pool, n_slots, n)
    pv, _, _, cv = _case(seed + 100, n_pool, n_slots, n)
    pc, _, _, cc = _case(seed + 200, n_pool, n_slots, n, block=(64, 1), dtype=jnp.float32)
    return (pool, pv, pc), src, dst, (cache, cv, cc)


def _on_host(pool):
    dev = jax.devices()[0]
    return jax.device_put(pool, SingleDeviceSharding(dev, memory_kind="pinned_host"))


# ---------------------------------------------------------------- the reference ("xla")


def test_reference_gather_and_scatter_equal_numpy():
    pool, src, dst, cache = _case(0)
    src, dst = _out_of_range(src, dst, pool.shape[0], cache.shape[0])
    want = _numpy_gather(pool, src, dst, cache)
    assert (want != np.asarray(cache)).any()
    np.testing.assert_array_equal(np.asarray(gather_blocks_reference(pool, src, dst, cache)), want)
    np.testing.assert_array_equal(np.asarray(gather_blocks(pool, src, dst, cache, implementation="xla")), want)
    slots = jnp.asarray(np.array([3, -1, 0, 7, 11, 12], np.int32))  # 12: past the cache
    blocks = jnp.asarray(np.array([5, 9, 39, 0, 17, 2], np.int32))
    want = _numpy_scatter(cache, slots, blocks, pool)
    np.testing.assert_array_equal(np.asarray(scatter_blocks_reference(cache, slots, blocks, pool)), want)
    np.testing.assert_array_equal(np.asarray(scatter_blocks(cache, slots, blocks, pool, implementation="xla")), want)


def test_start_wait_reference_is_the_gather():
    pool, src, dst, cache = _case(5)
    started = gather_blocks_start(pool, src, dst, cache, implementation="xla")
    out = gather_blocks_wait(started, src, dst, jnp.ones(3), implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), _numpy_gather(pool, src, dst, cache))


def test_reference_reads_a_pinned_host_pool():
    pool, src, dst, cache = _case(1, dtype=jnp.float32)
    out = jax.jit(gather_blocks_reference)(_on_host(pool), src, dst, cache)
    np.testing.assert_array_equal(np.asarray(out), _numpy_gather(pool, src, dst, cache))


def test_payloads_move_together_and_equal_one_by_one():
    pools, src, dst, caches = _payload_case(10)
    got = gather_blocks_reference(pools, src, dst, caches)
    assert isinstance(got, tuple) and len(got) == 3
    for g, p, c in zip(got, pools, caches):
        np.testing.assert_array_equal(np.asarray(g), _numpy_gather(p, src, dst, c))
    back = scatter_blocks_reference(caches, dst, src, pools)
    for b, p, c in zip(back, pools, caches):
        np.testing.assert_array_equal(np.asarray(b), _numpy_scatter(c, dst, src, p))


def test_errors():
    pool, src, dst, cache = _case(2)
    with pytest.raises(ValueError, match="differ"):
        gather_blocks(pool[:, :32], src, dst, cache, implementation="xla")
    with pytest.raises(ValueError, match="unknown kv_copy implementation"):
        gather_blocks(pool, src, dst, cache, implementation="dma")
    pools, src, dst, caches = _payload_case(11)
    with pytest.raises(ValueError, match="as many pools as caches"):
        gather_blocks(pools, src, dst, caches[:2], implementation="xla")
    with pytest.raises(TypeError, match="both be arrays or both be tuples"):
        gather_blocks(pools, src, dst, caches[0], implementation="xla")
    with pytest.raises(ValueError, match="same number of blocks"):
        gather_blocks((pools[0], pools[1][:30]), src, dst, caches[:2], implementation="xla")
    with pytest.raises(ValueError, match="1..4 payloads"):
        gather_blocks(pools + pools[:2], src, dst, caches + caches[:2], implementation="xla")
    with pytest.raises(TypeError, match="both be arrays or both be tuples"):
        gather_blocks_start(pools, src, dst, caches[0], implementation="xla")
    with pytest.raises(ValueError, match="lane must be in 0..3"):
        gather_blocks_start(pools[0], src, dst, caches[0], lane=4, implementation="xla")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's dispatch (the GPU's is tested below)")
def test_dispatch_on_the_cpu():
    """None takes the first of the default order this platform runs: on the CPU that is the
    reference; "cuda" cannot run here and says so with NotImplementedError."""
    assert resolve_implementation(None) == "xla"
    assert resolve_implementation("host_ffi") == "host_ffi"
    with pytest.raises(NotImplementedError, match="CUDA GPU"):
        resolve_implementation("cuda")
    pool, src, dst, cache = _case(3)
    np.testing.assert_array_equal(np.asarray(gather_blocks(pool, src, dst, cache)), _numpy_gather(pool, src, dst, cache))
    assert unaliased_copies("xla") == (0, 0)


def test_host_pool_places_in_pinned_host_where_the_device_has_it():
    from sparda_jax.kernels.kv_copy import host_pool

    x = np.random.default_rng(0).standard_normal((6, 4, 8)).astype(np.float32)
    pool = host_pool(x)
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert pool.sharding.memory_kind == ("pinned_host" if "pinned_host" in kinds else jax.devices()[0].default_memory().kind)
    np.testing.assert_array_equal(np.asarray(pool), x)


def test_config_is_validated_naming_the_field():
    assert KVCopyConfig() == KVCopyConfig(num_ctas=16, threads=256)
    for kw, field in (({"num_ctas": 0}, "num_ctas"), ({"num_ctas": 1025}, "num_ctas"), ({"threads": 48}, "threads"),
                      ({"threads": 0}, "threads"), ({"threads": 2048}, "threads"), ({"num_ctas": 4.0}, "num_ctas"),
                      ({"threads": True}, "threads")):
        with pytest.raises(ConfigError, match=f"KVCopyConfig.{field}"):
            KVCopyConfig(**kw)
    with pytest.raises(Exception):  # frozen
        KVCopyConfig().num_ctas = 8


def test_cta_quota_rules():
    assert paper_num_ctas(8) == 16 and paper_num_ctas(64) == 32 and paper_num_ctas(48, "A100") == 16
    assert pick_num_ctas({8: 2.0, 16: 1.1, 32: 1.0, 64: 1.01}) == 32
    assert pick_num_ctas({8: 2.0, 16: 1.015, 32: 1.0, 64: 0.99}) == 16  # within 3% of the fastest
    assert pick_num_ctas({16: 1.0}) == 16
    k = jnp.zeros((4, 64, 128), jnp.bfloat16)
    cis = jnp.zeros((4, 64, 1), jnp.float32)
    assert lane_ctas(16, [k, k]) == [8, 8]
    assert lane_ctas(16, [k, k, cis]) == [8, 8, 1]  # the small payload still gets a CTA
    assert lane_ctas(1, [k, k]) == [1, 1]


def test_after_start_orders_by_data_and_keeps_values():
    """The ordering helpers change no value: x comes back as it was, and the token holds one
    element of each started cache (so a wait that takes it follows every start)."""
    x = jax.random.normal(jax.random.key(0), (3, 5))
    a, b = jnp.arange(24.0).reshape(2, 3, 4), 7.0 - jnp.arange(6.0).reshape(6, 1)
    y, tok = jax.jit(lambda a, b, x: after_start({"k": a, "v": b}, x))(a, b, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert [t.shape for t in tok] == [(1, 1, 1), (1, 1)]  # one element of each cache, no kernel to join them
    np.testing.assert_array_equal(np.asarray(join_tokens(tok)), [0.0, 7.0])
    y1, tok1 = after_start(a, x)
    assert len(tok1) == 1 and tok1[0].size == 1
    np.testing.assert_array_equal(np.asarray(join_tokens(tok, None, tok1, jnp.ones((2, 1)))), [0, 7, 0, 1, 1])


# ---------------------------------------------------------------- the CPU twin ("host_ffi")


@needs_cxx
def test_host_ffi_twin_equals_the_reference():
    """The CPU twin of the CUDA custom calls (same targets, operands and aliasing): gather,
    start/wait and write-back on random inputs, out-of-range tasks skipped as by the kernel."""
    pool, src, dst, cache = _case(8, dtype=jnp.float32)
    src, dst = _out_of_range(src, dst, pool.shape[0], cache.shape[0])
    want = _numpy_gather(pool, src, dst, cache)
    assert (want != np.asarray(cache)).any()
    got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, implementation="host_ffi"))(pool, src, dst, cache)
    np.testing.assert_array_equal(np.asarray(got), want)
    sw = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_start(p, s, d, c, implementation="host_ffi"),
                                                        s, d, jnp.ones(2), implementation="host_ffi"))
    np.testing.assert_array_equal(np.asarray(sw(pool, src, dst, cache)), want)
    assert host_copies_in_flight() == 0
    slots, blocks = _out_of_range(dst, src, cache.shape[0], pool.shape[0])
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="host_ffi"))(cache, slots, blocks, pool)
    np.testing.assert_array_equal(np.asarray(sc), _numpy_scatter(cache, slots, blocks, pool))


@needs_cxx
def test_host_ffi_twin_moves_payloads_in_one_call_and_starts_on_lanes():
    """K, V and a 256-byte cis payload: the synchronous gather and the write-back take all three
    in one call; the starts one each, on lanes 0..2, ordered by `after_start`'s token, or all
    three in one start completed by one wait."""
    pools, src, dst, caches = _payload_case(13)
    src, dst = _out_of_range(src, dst, 40, 12)
    want = [_numpy_gather(p, src, dst, c) for p, c in zip(pools, caches)]
    unaliased_copies("host_ffi", reset=True)
    got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, implementation="host_ffi"))(pools, src, dst, caches)

    @jax.jit
    def lanes(p, s, d, c, x):
        started = [gather_blocks_start(p[j], s, d, c[j], lane=j, config=KVCopyConfig(num_ctas=n),
                                       implementation="host_ffi")
                   for j, n in enumerate(lane_ctas(16, c))]
        x, tok = after_start(started, x)
        x = jnp.tanh(x)  # work the copies would hide behind
        return [gather_blocks_wait(c_, s, d, join_tokens(tok, x), implementation="host_ffi") for c_ in started], x

    @jax.jit
    def one(p, s, d, c, x):  # every payload in one start, completed by one wait
        started = gather_blocks_start(p, s, d, c, config=KVCopyConfig(num_ctas=16), implementation="host_ffi")
        x, tok = after_start(started[0], x)  # a slice of one cache orders after the whole start
        x = jnp.tanh(x)
        # the token and x as separate operands of the wait (no kernel joins them)
        return gather_blocks_wait(started, s, d, (tok, x), implementation="host_ffi"), x

    sw, _ = lanes(pools, src, dst, caches, jnp.ones((2, 2)))
    so, _ = one(pools, src, dst, caches, jnp.ones((2, 2)))
    assert isinstance(so, tuple) and len(so) == 3
    for g, h, o, w in zip(got, sw, so, want):
        np.testing.assert_array_equal(np.asarray(g), w)
        np.testing.assert_array_equal(np.asarray(h), w)
        np.testing.assert_array_equal(np.asarray(o), w)
    assert host_copies_in_flight() == 0
    slots, blocks = _out_of_range(dst, src, 12, 40)
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="host_ffi"))(caches, slots, blocks, pools)
    for g, c, p in zip(sc, caches, pools):
        np.testing.assert_array_equal(np.asarray(g), _numpy_scatter(c, slots, blocks, p))
    assert unaliased_copies("host_ffi") == (0, 0)  # every call wrote its buffers in place


@needs_cxx
def test_blocks_as_trailing_dims():
    """block_ndim: pools and caches of any leading shape, blocks numbered in row-major order of
    the leading dims (as the engine passes its caches and pools, unreshaped) - the reference and
    the twin against NumPy on the flattened view."""
    pool, src, dst, cache = _case(21, n_pool=48, n_slots=12, block=(8, 16), dtype=jnp.float32)
    pool5, cache5 = pool.reshape(2, 3, 8, 8, 16), cache.reshape(2, 2, 3, 8, 16)
    want = _numpy_gather(pool, src, dst, cache)
    for impl in ("xla", "host_ffi"):
        got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, block_ndim=2, implementation=impl))(
            pool5, src, dst, cache5)
        assert got.shape == cache5.shape
        np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want, err_msg=impl)
        back = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, block_ndim=2, implementation=impl))(
            cache5, dst, src, pool5)
        np.testing.assert_array_equal(np.asarray(back), _numpy_scatter(cache, dst, src, pool).reshape(pool5.shape),
                                      err_msg=impl)
    with pytest.raises(ValueError, match="pool blocks"):
        gather_blocks(pool5, src, dst, cache5, block_ndim=3, implementation="xla")  # (8, 8, 16) vs (3, 8, 16)
    with pytest.raises(ValueError, match="no block index dims"):
        gather_blocks(pool5, src, dst, cache5, block_ndim=5, implementation="xla")


@needs_cxx
def test_host_ffi_twin_refuses_broken_pairings():
    """The start/wait bookkeeping the engine relies on: a wait must get the buffer its start
    wrote, and a start into a buffer still in flight is refused (the CUDA handlers' messages)."""
    pool, src, dst, cache = _case(9, dtype=jnp.float32)
    try:
        with pytest.raises(Exception, match="wait without start"):
            jax.block_until_ready(jax.jit(lambda c: gather_blocks_wait(c, src, dst, c, implementation="host_ffi"))(
                cache))
        # a start whose wait never comes leaves its buffer registered
        jax.block_until_ready(jax.jit(lambda c: gather_blocks_start(pool, src, dst, c, implementation="host_ffi"),
                                      donate_argnums=0)(jnp.array(cache)))
        assert host_copies_in_flight() == 1
    finally:
        reset_host_copies_in_flight()
    assert host_copies_in_flight() == 0
    odd = jnp.zeros((12, 3), jnp.float32)  # 12-byte blocks: not 16-byte vectors
    with pytest.raises(ValueError, match="multiples of 16"):
        gather_blocks(jnp.zeros((40, 3), jnp.float32), src, dst, odd, implementation="host_ffi")


@needs_cxx
def test_start_and_wait_carry_no_effect():
    """A jit with an effect misses JAX's C++ dispatch path on every call: the asynchronous copy
    must be ordered by data alone."""
    pool, src, dst, cache = _case(15, dtype=jnp.float32)
    jx = jax.make_jaxpr(lambda p, s, d, c: gather_blocks_wait(
        gather_blocks_start(p, s, d, c, implementation="host_ffi"), s, d, jnp.ones(2), implementation="host_ffi"))(
        pool, src, dst, cache)
    assert not jx.effects


# ---------------------------------------------------------------- CUDA


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc on this machine")
def test_cuda_source_compiles(tmp_path):
    """csrc/gather_blocks.cu builds for sm_90 and sm_80, cached, every registered target's
    symbol exported (loading it needs the CUDA driver)."""
    from sparda_jax.kernels.kv_copy.cuda import TARGETS

    lib = build_library(tmp_path)
    assert lib.stat().st_size > 10_000
    assert build_library(tmp_path) == lib  # cached
    exported = lib.read_bytes()
    assert all(sym.encode() + b"\0" in exported for sym in TARGETS.values())


@pytest.mark.gpu
def test_cuda_memory_type_tells_pinned_host_from_device():
    """The placement check on host pools: under XLA's default allocator a pinned_host array is
    page-locked host memory and a device array device memory."""
    from sparda_jax.kernels.kv_copy import host_pool, memory_type

    dev = jax.devices()[0]
    x = jax.random.normal(jax.random.key(1), (4096,), jnp.float32)
    assert memory_type(jax.device_put(x, SingleDeviceSharding(dev, memory_kind="pinned_host"))) == "host"
    assert memory_type(jax.device_put(x, SingleDeviceSharding(dev, memory_kind="device"))) == "device"
    assert resolve_implementation(None) == "cuda"
    assert host_pool(x).sharding.memory_kind == "pinned_host"


@pytest.mark.gpu
def test_cuda_gather_equals_reference():
    pool, src, dst, cache = _case(3, n_pool=300, n_slots=64, n=48)
    host = _on_host(pool)
    want = _numpy_gather(pool, src, dst, cache)
    for ctas, threads in ((1, 256), (4, 256), (16, 256), (132, 256), (2, 1024), (3, 96)):
        cfg = KVCopyConfig(num_ctas=ctas, threads=threads)
        out = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, config=cfg, implementation="cuda"))(
            host, src, dst, cache)
        np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.gpu
def test_cuda_start_wait_equals_reference_with_work_between():
    pool, src, dst, cache = _case(6, n_pool=3000, n_slots=800, n=700)
    host = _on_host(pool)
    w = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.bfloat16)

    @jax.jit
    def f(p, s, d, c, w):
        started = gather_blocks_start(p, s, d, c, config=KVCopyConfig(num_ctas=8), implementation="cuda")
        y, tok = after_start(started, w)
        for _ in range(4):  # work XLA issues while the copy runs
            y = jnp.tanh(y @ w)
        return gather_blocks_wait(started, s, d, join_tokens(tok, y[:1, :1]), implementation="cuda"), y

    for _ in range(3):  # repeated: events, streams and the CTA counter are reused
        out, _ = f(host, src, dst, cache, w)
        np.testing.assert_array_equal(np.asarray(out), _numpy_gather(pool, src, dst, cache))


@pytest.mark.gpu
def test_cuda_starts_on_lanes_and_payloads_in_one_launch_equal_reference():
    """K, V and a 256-byte cis payload as the engine moves them: started one per lane, each with
    its share of the quota, or all three in one start and one wait; the synchronous gather and
    the write-back all three in one launch."""
    pools, src, dst, caches = _payload_case(14, n_pool=3000, n_slots=800, n=700)
    src, dst = _out_of_range(src, dst, 3000, 800)
    hosts = tuple(_on_host(p) for p in pools)
    want = [_numpy_gather(p, src, dst, c) for p, c in zip(pools, caches)]
    w = jax.random.normal(jax.random.key(1), (2048, 2048), jnp.bfloat16)
    unaliased_copies("cuda", reset=True)

    @jax.jit
    def lanes(p, s, d, c, w):
        started = [gather_blocks_start(p[j], s, d, c[j], lane=j, config=KVCopyConfig(num_ctas=n),
                                       implementation="cuda") for j, n in enumerate(lane_ctas(16, c))]
        y, tok = after_start(started, w)
        for _ in range(4):
            y = jnp.tanh(y @ w)
        return [gather_blocks_wait(x, s, d, join_tokens(tok, y[:1, :1]), implementation="cuda") for x in started]

    @jax.jit
    def one(p, s, d, c, w):  # every payload in one launch, one event, one wait
        started = gather_blocks_start(p, s, d, c, config=KVCopyConfig(num_ctas=16), implementation="cuda")
        y, tok = after_start(started[0], w)
        for _ in range(4):
            y = jnp.tanh(y @ w)
        return gather_blocks_wait(started, s, d, join_tokens(tok, y[:1, :1]), implementation="cuda")

    for _ in range(2):  # lanes, events and counters reused
        for g, w_ in zip(lanes(hosts, src, dst, caches, w), want):
            np.testing.assert_array_equal(np.asarray(g), w_)
        for g, w_ in zip(one(hosts, src, dst, caches, w), want):
            np.testing.assert_array_equal(np.asarray(g), w_)
    for ctas in (1, 16):
        got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, config=KVCopyConfig(num_ctas=ctas),
                                                       implementation="cuda"))(hosts, src, dst, caches)
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w_)
    slots, blocks = _out_of_range(dst, src, 800, 3000)
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="cuda"), donate_argnums=3)(
        caches, slots, blocks, hosts)
    for g, c, p in zip(sc, caches, pools):
        assert g.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(g), _numpy_scatter(c, slots, blocks, p))
    assert unaliased_copies("cuda") == (0, 0)


def test_host_pool_refuses_a_pinned_host_array_that_cuda_places_elsewhere(monkeypatch):
    """host_pool checks on a CUDA GPU that the pinned_host pool is page-locked host memory: XLA's VMM
    allocator put such arrays in device memory on the H200, and the engine would then report offload
    numbers that are not. The CUDA query is replaced here; the GPU test of it is below."""
    from sparda_jax.kernels.kv_copy import api as engine, cuda

    x = jax.random.normal(jax.random.key(2), (8, 64), jnp.float32)
    seen = []
    monkeypatch.setattr(engine, "_PINNED_CHECKED", set())
    monkeypatch.setattr(cuda, "on_cuda", lambda dev: True)
    monkeypatch.setattr(cuda, "memory_type", lambda a: seen.append(a.sharding.memory_kind) or "device")
    for _ in range(2):  # a refusal is not remembered: asked again
        with pytest.raises(RuntimeError, match="places it in device memory"):
            engine.host_pool(x)
    assert seen == ["pinned_host"] * 2
    monkeypatch.setattr(cuda, "memory_type", lambda a: seen.append(a.sharding.memory_kind) or "host")
    out = engine.host_pool(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    engine.host_pool(x)  # the device's pools were found in host memory: not asked again
    assert seen == ["pinned_host"] * 3

    def no_nvcc(a):
        raise RuntimeError("nvcc not found")

    engine._PINNED_CHECKED.clear()
    monkeypatch.setattr(cuda, "memory_type", no_nvcc)  # cannot ask: a warning, not a stop
    for _ in range(2):  # and asked again next time
        with pytest.warns(UserWarning, match="placement was not checked"):
            engine.host_pool(x)
    monkeypatch.setattr(cuda, "memory_type", lambda a: pytest.fail("queried an empty pool"))
    assert engine.host_pool(x[:0]).size == 0  # no buffer address to ask about (a 1-layer model's pool)
    monkeypatch.setattr(cuda, "on_cuda", lambda dev: False)  # CPU: nothing to ask CUDA
    monkeypatch.setattr(cuda, "memory_type", lambda a: pytest.fail("queried off CUDA"))
    engine.host_pool(x)


def test_the_background_build_starts_once_and_only_on_cuda(monkeypatch):
    """`build_in_background`: nothing off CUDA; on CUDA with nvcc one thread a process, which runs
    `build_library` and keeps a failure for the first use to raise."""
    from sparda_jax.kernels.kv_copy import cuda

    monkeypatch.setattr(cuda, "_BACKGROUND", [])
    assert cuda.build_in_background() is None and cuda._BACKGROUND == []  # this machine has no CUDA GPU
    calls = []

    def fake_build():
        calls.append(1)
        raise RuntimeError("nvcc failed")

    monkeypatch.setattr(cuda, "on_cuda", lambda dev=None: True)
    monkeypatch.setattr(cuda, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(cuda, "build_library", fake_build)
    t = cuda.build_in_background()
    t.join(10)
    assert calls == [1] and not t.is_alive()
    assert cuda.build_in_background() is None and calls == [1]  # started before: not again
