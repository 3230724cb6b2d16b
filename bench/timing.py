"""Pieces shared by the benchmarks: a median timer, the device ceilings measured in the same run
(bf16 matmul rate, HBM bandwidth of a large copy), a wall-clock budget, evenly spread query
slices, accuracy checks and the JSON writer."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["time_fn", "measure", "ceilings", "Budget", "query_slice", "rel_check", "unavailable", "write_json",
           "judge_claims", "claim_lines", "pyplot_and_result", "save_png"]


def unavailable(e: BaseException) -> str:
    msg = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if "RESOURCE_EXHAUSTED" in str(e):  # what the allocator held, to tell a real need from fragmentation
        stats = jax.devices()[0].memory_stats() or {}
        gib = {k: round(stats[k] / 2**30, 2) for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use",
                                                      "largest_free_block_bytes", "bytes_reserved") if k in stats}
        msg += f" [device GiB: {gib}]"
    return msg


def time_fn(fn, repeats: int = 3, max_s: float = 3.0, warmup: bool = True) -> dict:
    """Median / min / max seconds of `fn()` (block_until_ready inside the timed region).

    The number of repeats shrinks so that one variant costs about `max_s` seconds: the H200 run
    is one bounded call, and a slow variant must not eat the others' time."""
    first = None
    if warmup:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        first = time.perf_counter() - t0
    ts = []
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
    n = max(1, min(repeats, int(max_s / max(ts[0], 1e-9))))
    for _ in range(n - 1):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    r = {"seconds": float(np.median(ts)), "seconds_min": float(min(ts)), "seconds_max": float(max(ts)),
         "repeats": len(ts)}
    if first is not None:
        r["first_call_seconds"] = first
    return r


def measure(fn, check, *, repeats: int, max_s: float) -> dict:
    """Run `fn` once (compile), check its output, then time it. Any exception (import, lowering,
    compile, run) becomes the variant's status instead of stopping the benchmark."""
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(fn())
        first = time.perf_counter() - t0
        chk = check(out)
        del out  # the timed calls must not share memory with a held output
        rec = {"check": chk, "first_call_seconds": first}
        rec.update(time_fn(fn, repeats, max_s, warmup=False))
        rec["status"] = "ok" if chk.get("passed") else "check_failed"
    except Exception as e:  # noqa: BLE001 - one missing kernel must not kill the run
        rec = {"status": unavailable(e)}
    return rec


def ceilings(*, matmul_n: int = 8192, copy_mib: int = 2048, repeats: int = 10, seed: int = 0) -> dict:
    """The device's measured bf16 matmul rate and copy bandwidth (read + write bytes), the floors'
    denominators. Random data: zeros can run faster than real numbers."""
    ka, kb, kx = jax.random.split(jax.random.key(seed), 3)
    a = jax.random.normal(ka, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(kb, (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(jnp.matmul)
    t_mm = time_fn(lambda: mm(a, b), repeats, max_s=5.0)
    del a, b
    n = copy_mib * 2**20 // 2
    x = jax.random.normal(kx, (n,), jnp.bfloat16)
    # negation, not a bare copy: XLA may not elide it, and it moves exactly one read and one write
    cp = jax.jit(jnp.negative)
    t_cp = time_fn(lambda: cp(x), repeats, max_s=5.0)
    del x
    flops = 2.0 * matmul_n**3
    nbytes = 2.0 * n * 2
    return {
        "matmul_shape": [matmul_n, matmul_n, matmul_n], "matmul_dtype": "bfloat16",
        "matmul_seconds": t_mm, "matmul_tflops": flops / t_mm["seconds"] / 1e12,
        "copy_bytes_read_plus_write": nbytes, "copy_seconds": t_cp,
        "hbm_gb_per_s": nbytes / t_cp["seconds"] / 1e9,
    }


class Budget:
    """Wall-clock guard: configurations started after `seconds` are skipped with a reason."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def exceeded(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds

    def reason(self) -> str:
        return f"skipped: budget of {self.seconds:.0f} s exceeded ({self.elapsed():.0f} s elapsed)"


def query_slice(t: int, n: int | None, piece: int = 512) -> np.ndarray:
    """Positions of a query subset: all t if n >= t, else runs of `piece` consecutive positions
    spread evenly from the start to the end of the sequence. Even spread keeps the mean visible
    context of the subset equal to the full sequence's, so scaling by t / len is fair for kernels
    that skip masked work; consecutive runs keep the kernels' query tiles intact."""
    if n is None or n >= t:
        return np.arange(t, dtype=np.int32)
    piece = max(1, min(piece, n))
    k = max(1, n // piece)
    if k == 1:
        starts = np.array([t - piece])
    else:
        starts = np.linspace(0, t - piece, k)
        starts = np.minimum((starts // 64) * 64, t - piece).astype(np.int64)
        starts[-1] = t - piece  # the last queries see the most context: always in
    pos = np.unique(np.concatenate([np.arange(s, s + piece) for s in starts]))
    return pos.astype(np.int32)


def rel_check(out, ref, bound: float) -> dict:
    """Relative Frobenius error of `out` against an f32 reference, with the bound it must meet."""
    o = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    r = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    rel = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    return {"rel_err": rel, "max_abs_err": float(np.max(np.abs(o - r))) if o.size else 0.0,
            "bound": bound, "passed": bool(math.isfinite(rel) and rel <= bound),
            "rows": int(np.prod(o.shape[:-2])) if o.ndim > 2 else 1}


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return _clean(float(x))
    if isinstance(x, np.bool_):
        return bool(x)
    return x


TARGET_BACKEND = "gpu"  # the claims' targets are set for an H200: timings elsewhere get no verdict


def judge_claims(result: dict) -> dict:
    """The result with each claim's "met" set to None where the run was not on the target
    backend (its "verdict" says why): a CPU timing neither meets nor misses an H200 target."""
    backend = result.get("environment", {}).get("backend")
    if backend in (None, TARGET_BACKEND):
        return result
    why = f"none: the targets are set for an H200 GPU, this ran on {backend}"
    return result | {"claims": [cl | {"met": None, "verdict": why} for cl in result.get("claims", [])]}


def write_json(result: dict, out: str | Path) -> Path:
    """The result (claims judged for the platform) as JSON at `out`; where that write fails, at a
    stamped file in the working directory (`runtime.write_result`). Returns the path written."""
    from sparda_jax.runtime import write_result

    return write_result(out, json.dumps(_clean(judge_claims(result)), indent=2))


def claim_lines(result: dict) -> list[str]:
    """One line per claimed ratio of a result (value, target, met, MISSED or no verdict off the
    GPU), then one per
    configuration the run skipped, with its reason."""
    def verdict(cl):
        return "no verdict off the GPU" if cl["met"] is None else "met" if cl["met"] else "MISSED"

    lines = [f"{cl['claim']}: {cl['value']:.2f} (target {cl['target']}, {verdict(cl)})"
             for cl in judge_claims(result)["claims"]]
    return lines + [f"skipped {s['phase']} T={s['T']} B={s['batch']}: {s['reason'][:80]}"
                    for s in result.get("skipped", [])]


def pyplot_and_result(json_path):
    """(matplotlib.pyplot with a file backend, the result JSON) for a plot made from the JSON;
    (None, None) when matplotlib is not installed (plots are optional, results are not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, None
    return plt, json.loads(Path(json_path).read_text())


def save_png(plt, fig, json_path) -> str:
    """Write the figure beside its JSON (same name, .png) and close it."""
    fig.tight_layout()
    out = str(Path(json_path).with_suffix(".png"))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_and_print(r: dict, out, plot, table) -> int:
    """A benchmark's `main` tail: the plot from the written JSON, then the table; a failing plot
    must not lose the measured JSON, so it only says why."""
    try:
        plot(out)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}", file=sys.stderr)
    print(table(r))
    return 0
