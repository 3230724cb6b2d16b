"""Perplexity and selection quality of every mode on held-out real text.

For each split of held-out text (`eval.heldout`: by default the "eval" part of the Python docs),
each context length and each of `n_seqs` windows of it, every mode runs the same prefill-style
forward (one row per (split, length, mode)):
  - perplexity over all tokens, and over the second half of each window (where the budget
    binds: the first `topk` blocks see everything);
  - per layer, block recall of the mode's selection against the layer's own InfLLM-V2 choice
    from its true queries (content blocks only: forced blocks are excluded), and the dense
    attention mass that the selected blocks capture. The config's dense layers
    (`sparse.dense_layers`) select nothing: no recall (None per layer), all of their mass.
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
from sparda_jax.text import haystack_from_tokens

from .heldout import HeldoutText, budget_record, describe, python_docs_text, selecting_layers

__all__ = ["eval_selection", "markdown_table", "mode_rows", "check_room"]


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


def check_room(texts: list[HeldoutText], n_tokens: int, what: str) -> None:
    """Raises ValueError naming the first split that holds fewer than n_tokens tokens."""
    for t in texts:
        if t.tokens < n_tokens:
            raise ValueError(f"split {t.split!r} holds {t.tokens} tokens, fewer than the {n_tokens} {what}")


def eval_selection(model: Pretrained, *, lengths=(4096, 8192), n_seqs: int = 4, modes=MODES,
                   forecast=None, seed: int = 0, texts: list[HeldoutText] | None = None, progress: bool = True,
                   on_row=None) -> dict:
    """Returns a JSON-ready dict (see the module docstring). forecast=None: the Forecast shipped
    for this model, or an untrained one (the rows say which). texts: the held-out splits
    (default: the Python docs' held-out quarter); a window never repeats text, so a split
    shorter than the longest length raises ValueError before any model work.
    on_row(partial_result) is called after every (split, length, mode) row, e.g. to save progress."""
    c = model.config
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected one of {', '.join(MODES)}")
    tok = model.tokenizer
    if texts is None:
        if tok is None:
            raise ValueError("the default held-out text needs the model's tokenizer")
        texts = [python_docs_text(tok.encode)]
    check_room(texts, max(lengths), "of a window (--lengths)")
    extra = prepare_modes(model, modes, seed=seed, forecast=forecast)
    trained, ig = extra["forecast_trained"], extra.get("infinigen")
    rows = []
    selects = selecting_layers(c)
    selecting = np.flatnonzero(selects)
    bar = tqdm(total=len(texts) * len(lengths) * n_seqs * len(modes), desc="eval", disable=not progress)
    for text, length in ((t, n) for t in texts for n in lengths):
        seqs = [haystack_from_tokens(text.docs, length, seed=seed + 1000 + i) for i in range(n_seqs)]
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
                    # a dense layer (sparse.dense_layers) reads every key: no recall, all of its mass
                    hits += np.asarray(h_) * selects
                    total += np.asarray(t_) * selects
                    mass += np.where(selects, np.asarray(m_), 1.0) / n_seqs
                    for tt in TILES:  # every selecting layer's selection, as the prefill kernel sees it
                        blowup[tt].append(float(jnp.mean(jax.lax.map(lambda i: tile_blowup(i, tile=tt),
                                                                     aux["ids"][selecting]))))
                bar.update(1)
            all_ = np.concatenate(nll_all)
            late = np.concatenate(nll_late)
            row = {
                "split": text.split,
                "mode": mode + ("" if mode != "sparda" else (" (trained)" if trained else " (untrained)")),
                "length": length,
                "n_seqs": n_seqs,
                "tokens_scored": int(all_.size),
                "ppl": math.exp(all_.mean()),
                "ppl_late": math.exp(late.mean()),
                "tokens_late": int(late.size),
                # a 95% interval on the mean NLL of the late half, over tokens (they are
                # correlated within a sequence, so this is a lower bound on the uncertainty)
                "nll_late_ci95": 1.96 * float(late.std(ddof=1) / math.sqrt(late.size)),
                "seconds": round(time.perf_counter() - t0, 2),
            }
            if mode != "dense":
                per_layer = np.where(total > 0, hits / np.maximum(total, 1), np.nan)
                row["recall"] = float(hits.sum() / max(total.sum(), 1))
                row["recall_hits"], row["recall_total"] = int(hits.sum()), int(total.sum())
                row["recall_per_layer"] = [None if math.isnan(x) else round(float(x), 4) for x in per_layer]
                row["attention_mass"] = float(mass.mean())
                row["attention_mass_per_layer"] = [round(float(x), 4) for x in mass]
                row["tile_union_over_selected"] = {str(tt): float(np.mean(v)) for tt, v in blowup.items()}
            rows.append(row)
            if on_row is not None:
                on_row(_result(c, rows, ig, texts))
    bar.close()
    return _result(c, rows, ig, texts)


def _result(c, rows, ig, texts) -> dict:
    sp = c.sparse
    return {
        "model": c.name,
        "budget": budget_record(sp),
        "text": describe(texts),
        "splits": {t.split: t.info for t in texts},
        "infinigen": None if ig is None else {"columns": ig.columns, "ratio": ig.columns / c.head_dim,
                                              "calibration_tokens": CALIBRATION_TOKENS},
        "rows": rows,
    }


def markdown_table(result: dict) -> str:
    """One table per split (rows of files written before splits were recorded: one table)."""
    splits = list(dict.fromkeys(r.get("split") for r in result["rows"]))
    if len(splits) == 1:
        return _split_table(result["rows"])
    return "\n\n".join(f"**{s}**\n\n" + _split_table([r for r in result["rows"] if r.get("split") == s])
                       for s in splits)


def mode_rows(rows: list[dict], lengths, cell, empty: str) -> list[str]:
    """Markdown rows, one per mode (in first-seen order): `cell(row)` for each length, `empty`
    where a (mode, length) was not measured."""
    by = {(r["mode"], r["length"]): r for r in rows}
    out = []
    for m in dict.fromkeys(r["mode"] for r in rows):
        out.append(f"| {m} | " + " | ".join(cell(by[m, n]) if (m, n) in by else empty for n in lengths) + " |")
    return out


def _split_table(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})

    def cell(r):
        ci = r.get("nll_late_ci95")
        late = f"{r['ppl_late']:.3f}" + (f" (±{ci:.3f} nats)" if ci is not None else "")
        recall = f"{r['recall']:.3f}" if "recall" in r else "-"
        mass = f"{r['attention_mass']:.3f}" if "attention_mass" in r else "1"
        return f"{r['ppl']:.3f} | {late} | {recall} | {mass}"

    head = "| mode | " + " | ".join(f"ppl {n} | ppl {n} late half | recall {n} | mass {n}" for n in lengths) + " |"
    return "\n".join([head, "|---|" + "---|---|---|---|" * len(lengths), *mode_rows(rows, lengths, cell, "- | - | - | -")])
