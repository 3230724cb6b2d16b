"""Budget sweep: how accuracy and selection recall fall as the block budget shrinks, for the
selectors that need it (Sparse and SparDA by default)."""

from __future__ import annotations

import dataclasses

from sparda_jax.api import Pretrained

from .accuracy import eval_tasks
from .heldout import budget_record
from .selection import eval_selection

__all__ = ["eval_budget", "budget_markdown"]


def eval_budget(model: Pretrained, *, topks=(12, 16, 24, 32), length: int = 4096, samples: int = 10,
                seqs: int = 2, modes=("sparse", "sparda"), tasks=("niah_single", "copy"), seed: int = 0,
                progress: bool = True, on_row=None) -> dict:
    rows = []
    base = model.config
    try:
        for topk in topks:
            model.config = base.replace(sparse=dataclasses.replace(base.sparse, topk=topk))
            sel = eval_selection(model, lengths=(length,), n_seqs=seqs, modes=modes, seed=seed, progress=progress)
            acc = eval_tasks(model, tasks=tasks, lengths=(length,), samples=samples, modes=modes, seed=seed,
                             progress=progress)
            for r in sel["rows"]:
                rows.append({"topk": topk, "kind": "selection", **r, "mode": _label(r["mode"])})
            for r in acc["rows"]:
                rows.append({"topk": topk, "kind": "task", **r})
            if on_row is not None:
                on_row({"rows": rows})
    finally:
        model.config = base
    return {"model": base.name, "length": length, "rows": rows, "samples_per_cell": samples, "seqs": seqs,
            "base_budget": budget_record(base.sparse)}  # rows each carry their own topk


def _label(mode: str) -> str:
    # the selection suite says "sparda (trained)" where the task suite says "sparda"; one row each
    return mode.replace(" (trained)", "")


def budget_markdown(result: dict) -> str:
    result = dict(result, rows=[dict(r, mode=_label(r["mode"])) for r in result["rows"]])
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    tasks = list(dict.fromkeys(r["task"] for r in result["rows"] if r["kind"] == "task"))
    head = "| topk | mode | ppl | recall | " + " | ".join(f"{t} %" for t in tasks) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * len(tasks)]
    for topk in sorted({r["topk"] for r in result["rows"]}):
        for m in modes:
            sel = next((r for r in result["rows"] if r["topk"] == topk and r["mode"] == m and r["kind"] == "selection"),
                       None)
            cells = [f"{100 * r['em']:.1f}" for t in tasks for r in result["rows"]
                     if r["topk"] == topk and r["mode"] == m and r["kind"] == "task" and r["task"] == t]
            ppl = f"{sel['ppl']:.3f}" if sel else "-"
            rec = f"{sel['recall']:.3f}" if sel and "recall" in sel else "-"
            lines.append(f"| {topk} | {m} | {ppl} | {rec} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
