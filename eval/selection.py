"""Perplexity and selection quality of every mode on held-out real text.

For each context length and each of `n_seqs` windows of held-out text (the "eval" part of the
corpus split), every mode runs the same prefill-style forward:
  - perplexity over all tokens, and over the second half of each window (where the budget
    binds: the first `topk` blocks see everything);
  - per layer, block recall of the mode's selection against the layer's own InfLLM-V2 choice
    from its true queries (content blocks only: forced blocks are excluded), and the dense
    attention mass that the selected blocks capture.
InfiniGen's offline setup uses the "train" part of the corpus.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sparda_jax.api import Pretrained, mode_kwargs, prepare_modes
from sparda_jax.infinigen import CALIBRATION_TOKENS
from sparda_jax.metrics import attention_mass, recall_counts, tile_blowup
from sparda_jax.modes import MODES, forward
from sparda_jax.text import corpus_split, haystack_tokens, python_docs_corpus

__all__ = ["eval_selection", "markdown_table"]


# tokens per tile of the prefill kernel (sparda_jax.ops.sparse_attention.prefill.tile_tokens_for):
# MiniCPM4.1's group of 16 heads gives 4, SmolLM2's group of 3 gives 16; 8 lies between
TILES = (4, 8, 16)


@functools.partial(jax.jit, static_argnames=("sparse",))
def _layer_metrics(ids, oracle, q, k, pos, sparse):
    """Per layer (leading L axis): recall hits, recall total, captured attention mass."""

    def one(args):
        i, o, qq, kk = args
        h, t = recall_counts(i, o, pos, sparse)
        return h, t, attention_mass(qq, kk, i, pos, block_size=sparse.block_size)

    return jax.lax.map(one, (ids, oracle, q, k))


def _nll(logits, tokens):
    """Per-token negative log-likelihood of tokens[1:] [B, T-1] (float64 on host)."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -np.asarray(jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0], np.float64)


def eval_selection(model: Pretrained, *, lengths=(4096, 8192), n_seqs: int = 4, modes=MODES,
                   forecast=None, seed: int = 0, progress: bool = True,
                   on_row=None) -> dict:
    """Returns a JSON-ready dict (see the module docstring). forecast=None: the Forecast shipped
    for this model, or an untrained one (the rows say which).
    on_row(partial_result) is called after every (length, mode) row, e.g. to save progress."""
    c = model.config
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected one of {', '.join(MODES)}")
    tok = model.tokenizer
    docs = python_docs_corpus()
    extra = prepare_modes(model, modes, seed=seed, forecast=forecast)
    trained, ig = extra["forecast_trained"], extra.get("infinigen")
    eval_docs = corpus_split(docs, "eval")
    rows = []
    bar = tqdm(total=len(lengths) * n_seqs * len(modes), desc="eval", disable=not progress)
    for length in lengths:
        seqs = [haystack_tokens(tok.encode, length, seed=seed + 1000 + i, docs=eval_docs) for i in range(n_seqs)]
        for mode in modes:
            nll_all, nll_late = [], []
            hits = np.zeros(c.num_layers)
            total = np.zeros(c.num_layers)
            mass = np.zeros(c.num_layers)
            blowup = {tt: [] for tt in TILES}
            t0 = time.perf_counter()
            for s in seqs:
                tokens = jnp.asarray([s], jnp.int32)
                sparse_mode = mode != "dense"
                out = forward(model.params, tokens, c, **mode_kwargs(extra, mode), dtype=model.dtype,
                              return_kv=sparse_mode, return_q=sparse_mode, collect_selection=sparse_mode)
                logits, aux = out if sparse_mode else (out, None)
                nll = _nll(logits, tokens)[0]
                nll_all.append(nll)
                nll_late.append(nll[length // 2:])
                if aux is not None:
                    pos = jnp.arange(length, dtype=jnp.int32)[None]
                    h_, t_, m_ = _layer_metrics(aux["ids"], aux["oracle"], aux["q"], aux["k"], pos, c.sparse)
                    hits += np.asarray(h_)
                    total += np.asarray(t_)
                    mass += np.asarray(m_) / n_seqs
                    for tt in TILES:  # every layer's selection, as the prefill kernel sees it
                        blowup[tt].append(float(jnp.mean(jax.lax.map(lambda i: tile_blowup(i, tile=tt), aux["ids"]))))
                bar.update(1)
            all_ = np.concatenate(nll_all)
            late = np.concatenate(nll_late)
            row = {
                "mode": mode + ("" if mode != "sparda" else (" (trained)" if trained else " (untrained)")),
                "length": length,
                "n_seqs": n_seqs,
                "tokens_scored": int(all_.size),
                "ppl": math.exp(all_.mean()),
                "ppl_late": math.exp(late.mean()),
                # a 95% interval on the mean NLL of the late half, over tokens (they are
                # correlated within a sequence, so this is a lower bound on the uncertainty)
                "nll_late_ci95": 1.96 * float(late.std(ddof=1) / math.sqrt(late.size)),
                "seconds": round(time.perf_counter() - t0, 2),
            }
            if mode != "dense":
                per_layer = np.where(total > 0, hits / np.maximum(total, 1), np.nan)
                row["recall"] = float(hits.sum() / max(total.sum(), 1))
                row["recall_per_layer"] = [None if math.isnan(x) else round(float(x), 4) for x in per_layer]
                row["attention_mass"] = float(mass.mean())
                row["attention_mass_per_layer"] = [round(float(x), 4) for x in mass]
                row["tile_union_over_selected"] = {str(tt): float(np.mean(v)) for tt, v in blowup.items()}
            rows.append(row)
            if on_row is not None:
                on_row(_result(c, rows, ig))
    bar.close()
    return _result(c, rows, ig)


def _result(c, rows, ig) -> dict:
    sp = c.sparse
    return {
        "model": c.name,
        "budget": {"block_size": sp.block_size, "init_blocks": sp.init_blocks, "local_blocks": sp.local_blocks,
                   "topk": sp.topk, "kernel_size": sp.kernel_size, "kernel_stride": sp.kernel_stride},
        "text": "held-out quarter of the Python docs shipped with CPython (pydoc_data.topics)",
        "infinigen": None if ig is None else {"columns": ig.columns, "ratio": ig.columns / c.head_dim,
                                              "calibration_tokens": CALIBRATION_TOKENS},
        "rows": rows,
    }


def markdown_table(result: dict) -> str:
    lengths = sorted({r["length"] for r in result["rows"]})
    modes = list(dict.fromkeys(r["mode"] for r in result["rows"]))
    by = {(r["mode"], r["length"]): r for r in result["rows"]}
    head = "| mode | " + " | ".join(f"ppl {n} (late half) | recall {n} | mass {n}" for n in lengths) + " |"
    sep = "|---|" + "---|---|---|" * len(lengths)
    lines = [head, sep]
    for m in modes:
        cells = []
        for n in lengths:
            r = by[(m, n)]
            rec = f"{r['recall']:.3f}" if "recall" in r else "-"
            mass = f"{r['attention_mass']:.3f}" if "attention_mass" in r else "1"
            cells.append(f"{r['ppl']:.3f} ({r['ppl_late']:.3f}) | {rec} | {mass}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
