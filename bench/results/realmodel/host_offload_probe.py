"""Can a prefill's per-layer KV reach host memory while later layers compute? A scan of L
layer-sized matmuls whose per-layer output (a KV-sized bf16 array) is placed in pinned_host memory
inside the scan, timed against the scan alone and against the scan followed by one device_put of
the stacked outputs (what the engine's prefill does today). Run on a GPU from the repository root:

    python bench/results/realmodel/host_offload_probe.py OUT.json
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from sparda_jax.envinfo import environment

L, T, D, KV = 30, 4096, 2048, 2 * 3 * 64  # KV: K and V of 3 heads of 64, per token (SmolLM2)


def timed(f, *a, n=20):
    jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def main(out):
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    host = SingleDeviceSharding(dev, memory_kind="pinned_host" if "pinned_host" in kinds else None)
    x = jax.random.normal(jax.random.key(0), (T, D), jnp.bfloat16)
    ws = jax.random.normal(jax.random.key(1), (L, D, D), jnp.bfloat16) / D ** 0.5

    def layer(x, w):
        y = jnp.tanh(x @ w)
        return y, y[:, :KV]  # the layer's "KV": T x 384 bf16, 1.5 MB

    compute = jax.jit(lambda x, ws: jax.lax.scan(layer, x, ws))
    after = lambda x, ws: jax.device_put(compute(x, ws)[1], host)  # the engine today: move after the scan

    def inside_body(x, w):
        y, kv = layer(x, w)
        return y, jax.device_put(kv, host)

    rows = {"scan alone": timed(compute, x, ws), "scan, then one move to the host": timed(after, x, ws)}
    try:
        inside = jax.jit(lambda x, ws: jax.lax.scan(inside_body, x, ws))
        got = inside(x, ws)[1]
        rows["each layer's output moved inside the scan"] = timed(inside, x, ws)
        where = got.sharding.memory_kind
    except Exception as e:  # noqa: BLE001 - the probe reports what XLA refuses
        rows["each layer's output moved inside the scan"] = None
        where = f"refused: {type(e).__name__}: {str(e)[:300]}"
    moved = L * T * KV * 2
    result = {"what": __doc__.splitlines()[0], "layers": L, "tokens": T, "bytes_moved": moved,
              "seconds": rows, "inside_scan_output_memory_kind": where, "environment": environment(),
              "command": "python " + " ".join(sys.argv)}
    for k, v in rows.items():
        print(f"{k:45s} {'-' if v is None else f'{v * 1e3:8.3f} ms'}")
    print("inside-scan output memory kind:", where)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
