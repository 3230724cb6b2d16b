"""Where the demo's needle is lost: per layer, the share of the question's selections that hold it.

`sparda demo` asks for a fact placed in a long document. When a sparse mode answers wrong, either
its selection never held the fact's block (the selector lost it) or it held it and the model did
not use it. This runs the demo's prompt (`infer.demo.make_case`) through one prefill-style forward
per mode and reports, per layer, the share of (KV head, query) rows of the question (the prompt's
last QUESTION_ROWS tokens) whose selection holds a block of the fact, beside the in-run InfLLM-V2
oracle's share.

    python -m sparda_jax.eval.needle --model smollm2-135m-sparse --context 8128 --out X.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax.numpy as jnp
import numpy as np

__all__ = ["needle_rows", "main", "QUESTION_ROWS"]

QUESTION_ROWS = 24  # the prompt's last tokens: the question and the chat template's tail


def needle_rows(ids, first_row: int, needle_blocks) -> np.ndarray:
    """ids int [L, B, K, T, n]: per layer, the share of rows (B, K, T >= first_row) whose selection
    holds any of needle_blocks."""
    sel = np.asarray(ids)[:, :, :, first_row:]
    held = np.isin(sel, np.asarray(list(needle_blocks))).any(axis=-1)
    return held.reshape(held.shape[0], -1).mean(axis=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["sparse", "sparda"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from sparda_jax.api import load_pretrained, mode_kwargs, prepare_modes
    from sparda_jax.envinfo import environment
    from sparda_jax.infer.demo import make_case
    from sparda_jax.modes import forward

    model = load_pretrained(a.model, dtype=getattr(jnp, a.dtype))
    c = model.config
    case = make_case(model, a.context, a.depth, a.seed)
    bs = c.sparse.block_size
    blocks = sorted({p // bs for p in range(*case.fact)})
    question = len(case.prompt_ids) - QUESTION_ROWS
    extra = prepare_modes(model, a.modes)
    tokens = jnp.asarray([case.prompt_ids], jnp.int32)
    t0 = time.perf_counter()
    rows = []
    for mode in a.modes:
        _, aux = forward(model.params, tokens, c, **mode_kwargs(extra, mode), dtype=model.dtype,
                         collect_selection=True, return_logits=False)
        share, oracle = needle_rows(aux["ids"], question, blocks), needle_rows(aux["oracle"], question, blocks)
        rows.append({"mode": mode, "share_per_layer": [round(float(x), 3) for x in share],
                     "oracle_share_per_layer": [round(float(x), 3) for x in oracle],
                     "layers_holding_it": int(np.sum(share > 0.5)), "oracle_layers_holding_it": int(np.sum(oracle > 0.5))})
        print(f"{mode}: layers whose question rows mostly hold the fact: {rows[-1]['layers_holding_it']} "
              f"(oracle {rows[-1]['oracle_layers_holding_it']}) of {c.num_layers}")
    res = {"what": __doc__.split("\n\n")[0], "model": a.model, "dtype": a.dtype, "context": len(case.prompt_ids),
           "depth": a.depth,
           "fact_blocks": blocks, "question_rows_from": question, "forecast_trained": extra["forecast_trained"],
           "rows": rows, "seconds": round(time.perf_counter() - t0, 1), "environment": environment(),
           "command": "python -m sparda_jax.eval.needle " + " ".join(sys.argv[1:] if argv is None else argv)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
