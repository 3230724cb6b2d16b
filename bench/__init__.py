"""Efficiency benchmarks; each writes its JSON (with provenance) under bench/results/<benchmark>/."""
