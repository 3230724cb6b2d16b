"""Host time of one dispatched SparDA engine step (the call's return, not the device's work)
against the layer count, on the tiny preset with the copy calls' CPU twin: does dispatch grow
with the step's argument leaves? Writes JSON to argv[1] (default stdout).

    .venv/bin/python scripts/probes/host_dispatch.py bench/results/host_dispatch_cpu.json
"""

import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax import get_preset, init_forecast, init_model, layered_params
from sparda_jax.envinfo import environment
from sparda_jax.infer.engine import engine_decode_step, engine_prefill


def host_ms(layers: int, steps: int = 10) -> dict:
    cfg = dataclasses.replace(get_preset("tiny"), num_layers=layers)
    params, fc = init_model(cfg, jax.random.key(0)), init_forecast(cfg, jax.random.key(2))
    lp = layered_params(params)
    b, t0 = 2, 70
    tokens = jax.random.randint(jax.random.key(4), (b, t0 + 1), 0, cfg.vocab_size)
    pos = np.array([t0, t0 - 11], np.int32)
    _, st = engine_prefill(params, tokens[:, :t0], jnp.asarray(pos), cfg, mode="sparda", cache_size=t0 + 40,
                           forecast=fc)
    step = lambda st, pos: engine_decode_step(lp, tokens[:, t0], pos, st, cfg, mode="sparda", forecast=fc,
                                              copy_impl="host_ffi")
    for _ in range(3):  # compile and warm up
        lg, st, _ = step(st, pos)
        pos = pos + 1
    jax.block_until_ready(lg)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        lg, st, _ = step(st, pos)
        ts.append(time.perf_counter() - t)
        jax.block_until_ready(lg)  # the next call's dispatch does not wait behind this one
        pos = pos + 1
    return {"layers": layers, "argument_leaves": len(jax.tree.leaves((lp, st, fc))),
            "host_ms_median": float(np.median(ts) * 1e3), "host_ms_min": float(np.min(ts) * 1e3)}


if __name__ == "__main__":
    rows = [host_ms(n) for n in (4, 8, 16, 32)]
    out = json.dumps({"name": "host_dispatch", "environment": environment(),
                      "command": "scripts/probes/host_dispatch.py", "rows": rows}, indent=1)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(out)
    for r in rows:
        print(r)
