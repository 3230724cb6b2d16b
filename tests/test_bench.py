"""Benchmarks run end to end at toy sizes (their real runs are on the GPU)."""

import math

import numpy as np

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


def _tiny_kw(tmp_path, name):
    # tiny preset (4 heads / 2 KV heads, d 16, 16-token blocks): the XLA paths end to end; the
    # Mosaic/cuDNN variants cannot run on the CPU and must say why instead of stopping the run
    return dict(lengths=(512,), batch=2, decode_batches=(2,), repeats=2, matmul_n=128, copy_mib=1,
                decode_steps=2, out=tmp_path / f"{name}.json", log=lambda s: None)


def test_attention_bench_smoke_on_cpu(tmp_path):
    import json

    from sparda_jax.bench.attention import bench_attention, plot, table

    r = bench_attention("tiny", variants=("xla", "dense_xla", "cudnn", "mosaic_gpu", "mosaic_gpu@simple"), timed_queries=256,
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
    dx = d["variants"]["xla"]
    assert dx["status"] == "ok" and dx["check"]["passed"] and dx["gb_per_s"] > 0 and d["steps"] == 2
    assert dx["bytes_per_step"] == d["bytes_selected_per_step"] > 0
    assert len(r["claims"]) == 2 and {"value", "target", "met"} <= set(r["claims"][0])
    assert "| prefill | 512 | 2 | xla* |" in table(r)
    out = plot(tmp_path / "attention.json")
    assert out is None or out.endswith("attention.png")


def test_select_bench_smoke_on_cpu(tmp_path):
    from sparda_jax.bench.select import bench_select, id_check, table

    r = bench_select("tiny", timed_queries=256, variants=("forecast_xla", "infllmv2_xla", "forecast_mosaic",
                                                          "infllmv2_mosaic"), **_tiny_kw(tmp_path, "select"))
    assert r["complete"] and [c["phase"] for c in r["cases"]] == ["prefill", "decode"]
    for c in r["cases"]:
        for n in ("forecast_xla", "infllmv2_xla"):
            v = c["variants"][n]
            assert v["status"] == "ok" and v["check"]["passed"] and v["check"]["id_agreement"] == 1.0
            assert v["seconds_layer"] > 0 and v["floor_seconds"] > 0
        assert c["variants"]["infllmv2_mosaic"]["status"].startswith("unavailable")
        assert c["best_forecast"] == "forecast_xla" and c["best_infllmv2"] == "infllmv2_xla"
        assert c["speedup_forecast"] > 0 and c["attention_seconds_layer"] > 0 and c["attention_variant"] == "xla"
    assert r["cases"][0]["variants"]["forecast_xla"]["scale"] == 2.0
    assert {cl["claim"].split(":")[1].strip() for cl in r["claims"]} == {
        "InfLLM-V2 time / Forecast time", "Forecast selection / sparse attention time"}
    assert "forecast_xla*" in table(r)
    bad = id_check(np.array([[0, 1, 2, -1]]), np.array([[0, 1, 3, -1]]))
    assert not bad["passed"] and abs(bad["id_agreement"] - 2 / 3) < 1e-9
