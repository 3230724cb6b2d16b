"""The Forecast's goals on held-out text, checked against `sparda eval` results.

  copy    copy NLL of SparDA within 15% of Sparse's (ratio <= 1.15), at every measured length
  recall  recall against the in-run InfLLM-V2 selection >= 0.92 at 4096 tokens, >= 0.88 at 8192
  ppl     late-half perplexity within 1% of Sparse's (ratio <= 1.01) at 4096 and 8192 tokens

The sparse-native model's goals (`native_goal_checks`: its InfLLM-V2 sparse mode against its own
dense mode):

  copy    copy NLL of Sparse within 1.2x of dense's (ratio <= 1.2), at every measured length
  ppl     late-half perplexity of Sparse within 1% of dense's (ratio <= 1.01)

Each check is made per split and, where there are several, over all splits pooled (copy NLL:
mean over all sequences; recall: all hits over all rows; perplexity: token-weighted mean NLL);
a pooled ratio pools only the splits that both modes were measured on.
Every row whose mode starts with "sparda" (trained or untrained) is checked. A length the block
budget covers whole (top-k x block size >= length: every mode reads every block) gets no verdict:
its check has passed None and prints as n/a, since agreement there says nothing of the selection.
"""

from __future__ import annotations

import math

__all__ = ["COPY_NLL_RATIO", "RECALL_MIN", "PPL_RATIO", "NATIVE_COPY_NLL_RATIO", "goal_checks", "native_goal_checks",
           "goals_text", "goals_markdown"]

COPY_NLL_RATIO = 1.15
RECALL_MIN = {4096: 0.92, 8192: 0.88}
PPL_RATIO = 1.01
NATIVE_COPY_NLL_RATIO = 1.2
ALL = "all splits"


def _split(r: dict) -> str:
    return r.get("split", "python-docs")


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows per split, and all of them under ALL when there are several splits."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(_split(r), []).append(r)
    if len(out) > 1:
        out[ALL] = list(rows)
    return out


def _pool_copy(rs: list[dict]) -> float:
    vals = [x for r in rs for x in (r.get("copy_nll_per_sample") or [r["copy_nll"]] * r.get("samples", 1))]
    return sum(vals) / len(vals)


def _pool_recall(rs: list[dict]) -> float:
    if all("recall_total" in r for r in rs):
        return sum(r["recall_hits"] for r in rs) / max(sum(r["recall_total"] for r in rs), 1)
    return sum(r["recall"] for r in rs) / len(rs)


def _pool_ppl_late(rs: list[dict]) -> float:
    w = [r.get("tokens_late", 1) for r in rs]
    return math.exp(sum(wi * math.log(r["ppl_late"]) for wi, r in zip(w, rs)) / sum(w))


def _common(mine: list[dict], ref: list[dict]) -> tuple[list[dict], list[dict]]:
    """Both row lists cut to the splits both hold: a pooled ratio compares like with like."""
    both = {_split(r) for r in mine} & {_split(r) for r in ref}
    return [r for r in mine if _split(r) in both], [r for r in ref if _split(r) in both]


def goal_checks(selection: dict | None = None, copy: dict | None = None, *, reference: str = "sparse") -> list[dict]:
    """The Forecast's checks that the given results' rows allow (every mode starting with
    "sparda" against `reference`), each a dict: goal, split, length, mode, value, reference (the
    reference mode's value, or None), target (text), passed."""
    return _checks(selection, copy, reference=reference, picked=lambda m: m.startswith("sparda"),
                   copy_ratio=COPY_NLL_RATIO, recall=True)


def native_goal_checks(selection: dict | None = None, copy: dict | None = None) -> list[dict]:
    """The sparse-native model's checks: its "sparse" rows against its own "dense" rows (copy NLL
    <= 1.2x, late-half perplexity <= 1.01x), as `goal_checks` makes them."""
    return _checks(selection, copy, reference="dense", picked=lambda m: m == "sparse",
                   copy_ratio=NATIVE_COPY_NLL_RATIO, recall=False)


def _covered(result: dict, length: int) -> bool:
    """Whether the result's block budget selects every block of a `length`-token sequence."""
    b = result.get("budget") or {}
    return "topk" in b and "block_size" in b and b["topk"] * b["block_size"] >= length


def _verdict(result: dict, length: int, passed: bool) -> bool | None:
    return None if _covered(result, length) else bool(passed)


def _checks(selection, copy, *, reference: str, picked, copy_ratio: float, recall: bool) -> list[dict]:
    checks = []
    if copy is not None:
        rows = [r for r in copy["rows"] if r.get("suite") == "copy"]
        for split, rs in _groups(rows).items():
            for length in sorted({r["length"] for r in rs}):
                at = [r for r in rs if r["length"] == length]
                ref = [r for r in at if r["mode"] == reference]
                for mode in dict.fromkeys(r["mode"] for r in at if picked(r["mode"])):
                    mine, ref_ = _common([r for r in at if r["mode"] == mode], ref)
                    if not ref_:
                        continue
                    v, b = _pool_copy(mine), _pool_copy(ref_)
                    checks.append({"goal": "copy NLL", "split": split, "length": length, "mode": mode, "value": v,
                                   "reference": b, "target": f"<= {copy_ratio:.2f} x {reference}",
                                   "passed": _verdict(copy, length, v <= copy_ratio * b)})
    if selection is not None:
        rows = [r for r in selection["rows"] if "task" not in r and r.get("suite", "selection") == "selection"]
        for split, rs in _groups(rows).items():
            for length in sorted({r["length"] for r in rs} & set(RECALL_MIN)):
                at = [r for r in rs if r["length"] == length]
                ref = [r for r in at if r["mode"] == reference]
                for mode in dict.fromkeys(r["mode"] for r in at if picked(r["mode"])):
                    mine = [r for r in at if r["mode"] == mode]
                    if recall and all("recall" in r for r in mine):
                        v = _pool_recall(mine)
                        checks.append({"goal": "recall", "split": split, "length": length, "mode": mode, "value": v,
                                       "reference": None, "target": f">= {RECALL_MIN[length]:.2f}",
                                       "passed": _verdict(selection, length, v >= RECALL_MIN[length])})
                    mine_, ref_ = _common(mine, ref)
                    if ref_:
                        v, b = _pool_ppl_late(mine_), _pool_ppl_late(ref_)
                        checks.append({"goal": "late-half ppl", "split": split, "length": length, "mode": mode,
                                       "value": v, "reference": b, "target": f"<= {PPL_RATIO:.2f} x {reference}",
                                       "passed": _verdict(selection, length, v <= PPL_RATIO * b)})
    return checks


def goals_text(checks: list[dict], reference: str = "sparse", title: str = "Goals of the Forecast on held-out text"
               ) -> str:
    """The checks as Markdown lines (PASS / FAIL with the numbers) under `title`; a line saying
    none could be made when there are none."""
    if not checks:
        return (f"Goals: none checkable here (they need sparda and {reference} rows: copy suite, or selection "
                f"suite at 4096 / 8192 tokens).\n")
    out = [f"{title}:", ""]
    for c in checks:
        ref = "" if c["reference"] is None else f" vs {reference} {c['reference']:.3f} (ratio {c['value'] / c['reference']:.3f})"
        verdict = "n/a" if c["passed"] is None else "PASS" if c["passed"] else "FAIL"
        out.append(f"- {verdict} {c['goal']} {c['target']}: {c['mode']} {c['value']:.3f}{ref}; {c['split']}, "
                   f"{c['length']} tokens" + (" (the block budget covers every block: no verdict)"
                                              if c["passed"] is None else ""))
    return "\n".join(out) + "\n"


NATIVE_TITLE = "Sparse against the model's own dense mode (the goals of a sparse-native model)"


def goals_markdown(selection: dict | None = None, copy: dict | None = None) -> str:
    """Both sets of checks as `goals_text` writes them: the Forecast's (or the line saying none
    could be made), then the sparse-native model's where dense and sparse rows allow them."""
    checks, native = goal_checks(selection, copy), native_goal_checks(selection, copy)
    parts = [goals_text(checks)] if checks or not native else []
    if native:
        parts.append(goals_text(native, "dense", NATIVE_TITLE))
    return "\n".join(parts)
