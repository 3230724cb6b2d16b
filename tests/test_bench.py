"""Benchmarks run end to end at toy sizes (their real runs are on the GPU)."""

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax.bench.train_step import bench_train_step


def test_train_step_bench_reports_a_real_step():
    r = bench_train_step("tiny", seq_len=192, micro_batch=2, accumulation=2, repeats=2)
    assert r["loss_finite"] and r["loss"] > 0
    assert r["tokens_per_s"] == 2 * 2 * 192 / r["step_seconds_median"]
    assert r["step_seconds_min"] <= r["step_seconds_median"] <= r["step_seconds_max"]
    assert r["forecast_params"] == 3 * 64 * 2 * 16 and r["layers"] == 3 and math.isfinite(r["tokens_per_s"])


def test_copy_bench_smoke_on_cpu():
    from sparda_jax.bench.copy import bench_copy, table

    r = bench_copy(pool_mib=4, sizes_mib=(1,), ctas=(4,), repeats=2, variants=("bulk", "xla_loop", "uva"))
    by = {x["variant"]: x for x in r["rows"]}
    assert by["bulk"]["gb_per_s"] > 0 and by["xla_loop"]["gb_per_s"] > 0  # checked against NumPy first
    if "error" in by["uva"]:  # no CUDA here: the variant says why instead of a number
        assert "gb_per_s" not in by["uva"]
    assert "| 1 | bulk |" in table(r)


def test_copy_pipeline_bench_on_cpu():
    """The prefetch-pattern sweep through the CUDA calls' CPU twin: every row's copies are
    checked against NumPy inside (a wrong copy records an error), so rows without an error moved
    the right blocks; the table says what was timed."""
    pytest.importorskip("sparda_jax.kernels.kv_copy").build_host_library()
    from sparda_jax.bench.copy import bench_pipeline, pipeline_table

    r = bench_pipeline(layers=2, blocks=(8,), ctas=(2,), threads=(256, 64), compute_ms=0.0, pool_mib=1,
                       dims=(64, 128), repeats=1, implementation="host_ffi", log=lambda m: None)
    rows = r["rows"]
    assert [(x["ctas"], x["threads"]) for x in rows] == [(2, 256), (2, 64)]
    for x in rows:
        assert "error" not in x, x
        assert x["mib_per_layer"] == 8 * 2 * 16 / 1024 and x["work_reps"] == 1
        assert x["pipelined_vs_max"] == x["pipelined_s"] / max(x["compute_s"], x["copy_s"]) > 0
    tab = pipeline_table(r)
    assert "| 8 | 2 | 64 |" in tab and "| 8 | 2 | 256 |" in tab


def _tiny_kw(tmp_path, name):
    # tiny preset (4 heads / 2 KV heads, d 16, 16-token blocks): the XLA paths end to end; the
    # Mosaic/cuDNN variants cannot run on the CPU and must say why instead of stopping the run
    return dict(lengths=(512,), batch=2, decode_batches=(2,), repeats=2, matmul_n=128, copy_mib=1,
                decode_steps=2, out=tmp_path / f"{name}.json", log=lambda s: None)


def test_attention_bench_smoke_on_cpu(tmp_path):
    import json

    from sparda_jax.bench.attention import bench_attention, plot, table

    r = bench_attention("tiny", variants=("xla", "dense_xla", "cudnn", "mosaic_gpu", "mosaic_gpu@s2", "mosaic_gpu@split"),
                        timed_queries=256,
                        **_tiny_kw(tmp_path, "attention"))
    assert r["complete"] and json.loads((tmp_path / "attention.json").read_text())["complete"]
    assert r["ceilings"]["matmul_tflops"] > 0 and r["ceilings"]["hbm_gb_per_s"] > 0
    (p,), (d,) = r["prefill"], r["decode"]
    x = p["variants"]["xla"]
    assert x["status"] == "ok" and x["check"]["passed"] and x["scaled"] and x["timed_queries"] == 256
    assert x["seconds_layer"] == x["seconds"] * 2 and x["tflops_effective"] > 0 and 0 < x["achieved_over_floor"]
    assert p["variants"]["dense_xla"]["check"]["passed"]
    assert p["best_sparse"] == "xla" and p["best_dense"] == "dense_xla" and p["ratio_sparse_over_dense_tflops"] > 0
    assert 4 <= p["union_mean_tile8"] <= 8 * 4 and 0 < p["density_vs_dense_causal"] < 1
    assert p["variants"]["mosaic_gpu"]["status"].startswith("unavailable")  # D=16 / CPU: said, not fatal
    assert set(p["variants"]) == {"xla", "dense_xla", "cudnn", "mosaic_gpu"}  # each phase keeps its own names
    # G = 2 pads to 4 rows a token: the kernel's tile is 16 tokens, whose union floors the sparse rows
    assert x["union_tile_tokens"] == 16 and set(p["union_mean_by_tile_tokens"]) == {"8", "16"}
    assert p["union_mean_by_tile_tokens"]["16"] >= p["union_mean_by_tile_tokens"]["8"]
    dx = d["variants"]["xla"]
    assert dx["status"] == "ok" and dx["check"]["passed"] and dx["gb_per_s"] > 0 and d["steps"] == 2
    assert dx["bytes_per_step"] == d["bytes_selected_per_step"] > 0
    assert d["variants"]["mosaic_gpu@s2"]["status"].startswith("unavailable") and d["best_sparse"] == "xla"
    assert d["variants"]["mosaic_gpu@split"]["status"].startswith("unavailable")  # never a best: not a whole attention
    assert len(r["claims"]) == 2 and {"value", "target", "met"} <= set(r["claims"][0])
    assert "| prefill | 512 | 2 | xla* |" in table(r)
    out = plot(tmp_path / "attention.json")
    assert out is None or out.endswith("attention.png")


def test_decode_case_cycles_positions_only_past_l2(monkeypatch):
    """A context too short for the steps asked cycles its spaced positions when the bytes read
    between two visits of one exceed the L2 guard, and runs fewer steps when they do not."""
    from sparda_jax.bench import attention as ba

    shape, ceil = ba.model_shape("tiny"), {"hbm_gb_per_s": 1.0}
    spacing = (shape["sparse"].local_blocks + 2) * shape["sparse"].block_size
    t = 4 * spacing + shape["sparse"].block_size  # 4 spaced positions
    few = ba.decode_case(t, 2, shape, ceil, variants=("xla",), repeats=1, steps=6)
    assert few["steps"] == few["distinct_positions"] == 4 and few["bytes_between_visits"] is None
    monkeypatch.setattr(ba, "L2_GUARD_BYTES", 0)
    cyc = ba.decode_case(t, 2, shape, ceil, variants=("xla",), repeats=1, steps=6)
    assert cyc["steps"] == 6 and cyc["distinct_positions"] == 4
    assert cyc["positions"] == [t - 1 - (i % 4) * spacing for i in range(6)]
    assert cyc["bytes_between_visits"] == 3 * cyc["bytes_selected_per_step"] > 0
    assert cyc["variants"]["xla"]["check"]["passed"] and cyc["variants"]["xla"]["steps_per_call"] == 6


def test_decode_steps_unrolled_equal_the_mapped_ones():
    """bench attention's two ways to issue a call's decode steps run the same steps."""
    import functools

    from sparda_jax.attention import sparse_attention
    from sparda_jax.bench.attention import _looped

    ks = jax.random.split(jax.random.key(11), 3)
    steps, b, t, kh, g, d, bs = 3, 2, 128, 2, 3, 16, 16
    q = jax.random.normal(ks[0], (steps, b, 1, kh * g, d))
    k, v = (jax.random.normal(x, (b, t, kh, d)) for x in ks[1:])
    pos = jnp.broadcast_to(jnp.array([40, 90, 127])[:, None, None], (steps, b, 1)).astype(jnp.int32)
    # each step's block and the 2 before it
    last = pos[:, :, :, None, None] // bs  # [steps, B, 1, 1, 1]
    ids = (last - jnp.arange(3)[None, None, None, None, :]).clip(-1)
    ids = jnp.broadcast_to(ids.reshape(steps, b, 1, 1, 3), (steps, b, kh, 1, 3)).astype(jnp.int32)  # [steps, B, K, 1, n]
    one = functools.partial(sparse_attention, block_size=bs, implementation="xla")
    mapped = _looped(one, False, "map")(q, k, v, ids, pos)
    unrolled = _looped(one, False, "unroll")(q, k, v, ids, pos)
    np.testing.assert_allclose(unrolled, mapped, rtol=1e-6, atol=1e-6)  # the same f32 ops, fused apart
    with pytest.raises(ValueError, match="loop"):
        _looped(one, False, "scan")


def test_correlated_queries_are_unit_ar1_and_shrink_the_tile_union(tmp_path):
    from sparda_jax.bench.attention import bench_attention, correlated_normal

    x = np.asarray(correlated_normal(jax.random.key(0), (4, 5000, 2), 0.9, jnp.float32))
    # 40000 pairs: the sample correlation and variance are within ~0.01 of their values
    assert abs(np.corrcoef(x[:, 1:].ravel(), x[:, :-1].ravel())[0, 1] - 0.9) < 0.02
    assert abs(x.std() - 1.0) < 0.03 and abs(x[:, 0].std() - 1.0) < 0.5
    lag5 = np.corrcoef(x[:, 5:].ravel(), x[:, :-5].ravel())[0, 1]
    assert abs(lag5 - 0.9**5) < 0.03  # an AR(1), not just neighbours alike
    unions = {}
    for rho in (0.0, 0.99):
        r = bench_attention("tiny", variants=("xla",), timed_queries=256, query_correlation=rho, decode=False,
                            **_tiny_kw(tmp_path, f"a{rho}"))
        (p,) = r["prefill"]
        assert not r["decode"] and r["config"]["query_correlation"] == rho and p["variants"]["xla"]["check"]["passed"]
        unions[rho] = p["union_mean_tile8"]
    assert unions[0.99] < unions[0.0]  # neighbours alike choose alike


def test_select_bench_smoke_on_cpu(tmp_path):
    from sparda_jax.bench.select import bench_select, id_check, table

    r = bench_select("tiny", timed_queries=256, variants=("forecast_xla", "infllmv2_xla", "forecast_mosaic_gpu",
                                                          "infllmv2_mosaic_gpu"), **_tiny_kw(tmp_path, "select"))
    assert r["complete"] and [c["phase"] for c in r["cases"]] == ["prefill", "decode"]
    for c in r["cases"]:
        for n in ("forecast_xla", "infllmv2_xla"):
            v = c["variants"][n]
            assert v["status"] == "ok" and v["check"]["passed"] and v["check"]["id_agreement"] == 1.0
            assert v["seconds_layer"] > 0 and v["floor_seconds"] > 0
        assert c["variants"]["infllmv2_mosaic_gpu"]["status"].startswith("unavailable")
        assert c["best_forecast"] == "forecast_xla" and c["best_infllmv2"] == "infllmv2_xla"
        assert c["speedup_forecast"] > 0 and c["attention_seconds_layer"] > 0 and c["attention_variant"] == "xla"
        # the attention floor is the layer's (a prefill slice's floor scaled like its seconds)
        fx = c["variants"]["forecast_xla"]
        fa = fx["floor_seconds"] * fx.get("scale", 1.0) / c["forecast_over_attention_at_floors"]
        assert 0 < fa < c["attention_seconds_layer"] and fa == pytest.approx(c["attention_floor_seconds"])
    assert all(cl["ratio_at_floors"] > 0 for cl in r["claims"] if "sparse attention" in cl["claim"])
    assert r["cases"][0]["variants"]["forecast_xla"]["scale"] == 2.0
    assert {cl["claim"].split(":")[1].strip() for cl in r["claims"]} == {
        "InfLLM-V2 time / Forecast time", "Forecast selection / sparse attention time"}
    assert "forecast_xla*" in table(r)
    bad = id_check(np.array([[0, 1, 2, -1]]), np.array([[0, 1, 3, -1]]))
    assert not bad["passed"] and abs(bad["id_agreement"] - 2 / 3) < 1e-9


def test_decode_bench_smoke_on_cpu(tmp_path):
    import json

    from sparda_jax.bench.decode import bench_decode, plot, table

    # tiny: 3 layers (2 timed, scaled to 3), 16-token blocks, topk 4; every system, one batch
    r = bench_decode("tiny", lengths=(256,), batches=(8,), layers=2, steps=2, warmup=1, reuse_fractions=(0.5,),
                     real_miss_rates={"sparda": 0.05}, with_ceilings=False, budget_s=None, profile_steps=2,
                     out=tmp_path / "decode.json", log=lambda s: None)
    assert r["complete"] and json.loads((tmp_path / "decode.json").read_text())["complete"]
    assert r["config"]["layers_timed"] == 2 and r["config"]["scaled_to"] == 3
    rows = {(x["mode"], x["variant"]): x for x in r["rows"]}
    for m in ("dense_resident", "sparse_resident", "sparse", "infinigen", "sparda_sync", "sparda"):
        x = rows[(m, "random")]
        assert x["status"] == "ok" and x["check"]["passed"] and x["feasibility"]["fits"], (m, x.get("status"))
        assert x["sync_step_seconds_min"] <= x["sync_step_seconds"] <= x["sync_step_seconds_max"]
        # present and the host's part of the same back-to-back span (bounded by it by construction)
        assert 0 < x["host_period_seconds"] <= x["step_seconds"]
        assert abs(x["tokens_per_s"] - 8 / (x["step_seconds"] * 1.5)) < 1e-6 * x["tokens_per_s"]
        assert abs(x["sync_tokens_per_s"] - 8 / (x["sync_step_seconds"] * 1.5)) < 1e-6 * x["sync_tokens_per_s"]
        if m not in ("dense_resident", "sparse_resident"):
            assert x["check"]["counts_ok"] and x["check"]["vs_resident_row0"]["passed"]
            assert 0 < x["miss_rate"] <= 1 and x["bytes_copied_per_step_scaled"] == 2 * x["bytes_copied_per_step"]
    # half the rows repeat their step: they copy nothing after step 0, so fewer misses
    for m in ("sparse", "sparda"):  # the batch-8 claim's pair
        assert rows[(m, "reuse=0.50")]["miss_rate"] < rows[(m, "random")]["miss_rate"]
    emulated = [x for x in r["rows"] if x["mode"] == "sparda" and "target_miss_rate" in x]
    assert emulated and emulated[0]["target_miss_rate"] == 0.05
    assert r["claims"][0]["claim"].endswith("SparDA / Sparse tokens/s") and r["claims"][0]["value"] > 0
    assert r["best_feasible"]["256"]["sparda"]["batch"] == 8
    assert "| SparDA | 256 | 8 | random |" in table(r)
    # the claims' random rows carry a profile of 2 extra steps; on the CPU, of XLA's host threads
    prof = rows[("sparda", "random")]["profile"]
    assert prof["source"].startswith("host") and prof["events"] > 0 and prof["steps"] == 2
    assert 0 < prof["busy_s_per_step"] <= prof["span_s_per_step"] and prof["top"]
    # the trace is kept flat beside the profile folder (the device tool brings back shallow files)
    assert (tmp_path / "profiles" / "decode_sparda_T256_B8.trace.json.gz").is_file()
    assert not (tmp_path / "profiles" / "decode_sparda_T256_B8").exists() and "profile" not in rows[("sparda", "reuse=0.50")]
    assert "profile SparDA T=256 B=8 random (host" in table(r)
    out = plot(tmp_path / "decode.json")
    assert out is None or out.endswith("decode.png")


def test_decode_bench_steps_per_call_on_cpu():
    """steps_per_call k: each timed call runs k steps in one program (`engine_decode_steps`) on
    the inputs of k single steps, in order, and a row's times and counts stay per step."""
    from sparda_jax import get_preset
    from sparda_jax.bench.decode import _Ctx, _row_inputs, bench_decode

    one, three = (_Ctx("tiny", 2, ("sparda",), 0, None, steps_per_call=k) for k in (1, 3))
    flat = _row_inputs(one, 256, 4, 1, 6)
    chunks = _row_inputs(three, 256, 4, 1, 2)
    assert [c[0].shape for c in chunks] == [(3, 4)] * 2 and [c[1].shape for c in chunks] == [(3, 4)] * 2
    for i, (tok, pos) in enumerate(flat):
        np.testing.assert_array_equal(chunks[i // 3][0][i % 3], tok)
        np.testing.assert_array_equal(chunks[i // 3][1][i % 3], pos)
    assert list(chunks[1][1][:, 0]) == [256] * 3 and list(chunks[1][1][:, 1]) == [259, 260, 261]  # row 0 repeats
    with pytest.raises(ValueError, match="steps_per_call"):
        _Ctx("tiny", 2, ("sparda",), 0, None, steps_per_call=0)
    # a repeated position must start a compression group, or its key would be counted again
    with pytest.raises(ValueError, match="multiple of gcd"):
        _row_inputs(one, 257, 4, 1, 2)
    assert len(_row_inputs(one, 257, 4, 0, 2)) == 2  # rows that advance take any context

    r = bench_decode("tiny", lengths=(256,), batches=(8,), modes=("sparda",), layers=2, steps=2, warmup=1,
                     reuse_fractions=(0.5,), with_ceilings=False, budget_s=None, steps_per_call=3, log=lambda s: None)
    assert r["config"]["steps_per_call"] == 3
    rows = {(x["mode"], x["variant"]): x for x in r["rows"]}
    for m in ("sparda",):  # the loop itself is tested for every kind of mode in test_engine.py
        x = rows[(m, "random")]
        assert x["status"] == "ok" and x["check"]["counts_ok"] and x["check"]["vs_resident_row0"]["passed"], x
        assert x["steps_per_call"] == 3 and x["steps_timed"] == 6
        # per step: at most every selected block is copied, and selected counts (L-1) B K topk a step
        tiny = get_preset("tiny")
        assert x["selected_blocks_per_step"] == 1 * 8 * tiny.num_kv_heads * tiny.sparse.topk
        assert 0 < x["miss_rate"] <= 1 and 0 < x["host_period_seconds"] <= x["step_seconds"]
        assert rows[(m, "reuse=0.50")]["miss_rate"] < x["miss_rate"]


def test_trace_summary_of_a_known_trace():
    from sparda_jax.bench.profile import summarize_trace

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}},
            {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name", "args": {"name": "Stream #9"}},
            {"ph": "M", "pid": 1, "tid": 5, "name": "thread_name", "args": {"name": "XLA Modules"}}]
    # two steps; per step: stream 7 runs a (0-100 us) and b (300-400), stream 9 runs copy (50-250)
    xs = []
    for k in range(2):
        o = 1000 * k
        xs += [{"ph": "X", "pid": 1, "tid": 7, "ts": o, "dur": 100, "name": "a"},
               {"ph": "X", "pid": 1, "tid": 7, "ts": o + 300, "dur": 100, "name": "b"},
               {"ph": "X", "pid": 1, "tid": 9, "ts": o + 50, "dur": 200, "name": "copy"},
               {"ph": "X", "pid": 2, "tid": 3, "ts": o, "dur": 999, "name": "host work"},
               {"ph": "X", "pid": 2, "tid": 3, "ts": o + 10, "dur": 4, "name": "cuLaunchKernel"},
               {"ph": "X", "pid": 2, "tid": 3, "ts": o + 20, "dur": 6, "name": "cuLaunchKernel"},
               {"ph": "X", "pid": 1, "tid": 5, "ts": o, "dur": 450, "name": "jit_step"}]  # spans the kernels
    s = summarize_trace({"traceEvents": meta + xs}, steps=2)
    assert s["source"] == "device" and s["events"] == 6 and s["kernels_per_step"] == 3
    # span 0..1400 us over 2 steps; busy per step = union(0-250, 300-400) = 350 us
    assert abs(s["span_s_per_step"] - 700e-6) < 1e-12 and abs(s["busy_s_per_step"] - 350e-6) < 1e-12
    assert abs(s["idle_fraction"] - 0.5) < 1e-12
    assert s["streams"] == pytest.approx({"/device:GPU:0 Stream #7": 200e-6, "/device:GPU:0 Stream #9": 200e-6},
                                         rel=1e-12)  # float sums of microseconds
    assert [t["name"] for t in s["top"]] == ["copy", "a", "b"] and s["top"][0]["calls_per_step"] == 1
    assert s["derived_lines_s_per_step"] == pytest.approx({"XLA Modules": 450e-6}, rel=1e-12)
    assert s["overlap_s_per_step"] == pytest.approx(50e-6, rel=1e-9)  # copy beside a: 50-100 us
    m = s["modules"]  # executions 0-450 and 1000-1450: 550 us between, over 2 steps
    assert m["executions"] == 2 and m["gap_s_per_step"] == pytest.approx(275e-6, rel=1e-9)
    # inside each: idle 250-300 (copy -> b) and 400-450 (b -> the end)
    assert m["idle_inside_s_per_step"] == pytest.approx(100e-6, rel=1e-9)
    assert {(g["after"], g["before"]) for g in m["largest_gaps"]} == {("copy", "b"), ("b", "(end)")}
    assert s["host_top"][0] == {"name": "host work", "s_per_step": pytest.approx(999e-6, rel=1e-9), "calls_per_step": 1}
    assert s["host_api"] == [{"name": "cuLaunchKernel", "s_per_step": pytest.approx(10e-6, rel=1e-9), "calls_per_step": 2}]


def test_decode_decomposition_splits_the_speedup_like_the_papers_tables(tmp_path):
    from sparda_jax.bench.decode import decomposition, decomposition_lines, plot

    rng = np.random.default_rng(7)
    tps = dict(zip(("sparse_resident", "sparse", "sparda_sync", "sparda"), rng.uniform(100, 1000, 4)))

    def row(m, variant="random", t=None, status="ok"):
        return {"mode": m, "T": 131072, "batch": 8, "status": status, "variant": variant,
                "tokens_per_s": tps[m] if t is None else t, "miss_rate": None if m == "sparse_resident" else 0.6}

    rows = [row(m) for m in tps] + [row("sparse", "reuse=0.62", 300.0), row("sparda", "reuse=0.62", 510.0),
                                    row("sparda_sync", "random", 1e6, status="out of memory"),
                                    # the real-model rows name each mode's own target: they pair all the same
                                    row("sparse", "reuse=0.75 (real-model target 0.122)", 400.0),
                                    row("sparda", "reuse=0.75 (real-model target 0.086)", 500.0)]
    (d,) = decomposition({"rows": rows})
    f = d["factors"]
    assert f["total"] == pytest.approx(tps["sparda"] / tps["sparse"])
    assert f["selector"] * f["prefetch"] == pytest.approx(f["total"])  # the failed row is not divided
    assert f["copy_free"] == pytest.approx(tps["sparda"] / tps["sparse_resident"])
    bt, bt75 = d["by_traffic"]  # Sparse+ copies nothing: its row pairs with the reuse rows too
    assert bt["variant"] == "reuse=0.62" and bt75["variant"] == "reuse=0.75"
    assert bt["factors"] == {"total": pytest.approx(1.7), "copy_free": pytest.approx(510.0 / tps["sparse_resident"])}
    assert bt75["factors"]["total"] == pytest.approx(1.25)
    # the paper's own split (docs/algorithm.md, section 7): 1.69 at batch 8; at batch 4 its SparDA beats the
    # copy-free Sparse+ (240.2 against 189.5), its selector alone giving 247.3 / 167.8 (abs 5e-3: the
    # ratios as the paper rounds them, to two decimals)
    assert set(d["paper_h100_128k"]) == {"4", "8"}
    assert d["paper_h100_128k"]["8"] == {"total": pytest.approx(1.69, abs=5e-3)}
    assert d["paper_h100_128k"]["4"]["copy_free"] == pytest.approx(1.27, abs=5e-3)
    assert d["paper_h100_128k"]["4"]["selector"] == pytest.approx(1.47, abs=5e-3)
    (line,) = decomposition_lines({"rows": rows})
    assert f"selector {f['selector']:.2f}" in line and "reuse=0.62 (miss 0.600): total 1.70" in line
    # with only Sparse and SparDA there is nothing to split beyond the claim's ratio
    assert decomposition({"rows": [row("sparse"), row("sparda")]}) == []
    for x in rows:
        x.update(step_seconds_scaled=8 / x["tokens_per_s"], floor_seconds=1e-3)
    path = tmp_path / "decode_split.json"
    path.write_text(json.dumps({"name": "decode", "rows": rows}))
    png = plot(path)  # a panel by traffic and one for the split
    assert png is None or pathlib.Path(png).stat().st_size > 0  # None: no matplotlib


def test_decode_plot_by_traffic_where_a_mode_ran_several_miss_rates(tmp_path):
    """The plot gets a panel by miss rate for each (context, batch) some mode ran at several miss
    rates, and none for one run only at random traffic; failed rows do not count."""
    from sparda_jax.bench.decode import plot, traffic_groups

    def row(mode, t, b, variant, miss, ms, status="ok"):
        return dict(mode=mode, system=mode, T=t, batch=b, variant=variant, miss_rate=miss, status=status,
                    step_seconds_scaled=ms / 1e3, floor_seconds=ms / 2e3, tokens_per_s=b * 1e3 / ms)

    rows = [row("sparse", 1024, 8, "random", 0.6, 27.0), row("sparda", 1024, 8, "random", 0.6, 20.0),
            row("sparse", 1024, 8, "reuse=0.62", 0.23, 15.6), row("sparda", 1024, 8, "reuse=0.62", 0.23, 9.0),
            row("sparda", 1024, 16, "random", 0.6, 30.0),  # one miss rate: no panel
            row("sparda", 2048, 8, "random", 0.6, 30.0), row("sparda", 2048, 8, "reuse=0.5", 0.3, 20.0, "infeasible")]
    g = traffic_groups(rows)
    assert list(g) == [(1024, 8)] and len(g[(1024, 8)]) == 4
    path = tmp_path / "decode_x.json"
    path.write_text(json.dumps({"name": "decode", "rows": rows}))
    png = plot(path)
    assert png is None or pathlib.Path(png).stat().st_size > 0  # None: no matplotlib


def test_select_bench_decode_only_names_each_implementation(tmp_path):
    from sparda_jax.bench.select import bench_select, selector
    from sparda_jax.config import SparseConfig

    r = bench_select("tiny", variants=("forecast_xla", "forecast_mosaic_gpu"),
                     prefill=False, **_tiny_kw(tmp_path, "select_decode"))
    assert r["config"]["phases"] == ["decode"] and [c["phase"] for c in r["cases"]] == ["decode"]
    v = r["cases"][0]["variants"]
    assert v["forecast_xla"]["status"] == "ok"
    # compiled Mosaic (not interpreted) cannot run on the CPU: the row says why, the run goes on
    assert v["forecast_mosaic_gpu"]["status"] != "ok" or jax.default_backend() == "gpu"
    fam, fn = selector("infllmv2_mosaic_gpu", SparseConfig(), 8)
    assert fam == "infllmv2" and fn.keywords["implementation"] == "mosaic_gpu"
    assert selector("forecast_xla", SparseConfig(), 8)[1].keywords["implementation"] == "xla"
    for gone in ("forecast_xla@count_topk", "forecast_xla@mosaic_topk", "forecast_mosaic@bisect"):
        with pytest.raises(ValueError, match="unknown selection variant"):
            selector(gone, SparseConfig(), 8)


def test_decode_bench_reports_what_does_not_fit():
    from sparda_jax.bench.engine_state import bench_config, feasibility, weights_bytes

    _, full = bench_config("minicpm4.1-8b", 4)
    w = weights_bytes(full)
    host, dev = 128 * 2**30, 141 * 10**9  # the H200 machine
    f16 = feasibility(full, "sparda", batch=16, context=131072, weights=w, host_bytes=host, device_bytes=dev)
    f32 = feasibility(full, "sparda", batch=32, context=131072, weights=w, host_bytes=host, device_bytes=dev)
    assert f16["fits"] and 60e9 < f16["host_need_bytes"] < 75e9  # docs/algorithm.md, section 5: ~69 GB
    assert not f32["fits"] and "host needs" in f32["reason"]
    dense = feasibility(full, "dense_resident", batch=32, context=131072, weights=w, host_bytes=host, device_bytes=dev)
    assert not dense["fits"] and "device needs" in dense["reason"]


def test_cta_bench_smoke_on_cpu(tmp_path):
    from sparda_jax.bench.decode import bench_cta, cta_table

    r = bench_cta("tiny", context=256, batches=(4,), ctas=(8,), layers=None, steps=2, warmup=1, budget_s=None,
                  out=tmp_path / "cta.json", log=lambda s: None)
    assert r["complete"] and [x["num_ctas"] for x in r["rows"]] == [16, 8]  # the heuristic's count first
    assert all(x["status"] == "ok" and x["check"]["passed"] for x in r["rows"]) and r["rows"][0]["heuristic"]
    cl = r["claims"][0]
    assert cl["heuristic_ctas"] == 16 and 0 < cl["value"] <= 1
    assert "| 4 | 16 | yes |" in cta_table(r)


def test_prefill_bench_smoke_on_cpu(tmp_path):
    from sparda_jax.bench.prefill import bench_prefill, table

    r = bench_prefill("tiny", lengths=(256,), batch=2, layers=2, repeats=2, budget_s=None, out=tmp_path / "p.json",
                      log=lambda s: None)
    assert r["complete"] and r["config"]["layers_timed"] == 2 and r["config"]["scaled_to"] == 3
    by = {x["mode"]: x for x in r["rows"]}
    for m in ("dense_resident", "sparse", "sparda"):
        x = by[m]
        assert x["status"] == "ok" and x["check"]["small"]["passed"] and x["check"]["finite"]["passed"]
        assert abs(x["tokens_per_s"] - 2 * 256 / (x["seconds"] * 1.5)) < 1e-6 * x["tokens_per_s"]
    assert {c["claim"].split(": ")[1] for c in r["claims"]} == {"SparDA / Sparse tokens/s", "SparDA / Dense+ tokens/s"}
    assert "| SparDA | 256 | 2 | xla,xla |" in table(r)


def test_cli_knows_the_engine_benchmarks():
    from sparda_jax.cli import build_parser

    a = build_parser().parse_args(["bench", "decode", "--lengths", "131072", "--batches", "8", "16", "--layers", "4",
                                   "--budget-s", "100", "--out", "x.json", "--real-miss-rate", "sparse=0.13", "sparda=0.09"])
    assert a.name == "decode" and a.batches == [8, 16] and a.repeats is None
    from sparda_jax.bench.decode import _parse_real

    assert _parse_real(a.real_miss_rate) == {"sparse": 0.13, "sparda": 0.09, "sparda_sync": 0.09}
    assert _parse_real(["0.2"])["infinigen"] == 0.2 and _parse_real(None) is None
    for name in ("prefill", "cta"):
        assert build_parser().parse_args(["bench", name]).name == name


def test_prefill_bench_correlated_inputs_shrink_the_measured_tile_union(tmp_path):
    import json

    from sparda_jax.bench.engine_state import bench_config, correlated_embedding
    from sparda_jax.bench.prefill import _tokens, bench_prefill

    cfg, _ = bench_config("tiny", 2)
    e = np.asarray(correlated_embedding(cfg, 0.9, seed=0), np.float32)  # [256, 64]: rows AR(1) over the row index
    assert e.shape == (cfg.vocab_size, cfg.hidden_size) and abs(e.std() - 0.02) < 0.004
    assert abs(np.corrcoef(e[1:].ravel(), e[:-1].ravel())[0, 1] - 0.9) < 0.05
    tok = np.asarray(_tokens(jax.random.key(1), 3, 300, cfg.vocab_size, 0.9))
    assert (np.diff(tok, axis=1) % cfg.vocab_size == 1).all() and len(set(tok[:, 0])) == 3  # count up, own offsets
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        bench_prefill("tiny", lengths=(256,), input_correlation=1.0, log=lambda s: None)

    unions = {}
    for rho in (0.0, 0.99):
        r = bench_prefill("tiny", lengths=(256,), batch=2, layers=2, repeats=1, budget_s=None, systems=("sparse", "sparda"),
                          input_correlation=rho, out=tmp_path / f"p{rho}.json", log=lambda s: None)
        c = json.loads((tmp_path / f"p{rho}.json").read_text())["config"]
        assert c["input_correlation"] == rho
        assert (c["inputs"] == "random tokens") == (rho == 0) and (rho == 0 or "AR(1)" in c["inputs"])
        for x in r["rows"]:
            u = x["selection_union"]
            assert x["status"] == "ok" and u["status"] == "ok" and u["T"] == 256 and u["layer"] == 1
            # tiny: 16 blocks of 16 tokens, topk 4; a tile's union is >= one token's and <= tile x it
            assert 1 <= u["tile_union_over_selected"]["4"] <= u["tile_union_over_selected"]["8"] <= 8
            unions[(rho, x["mode"])] = u["tile_union_over_selected"]["8"]
    for m in ("sparse", "sparda"):  # neighbours alike choose alike
        assert unions[(0.99, m)] < unions[(0.0, m)] - 0.2, unions


def test_decode_bench_marginal_estimate_on_cpu(monkeypatch):
    from sparda_jax.bench import engine_state
    from sparda_jax.bench.decode import bench_decode, table
    from sparda_jax.config import get_preset

    four = get_preset("tiny").replace(num_layers=4)  # room for 2 (marginal), 3 (timed) and 4 (validation) layers
    monkeypatch.setattr(engine_state, "get_preset", lambda name: four)
    r = bench_decode("tiny", lengths=(256,), batches=(8,), modes=("sparse", "sparda_sync", "sparda"), layers=3, steps=2,
                     warmup=1, reuse_fractions=(), with_ceilings=False, budget_s=None, marginal_layers=2,
                     validate_layers=4, log=lambda s: None)
    rows = {x["mode"]: x for x in r["rows"]}
    # the marginal estimate: the claims' rows (sparse and sparda at batch 8) timed again at 2 layers
    assert "marginal" not in rows["sparda_sync"]
    for m in ("sparse", "sparda"):
        x = rows[m]
        g = x["marginal"]
        assert x["layers_timed"] == 3 and g["layers"] == [2, 3] and g["scaled_to"] == 4
        assert g["per_layer_seconds"] == pytest.approx(x["step_seconds"] - g["step_seconds_lo"])
        assert g["step_seconds_extrapolated"] == pytest.approx(x["step_seconds"] + g["per_layer_seconds"])
        v = g["validation"]
        assert v["layers"] == 4 and v["step_seconds_measured"] > 0
        assert v["step_seconds_predicted"] == pytest.approx(g["step_seconds_extrapolated"])  # 4 layers is the full model
        assert v["step_seconds_by_scaling"] == pytest.approx(x["step_seconds"] * 4 / 3)
    # a claim on the estimate exists where its values do: CPU timings are noisy, and a difference
    # of two can come out <= 0 (then the estimate is None and no claim is made)
    est = {c["claim"]: c for c in r["claims"] if c.get("estimate") == "marginal"}
    tps = {m: rows[m]["marginal"]["tokens_per_s_extrapolated"] for m in ("sparse", "sparda")}
    speed = "decode T=256 B=8: SparDA / Sparse tokens/s (marginal-layer estimate)"
    assert set(est) == ({speed} if None not in tps.values() else set())
    if speed in est:
        assert est[speed]["value"] == pytest.approx(tps["sparda"] / tps["sparse"])
    assert "marginal SparDA T=256 B=8 random: layers 2 and 3" in table(r)


def test_real_miss_rate_rows_bracket_the_target_and_interpolate():
    from sparda_jax.bench.decode import at_miss_rate, real_fractions

    # batch 8, random traffic misses 0.624: 6 repeating rows miss 0.156, 7 miss 0.078
    assert real_fractions(0.122, 0.624, 8) == [6 / 8, 7 / 8]
    assert real_fractions(0.156, 0.624, 8) == [6 / 8]  # exactly 6 rows
    assert real_fractions(0.6, 0.624, 8) == [1 / 8]  # 0 rows (the random row) is not returned
    assert real_fractions(0.7, 0.624, 8) == []  # above the random rate: nothing to emulate

    def row(miss, step):
        return {"batch": 8, "miss_rate": miss, "step_seconds_scaled": step,
                "marginal": {"step_seconds_extrapolated": step / 2}}
    rows = [row(0.624, 0.028), row(0.156, 0.0164), row(0.078, 0.0146)]
    a = at_miss_rate(rows, 0.122, "scaled")
    assert a["between"] == [0.078, 0.156]
    assert a["step_seconds"] == pytest.approx(0.0146 + (0.0164 - 0.0146) * (0.122 - 0.078) / 0.078)
    assert a["tokens_per_s"] == pytest.approx(8 / a["step_seconds"])
    assert at_miss_rate(rows, 0.122, "marginal")["step_seconds"] == pytest.approx(a["step_seconds"] / 2)
    assert at_miss_rate(rows, 0.156, "scaled")["step_seconds"] == pytest.approx(0.0164)
    assert at_miss_rate(rows, 0.05, "scaled") is None  # below every row: no extrapolation
    assert at_miss_rate([row(0.078, 0.0146)], 0.078, "scaled")["step_seconds"] == 0.0146


def test_decode_claims_at_the_real_miss_rates():
    """The batch-8 claim at the real-model miss rates compares the two modes' interpolated steps."""
    from sparda_jax.bench.decode import _claims

    def row(mode, miss, step, target=None):
        x = {"mode": mode, "T": 1024, "batch": 8, "status": "ok", "miss_rate": miss, "step_seconds_scaled": step,
             "tokens_per_s": 8 / step, "variant": "random" if target is None else "reuse", "feasibility": {"fits": True}}
        return x if target is None else {**x, "target_miss_rate": target}
    rows = [row("sparse", 0.62, 0.028), row("sparse", 0.156, 0.0164, 0.122), row("sparse", 0.078, 0.0146, 0.122),
            row("sparda", 0.62, 0.020), row("sparda", 0.156, 0.0120, 0.086), row("sparda", 0.078, 0.0110, 0.086)]
    claims, _ = _claims({"rows": rows, "config": {"modes": ["sparse", "sparda"]}})
    c = {x["claim"]: x for x in claims}
    real = c["decode T=1024 B=8: SparDA / Sparse tokens/s at the real-model miss rates (interpolated)"]
    sparse = 0.0146 + 0.0018 * (0.122 - 0.078) / 0.078
    sparda = 0.0110 + 0.0010 * (0.086 - 0.078) / 0.078
    assert real["value"] == pytest.approx(sparse / sparda) and real["met"] == (sparse / sparda >= 1.7)
    assert c["decode T=1024 B=8: SparDA / Sparse tokens/s"]["value"] == pytest.approx(0.028 / 0.020)
    # no marginal estimate in these rows: no claim on it
    assert not any(x.get("estimate") == "marginal" for x in claims)


def test_marginal_estimate_is_exact_for_a_step_linear_in_layers():
    """step(L) = fixed + L x per_layer: the estimate recovers the full model's step, which scaling
    by full / timed layers overstates by the fixed cost times (full / timed - 1)."""
    from sparda_jax.bench.decode import marginal

    fixed, per, full = 1.3e-3, 0.45e-3, 32

    def row(layers, **kw):
        return {"layers_timed": layers, "batch": 8, "step_seconds": fixed + layers * per, **kw}
    m = marginal(row(4), row(2), full_layers=full)
    assert m["per_layer_seconds"] == pytest.approx(per)
    assert m["step_seconds_extrapolated"] == pytest.approx(fixed + full * per)
    assert m["tokens_per_s_extrapolated"] == pytest.approx(8 / (fixed + full * per))
    assert (fixed + 4 * per) * full / 4 > m["step_seconds_extrapolated"] * 1.2  # the scaling's overstatement
    with pytest.raises(ValueError, match="hi > lo"):
        marginal(row(2), row(4), full_layers=full)


def test_select_bench_xla_variants_stay_xla_where_the_default_picks_kernels(monkeypatch):
    # the selectors' default picks the Mosaic kernels for bf16 prefill on Hopper; the benchmark's
    # "xla" rows must time the jnp path there, not the kernels again. With the platform check
    # forced true on this CPU, a row that followed the default would try to lower a Mosaic GPU kernel.
    import sparda_jax.ops.block_select.api as sel_api
    import sparda_jax.select as sel
    from sparda_jax.bench.attention import model_shape
    from sparda_jax.bench.select import _kc, selector

    monkeypatch.setattr(sel_api, "hopper_gpu", lambda: True)
    shape = model_shape("tiny")
    sp, kh, h, t = shape["sparse"], shape["kv_heads"], shape["heads"], 256
    d = 128  # the default's head-dim condition
    nb = t // sp.block_size
    kq, kf, kk = jax.random.split(jax.random.key(4), 3)
    kc = _kc(kk, 1, t, kh, d, sp)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    x = {"infllmv2": jax.random.normal(kq, (1, t, h, d), jnp.bfloat16),
         "forecast": jax.random.normal(kf, (1, t, kh, d), jnp.bfloat16)}
    assert sel_api.default_order(x["forecast"])[0] == "mosaic_gpu"  # what the default tries first
    import sparda_jax.ops.block_select.forecast_mgpu as fm

    class Ran(Exception):
        pass

    def stand_in(*a, **k):
        raise Ran
    monkeypatch.setattr(fm, "forecast_select", stand_in)
    with pytest.raises(Ran):  # and the default does run the kernel there
        sel.select_blocks_forecast(x["forecast"], kc, pos, sp, n_blocks=nb)
    for name, ref in (("forecast_xla", sel.select_blocks_forecast), ("infllmv2_xla", sel.select_blocks_infllmv2)):
        fam, fn = selector(name, sp, nb)
        got = fn(x[fam], kc, pos)
        want = ref(x[fam], kc, pos, sp, n_blocks=nb, implementation="xla")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_claims_get_a_verdict_only_on_the_target_backend(tmp_path):
    from sparda_jax.bench.timing import claim_lines, write_json

    claims = [{"claim": "decode B=8: Sparse / SparDA", "value": 2.0, "target": 1.7, "met": True}]
    on_cpu = {"environment": {"backend": "cpu"}, "claims": claims}
    assert claim_lines(on_cpu) == ["decode B=8: Sparse / SparDA: 2.00 (target 1.7, no verdict off the GPU)"]
    saved = json.loads(write_json(on_cpu, tmp_path / "r.json").read_text())
    assert saved["claims"][0]["met"] is None and "ran on cpu" in saved["claims"][0]["verdict"]
    on_gpu = {"environment": {"backend": "gpu"}, "claims": claims}
    assert claim_lines(on_gpu) == ["decode B=8: Sparse / SparDA: 2.00 (target 1.7, met)"]
    assert json.loads(write_json(on_gpu, tmp_path / "g.json").read_text())["claims"][0]["met"] is True


def _small_mosaic_shape():
    # the smallest shape the Mosaic kernels take in interpret mode (64-token blocks, head dim 64):
    # 2 query heads on 1 KV head, 2 of the 3 blocks chosen
    import dataclasses

    from sparda_jax.config import get_preset

    sp = dataclasses.replace(get_preset("smollm2-135m").sparse, topk=2, local_blocks=0)
    return {"preset": "small-mosaic", "heads": 2, "kv_heads": 1, "head_dim": 64, "sparse": sp}


def test_attention_train_phase_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The train phase (forward + backward) through bench_attention on the CPU: each sparse
    variant's gradients checked first, then timed; the CPU-less variants say why; the JSON, table
    and plot carry the phase; the goal claim at TRAIN_GOAL_T. (The interpreted Mosaic kernels'
    gradients are tested in tests/test_sparse_attention_grad.py; timing them here cost ~15 s.)"""
    from sparda_jax.bench import attention as ba

    monkeypatch.setattr(ba, "model_shape", lambda preset: _small_mosaic_shape())
    monkeypatch.setattr(ba, "TRAIN_GOAL_T", 192)  # the claim's machinery at this T
    out = tmp_path / "train.json"
    r = ba.bench_attention("small", variants=("xla", "dense_xla", "cudnn", "mosaic_gpu"),
                           lengths=(192,), batch=1, repeats=1, matmul_n=128, copy_mib=1, timed_queries=128,
                           train=True, prefill=False, decode=False, grad_check_t=192, grad_check_queries=64,
                           out=out, log=lambda s: None)
    saved = json.loads(out.read_text())
    assert saved["complete"] and {"commit", "jax", "backend"} <= set(saved["environment"])
    assert saved["train"][0]["variants"]["xla"]["status"] == "ok" and saved["train_grad_check"]
    assert not r["prefill"] and not r["decode"] and r["config"]["train_variants"][0] == "xla"
    gc = r["train_grad_check"]
    assert set(gc) == {"xla", "mosaic_gpu"}  # the dense ones are not checked
    for n in ("xla",):
        assert gc[n]["status"] == "ok" and gc[n]["passed"], gc[n]
        assert 0 < gc[n]["max_rel_err"] <= gc[n]["bound"] and gc[n]["max_abs_err"] > 0
        assert gc[n]["max_rel_err"] == max(gc[n][g]["rel_err"] for g in ("dq", "dk", "dv"))
    assert gc["mosaic_gpu"]["status"].startswith("unavailable") and not gc["mosaic_gpu"]["passed"]
    (c,) = r["train"]
    v = c["variants"]
    assert v["mosaic_gpu"] == {"status": gc["mosaic_gpu"]["status"]}  # not timed
    assert v["cudnn"]["status"].startswith("unavailable")
    for n in ("xla", "dense_xla"):
        assert v[n]["status"] == "ok" and v[n]["check"]["passed"] and v[n]["check"]["grads_finite"], (n, v[n])
        assert v[n]["seconds_layer"] > 0 and v[n]["tflops_effective"] > 0
    assert v["xla"]["scaled"] and v["xla"]["seconds_layer"] == pytest.approx(v["xla"]["seconds"] * 1.5)
    assert c["check_batch_element"] == 0
    assert c["dense_baseline"] == "dense_xla" and c["best_sparse"] == "xla"
    assert c["speedup_sparse_over_dense"] == pytest.approx(v["dense_xla"]["seconds_layer"] / v["xla"]["seconds_layer"])
    assert v["xla"]["speedup_over_dense"] > 0
    (cl,) = r["claims"]
    assert cl["value"] == c["speedup_sparse_over_dense"] and cl["target"] == ba.TRAIN_TARGET
    assert saved["claims"][0]["met"] is None  # a CPU timing gets no verdict
    tab = ba.table(r)
    assert "| train | 192 | 1 | xla* |" in tab and "gradient check xla" in tab
    assert "train T=192 B=1: dense_xla time / sparse time" in tab
    png = ba.plot(out)
    assert png is None or png.endswith("train.png")


def test_attention_train_check_fails_on_a_wrong_backward(monkeypatch):
    """A backward that gets dq 10% too large fails the gradient check (dq alone) and the timed
    case's row check, so the variant is reported as failed and never counted."""
    from sparda_jax.bench import attention as ba
    from sparda_jax.ops.sparse_attention import vjp

    right = vjp.sparse_attention_backward_reference

    def wrong(*a, **kw):
        dq, dk, dv, dbias = right(*a, **kw)
        return dq * 1.1, dk, dv, dbias

    shape = ba.model_shape("tiny")  # 16-token blocks, 4 chosen of 8
    kw = dict(t=128, queries=32)
    assert ba.train_grad_check("xla", shape, **kw)["passed"]
    monkeypatch.setattr(vjp, "sparse_attention_backward_reference", wrong)
    bad = ba.train_grad_check("xla", shape, **kw)
    assert bad["status"] == "grad_check_failed" and not bad["passed"]
    assert not bad["dq"]["passed"] and 0.05 < bad["dq"]["rel_err"] < 0.2 and bad["dk"]["passed"] and bad["dv"]["passed"]
    # timed anyway (no gradient check before), its rows of dq (last sequence) fail the case's own
    # check: flagged, never the best
    c = ba.train_case(128, 2, shape, {"matmul_tflops": 1.0, "hbm_gb_per_s": 1.0}, variants=("xla", "dense_xla"),
                      repeats=1, timed_queries=64, check_rows=16)
    x = c["variants"]["xla"]
    assert x["status"] == "check_failed" and not x["check"]["passed"] and x["check"]["grads_finite"]
    assert c["variants"]["dense_xla"]["status"] == "ok" and c["best_sparse"] is None
    assert "speedup_sparse_over_dense" not in c and "speedup_over_dense" not in x


def test_attention_cli_takes_one_phase_flag(capsys):
    from sparda_jax.bench.attention import main
    from sparda_jax.cli import build_parser

    args = build_parser().parse_args(["bench", "attention", "--train-only", "--prefill-only"])
    assert args.train_only and main(args) == 2
    assert "one of --prefill-only, --decode-only, --train-only" in capsys.readouterr().err
