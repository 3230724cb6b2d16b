"""The offload engine reproduces the resident modes token for token, on the CPU."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import get_preset, init_forecast, init_model
from sparda_jax.infinigen import infinigen_setup
from sparda_jax.infer.engine import decode_plan, engine_decode_step, engine_prefill, memory_report, selector_of
from sparda_jax.modes import decode_step, prefill

TINY = get_preset("tiny")  # blocks of 16, init 1, local 1, topk 4
TINY_NOSA = get_preset("tiny-nosa")


def _make(config):
    params = init_model(config, jax.random.key(0))
    if config.has_cis:  # A starts at zero; make the cis bias and stage matter
        layers = dict(params["layers"])
        layers["cis_A"] = jax.random.normal(jax.random.key(1), layers["cis_A"].shape)
        params = dict(params, layers=layers)
    forecast = init_forecast(config, jax.random.key(2))
    ig = infinigen_setup(params, config, jax.random.randint(jax.random.key(3), (1, 96), 0, config.vocab_size))
    return params, forecast, ig


@pytest.fixture(scope="module")
def setup():
    return _make(TINY)


@pytest.fixture(scope="module")
def setup_nosa():
    return _make(TINY_NOSA)


def _run(setup, mode, *, reuse=True, resident=False, steps=60, n_slots=None, config=TINY, copy_impl=None,
         copy_start="lanes", copy_in_graph=False, topk_impl="xla"):
    params, forecast, ig = setup
    b, t0 = 2, 70
    tokens = jax.random.randint(jax.random.key(4), (b, t0 + steps), 0, config.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)
    prompt = jnp.where(jnp.arange(t0)[None] < lengths[:, None], tokens[:, :t0], 0)
    kw = dict(forecast=forecast, infinigen=ig)
    if resident:
        last, st = prefill(params, prompt, lengths, config, cache_size=t0 + steps, mode=selector_of(mode), **kw)
    else:
        last, st = engine_prefill(params, prompt, lengths, config, mode=mode, cache_size=t0 + steps, n_slots=n_slots,
                                  **kw)
    out, copied, selected = [last], 0, 0
    pos = lengths
    for _ in range(steps - 12):
        tok = tokens[jnp.arange(b), pos]
        if resident:
            logits, st = decode_step(params, tok, pos, st, config, mode=selector_of(mode), **kw)
        else:
            logits, st, stats = engine_decode_step(params, tok, pos, st, config, mode=mode, reuse=reuse,
                                                   copy_impl=copy_impl, copy_start=copy_start,
                                                   copy_in_graph=copy_in_graph, topk_impl=topk_impl, **kw)
            copied += int(stats["copied_blocks"])
            selected += int(stats["selected_blocks"])
        out.append(logits)
        pos = pos + 1
    return jnp.stack(out), copied, selected


@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_topk_impl_reaches_every_layers_selection(setup, mode, monkeypatch):
    # topk_impl takes the step's selections through the Mosaic top-k's entry point. The kernel
    # itself cannot run inside the step on the CPU (its interpreter's callbacks and the step's
    # donated state do not lower together), so here it is stood in for by its jnp reference;
    # tests/test_kernel_select.py checks the kernel against XLA's top-k id for id (interpreted,
    # and compiled on the GPU), and the GPU test below runs it in the step
    from sparda_jax.kernels import forecast_select as fs

    calls = []

    def stand_in(scores, k, *, implementation, interpret):
        calls.append((scores.shape, implementation))
        return fs.topk_reference(scores, k)

    monkeypatch.setattr(fs, "select_topk", stand_in)
    ref, c0, s0 = _run(setup, mode, steps=20)
    assert not calls
    got, c1, s1 = _run(setup, mode, steps=20, topk_impl="mosaic_gpu_interpret")
    assert calls and all(impl == "rows" for _, impl in calls)
    assert (c1, s1) == (c0, s0) and c0 > 0
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if mode == "sparda":  # both selectors end in the same finalize_topk: one mode shows the plumbing
        # the top-k by counting (XLA, no sort): the same blocks, so the same copies; logits within
        # the CUDA copy test's 2e-5 (the programs fuse differently around the swapped top-k)
        got, c2, s2 = _run(setup, mode, steps=20, topk_impl="xla_count")
        assert (c2, s2) == (c0, s0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    with pytest.raises(ValueError, match="topk_impl must be one of"):
        _run(setup, mode, steps=13, topk_impl="sort")


@pytest.mark.parametrize("mode", ["sparse", "sparda_sync", "sparda", "infinigen"])
def test_offload_equals_resident(setup, mode):
    """Many decode steps across block boundaries (blocks complete and go to the host)."""
    resident, _, _ = _run(setup, mode, resident=True)
    offload, copied, selected = _run(setup, mode)
    np.testing.assert_allclose(offload, resident, atol=2e-5)
    assert 0 < copied < selected  # the cache reused blocks


@pytest.mark.parametrize("mode", ["dense_resident", "sparse_resident"])
def test_engine_resident_modes_equal_the_stacked_decode(setup, mode):
    """Dense+ and Sparse+ in the engine decode a per-layer state (`layered_state`, each layer's
    K/V updated in place); the tokens' logits are those of `modes.decode_step` on the stacked one."""
    params, forecast, ig = setup
    stacked, _, _ = _run(setup, mode, resident=True, steps=30)
    engine, copied, selected = _run(setup, mode, steps=30)
    np.testing.assert_allclose(engine, stacked, atol=2e-5)
    assert copied == selected == 0
    _, st = engine_prefill(params, jnp.ones((1, 20), jnp.int32), jnp.array([20]), TINY, mode=mode, cache_size=64)
    assert isinstance(st, tuple) and len(st) == TINY.num_layers and st[0].kv.k.ndim == 4


def test_engine_step_on_per_layer_weights_slices_none(setup):
    """`layered_params`: the engine's layer loop (the copy custom calls' CPU twin, as the CUDA
    path runs) gives the stacked weights' logits, and its compiled step (CPU HLO) slices no
    backbone weight, where on the stacked tree every layer's are slices (the test's witness: on
    the GPU XLA copied the o_proj slice, as it feeds a cuBLAS GEMM). On either tree the
    compiled step reads its positions input in one op (`_own_buffer`; witness:
    `_positions_witness`). Both checks share this test's compiles, to keep the suite short."""
    import re

    from sparda_jax.infer.engine import _engine_decode, decode_plan
    from sparda_jax.model import layered_params

    params, forecast, _ = setup
    b, t0 = 2, 70
    tokens = jax.random.randint(jax.random.key(6), (b, t0 + 8), 0, TINY.vocab_size)
    lengths = jnp.array([t0, t0 - 9], jnp.int32)
    per_layer = layered_params(params)
    slice_of = lambda a: ",".join(map(str, (1,) + a.shape[1:]))
    # the Forecast's own stack stays stacked (its kernels, shaped as k_proj's here, feed a fused
    # Triton GEMM on the GPU: no copy, stage hlo-decode): those shapes are left out
    shapes = ({slice_of(a) for a in jax.tree.leaves(params["layers"]) if a.ndim > 2}
              - {slice_of(forecast["f"]["kernel"])})
    assert {"1,4,16,64", "1,64,4,16", "1,64,128", "1,128,64"} <= shapes  # o, q, gate/up, down

    def run(p):
        _, st = engine_prefill(params, tokens[:, :t0], lengths, TINY, mode="sparda", cache_size=t0 + 16,
                               forecast=forecast)
        plan = decode_plan(TINY, "sparda", st.cache, copy_impl="host_ffi")
        hlo = _engine_decode.lower(p, tokens[:, t0], lengths, st, forecast, None, plan=plan).compile().as_text()
        sliced = [m.group(1) for m in re.finditer(r"=\s*\w+\[([\d,]*)\]\S*\s+(?:slice|copy|dynamic-slice)\(", hlo)
                  if m.group(1) in shapes]
        # the positions input (after params and tokens) is read by one op (`_own_buffer`)
        assert len(_entry_users(hlo, len(jax.tree.leaves(p)) + 1)) == 1
        out, pos = [], lengths
        for i in range(6):
            logits, st, _ = engine_decode_step(p, tokens[jnp.arange(b), t0 + i], pos, st, TINY, mode="sparda",
                                               forecast=forecast, copy_impl="host_ffi")
            out.append(logits)
            pos = pos + 1
        return jnp.stack(out), sliced

    stacked, sliced_stacked = run(params)
    layered, sliced_layered = run(per_layer)
    _positions_witness(per_layer, tokens[:, t0], lengths, forecast)
    np.testing.assert_allclose(layered, stacked, rtol=1e-6, atol=1e-6)  # the same math; f32 fusions may differ
    assert sliced_stacked, "the stacked step no longer slices weights: this test needs a new witness"
    assert sliced_layered == []
    with pytest.raises(ValueError, match="layers"):
        engine_decode_step(dict(per_layer, layers=per_layer["layers"][:2]), tokens[:, t0], lengths, None, TINY,
                           mode="sparda", forecast=forecast)


@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_copies_in_graph_are_the_same_copies(setup, mode):
    """copy_in_graph: the custom calls declared safe for XLA's command buffers (here their CPU
    twin) give the same logits and counts as the plain ones."""
    ref, c0, s0 = _run(setup, mode, copy_impl="host_ffi", steps=30)
    graph, c1, s1 = _run(setup, mode, copy_impl="host_ffi", steps=30, copy_in_graph=True)
    np.testing.assert_array_equal(graph, ref)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


def test_host_pool_refuses_a_pinned_host_array_that_cuda_places_elsewhere(monkeypatch):
    """host_pool checks on a CUDA GPU that the pinned_host pool is page-locked host memory: XLA's VMM
    allocator put such arrays in device memory on the H200, and the engine would then report offload
    numbers that are not. The CUDA query is replaced here; the GPU test of it is in test_copy_engine."""
    from sparda_jax.infer import engine

    x = jax.random.normal(jax.random.key(2), (8, 64), jnp.float32)
    seen = []
    monkeypatch.setattr(engine, "_on_cuda", lambda dev: True)
    monkeypatch.setattr(engine, "memory_type", lambda a: seen.append(a.sharding.memory_kind) or "device")
    with pytest.raises(RuntimeError, match="places it in device memory"):
        engine.host_pool(x)
    assert seen == ["pinned_host"]
    monkeypatch.setattr(engine, "memory_type", lambda a: "host")
    out = engine.host_pool(x)
    assert out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    def no_nvcc(a):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(engine, "memory_type", no_nvcc)  # cannot ask: a warning, not a stop
    with pytest.warns(UserWarning, match="placement was not checked"):
        engine.host_pool(x)
    monkeypatch.setattr(engine, "memory_type", lambda a: pytest.fail("queried an empty pool"))
    assert engine.host_pool(x[:0]).size == 0  # no buffer address to ask about (a 1-layer model's pool)
    monkeypatch.setattr(engine, "_on_cuda", lambda dev: False)  # CPU: nothing to ask CUDA
    monkeypatch.setattr(engine, "memory_type", lambda a: pytest.fail("queried off CUDA"))
    engine.host_pool(x)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,copy_start,copy_in_graph", [("sparse", "lanes", False), ("sparda", "lanes", False),
                                                           ("sparda", "one", False), ("sparse", "lanes", True),
                                                           ("sparda", "lanes", True), ("sparda", "graph", True),
                                                           ("sparda", "doorbell", True)])
def test_cuda_copy_engine_equals_reference_copies(setup, mode, copy_start, copy_in_graph):
    """On the GPU: the UVA gather (asynchronous start/wait in sparda, K and V on two lanes or
    in one start) and the in-place write-back of completed blocks give the reference copy
    path's logits and counts; so do the synchronous gather and the write-back recorded into
    XLA's CUDA graphs (copy_in_graph), sparda's prefetch as that gather beside the previous
    layer's work (copy_start "graph", CONCURRENT graph scheduling), and as jobs of the doorbell's
    persistent server (copy_start "doorbell")."""
    cuda, c1, s1 = _run(setup, mode, copy_impl="cuda", copy_start=copy_start, copy_in_graph=copy_in_graph)
    ref, c0, s0 = _run(setup, mode, copy_impl="xla")
    np.testing.assert_allclose(cuda, ref, atol=2e-5)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


@pytest.mark.gpu
@pytest.mark.parametrize("topk_impl", ["mosaic_gpu", "xla_count"])
@pytest.mark.parametrize("mode,copy_start", [("sparse", "lanes"), ("sparda", "doorbell")])
def test_cuda_step_with_the_topk_kernel_equals_xla_topk(setup, mode, copy_start, topk_impl):
    """The compiled Mosaic top-k, and the top-k by counting, in the GPU step select XLA's blocks:
    the same copies exactly, and the logits of the same blocks. Those are compared as the CUDA
    copy test compares them (atol 2e-5): the two programs are fused apart by XLA, which may order
    float sums differently around the swapped top-k."""
    kw = dict(copy_impl="cuda", copy_start=copy_start, copy_in_graph=True, steps=30)
    got, c1, s1 = _run(setup, mode, topk_impl=topk_impl, **kw)
    ref, c0, s0 = _run(setup, mode, **kw)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_cuda_copy_calls_update_in_place(setup, mode):
    """Inside the engine's jit on the GPU every copy call gets its cache as its output buffer
    (input_output_aliases kept): a call that got two buffers copies the whole cache on XLA's
    stream first, a cost in every layer of every step (the CPU twin's test says 0 there)."""
    from sparda_jax.kernels.copy_engine import unaliased_copies

    unaliased_copies("cuda", reset=True)
    _run(setup, mode, copy_impl="cuda", steps=20)
    assert unaliased_copies("cuda") == (0, 0)


needs_cxx = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="no host C++ compiler for the host_ffi twin")


@needs_cxx
@pytest.mark.parametrize("mode,copy_start", [("sparse", "lanes"), ("sparda", "lanes"), ("sparda", "one"),
                                             ("sparda", "graph"), ("sparda", "doorbell")])
def test_host_ffi_copy_engine_equals_reference_copies(setup, mode, copy_start):
    """The CUDA path's custom calls run by their CPU twin (kernels/copy/gather_blocks_host.cc):
    what XLA does to the start/wait pairs inside the engine's jit is checked here, in CI. Every
    start's buffer must reach its own wait (none left in flight after a step). "graph": the
    prefetch is the synchronous in-graph gather, compiled with CONCURRENT graph scheduling."""
    from sparda_jax.kernels.copy_engine import host_copies_in_flight

    from sparda_jax.kernels.copy_engine import unaliased_copies

    unaliased_copies("host_ffi", reset=True)
    ffi, c1, s1 = _run(setup, mode, copy_impl="host_ffi", steps=30, copy_start=copy_start,
                       copy_in_graph=copy_start == "graph")
    assert host_copies_in_flight() == 0
    # XLA kept every call's aliasing: no handler had to copy a whole cache before its own copy
    assert unaliased_copies("host_ffi") == (0, 0)
    if copy_start in ("graph", "doorbell"):  # no asynchronous start is left to cut XLA's graph
        from sparda_jax.infer import engine

        params, forecast, _ = setup
        _, st = engine_prefill(params, jnp.ones((2, 70), jnp.int32), jnp.array([70, 59]), TINY, mode=mode,
                               cache_size=100, forecast=forecast)
        plan = decode_plan(TINY, mode, st.cache, copy_impl="host_ffi", copy_start=copy_start)
        assert engine._scheduling(plan) == ("CONCURRENT" if copy_start == "graph" else None)
        hlo = engine._decode_program(plan).lower(params, jnp.ones(2, jnp.int32), jnp.array([70, 59]), st, forecast,
                                                 None, plan=plan).as_text()
        assert "sparda_gather_start" not in hlo and "sparda_gather_wait" not in hlo
        if copy_start == "graph":
            assert "sparda_gather_blocks" in hlo
        else:  # one serve a step, one ring and one wait per offloaded layer
            calls = lambda t: hlo.count(f'custom_call_target = "{t}"') + hlo.count(f'@{t}(')
            n = TINY.num_layers - 1
            assert (calls("sparda_doorbell_serve"), calls("sparda_doorbell_ring"), calls("sparda_doorbell_wait")) \
                == (1, n, n), hlo.count("sparda_doorbell")
    ref, c0, s0 = _run(setup, mode, copy_impl="xla", steps=30)
    np.testing.assert_allclose(ffi, ref, atol=2e-5)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


@needs_cxx
def test_host_ffi_doorbell_timeline_orders_each_job(tmp_path):
    """The doorbell's timeline (the GPU's %globaltimer marks, the twin's host clock): for each job
    the ring, the copy and the wait in protocol order, one job after another in a step whose
    rings follow the previous waits; and the decode benchmark's doorbell row carries it."""
    from sparda_jax.bench.decode import bench_decode
    from sparda_jax.kernels.copy_engine import (doorbell_serve, doorbell_timeline, gather_blocks_ring,
                                                gather_blocks_ring_wait, reset_host_copies_in_flight)

    reset_host_copies_in_flight()
    pool = jax.random.normal(jax.random.key(1), (6, 4, 8))
    cache = jax.random.normal(jax.random.key(2), (3, 4, 8))
    src, dst = jnp.array([4, 1, 5], jnp.int32), jnp.array([0, 2, 1], jnp.int32)

    def step(pool, cache):
        s = doorbell_serve(src, n_jobs=3, implementation="host_ffi")
        for j in range(3):
            cache = gather_blocks_ring(pool, s, dst, cache, job=j, implementation="host_ffi")
            cache = gather_blocks_ring_wait(cache, s, dst, s, job=j, implementation="host_ffi")
            s = s + 0 * cache[0, 0, :1].astype(jnp.int32)  # the next ring after this wait
        return cache

    jax.jit(step)(pool, cache).block_until_ready()
    t = doorbell_timeline(3, "host_ffi")
    marks = np.stack([t[m] for m in ("ring", "copy_begin", "copy_end", "wait_begin", "wait_end")], 1)  # [job, mark]
    assert np.isfinite(marks).all() and (marks > 0).all()
    assert (np.diff(marks, axis=1) >= 0).all()  # ring <= copy <= copy end <= wait <= wait end
    assert (marks[1:, 0] >= marks[:-1, 4]).all()  # each ring after the previous job's wait
    assert np.isnan(doorbell_timeline(4, "host_ffi")["ring"][3])  # beyond the step's 3 jobs
    with pytest.raises(RuntimeError, match="n_jobs outside"):
        doorbell_timeline(0, "host_ffi")
    with pytest.raises(ValueError, match="FFI implementation"):
        doorbell_timeline(3, "xla")

    r = bench_decode("tiny", lengths=(256,), batches=(8,), modes=("sparda",), layers=3, steps=3, warmup=1,
                     reuse_fractions=(), copy_impl="host_ffi", copy_start="doorbell", with_ceilings=False,
                     budget_s=None, overlap=True, out=tmp_path / "d.json", log=lambda s: None)
    (row,) = [x for x in r["rows"] if x["status"] == "ok"]
    tl = row["doorbell_timeline"]
    assert tl["steps"] == 3 and tl["jobs"] == 2 and tl["median_copy_us"] >= 0 and tl["median_window_us"] > 0
    assert len(tl["per_job_us"]["ring"]) == 2
    ring = np.array(tl["per_job_us"]["ring"])
    assert tl["median_ring_interval_us"] > 0 and ring[1] > ring[0]
    # compute alone (no data moved) records its own timeline, from its own synchronous steps
    ct = row["overlap"]["compute_alone_doorbell_timeline"]
    assert ct["steps"] == 3 and ct["jobs"] == 2 and ct["median_ring_interval_us"] > 0 and ct["median_stall_us"] >= 0
    from sparda_jax.bench.decode import table

    lines = table(r).splitlines()
    assert any(ln.startswith("overlap") and "compute alone" in ln and "ring to ring" in ln for ln in lines)
    assert any(ln.startswith("doorbell timeline") and "ring to ring" in ln for ln in lines)


@pytest.mark.gpu
def test_cuda_decode_bench_doorbell_rows_carry_the_timeline(tmp_path):
    """Through the benchmark's default copy implementation (what the CLI runs): "cuda" on the GPU,
    so the doorbell row records the device timeline. Run with CUDA_MODULE_LOADING=EAGER (stage
    doorbell), as the CLI sets it."""
    from sparda_jax.bench.decode import bench_decode

    r = bench_decode("tiny", lengths=(256,), batches=(8,), modes=("sparda",), layers=3, steps=3, warmup=1,
                     reuse_fractions=(), copy_start="doorbell", with_ceilings=False, budget_s=None,
                     out=tmp_path / "d.json", log=lambda s: None)
    (row,) = [x for x in r["rows"] if x["status"] == "ok"]
    tl = row["doorbell_timeline"]
    assert tl["steps"] == 3 and tl["jobs"] == 2 and tl["median_copy_us"] is not None and tl["median_copy_us"] >= 0


@needs_cxx
def test_host_ffi_doorbell_refuses_a_step_that_rang_too_few_jobs():
    """The doorbell's server copies a step's jobs 0..n_jobs-1 in order; a step that rings fewer
    would leave the GPU's server waiting. The CPU twin says so at the next serve, and refuses a
    ring out of order and a wait on another job than its cache's ring."""
    from sparda_jax.kernels.copy_engine import (doorbell_serve, gather_blocks_ring, gather_blocks_ring_wait,
                                                reset_host_copies_in_flight)

    pool = jax.random.normal(jax.random.key(0), (6, 4, 8))
    cache = jnp.zeros((3, 4, 8))
    src, dst = jnp.array([4, 1, -1], jnp.int32), jnp.array([0, 2, 1], jnp.int32)

    def step(pool, cache, n_jobs, jobs):
        s = doorbell_serve(src, n_jobs=n_jobs, implementation="host_ffi")
        for j in jobs:
            cache = gather_blocks_ring(pool, s, dst, cache, job=j, implementation="host_ffi")
            cache = gather_blocks_ring_wait(cache, s, dst, s, job=j, implementation="host_ffi")
        return cache

    reset_host_copies_in_flight()
    out = jax.jit(step, static_argnums=(2, 3))(pool, cache, 2, (0, 1))
    np.testing.assert_array_equal(out[0], pool[4])
    np.testing.assert_array_equal(out[2], pool[1])
    short = jax.jit(step, static_argnums=(2, 3))
    short(pool, cache, 2, (0,)).block_until_ready()  # rings 1 of its 2 jobs
    with pytest.raises(Exception, match="rang 1 of its 2 jobs"):
        short(pool, cache, 2, (0,)).block_until_ready()
    reset_host_copies_in_flight()
    with pytest.raises(Exception, match="ring of job 1 where the server expects job 0"):
        short(pool, cache, 2, (1,)).block_until_ready()
    reset_host_copies_in_flight()

    def crossed(pool, cache):  # job 0's cache waited on as job 1
        s = doorbell_serve(src, n_jobs=1, implementation="host_ffi")
        c = gather_blocks_ring(pool, s, dst, cache, job=0, implementation="host_ffi")
        return gather_blocks_ring_wait(c, s, dst, s, job=1, implementation="host_ffi")

    with pytest.raises(Exception, match="wait for job 1 on a cache rung as job 0"):
        jax.jit(crossed)(pool, cache).block_until_ready()
    reset_host_copies_in_flight()


@needs_cxx
def test_host_ffi_prefetch_with_two_layers_in_bf16():
    """The configuration that failed on the H200 ("a copy into this cache is already in
    flight"): 2 layers, so one layer-1 copy started in layer 0 and one dummy start in layer 1.
    Before the engine stopped passing started caches through an optimization barrier, XLA
    copied them ahead of their waits and this raised "wait without start"."""
    from sparda_jax import SparseConfig
    from sparda_jax.kernels.copy_engine import host_copies_in_flight

    from engine_runs import sparda_bf16_decode

    cfg = TINY.replace(num_layers=2, head_dim=64, sparse=SparseConfig(block_size=16, local_blocks=1, topk=4,
                                                                      dense_len=0, kernel_size=16, kernel_stride=8))
    # 20 steps cross a block boundary: completed blocks go to the host
    run = dict(tok_len=200, lengths=[90, 71], cache_size=160, steps=20)
    outs = {"host_ffi": sparda_bf16_decode(cfg, copy_impl="host_ffi", **run)}
    assert host_copies_in_flight() == 0
    outs["xla"] = sparda_bf16_decode(cfg, copy_impl="xla", **run)
    # the same copies in the same order: only bf16 fusion differences between the two programs
    np.testing.assert_allclose(outs["host_ffi"], outs["xla"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_offload_equals_resident_nosa(setup_nosa, mode):
    """NOSA: the cis stage of selection and the cis attention bias travel with the blocks."""
    resident, _, _ = _run(setup_nosa, mode, resident=True, config=TINY_NOSA)
    offload, copied, selected = _run(setup_nosa, mode, config=TINY_NOSA)
    np.testing.assert_allclose(offload, resident, atol=2e-5)
    assert 0 < copied < selected


def test_reuse_changes_only_the_copies(setup):
    with_reuse, c1, s1 = _run(setup, "sparda")
    without, c0, s0 = _run(setup, "sparda", reuse=False)
    np.testing.assert_allclose(with_reuse, without, atol=1e-6)
    # without reuse every selected block is copied but the one being written (one per layer,
    # sequence and KV head: (L-1) * B * K per step)
    per_step = (TINY.num_layers - 1) * 2 * TINY.num_kv_heads
    assert s1 == s0 and c0 >= s0 - per_step * 48 and c1 < c0


def test_more_slots_fewer_copies(setup):
    _, few, _ = _run(setup, "sparse", n_slots=4)
    _, many, _ = _run(setup, "sparse", n_slots=9)
    assert many < few


def test_engine_errors(setup):
    params, forecast, ig = setup
    with pytest.raises(ValueError, match="unknown engine mode"):
        engine_prefill(params, jnp.zeros((1, 32), jnp.int32), jnp.array([32]), TINY, mode="quest", cache_size=64)
    with pytest.raises(ValueError, match="n_slots"):
        engine_prefill(params, jnp.zeros((1, 32), jnp.int32), jnp.array([32]), TINY, mode="sparse", cache_size=64,
                       n_slots=2)
    _, st = engine_prefill(params, jnp.ones((1, 70), jnp.int32), jnp.array([70]), TINY, mode="sparda", cache_size=80,
                           forecast=forecast)
    with pytest.raises(ValueError, match="copy_start must be one of"):
        decode_plan(TINY, "sparda", st.cache, copy_start="late")
    with pytest.raises(ValueError, match="needs copy_in_graph"):
        decode_plan(TINY, "sparda", st.cache, copy_start="graph", copy_in_graph=False)
    with pytest.raises(ValueError, match="graph_scheduling must be"):
        decode_plan(TINY, "sparda", st.cache, graph_scheduling="concurrent")


@needs_cxx
@pytest.mark.parametrize("mode,copy_impl,copy_start", [
    ("sparda", "host_ffi", "doorbell"), ("sparse", "xla", "lanes"), ("sparse_resident", None, "lanes"),
    # on the GPU (the doorbell with eager module loading, as the CLI sets it: gpu_session.sh tests-loop)
    pytest.param("sparda", "cuda", "doorbell", marks=pytest.mark.gpu),
    pytest.param("sparda", "cuda", "lanes", marks=pytest.mark.gpu),
    pytest.param("sparse", "cuda", "lanes", marks=pytest.mark.gpu)])
def test_decode_steps_in_one_program_equal_the_steps_called_one_by_one(setup, mode, copy_impl, copy_start):
    """`engine_decode_steps` runs n steps as one program (a loop of static trip count, so XLA
    records its graphs once): the same logits, state and counters as n calls of the step, here
    across a block boundary (one block completes and is written back mid-loop). With the copy
    calls' CPU twin every start's buffer reaches its own wait inside its iteration, and no call
    is handed a copy of its cache; on the GPU the CUDA calls keep their aliasing in the loop too."""
    from sparda_jax.infer.engine import engine_decode_steps
    from sparda_jax.kernels.copy_engine import host_copies_in_flight, unaliased_copies

    params, forecast, ig = setup
    b, t0, n = 2, 70, 12
    tokens = jax.random.randint(jax.random.key(7), (b, t0 + n), 0, TINY.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)  # row 0 completes block 4 (tokens 64..79) at step 9
    pos = np.asarray(lengths)[None] + np.arange(n)[:, None]  # [n, B]
    toks = np.asarray(tokens)[np.arange(b)[None], pos]
    kw = dict(mode=mode, forecast=forecast, infinigen=ig)
    if mode not in ("dense_resident", "sparse_resident"):
        kw.update(copy_impl=copy_impl, copy_start=copy_start)

    def fresh():
        return engine_prefill(params, tokens[:, :t0], lengths, TINY, mode=mode, cache_size=t0 + n, forecast=forecast,
                              infinigen=ig)[1]

    st, one, copied = fresh(), [], []
    for i in range(n):
        logits, st, stats = engine_decode_step(params, toks[i], pos[i], st, TINY, **kw)
        one.append(logits)
        copied.append(int(stats["copied_blocks"]))
    unaliased_copies(copy_impl or "xla", reset=True)
    loop, st_loop, stats = engine_decode_steps(params, toks, pos, fresh(), TINY, **kw)
    assert loop.shape == (n, b, TINY.vocab_size) and stats["copied_blocks"].shape == (n,)
    # the same step, compiled inside a loop: XLA may fuse (and so order f32 sums) differently there
    np.testing.assert_allclose(np.asarray(loop), np.asarray(jnp.stack(one)), rtol=0, atol=2e-5)

    def same(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.integer):  # block tables, slots: exactly
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=0, atol=2e-5)
    jax.tree.map(same, st_loop, st)
    assert list(np.asarray(stats["copied_blocks"])) == copied
    if copy_impl == "host_ffi":
        assert host_copies_in_flight() == 0
    if copy_impl in ("host_ffi", "cuda"):
        assert unaliased_copies(copy_impl) == (0, 0)
    if mode == "sparse":  # something moved after the first step, so the equality above says something
        assert copied[0] > 0 and sum(copied[1:]) > 0
        with pytest.raises(ValueError, match=r"take the shape \[n, B\]"):
            engine_decode_steps(params, toks[0], pos[0], st, TINY, **kw)
        with pytest.raises(ValueError, match="sequences"):
            engine_decode_steps(params, toks[:, :1], pos[:, :1], st, TINY, **kw)
        with pytest.raises(TypeError, match="integers"):
            engine_decode_steps(params, toks.astype(np.float32), pos, st, TINY, **kw)


def test_memory_report_minicpm_128k():
    c = get_preset("minicpm4.1-8b")
    r = memory_report(c, batch=1, context=131072)
    # 128K tokens of MiniCPM4.1-8B KV: 32 layers x 2 (K, V) x 131072 x 2 heads x 128 x 2 bytes
    assert r["host total"] + r["device: layer 0 K/V"] == 32 * 2 * 131072 * 2 * 128 * 2  # ~4.3 GB (BENCHMARKS.md)
    n_c = (131072 - 32) // 16 + 1  # compressed keys: ~1/16 of K, every layer, on the device
    assert r["device: compressed keys"] == 32 * n_c * 2 * 128 * 2
    assert r["device: block cache"] == 2 * 31 * 2 * 96 * 64 * 128 * 2  # topk slots per layer and head
    assert r["device total"] < 0.12 * r["host total"]


def test_generation_through_the_engine_matches_resident(setup):
    from sparda_jax.infer.generate import SamplingConfig, generate

    params, forecast, _ = setup
    prompts = [list(range(1, 80)), list(range(5, 70))]
    cfg = SamplingConfig(max_new_tokens=40)
    resident = generate(params, TINY, prompts, cfg, mode="sparda", forecast=forecast)
    offload, stats = generate(params, TINY, prompts, cfg, system="sparda", forecast=forecast, return_stats=True)
    assert offload == resident
    from sparda_jax import layered_params  # per-layer weights: prefill stacks them back, decode reads them
    assert generate(layered_params(params), TINY, prompts, cfg, system="sparda", forecast=forecast) == resident
    assert stats["steps"] == 39 and 0 < stats["copied_blocks"] < stats["selected_blocks"]


def test_generation_stops_where_a_stop_token_comes_and_counts_only_the_steps_it_used(setup):
    """The loop dispatches the next step before it reads a token: a step run past the last
    sequence's stop token must not show, in the tokens or in the counters."""
    from sparda_jax.infer.generate import SamplingConfig, generate

    params, forecast, _ = setup
    prompt = [list(range(3, 75))]
    free, free_stats = generate(params, TINY, prompt, SamplingConfig(max_new_tokens=12), system="sparse",
                                return_stats=True)
    k = next(i for i in range(3, 12) if free[0][i] not in free[0][:i])  # first occurrence, past a few steps
    cut, stats = generate(params, TINY, prompt, SamplingConfig(max_new_tokens=12), system="sparse",
                          stop_ids=[free[0][k]], return_stats=True)
    assert cut == [free[0][:k]] and free_stats["steps"] == 11
    assert stats["steps"] == k  # the decode steps that produced tokens 1..k, not one more
    assert 0 < stats["selected_blocks"] < free_stats["selected_blocks"]


def test_generation_in_device_calls_equals_the_one_step_loop(setup):
    """steps_per_call: the engine draws the tokens on the device, several steps a program
    (`engine_generate_steps`); with the keys the one-step loop splits, the tokens, the streamed
    prefixes and the counters are the same, sampled or greedy, a stop token mid-call included
    (its call's later steps are discarded uncounted)."""
    from sparda_jax.infer.engine import engine_generate_steps
    from sparda_jax.infer.generate import SamplingConfig, generate

    params, forecast, _ = setup
    prompts = [list(range(1, 80)), list(range(5, 70))]
    sampled = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=9, seed=3)  # 8 steps: two calls of 4
    runs = []
    for k in (1, 4):
        seen = []
        runs.append((generate(params, TINY, prompts, sampled, system="sparda", forecast=forecast, return_stats=True,
                              steps_per_call=k, on_step=lambda o: seen.append([list(x) for x in o])), seen))
    (one, one_seen), (calls, calls_seen) = runs
    assert calls == one and calls_seen == one_seen and one[1]["steps"] == 8
    greedy = SamplingConfig(max_new_tokens=9)
    free = generate(params, TINY, [prompts[0]], greedy, system="sparse")[0]
    k = next(i for i in range(5, 8) if free[i] not in free[:i])  # a stop token inside the second call
    cut = [generate(params, TINY, [prompts[0]], greedy, system="sparse", stop_ids=[free[k]], return_stats=True,
                    steps_per_call=n) for n in (1, 4)]
    assert cut[0] == cut[1] and cut[0][0] == [free[:k]] and cut[0][1]["steps"] == k
    with pytest.raises(ValueError, match="engine system"):
        generate(params, TINY, prompts, greedy, mode="sparda", forecast=forecast, steps_per_call=4)
    _, st = engine_prefill(params, jnp.ones((2, 70), jnp.int32), jnp.array([70, 59]), TINY, mode="sparse",
                           cache_size=90)
    pos = np.array([[70, 59], [71, 60]])
    with pytest.raises(ValueError, match="one key per step"):
        engine_generate_steps(params, jnp.ones(2, jnp.int32), pos, jax.random.split(jax.random.key(0), 3), st, TINY,
                              mode="sparse")
    with pytest.raises(ValueError, match="one first token per sequence"):
        engine_generate_steps(params, jnp.ones((2, 2), jnp.int32), pos, jax.random.split(jax.random.key(0), 2), st,
                              TINY, mode="sparse")


def test_lane_ctas_split_the_quota_by_bytes():
    from sparda_jax.kernels.copy_engine import lane_ctas

    k = jnp.zeros((4, 64, 128), jnp.bfloat16)  # 16 KB blocks
    cis = jnp.zeros((4, 64, 1), jnp.float32)   # 256 B
    assert lane_ctas(16, [k, k]) == [8, 8]
    assert lane_ctas(16, [k, k, cis]) == [8, 8, 1]  # the small payload still gets a CTA
    assert lane_ctas(1, [k, k]) == [1, 1]


def test_skip_copies_moves_no_data_but_keeps_the_bookkeeping(setup):
    """skip_copies (timing only): the same slot/table bookkeeping and copy counts, but no block
    arrives: the cache (zero after prefill) holds only the new tokens' writes, so the logits
    differ. Only step 0's counts and layer 1's table are comparable: from layer 2 on the stale
    attention output changes the queries, hence the selections."""
    params, _, _ = setup
    b, t0, steps = 2, 70, 4
    tokens = jax.random.randint(jax.random.key(4), (b, t0 + steps), 0, TINY.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)  # positions 70..73 and 59..62: no block completes
    prompt = jnp.where(jnp.arange(t0)[None] < lengths[:, None], tokens[:, :t0], 0)
    runs = {}
    for skip in (False, True):
        _, st = engine_prefill(params, prompt, lengths, TINY, mode="sparse", cache_size=t0 + steps)
        pos, out = lengths, []
        for _ in range(steps):
            logits, st, stats = engine_decode_step(params, tokens[jnp.arange(b), pos], pos, st, TINY, mode="sparse",
                                                   skip_copies=skip)
            out.append((np.asarray(logits), int(stats["copied_blocks"]), int(stats["selected_blocks"]),
                        np.asarray(st.table[0])))
            pos = pos + 1
        runs[skip] = out, np.stack([np.asarray(c["k"]) for c in st.cache])
    (normal, k_n), (skipped, k_s) = runs[False], runs[True]
    assert normal[0][1:3] == skipped[0][1:3] and normal[0][1] == normal[0][2] > 0  # cold cache: all copied
    np.testing.assert_array_equal(normal[0][3], skipped[0][3])
    assert not np.allclose(normal[0][0], skipped[0][0], atol=1e-3)
    written = (TINY.num_layers - 1) * b * TINY.num_kv_heads * steps  # one key vector per step, layer, row, head
    assert np.count_nonzero(np.any(k_s != 0, axis=-1)) == written
    assert np.count_nonzero(np.any(k_n != 0, axis=-1)) > written


def _entry_users(hlo: str, index: int) -> list[str]:
    """The instructions of an optimized module's entry computation that read parameter `index`."""
    import re

    entry = hlo[hlo.index("\nENTRY"):].split("\n}")[0].splitlines()[1:]
    name = next(re.match(r"\s*%?([\w.\-]+)", line).group(1) for line in entry if f"parameter({index})" in line)
    return [line.split("=")[0].strip() for line in entry
            if re.search(r"[(, ]%?" + re.escape(name) + r"[,)]", line) and "parameter(" not in line]


def _positions_witness(params, tokens, lengths, forecast):
    """Without `_own_buffer`, many ops of the tiny model's step read the positions input
    directly: the witness that the one-reader check above can fail. XLA re-records every CUDA
    graph that reads an input whose buffer moved since the last step, and the positions are a
    new buffer each step that every layer reads."""
    from sparda_jax.infer import engine

    _, st = engine_prefill(params, jnp.zeros((2, 70), jnp.int32), lengths, TINY, mode="sparda", cache_size=86,
                           forecast=forecast)
    plan = engine.decode_plan(TINY, "sparda", st.cache, copy_impl="host_ffi")
    own = engine._own_buffer
    engine._own_buffer = lambda x: x
    engine._engine_decode.clear_cache()  # retrace with the patch
    try:
        hlo = engine._engine_decode.lower(params, tokens, lengths, st, forecast, None, plan=plan).compile().as_text()
        assert len(_entry_users(hlo, len(jax.tree.leaves(params)) + 1)) > 10
    finally:
        engine._own_buffer = own
        engine._engine_decode.clear_cache()  # later calls trace the real step again
