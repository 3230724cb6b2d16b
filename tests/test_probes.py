"""The device probes' CPU-side helpers: what they print from a run must be right, since the run
itself happens once, on a GPU this machine does not have."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "probes" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HLO = """HloModule jit_fn, is_scheduled=true

%fused (p0: bf16[16,16]) -> bf16[16,16] {
  %p0 = bf16[16,16]{1,0} parameter(0)
  ROOT %t = bf16[16,16]{1,0} tanh(%p0)
}

ENTRY %main (a: s32[8], b: s32[8], p: bf16[8,64,128]) -> (bf16[8,64,128]) {
  %a = s32[8]{0} parameter(0)
  %b = s32[8]{0} parameter(1)
  %p = bf16[8,64,128]{2,1,0} parameter(2)
  %s = bf16[8,64,128]{2,1,0} custom-call(%a, %b, %p), custom_call_target="sparda_gather_start", backend_config={lane = 1 : i32, num_ctas = 8 : i32}
  %kv = (bf16[8,64,128]{2,1,0}, bf16[8,64,128]{2,1,0}) custom-call(%a, %b, %p, %p), custom_call_target="sparda_gather_start", backend_config={lane = 0 : i32}
  %v = bf16[8,64,128]{2,1,0} get-tuple-element(%kv), index=1
  %c = bf16[8,64,128]{2,1,0} copy(%s)
  %cv = bf16[8,64,128]{2,1,0} copy(%v)
  %f = bf16[16,16]{1,0} fusion(%a), kind=kLoop, calls=%fused
  %g = bf16[16,16]{1,0} custom-call(%f, %f), custom_call_target="__cublas$gemm"
  %w = bf16[8,64,128]{2,1,0} custom-call(%a, %b, %g, %s), custom_call_target="sparda_gather_wait"
  %c2 = bf16[8,64,128]{2,1,0} copy(%w)
  %m = bf16[16,16]{1,0} custom-call(%g), custom_call_target="sparda_mark", backend_config={id = 3 : i32}
  %o = (bf16[16,16]{1,0}, bf16[8,64,128]{2,1,0}) opt-barrier(%m, %c2)
  ROOT %r = (bf16[8,64,128]{2,1,0}) tuple(%c2)
}
"""


def test_hlo_order_reads_the_schedule_and_flags_copies_of_started_buffers():
    hlo = _load("hlo_order")
    seq, counts = hlo.order(HLO)
    # a copy of a buffer a start wrote, before its wait (also through a tuple element), is COPY!;
    # after the wait it is an ordinary COPY
    assert seq == ["S1", "S*", "COPY!", "COPY!", "f", "gemm", "W", "COPY", "M3", "|"]
    assert counts["COPY!"] == 2 and counts["S1"] == 1
    assert hlo._compact(["f", "f", "S0", "f", "W"]) == "f*2 S0 f W"


def test_overlap_summary_tables_a_run(tmp_path, monkeypatch):
    """The probe's JSON lines -> one JSON with its runs and a table with total / max and / sum
    against the cases alone (a run cut short, or a line that is not JSON, still reads)."""
    summ = _load("overlap_summary")
    lines = [{"header": True, "sms": 132, "driver": 13000, "CUDA_DEVICE_MAX_CONNECTIONS": ""},
             {"case": "spin_alone", "work": "spin", "copies": 0, "ctas": 1, "copy_first": True, "copy_ms": 0.0,
              "work_ms": 1.0, "total_ms": 1.0},
             {"case": "two_spins", "work": "spin", "copies": -1, "ctas": 1, "copy_first": True, "copy_ms": 2.0,
              "work_ms": 1.0, "total_ms": 2.0},
             {"case": "copy_alone", "work": "none", "copies": 1, "ctas": 16, "copy_first": True, "copy_ms": 1.5,
              "work_ms": 0.0, "total_ms": 1.5},
             {"case": "work_alone", "work": "cublas", "copies": 0, "ctas": 16, "copy_first": True, "copy_ms": 0.0,
              "work_ms": 1.0, "total_ms": 1.0},
             {"case": "together", "work": "cublas", "copies": 1, "ctas": 16, "copy_first": True, "copy_ms": 1.5,
              "work_ms": 2.5, "total_ms": 2.5}]
    f = tmp_path / "overlap_probe_inherited.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    run = summ.load(str(f))
    assert run["run"] == "inherited" and run["sms"] == 132 and len(run["cases"]) == 5
    rows = {r.split()[0] + r.split()[1]: r.split() for r in summ.table(run).splitlines()[2:]}
    assert rows["two_spinsspin"][-2:] == ["2.00", "1.00"]          # two spins one after the other
    assert rows["togethercublas"][-2:] == ["1.67", "1.00"]         # total = copy + work: no overlap


def test_hlo_unordered_starts_sees_a_dropped_barrier():
    """A start whose slice reaches an opt-barrier is ordered; one whose slice was dropped is not."""
    hlo = _load("hlo_order")
    text = """ENTRY %m {
  %s0 = f32[8,4]{1,0} custom-call(%a, %b, %p, %c0), custom_call_target="sparda_gather_start"
  %s1 = f32[8,4]{1,0} custom-call(%a, %b, %p, %c1), custom_call_target="sparda_gather_start"
  %m0 = f32[1,1]{1,0} fusion(%s0), kind=kLoop, calls=%sl
  %m1 = f32[1,1]{1,0} fusion(%s1), kind=kLoop, calls=%sl
  %t = (f32[1,1]{1,0}, f32[2]{0}) tuple(%m0, %x)
  %ob = (f32[1,1]{1,0}, f32[2]{0}) opt-barrier(%t)
  %w0 = f32[8,4]{1,0} custom-call(%a, %b, %ob, %s0), custom_call_target="sparda_gather_wait"
  %w1 = f32[8,4]{1,0} custom-call(%a, %b, %m1, %s1), custom_call_target="sparda_gather_wait"
}
"""
    assert hlo.unordered_starts(text) == (2, ["s1"])


def test_every_copy_start_is_ordered_and_no_state_buffer_is_copied(tmp_path):
    """The engine's SparDA step (CPU twin of the CUDA calls, K and V on two lanes and in one
    start) and the prefetch microbenchmark, compiled by XLA: before copy insertion every start's
    slice still reaches its optimization barrier (XLA drops barrier outputs nothing uses, and
    until this was found none of the engine's starts was ordered: XLA could schedule each start
    just before its wait, with nothing beside the copy); and the optimized step copies no cache,
    pool or compressed-key buffer (a reshape around an aliased call, and an append unordered
    with the prefetch's read of the old keys, had made XLA copy them every step)."""
    import os
    import re
    import subprocess
    import sys

    pytest = __import__("pytest")
    pytest.importorskip("sparda_jax.kernels.copy_engine").build_host_library()
    dump = tmp_path / "hlo"
    code = f"""
import sys; sys.path.insert(0, {str(ROOT / 'tests')!r})
import jax, jax.numpy as jnp
import test_engine as te
from sparda_jax.infer.engine import engine_prefill, decode_plan, _engine_decode
from sparda_jax.bench.copy import bench_pipeline
params, forecast, ig = te._make(te.TINY)
cfg, b, t0 = te.TINY, 2, 70
tokens = jax.random.randint(jax.random.key(4), (b, t0 + 20), 0, cfg.vocab_size)
lengths = jnp.array([t0, t0 - 11], jnp.int32)
prompt = jnp.where(jnp.arange(t0)[None] < lengths[:, None], tokens[:, :t0], 0)
for start in ("lanes", "one"):
    _, st = engine_prefill(params, prompt, lengths, cfg, mode="sparda", cache_size=t0 + 20, forecast=forecast)
    plan = decode_plan(cfg, "sparda", st.cache, copy_impl="host_ffi", copy_start=start)
    _engine_decode.lower(params, tokens[jnp.arange(b), lengths], lengths, st, forecast, None, plan=plan).compile()
bench_pipeline(layers=3, blocks=(8,), ctas=(2,), threads=(256,), starts=("lanes",), compute_ms=0.0, pool_mib=1,
               dims=(64, 128), repeats=1, implementation="host_ffi", log=lambda m: None)
"""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=copy-insertion "
                                     "--xla_dump_hlo_module_re=.*(engine_decode|fn).*")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    hlo = _load("hlo_order")
    before = sorted(dump.glob("*before_copy-insertion.txt"))
    checked = 0
    for f in before:
        n, bad = hlo.unordered_starts(f.read_text())
        assert not bad, (f.name, n, bad)
        checked += n
    assert checked >= 2 * 4 + 2 * 2, checked  # the engine's starts (lanes, then one start) and the pipeline's
    for f in dump.glob("*engine_decode*after_optimizations.txt"):
        text = f.read_text()
        entry = text[text.index("\nENTRY"):]
        # caches, pools and compressed keys: float, 4-6 dims (the int32 slot table, [L-1, B, K, n_slots], is
        # still copied once a step: rebuilt by a stack of the layers' new rows; 0.4 MB at batch 16, 128K)
        big = [m for m in re.findall(r"= ((?:f32|bf16|f16)\[[\d,]+\])\{[^}]*\} copy\(", entry)
               if len(m.split("[")[1].split(",")) >= 4]
        assert not big, (f.name, big)


GRAPHS_HLO = """HloModule jit_step, is_scheduled=true

%command_buffer (p0: f32[8], p1: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %fusion.1 = f32[8]{0} fusion(%p0, %p1), kind=kLoop, calls=%fused_add
  ROOT %fusion.2 = f32[8]{0} fusion(%fusion.1), kind=kLoop, calls=%fused_tanh
}

ENTRY %main (a: f32[8], b: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %call = f32[8]{0} call(%a, %b), to_apply=%command_buffer
  %custom-call.3 = f32[8]{0} custom-call(%call), custom_call_target="sparda_gather_start", api_version=API_VERSION_TYPED_FFI
  %fusion.4 = f32[8]{0} fusion(%custom-call.3), kind=kLoop, calls=%fused_neg
  %gte = f32[8]{0} get-tuple-element(%fusion.4), index=0
  ROOT %custom-call.5 = f32[8]{0} custom-call(%fusion.4), custom_call_target="sparda_gather_wait"
}
"""


def test_graph_cuts_counts_what_runs_outside_command_buffers():
    s = _load("graph_cuts").summarize(GRAPHS_HLO)
    assert s["graphs"] == 1 and s["graph_sizes"] == [2] and s["ops_in_graphs"] == 2
    # the two custom calls and the fusion between them launch on their own; parameters and
    # get-tuple-element launch nothing
    assert s["outside_by_op"] == {"custom-call[sparda_gather_start]": 1, "fusion": 1,
                                  "custom-call[sparda_gather_wait]": 1}
    assert s["schedule_head"] == ["CB2", "cc[sparda_gather_start]", "fusion", "cc[sparda_gather_wait]"]


def test_decode_compare_plot_reads_committed_runs(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_decode_compare", ROOT / "scripts" / "plot_decode_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.rows_of(str(ROOT / "bench" / "results" / "decode_depth_queue4x.json"))
    assert r["commit"] == "7b25dc4"
    assert set(r["rows"]) == {("Sparse", "random"), ("Sparse", "reuse=0.88"), ("SparDA", "random"), ("SparDA", "reuse=0.88")}
    step, host = r["rows"][("SparDA", "reuse=0.88")]
    assert 0 < host < step  # with 4x queues the host runs ahead of SparDA's device step
    out = mod.plot(str(tmp_path / "cmp.png"), [("a", str(ROOT / "bench" / "results" / "decode_depth_graph.json")),
                                                ("b", str(ROOT / "bench" / "results" / "decode_depth_queue4x.json"))])
    assert (tmp_path / "cmp.png").stat().st_size > 0 and out.endswith("cmp.png")


def test_graph_updates_counts_re_recordings_per_step():
    mod = _load("graph_updates")
    log = [
        "I1202 thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1 "
        "executions since last update; num_commands=5; updated_allocs=4; is_first_record=true",  # before any step
        f"{mod.MARK}0",
        "I1202 thunk.cc:371] [0] Execute command buffer; num_executions=1",
        f"{mod.MARK}1",
        "I1202 thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1 "
        "executions since last update; num_commands=40; updated_allocs=2; is_first_record=false; needs_update=true",
        "I1202 thunk.cc:371] [0] Execute command buffer; num_executions=1",
        "I1202 thunk.cc:371] [0] Execute command buffer; num_executions=2",
        f"{mod.MARK}2 (end)",
    ]
    s = mod.summarize(log)
    assert s[0] == {"executions": 1, "updates": 0, "updated": {}}
    assert s[1]["executions"] == 2 and s[1]["updates"] == 1 and s[1]["updated"] == {(40, 2): 1}
    assert s[2]["executions"] == 0


def test_graph_update_costs_pair_each_update_with_its_moved_allocations():
    # XLA's command_buffer_thunk=3 lines, as in bench/results/graph_updates/*.log.gz: two graphs
    # interleaved; small graphs (< 100 commands) are left out
    g = _load("graph_updates")
    head = "I1202 16:53:46.933481     587 command_buffer_thunk.cc:336] [0] Create/Update command buffer by "
    upd = lambda n, a: (head + f"recoding command buffer cmd sequence after 1 executions since last update; "
                        f"num_commands={n}; updated_allocs={a}; is_first_record=false; needs_update=true")
    done = lambda n, us: ("I1202 16:53:46.943358     587 command_buffer_thunk.cc:362] [0] Updated command buffer "
                          f"in {us} μs; num_commands={n}")
    log = [upd(1405, 3), upd(5, 2), done(5, 20), done(1405, 6230), upd(1405, 2), done(1405, 121), upd(1405, 3),
           done(1405, 7000)]
    assert g.update_costs(log) == {(1405, 3): [6230, 7000], (1405, 2): [121]}
