"""Efficiency benchmarks; each writes its JSON (with provenance) under bench/results/<benchmark>/."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def default_out(relative: str) -> str:
    """A benchmark's default result path: under the repository's results folder wherever the
    command runs from (a path relative to the working directory would scatter results)."""
    return str(RESULTS / relative)
