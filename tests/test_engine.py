"""The offload engine reproduces the resident systems token for token, on the CPU."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import get_preset, init_forecast, init_model
from sparda_jax.infinigen import infinigen_setup
from sparda_jax.config import ConfigError, Implementations
from sparda_jax.infer.engine import (EngineConfig, engine_decode_step, engine_prefill, memory_report, resolve,
                                    selector_of)
from sparda_jax.modes import decode_step, prefill

TINY = get_preset("tiny")  # blocks of 16, init 1, local 1, topk 4
TINY_NOSA = get_preset("tiny-nosa")

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="no host C++ compiler for the host_ffi twin")


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


def engine_config(mode, *, copy_impl=None, kernels=None, **kw) -> EngineConfig:
    """kernels: more `Implementations` fields, e.g. {"copy_plan": "triton_interpret"}."""
    return EngineConfig(mode, implementations=Implementations(kv_copy=copy_impl, **(kernels or {})), **kw)


def _run(setup, mode, *, reuse=True, resident=False, steps=60, n_slots=None, config=TINY, copy_impl=None,
         kernels=None, engine_kw=None):
    params, forecast, ig = setup
    b, t0 = 2, 70
    tokens = jax.random.randint(jax.random.key(4), (b, t0 + steps), 0, config.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)
    prompt = jnp.where(jnp.arange(t0)[None] < lengths[:, None], tokens[:, :t0], 0)
    kw = dict(forecast=forecast, infinigen=ig)
    eng = engine_config(mode, copy_impl=copy_impl, kernels=kernels, reuse=reuse, n_slots=n_slots, **(engine_kw or {}))
    if resident:
        last, st = prefill(params, prompt, lengths, config, cache_size=t0 + steps, mode=selector_of(mode), **kw)
    else:
        last, st = engine_prefill(params, prompt, lengths, config, eng, cache_size=t0 + steps, **kw)
    out, copied, selected = [last], 0, 0
    pos = lengths
    for _ in range(steps - 12):
        tok = tokens[jnp.arange(b), pos]
        if resident:
            logits, st = decode_step(params, tok, pos, st, config, mode=selector_of(mode), **kw)
        else:
            logits, st, stats = engine_decode_step(params, tok, pos, st, config, eng, **kw)
            copied += int(stats["copied_blocks"])
            selected += int(stats["selected_blocks"])
        out.append(logits)
        pos = pos + 1
    return jnp.stack(out), copied, selected


@pytest.mark.parametrize("mode", ["sparse", "sparda_sync", "sparda", "infinigen"])
def test_offload_equals_resident(setup, mode):
    """Many decode steps across block boundaries (blocks complete and go to the host)."""
    resident, _, _ = _run(setup, mode, resident=True)
    offload, copied, selected = _run(setup, mode)
    np.testing.assert_allclose(offload, resident, atol=2e-5)
    assert 0 < copied < selected  # the cache reused blocks


@pytest.mark.parametrize("mode,dense,copy_impl", [
    ("sparse", (1,), None), ("sparda", (1,), None), ("sparda", (2,), None), ("sparda_sync", (0, 2), None),
    ("sparda", (0,), None),
    ("infinigen", (1,), None), pytest.param("sparda", (1,), "host_ffi", marks=needs_cxx, id="sparda-1-host_ffi")])
def test_offload_with_dense_layers_equals_resident(setup, mode, dense, copy_impl):
    """A dense layer (`sparse.dense_layers`) keeps its KV on the device and attends to all of it;
    the others offload as before: the tokens' logits are the resident decode's of the same
    config, and differ from those of the config without dense layers."""
    import dataclasses

    config = TINY.replace(sparse=dataclasses.replace(TINY.sparse, dense_layers=dense))
    resident, _, _ = _run(setup, mode, resident=True, config=config, steps=30)
    offload, copied, selected = _run(setup, mode, config=config, copy_impl=copy_impl, steps=30)
    np.testing.assert_allclose(offload, resident, atol=2e-5)
    assert 0 < copied < selected
    without, _, _ = _run(setup, mode, resident=True, steps=30)
    assert float(jnp.abs(without[1:] - resident[1:]).max()) > 1e-3
    params, forecast, ig = setup
    _, st = engine_prefill(params, jnp.ones((1, 40), jnp.int32), jnp.array([40]), config, engine_config(mode),
                           cache_size=64, forecast=forecast, infinigen=ig)
    off = [i for i in range(1, TINY.num_layers) if i not in dense]
    assert st.host["k"].shape[0] == len(off) and len(st.offloaded) == len(off)
    assert [type(ly).__name__ for ly in st.layers] == ["OffloadLayer" if i in off else "DecodeState"
                                                       for i in range(1, TINY.num_layers)]


def test_every_layer_dense_has_nothing_to_offload(setup):
    import dataclasses

    config = TINY.replace(sparse=dataclasses.replace(TINY.sparse, dense_layers=(1, 2)))
    with pytest.raises(ValueError, match="nothing to offload"):
        engine_prefill(setup[0], jnp.ones((1, 20), jnp.int32), jnp.array([20]), config, EngineConfig("sparse"),
                       cache_size=64)


@pytest.mark.parametrize("mode", ["dense_resident", "sparse_resident"])
def test_engine_resident_modes_equal_the_stacked_decode(setup, mode):
    """Dense+ and Sparse+ in the engine decode a per-layer state (`layered_state`, each layer's
    K/V updated in place); the tokens' logits are those of `modes.decode_step` on the stacked one."""
    params, forecast, ig = setup
    stacked, _, _ = _run(setup, mode, resident=True, steps=30)
    engine, copied, selected = _run(setup, mode, steps=30)
    np.testing.assert_allclose(engine, stacked, atol=2e-5)
    assert copied == selected == 0
    _, st = engine_prefill(params, jnp.ones((1, 20), jnp.int32), jnp.array([20]), TINY, EngineConfig(mode), cache_size=64)
    assert isinstance(st, tuple) and len(st) == TINY.num_layers and st[0].kv.k.ndim == 4


def test_engine_step_on_per_layer_weights_slices_none(setup):
    """`layered_params`: the engine's layer loop (the copy custom calls' CPU twin, as the CUDA
    path runs) gives the stacked weights' logits, and its compiled step (CPU HLO) slices no
    backbone weight, where on the stacked tree every layer's are slices (the test's witness: on
    the GPU XLA copied the o_proj slice, as it feeds a cuBLAS GEMM). On either tree the
    compiled step reads its positions input in one op (`_own_buffer`; witness:
    `_positions_witness`). Both checks share this test's compiles, to keep the suite short."""
    import re

    from sparda_jax.infer.engine import _engine_decode
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
        eng = engine_config("sparda", copy_impl="host_ffi")
        _, st = engine_prefill(params, tokens[:, :t0], lengths, TINY, eng, cache_size=t0 + 16, forecast=forecast)
        run_, st = resolve(p, lengths, st, TINY, eng, forecast=forecast)
        hlo = _engine_decode.lower(p, tokens[:, t0], lengths, st, forecast, None, run=run_).compile().as_text()
        sliced = [m.group(1) for m in re.finditer(r"=\s*\w+\[([\d,]*)\]\S*\s+(?:slice|copy|dynamic-slice)\(", hlo)
                  if m.group(1) in shapes]
        # the positions input (after params and tokens) is read by one op (`_own_buffer`)
        assert len(_entry_users(hlo, len(jax.tree.leaves(p)) + 1)) == 1
        out, pos = [], lengths
        for i in range(6):
            logits, st, _ = engine_decode_step(p, tokens[jnp.arange(b), t0 + i], pos, st, TINY, eng,
                                               forecast=forecast)
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
                           EngineConfig("sparda"), forecast=forecast)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,copy_start", [("sparse", "lanes"), ("sparda", "lanes"), ("sparda", "one")])
def test_cuda_copy_engine_equals_reference_copies(setup, mode, copy_start):
    """On the GPU: the UVA gather (sparda: asynchronous start/wait, one lane per payload or one
    start of every payload) and the in-place write-back of completed blocks give the reference
    copy path's logits and counts. Both copy paths are also held to the resident run (no
    copies), so that a mismatch says which path moved. The programs run at full f32: the GPU's
    default f32 matmul is TF32, and programs that fuse differently then part by ~1e-4 (H100)."""
    with jax.default_matmul_precision("highest"):
        cuda, c1, s1 = _run(setup, mode, copy_impl="cuda", engine_kw={"copy_start": copy_start})
        ref, c0, s0 = _run(setup, mode, copy_impl="xla")
        resident = np.asarray(_run(setup, mode, resident=True)[0])
    for name, got in (("cuda", cuda), ("xla", ref)):
        diff = np.abs(np.asarray(got) - resident).max(axis=-1)  # [step, batch]
        first = np.argwhere(diff > 2e-5)[:1].tolist()
        # the same math in f32 programs that may fuse differently
        assert not first, f"{name} copy path left the resident run at (step, batch) {first[0]}: max {diff.max():.2e}"
    np.testing.assert_allclose(cuda, ref, atol=2e-5)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_cuda_copy_calls_update_in_place(setup, mode):
    """Inside the engine's jit on the GPU every copy call gets its cache as its output buffer
    (input_output_aliases kept): a call that got two buffers copies the whole cache on XLA's
    stream first, a cost in every layer of every step (the CPU twin's test says 0 there)."""
    from sparda_jax.kernels.kv_copy import unaliased_copies

    unaliased_copies("cuda", reset=True)
    _run(setup, mode, copy_impl="cuda", steps=20)
    assert unaliased_copies("cuda") == (0, 0)



@needs_cxx
@pytest.mark.parametrize("mode", ["sparse", "sparda"])
def test_host_ffi_copy_engine_equals_reference_copies(setup, mode):
    """The CUDA path's custom calls run by their CPU twin: what XLA does to the start/wait pairs
    inside the engine's jit is checked here, in CI. Every start's buffer must reach its own wait
    (none left in flight after a step), and no call is handed a copy of its cache."""
    from sparda_jax.kernels.kv_copy import host_copies_in_flight, unaliased_copies

    unaliased_copies("host_ffi", reset=True)
    ffi, c1, s1 = _run(setup, mode, copy_impl="host_ffi", steps=30)
    assert host_copies_in_flight() == 0
    assert unaliased_copies("host_ffi") == (0, 0)
    ref, c0, s0 = _run(setup, mode, copy_impl="xla", steps=30)
    np.testing.assert_allclose(ffi, ref, atol=2e-5)
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


@needs_cxx
def test_one_start_per_layer_equals_the_lanes(setup):
    """copy_start="one" (the default: every payload in one start and one wait) through the CPU
    twin: the lanes' logits and counts, every start waited for, no cache handed over as a copy."""
    from sparda_jax.kernels.kv_copy import host_copies_in_flight, unaliased_copies

    unaliased_copies("host_ffi", reset=True)
    one, c1, s1 = _run(setup, "sparda", copy_impl="host_ffi", steps=30,
                       engine_kw={"copy_start": "one"})
    assert host_copies_in_flight() == 0
    assert unaliased_copies("host_ffi") == (0, 0)
    lanes, c0, s0 = _run(setup, "sparda", copy_impl="host_ffi", steps=30, engine_kw={"copy_start": "lanes"})
    np.testing.assert_array_equal(np.asarray(one), np.asarray(lanes))
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1
    with pytest.raises(ConfigError, match="EngineConfig.copy_start"):
        EngineConfig("sparda", copy_start="two")


@pytest.mark.parametrize("copy_impl", ["xla", pytest.param("host_ffi", marks=needs_cxx)])
@pytest.mark.parametrize("mode", ["sparse", "sparda", "infinigen"])
def test_engine_on_the_triton_kernels_equals_the_xla_engine(setup, mode, copy_impl):
    """The copy plan's and the top-k's Triton kernels (interpreted) inside the engine: the same
    logits and counts as its jnp path, in the scan over layers (xla copy: a traced pool row) and
    in the unrolled FFI path (the row offset in the task lists)."""
    kernels = {"copy_plan": "triton_interpret", "select": "triton_interpret"}
    got, c1, s1 = _run(setup, mode, copy_impl=copy_impl, kernels=kernels, steps=30)
    want, c0, s0 = _run(setup, mode, copy_impl=copy_impl, steps=30)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (c1, s1) == (c0, s0) and 0 < c1 < s1


@needs_cxx
def test_host_ffi_prefetch_with_two_layers_in_bf16():
    """The configuration that failed on the H200 ("a copy into this cache is already in
    flight"): 2 layers, so one layer-1 copy started in layer 0 and one dummy start in layer 1.
    Before the engine stopped passing started caches through an optimization barrier, XLA
    copied them ahead of their waits and this raised "wait without start"."""
    from sparda_jax import SparseConfig
    from sparda_jax.kernels.kv_copy import host_copies_in_flight

    from engine_runs import sparda_bf16_decode

    cfg = TINY.replace(num_layers=2, head_dim=64, sparse=SparseConfig(block_size=16, local_blocks=1, topk=4,
                                                                      dense_len=0, kernel_size=16, kernel_stride=8))
    # 20 steps cross a block boundary: completed blocks go to the host
    run = dict(tok_len=200, lengths=[90, 71], cache_size=160, steps=20)
    outs = {"host_ffi": sparda_bf16_decode(cfg, kv_copy="host_ffi", **run)}
    assert host_copies_in_flight() == 0
    outs["xla"] = sparda_bf16_decode(cfg, kv_copy="xla", **run)
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
    with pytest.raises(ConfigError, match="EngineConfig.system"):
        EngineConfig("quest")
    for bad in (dict(n_slots=0), dict(n_slots=4.0), dict(reuse=1), dict(num_ctas=0), dict(num_ctas="fast"),
                dict(implementations="xla")):
        with pytest.raises(ConfigError, match="EngineConfig." + next(iter(bad))):
            EngineConfig("sparse", **bad)
    with pytest.raises(ConfigError, match="n_slots"):
        engine_prefill(params, jnp.zeros((1, 32), jnp.int32), jnp.array([32]), TINY, EngineConfig("sparse", n_slots=2),
                       cache_size=64)
    _, st = engine_prefill(params, jnp.ones((1, 70), jnp.int32), jnp.array([70]), TINY, EngineConfig("sparda"),
                           cache_size=80, forecast=forecast)
    with pytest.raises(TypeError, match="OffloadState"):
        engine_decode_step(params, jnp.ones(1, jnp.int32), jnp.array([70]), st.l0, TINY, EngineConfig("sparda"),
                           forecast=forecast)
    with pytest.raises(ValueError, match="sequences"):
        engine_decode_step(params, jnp.ones(2, jnp.int32), jnp.array([70, 70]), st, TINY, EngineConfig("sparda"),
                           forecast=forecast)


@needs_cxx
@pytest.mark.parametrize("mode,copy_impl", [
    ("sparda", "host_ffi"), ("sparse", "xla"), ("sparse_resident", None),
    pytest.param("sparda", "cuda", marks=pytest.mark.gpu),
    pytest.param("sparse", "cuda", marks=pytest.mark.gpu)])
def test_decode_steps_in_one_program_equal_the_steps_called_one_by_one(setup, mode, copy_impl):
    """`engine_decode_steps` runs n steps as one program (a loop of static trip count, so XLA
    records its graphs once): the same logits, state and counters as n calls of the step, here
    across a block boundary (one block completes and is written back mid-loop). With the copy
    calls' CPU twin every start's buffer reaches its own wait inside its iteration, and no call
    is handed a copy of its cache; on the GPU the CUDA calls keep their aliasing in the loop too."""
    from sparda_jax.infer.engine import engine_decode_steps
    from sparda_jax.kernels.kv_copy import host_copies_in_flight, unaliased_copies

    params, forecast, ig = setup
    b, t0, n = 2, 70, 12
    tokens = jax.random.randint(jax.random.key(7), (b, t0 + n), 0, TINY.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)  # row 0 completes block 4 (tokens 64..79) at step 9
    pos = np.asarray(lengths)[None] + np.arange(n)[:, None]  # [n, B]
    toks = np.asarray(tokens)[np.arange(b)[None], pos]
    kw = dict(forecast=forecast, infinigen=ig)
    eng = engine_config(mode, copy_impl=copy_impl)

    def fresh():
        return engine_prefill(params, tokens[:, :t0], lengths, TINY, eng, cache_size=t0 + n, **kw)[1]

    st, one, copied = fresh(), [], []
    for i in range(n):
        logits, st, stats = engine_decode_step(params, toks[i], pos[i], st, TINY, eng, **kw)
        one.append(logits)
        copied.append(int(stats["copied_blocks"]))
    unaliased_copies(copy_impl or "xla", reset=True)
    loop, st_loop, stats = engine_decode_steps(params, toks, pos, fresh(), TINY, eng, **kw)
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
            engine_decode_steps(params, toks[0], pos[0], st, TINY, eng, **kw)
        with pytest.raises(ValueError, match="sequences"):
            engine_decode_steps(params, toks[:, :1], pos[:, :1], st, TINY, eng, **kw)
        with pytest.raises(TypeError, match="integers"):
            engine_decode_steps(params, toks.astype(np.float32), pos, st, TINY, eng, **kw)


def test_memory_report_minicpm_128k():
    c = get_preset("minicpm4.1-8b")
    r = memory_report(c, batch=1, context=131072)
    # 128K tokens of MiniCPM4.1-8B KV: 32 layers x 2 (K, V) x 131072 x 2 heads x 128 x 2 bytes
    assert r["host total"] + r["device: layer 0 K/V"] == 32 * 2 * 131072 * 2 * 128 * 2  # ~4.3 GB
    n_c = (131072 - 32) // 16 + 1  # compressed keys: ~1/16 of K, every layer, on the device
    assert r["device: compressed keys"] == 32 * n_c * 2 * 128 * 2
    assert r["device: block cache"] == 2 * 31 * 2 * 96 * 64 * 128 * 2  # topk slots per layer and head
    assert r["device total"] < 0.12 * r["host total"]
    import dataclasses

    two = memory_report(c.replace(sparse=dataclasses.replace(c.sparse, dense_layers=(5, 9))), batch=1, context=131072)
    per_layer = 2 * 131072 * 2 * 128 * 2
    assert two["device: dense layers' K/V"] == 2 * per_layer and two["host total"] == r["host total"] - 2 * per_layer
    assert two["device: block cache"] == r["device: block cache"] * 29 // 31


def test_generation_through_the_engine_matches_resident(setup):
    from sparda_jax.infer.generate import SamplingConfig, generate

    params, forecast, _ = setup
    prompts = [list(range(1, 80)), list(range(5, 70))]
    cfg = SamplingConfig(max_new_tokens=40)
    resident = generate(params, TINY, prompts, cfg, mode="sparda", forecast=forecast)
    offload, stats = generate(params, TINY, prompts, cfg, engine=EngineConfig("sparda"), forecast=forecast, return_stats=True)
    assert offload == resident
    from sparda_jax import layered_params  # per-layer weights: prefill stacks them back, decode reads them
    assert generate(layered_params(params), TINY, prompts, cfg, engine=EngineConfig("sparda"), forecast=forecast) == resident
    assert stats["steps"] == 39 and 0 < stats["copied_blocks"] < stats["selected_blocks"]


def test_generation_samples_the_first_token_before_the_kv_moves_to_the_host(setup, monkeypatch):
    """generate runs the prefill up to the host move (`engine_prefill_staged`), samples the first
    token and streams it, then moves the KV (`engine_offload`): the first token waits for no
    move. The two halves give `engine_prefill`'s state; a resident system has nothing to move."""
    from sparda_jax.infer import engine as E
    from sparda_jax.infer import generate as G

    params, forecast, _ = setup
    events, sample, pool = [], G.sample_next, E.host_pool
    monkeypatch.setattr(G, "sample_next", lambda *a, **kw: events.append("sample") or sample(*a, **kw))
    monkeypatch.setattr(E, "host_pool", lambda x: events.append("host") or pool(x))
    prompts = [list(range(1, 80))]
    for k in (1, 2):  # the one-step loop and calls of k steps
        events.clear()
        out = G.generate(params, TINY, prompts, G.SamplingConfig(max_new_tokens=3), engine=EngineConfig("sparda"),
                         forecast=forecast, steps_per_call=k, on_step=lambda o: events.append(f"token {len(o[0])}"))
        # K's and V's pools after the first token is shown
        assert events[:4] == ["sample", "token 1", "host", "host"], events
        assert out == G.generate(params, TINY, prompts, G.SamplingConfig(max_new_tokens=3), mode="sparda",
                                 forecast=forecast)
    tokens, lengths = jnp.asarray([list(range(1, 80))]), jnp.array([79])
    for system in ("sparda", "dense_resident"):
        eng = EngineConfig(system)
        last, staged = E.engine_prefill_staged(params, tokens, lengths, TINY, eng, cache_size=96, forecast=forecast)
        assert isinstance(staged, E.StagedOffload) == (system == "sparda")
        two = E.engine_offload(staged)
        one_last, one = engine_prefill(params, tokens, lengths, TINY, eng, cache_size=96, forecast=forecast)
        np.testing.assert_array_equal(np.asarray(last), np.asarray(one_last))
        assert jax.tree.structure(two) == jax.tree.structure(one)
        for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one)):
            assert a.sharding.memory_kind == b.sharding.memory_kind
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generation_sizes_the_cache_in_whole_blocks(setup, monkeypatch):
    """generate's cache holds whole blocks (the compiled decode kernel takes no partial one): a
    20-token prompt (padded to 64) + 5 new tokens gets 80 positions with TINY's 16-token blocks."""
    from sparda_jax.infer import generate as G

    params, forecast, _ = setup
    sizes, prefill = [], G.prefill
    monkeypatch.setattr(G, "prefill", lambda *a, cache_size, **kw: sizes.append(cache_size) or prefill(
        *a, cache_size=cache_size, **kw))
    out = G.generate(params, TINY, [list(range(1, 21))], G.SamplingConfig(max_new_tokens=5), mode="sparse")
    assert sizes == [80] and len(out[0]) == 5


def test_generation_stops_where_a_stop_token_comes_and_counts_only_the_steps_it_used(setup):
    """The loop dispatches the next step before it reads a token: a step run past the last
    sequence's stop token must not show, in the tokens or in the counters."""
    from sparda_jax.infer.generate import SamplingConfig, generate

    params, forecast, _ = setup
    prompt = [list(range(3, 75))]
    free, free_stats = generate(params, TINY, prompt, SamplingConfig(max_new_tokens=12), engine=EngineConfig("sparse"),
                                return_stats=True)
    k = next(i for i in range(3, 12) if free[0][i] not in free[0][:i])  # first occurrence, past a few steps
    cut, stats = generate(params, TINY, prompt, SamplingConfig(max_new_tokens=12), engine=EngineConfig("sparse"),
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
        runs.append((generate(params, TINY, prompts, sampled, engine=EngineConfig("sparda"), forecast=forecast, return_stats=True,
                              steps_per_call=k, on_step=lambda o: seen.append([list(x) for x in o])), seen))
    (one, one_seen), (calls, calls_seen) = runs
    assert calls == one and calls_seen == one_seen and one[1]["steps"] == 8
    greedy = SamplingConfig(max_new_tokens=9)
    free = generate(params, TINY, [prompts[0]], greedy, engine=EngineConfig("sparse"))[0]
    k = next(i for i in range(5, 8) if free[i] not in free[:i])  # a stop token inside the second call
    cut = [generate(params, TINY, [prompts[0]], greedy, engine=EngineConfig("sparse"), stop_ids=[free[k]], return_stats=True,
                    steps_per_call=n) for n in (1, 4)]
    assert cut[0] == cut[1] and cut[0][0] == [free[:k]] and cut[0][1]["steps"] == k
    with pytest.raises(ValueError, match="with an engine"):
        generate(params, TINY, prompts, greedy, mode="sparda", forecast=forecast, steps_per_call=4)
    sparse = EngineConfig("sparse")
    _, st = engine_prefill(params, jnp.ones((2, 70), jnp.int32), jnp.array([70, 59]), TINY, sparse, cache_size=90)
    pos = np.array([[70, 59], [71, 60]])
    with pytest.raises(ValueError, match="one key per step"):
        engine_generate_steps(params, jnp.ones(2, jnp.int32), pos, jax.random.split(jax.random.key(0), 3), st, TINY,
                              sparse)
    with pytest.raises(ValueError, match="one first token per sequence"):
        engine_generate_steps(params, jnp.ones((2, 2), jnp.int32), pos, jax.random.split(jax.random.key(0), 2), st,
                              TINY, sparse)


def test_lane_ctas_split_the_quota_by_bytes():
    from sparda_jax.kernels.kv_copy import lane_ctas

    k = jnp.zeros((4, 64, 128), jnp.bfloat16)  # 16 KB blocks
    cis = jnp.zeros((4, 64, 1), jnp.float32)   # 256 B
    assert lane_ctas(16, [k, k]) == [8, 8]
    assert lane_ctas(16, [k, k, cis]) == [8, 8, 1]  # the small payload still gets a CTA
    assert lane_ctas(1, [k, k]) == [1, 1]


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

    eng = engine_config("sparda", copy_impl="host_ffi")
    _, st = engine_prefill(params, jnp.zeros((2, 70), jnp.int32), lengths, TINY, eng, cache_size=86, forecast=forecast)
    run_, st = engine.resolve(params, lengths, st, TINY, eng, forecast=forecast)
    own = engine._own_buffer
    engine._own_buffer = lambda x: x
    engine._engine_decode.clear_cache()  # retrace with the patch
    try:
        hlo = engine._engine_decode.lower(params, tokens, lengths, st, forecast, None, run=run_).compile().as_text()
        assert len(_entry_users(hlo, len(jax.tree.leaves(params)) + 1)) > 10
    finally:
        engine._own_buffer = own
        engine._engine_decode.clear_cache()  # later calls trace the real step again


def _made_from_constants(jaxpr) -> list[str]:
    """The equations of jaxpr (nested programs included) whose inputs are all literals: values
    made inside the program, which XLA may return as one shared buffer."""
    found = []
    for e in jaxpr.eqns:
        if all(type(v).__name__ == "Literal" for v in e.invars):
            found.append(e.primitive.name)
        for sub in e.params.values():
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                found += _made_from_constants(inner)
    return found


def test_the_offload_layout_makes_no_buffer_of_its_own(setup):
    """The engine's layout program only moves what it is given (slices, reshapes, transposes of
    the prefill state and of the empty caches made outside it): a value made inside, like the
    zeros the caches once were, may come back from the GPU as one buffer shared by every layer,
    which the CUDA copy's in-place writes then corrupt (a CPU never shares them)."""
    from sparda_jax.infer.engine import _offload_layout

    params, forecast, _ = setup
    prompt = jax.random.randint(jax.random.key(1), (2, 70), 0, TINY.vocab_size)
    _, st = prefill(params, prompt, jnp.array([70, 59]), TINY, cache_size=128, mode="sparda", forecast=forecast)
    ln, b, _, kh, dh = st.kv.k.shape
    for off in ((1, 2), (2,)):  # every layer offloaded; layer 1 dense
        empty = {n: jnp.zeros((len(off), b, kh, 3, 64, dh)) for n in ("k", "v")}
        jaxpr = jax.make_jaxpr(lambda *a: _offload_layout(*a, bs=64, offloaded=off))(
            st, empty, jnp.zeros((len(off), b, kh, 3), jnp.int32))
        assert _made_from_constants(jaxpr.jaxpr) == []
    # the check sees such a value where one is made
    made = jax.make_jaxpr(jax.jit(lambda x: (x[0], jnp.zeros(3))))(jnp.ones((2, 3)))
    assert _made_from_constants(made.jaxpr) == ["broadcast_in_dim"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sparda", "infinigen"])
def test_prefill_gives_every_offloaded_layer_buffers_of_its_own(setup, mode):
    """The CUDA copy writes each layer's block cache and slot table in place, so no two of them
    may share a device buffer (on the GPU a program's identical zero outputs did: layer caches
    made inside one jit). Every array of the state is a buffer of its own."""
    params, forecast, ig = setup
    prompt = jax.random.randint(jax.random.key(1), (2, 70), 0, TINY.vocab_size)
    _, st = engine_prefill(params, prompt, jnp.array([70, 59]), TINY, engine_config(mode), cache_size=140,
                           forecast=forecast, infinigen=ig)
    arrays = [a for a in jax.tree.leaves(st) if isinstance(a, jax.Array) and a.size]
    pointers = [a.unsafe_buffer_pointer() for a in arrays]
    assert len(st.layers) == TINY.num_layers - 1 and len(arrays) > 3 * len(st.layers)
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("copy_impl", ["xla", pytest.param("xla", marks=pytest.mark.gpu, id="xla-gpu"),
                                       pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_offloaded_layer_decodes_in_one_program(copy_impl):
    """A model of two layers offloads one: its pools have a leading dim of 1. On the H200 the
    reference copy's loop of this shape failed to compile when the layer was taken by an
    integer index (XLA: a bitcast between device and pinned-host memory); the loop must give
    the step-by-step logits whatever the layer count."""
    from sparda_jax.infer.engine import engine_decode_steps

    config = TINY.replace(num_layers=2)
    params, forecast, ig = _make(config)
    b, t0, n = 2, 70, 12
    tokens = jax.random.randint(jax.random.key(7), (b, t0 + n), 0, config.vocab_size)
    lengths = jnp.array([t0, t0 - 11], jnp.int32)
    pos = np.asarray(lengths)[None] + np.arange(n)[:, None]
    toks = np.asarray(tokens)[np.arange(b)[None], pos]
    eng = engine_config("sparda", copy_impl=copy_impl)

    def fresh():
        return engine_prefill(params, tokens[:, :t0], lengths, config, eng, cache_size=t0 + n, forecast=forecast)[1]

    st, one = fresh(), []
    for i in range(n):
        logits, st, _ = engine_decode_step(params, toks[i], pos[i], st, config, eng, forecast=forecast)
        one.append(logits)
    loop, _, stats = engine_decode_steps(params, toks, pos, fresh(), config, eng, forecast=forecast)
    np.testing.assert_allclose(np.asarray(loop), np.asarray(jnp.stack(one)), rtol=0, atol=2e-5)  # as above
    assert int(np.asarray(stats["copied_blocks"]).sum()) > 0
