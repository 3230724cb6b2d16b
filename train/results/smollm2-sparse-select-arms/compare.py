"""The block-choice term against controls: paired differences of held-out copy NLL between the
arms (same corpus and seed, so the same 32 copy sequences per length: 8 from each of four
held-out splits), the ratio Sparse / own dense, the share of dense attention inside the blocks
InfLLM-V2 chose ("mass", selection suite) and the share of selections that hold the copy's
source block. Run from the repository root:

    python train/results/smollm2-sparse-select-arms/compare.py > train/results/smollm2-sparse-select-arms/compare.json
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
ARMS = {  # name -> (copy JSON, selection JSON)
    "shipped": ("eval/results/sparse_native/baselines_copy.json", "eval/results/sparse_native/baselines_selection.json"),
    "sel8k": ("train/results/smollm2-sparse-select-8k/eval/baselines_sn_copy.json",
              "train/results/smollm2-sparse-select-8k/eval/baselines_sn_selection.json"),
    **{a: (f"{HERE}/{a}/eval/baselines_{a}_copy.json", f"{HERE}/{a}/eval/baselines_{a}_selection.json")
       for a in ("sel4k", "ctl4k", "ctl8k", "l18")},
}
# (arm, its control, what the difference isolates)
PAIRS = [("sel4k", "ctl4k", "the term, 4K windows"),
         ("l18", "ctl4k", "the term on layer 18 alone (weight 0.5), 4K windows"), ("sel8k", "ctl8k", "the term, 8K windows"),
         ("ctl4k", "shipped", "250 more steps without the term, 4K windows"),
         ("ctl8k", "shipped", "250 more steps without the term, 8K windows")]


def copy_rows(result: dict, mode: str, length: int) -> list[dict]:
    return sorted((r for r in result["rows"] if r.get("suite") == "copy" and r["mode"] == mode
                   and r["length"] == length), key=lambda r: r["split"])


def per_sample(result: dict, mode: str, length: int, key: str = "copy_nll_per_sample") -> np.ndarray:
    return np.array([x for r in copy_rows(result, mode, length) for x in r[key]])


def pooled_selection(result: dict, mode: str, length: int, key: str) -> float:
    rows = [r for r in result["rows"] if r["mode"] == mode and r["length"] == length and key in r]
    return float(np.mean([r[key] for r in rows]))


def main() -> dict:
    copy = {a: json.loads(Path(c).read_text()) for a, (c, _) in ARMS.items()}
    sel = {a: json.loads(Path(s).read_text()) for a, (_, s) in ARMS.items()}
    out = {"arms": {}, "pairs": []}
    for a in ARMS:
        out["arms"][a] = {"device": copy[a]["environment"]["device"], "by_length": {}}
        for n in (4096, 8192):
            d, s = per_sample(copy[a], "dense", n), per_sample(copy[a], "sparse", n)
            out["arms"][a]["by_length"][n] = {
                "copy_nll_dense": float(d.mean()), "copy_nll_sparse": float(s.mean()),
                "sparse_over_dense": float(s.mean() / d.mean()),
                "source_share_sparse": float(per_sample(copy[a], "sparse", n, "source_share_per_sample").mean()),
                "mass_sparse": pooled_selection(sel[a], "sparse", n, "attention_mass"),
                "ppl_late_dense": pooled_selection(sel[a], "dense", n, "ppl_late"),
                "ppl_late_sparse": pooled_selection(sel[a], "sparse", n, "ppl_late")}
    for a, b, what in PAIRS:
        for n in (4096, 8192):
            for mode in ("dense", "sparse"):
                diff = per_sample(copy[a], mode, n) - per_sample(copy[b], mode, n)
                out["pairs"].append({"arm": a, "control": b, "isolates": what, "length": n, "mode": mode,
                                     "copy_nll_diff": float(diff.mean()),
                                     "ci95": float(1.96 * diff.std(ddof=1) / np.sqrt(len(diff))), "n": len(diff)})
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
