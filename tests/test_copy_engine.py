"""The copy engine: reference semantics on the CPU, the CUDA source compiles, GPU equality."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from sparda_jax.kernels.copy_engine import (build_library, gather_blocks, gather_blocks_reference, nvcc_path,
                                            paper_num_ctas)


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


@pytest.mark.skipif(nvcc_path() is None, reason="no nvcc on this machine")
def test_cuda_source_compiles(tmp_path):
    lib = build_library(tmp_path)
    assert lib.stat().st_size > 10_000
    assert build_library(tmp_path) == lib  # cached


@pytest.mark.gpu
def test_cuda_gather_equals_reference():
    pool, src, dst, cache = _case(3, n_pool=300, n_slots=64, n=48)
    dev = jax.devices()[0]
    host = jax.device_put(pool, SingleDeviceSharding(dev, memory_kind="pinned_host"))
    for ctas in (1, 4, 16, 132):
        out = jax.jit(lambda p, s, d, c: gather_blocks(p, s, d, c, num_ctas=ctas, implementation="cuda"))(
            host, src, dst, cache)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(gather_blocks_reference(pool, src, dst, cache)))
