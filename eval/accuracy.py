"""One harness, every mode: the synthetic tasks of `eval.tasks` at several context lengths.

Per (task, length, mode) cell, over the same samples:
  em     exact match: the share of expected strings found in the greedy answer
  ll     teacher-forced mean log-probability per token of the reference answer (more sensitive
         than exact match for a small model)
  copy   token accuracy and NLL of the repeated passage (teacher forced)
Every metric comes with a 95% interval over samples (normal approximation; samples are
independent draws). Modes see identical prompts; differences between modes are paired.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sparda_jax.api import Pretrained, mode_kwargs, prepare_modes
from sparda_jax.infer.generate import SamplingConfig, generate
from sparda_jax.modes import MODES, forward

from .tasks import TASKS, make_sample

__all__ = ["eval_tasks", "tasks_markdown", "plot_tasks"]


def _ci(x: np.ndarray) -> float:
    return float(1.96 * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


def _teacher_forced(model, extra, mode, seqs: list[list[int]], spans: list[tuple[int, int]], pad_to: int = 0):
    """Log-probs and argmax hits of the tokens in spans [start, end) of each sequence
    (right-padded to at least pad_to tokens)."""
    t = max(max(len(s) for s in seqs), pad_to)
    toks = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s  # right padding: causal, so it never affects earlier tokens
    logits = forward(model.params, jnp.asarray(toks), model.config, dtype=model.dtype, **mode_kwargs(extra, mode))
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nxt = jnp.asarray(toks[:, 1:])
    tok_lp = np.asarray(jnp.take_along_axis(lp, nxt[..., None], axis=-1)[..., 0])
    hit = np.asarray(jnp.argmax(lp, axis=-1) == nxt)
    # token j is predicted at position j - 1
    return ([tok_lp[i, a - 1: b - 1] for i, (a, b) in enumerate(spans)],
            [hit[i, a - 1: b - 1] for i, (a, b) in enumerate(spans)])


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def eval_tasks(model: Pretrained, *, tasks=TASKS, lengths=(1024, 2048, 4096, 8192), samples: int = 20,
               modes=MODES, forecast=None, seed: int = 0, max_new_tokens: int = 40, progress: bool = True,
               on_row=None) -> dict:
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the task evaluation needs the model's tokenizer")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; expected one of {', '.join(TASKS)}")
    extra = prepare_modes(model, modes, seed=seed, forecast=forecast)
    rows = []
    bar = tqdm(total=len(tasks) * len(lengths) * len(modes), desc="tasks", disable=not progress)
    for length in lengths:
        batches = {task: [make_sample(task, tok, length, seed + i) for i in range(samples)] for task in tasks}
        # one padded length per context length for every task: one compile per (length, mode),
        # not per (task, length, mode), which dominated the run time on the GPU
        gen_pad = max([len(s.prompt_ids) for t, b in batches.items() if t != "copy" for s in b] or [0])
        tf_pad = _round_up(max(len(s.prompt_ids) + len(s.target_ids)
                               for b in batches.values() for s in b), 64)
        for task in tasks:
            batch = batches[task]
            for mode in modes:
                t0 = time.perf_counter()
                row = {"task": task, "length": length, "mode": mode, "samples": samples}
                if mode == "sparda":
                    row["mode"] = "sparda" if extra["forecast_trained"] else "sparda (untrained)"
                if task == "copy":
                    lps, hits = _teacher_forced(model, extra, mode, [s.prompt_ids for s in batch],
                                                [s.repeat for s in batch], tf_pad)
                    acc = np.array([h.mean() for h in hits])
                    nll = np.array([-x.mean() for x in lps])
                    row.update(em=float(acc.mean()), em_ci95=_ci(acc), copy_nll=float(nll.mean()),
                               copy_nll_ci95=_ci(nll))
                else:
                    out = generate(model.params, model.config, [s.prompt_ids for s in batch],
                                   SamplingConfig(max_new_tokens=max_new_tokens), stop_ids=tok.eos_ids,
                                   dtype=model.dtype, pad_to=gen_pad, **mode_kwargs(extra, mode))
                    em = np.array([s.exact_match(tok.decode(o)) for s, o in zip(batch, out)])
                    lps, _ = _teacher_forced(model, extra, mode, [s.prompt_ids + s.target_ids for s in batch],
                                             [(len(s.prompt_ids), len(s.prompt_ids) + len(s.target_ids))
                                              for s in batch], tf_pad)
                    ll = np.array([x.mean() for x in lps])
                    row.update(em=float(em.mean()), em_ci95=_ci(em), ll=float(ll.mean()), ll_ci95=_ci(ll),
                               example=tok.decode(out[0])[:120])
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                bar.update(1)
                if on_row is not None:
                    on_row({"rows": rows})
    bar.close()
    sp = model.config.sparse
    return {"model": model.config.name, "rows": rows, "samples_per_cell": samples,
            "budget": {"block_size": sp.block_size, "init_blocks": sp.init_blocks, "local_blocks": sp.local_blocks,
                       "topk": sp.topk},
            "forecast_trained": extra["forecast_trained"],
            "text": "held-out quarter of the Python docs shipped with CPython (pydoc_data.topics)"}


def tasks_markdown(result: dict) -> str:
    """Per length: tasks x modes (exact match in %, copy token accuracy in %) with the
    average, then the same for the answer log-likelihood."""
    rows = result["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["task"], r["length"], r["mode"]): r for r in rows}
    out = []
    for length in sorted({r["length"] for r in rows}):
        out.append(f"\n**{length} tokens**, exact match % (copy: token accuracy %), ± 95% interval, "
                   f"{result['samples_per_cell']} samples per cell\n")
        out.append("| mode | " + " | ".join(tasks) + " | avg |")
        out.append("|---|" + "---|" * (len(tasks) + 1))
        for m in modes:
            cells, vals = [], []
            for t in tasks:
                r = by.get((t, length, m))
                if r is None:
                    cells.append("-")
                    continue
                vals.append(r["em"])
                ci = r["em_ci95"]
                cells.append(f"{100 * r['em']:.1f}" + ("" if math.isnan(ci) else f" ±{100 * ci:.1f}"))
            out.append(f"| {m} | " + " | ".join(cells) + f" | {100 * np.mean(vals):.1f} |")
        lt = [t for t in tasks if t != "copy"]
        if lt:
            out.append(f"\n{length} tokens, answer log-likelihood per token (copy: NLL of the repeat)\n")
            out.append("| mode | " + " | ".join(tasks) + " |")
            out.append("|---|" + "---|" * len(tasks))
            for m in modes:
                cells = []
                for t in tasks:
                    r = by.get((t, length, m))
                    if r is None:
                        cells.append("-")
                    elif t == "copy":
                        cells.append(f"{r['copy_nll']:.3f}")
                    else:
                        cells.append(f"{r['ll']:.3f} ±{r['ll_ci95']:.3f}")
                out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out).strip() + "\n"


def plot_tasks(result: dict, png) -> None:
    """Average accuracy vs context length per mode (the paper's Table 2 view), and the copy
    task's token accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for m in modes:
        avg = [np.mean([r["em"] for r in rows if r["mode"] == m and r["length"] == n and r["task"] != "copy"] or
                       [np.nan]) for n in lengths]
        cp = [next((r["em"] for r in rows if r["mode"] == m and r["length"] == n and r["task"] == "copy"), np.nan)
              for n in lengths]
        ax[0].plot(lengths, 100 * np.array(avg), marker="o", label=m)
        ax[1].plot(lengths, 100 * np.array(cp), marker="o", label=m)
    ax[0].set(title="synthetic tasks, average exact match", xlabel="context tokens", ylabel="%")
    ax[1].set(title="long-range copy, token accuracy", xlabel="context tokens", ylabel="%")
    for a in ax:
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
