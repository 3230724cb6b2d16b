"""Accuracy evaluation: perplexity, selection quality, long-context tasks, every mode."""
