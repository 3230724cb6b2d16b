"""Test setup: strict shapes, and GPU tests skipped where there is no GPU."""

import jax
import pytest

# Implicit rank promotion hides shape bugs (nanodo does the same).
jax.config.update("jax_numpy_rank_promotion", "raise")


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
