"""`sparda bench train`: one Forecast training step at long context with real model shapes
(random weights: the time does not depend on them). Reports the step time, tokens/s and the
device's peak memory.

    sparda bench train --preset minicpm4.1-8b --seq-len 32768 --out bench/results/train_step/train.json
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.config import get_preset
from sparda_jax.envinfo import environment
from sparda_jax.forecast import forecast_param_count, init_forecast
from sparda_jax.model import init_params
from sparda_jax.train.objective import TrainConfig, init_state, train_step

__all__ = ["bench_train_step"]


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def bench_train_step(preset: str = "minicpm4.1-8b", *, seq_len: int = 32768, micro_batch: int = 1,
                     accumulation: int = 1, layers: int | None = None, repeats: int = 3, seed: int = 0) -> dict:
    config = get_preset(preset)
    if layers is not None:
        config = config.replace(num_layers=layers)
    tc = TrainConfig(seq_len=seq_len, batch=micro_batch * accumulation, micro_batch=micro_batch, steps=1,
                     dtype="bfloat16")
    # weights are made on the device, in bf16, without a float32 copy of the backbone
    params = jax.jit(functools.partial(init_params, config, param_dtype=jnp.bfloat16))(jax.random.key(seed))
    state = init_state(init_forecast(config, jax.random.key(seed + 1)), tc)
    tokens = jax.random.randint(jax.random.key(seed + 2), (accumulation, micro_batch, seq_len), 0,
                                config.vocab_size, dtype=jnp.int32)
    t0 = time.perf_counter()
    state, m = train_step(state, params, tokens, config=config, tc=tc)
    jax.block_until_ready(m["loss"])
    compile_and_first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = train_step(state, params, tokens, config=config, tc=tc)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    med = float(np.median(times))
    n_tok = micro_batch * accumulation * seq_len
    return {
        "name": "train",
        "preset": preset,
        "layers": config.num_layers,
        "layers_note": None if layers is None else f"timed with {layers} of {get_preset(preset).num_layers} layers",
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "accumulation": accumulation,
        "forecast_params": forecast_param_count(config),
        "teacher": [config.forecast.teacher_kernel_size, config.forecast.teacher_kernel_stride],
        "step_seconds_median": med,
        "step_seconds_min": float(min(times)),
        "step_seconds_max": float(max(times)),
        "compile_and_first_step_seconds": compile_and_first,
        "tokens_per_s": n_tok / med,
        "peak_device_bytes": _peak_bytes(),
        "loss": float(m["loss"]),
        "loss_finite": bool(np.isfinite(float(m["loss"]))),
        "environment": environment(),
    }


def main(args) -> int:
    r = bench_train_step(args.preset, seq_len=args.seq_len, micro_batch=args.micro_batch,
                         accumulation=args.accumulation, layers=args.layers, repeats=args.repeats)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=2))
    peak = r["peak_device_bytes"]
    print("| preset | layers | seq_len | step s (median) | tokens/s | peak device GiB |")
    print("|---|---|---|---|---|---|")
    print(f"| {r['preset']} | {r['layers']} | {r['seq_len']} | {r['step_seconds_median']:.3f} | "
          f"{r['tokens_per_s']:.0f} | {'-' if peak is None else f'{peak / 2**30:.1f}'} |")
    return 0
