"""Would layer l's own selection help the Forecast that selects layer l+1?

SparDA's Forecast of layer l reads layer l's input; layer l's own block choice is known then too
and could be a further input (a bonus on the blocks it chose). Before training such an input,
this probe measures what it could add, from one sparda forward with the in-run InfLLM-V2
selection beside it: per layer l+1, of the content blocks the oracle chose and the Forecast
missed, the share that layer l's selection holds, against the share it holds of the content
blocks the Forecast did not choose at all (the chance level for a bonus on them). A share far
above chance says the previous choice carries what the Forecast lacks; near chance, nothing.

    python -m sparda_jax.eval.prev_selection --text CORPUS --split eval-info --length 4096 --seqs 2 --out X.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.metrics import forced_mask
from sparda_jax.ops.block_select.reference import block_mask

__all__ = ["prev_selection_counts", "main"]


def prev_selection_counts(ids, oracle, q_positions, sparse, n_blocks: int):
    """Per layer l >= 1 (a leading L-1 axis), summed over rows (sequence, KV head, query):
    (oracle content blocks, those the selection holds, those it misses, misses that layer
    l-1's selection holds, content candidates the selection left out, those of them layer
    l-1's selection holds). ids, oracle int [L, B, K, T, n]; q_positions [B, T]."""
    blk = jnp.broadcast_to(jnp.arange(n_blocks).reshape(1, 1, 1, n_blocks), ids.shape[1:-1] + (n_blocks,))
    forced = forced_mask(blk, q_positions, sparse)
    cand = blk <= (q_positions // sparse.block_size)[:, None, :, None]  # [B, K, T, nb]
    content = cand & ~forced

    def layer(args):
        cur, orc, prev = args
        s, o, p = block_mask(cur, n_blocks) & content, block_mask(orc, n_blocks) & content, block_mask(prev, n_blocks)
        miss, left = o & ~s, content & ~s
        return jnp.stack([jnp.sum(o), jnp.sum(o & s), jnp.sum(miss), jnp.sum(miss & p), jnp.sum(left),
                          jnp.sum(left & p)])

    return jax.lax.map(layer, (ids[1:], oracle[1:], ids[:-1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", required=True, help="a token corpus directory (`sparda corpus build`)")
    ap.add_argument("--split", default="eval-info")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--forecast", default=None, help="a Forecast file (default: the shipped one)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from sparda_jax.api import load_pretrained, mode_kwargs, prepare_modes
    from sparda_jax.envinfo import environment
    from sparda_jax.modes import forward
    from sparda_jax.text import haystack_from_tokens

    from .heldout import corpus_texts
    from .selection import check_room

    model = load_pretrained(a.model)
    c = model.config
    text = corpus_texts(a.text, [a.split], vocab_size=c.vocab_size)[0]
    check_room([text], a.length, "of a window (--length)")
    forecast = None
    if a.forecast:
        from sparda_jax.io.forecast_file import load_forecast
        forecast = load_forecast(a.forecast, c)
    extra = prepare_modes(model, ["sparda"], forecast=forecast)
    nb = -(-a.length // c.sparse.block_size)
    t0 = time.perf_counter()
    total = np.zeros((c.num_layers - 1, 6), np.int64)
    pos = jnp.arange(a.length, dtype=jnp.int32)[None]
    for i in range(a.seqs):
        tokens = jnp.asarray([haystack_from_tokens(text.docs, a.length, seed=1000 + i)], jnp.int32)
        _, aux = forward(model.params, tokens, c, **mode_kwargs(extra, "sparda"), dtype=model.dtype,
                         collect_selection=True, return_logits=False)
        total += np.asarray(prev_selection_counts(aux["ids"], aux["oracle"], pos, c.sparse, nb), np.int64)
    o, hit, miss, miss_prev, left, left_prev = total.T
    rows = [{"layer": l + 1, "recall": hit[l] / o[l], "misses_held_by_prev": miss_prev[l] / max(miss[l], 1),
             "chance": left_prev[l] / max(left[l], 1)} for l in range(c.num_layers - 1)]
    pooled = {"recall": hit.sum() / o.sum(), "misses_held_by_prev": miss_prev.sum() / miss.sum(),
              "chance": left_prev.sum() / left.sum()}
    res = {"what": "per layer l+1: the share of the Forecast's missed oracle content blocks that layer l's own "
                   "selection holds, against its share of all content blocks the Forecast left out (chance)",
           "model": a.model, "split": a.split, "length": a.length, "seqs": a.seqs,
           "forecast_trained": extra["forecast_trained"], "pooled": pooled,
           "layers": [{k: (round(float(v), 4) if k != "layer" else v) for k, v in r.items()} for r in rows],
           "seconds": round(time.perf_counter() - t0, 1), "environment": environment(),
           "command": "python -m sparda_jax.eval.prev_selection " + " ".join(sys.argv[1:] if argv is None else argv)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(pooled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
