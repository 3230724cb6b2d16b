"""Which layers' InfLLM-V2 choice costs the sparse-native SmolLM2 its long-range copy: the sparse
mode with the attention-mass oracle's blocks (`sparda_jax.eval.bound`) in one group of layers and
InfLLM-V2's in the others, group by group, beside the oracle in every layer and in none (the
sparse mode itself), on the held-out copy sequences of `sparda eval --suite copy` (same seed).
The shipped adapter (or --adapter FILE), float32. Run from the repository root:

    python eval/results/sparse_native/layer_groups.py CORPUS_DIR LENGTH SAMPLES OUT.json SPLIT... \
        [--layers 15-19] [--group-size 1] [--adapter FILE] [--no-groups] [--no-all] [--budget 18=48 ...] \
        [--dense-layers 18]

Every layer selects unless --dense-layers names some (the recorded runs predate the preset's dense
layer 18, so the default here is none).
"""

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax import api
from sparda_jax.envinfo import environment
from sparda_jax.eval.bound import oracle_forward
from sparda_jax.eval.copy import copy_sequence
from sparda_jax.eval.heldout import corpus_texts


def main(corpus: str, length: int, samples: int, out: str, splits: list[str], *, layers: tuple[int, ...] | None = None,
         group_size: int = 5, adapter: str | None = None, budgets: tuple[tuple[int, int], ...] = (),
         with_all: bool = True, dense_layers: tuple[int, ...] = ()) -> None:
    """Groups of group_size consecutive layers among `layers` (default: all of them; () none);
    then one arm per (layer, topk) of `budgets`: InfLLM-V2 everywhere, that layer with topk blocks."""
    m = api.load_pretrained("smollm2-135m-sparse", adapter=adapter)
    m.config = m.config.replace(sparse=dataclasses.replace(m.config.sparse, dense_layers=dense_layers))
    c, sp = m.config, m.config.sparse
    layers = tuple(range(c.num_layers)) if layers is None else layers
    groups = [layers[i:i + group_size] for i in range(0, len(layers), group_size)]
    name = lambda g: f"layer {g[0]}" if len(g) == 1 else f"layers {g[0]}-{g[-1]}"
    arms = {"none (sparse mode)": ((), ()), **{name(g): (g, ()) for g in groups},
            **({"all": (None, ())} if with_all else {}),
            **{f"layer {l} at topk {k}": ((), ((l, k),)) for l, k in budgets}}
    seqs = [copy_sequence(text.docs, length, i, block_size=sp.block_size, init_blocks=sp.init_blocks,
                          local_blocks=sp.local_blocks) for text in corpus_texts(corpus, splits, vocab_size=c.vocab_size)
            for i in range(samples)]
    t0, rows = time.time(), []
    for name, (layers, layer_topk) in arms.items():
        nll = []
        for s in seqs:
            at = jnp.arange(s.repeat - 1, length - 1, dtype=jnp.int32)[None]
            logits, _ = oracle_forward(m.params, jnp.asarray(s.tokens[None]), c, dtype=m.dtype, logits_at=at,
                                       oracle_layers=layers, layer_topk=layer_topk)
            lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
            target = jnp.asarray(s.tokens[s.repeat:])
            nll.append(-float(jnp.mean(jnp.take_along_axis(lp, target[:, None], axis=-1))))
        rows.append({"arm": name, "oracle_layers": "all" if layers is None else list(layers),
                     "layer_topk": [list(b) for b in layer_topk], "copy_nll": float(np.mean(nll)),
                     "copy_nll_per_sample": nll})
        print(f"{name:20s} {rows[-1]['copy_nll']:.4f}  {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    result = {"what": f"copy NLL of smollm2-135m-sparse, the oracle's blocks in some layers (or a larger budget) "
                      f"and InfLLM-V2's in the others, {length} tokens, {samples} sequences per split of "
                      f"{', '.join(splits)}",
              "rows": rows, "length": length, "samples": samples, "splits": splits, "budget": vars(sp),
              "adapter": adapter or "shipped",
              "command": "python " + " ".join(sys.argv), "environment": environment(),
              "seconds": round(time.time() - t0, 1)}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    from sparda_jax.cli import _layer_list

    ap = argparse.ArgumentParser()
    ap.add_argument("corpus")
    ap.add_argument("length", type=int)
    ap.add_argument("samples", type=int)
    ap.add_argument("out")
    ap.add_argument("splits", nargs="+")
    ap.add_argument("--layers", type=_layer_list, help="the layers grouped (default: all)")
    ap.add_argument("--group-size", type=int, default=5)
    ap.add_argument("--adapter", help="an adapter file in place of the shipped one")
    ap.add_argument("--no-groups", action="store_true", help="no oracle groups (the sparse mode, all, budgets)")
    ap.add_argument("--no-all", action="store_true", help="no arm with the oracle in every layer")
    ap.add_argument("--budget", action="append", default=[], metavar="LAYER=TOPK",
                    help="an arm with InfLLM-V2's choice of TOPK blocks in LAYER (repeatable)")
    ap.add_argument("--dense-layers", type=_layer_list, default=(), help="layers that attend densely (default: none)")
    a = ap.parse_args()
    budgets = tuple(tuple(int(x) for x in b.split("=")) for b in a.budget)
    main(a.corpus, a.length, a.samples, a.out, a.splits, layers=() if a.no_groups else a.layers,
         group_size=a.group_size, adapter=a.adapter, budgets=budgets, with_all=not a.no_all,
         dense_layers=a.dense_layers)
