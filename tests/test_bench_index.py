"""The generated results index (`bench/index.py`) against the committed folder: the page is
current, it lists every folder and file, and the numbers in its tables are the JSONs' own."""

import bisect
import json
import pathlib
import re

from sparda_jax.bench import index
from sparda_jax.bench.decode import PAPER_DECODE_128K

RESULTS = pathlib.Path(index.__file__).resolve().parent / "results"


def _rows(page: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in page.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


def test_committed_page_is_the_generated_one():
    # a hand edit, or a result added or removed without regenerating, makes this fail
    assert (RESULTS / "README.md").read_text() == index.render()
    assert index.main(["--check"]) == 0


def test_page_lists_every_folder_and_file_with_its_commit():
    page = index.render()
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders and all(f"### `{f}/`" in page for f in folders)
    assert all(f in index.FOLDERS for f in folders)                 # every folder described
    for p in RESULTS.rglob("*"):
        rel = str(p.relative_to(RESULTS))
        if p.is_file() and rel != "README.md" and not rel.endswith(".png"):
            assert f"`{rel}`" in page, rel
        if rel.endswith(".json"):
            assert rel in index.FILES, rel                          # every kept run says what it backs
            d = json.loads(p.read_text())
            commit = (d.get("environment", {}).get("commit") or d.get("trace_commit") or "")[:7]
            assert commit, rel                                      # provenance in every result
            assert re.search(rf"`{re.escape(rel)}` \| [^\n]*\| {commit} \|", page), rel
    assert len([p for p in RESULTS.iterdir() if p.is_file()]) <= 12   # loose files at the top


def test_table_numbers_come_from_the_jsons_and_the_paper():
    """Every decimal in a table cell equals a value found in a result JSON, a ratio of two such
    values, or a paper number (or a ratio of two), at the printed precision."""
    values, rates = set(), set()

    def walk(x, key=""):
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            values.add(float(x))
            if key in ("tokens_per_s", "paper"):
                rates.add(float(x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, key if key == "paper" else k)
        elif isinstance(x, list):
            for v in x:
                walk(v, key)

    for p in RESULTS.glob("*/*.json"):
        walk(json.loads(p.read_text()))
    walk(PAPER_DECODE_128K, "paper")
    walk(index.PAPER_PREFILL_128K, "paper")
    walk(index.PAPER_CTA_32K, "paper")
    walk(index.PAPER_SELECT_SPEEDUP_128K)
    base = sorted(v for v in values if v > 0)
    derived = {round(v, 4) for v in base}
    derived |= {v / 2**30 for v in base}
    derived |= {a / b for a in rates for b in rates if b > 0}        # the tables' ratios of tokens/s
    derived = sorted(derived)

    def known(text: str) -> bool:
        nd = len(text.split(".")[1])
        x, tol = float(text), 0.5 * 10 ** -nd + 1e-12
        i = bisect.bisect_left(derived, x - tol)
        return i < len(derived) and derived[i] <= x + tol

    checked = 0
    for row in _rows(index.render()):
        for cell in row:
            if re.fullmatch(r"\d+\.\d+", cell):
                assert known(cell), (cell, row)
                checked += 1
    assert checked > 100
