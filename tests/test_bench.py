"""Benchmarks run end to end at toy sizes (their real runs are on the GPU)."""

import math

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
