"""The copy engine: reference semantics on the CPU, the CUDA source compiles, GPU equality."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import shutil

from sparda_jax.kernels.copy_engine import (build_library, gather_blocks, gather_blocks_reference,
                                            gather_blocks_start, gather_blocks_wait, host_copies_in_flight,
                                            nvcc_path, paper_num_ctas, reset_host_copies_in_flight, scatter_blocks,
                                            scatter_blocks_reference)

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


def test_reference_semantics():
    pool, src, dst, cache = _case(0)
    out = np.asarray(gather_blocks_reference(pool, src, dst, cache))
    expected = np.asarray(cache).copy()
    for s, d in zip(np.asarray(src), np.asarray(dst)):
        if s >= 0:
            expected[d] = np.asarray(pool)[s]
    np.testing.assert_array_equal(out, expected)


def test_scatter_reference_semantics():
    pool, src, dst, cache = _case(4)
    # scatter: pool[dst[i]] = cache[src[i]]; src indexes the cache here, dst the pool
    slots = jnp.asarray(np.array([3, -1, 0, 7, 11], np.int32))
    blocks = jnp.asarray(np.array([5, 9, 39, 0, 17], np.int32))
    out = np.asarray(scatter_blocks_reference(cache, slots, blocks, pool))
    expected = np.asarray(pool).copy()
    for s_, d in zip(np.asarray(slots), np.asarray(blocks)):
        if s_ >= 0:
            expected[d] = np.asarray(cache)[s_]
    np.testing.assert_array_equal(out, expected)


def test_start_wait_reference_is_the_gather():
    pool, src, dst, cache = _case(5)
    started = gather_blocks_start(pool, src, dst, cache, implementation="xla")
    out = gather_blocks_wait(started, src, dst, jnp.ones(3), implementation="xla")
    np.testing.assert_array_equal(out, gather_blocks_reference(pool, src, dst, cache))


def test_reference_reads_a_pinned_host_pool():
    pool, src, dst, cache = _case(1, dtype=jnp.float32)
    dev = jax.devices()[0]
    host = jax.device_put(pool, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    out = jax.jit(gather_blocks_reference)(host, src, dst, cache)
    np.testing.assert_array_equal(out, gather_blocks_reference(pool, src, dst, cache))


def test_errors_and_quota():
    pool, src, dst, cache = _case(2)
    with pytest.raises(ValueError, match="differ"):
        gather_blocks(pool[:, :32], src, dst, cache, implementation="xla")
    with pytest.raises(ValueError, match="unknown implementation"):
        gather_blocks(pool, src, dst, cache, implementation="dma")
    assert paper_num_ctas(8) == 16 and paper_num_ctas(64) == 32 and paper_num_ctas(48, "A100") == 16


def _payload_case(seed, n_pool=40, n_slots=12, n=9):
    """K and V (bf16 blocks of 64 x 128) and NOSA's cis (f32 blocks of 64 x 1, 256 bytes): the
    engine's payloads, moved by one task list."""
    pool, src, dst, cache = _case(seed, n_pool, n_slots, n)
    pv, _, _, cv = _case(seed + 100, n_pool, n_slots, n)
    pc, _, _, cc = _case(seed + 200, n_pool, n_slots, n, block=(64, 1), dtype=jnp.float32)
    return (pool, pv, pc), src, dst, (cache, cv, cc)


def test_payloads_move_together_and_equal_one_by_one():
    pools, src, dst, caches = _payload_case(10)
    got = gather_blocks_reference(pools, src, dst, caches)
    assert isinstance(got, tuple) and len(got) == 3
    for g, p, c in zip(got, pools, caches):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(gather_blocks_reference(p, src, dst, c)))
    back = scatter_blocks_reference(caches, dst, src, pools)
    for b, p, c in zip(back, pools, caches):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(scatter_blocks_reference(c, dst, src, p)))


def test_payload_errors():
    pools, src, dst, caches = _payload_case(11)
    with pytest.raises(ValueError, match="as many pools as caches"):
        gather_blocks(pools, src, dst, caches[:2], implementation="xla")
    with pytest.raises(TypeError, match="both be arrays or both be tuples"):
        gather_blocks(pools, src, dst, caches[0], implementation="xla")
    with pytest.raises(ValueError, match="same number of blocks"):
        gather_blocks((pools[0], pools[1][:30]), src, dst, caches[:2], implementation="xla")
    with pytest.raises(ValueError, match="1..4 payloads"):
        gather_blocks(pools + pools[:2], src, dst, caches + caches[:2], implementation="xla")


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc on this machine")
def test_cuda_source_compiles(tmp_path):
    from sparda_jax.kernels.copy_engine import TARGETS

    lib = build_library(tmp_path)
    assert lib.stat().st_size > 10_000
    assert build_library(tmp_path) == lib  # cached
    exported = lib.read_bytes()  # every registered target's symbol is in it (loading needs the CUDA driver)
    assert all(sym.encode() + b"\0" in exported for sym in TARGETS.values())


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc on this machine")
def test_overlap_probe_compiles(tmp_path):
    """scripts/probes/overlap_probe.cu builds against the engine's own kernel header (as its
    script does on the GPU machine), so a change to copy_kernels.cuh cannot silently break it."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "overlap_probe"
    r = subprocess.run([nvcc_path(), "-O3", "-std=c++17", "-arch=sm_90", "-I", str(root / "kernels" / "copy"),
                        "-I", jax.ffi.include_dir(), str(root / "scripts" / "probes" / "overlap_probe.cu"),
                        "-o", str(out), "-ldl"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size > 10_000


@pytest.mark.gpu
def test_cuda_memory_type_tells_pinned_host_from_device():
    """The engine's check on its host pools: under XLA's default allocator a pinned_host array is
    page-locked host memory and a device array device memory (under the VMM allocator that XLA's
    command-buffer update modes force, pinned_host arrays came out in device memory, f43841a)."""
    from sparda_jax.kernels.copy_engine import memory_type

    dev = jax.devices()[0]
    x = jax.random.normal(jax.random.key(1), (4096,), jnp.float32)
    assert memory_type(jax.device_put(x, SingleDeviceSharding(dev, memory_kind="pinned_host"))) == "host"
    assert memory_type(jax.device_put(x, SingleDeviceSharding(dev, memory_kind="device"))) == "device"
    # the engine's own path: it must see this GPU as CUDA (else it checks nothing) and accept the pool
    from sparda_jax.infer import engine

    assert engine._on_cuda(dev)
    assert engine.host_pool(x).sharding.memory_kind == "pinned_host"


@pytest.mark.gpu
def test_cuda_gather_equals_reference():
    pool, src, dst, cache = _case(3, n_pool=300, n_slots=64, n=48)
    dev = jax.devices()[0]
    host = jax.device_put(pool, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    # groups > 1 take the deeper kernel: 48 tasks make 12 whole groups of 4, and 9 of 5 plus a ragged 3
    for ctas, threads, group in ((1, 256, 1), (4, 256, 1), (16, 256, 1), (132, 256, 1), (2, 1024, 1), (3, 96, 1),
                                 (4, 256, 4), (3, 128, 5), (132, 256, 8)):
        out = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, num_ctas=ctas, threads=threads, group=group,
                                                       implementation="cuda"))(host, src, dst, cache)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(gather_blocks_reference(pool, src, dst, cache)))


@pytest.mark.gpu
def test_cuda_dma_start_equals_reference():
    """The DMA-engine start (an experiment for bench_pipeline): K and V payloads, -1 tasks
    skipped, completed by the usual wait."""
    from sparda_jax.kernels.copy_engine import gather_blocks_dma_start

    pool, src, dst, cache = _case(5, n_pool=300, n_slots=64, n=48)
    pools = (_on_host(pool), _on_host(pool[::-1]))
    f = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_dma_start(p, s, d, c, implementation="cuda"),
                                                      s, d, s, implementation="cuda"))
    got = f(pools, src, dst, (cache, cache + 1))
    for g, p, c in zip(got, (pool, pool[::-1]), (cache, cache + 1)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(gather_blocks_reference(p, src, dst, c)))


def _on_host(pool):
    dev = jax.devices()[0]
    return jax.device_put(pool, SingleDeviceSharding(dev, memory_kind="pinned_host"))


@pytest.mark.gpu
def test_cuda_start_wait_equals_reference_with_work_between():
    pool, src, dst, cache = _case(6, n_pool=3000, n_slots=800, n=700)
    host = _on_host(pool)
    w = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=5)
    def f(p, s, d, c, w, resident):
        started = gather_blocks_start(p, s, d, c, num_ctas=8, resident=resident, implementation="cuda")
        y = w
        for _ in range(4):  # work XLA issues while the copy runs
            y = jnp.tanh(y @ w)
        return gather_blocks_wait(started, s, d, y, implementation="cuda"), y

    for resident in (False, True, True):  # repeated: events, streams and the CTA counter are reused
        out, _ = f(host, src, dst, cache, w, resident)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(gather_blocks_reference(pool, src, dst, cache)))


@pytest.mark.gpu
def test_cuda_starts_on_two_lanes_run_side_by_side_and_equal_reference():
    """K and V as the engine starts them: one copy each, on lanes 0 and 1, both in flight while
    XLA computes, waited for after; each lane's CTA counter is its own."""
    pools, src, dst, caches = _payload_case(14, n_pool=3000, n_slots=800, n=700)
    hosts = tuple(_on_host(p) for p in pools[:2])
    w = jax.random.normal(jax.random.key(1), (2048, 2048), jnp.bfloat16)

    @jax.jit
    def f(p, s, d, c, w):
        started = [gather_blocks_start(p[j], s, d, c[j], num_ctas=4, lane=j, implementation="cuda") for j in (0, 1)]
        y = w
        for _ in range(4):
            y = jnp.tanh(y @ w)
        return [gather_blocks_wait(x, s, d, y, implementation="cuda") for x in started]

    want = gather_blocks_reference(pools[:2], src, dst, caches[:2])
    for _ in range(2):  # lanes, events and counters reused
        for g, w_ in zip(f(hosts, src, dst, caches[:2], w), want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))


@pytest.mark.gpu
def test_cuda_payloads_in_one_launch_equal_reference():
    """K, V and a 256-byte cis payload: gather, start/wait and write-back, one launch each."""
    pools, src, dst, caches = _payload_case(12, n_pool=300, n_slots=64, n=48)
    src, dst = _out_of_range(src, dst, 300, 64)
    hosts = tuple(_on_host(p) for p in pools)
    want = gather_blocks_reference(pools, src, dst, caches)
    for ctas in (1, 16):
        got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, num_ctas=ctas, implementation="cuda"))(
            hosts, src, dst, caches)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    sw = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_start(p, s, d, c, implementation="cuda"),
                                                        s, d, jnp.ones(2), implementation="cuda"))
    for g, w in zip(sw(hosts, src, dst, caches), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    slots, blocks = _out_of_range(dst, src, 64, 300)
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="cuda"), donate_argnums=3)(
        caches, slots, blocks, hosts)
    for g, c, p in zip(sc, caches, pools):
        assert g.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(g), np.asarray(scatter_blocks_reference(c, slots, blocks, p)))


@pytest.mark.gpu
def test_cuda_doorbell_jobs_equal_reference():
    """The doorbell: one serve, then three jobs rung and waited on XLA's stream (K, V and cis in
    each, tasks out of range skipped), copied by the persistent server; four steps in a row
    reuse the doorbell's flags, which each step's server and waits reset."""
    from sparda_jax.kernels.copy_engine import doorbell_serve, gather_blocks_ring, gather_blocks_ring_wait

    pools, src, dst, caches = _payload_case(13, n_pool=300, n_slots=64, n=48)
    src, dst = _out_of_range(src, dst, 300, 64)
    hosts = tuple(_on_host(p) for p in pools)
    srcs = jnp.stack([src, jnp.roll(src, 5), jnp.flip(src)])

    def step(p, srcs, d, c, impl="cuda"):
        s = doorbell_serve(srcs[0], n_jobs=3, num_ctas=8, implementation=impl)
        outs = []
        for j in range(3):  # each job into the caches the previous one completed, as the engine's layers
            c = gather_blocks_ring_wait(gather_blocks_ring(p, s, d, c, job=j, implementation=impl), s, d,
                                        jnp.ones(2), job=j, implementation=impl)
            outs.append(c)
            if j < 2:  # the next job's tasks follow this one's wait (the engine's next layer follows it)
                s = srcs[j + 1] + 0 * c[0].reshape(-1)[:1].astype(jnp.int32)
        return outs

    f = jax.jit(step)
    want, c = [], caches
    for j in range(3):
        c = gather_blocks_reference(pools, srcs[j], dst, c)
        want.append(c)
    for _ in range(4):
        for got, w in zip(f(hosts, srcs, dst, caches), want):
            for g, w_ in zip(got, w):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w_))
    # the last step's device timeline: each job rung, taken up, finished and waited for in protocol
    # order (a wait may start spinning before its copy ends), jobs one after another
    from sparda_jax.kernels.copy_engine import doorbell_timeline

    t = doorbell_timeline(3, "cuda")
    assert all(np.isfinite(v).all() for v in t.values()), t
    tick = 2.0  # us: %globaltimer's ~1 us ticks, read on different SMs
    for a, b in (("ring", "copy_begin"), ("copy_begin", "copy_end"), ("copy_end", "wait_end"),
                 ("wait_begin", "wait_end")):
        assert (t[a] <= t[b] + tick).all(), (a, b, t)
    assert (t["copy_begin"][1:] + tick >= t["copy_end"][:-1]).all()
    assert np.isnan(doorbell_timeline(5, "cuda")["ring"][3:]).all()  # beyond the step's 3 jobs


@pytest.mark.gpu
def test_cuda_scatter_writes_the_host_pool_in_place():
    pool, src, dst, cache = _case(7, n_pool=300, n_slots=64, n=48)
    host = _on_host(pool)
    slots, blocks = dst, src  # write cache slots back into pool blocks
    f = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="cuda"), donate_argnums=3)
    out = f(cache, slots, blocks, host)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(scatter_blocks_reference(cache, slots, blocks, pool)))


def test_cta_choice_prefers_fewer_on_a_near_tie():
    from sparda_jax.kernels.copy_engine import pick_num_ctas

    assert pick_num_ctas({8: 2.0, 16: 1.1, 32: 1.0, 64: 1.01}) == 32
    assert pick_num_ctas({8: 2.0, 16: 1.015, 32: 1.0, 64: 0.99}) == 16  # within 3% of the fastest
    assert pick_num_ctas({16: 1.0}) == 16


def _out_of_range(src, dst, n_pool, n_slots):
    # tasks the kernels skip: an index past the end on either side
    src, dst = np.asarray(src).copy(), np.asarray(dst).copy()
    src[0], dst[1] = n_pool + 3, n_slots + 1
    return jnp.asarray(src), jnp.asarray(dst)


@needs_cxx
def test_host_ffi_twin_equals_the_reference():
    """The CPU twin of the CUDA custom calls (same targets, operands and aliasing) computes the
    reference's gather, start/wait and write-back, out-of-range tasks skipped as by the kernel."""
    pool, src, dst, cache = _case(8, dtype=jnp.float32)
    src, dst = _out_of_range(src, dst, pool.shape[0], cache.shape[0])
    want = np.asarray(gather_blocks_reference(pool, src, dst, cache))
    assert (want != np.asarray(cache)).any()
    got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, implementation="host_ffi"))(pool, src, dst, cache)
    np.testing.assert_array_equal(np.asarray(got), want)
    sw = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_start(p, s, d, c, implementation="host_ffi"),
                                                        s, d, jnp.ones(2), implementation="host_ffi"))
    np.testing.assert_array_equal(np.asarray(sw(pool, src, dst, cache)), want)
    assert host_copies_in_flight() == 0
    slots, blocks = _out_of_range(dst, src, cache.shape[0], pool.shape[0])
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="host_ffi"))(cache, slots, blocks, pool)
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(scatter_blocks_reference(cache, slots, blocks, pool)))


@needs_cxx
def test_blocks_as_trailing_dims():
    """block_ndim: pools and caches of any leading shape, blocks numbered in row-major order of
    the leading dims (as the engine passes its [B, K, n_slots, bs, X] caches and [L-1, B, K, nb,
    bs, X] pools, unreshaped) - the reference and the twin against NumPy on the flattened view."""
    pool, src, dst, cache = _case(21, n_pool=48, n_slots=12, block=(8, 16), dtype=jnp.float32)
    pool5, cache5 = pool.reshape(2, 3, 8, 8, 16), cache.reshape(2, 2, 3, 8, 16)
    want = np.asarray(cache).copy()
    for s_, d_ in zip(np.asarray(src), np.asarray(dst)):
        if s_ >= 0:
            want[d_] = np.asarray(pool)[s_]
    for impl in ("xla", "host_ffi"):
        got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, block_ndim=2, implementation=impl))(
            pool5, src, dst, cache5)
        assert got.shape == cache5.shape
        np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want, err_msg=impl)
        back = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, block_ndim=2, implementation=impl))(
            cache5, dst, src, pool5)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(
            scatter_blocks_reference(cache, dst, src, pool)).reshape(pool5.shape), err_msg=impl)
    with pytest.raises(ValueError, match="pool blocks"):
        gather_blocks(pool5, src, dst, cache5, block_ndim=3, implementation="xla")  # (8, 8, 16) vs (3, 8, 16)
    with pytest.raises(ValueError, match="no block index dims"):
        gather_blocks(pool5, src, dst, cache5, block_ndim=5, implementation="xla")


@needs_cxx
def test_host_ffi_twin_moves_payloads_in_one_call():
    pools, src, dst, caches = _payload_case(13)
    src, dst = _out_of_range(src, dst, 40, 12)
    want = gather_blocks_reference(pools, src, dst, caches)
    got = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, implementation="host_ffi"))(pools, src, dst, caches)
    sw = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_start(p, s, d, c, implementation="host_ffi"),
                                                        s, d, jnp.ones(2), implementation="host_ffi"))(
        pools, src, dst, caches)
    for g, h, w in zip(got, sw, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(h), np.asarray(w))
    assert host_copies_in_flight() == 0
    slots, blocks = _out_of_range(dst, src, 12, 40)
    sc = jax.jit(lambda c, s, d, p: scatter_blocks(c, s, d, p, implementation="host_ffi"))(caches, slots, blocks, pools)
    for g, c, p in zip(sc, caches, pools):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(scatter_blocks_reference(c, slots, blocks, p)))


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
    with pytest.raises(ValueError, match="CPU backend only|unknown"):
        gather_blocks(pool, src, dst, cache, implementation="host-ffi")
    with pytest.raises(Exception, match="lane must be in 0..3"):
        jax.block_until_ready(jax.jit(lambda c: gather_blocks_start(pool, src, dst, c, lane=4,
                                                                    implementation="host_ffi"))(cache))
    for bad in (0, 9):
        with pytest.raises(Exception, match="group must be in 1..8"):
            jax.block_until_ready(jax.jit(lambda c: gather_blocks(pool, src, dst, c, group=bad,
                                                                  implementation="host_ffi"))(cache))
    for bad in (0, 48, 2048):  # not a warp multiple CUDA can launch: refused as the CUDA handlers do
        with pytest.raises(Exception, match="threads must be a multiple of 32"):
            jax.block_until_ready(jax.jit(lambda c: gather_blocks(pool, src, dst, c, threads=bad,
                                                                  implementation="host_ffi"))(cache))
        with pytest.raises(Exception, match="threads must be a multiple of 32"):
            jax.block_until_ready(jax.jit(lambda c: gather_blocks_start(pool, src, dst, c, threads=bad,
                                                                        implementation="host_ffi"))(cache))
    assert host_copies_in_flight() == 0


@needs_cxx
def test_start_and_wait_carry_no_effect():
    """A jit with an effect misses JAX's C++ dispatch path on every call (3.5 ms of host time a
    decode step on the H200): the async copy must be ordered by data alone."""
    pool, src, dst, cache = _case(15, dtype=jnp.float32)
    jx = jax.make_jaxpr(lambda p, s, d, c: gather_blocks_wait(
        gather_blocks_start(p, s, d, c, implementation="host_ffi"), s, d, jnp.ones(2), implementation="host_ffi"))(
        pool, src, dst, cache)
    assert not jx.effects
    f = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_start(p, s, d, c, implementation="host_ffi"),
                                                       s, d, jnp.ones(2), implementation="host_ffi"))
    np.testing.assert_array_equal(np.asarray(f(pool, src, dst, cache)),
                                  np.asarray(gather_blocks_reference(pool, src, dst, cache)))
    assert host_copies_in_flight() == 0


@needs_cxx
def test_host_ffi_dma_start_twin_is_the_gather():
    """The DMA start's CPU twin: the same copy as the start, completed by the same wait."""
    from sparda_jax.kernels.copy_engine import gather_blocks_dma_start

    pool, src, dst, cache = _case(6, dtype=jnp.float32)
    f = jax.jit(lambda p, s, d, c: gather_blocks_wait(gather_blocks_dma_start(p, s, d, c, implementation="host_ffi"),
                                                      s, d, s, implementation="host_ffi"))
    got = f(pool, src, dst, cache)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gather_blocks_reference(pool, src, dst, cache)))
    assert host_copies_in_flight() == 0


@needs_cxx
def test_host_ffi_mark_is_the_identity():
    from sparda_jax.kernels.copy_engine import mark

    x = jax.random.normal(jax.random.key(3), (5, 7))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: mark(a, 3, implementation="host_ffi"))(x)),
                                  np.asarray(x))
    assert mark(x, 3, implementation="xla") is x


@pytest.mark.gpu
def test_cuda_trace_records_a_started_copy_and_marks_in_order():
    """The diagnostics timeline: a start's copy begins and ends on its lane, marks sit on XLA's
    stream; nothing is recorded once tracing is off."""
    from sparda_jax.infer.engine import _after_start
    from sparda_jax.kernels.copy_engine import mark, read_trace, trace

    pool, src, dst, cache = _case(8, n_pool=300, n_slots=64, n=48)

    @jax.jit
    def f(p, s, d, c):
        c = gather_blocks_start(p, s, d, c, lane=1, implementation="cuda")
        # the mark on the start's token (the barrier's output a wait must consume), not on its buffer
        after = mark(_after_start({"c": c}, d + 0)[1], 7, implementation="cuda")
        return gather_blocks_wait(c, s, d, after, implementation="cuda")
    host = _on_host(pool)
    trace(True)
    try:
        got = f(host, src, dst, cache)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(gather_blocks_reference(pool, src, dst, cache)))
        ev = read_trace()
    finally:
        trace(False)
    labels = [lab for lab, _ in ev]
    assert labels == ["copy1+", "copy1-", "mark7"] and all(t >= 0 for _, t in ev) and ev[1][1] >= ev[0][1]
    jax.block_until_ready(f(host, src, dst, cache))
    assert read_trace() == []
