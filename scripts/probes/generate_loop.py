"""`generate(steps_per_call=k)` on the GPU: the same tokens as the one-step loop, and its time a token.

    python3 scripts/probes/generate_loop.py --layers 8 --context 32768 --batch 4 --out $OUT/generate_loop.json

MiniCPM4.1-8B shapes with random weights (and a random Forecast), `layers` of its 32 layers. Each
(system, k) generates twice with the same shapes; the second run is timed from the streamed tokens
(`on_step` timestamps): the time a token is the span from the first call's tokens to the last's,
over the tokens between, so the prefill and the compile stay outside it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.config import get_preset
from sparda_jax.envinfo import environment
from sparda_jax.forecast import init_forecast
from sparda_jax.infer.generate import SamplingConfig, generate
from sparda_jax.model import init_params, layered_params


def _timed(params, cfg, prompts, sampling, system, k, forecast):
    marks = []  # (tokens so far in row 0, time)
    on_step = lambda out: marks.append((len(out[0]), time.perf_counter()))
    out, stats = generate(params, cfg, prompts, sampling, dtype=jnp.bfloat16, system=system, forecast=forecast,
                          steps_per_call=k, return_stats=True, on_step=on_step)
    # the first mark is the prefill's token; the span starts after the first decode call's tokens
    first = next(i for i, (n, _) in enumerate(marks) if n > 1 + (k - 1))
    n0, t0 = marks[first]
    n1, t1 = marks[-1]
    return out, stats, (t1 - t0) / (n1 - n0), n1 - n0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="minicpm4.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=41, help="1 + a multiple of every k: whole calls only")
    p.add_argument("--systems", nargs="+", default=["sparse", "sparda"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.ks[0] != 1:  # the one-step loop is every row's reference, tokens and time
        p.error(f"--ks must start with 1, got {a.ks}")
    cfg = get_preset(a.preset)
    cfg = dataclasses.replace(cfg, num_layers=a.layers)
    key = jax.random.PRNGKey(0)
    params = layered_params(init_params(cfg, key, param_dtype=jnp.bfloat16))
    forecast = init_forecast(cfg, jax.random.PRNGKey(1), param_dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    # different lengths, as a batch of prompts has: the longest is `context`
    prompts = [list(rng.integers(0, cfg.vocab_size, a.context - 64 * i)) for i in range(a.batch)]
    sampling = SamplingConfig(max_new_tokens=a.new_tokens)
    rows, ref = [], {}

    def save(**extra):  # after every row: a run cut short keeps what it timed
        if a.out:
            res = dict(name="generate_loop", environment=environment(), config=vars(a), rows=rows,
                       command=" ".join(["scripts/probes/generate_loop.py"] + sys.argv[1:]), **extra)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1, default=str)

    for system in a.systems:
        for k in a.ks:
            t = time.perf_counter()
            generate(params, cfg, prompts, sampling, dtype=jnp.bfloat16, system=system, forecast=forecast,
                     steps_per_call=k)
            warm = time.perf_counter() - t
            out, stats, per_token, n = _timed(params, cfg, prompts, sampling, system, k, forecast)
            same = ref.setdefault(system, out) == out  # k = 1 runs first
            rows.append(dict(system=system, steps_per_call=k, first_run_seconds=warm, seconds_per_token=per_token,
                             tokens_timed=n, batch=a.batch, same_tokens_as_k1=same,
                             miss_rate=stats["copied_blocks"] / max(stats["selected_blocks"], 1)))
            print(f"[generate] {system} k={k}: {per_token * 1e3:.2f} ms a token, same tokens as k=1: {same}",
                  flush=True)
            save()
    ratios = {s: next(r["seconds_per_token"] for r in rows if r["system"] == s and r["steps_per_call"] == 1)
              / next(r["seconds_per_token"] for r in rows if r["system"] == s and r["steps_per_call"] == max(a.ks))
              for s in a.systems}
    save(speedup_k_over_1=ratios)
    print("| system | k | ms/token | same tokens |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['steps_per_call']} | {r['seconds_per_token'] * 1e3:.2f} | {r['same_tokens_as_k1']} |")
    return 0 if all(r["same_tokens_as_k1"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
