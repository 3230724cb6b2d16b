"""Test setup: strict shapes, and GPU tests skipped where there is no GPU."""

import jax
import pytest

# Implicit rank promotion hides shape bugs (nanodo does the same).
jax.config.update("jax_numpy_rank_promotion", "raise")

# Compiled programs persist across test processes and runs (the xdist workers share them);
# SPARDA_JAX_CACHE_DIR moves the cache, a fresh directory measures a cold run.
from sparda_jax.runtime import default_cache_dir, enable_compilation_cache  # noqa: E402

enable_compilation_cache(default_cache_dir() / "xla-tests", min_compile_s=0.1)


@pytest.fixture(autouse=True)
def _no_program_store_after_a_test():
    """`sparda_jax.cli.main` turns the program store on for its process; a test that called it
    leaves it off again, so the next test's programs are the jit's."""
    yield
    from sparda_jax import programs

    programs.disable_program_store()


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


# Linux allows 65530 memory maps per process (vm.max_map_count), and every XLA CPU executable
# keeps its JIT-compiled code mapped: the whole suite in one process reached 65268 and the next
# compile, in test_train, died with a segmentation fault (an mmap failing inside LLVM).
MAPS_HIGH = 40000


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, the compiled programs are released when the process holds more than
    MAPS_HIGH memory maps: clearing after every module kept them under 21100 (over the 70% of
    the suite it was left to run) but made the suite ~40% slower (every module recompiled what
    it shares)."""
    yield
    if _memory_maps() > MAPS_HIGH:
        jax.clear_caches()
