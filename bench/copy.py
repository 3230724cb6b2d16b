"""`sparda bench copy`: moving 64-token KV blocks from pinned host memory to the GPU.

For per-layer sizes (1..32 MiB of randomly chosen 16 KB blocks out of a large pool):
  uva      the CUDA gather of kernels/copy (reads the host pool over UVA), per CTA count
  bulk     one device_put of a contiguous host array of the same bytes (the ceiling)
  xla_loop a fori_loop of dynamic_slice + device_put per block inside jit
  host     gather on the host (compute_on 'device_host'), then copy (InfiniGen's path)
Each variant is checked against NumPy before it is timed; a variant that fails records its
error instead of a number. Ratios (gather / bulk) are measured in the same run.

    sparda bench copy --out bench/results/copy.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from sparda_jax.envinfo import environment
from sparda_jax.kernels.copy_engine import gather_blocks

__all__ = ["bench_copy"]

BLOCK = (64, 128)  # tokens x head dim: one KV head's block, 16 KB in bf16


def _time(fn, repeats: int) -> tuple[float, float, float]:
    jax.block_until_ready(fn())  # warm-up (compile) outside the timing
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(min(ts)), float(max(ts))


def bench_copy(*, pool_mib: int = 2048, sizes_mib=(1, 2, 4, 8, 16, 32), ctas=(1, 2, 4, 8, 16, 32, 64, 132),
               repeats: int = 20, seed: int = 0, variants=("uva", "bulk", "xla_loop", "host")) -> dict:
    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    block_bytes = int(np.prod(BLOCK)) * 2
    n_pool = pool_mib * 2**20 // block_bytes
    rng = np.random.default_rng(seed)
    pool_np = rng.standard_normal((n_pool, *BLOCK), dtype=np.float32).astype(jnp.bfloat16)
    pool = jax.device_put(pool_np, host)
    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // block_bytes
        src_np = rng.choice(n_pool, n, replace=False).astype(np.int32)
        src, dst = jnp.asarray(src_np), jnp.arange(n, dtype=jnp.int32)
        cache = jax.device_put(jnp.zeros((n, *BLOCK), jnp.bfloat16), dev)
        expected = pool_np[src_np]
        nbytes = n * block_bytes

        def record(name, fn, **extra):
            row = {"size_mib": mib, "blocks": n, "variant": name, **extra}
            try:
                out = np.asarray(jax.block_until_ready(fn()))
                if not np.array_equal(out.astype(np.float32), expected.astype(np.float32)):
                    raise AssertionError("wrong data")
                med, lo, hi = _time(fn, repeats)
                row.update(seconds=med, seconds_min=lo, seconds_max=hi, gb_per_s=nbytes / med / 1e9)
            except Exception as e:  # a variant that cannot run here says why, the rest go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)

        if "bulk" in variants:
            contiguous = jax.device_put(expected, host)
            to_device = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))
            record("bulk", lambda: to_device(contiguous))
        if "uva" in variants:
            for c in ctas:
                f = jax.jit(lambda p, s, d, k, c=c: gather_blocks(p, s, d, k, num_ctas=c, implementation="cuda"))
                record("uva", lambda f=f: f(pool, src, dst, cache), ctas=c)
        if "xla_loop" in variants:
            @jax.jit
            def loop(p, s):
                def body(i, acc):
                    blk = jax.lax.dynamic_slice_in_dim(p, s[i], 1, axis=0)
                    return acc.at[i].set(jax.device_put(blk, jax.memory.Space.Device)[0])
                return jax.lax.fori_loop(0, s.shape[0], body, jnp.zeros((s.shape[0], *BLOCK), p.dtype))
            record("xla_loop", lambda: loop(pool, src))
        if "host" in variants:
            from jax.experimental.compute_on import compute_on

            take_on_host = compute_on(lambda p, s: p[s], compute_type="device_host",
                                      out_memory_spaces=jax.memory.Space.Host)

            @jax.jit
            def host_gather(p, s):
                g = take_on_host(p, jax.device_put(s, jax.memory.Space.Host))
                return jax.device_put(g, jax.memory.Space.Device)
            record("host", lambda: host_gather(pool, src))
    bulk = {r["size_mib"]: r.get("gb_per_s") for r in rows if r["variant"] == "bulk"}
    for r in rows:
        if r.get("gb_per_s") and bulk.get(r["size_mib"]):
            r["vs_bulk"] = r["gb_per_s"] / bulk[r["size_mib"]]
    return {"name": "copy", "block_bytes": block_bytes, "pool_mib": pool_mib, "repeats": repeats, "rows": rows,
            "environment": environment()}


def table(result: dict) -> str:
    lines = ["| MiB | variant | CTAs | GB/s | vs bulk |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        gbs = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else f"error: {r.get('error', '')[:60]}"
        vs = f"{r['vs_bulk']:.2f}" if "vs_bulk" in r else "-"
        lines.append(f"| {r['size_mib']} | {r['variant']} | {r.get('ctas', '-')} | {gbs} | {vs} |")
    return "\n".join(lines)


def main(args) -> int:
    r = bench_copy(pool_mib=args.pool_mib, sizes_mib=tuple(args.sizes), repeats=args.repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=2))
    print(table(r))
    return 0
