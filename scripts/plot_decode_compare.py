"""Decode runs side by side: ms per step (bars) and host ms per step (dots) of each system and
traffic, one bar group per row, one colour per run. For runs at one batch and context, where
bench decode's own tokens/s-vs-batch plot is a single point per system.

    python3 scripts/plot_decode_compare.py OUT.png LABEL=run1.json LABEL=run2.json ...
"""

from __future__ import annotations

import json
import sys


def rows_of(path: str) -> dict:
    """(system, traffic) -> (ms/step, host ms/step) of a decode JSON's completed rows."""
    with open(path) as f:
        d = json.load(f)
    out = {}
    for x in d["rows"]:
        if x.get("status") != "ok":
            continue
        key = (x["system"], x["variant"].split(" ")[0])
        out[key] = (x["step_seconds_scaled"] * 1e3, x.get("host_dispatch_seconds", 0.0) * 1e3)
    return {"commit": d["environment"].get("commit", "?")[:7], "rows": out}


def plot(out: str, runs: list[tuple[str, str]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [(label, rows_of(p)) for label, p in runs]
    keys = sorted({k for _, r in data for k in r["rows"]})
    width = 0.8 / len(data)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(keys)), 4))
    for i, (label, r) in enumerate(data):
        xs = [j + (i - (len(data) - 1) / 2) * width for j, k in enumerate(keys) if k in r["rows"]]
        step = [r["rows"][k][0] for k in keys if k in r["rows"]]
        host = [r["rows"][k][1] for k in keys if k in r["rows"]]
        bars = ax.bar(xs, step, width, label=f"{label} ({r['commit']})")
        ax.plot(xs, host, "o", color="black", markersize=4, label="host ms/step" if i == 0 else None)
        for x, v in zip(xs, step):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7, color=bars[0].get_facecolor())
    ax.set_xticks(range(len(keys)), [f"{s}\n{t}" for s, t in keys], fontsize=8)
    ax.set(ylabel="ms per decode step (full model)", title="decode step, one batch and context, by run")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    runs = [tuple(a.split("=", 1)) if "=" in a else (a, a) for a in argv[1:]]
    print(plot(argv[0], runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
