"""Synthetic long-context tasks: construction, determinism, scoring, and the harness end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sparda_jax import load_pretrained
from sparda_jax.eval import report
from sparda_jax.eval.accuracy import _t975, eval_tasks, max_task_length, paired_differences, tasks_markdown
from sparda_jax.infer.generate import PAD_MULTIPLE
from sparda_jax.eval.tasks import TASKS, Sample, make_sample


@pytest.fixture(scope="module")
def smollm2():
    return load_pretrained("smollm2-135m")


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_deterministic_sized_and_answerable(smollm2, task):
    tok = smollm2.tokenizer
    a = make_sample(task, tok, 1500, seed=3)
    assert a.prompt_ids == make_sample(task, tok, 1500, seed=3).prompt_ids
    assert a.prompt_ids != make_sample(task, tok, 1500, seed=4).prompt_ids
    assert abs(len(a.prompt_ids) - 1500) <= 16, len(a.prompt_ids)
    text = tok.decode(a.prompt_ids)
    if task == "copy":
        s, e = a.repeat
        n = a.meta["passage_tokens"]
        assert e - s == n and a.prompt_ids[s:e] == a.prompt_ids[:n]
        # the passage occurs nowhere else: its first 32 tokens appear exactly twice
        head = a.prompt_ids[:32]
        hits = [i for i in range(len(a.prompt_ids) - 31) if a.prompt_ids[i:i + 32] == head]
        assert hits == [0, s]
    else:
        assert a.answers and all(x in text for x in a.answers)  # the facts are in the context
        assert tok.decode(a.target_ids).strip().rstrip(".").split(", ")[0].split()[0] in a.answers[0]
        assert text.rstrip().endswith(":")  # an answer prefix the model continues


def test_exact_match_gives_partial_credit():
    s = Sample("niah_multivalue", [], ["1234567", "7654321"], [])
    assert s.exact_match("it is 1234567 and more") == 0.5
    assert s.exact_match("1234567, 7654321") == 1.0
    assert s.exact_match("nothing") == 0.0


def test_harness_end_to_end(smollm2):
    r = eval_tasks(smollm2, tasks=("niah_single", "copy"), lengths=(700,), samples=2, modes=("dense",),
                   progress=False)
    rows = {x["task"]: x for x in r["rows"]}
    assert set(rows) == {"niah_single", "copy"}
    assert 0 <= rows["niah_single"]["em"] <= 1 and rows["niah_single"]["ll"] < 0
    assert rows["copy"]["em"] > 0.6  # SmolLM2 copies a repeated passage (94% at 1K measured)
    # the per-sample values are the ones the means were taken over, and survive JSON
    back = {x["task"]: x for x in json.loads(json.dumps(r))["rows"]}
    for task, fields in (("niah_single", ("em", "ll")), ("copy", ("em", "copy_nll"))):
        for f in fields:
            v = back[task][f"{f}_per_sample"]
            assert len(v) == 2 and all(type(x) is float for x in v)
            assert np.mean(v) == pytest.approx(rows[task][f], rel=1e-6)
    table = tasks_markdown(r)
    assert "| dense |" in table and "niah_single" in table


# 0.975 quantiles of Student t from published tables (scipy, which is not a dependency, agrees)
T975 = {4: 2.776445, 19: 2.093024, 38: 2.024394, 40: 2.021075, 100: 1.983972}


def test_the_longest_task_length_fits_the_model_and_longer_is_refused_up_front(smollm2):
    # SmolLM2 has 8192 positions: an 8192-token haystack plus a 40-token answer cannot fit (the
    # first 8K GPU run failed at its first cell); the harness must say so before any work
    longest = max_task_length(smollm2.config, 40)
    assert longest == 8120
    for task in ("niah_single", "vt"):
        n = len(make_sample(task, smollm2.tokenizer, longest, seed=0).prompt_ids)
        assert -(-n // PAD_MULTIPLE) * PAD_MULTIPLE + 40 <= smollm2.config.max_position_embeddings, n
    with pytest.raises(ValueError, match="longest allowed is 8120"):
        eval_tasks(smollm2, tasks=("niah_single",), lengths=(1024, 8192), samples=1, modes=("dense",),
                   progress=False)


def test_t_quantile_matches_tables():
    for df, t in T975.items():
        assert _t975(df) == pytest.approx(t, abs=2e-6), df
    assert _t975(19.7) == _t975(19)  # fractional df below 31 rounds down: the wider interval
    assert math.isnan(_t975(0))


def _with_spread(rng, n, mean, std):
    """n values whose sample mean and sample standard deviation are exactly mean and std."""
    z = rng.normal(size=n)
    return mean + std * (z - z.mean()) / z.std(ddof=1)


def _synthetic_result(n=20):
    """niah_single and copy at 4096 tokens for sparse (the reference), dense and sparda. Per
    metric, both tasks' differences have one standard deviation, so the Welch-Satterthwaite df
    of the task average is exactly 2 (n - 1); dense is clearly ahead, sparda within noise."""
    rng = np.random.default_rng(7)
    base = {"niah_single": (rng.uniform(-1.5, -0.2, n), rng.integers(0, 3, n) / 2),
            "copy": (rng.uniform(0.2, 0.9, n), rng.uniform(0.6, 1.0, n))}
    shift = {"dense": {"ll": (0.05, 0.02), "em": (0.15, 0.1)}, "sparda": {"ll": (0.004, 0.05), "em": (-0.02, 0.3)}}
    rows = []
    for task, (ll, em) in base.items():
        for mode in ("sparse", "dense", "sparda"):
            if mode == "sparse":
                dll, dem = np.zeros(n), np.zeros(n)
            else:
                # copy moves half as far, so a mix-up of tasks shows
                scale = 0.5 if task == "copy" else 1.0
                dll, dem = (_with_spread(rng, n, scale * shift[mode][k][0], shift[mode][k][1]) for k in ("ll", "em"))
            r = {"task": task, "length": 4096, "mode": mode, "samples": n, "seed": 0,
                 "em": float(np.mean(em + dem)), "em_ci95": 0.1, "em_per_sample": list(map(float, em + dem))}
            if task == "copy":  # stored as an NLL: the higher log-likelihood is the lower NLL
                nll = ll - dll
                r.update(copy_nll=float(nll.mean()), copy_nll_ci95=0.1, copy_nll_per_sample=list(map(float, nll)))
            else:
                r.update(ll=float(np.mean(ll + dll)), ll_ci95=0.1, ll_per_sample=list(map(float, ll + dll)))
            rows.append(r)
    return {"rows": rows, "samples_per_cell": n}


def _numpy_paired(result, task, mode, metric, t):
    by = {(r["task"], r["mode"]): r for r in result["rows"]}

    def vals(r):
        if metric == "ll" and task == "copy":
            return -np.array(r["copy_nll_per_sample"])
        return np.array(r[f"{metric}_per_sample"])

    d = vals(by[(task, mode)]) - vals(by[(task, "sparse")])
    return d.mean(), t * d.std(ddof=1) / math.sqrt(len(d)), d.var(ddof=1) / len(d)


def test_paired_differences_match_numpy():
    res = _synthetic_result(20)
    got = {(d["mode"], d["task"]): d for d in paired_differences(res, reference="sparse")}
    assert set(got) == {(m, t) for m in ("dense", "sparda") for t in ("niah_single", "copy", "avg")}
    for mode in ("dense", "sparda"):
        for metric in ("ll", "em"):
            per = {}
            for task in ("niah_single", "copy"):
                mean, half, var = _numpy_paired(res, task, mode, metric, T975[19])
                per[task] = (mean, var)
                d = got[(mode, task)]
                assert d["n"] == 20 and d["reference"] == "sparse"
                assert d[f"{metric}_diff"] == pytest.approx(mean, rel=1e-9, abs=1e-12)
                assert d[f"{metric}_diff_ci95"] == pytest.approx(half, rel=1e-5)
            # task average: mean of the two task means, variance (v1 + v2) / 2^2, t at 38 df
            a = got[(mode, "avg")]
            assert a["tasks"] == 2
            assert a[f"{metric}_diff"] == pytest.approx((per["niah_single"][0] + per["copy"][0]) / 2, rel=1e-9)
            half = T975[38] * math.sqrt(per["niah_single"][1] + per["copy"][1]) / 2
            assert a[f"{metric}_diff_ci95"] == pytest.approx(half, rel=1e-5)
    # the paired interval is much tighter than the unpaired one would be
    d = got[("dense", "niah_single")]
    ll_sd = np.std(next(r["ll_per_sample"] for r in res["rows"]
                        if r["mode"] == "sparse" and r["task"] == "niah_single"), ddof=1)
    assert d["ll_diff_ci95"] < 0.2 * 1.96 * ll_sd / math.sqrt(20)
    assert d["ll_diff"] - d["ll_diff_ci95"] > 0  # dense is ahead beyond noise
    s = got[("sparda", "avg")]
    assert abs(s["ll_diff"]) < s["ll_diff_ci95"]  # sparda is not


def test_paired_differences_skip_rows_without_per_sample_values():
    res = _synthetic_result(20)
    # a task written before per-sample values were kept, and one whose dense row used another seed
    for mode in ("sparse", "dense", "sparda"):
        res["rows"].append({"task": "vt", "length": 4096, "mode": mode, "samples": 20, "em": 0.5, "em_ci95": 0.2,
                            "ll": -2.0, "ll_ci95": 0.1})
        res["rows"].append({"task": "cwe", "length": 4096, "mode": mode, "samples": 20, "seed": 5 if mode == "dense"
                            else 0, "em": 0.5, "em_ci95": 0.2, "ll": -2.0, "ll_ci95": 0.1,
                            "em_per_sample": [0.0, 1.0] * 10, "ll_per_sample": [-2.5, -1.5] * 10})
    got = {(d["mode"], d["task"]): d for d in paired_differences(res)}
    assert ("dense", "vt") not in got and ("sparda", "vt") not in got and ("dense", "cwe") not in got
    assert got[("sparda", "cwe")]["ll_diff"] == 0.0 and got[("sparda", "cwe")]["ll_diff_ci95"] == 0.0
    assert got[("dense", "avg")]["tasks"] == 2 and got[("sparda", "avg")]["tasks"] == 3
    # the average leaves the unpaired tasks out: unchanged from the two-task result
    two = {(d["mode"], d["task"]): d for d in paired_differences(_synthetic_result(20))}
    assert got[("dense", "avg")]["ll_diff"] == pytest.approx(two[("dense", "avg")]["ll_diff"])
    table = tasks_markdown(res)
    dense = [ln for ln in table.splitlines() if ln.startswith("| dense |")]
    # em, ll, paired ll, paired em; in the paired rows vt and cwe are "-", avg says 2 tasks
    assert len(dense) == 4 and dense[2].split(" | ")[3:5] == ["-", "-"] and "(2 tasks)" in dense[2]


def test_old_results_without_per_sample_values_still_render():
    old = json.loads((Path(__file__).parents[1] / "eval/results/tasks_smollm2_partial.json").read_text())
    assert "ll_per_sample" not in old["rows"][0]
    assert paired_differences(old) == []
    table = tasks_markdown(old)
    assert "| sparse | 60.0 ±22.0 |" in table and "paired difference" not in table


def test_tasks_markdown_renders_paired_section():
    res = _synthetic_result(20)
    table = tasks_markdown(res, reference="sparse")
    lines = table.splitlines()
    heads = [ln for ln in lines if "paired difference vs sparse" in ln]
    assert len(heads) == 2 and all("20 samples per cell" in h and "paired 95% interval" in h for h in heads)
    got = {(d["mode"], d["task"]): d for d in paired_differences(res)}
    rows = {m: [ln for ln in lines if ln.startswith(f"| {m} |")] for m in ("sparse", "dense", "sparda")}
    assert len(rows["sparse"]) == 2  # the reference gets no difference row
    ll_dense, em_dense = rows["dense"][2], rows["dense"][3]
    d = got[("dense", "niah_single")]
    # dense is ahead beyond the interval: bold; sparda within it: plain
    assert f"| **{d['ll_diff']:+.3f} ±{d['ll_diff_ci95']:.3f}** |" in ll_dense
    assert f"| **{100 * d['em_diff']:+.1f} ±{100 * d['em_diff_ci95']:.1f}** |" in em_dense
    s = got[("sparda", "avg")]
    assert rows["sparda"][2].endswith(f"| {s['ll_diff']:+.3f} ±{s['ll_diff_ci95']:.3f} |")
    assert "**" not in rows["sparda"][2]
    # the section comes after the unpaired tables of its length
    assert lines.index(heads[0]) > lines.index(rows["dense"][1])


def test_report_merges_task_files_with_the_paired_section(tmp_path):
    res = _synthetic_result(20)
    env = {"environment": {"commit": "abc", "device": "cpu"}, "command": "sparda eval"}
    # the reference in one file, the other modes in a second, relabelled: pairing spans files
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [r for r in res["rows"] if r["mode"] == "sparse"], **env}))
    b.write_text(json.dumps({"rows": [r for r in res["rows"] if r["mode"] == "dense"], **env}))
    out = tmp_path / "out.md"
    assert report.main([str(out), str(a), f"{b}=dense, trained"]) == 0
    text = out.read_text()
    assert "paired difference vs sparse" in text and "| dense, trained |" in text
    d = {(x["mode"], x["task"]): x for x in paired_differences(res)}[("dense", "copy")]
    assert f"**{d['ll_diff']:+.3f} ±{d['ll_diff_ci95']:.3f}**" in text


def test_report_takes_a_cell_from_the_last_file_that_has_it(tmp_path):
    # a run cut by its time limit, then completed by a second run that repeats one cell
    res = _synthetic_result(20)
    env = {"environment": {"commit": "abc", "device": "cpu"}, "command": "sparda eval"}
    first = [r for r in res["rows"] if r["mode"] == "sparse"]
    again = [dict(first[0], em=0.123, em_per_sample=None)]  # the repeated cell, different numbers
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": first, **env, "complete": False}))
    b.write_text(json.dumps({"rows": again, **env, "complete": True}))
    rows, sources = report.merge([str(a), str(b)])
    cell = [r for r in rows if (r["task"], r["length"], r["mode"]) == (again[0]["task"], again[0]["length"], "sparse")]
    assert len(rows) == len(first) and len(cell) == 1 and cell[0]["em"] == 0.123
    assert [s["complete"] for s in sources] == [False, True]
    assert report.main([str(tmp_path / "o.md"), str(a), str(b)]) == 0
    assert "cut by its time limit" in (tmp_path / "o.md").read_text()


def test_selection_suite_end_to_end(smollm2):
    """The selection suite on real text past the budget (1024 tokens, 8 of 16 blocks chosen):
    InfLLM-V2 is its own oracle, the Forecast is not, and the tile union is between its bounds."""
    import dataclasses

    from sparda_jax.api import Pretrained
    from sparda_jax.eval.selection import TILES, eval_selection

    c = smollm2.config
    small = Pretrained(c.replace(sparse=dataclasses.replace(c.sparse, local_blocks=2, topk=8)), smollm2.params,
                       smollm2.tokenizer, smollm2.dtype)
    r = eval_selection(small, lengths=(1024,), n_seqs=1, modes=("sparse", "sparda"), progress=False)
    rows = {x["mode"].split(" ")[0]: x for x in r["rows"]}
    assert rows["sparse"]["recall"] == 1.0 and 0 < rows["sparda"]["recall"] < 1
    for x in rows.values():
        assert np.isfinite(x["ppl"]) and 0 < x["attention_mass"] <= 1
        u = x["tile_union_over_selected"]
        assert set(u) == {str(t) for t in TILES}
        # 1: a tile's tokens share every block; the tile size: they share none
        assert all(1.0 <= u[str(t)] <= t for t in TILES) and u["4"] <= u["8"] <= u["16"]


def test_budget_table_joins_the_suites_rows_per_mode():
    from sparda_jax.eval.budget import budget_markdown

    rows = []
    for topk, rec, em in ((12, 0.655, 0.559), (24, 0.867, 0.595)):
        rows += [{"topk": topk, "kind": "selection", "mode": "sparse", "ppl": 10.2, "recall": 1.0},
                 {"topk": topk, "kind": "selection", "mode": "sparda (trained)", "ppl": 10.3, "recall": rec},
                 {"topk": topk, "kind": "task", "mode": "sparse", "task": "copy", "em": 0.6},
                 {"topk": topk, "kind": "task", "mode": "sparda", "task": "copy", "em": em}]
    lines = budget_markdown({"rows": rows}).splitlines()
    assert "| 12 | sparda | 10.300 | 0.655 | 55.9 |" in lines and "| 24 | sparda | 10.300 | 0.867 | 59.5 |" in lines
    assert len(lines) == 2 + 4  # header, rule, (sparse, sparda) x 2 budgets
