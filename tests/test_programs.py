"""The program store (`sparda_jax.programs`): a later process runs a stored program without
tracing it, gets what the jit gives, and never runs a program stored for another call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import programs
from sparda_jax.infer.timing import CompileClock, phase_line


@pytest.fixture
def store(tmp_path):
    s = programs.enable_program_store(tmp_path / "programs")
    yield s
    programs.disable_program_store()


TRACES: list = []


def _f(x, state, scale=None, *, n, tag):
    TRACES.append(tag)
    y = x * n + (0.0 if scale is None else scale)
    return y.sum(), {"a": state["a"] + y, "b": state["b"] * 2}


def _counted(**jit_kw):
    """A fresh StoredJit of a fresh copy of the module-level `_f` (as a new process has: nothing
    in memory, not even jax's trace of it) and the list its traces go to. A copy, not a closure:
    a function with a closure is never stored."""
    TRACES.clear()
    fresh = types.FunctionType(_f.__code__, _f.__globals__, "_f", _f.__defaults__, None)
    fresh.__kwdefaults__ = _f.__kwdefaults__
    return programs.stored_jit(fresh, static_argnames=("n", "tag"), **jit_kw), TRACES


def _args():
    return jnp.arange(4.0), {"a": jnp.zeros(4), "b": jnp.ones(4)}


def test_a_new_instance_loads_the_stored_program_without_tracing(store):
    x, st = _args()
    f1, t1 = _counted()
    want = jax.jit(lambda x, st, s: (lambda y: (y.sum(), {"a": st["a"] + y, "b": st["b"] * 2}))(x * 3 + s))(x, st, 2.0)
    got1 = f1(x, st, scale=jnp.float32(2.0), n=3, tag="t")
    assert len(t1) == 1 and store.stats["compiled"] == 1 and store.stats["stored"] == 1
    assert len(list(store.directory.glob("*.prog"))) == 1
    f1(x, st, scale=jnp.float32(2.0), n=3, tag="t")  # in memory now: no second trace
    assert len(t1) == 1
    f2, t2 = _counted()
    got2 = f2(x, st, scale=jnp.float32(2.0), n=3, tag="t")
    assert t2 == [] and store.stats["loaded"] == 1
    key = store.events[0][2]  # each count is an event naming the program and its key
    assert store.events == [("compiled", "f", key), ("stored", "f", key), ("loaded", "f", key)]
    for got in (got1, got2):
        jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize("change", ["static", "shape", "dtype", "weak type", "tree", "source"])
def test_a_call_that_differs_gets_its_own_program(store, change, monkeypatch):
    """Every part of the key separates programs: a static value, a shape, a dtype, a weak type,
    the argument tree, the package's source. The changed call traces and compiles anew."""
    x, st = _args()
    f, traces = _counted()
    f(x, st, scale=jnp.float32(2.0), n=3, tag="t")
    kw = dict(scale=jnp.float32(2.0), n=3, tag="t")
    if change == "static":
        kw["n"] = 4
    elif change == "shape":
        x, st = jnp.arange(5.0), {"a": jnp.zeros(5), "b": jnp.ones(5)}
    elif change == "dtype":
        kw["scale"] = jnp.bfloat16(2.0)
    elif change == "weak type":
        kw["scale"] = jax.jit(lambda: 2.0)()  # a weak-typed float32 scalar
    elif change == "tree":
        kw.pop("scale")
    elif change == "source":
        monkeypatch.setattr(store.sources, "digest", "another source")
    g, traces2 = _counted()  # nothing in memory: the store decides
    g(x, st, **kw)
    assert len(traces2) == 1, change
    assert store.stats["compiled"] == 2 and len(list(store.directory.glob("*.prog"))) == 2


def test_calls_the_key_cannot_describe_go_through_the_jit(store):
    """A static whose repr is an address, a static passed by position and a call under a trace
    are the jit's: same results, nothing written."""
    f = programs.stored_jit(_apply, static_argnames=("fn",))
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(f(x, fn=jnp.tanh), jnp.tanh(x) + 1)     # <function ... at 0x...>
    np.testing.assert_array_equal(f(x, jnp.tanh), jnp.tanh(x) + 1)        # by position
    np.testing.assert_array_equal(jax.jit(lambda x: f(x, fn=jnp.tanh))(x), jnp.tanh(x) + 1)  # tracers
    assert list(store.directory.glob("*.prog")) == [] and store.stats["unkeyed"] == 1
    assert store.events == [("unkeyed: static fn has no stable repr", "apply", "")]


def _apply(x, fn):
    return fn(x) + 1


def test_functions_with_a_closure_or_defined_inside_another_are_not_stored(store):
    """Their code is not all of what they compute (make(2.0) and make(3.0) share a code object
    and a name): both go through the jit."""
    def make(scale):
        return programs.stored_jit(lambda x: x * scale)

    def inner(x):
        return x + 1

    x = jnp.arange(3.0)
    np.testing.assert_array_equal(make(2.0)(x), x * 2)
    np.testing.assert_array_equal(make(3.0)(x), x * 3)
    np.testing.assert_array_equal(programs.stored_jit(inner)(x), x + 1)
    assert list(store.directory.glob("*.prog")) == [] and store.stats["compiled"] == 0


def test_jax_settings_in_effect_separate_programs(store):
    """A program made under `jax.default_matmul_precision("highest")` is not the default one, in
    memory as on disk."""
    f = programs.stored_jit(_matmul)
    a = jax.random.normal(jax.random.key(0), (64, 64))
    f(a)
    with jax.default_matmul_precision("highest"):
        f(a)
    assert store.stats["compiled"] == 2 and len(list(store.directory.glob("*.prog"))) == 2


def _matmul(a):
    return a @ a


def test_nothing_is_stored_once_the_package_changed(store, monkeypatch):
    """A file of the package edited after the store was opened: the program runs but is not
    stored (its key names the code as it was when the store opened)."""
    monkeypatch.setattr(store.sources, "changed", lambda: True)
    x, st = _args()
    f, _ = _counted()
    f(x, st, n=7, tag="e")
    assert store.stats["compiled"] == 1 and store.stats["not_stored"] == 1
    assert list(store.directory.glob("*.prog")) == []


def test_a_stored_program_called_under_a_trace_is_traced_through(store):
    """Once a call has a stored program, the same function inside jit and grad (tracer
    arguments) still gives the traced results."""
    x, st = _args()
    f, _ = _counted()
    f(x, st, n=3, tag="g")
    total, _ = jax.jit(lambda x: f(x, st, n=3, tag="g"))(x)
    assert float(total) == float(jnp.sum(x * 3))
    np.testing.assert_array_equal(jax.grad(lambda x: f(x, st, n=3, tag="g")[0])(x), jnp.full(4, 3.0))


def test_donation_is_kept(store):
    x, st = _args()
    f, _ = _counted(donate_argnames=("state",))
    f(x, st, n=1, tag="d")
    assert st["a"].is_deleted()
    g, traces = _counted(donate_argnames=("state",))
    st2 = {"a": jnp.zeros(4), "b": jnp.ones(4)}
    g(x, st2, n=1, tag="d")
    assert traces == [] and st2["a"].is_deleted()


def test_an_unreadable_file_is_removed_and_its_key_left_to_the_jit(store):
    """A file that cannot be loaded is removed with a warning and the call runs through the
    jit; its key is marked, so later processes do not store it again (one extra compile in
    all, not one a run, where a backend cannot store a program)."""
    x, st = _args()
    f, _ = _counted()
    want = f(x, st, n=2, tag="c")
    (path,) = store.directory.glob("*.prog")
    path.write_bytes(path.read_bytes()[:100])  # a truncated write
    g, traces = _counted()
    with pytest.warns(UserWarning, match="could not be loaded"):
        got = g(x, st, n=2, tag="c")
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert len(traces) == 1 and store.stats["discarded"] == 1 and not path.exists()
    assert path.with_suffix(".refused").exists()
    h, traces = _counted()
    jax.tree.map(np.testing.assert_array_equal, h(x, st, n=2, tag="c"), want)
    assert len(traces) == 1 and not path.exists() and store.stats["compiled"] == 1


def test_a_stored_program_that_cannot_run_goes_to_the_jit(store, monkeypatch):
    """A program that loads but fails at its dispatch (as an executable serialized without its
    code does: "Function ... not found") is removed and the call runs through the jit."""
    x, st = _args()
    f, _ = _counted()
    want = f(x, st, n=3, tag="r")

    def broken(*a, **k):
        raise jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Function fusion not found")

    monkeypatch.setattr(store, "load", lambda name, key: broken)
    g, traces = _counted()
    with pytest.warns(UserWarning, match="could not be loaded or run"):
        got = g(x, st, n=3, tag="r")
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert len(traces) == 1 and store.stats["discarded"] == 1 and store.stats["compiled"] == 1
    assert list(store.directory.glob("*.prog")) == [] and len(list(store.directory.glob("*.refused"))) == 1


def test_a_failing_program_that_consumed_its_donations_says_so(store, monkeypatch):
    """The no-code failure after the donated state is gone cannot be rerun by the jit: a clear
    RuntimeError, and the key refused, so the next run compiles. Any other failure is the
    program's own: raised as it is, nothing refused."""
    x, st = _args()
    f, _ = _counted(donate_argnames=("state",))
    f(x, {"a": jnp.zeros(4), "b": jnp.ones(4)}, n=4, tag="k")
    (path,) = store.directory.glob("*.prog")

    def consumed(x, state, **kw):
        state["a"].delete()
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found")

    monkeypatch.setattr(store, "load", lambda name, key: consumed)
    g, _ = _counted(donate_argnames=("state",))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="donated arguments were consumed"):
        g(x, st, n=4, tag="k")
    assert path.with_suffix(".refused").exists()

    def out_of_memory(*a, **k):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(store, "load", lambda name, key: out_of_memory)
    h, _ = _counted()
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        h(x, {"a": jnp.zeros(4), "b": jnp.ones(4)}, n=5, tag="k")
    assert len(list(store.directory.glob("*.refused"))) == 1


def test_the_store_keeps_to_its_size(tmp_path):
    s = programs.enable_program_store(tmp_path / "p", max_bytes=1)
    try:
        x, st = _args()
        for n in (1, 2, 3):
            f, _ = _counted()
            f(x, st, n=n, tag="s")
        assert len(list(s.directory.glob("*.prog"))) == 1  # the newest stays
    finally:
        programs.disable_program_store()


def test_without_a_store_it_is_the_jit():
    assert programs.program_store() is None
    f, traces = _counted()
    x, st = _args()
    f(x, st, n=2, tag="j")
    f(x, st, n=2, tag="j")
    assert len(traces) == 1 and f.lower(x, st, n=2, tag="j") is not None


def test_the_first_calls_line_counts_loads(store):
    x, st = _args()
    f, _ = _counted()
    f(x, st, n=5, tag="l")
    g, _ = _counted()
    with CompileClock() as clock:
        a = clock.clock()
        g(x, st, n=5, tag="l")
        b = clock.clock()
    split = clock.between(a, b)
    assert split["stored"] == 1 and split["load"] > 0 and split["trace"] == 0
    assert " + load " in phase_line("prefill", b - a, split) and "(1 stored)" in phase_line("prefill", b - a, split)


SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from sparda_jax import get_preset, init_forecast, init_model, programs, runtime
from sparda_jax.config import Implementations, SparseConfig
from sparda_jax.infer.engine import EngineConfig
from sparda_jax.infer.generate import SamplingConfig, generate
runtime.enable_compilation_cache(sys.argv[1])
if sys.argv[3] == "store":
    programs.enable_program_store(sys.argv[4])
c, dtype, n, ffi = get_preset("tiny"), jnp.float32, 70, "host_ffi"
if sys.argv[2] == "gpu":  # shapes the Mosaic kernels take (bf16, head dim 64, 64-token blocks), the CUDA copy
    # three layers, two offloaded (a one-layer pool is test_engine.py's
    # test_one_offloaded_layer_decodes_in_one_program)
    c = c.replace(num_layers=3, head_dim=64, sparse=SparseConfig(block_size=64, init_blocks=1, local_blocks=1,
                                                                 topk=4, kernel_size=32, kernel_stride=16, dense_len=0))
    dtype, n, ffi = jnp.bfloat16, 600, "cuda"
params, forecast = init_model(c, jax.random.key(0)), init_forecast(c, jax.random.key(2))
prompts = [[1 + i % (c.vocab_size - 1) for i in range(1, n)], [1 + i % (c.vocab_size - 1) for i in range(5, n - 10)]]


def run_all():
    out = {}
    # sparda twice: with the reference copy and with the FFI copy (on the CPU its twin), whose
    # targets a loaded program needs registered without a trace
    for name, system, per_call, copy in (("sparda", "sparda", 3, "xla"), ("sparda_ffi", "sparda", 3, ffi),
                                         ("dense_resident", "dense_resident", 1, None)):
        engine = EngineConfig(system, implementations=Implementations(kv_copy=copy))
        out[name] = generate(params, c, prompts, SamplingConfig(max_new_tokens=8, temperature=0.0),
                             forecast=forecast, engine=engine, steps_per_call=per_call, dtype=dtype)
    return out


out = run_all()
if sys.argv[3] == "jit-then-store":  # the programs in the jit's memory first (from XLA's cache), then a store
    programs.enable_program_store(sys.argv[4])
    assert run_all() == out
s = programs.program_store()
print(json.dumps({"tokens": out, "stats": s.stats if s else None, "events": s.events if s else None}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_second_process_generates_the_same_tokens_from_stored_programs(tmp_path, platform):
    """Four processes share XLA's persistent cache: the first without a store (it fills that
    cache: an executable from it serializes without its code on the CPU), the second runs the
    same with the jit first and then with a store (the jit's executables, from that cache, must
    not be stored), the third stores what is left, the fourth loads every program and compiles
    none. They generate the same tokens with sparda (its copy by XLA and by the FFI
    calls: on the CPU their twin) and dense_resident; on the GPU the programs carry the Mosaic
    kernels, and the jit's tokens (first process) are not compared: its compile may pick other
    GEMM algorithms than the store's, and bf16 argmax ties then differ."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"} if platform == "cpu" else dict(os.environ)

    def run(*args):
        p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "xla"), platform, *args],
                           capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    store = str(tmp_path / "programs")
    ref = run("none")
    mixed = run("jit-then-store", store)  # what it stores must run in the next process
    first = run("store", store)
    time.sleep(0.05)
    before_second = time.time()
    second = run("store", store)
    stored = mixed["stats"]["stored"] + first["stats"]["stored"]
    assert first["stats"]["compiled"] >= 1 and first["stats"]["discarded"] == 0
    assert first["stats"]["loaded"] == mixed["stats"]["stored"]
    # a load touches its file: those the last process left untouched, named if the count is off
    unused = sorted(p.name for p in Path(store).glob("*.prog") if p.stat().st_mtime < before_second)
    assert second["stats"]["compiled"] == 0 and second["stats"]["loaded"] == stored >= 4, (
        mixed["stats"], first["stats"], second["stats"], unused, "second's events but loads:",
        [e for e in second["events"] if e[0] != "loaded"], "first's stores:", [e for e in first["events"] if e[0] == "stored"])
    assert second["stats"]["discarded"] == second["stats"]["unkeyed"] == 0
    assert first["tokens"] == second["tokens"]
    if platform == "cpu":
        assert ref["tokens"] == mixed["tokens"] == first["tokens"]
    assert all(len(t) == 8 for seqs in ref["tokens"].values() for t in seqs)


def test_cli_turns_the_store_on_and_off(tmp_path, monkeypatch):
    from sparda_jax import cli

    monkeypatch.setenv("SPARDA_JAX_CACHE_DIR", str(tmp_path))
    try:
        assert cli.main(["info", "--model", "tiny"]) == 0
        assert programs.program_store().directory == tmp_path / "programs"
        programs.disable_program_store()
        assert cli.main(["--no-compile-cache", "info", "--model", "tiny"]) == 0
        assert programs.program_store() is None
        assert cli.main(["--no-program-store", "info", "--model", "tiny"]) == 0
        assert programs.program_store() is None
    finally:
        programs.disable_program_store()
        from sparda_jax.runtime import default_cache_dir, enable_compilation_cache

        monkeypatch.delenv("SPARDA_JAX_CACHE_DIR")
        enable_compilation_cache(default_cache_dir() / "xla-tests", min_compile_s=0.1)  # conftest's
