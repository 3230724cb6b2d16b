"""Rows per CTA of the Mosaic top-k (`forecast_mgpu.topk_select_rows`) at SmolLM2's prefill shapes
(3 KV heads, top-24 of 64 or 128 blocks), beside XLA's top-k + sort (`topk_reference`), every
variant checked equal to XLA's ids first. Run on a Hopper GPU:

    python bench/results/select/topk_rows_sweep.py OUT.json

(`topk_rows_sweep.json` ran at c897ee8, before `topk_select_rows` took rows=: it set the rows by
replacing `rows_per_cta` around each call, the same kernel.)
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.bench.timing import measure
from sparda_jax.envinfo import environment
from sparda_jax.ops.block_select import forecast_mgpu as fm

K_HEADS, TOPK, BLOCK, FORCED_LOCAL = 3, 24, 64, 8


def scores(batch: int, context: int, seed: int = 0) -> np.ndarray:
    """[batch * K * context, blocks] like `block_scores`' rows: -inf after the query's block,
    +inf on the init block, the 8 local blocks and the own block, normal scores between."""
    nb = context // BLOCK
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((batch, K_HEADS, context, nb)).astype(np.float32)
    qblk = (np.arange(context) // BLOCK)[:, None]
    blk = np.arange(nb)[None, :]
    s = np.where(blk > qblk, -np.inf, s)
    s = np.where((blk <= qblk) & ((blk < 1) | (blk >= qblk - FORCED_LOCAL)), np.inf, s)
    return s.reshape(-1, nb)


def main(out_path: str) -> None:
    rows_out = []
    ref = jax.jit(fm.topk_reference, static_argnums=1)
    for batch, context in ((1, 4096), (8, 4096), (1, 8192)):
        x = jnp.asarray(scores(batch, context))
        want = np.asarray(ref(x, TOPK))
        cases = [("xla_top_k_sort", lambda x=x: ref(x, TOPK))]
        for rt in (8, 16, 32, 64, 128, 256):
            if rt * x.shape[1] > 16384:
                continue
            cases.append((f"mosaic_rows{rt}", jax.jit(lambda x=x, rt=rt: fm.topk_select_rows(x, TOPK, rows=rt))))
        for name, fn in cases:
            rec = measure(fn, lambda out: {"passed": bool(np.array_equal(np.asarray(out), want))}, repeats=20, max_s=10.0)
            row = {"batch": batch, "context": context, "rows": int(x.shape[0]), "blocks": int(x.shape[1]),
                   "variant": name} | rec
            rows_out.append(row)
            t = rec.get("median_s") or rec.get("seconds")
            print(f"B={batch} T={context} {name:>16} {rec.get('status')} "
                  f"{'%.1f us' % (1e6 * t) if t else ''}", flush=True)
    with open(out_path, "w") as f:
        json.dump({"name": "topk_rows_sweep", "environment": environment(), "topk": TOPK, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
