"""`sparda bench train`: one Forecast training step at long context with real model shapes
(random weights: the time does not depend on them). Reports the step time, tokens/s and the
device's peak memory.

    sparda bench train --preset minicpm4.1-8b --seq-len 32768 --out bench/results/train_step/train.json
    sparda bench train --data-devices 2 ...   # one GPU and two in the same run: the scaling
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sparda_jax.config import get_preset
from sparda_jax.envinfo import environment
from sparda_jax.forecast import forecast_param_count, init_forecast
from sparda_jax.model import init_params
from sparda_jax.train.objective import TrainConfig, init_state, train_step

__all__ = ["bench_train_step"]


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# tokens/s on N devices over one device's, the goals for 2 and 4 GPUs (0.9 N elsewhere)
SCALING_TARGETS = {2: 1.85, 4: 3.6}


def _time_steps(config, tc: TrainConfig, params, state, tokens, mesh, repeats: int) -> dict:
    """Compile and run one step, then time `repeats` more; the state is donated each step."""
    t0 = time.perf_counter()
    state, m = train_step(state, params, tokens, config=config, tc=tc, mesh=mesh)
    jax.block_until_ready(m["loss"])
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = train_step(state, params, tokens, config=config, tc=tc, mesh=mesh)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    return {"devices": mesh.size, "step_seconds_median": med, "step_seconds_min": float(min(times)),
            "step_seconds_max": float(max(times)), "compile_and_first_step_seconds": first,
            "tokens_per_s": tokens.size / med, "loss": float(m["loss"]), "loss_finite": bool(np.isfinite(float(m["loss"])))}


def bench_train_step(preset: str = "minicpm4.1-8b", *, seq_len: int = 32768, micro_batch: int = 1,
                     accumulation: int = 1, layers: int | None = None, repeats: int = 3, seed: int = 0,
                     data_devices: int | None = None) -> dict:
    """The Forecast training step at long context. micro_batch: sequences per device and
    micro-batch. data_devices N > 1 (0: every device there is): the step on one device and on a data-parallel mesh of N
    (`train.run.make_mesh`; N x micro_batch sequences a micro-batch) in the same run, with the
    scaling of tokens/s as a claim; the top-level numbers are then the N-device step's."""
    from sparda_jax.train.run import make_mesh, shard_batch

    config = get_preset(preset)
    if layers is not None:
        config = config.replace(num_layers=layers)
    n = jax.device_count() if data_devices == 0 else (data_devices or 1)
    if not 1 <= n <= jax.device_count():
        raise ValueError(f"data_devices must be 1..{jax.device_count()}, got {data_devices}")
    # weights are made on the device, in bf16, without a float32 copy of the backbone
    params0 = jax.jit(functools.partial(init_params, config, param_dtype=jnp.bfloat16))(jax.random.key(seed))
    forecast = init_forecast(config, jax.random.key(seed + 1))
    rows = []
    for m in sorted({1, n}):
        mesh = make_mesh(m)
        rep = NamedSharding(mesh, P())
        tc = TrainConfig(seq_len=seq_len, batch=m * micro_batch * accumulation, micro_batch=m * micro_batch, steps=1,
                         dtype="bfloat16")
        tokens = np.asarray(jax.random.randint(jax.random.key(seed + 2), (accumulation, m * micro_batch, seq_len), 0,
                                               config.vocab_size, dtype=jnp.int32))
        params = params0 if m == 1 else jax.device_put(params0, rep)
        state = jax.device_put(init_state(forecast, tc), rep)
        rows.append(_time_steps(config, tc, params, state, shard_batch(mesh, tokens, tokens.shape), mesh, repeats))
    top = rows[-1]
    r = {
        "name": "train",
        "preset": preset,
        "layers": config.num_layers,
        "layers_note": None if layers is None else f"timed with {layers} of {get_preset(preset).num_layers} layers",
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "accumulation": accumulation,
        "data_devices": n,
        "forecast_params": forecast_param_count(config),
        "teacher": [config.forecast.teacher_kernel_size, config.forecast.teacher_kernel_stride],
        **{k: v for k, v in top.items() if k != "devices"},
        "peak_device_bytes": _peak_bytes(),
        "environment": environment(),
    }
    if n > 1:
        scaling = top["tokens_per_s"] / rows[0]["tokens_per_s"]
        target = SCALING_TARGETS.get(n, 0.9 * n)
        r["rows"] = rows
        r["claims"] = [{"claim": f"train T={seq_len}: tokens/s on {n} devices / on one (data parallel, "
                                 f"{micro_batch} sequence(s) per device)",
                        "value": scaling, "target": target, "met": scaling >= target}]
    return r


def main(args) -> int:
    r = bench_train_step(args.preset, seq_len=args.seq_len, micro_batch=args.micro_batch,
                         accumulation=args.accumulation, layers=args.layers, repeats=args.repeats,
                         data_devices=args.data_devices)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=2))
    peak = r["peak_device_bytes"]
    print("| preset | layers | seq_len | devices | step s (median) | tokens/s | peak device GiB |")
    print("|---|---|---|---|---|---|---|")
    for row in r.get("rows") or [dict(r, devices=1)]:
        print(f"| {r['preset']} | {r['layers']} | {r['seq_len']} | {row['devices']} | {row['step_seconds_median']:.3f} | "
              f"{row['tokens_per_s']:.0f} | {'-' if peak is None else f'{peak / 2**30:.1f}'} |")
    for c in r.get("claims", []):
        print(f"{c['claim']}: {c['value']:.2f} (target {c['target']}, {'met' if c['met'] else 'not met'})")
    return 0
