"""Paired comparison of this adapter's held-out copy NLL with the shipped adapter's, and both
sets of goals on this run's evaluation. Run from the repository root:

    python train/results/smollm2-sparse-select-8k/compare.py > train/results/smollm2-sparse-select-8k/compare.json

The shipped adapter's rows are `eval/results/sparse_native/baselines_copy.json` (same corpus,
same seed, so the same 32 copy sequences per length: 8 from each of four held-out splits).
"""

import json
from pathlib import Path

import numpy as np

from sparda_jax.eval.goals import native_goal_checks, goal_checks

HERE = Path(__file__).parent


def per_sample(result: dict, mode: str, length: int) -> np.ndarray:
    rows = [r for r in result["rows"] if r.get("suite") == "copy" and r["mode"] == mode and r["length"] == length]
    return np.array([x for r in sorted(rows, key=lambda r: r["split"]) for x in r["copy_nll_per_sample"]])


def main() -> dict:
    shipped = json.loads(Path("eval/results/sparse_native/baselines_copy.json").read_text())
    new = json.loads((HERE / "eval/baselines_sn_copy.json").read_text())
    out = {"paired_copy_nll": []}
    for length in (4096, 8192):
        for mode in ("dense", "sparse"):
            a, b = per_sample(new, mode, length), per_sample(shipped, mode, length)
            d = a - b
            out["paired_copy_nll"].append({
                "length": length, "mode": mode, "this": float(a.mean()), "shipped": float(b.mean()),
                "diff": float(d.mean()), "ci95": float(1.96 * d.std(ddof=1) / np.sqrt(len(d))), "n": len(d)})
        out["paired_copy_nll"].append({
            "length": length, "sparse_over_dense_this": float(per_sample(new, "sparse", length).mean()
                                                              / per_sample(new, "dense", length).mean()),
            "sparse_over_dense_shipped": float(per_sample(shipped, "sparse", length).mean()
                                               / per_sample(shipped, "dense", length).mean())})
    sel = json.loads((HERE / "eval/baselines_sn_selection.json").read_text())
    fsel = json.loads((HERE / "eval/sn_sel8k_selection.json").read_text())
    fcopy = json.loads((HERE / "eval/sn_sel8k_copy.json").read_text())
    selection = {"rows": sel["rows"] + fsel["rows"], "budget": sel["budget"]}
    copy = {"rows": new["rows"] + fcopy["rows"], "budget": new["budget"]}
    pooled = lambda checks: [c for c in checks if c["split"] == "all splits"]
    out["native_goals_pooled"] = pooled(native_goal_checks(selection, copy))
    out["forecast_goals_pooled"] = pooled(goal_checks(selection, copy))
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
