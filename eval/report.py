"""Merge result JSONs of `sparda eval` into one Markdown table (numbers never typed by hand).

    python -m sparda_jax.eval.report OUT.md FILE[=LABEL] ...

LABEL replaces the mode names of a file's rows (for a file of one mode, e.g. an ablation); "{mode}" in
it stands for each row's own mode (e.g. "base model, {mode}" beside another model's rows).
Rows of `--suite tasks` files are rendered by `eval.accuracy.tasks_markdown`, paired differences
included: rows of different files (of one model) pair where they share (task, length, seed),
which fixes the prompts. Rows of `--suite selection` files form a table per held-out split,
rows of `--suite copy` files go to `eval.copy.copy_markdown`; where sparda and sparse rows of
those suites are present, the goals of `eval.goals` follow with pass / fail.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from .heldout import DEFAULT_SPLIT

__all__ = ["merge", "main"]


def _key(r: dict) -> tuple:
    # not the seed: rows written before it was recorded have none, and one cell is one cell
    return (r.get("suite"), r.get("task"), r.get("split"), r["length"], r["mode"])


def merge(specs: list[str]) -> tuple[list[dict], list[dict]]:
    """A cell (suite, task, split, length, mode) measured in several files (a run cut by its time limit, then
    completed by a second one) is taken from the last file that has it."""
    rows, sources = {}, []
    for spec in specs:
        path, _, label = spec.partition("=")
        d = json.loads(Path(path).read_text())
        for r in d["rows"]:
            r = dict(r, mode=label.replace("{mode}", r["mode"]) if label else r["mode"])
            if "task" not in r:  # selection rows written before splits were recorded: the Python docs
                r.setdefault("split", DEFAULT_SPLIT)
            rows.pop(_key(r), None)  # re-inserted last: the order is the last run's
            rows[_key(r)] = r
        sources.append({"file": path, "command": d.get("command"), "commit": d["environment"].get("commit"),
                        "device": d["environment"].get("device"), "budget": d.get("budget"),
                        "complete": d.get("complete")})
    return list(rows.values()), sources


def table(rows: list[dict]) -> str:
    """Selection rows: one table per held-out split (one table for rows without splits)."""
    from .selection import markdown_table

    return markdown_table({"rows": rows})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, specs = Path(argv[0]), argv[1:]
    rows, sources = merge(specs)
    text = []
    sel = [r for r in rows if "task" not in r and r.get("suite", "selection") == "selection"]
    if sel:
        text += [table(sel), ""]
    copy = [r for r in rows if r.get("suite") == "copy"]
    if copy:
        from .copy import copy_markdown

        text += [copy_markdown({"rows": copy}), ""]
    if sel or copy:
        from .goals import goal_checks, goals_markdown, native_goal_checks

        results = ({"rows": sel} if sel else None, {"rows": copy} if copy else None)
        if goal_checks(*results) or native_goal_checks(*results):
            text += [goals_markdown(*results), ""]
    tasks = [r for r in rows if "task" in r]
    if tasks:
        # imported here: it pulls in JAX, which the selection tables do not need
        from .accuracy import tasks_markdown

        text += [tasks_markdown({"rows": tasks}), ""]
        if len({r["length"] for r in tasks}) > 1:  # accuracy vs length, beside the table
            from .accuracy import plot_tasks

            plot_tasks({"rows": tasks}, out.with_suffix(".png"))
            text += [f"Plot: `{out.with_suffix('.png').name}`", ""]
    text += ["Sources (each made by the command shown, on the device shown):", ""]
    for s in sources:
        cut = "" if s["complete"] in (True, None) else " (cut by its time limit; its finished cells are used)"
        text.append(f"- `{s['file']}`: `{s['command']}` at commit {str(s['commit'])[:12]} on {s['device']}{cut}")
    text.append("")
    text.append(f"Made by: `python -m sparda_jax.eval.report {shlex.join(argv)}`")
    out.write_text("\n".join(text) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
