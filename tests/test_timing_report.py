"""The decode rate that `sparda demo` and `sparda generate` print is the steady state: the first
decode call (its compile, the copy library's build) is reported apart. Fake clocks, no real model."""

from __future__ import annotations

import types

import jax
import pytest

from sparda_jax import get_preset, init_model
from sparda_jax.infer.timing import DecodeTiming, StepTimer


def test_steady_rate_leaves_out_a_slow_first_step():
    # prompt token at 2 s; the first decode step takes 100 s (a compile), then 8 steps of 0.5 s
    stamps = [2.0, 102.0] + [102.0 + 0.5 * i for i in range(1, 9)]
    t = DecodeTiming.from_stamps(0.0, stamps)
    assert t.prefill_s == 2.0 and t.first_decode_s == 100.0 and t.first_call_steps == 1
    assert t.steady_steps == 8 and t.steady_s == 4.0 and t.steady_tokens_per_s == 2.0
    assert t.total_s == stamps[-1]
    # what the demo printed before: steps[0] to steps[-1], the compile inside (9 steps in 104 s)
    assert (len(stamps) - 1) / (stamps[-1] - stamps[0]) < 0.1 < t.steady_tokens_per_s
    assert t.summary() == "prefill 2.00 s, first step 100.00 s, steady 2.0 tok/s over 8 steps"


def test_device_calls_of_several_steps_and_a_shorter_last_call():
    # steps_per_call 4, max_new_tokens 12: calls of 4, 4 and 3 steps; each call's tokens are read
    # together after it. The first call and the last one (a program of its own) compile.
    stamps = [1.0] + [51.0] * 4 + [53.0] * 4 + [83.0] * 3
    t = DecodeTiming.from_stamps(0.0, stamps, steps_per_call=4, max_new_tokens=12)
    assert (t.prefill_s, t.first_decode_s, t.first_call_steps) == (1.0, 50.0, 4)
    assert (t.steady_steps, t.steady_s, t.steady_tokens_per_s) == (4, 2.0, 2.0)
    assert "first call of 4 steps 50.00 s, steady 2.0 tok/s over 4 steps" in t.summary()
    # without the budget every call counts as full-size, and the last call's compile leaks in
    leaky = DecodeTiming.from_stamps(0.0, stamps, steps_per_call=4)
    assert leaky.steady_steps == 7 and leaky.steady_tokens_per_s == pytest.approx(7 / 32)


def test_too_few_steps_for_a_steady_rate():
    for stamps, first in (([], None), ([3.0], None), ([3.0, 9.0], 6.0), ([3.0, 9.0, 9.5], 6.0)):
        t = DecodeTiming.from_stamps(0.0, stamps, end=10.0)
        assert t.first_decode_s == first and t.steady_tokens_per_s is None and t.total_s == 10.0
        assert t.summary().endswith("steady -")
    assert DecodeTiming.from_stamps(0.0, []).summary() == "prefill 0.00 s, first step -, steady -"
    with pytest.raises(ValueError, match="must not decrease"):
        DecodeTiming.from_stamps(5.0, [4.0, 6.0])
    with pytest.raises(ValueError, match="steps_per_call"):
        DecodeTiming.from_stamps(0.0, [1.0], steps_per_call=0)
    with pytest.raises(RuntimeError, match="before start"):
        StepTimer().timing()


def test_generate_reads_the_prompt_token_before_the_first_decode_step_compiles(monkeypatch):
    """Through `generate` (tiny random model, dense): prefill takes 5 fake seconds, the first
    decode step 100 (a compile), later steps 1. The prompt's token is stamped before the first
    step is dispatched, so its 100 s land in first_decode_s, not in prefill_s nor the rate."""
    from sparda_jax.infer import generate as gen
    from sparda_jax.infer.generate import SamplingConfig

    now = [0.0]
    calls = []

    def slow(fn, cost):
        def wrapped(*a, **kw):
            calls.append(fn.__name__)
            now[0] += cost(len(calls))
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(gen, "prefill", slow(gen.prefill, lambda n: 5.0))
    decodes = []
    monkeypatch.setattr(gen, "decode_step", slow(gen.decode_step, lambda n: decodes.append(n) or
                                                 (100.0 if len(decodes) == 1 else 1.0)))
    config = get_preset("tiny")
    params = init_model(config, jax.random.key(0))
    timer = StepTimer(then=lambda out: calls.append("stream"), clock=lambda: now[0])
    timer.start()
    out = gen.generate(params, config, [list(range(1, 40))], SamplingConfig(max_new_tokens=6), on_step=timer)
    t = timer.timing(max_new_tokens=6)
    assert len(out[0]) == 6 and len(timer.stamps) == 6
    # the stream sees the prompt's token before any decode step runs; each later step is
    # dispatched before the previous token is read (5 decode steps for 6 tokens)
    assert calls == ["prefill", "stream", "decode_step", "decode_step", "stream", "decode_step", "stream",
                     "decode_step", "stream", "decode_step", "stream", "stream"]
    assert timer.stamps == [5.0, 106.0, 107.0, 108.0, 109.0, 109.0]
    assert t.prefill_s == 5.0 and t.first_decode_s == 101.0  # step 0's compile and step 1's dispatch
    assert t.steady_steps == 4 and t.steady_tokens_per_s == pytest.approx(4 / 3)


def _stub_cli_generate(monkeypatch, tok, fake_generate) -> None:
    """`sparda generate` on a stub model with tokenizer `tok`, its `generate` replaced."""
    import sparda_jax.api as api
    import sparda_jax.cli as cli
    import sparda_jax.infer.generate as gen

    monkeypatch.setattr(cli, "_load", lambda args: types.SimpleNamespace(tokenizer=tok, params=None, config=None,
                                                                         dtype=None))
    monkeypatch.setattr(api, "prepare_modes", lambda model, modes, seed, forecast: {})
    monkeypatch.setattr(gen, "generate", fake_generate)


def test_generate_command_prints_the_first_call_apart(monkeypatch, capsys):
    """`sparda generate`'s stderr line, with a stub model and a stub `generate` whose first
    decode step is 60 fake seconds and later ones 0.25."""
    import sparda_jax.cli as cli
    import sparda_jax.infer.timing as timing

    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    class Tok:
        eos_ids = (0,)

        def chat_prompt(self, text):
            return text

        def encode(self, text):
            return list(range(1, len(text) + 1))

        def decode(self, ids):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    def fake_generate(params, config, prompts, sampling, *, on_step, **kw):
        out = [[]]
        # the prefill: 3 s, of which JAX reports 0.5 s tracing, 0.25 lowering, 1 s compiling
        for event, s in (("jaxpr_trace_duration", 0.5), ("jaxpr_to_mlir_module_duration", 0.25),
                         ("backend_compile_duration", 1.0)):
            now[0] += s
            jax.monitoring.record_event_duration_secs(f"/jax/core/compile/{event}", s)
        now[0] += 1.25
        for i in range(sampling.max_new_tokens):
            if i == 1:  # the first decode step: 60 s, its program loaded from the persistent cache in 2
                now[0] += 2.0
                jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 2.0)
                jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
                now[0] += 58.0
            now[0] += 0.25 if i > 1 else 0.0
            out[0].append(i)
            on_step(out)
        return out

    _stub_cli_generate(monkeypatch, Tok(), fake_generate)
    assert cli.main(["--no-compile-cache", "generate", "--prompt", "hello", "--max-new-tokens", "10"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == ("[5 prompt tokens, 10 new tokens in 65.0 s: prefill 3.00 s, first step 60.00 s, "
                       "steady 4.0 tok/s over 8 steps]")
    assert err[-1] == ("[first calls: prefill 3.00 s = trace 0.50 + lower 0.25 + compile 1.00 + the rest 1.25; "
                       "first step 60.00 s = trace 0.00 + lower 0.00 + compile 2.00 (1 cached) + the rest 58.00]")


def test_compile_clock_sees_a_new_programs_trace_lower_and_compile_once():
    """A real jit on this machine: its first call traces, lowers and compiles (each > 0 s, in the
    window), its second call none of them; outside the window nothing is counted."""
    import time

    import jax.numpy as jnp

    from sparda_jax.infer.timing import CompileClock

    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum())  # a new function: not in any cache of this process
    x = jnp.arange(7.0)
    with CompileClock() as clock:
        a = time.perf_counter()
        f(x).block_until_ready()
        b = time.perf_counter()
        f(x).block_until_ready()
        c = time.perf_counter()
    first, second = clock.between(a, b), clock.between(b, c)
    assert first["trace"] > 0 and first["lower"] > 0 and first["compile"] > 0
    assert second == {"trace": 0.0, "lower": 0.0, "compile": 0.0, "load": 0.0, "cache_hits": 0, "stored": 0}
    n = len(clock.events)
    jax.jit(lambda x: x - 1)(x)  # after the window: not recorded
    assert len(clock.events) == n


def test_generate_trace_writes_a_chrome_trace_and_a_summary(monkeypatch, capsys, tmp_path):
    """--trace: the whole generate call runs under the profiler; the trace file holds the
    programs it ran, and stderr says where the time went."""
    import gzip
    import json

    import jax
    import jax.numpy as jnp

    import sparda_jax.cli as cli

    class Tok:
        eos_ids = (0,)
        chat_prompt = staticmethod(lambda text: text)
        encode = staticmethod(lambda text: [1, 2, 3])
        decode = staticmethod(lambda ids: "x" * len(ids))

    def fake_generate(params, config, prompts, sampling, *, on_step, **kw):
        out = [[]]
        for i in range(sampling.max_new_tokens):
            jax.block_until_ready(jax.jit(lambda a: jnp.tanh(a @ a))(jnp.ones((64, 64)) * i))
            out[0].append(i)
            on_step(out)
        return out

    _stub_cli_generate(monkeypatch, Tok(), fake_generate)
    path = tmp_path / "gen.trace.json.gz"
    assert cli.main(["--no-compile-cache", "generate", "--prompt", "hi", "--max-new-tokens", "3",
                     "--trace", str(path)]) == 0
    with gzip.open(path, "rb") as f:
        events = json.load(f)["traceEvents"]
    assert any("tanh" in str(e.get("name", "")) or "dot" in str(e.get("name", "")) for e in events)
    assert not list(tmp_path.glob("*.profile-tmp"))  # the profiler's folder is removed
    err = capsys.readouterr().err
    assert f"[trace] {path}" in err and "events" in err
    assert cli.main(["generate", "--prompt", "hi", "--trace", str(tmp_path)]) == 2  # before any work
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("system", ["sparda", "dense_resident", None])
def test_the_decode_program_compiles_once(system, caplog):
    """The first decode step is fed the prefill's outputs, later ones the previous step's; both
    must be committed alike, or the decode program compiles a second time (a jit's compile key
    holds whether each argument is committed). None: the resident `mode` path, no engine."""
    import logging

    from sparda_jax import init_forecast
    from sparda_jax.infer.engine import EngineConfig
    from sparda_jax.infer.generate import SamplingConfig, generate

    config = get_preset("tiny")
    params = init_model(config, jax.random.key(0))
    forecast = init_forecast(config, jax.random.key(2))
    engine = None if system is None else EngineConfig(system)
    program = {"sparda": "_engine_decode_impl", "dense_resident": "decode_program", None: "decode_program"}[system]
    prompt = list(range(1, 131 + (system is None)))  # padded to 192: shapes no other test here compiles
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        out = generate(params, config, [prompt], SamplingConfig(max_new_tokens=5), mode="sparda", forecast=forecast,
                       engine=engine)
    assert len(out[0]) == 5
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"Compiling jit({program})")]
    assert len(compiles) == 1, [c[:200] for c in compiles]


def test_generate_implementation_flag_reaches_the_engine(monkeypatch, capsys):
    """`--implementation OP=NAME` sets that op's backend in the engine `generate` gets; an unknown
    op or backend is a usage error naming the choices."""
    import sparda_jax.cli as cli
    from sparda_jax.config import Implementations

    seen = {}

    class Tok:
        eos_ids = (0,)
        chat_prompt = staticmethod(lambda t: t)
        encode = staticmethod(lambda t: [1, 2])
        decode = staticmethod(lambda ids: "x" * len(ids))

    def fake_generate(params, config, prompts, sampling, *, on_step, engine=None, **kw):
        seen["engine"] = engine
        out = [[5]]
        on_step(out)
        return out

    _stub_cli_generate(monkeypatch, Tok(), fake_generate)
    argv = ["--no-compile-cache", "generate", "--prompt", "hi", "--max-new-tokens", "1", "--system", "sparda"]
    assert cli.main(argv + ["--implementation", "sparse_attention=xla", "select=xla"]) == 0
    assert seen["engine"].system == "sparda"
    assert seen["engine"].implementations == Implementations(sparse_attention="xla", select="xla")
    assert cli.main(argv) == 0 and seen["engine"].implementations == Implementations()
    for bad, says in (("attention=xla", "OP one of dense_attention"), ("select=cuda", "select's backends are")):
        with pytest.raises(SystemExit):
            cli.main(argv + ["--implementation", bad])
        assert says in capsys.readouterr().err
