"""`sparda bench realmodel` on the tiny random-weight preset with the byte tokenizer: the rows'
fields, a steady rate that leaves the first decode call out, miss rates equal to an independent
`generate` run's counters, bytes per token by hand, and bad input refused before any work."""

from __future__ import annotations

import json
import types
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from byte_tokenizer import ByteTokenizer

from sparda_jax import get_preset, init_forecast, init_model
from sparda_jax.api import Pretrained
from sparda_jax.bench import realmodel as RM
from sparda_jax.bench.timing import Budget
from sparda_jax.infer.engine import EngineConfig
from sparda_jax.infer.generate import SamplingConfig, generate
from sparda_jax.text import haystack_tokens

CONTEXT, NEW, K = 200, 9, 2  # 8 decode steps in 4 calls of 2: the first and 3 steady ones


@pytest.fixture(scope="module")
def tiny():
    c = get_preset("tiny").replace(num_layers=2)  # layer 0 resident, layer 1 offloaded: the fewest compiled
    return Pretrained(c, init_model(c, jax.random.key(0)), ByteTokenizer(), jnp.float32)


@pytest.fixture(scope="module")
def grid(tiny, tmp_path_factory):
    """The run, and the programs it compiled (jax.log_compiles). It starts with no program in
    memory, so each cell's first prefill is cold here: traced and lowered, at least."""
    jax.clear_caches()
    out = tmp_path_factory.mktemp("rm") / "realmodel.json"
    compiles = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: compiles.append(rec.getMessage())
    logger = logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            r = RM.bench_realmodel(tiny, systems=("dense_resident", "sparda"), contexts=(CONTEXT,), batches=(1, 2),
                                   new_tokens=NEW, steps_per_call=K, out=out, command="test", progress=False,
                                   log=lambda s: None)
    finally:
        logger.removeHandler(handler)
    return r, out, compiles


def test_rows_and_the_written_json(grid):
    r, out, _ = grid
    assert [(x["system"], x["batch"]) for x in r["rows"]] == [("dense_resident", 1), ("sparda", 1),
                                                              ("dense_resident", 2), ("sparda", 2)]
    for x in r["rows"]:
        assert x["status"] == "ok" and x["error"] is None, x
        assert (x["context"], x["prompt_tokens"], x["new_tokens"], x["steps_per_call"]) == (CONTEXT, CONTEXT, NEW, K)
        assert x["generated_tokens"] == [NEW] * x["batch"]  # greedy, no stop token
        assert x["decode_steps"] == NEW - 1 and len(x["stamps_s"]) == NEW
        for f in ("steady_tokens_per_s", "prefill_s", "first_call_s", "cold_prefill_s", "first_decode_s"):
            assert x[f] > 0, f
        offload = x["system"] == "sparda"
        for f in ("miss_rate", "bytes_copied_per_token", "copied_blocks", "selected_blocks"):
            assert (x[f] is not None) == offload, f
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))  # the JSON is the returned result
    assert r["complete"] and r["config"]["steps_per_call"] == K and not r["config"]["steps_per_call_default"]
    assert r["environment"]["device"] and r["environment"]["jax"] == jax.__version__
    assert set(r["compilation_cache"]) == {"enabled", "dir", "entries_at_start"}
    assert "itemsize" in r["definitions"]["bytes_copied_per_token"]
    assert r["claims"] == []  # issue 28's targets are at 4K batch 1 only
    assert RM.plot(out) and out.with_suffix(".png").stat().st_size > 1000


def test_steady_rate_leaves_the_first_call_out(grid):
    """From the stamps (each token's read, [0] the prompt's): the first decode call ends at
    stamps[K]; the steady rate is the later calls' tokens over their time. The first call
    (compiles: traced and lowered even when the persistent cache holds the program) costs more
    than a steady call, and the warm prefill less than the cold one."""
    r, _, _ = grid
    for x in r["rows"]:
        st = x["stamps_s"]
        steady_steps = NEW - 1 - K
        assert x["steady_steps"] == steady_steps and x["first_call_steps"] == K
        assert x["steady_tokens_per_s"] == pytest.approx(x["batch"] * steady_steps / (st[-1] - st[K]), rel=1e-3)
        assert x["cold_prefill_s"] == pytest.approx(st[0], abs=1e-4)
        assert x["first_decode_s"] == pytest.approx(st[K] - st[0], abs=1e-4)
        assert x["first_call_s"] == pytest.approx(x["cold_prefill_s"] + x["first_decode_s"])
        per_call = x["steady_s"] / (steady_steps // K)
        assert x["first_decode_s"] > per_call, x
        assert x["prefill_s"] < x["cold_prefill_s"], x
        assert len(x["prefill_s_samples"]) == RM.WARM_REPEATS and x["prefill_s"] == np.median(x["prefill_s_samples"])
        # what a rate over every decode step would say: the first call inside makes it lower
        assert x["batch"] * (NEW - 1) / (st[-1] - st[0]) < x["steady_tokens_per_s"]


def test_prefill_profile_traces_one_more_warm_prefill(tiny, tmp_path):
    """profile_prefill: each row carries the summary of one traced warm prefill (on the CPU the
    host's XLA threads), and the traced call leaves the timed fields as they are measured."""
    r = RM.bench_realmodel(tiny, systems=("dense_resident",), contexts=(CONTEXT,), batches=(1,), new_tokens=NEW,
                           steps_per_call=K, command="test", progress=False, log=lambda s: None, profile_prefill=True)
    (x,) = r["rows"]
    p = x["prefill_profile"]
    assert x["status"] == "ok" and p["steps"] == 1 and p["kernels_per_step"] >= 1, p
    assert 0 < p["busy_s_per_step"] <= p["span_s_per_step"], p
    assert len(x["prefill_s_samples"]) == RM.WARM_REPEATS
    lines = RM.profile_lines([x], label=lambda y: "prefill", key="prefill_profile")
    assert lines and lines[0].startswith("profile prefill")


def test_decode_profile_traces_the_steady_steps_only(tiny):
    """profile_decode: the trace opens after the first decode call, so its summary is per steady
    step, NEW - 1 - K of them."""
    r = RM.bench_realmodel(tiny, systems=("sparda",), contexts=(CONTEXT,), batches=(1,), new_tokens=NEW,
                           steps_per_call=K, command="test", progress=False, log=lambda s: None, profile_decode=True)
    (x,) = r["rows"]
    p = x["decode_profile"]
    assert x["status"] == "ok" and "prefill_profile" not in x, x
    assert p["steps"] == NEW - 1 - K and p["kernels_per_step"] >= 1, p
    assert 0 < p["busy_s_per_step"] <= p["span_s_per_step"], p
    # every kernel of the step is listed (an inventory), not only the costliest
    assert sum(t["calls_per_step"] for t in p["top"]) == pytest.approx(p["kernels_per_step"])
    lines = RM.profile_lines([x], label=lambda y: "decode", key="decode_profile")
    assert lines and lines[0].startswith("profile decode")


def test_miss_rate_and_bytes_against_an_independent_run(grid, tiny):
    """The same prompts through `generate` directly (the same programs, compiled already): the
    same counters; bytes per token = copied x (K and V x 16 tokens x head dim 16 x 4 bytes)
    / (8 steps x batch)."""
    r, _, _ = grid
    fc = init_forecast(tiny.config, jax.random.key(0))  # prepare_modes' untrained Forecast for seed 0
    for x in (x for x in r["rows"] if x["system"] == "sparda"):
        prompts = [haystack_tokens(tiny.tokenizer.encode, CONTEXT, seed=i) for i in range(x["batch"])]
        _, st = generate(tiny.params, tiny.config, prompts, SamplingConfig(max_new_tokens=NEW),
                         engine=EngineConfig("sparda"), forecast=fc, return_stats=True, steps_per_call=K)
        assert (x["copied_blocks"], x["selected_blocks"]) == (st["copied_blocks"], st["selected_blocks"])
        assert 0 <= x["miss_rate"] <= 1 and 0 < x["copied_blocks"]
        assert x["miss_rate"] == st["copied_blocks"] / st["selected_blocks"]
        assert x["bytes_copied_per_token"] == st["copied_blocks"] * (2 * 16 * 16 * 4) / (8 * x["batch"])


def test_bad_input_is_refused_before_any_work(tiny, monkeypatch, capsys):
    def no_work(*a, **kw):
        raise AssertionError("work started")

    monkeypatch.setattr(RM, "generate", no_work)
    monkeypatch.setattr(RM, "prepare_modes", no_work)
    kw = dict(systems=("sparda",), contexts=(CONTEXT,), batches=(1,), new_tokens=NEW, progress=False)
    for bad, match in ((dict(systems=("sparda", "fast")), r"unknown system\(s\) \['fast'\]"),
                       (dict(contexts=(5000,)), "tiny: context 5000 exceeds the model's 4096 positions"),
                       (dict(batches=(1, 0)), "a batch must be an integer >= 1, got 0"),
                       (dict(new_tokens=1), "new_tokens must be an integer >= 2"),
                       (dict(steps_per_call=0), "steps_per_call must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            RM.bench_realmodel(tiny, **{**kw, **bad})
    # the command refuses what it can before loading the model
    import sparda_jax.api as api
    from sparda_jax.cli import main

    monkeypatch.setattr(api, "load_pretrained", no_work)
    for argv, msg in ((["--systems", "fast"], "unknown system(s) ['fast']"),
                      (["--batches", "0"], "a batch must be an integer >= 1, got 0"),
                      (["--first-token-implementation", "select=xla"], "give --first-token too"),
                      (["--first-token-without-store"], "give --first-token too")):
        assert main(["--no-compile-cache", "bench", "realmodel", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_every_cell_gets_a_row_failed_or_skipped(tiny, monkeypatch, tmp_path):
    """A failing cell is a row with its error and the run goes on; past the budget, cells are
    skipped rows."""
    def cell(model, prompts, system, extra, new_tokens, k, profile_prefill=False, implementations=None,
             profile_decode=False, copy_start="one"):
        if system == "sparda":
            raise RuntimeError("no copy for you\nsecond line")
        return {"steady_tokens_per_s": 1.0, "prefill_s": 0.5}

    monkeypatch.setattr(RM, "_cell", cell)
    monkeypatch.setattr(RM, "prepare_modes", lambda *a, **kw: {"forecast_trained": False})
    out = tmp_path / "r.json"
    r = RM.bench_realmodel(tiny, systems=("sparda", "dense_resident"), contexts=(64, 4096), batches=(1,),
                           new_tokens=NEW, out=out, progress=False, log=lambda s: None)
    assert [(x["system"], x["context"], x["status"]) for x in r["rows"]] == [
        ("sparda", 64, "error"), ("dense_resident", 64, "ok"), ("sparda", 4096, "error"),
        ("dense_resident", 4096, "ok")]
    assert r["rows"][0]["error"] == "RuntimeError: no copy for you" and r["rows"][1]["steady_tokens_per_s"] == 1.0
    # 4096 + 9 new tokens pass tiny's 4096 positions: the prompt is the longest multiple of 64 that fits
    assert r["rows"][3]["prompt_tokens"] == 4032 and "shortened to 4032" in r["rows"][3]["note"]
    assert r["claims"] == []  # no SparDA row to compare; prefill claims need rows besides Dense+
    skipped = RM.bench_realmodel(tiny, systems=("dense_resident",), contexts=(64,), batches=(1, 2), new_tokens=NEW,
                                 budget=Budget(0.0), progress=False, log=lambda s: None)
    assert [x["status"] for x in skipped["rows"]] == ["skipped", "skipped"]
    assert skipped["rows"][0]["error"].startswith("budget of 0 s exceeded")  # the status says "skipped"
    assert "| sparda | 64 | 64 | 1 |" in RM.table(r)


def test_claims_at_4k_batch_1():
    rows = [{"system": s, "context": 4096, "batch": 1, "status": "ok", "steady_tokens_per_s": v, "prefill_s": p}
            for s, v, p in (("dense_resident", 300.0, 0.2), ("sparda", 180.0, 0.4), ("sparse", 150.0, 0.25))]
    rows.append({**rows[1], "batch": 8, "steady_tokens_per_s": 1.0})  # another cell: no claim
    cl = {c["claim"]: (c["value"], c["met"]) for c in RM.claims(rows)}
    assert cl == {"SparDA / Dense+ steady decode tokens/s, 4K batch 1 (at least)": (0.6, True),
                  "SparDA / Dense+ steady prefill seconds, 4K batch 1 (at most)": (2.0, False),
                  "Sparse / Dense+ steady prefill seconds, 4K batch 1 (at most)": (1.25, True)}


def test_defaults():
    from sparda_jax.infer.engine import SYSTEMS

    assert sorted(RM.SYSTEMS) == sorted(SYSTEMS) and RM.SYSTEMS[:2] == ("dense_resident", "sparda")
    # no shorter last call, at least 3 calls, at most 8 steps a call
    assert [RM.default_steps_per_call(n) for n in (64, 65, 8, 9, 2, 3)] == [7, 8, 1, 2, 1, 1]
    assert RM.prompt_length(4096, 64, 8192) == 4096
    assert RM.prompt_length(8192, 64, 8192) == 8128  # SmolLM2's whole context: 8192 - 64 new tokens
    assert RM.prompt_length(8192, 65, 8192) == 8064
    assert RM.prompt_length(8100, 64, 8192) == 8100  # padded to 8128: + 64 fits
    assert RM.prompt_length(8129, 64, 8192) == 8128  # padded to 8192: + 64 does not
    for args in ((8193, 64, 8192), (64, 8192, 8192)):
        with pytest.raises(ValueError):
            RM.prompt_length(*args)


def test_the_n_step_program_compiles_once_a_cell(grid):
    """steps_per_call > 1: every decode call after the first is fed the last call's token; it must
    be committed as the first call's is, or the program compiles a second time inside the steady
    window. Four cells of distinct shapes or systems: four compiles."""
    _, _, compiles = grid
    loops = [c for c in compiles if c.startswith("Compiling jit(_engine_decode_loop_impl)")]
    assert len(loops) == 4, [c[:200] for c in loops]


def test_the_results_index_shows_the_run_once_committed(grid, tmp_path, monkeypatch):
    from sparda_jax.bench import index

    monkeypatch.setattr(index, "RESULTS", tmp_path)
    (tmp_path / "realmodel").mkdir()
    assert index._realmodel_sections() == []  # no run committed yet: no section
    r, out, _ = grid
    (tmp_path / "realmodel" / "realmodel.json").write_text(out.read_text())
    page = "\n".join(index._realmodel_sections())
    for x in r["rows"]:
        assert (f"| {CONTEXT} | {x['batch']} | {index.LABELS[x['system']]} | {x['steady_tokens_per_s']:.1f} | "
                f"{x['prefill_s']:.3f} |") in page
    assert f"### `realmodel/realmodel.json` ({r['environment']['commit'][:7]}, " in page
    assert f"({r['environment']['device']}; no paper figure)" in page


def test_cli_first_token_runs_generate_cold_then_warm_and_keeps_its_lines(monkeypatch):
    """Each system runs twice in a fresh process sharing one new cache folder; the row keeps the
    load, timing and first-calls lines apart, and the forced backends reach the command line."""
    import subprocess

    calls = []

    class FakeProc:
        def __init__(self, cmd, stdout, stderr, env):
            calls.append((cmd, env["SPARDA_JAX_CACHE_DIR"]))
            self.returncode = 0
            self.stdout = types.SimpleNamespace(read=lambda n: b"T")

        def communicate(self):
            err = ("loading...\nloaded smollm2-135m in 1.0 s\n[40 prompt tokens, 4 new tokens in 2.0 s: prefill 1.00 s, "
                   "first step 0.50 s, steady -]\n[first calls: prefill 1.00 s = trace 0.10 + lower 0.10 + compile "
                   "0.10 + the rest 0.70]\n")
            return b"he rest", err.encode()

    monkeypatch.setattr(subprocess, "Popen", FakeProc)
    rows = RM.cli_first_token("smollm2-135m", "hello", systems=("dense_resident", "sparda"),
                              implementation=("select=xla",), log=lambda s: None)
    assert [(r["system"], r["run"]) for r in rows] == [("dense_resident", "cold"), ("dense_resident", "warm"),
                                                       ("sparda", "cold"), ("sparda", "warm")]
    assert calls[0][1] == calls[1][1] != calls[2][1] == calls[3][1]  # a new cache per system, shared by its 2 runs
    assert all(c[-2:] == ["--implementation", "select=xla"] for c, _ in calls)
    r = rows[0]
    assert r["implementation"] == ["select=xla"] and r["returncode"] == 0 and r["first_token_s"] is not None
    assert r["load_line"] == "loaded smollm2-135m in 1.0 s"
    assert r["timing_line"].startswith("[40 prompt tokens") and r["first_calls_line"].startswith("[first calls:")
    assert r["program_store"] and not any("--no-program-store" in c for c, _ in calls)
    calls.clear()
    rows = RM.cli_first_token("smollm2-135m", "hello", systems=("sparda",), program_store=False, log=lambda s: None)
    assert all(c[3] == "--no-program-store" and c[4] == "generate" for c, _ in calls) and len(calls) == 2
    assert [r["program_store"] for r in rows] == [False, False]


def test_forced_backends_reach_every_cell_and_the_json(tiny, monkeypatch):
    """implementations= (the command's --implementation) is the engine's in every generate the
    cells run, and the config records it."""
    from sparda_jax.config import Implementations

    seen = []
    real = RM.generate

    def spy(*a, **kw):
        seen.append(kw["engine"].implementations)
        return real(*a, **kw)

    monkeypatch.setattr(RM, "generate", spy)
    forced = Implementations(sparse_attention="xla", select="xla")
    r = RM.bench_realmodel(tiny, systems=("sparda",), contexts=(CONTEXT,), batches=(1,), new_tokens=NEW,
                           steps_per_call=K, progress=False, log=lambda s: None, implementations=forced)
    assert r["rows"][0]["status"] == "ok", r["rows"][0]
    assert seen and all(x == forced for x in seen)  # the cold run and each warm prefill
    assert r["config"]["implementations"] == {"dense_attention": None, "sparse_attention": "xla", "select": "xla",
                                              "kv_copy": None, "copy_plan": None}
