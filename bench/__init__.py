"""Efficiency benchmarks (BENCHMARKS.md); each writes bench/results/<name>.json."""
