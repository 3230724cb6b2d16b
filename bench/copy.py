"""`sparda bench copy`: moving 64-token KV blocks from pinned host memory to the GPU.

For per-layer sizes (1..32 MiB of randomly chosen 16 KB blocks out of a large pool):
  uva      the "cuda" gather of kernels/kv_copy (reads the host pool over UVA), per CTA count
  bulk     one device_put of a contiguous host array of the same bytes (the ceiling)
  xla_loop a fori_loop of dynamic_slice + device_put per block inside jit
  host     gather on the host (compute_on 'device_host'), then copy (InfiniGen's path)
Each variant is checked against NumPy before it is timed; a variant that fails records its
error instead of a number. Ratios (gather / bulk) are measured in the same run.

Overlap (`bench_overlap`): a chain of matmuls alone, the gather alone, both in one jit one after
the other, and both with the gather started before the chain and waited for after it
(`gather_blocks_start` / `gather_blocks_wait`, a high-priority side stream), per CTA count;
the claim is overlapped <= 1.1 x max(compute alone, copy alone). Write-back (`scatter`): a few
blocks written into a large host pool in place, timed against the pool size (it must not move
the pool).

    sparda bench copy --out bench/results/copy/copy.json
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.envinfo import environment
from sparda_jax.kernels.kv_copy import (KVCopyConfig, after_start, gather_blocks, gather_blocks_start,
                                        gather_blocks_wait, host_pool, join_tokens, lane_ctas, scatter_blocks,
                                        scatter_blocks_reference)

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
    block_bytes = int(np.prod(BLOCK)) * 2
    n_pool = pool_mib * 2**20 // block_bytes
    rng = np.random.default_rng(seed)
    pool_np = rng.standard_normal((n_pool, *BLOCK), dtype=np.float32).astype(jnp.bfloat16)
    pool = host_pool(pool_np)
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
            contiguous = host_pool(expected)
            to_device = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))
            record("bulk", lambda: to_device(contiguous))
        if "uva" in variants:
            for c in ctas:
                f = jax.jit(lambda p, s, d, k, c=c: gather_blocks(p, s, d, k, config=KVCopyConfig(num_ctas=c),
                                                                 implementation="cuda"))
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


def bench_overlap(*, copy_mib: int = 32, pool_mib: int = 1024, ctas=(8, 16, 32), repeats: int = 20,
                  seed: int = 0) -> dict:
    """Does the copy hide behind compute? Two kinds of work, each sized near the copy's time:
    "matmul" (bf16 4096^3, tensor-core bound) and "stream" (a skinny [16, 8192] x [8192, 8192]
    chain, weight-read bound like a decode layer)."""
    dev = jax.devices()[0]
    block_bytes = int(np.prod(BLOCK)) * 2
    n_pool, n = pool_mib * 2**20 // block_bytes, copy_mib * 2**20 // block_bytes
    rng = np.random.default_rng(seed)
    pool_np = rng.standard_normal((n_pool, *BLOCK), dtype=np.float32).astype(jnp.bfloat16)
    pool = host_pool(pool_np)
    src = jnp.asarray(rng.choice(n_pool, n, replace=False).astype(np.int32))
    dst = jnp.arange(n, dtype=jnp.int32)
    cache = jax.device_put(jnp.zeros((n, *BLOCK), jnp.bfloat16), dev)
    expected = pool_np[np.asarray(src)].astype(np.float32)
    ks = jax.random.split(jax.random.key(seed), 4)
    works = {
        "matmul": (jax.random.normal(ks[0], (4096, 4096), jnp.bfloat16), jax.random.normal(ks[1], (4096, 4096), jnp.bfloat16)),
        "stream": (jax.random.normal(ks[2], (8192, 8192), jnp.bfloat16) * 0.01, jax.random.normal(ks[3], (16, 8192), jnp.bfloat16)),
    }
    rows = []

    chain = _chain_jit.__wrapped__  # traced inline into the jits below

    def timed(fn):
        return _time(fn, repeats)[0]

    for kind, (w, x) in works.items():
        # size the chain so that compute alone takes about as long as the copy alone
        copy_alone = timed(lambda: _copy(pool, src, dst, cache, 32))
        one = timed(lambda: _chain_jit(w, x, 1))
        steps = max(1, int(round(copy_alone / max(one, 1e-9))))
        compute_alone = timed(lambda: _chain_jit(w, x, steps))
        for c in ctas:
            row = {"work": kind, "chain_steps": steps, "ctas": c, "copy_mib": copy_mib}
            try:
                row["compute_s"] = compute_alone
                row["copy_s"] = timed(lambda: _copy(pool, src, dst, cache, c))

                cfg = KVCopyConfig(num_ctas=c)

                @jax.jit
                def serial(p, s, d, k, w, x):
                    k = gather_blocks(p, s, d, k, config=cfg, implementation="cuda")
                    k, x = jax.lax.optimization_barrier((k, x))  # copy first, then the chain
                    return k, chain(w, x, steps)

                @jax.jit
                def overlapped(p, s, d, k, w, x):
                    k = gather_blocks_start(p, s, d, k, config=cfg, implementation="cuda")
                    x, token = after_start(k, x)  # the start is issued before the chain
                    y = chain(w, x, steps)
                    return gather_blocks_wait(k, s, d, join_tokens(token, y[:1, :1]), implementation="cuda"), y

                for name, fn in (("serial", serial), ("overlapped", overlapped)):
                    got = np.asarray(fn(pool, src, dst, cache, w, x)[0]).astype(np.float32)
                    if not np.array_equal(got, expected):
                        raise AssertionError(f"{name}: wrong data")
                    row[f"{name}_s"] = timed(lambda fn=fn: fn(pool, src, dst, cache, w, x))
                row["overlapped_vs_max"] = row["overlapped_s"] / max(row["compute_s"], row["copy_s"])
                row["serial_vs_sum"] = row["serial_s"] / (row["compute_s"] + row["copy_s"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
    return {"rows": rows}


def bench_pipeline(*, layers: int = 4, blocks=(240, 1920), ctas=(2, 4, 8, 16), threads=(256, 1024),
                   dependent: bool = True, compute_ms: float = 0.7, pool_mib: int = 512, dims=(4096, 14336),
                   repeats: int = 10, seed: int = 0, implementation: str = "cuda", log=None) -> dict:
    """The engine's prefetch pattern without the engine: does it hide the copy, and what does
    the copy cost the compute beside it? `layers` + 1 layers (layer 0 resident, no copy); layer
    l first starts layer l+1's copy (K and V, one `gather_blocks_start` each on lanes 0 and 1,
    the CTA quota split by `lane_ctas`), then waits for its own, then runs a decode layer's
    weight-read-bound work (skinny [16, 4096] x [4096, 14336] x [14336, 4096] matmuls, repeated
    to ~compute_ms) that reads its cache (as attention does). `blocks`: K/V block pairs per layer
    (240: SmolLM2's miss rate at batch 16 and 128K, 1920: random traffic). Timed per (blocks,
    CTAs, threads per CTA): compute alone, copies alone (start + wait per layer), serial (a
    synchronous gather then the work, per layer) and pipelined. dependent: each start's task
    list depends on the layer's input, as in the engine, so XLA cannot issue it early. Every
    copy is checked against NumPy. implementation "host_ffi" (the CPU twin) runs it on the CPU,
    as a test."""
    log = log or (lambda m: print(m, flush=True))
    n_pool = pool_mib * 2**20 // (int(np.prod(BLOCK)) * 2)
    rng = np.random.default_rng(seed)
    pools = tuple(host_pool(rng.standard_normal((n_pool, *BLOCK), dtype=np.float32).astype(jnp.bfloat16))
                  for _ in range(2))
    ks = jax.random.split(jax.random.key(seed), 3)
    w1 = jax.random.normal(ks[0], dims, jnp.bfloat16) * 0.01
    w2 = jax.random.normal(ks[1], dims[::-1], jnp.bfloat16) * 0.01
    x0 = jax.random.normal(ks[2], (16, dims[0]), jnp.bfloat16)

    def work(x, w, reps):
        for _ in range(reps):
            x = jnp.tanh(jnp.tanh(x @ w[0]) @ w[1])
        return x

    def touch(x, kv):  # the layer's compute reads its cache, as attention does
        return x + 1e-3 * (kv[0][0, 0, 0] + kv[1][0, 0, 0])

    one = jax.jit(lambda x, w: work(x, w, 1))
    t1 = _time(lambda: one(x0, (w1, w2)), repeats)[0]
    reps = max(1, int(round(compute_ms * 1e-3 / t1)))
    rows = []
    for n in blocks:
        srcs = jnp.asarray(np.stack([rng.choice(n_pool, n, replace=False) for _ in range(layers)]).astype(np.int32))
        dst = jnp.arange(n, dtype=jnp.int32)
        expected = [[np.asarray(p)[np.asarray(srcs[l])].astype(np.float32) for p in pools] for l in range(layers)]

        def fresh():
            return tuple((jnp.zeros((n, *BLOCK), jnp.bfloat16), jnp.zeros((n, *BLOCK), jnp.bfloat16))
                         for _ in range(layers))

        def make(kind, c, th):
            split = [KVCopyConfig(num_ctas=k, threads=th)
                     for k in lane_ctas(c, [jnp.zeros((1, *BLOCK), jnp.bfloat16)] * 2)]

            def fn(caches, x, pools, srcs, dst, w):
                def tasks(l, x):
                    # dependent: the start needs this layer's input, as the engine's Forecast selection
                    # does (x never exceeds 1e30: the sources are unchanged), so XLA cannot issue it early
                    return srcs[l] + (x[0, 0] > 1e30).astype(jnp.int32) if dependent else srcs[l]

                live = {}  # each start's task list, kept alive by its wait (the side stream reads it)

                def start(l, kv, x):
                    sl = live[l] = tasks(l, x)
                    return tuple(gather_blocks_start(pools[j], sl, dst, kv[j], lane=j, config=split[j],
                                                     implementation=implementation) for j in range(2))

                def wait(l, kv, after):
                    return tuple(gather_blocks_wait(kv[j], live[l], dst, after, implementation=implementation)
                                 for j in range(2))

                # work layer 0 is resident (no copy), as the engine's layer 0; copy l feeds work layer l + 1
                caches = list(caches)
                if kind == "compute":
                    x = work(x, w, reps)
                    for l in range(layers):
                        x = work(touch(x, caches[l]), w, reps)
                elif kind == "copy":
                    for l in range(layers):
                        kv = start(l, caches[l], x)
                        caches[l] = wait(l, kv, after_start(kv, x)[1])
                elif kind == "serial":
                    x = work(x, w, reps)
                    for l in range(layers):
                        caches[l] = gather_blocks(pools, tasks(l, x), dst, caches[l],
                                                  config=KVCopyConfig(num_ctas=c, threads=th),
                                                  implementation=implementation)
                        x = work(touch(x, caches[l]), w, reps)
                else:  # pipelined: copy l runs beside work layer l (the engine's layer l+1 copy during layer l)
                    # each wait follows its own start's barrier and the next start's (their tokens), as
                    # in the engine: a barrier whose outputs nothing uses is dropped, and its order with it
                    tokens = {}
                    caches[0] = start(0, caches[0], x)
                    x, tokens[0] = after_start(caches[0], x)
                    x = work(x, w, reps)
                    for l in range(layers):
                        after = [tokens[l]]
                        if l + 1 < layers:
                            caches[l + 1] = start(l + 1, caches[l + 1], x)
                            x, tokens[l + 1] = after_start(caches[l + 1], x)
                            after.append(tokens[l + 1])
                        caches[l] = wait(l, caches[l], join_tokens(*after, x.reshape(-1)[:1]))
                        x = work(touch(x, caches[l]), w, reps)
                return tuple(caches), x
            return jax.jit(fn, donate_argnums=0)

        def timed(fn, check=True):
            state = {"c": fresh()}

            def call():
                state["c"], x = fn(state["c"], x0, pools, srcs, dst, (w1, w2))
                return x
            t = _time(call, repeats)[0]
            for l in range(layers if check else 0):
                for j in range(2):
                    if not np.array_equal(np.asarray(state["c"][l][j]).astype(np.float32), expected[l][j]):
                        raise AssertionError(f"layer {l} payload {j}: wrong data")
            return t

        compute = timed(make("compute", 1, 256), check=False)
        for c in ctas:
            for th in threads:
                row = {"blocks_per_layer": n, "mib_per_layer": n * 2 * int(np.prod(BLOCK)) * 2 / 2**20,
                       "layers": layers, "dependent": dependent, "ctas": c, "threads": th, "compute_s": compute,
                       "work_reps": reps}
                try:
                    for kind in ("copy", "serial", "pipelined"):
                        row[f"{kind}_s"] = timed(make(kind, c, th))
                    row["copy_gb_per_s"] = layers * n * 2 * int(np.prod(BLOCK)) * 2 / row["copy_s"] / 1e9
                    row["pipelined_vs_max"] = row["pipelined_s"] / max(compute, row["copy_s"])
                    row["pipelined_vs_serial"] = row["pipelined_s"] / row["serial_s"]
                except Exception as e:  # noqa: BLE001 - record, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                log(f"[pipeline] {n} blocks, {c} CTAs x {th} threads: " +
                    (f"compute {compute * 1e3:.2f} copy {row['copy_s'] * 1e3:.2f} serial {row['serial_s'] * 1e3:.2f} "
                     f"pipelined {row['pipelined_s'] * 1e3:.2f} ms, / max {row['pipelined_vs_max']:.2f}"
                     if "error" not in row else row["error"]))
    return {"rows": rows, "note": "times of all layers, one call (layers + 1 work layers, layers copies); compute: "
                                  "the work alone (the same cache reads)"}


def pipeline_table(result: dict) -> str:
    lines = ["| blocks/layer | CTAs | threads | compute ms | copy ms (GB/s) | serial ms | pipelined ms | "
             "pipelined / max | pipelined / serial |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        head = f"| {r['blocks_per_layer']} | {r['ctas']} | {r['threads']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} |")
            continue
        lines.append(f"{head} {r['compute_s'] * 1e3:.2f} | {r['copy_s'] * 1e3:.2f} ({r['copy_gb_per_s']:.0f}) | "
                     f"{r['serial_s'] * 1e3:.2f} | {r['pipelined_s'] * 1e3:.2f} | {r['pipelined_vs_max']:.2f} | "
                     f"{r['pipelined_vs_serial']:.2f} |")
    return "\n".join(lines)


@functools.partial(jax.jit, static_argnums=2)
def _chain_jit(w, x, steps):
    for _ in range(steps):
        x = jnp.tanh(x @ w)
    return x


@functools.partial(jax.jit, static_argnums=4)
def _copy(pool, src, dst, cache, ctas):
    return gather_blocks(pool, src, dst, cache, config=KVCopyConfig(num_ctas=ctas), implementation="cuda")


def bench_scatter(*, pools_mib=(256, 4096), blocks: int = 64, repeats: int = 20, seed: int = 0) -> dict:
    """Write-back of `blocks` blocks into host pools of growing size: the time must not grow
    with the pool (only the written blocks cross PCIe)."""
    block_bytes = int(np.prod(BLOCK)) * 2
    rng = np.random.default_rng(seed)
    cache = jax.random.normal(jax.random.key(seed), (blocks, *BLOCK), jnp.bfloat16)
    rows = []
    for mib in pools_mib:
        row = {"pool_mib": mib, "blocks": blocks}
        try:
            n_pool = mib * 2**20 // block_bytes
            pool_np = rng.standard_normal((n_pool, *BLOCK), dtype=np.float32).astype(jnp.bfloat16)
            slots = jnp.arange(blocks, dtype=jnp.int32)
            dst = jnp.asarray(rng.choice(n_pool, blocks, replace=False).astype(np.int32))
            want = np.asarray(scatter_blocks_reference(cache, slots, dst, jnp.asarray(pool_np))).astype(np.float32)
            for impl in ("cuda", "xla"):
                f = jax.jit(lambda c, s, d, p, impl=impl: scatter_blocks(c, s, d, p, implementation=impl), donate_argnums=3)
                check = f(cache, slots, dst, host_pool(pool_np))
                if not np.array_equal(np.asarray(check).astype(np.float32), want):
                    raise AssertionError(f"{impl}: wrong data")
                row[f"{impl}_on_host"] = check.sharding.memory_kind == "pinned_host"
                del check  # np.asarray keeps a view of it: the timed chain below needs a pool nobody else holds
                pool = f(cache, slots, dst, host_pool(pool_np))
                ts = []
                for _ in range(repeats):  # the pool is donated: each call returns the next input
                    t0 = time.perf_counter()
                    pool = jax.block_until_ready(f(cache, slots, dst, pool))
                    ts.append(time.perf_counter() - t0)
                row[f"{impl}_s"] = float(np.median(ts))
                del pool
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return {"rows": rows}


def table(result: dict) -> str:
    lines = ["| MiB | variant | CTAs | GB/s | vs bulk |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        gbs = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else f"error: {r.get('error', '')[:60]}"
        vs = f"{r['vs_bulk']:.2f}" if "vs_bulk" in r else "-"
        lines.append(f"| {r['size_mib']} | {r['variant']} | {r.get('ctas', '-')} | {gbs} | {vs} |")
    return "\n".join(lines)


def overlap_table(result: dict) -> str:
    lines = ["| work | CTAs | compute ms | copy ms | serial ms | overlapped ms | overlapped / max |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['work']} | {r['ctas']} | error: {r['error'][:80]} |")
            continue
        lines.append(f"| {r['work']} | {r['ctas']} | {r['compute_s'] * 1e3:.3f} | {r['copy_s'] * 1e3:.3f} | "
                     f"{r['serial_s'] * 1e3:.3f} | {r['overlapped_s'] * 1e3:.3f} | {r['overlapped_vs_max']:.2f} |")
    return "\n".join(lines)


def main(args) -> int:
    if args.pipeline_only:
        r = {"name": "copy_pipeline", "environment": environment(), "pipeline": bench_pipeline(repeats=args.repeats)}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(r, indent=2))
        print(pipeline_table(r["pipeline"]))
        return 0
    r = bench_copy(pool_mib=args.pool_mib, sizes_mib=tuple(args.sizes), repeats=args.repeats)
    r["overlap"] = bench_overlap(repeats=args.repeats)
    r["scatter"] = bench_scatter(repeats=min(args.repeats, 10))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=2))
    print(table(r))
    print(overlap_table(r["overlap"]))
    print("scatter:", json.dumps(r["scatter"]["rows"]))
    return 0
