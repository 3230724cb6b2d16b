"""Long-range copy as a selection measurement: does each mode's selection find the first copy?

A sequence of `length` tokens is
    prefix filler (init_blocks + 1 blocks) | passage (256 tokens) | filler | the passage again,
the repeat ending the sequence. Passage and filler come from disjoint documents of one held-out
split (even / odd documents), and a passage sharing any 32-token run with the filler is drawn
again, so the only earlier occurrence of the repeat is its source. The prefix keeps the source
out of the forced init block(s), and the gap keeps it out of every repeat query's local window,
so a selection holds the source only by choosing it.

Per (split, length, mode), over `samples` sequences, one prefill-style `forward` each:
  copy_nll        teacher-forced NLL per token of the repeat's tokens (all of them), mean over
                  sequences, with a 95% Student t interval over sequences; copy_acc: argmax hits
  source_share    over (layer, KV head, query at repeat offset j = 1 .. P-1), the share of rows
                  whose selection holds the block of position source + j + 1: the source of the
                  token the query predicts (the induction target); per layer too
  copy_share      the same for the block of source + j (the copy of the query's own token)
  oracle_*        the same shares for the in-run InfLLM-V2 selection from the layer's true
                  queries (aux["oracle"]): the ceiling a selector predicting it can reach
Dense attention reads every block: its rows carry the NLL alone; so do the config's dense layers
(`sparse.dense_layers`) in the shares: they select nothing, and their per-layer share is None.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sparda_jax.api import Pretrained, mode_kwargs, prepare_modes
from sparda_jax.modes import MODES, forward
from sparda_jax.text import haystack_from_tokens

from .heldout import HeldoutText, budget_record, describe, python_docs_text, selecting_layers
from .selection import mode_rows

__all__ = ["CopySequence", "copy_sequence", "source_share", "eval_copy", "copy_markdown", "PASSAGE_TOKENS",
           "OVERLAP_TOKENS"]

PASSAGE_TOKENS = 256
OVERLAP_TOKENS = 32  # a passage sharing a run this long with its filler is drawn again
_PASSAGE_OFFSET_MAX = 2048  # the passage starts up to this far into its documents' seeded stream
_DRAWS = 20


@dataclass(frozen=True)
class CopySequence:
    """tokens int32 [length]; the passage's source copy is tokens[source:source + passage_tokens],
    its repeat tokens[repeat:] (repeat = length - passage_tokens)."""

    tokens: np.ndarray
    source: int
    repeat: int
    passage_tokens: int


def _shares_run(passage: np.ndarray, filler: np.ndarray, n: int) -> bool:
    """Whether some n-token run of passage occurs in filler."""
    if passage.size < n or filler.size < n:
        return False
    runs = {bytes(w) for w in np.lib.stride_tricks.sliding_window_view(filler.astype(np.int32), n)}
    return any(bytes(w) in runs for w in np.lib.stride_tricks.sliding_window_view(passage.astype(np.int32), n))


def copy_sequence(docs, length: int, seed: int, *, block_size: int, init_blocks: int, local_blocks: int,
                  passage_tokens: int = PASSAGE_TOKENS) -> CopySequence:
    """The copy sequence of `length` tokens drawn from docs (1-D token arrays; passage from the
    even-indexed, filler from the odd-indexed ones), a pure function of its arguments.

    Raises ValueError when length leaves no room: the repeat must start more than
    (local_blocks + 1) blocks after the source, so that no repeat query's local window holds
    the block it predicts from; when the documents hold too few tokens; or when no passage free
    of the filler's runs is found in a few draws."""
    docs = list(docs)
    if len(docs) < 2:
        raise ValueError(f"the copy task needs at least 2 documents (passage and filler disjoint), got {len(docs)}")
    prefix = (init_blocks + 1) * block_size
    middle = length - prefix - 2 * passage_tokens
    distance = passage_tokens + middle  # repeat - source
    need = (local_blocks + 1) * block_size + 1
    if middle < 1 or distance < need:
        shortest = prefix + 2 * passage_tokens + max(1, need - passage_tokens)
        raise ValueError(f"length {length} leaves no room for the copy task: {prefix} prefix tokens + 2 x "
                         f"{passage_tokens}-token passage + filler with the repeat at least {need} tokens after "
                         f"its source (local window of {local_blocks} blocks of {block_size}); the shortest "
                         f"length is {shortest}")
    pdocs, fdocs = docs[0::2], docs[1::2]
    p_total = sum(int(np.asarray(d).size) for d in pdocs)
    f_total = sum(int(np.asarray(d).size) for d in fdocs)
    if p_total < passage_tokens:
        raise ValueError(f"the passage documents hold {p_total} tokens, fewer than a {passage_tokens}-token passage")
    if f_total < prefix + middle:
        raise ValueError(f"the filler documents hold {f_total} tokens, fewer than the {prefix + middle} filler "
                         f"tokens of a length-{length} copy sequence")
    rng = random.Random(seed)
    filler = haystack_from_tokens(fdocs, prefix + middle, seed=rng.randint(0, 10**6))
    for _ in range(_DRAWS):
        off = rng.randint(0, min(p_total - passage_tokens, _PASSAGE_OFFSET_MAX))
        passage = haystack_from_tokens(pdocs, passage_tokens + off, seed=rng.randint(0, 10**6))[off:]
        if not _shares_run(passage, filler, OVERLAP_TOKENS):
            break
    else:
        raise ValueError(f"no passage in {_DRAWS} draws is free of {OVERLAP_TOKENS}-token runs of its filler "
                         f"(the text repeats itself across documents)")
    tokens = np.concatenate([filler[:prefix], passage, filler[prefix:], passage]).astype(np.int32)
    return CopySequence(tokens, prefix, length - passage_tokens, passage_tokens)


def source_share(ids, seq: CopySequence, *, block_size: int, shift: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(hits [L], rows [L]): per layer, over (batch row, KV head, query at repeat offset
    j = 1 .. P-1), how many selections ids [L, B, K, T, n] (-1 padded) hold the block of
    position seq.source + j + shift, and how many rows there are."""
    p = seq.passage_tokens
    q = np.asarray(ids[:, :, :, seq.repeat + 1: seq.repeat + p, :])  # [L, B, K, P-1, n]
    target = (seq.source + np.arange(1, p) + shift) // block_size  # [P-1]
    hit = np.any(q == target[:, None], axis=-1)  # [L, B, K, P-1]
    return hit.sum(axis=(1, 2, 3)).astype(np.int64), np.full(q.shape[0], np.prod(hit.shape[1:]), np.int64)


def _t_ci(x: np.ndarray) -> float | None:
    from .accuracy import _t975

    return float(_t975(len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None


def _shares(prefix: str, hits: np.ndarray, rows: np.ndarray) -> dict:
    """hits, rows [samples, L]; a layer with no rows (a dense layer) has no share (None)."""
    per_layer = [None if n == 0 else round(float(h / n), 4) for h, n in zip(hits.sum(0), rows.sum(0))]
    per_sample = hits.sum(1) / rows.sum(1)
    return {prefix: float(hits.sum() / rows.sum()), f"{prefix}_ci95": _t_ci(per_sample),
            f"{prefix}_per_layer": per_layer,
            f"{prefix}_per_sample": [float(x) for x in per_sample]}


def eval_copy(model: Pretrained, *, lengths=(4096, 8192), samples: int = 8, modes=MODES, forecast=None,
              seed: int = 0, texts: list[HeldoutText] | None = None, passage_tokens: int = PASSAGE_TOKENS,
              progress: bool = True, on_row=None) -> dict:
    """Returns a JSON-ready dict (see the module docstring) with a row per (split, length, mode).
    Sample i of a (split, length) cell is copy_sequence(split docs, length, seed + i): the same
    sequence in every mode. Every sequence is built, and bad input refused (ValueError), before
    the model runs. on_row(partial_result) is called after every row."""
    c = model.config
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected one of {', '.join(MODES)}")
    too_long = [n for n in lengths if n > c.max_position_embeddings]
    if too_long:
        raise ValueError(f"length {too_long[0]} exceeds {c.name}'s context of {c.max_position_embeddings} tokens")
    if texts is None:
        if model.tokenizer is None:
            raise ValueError("the default held-out text needs the model's tokenizer")
        texts = [python_docs_text(model.tokenizer.encode)]
    sp = c.sparse
    seqs = {}
    for text in texts:
        for length in lengths:
            try:
                seqs[text.split, length] = [
                    copy_sequence(text.docs, length, seed + i, block_size=sp.block_size, init_blocks=sp.init_blocks,
                                  local_blocks=sp.local_blocks, passage_tokens=passage_tokens) for i in range(samples)]
            except ValueError as e:
                raise ValueError(f"split {text.split!r}: {e}") from None
    extra = prepare_modes(model, modes, seed=seed, forecast=forecast)
    trained, rows = extra["forecast_trained"], []
    selects = selecting_layers(c).astype(np.int64)  # 0: a dense layer
    bar = tqdm(total=len(seqs) * samples * len(modes), desc="copy", disable=not progress)
    for (split, length), batch in seqs.items():
        s0 = batch[0]
        at = jnp.arange(s0.repeat - 1, length - 1, dtype=jnp.int32)[None]  # logits predicting the repeat
        for mode in modes:
            t0 = time.perf_counter()
            sparse_mode = mode != "dense"
            nll, acc, sh = [], [], {k: ([], []) for k in ("source", "copy", "oracle_source", "oracle_copy")}
            for s in batch:
                tokens = jnp.asarray(s.tokens[None])
                out = forward(model.params, tokens, c, **mode_kwargs(extra, mode), dtype=model.dtype,
                              collect_selection=sparse_mode, logits_at=at)
                logits, aux = out if sparse_mode else (out, None)
                lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)  # [P, vocab]
                target = jnp.asarray(s.tokens[s.repeat:])
                nll.append(-float(jnp.mean(jnp.take_along_axis(lp, target[:, None], axis=-1))))
                acc.append(float(jnp.mean(jnp.argmax(lp, axis=-1) == target)))
                if aux is not None:
                    for name, arr in (("", aux["ids"]), ("oracle_", aux["oracle"])):
                        for what, shift in (("source", 1), ("copy", 0)):
                            h, r = source_share(arr, s, block_size=sp.block_size, shift=shift)
                            h, r = h * selects, r * selects  # a dense layer's ids are computed, not read
                            sh[name + what][0].append(h)
                            sh[name + what][1].append(r)
                bar.update(1)
            nll_a, acc_a = np.array(nll), np.array(acc)
            row = {"suite": "copy", "split": split, "length": length,
                   "mode": mode + ("" if mode != "sparda" else (" (trained)" if trained else " (untrained)")),
                   "samples": samples, "seed": seed, "passage_tokens": passage_tokens,
                   "source_start": s0.source, "repeat_start": s0.repeat,
                   "context_blocks": -(-length // sp.block_size),
                   "copy_nll": float(nll_a.mean()), "copy_nll_ci95": _t_ci(nll_a),
                   "copy_nll_per_sample": [float(x) for x in nll_a],
                   "copy_acc": float(acc_a.mean()), "copy_acc_ci95": _t_ci(acc_a)}
            if sparse_mode:
                for k, (h, r) in sh.items():
                    row.update(_shares(f"{k}_share", np.array(h), np.array(r)))
            row["seconds"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            if on_row is not None:
                on_row(_result(c, rows, texts, samples))
    bar.close()
    return _result(c, rows, texts, samples)


def _result(c, rows, texts, samples) -> dict:
    sp = c.sparse
    return {"suite": "copy", "model": c.name,
            "budget": budget_record(sp),
            "text": describe(texts), "splits": {t.split: t.info for t in texts}, "samples_per_cell": samples,
            "rows": rows}


def _fmt(x, ci=None, digits=3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" + ("" if ci is None else f" ±{ci:.{digits}f}")


def copy_markdown(result: dict) -> str:
    """Per split: modes x lengths (NLL ± 95% interval, source share, copy share, oracle source
    share), then the source share per layer."""
    rows = [r for r in result["rows"] if r.get("suite") == "copy"]
    out = []
    for split in dict.fromkeys(r["split"] for r in rows):
        here = [r for r in rows if r["split"] == split]
        lengths = sorted({r["length"] for r in here})
        out.append(f"**{split}**: copy NLL per token of the repeat (± 95% interval over sequences); share of "
                   f"(layer, KV head, repeat query) rows selecting the block of the next token's source "
                   f"(source), of the query token's own copy (copy), and the in-run InfLLM-V2 ceiling (oracle)\n")
        out.append("| mode | " + " | ".join(f"NLL {n} | source {n} | copy {n} | oracle source {n}" for n in lengths)
                   + " |")
        out.append("|---|" + "---|---|---|---|" * len(lengths))
        covered = [n for n in lengths if any(r.get("context_blocks", math.inf) <= result.get("budget", {}).get(
            "topk", -1) for r in here if r["length"] == n)]
        out += mode_rows(here, lengths, lambda r: " | ".join([
            _fmt(r["copy_nll"], r.get("copy_nll_ci95")), _fmt(r.get("source_share")), _fmt(r.get("copy_share")),
            _fmt(r.get("oracle_source_share"))]), "- | - | - | -")
        if covered:
            out.append(f"\nAt {', '.join(map(str, covered))} tokens the budget of {result['budget']['topk']} blocks "
                       f"covers the whole context: every selection holds every block.")
        for n in lengths:
            layered = [r for r in here if r["length"] == n and "source_share_per_layer" in r]
            if not layered:
                continue
            nl = len(layered[0]["source_share_per_layer"])
            out.append(f"\n{split}, {n} tokens: source share per layer (oracle: the in-run InfLLM-V2 selection)\n")
            out.append("| mode | " + " | ".join(str(i) for i in range(nl)) + " |")
            out.append("|---|" + "---|" * nl)
            for r in layered:
                out.append(f"| {r['mode']} | " + " | ".join(_fmt(x, digits=2) for x in r["source_share_per_layer"]) + " |")
            r = next((r for r in layered if r["mode"] == "sparse"), layered[0])
            out.append("| oracle (in the " + r["mode"] + " run) | "
                       + " | ".join(_fmt(x, digits=2) for x in r["oracle_source_share_per_layer"]) + " |")
        out.append("")
    return "\n".join(out).strip() + "\n"
