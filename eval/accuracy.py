"""One harness, every mode: the synthetic tasks of `eval.tasks` at several context lengths.

Per (task, length, mode) cell, over the same samples:
  em     exact match: the share of expected strings found in the greedy answer
  ll     teacher-forced mean log-probability per token of the reference answer (more sensitive
         than exact match for a small model)
  copy   token accuracy and NLL of the repeated passage (teacher forced)
Every metric comes with a 95% interval over samples (normal approximation; samples are
independent draws). Modes see identical prompts; differences between modes are paired: each row
also keeps its per-sample values (sample i is the same prompt in every mode), and
`paired_differences` turns them into intervals on mode - reference that are far tighter than
the two unpaired intervals side by side.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from sparda_jax.api import Pretrained, mode_kwargs, prepare_modes
from sparda_jax.infer.generate import PAD_MULTIPLE, SamplingConfig, generate
from sparda_jax.modes import MODES, forward

from .heldout import budget_record
from .tasks import TASKS, make_sample

__all__ = ["eval_tasks", "max_task_length", "paired_differences", "tasks_markdown", "plot_tasks"]

# make_sample fits a haystack to within this many tokens of the asked length (eval.tasks._fit)
_FIT_SLACK = 8


def _ci(x: np.ndarray) -> float:
    return float(1.96 * x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else float("nan")


# Student t 0.975 quantiles for 1..30 degrees of freedom. scipy is not a dependency of the
# package (pyproject.toml), and at 20 samples the normal 1.96 would understate a paired interval
# by 7%; above 30 df the Cornish-Fisher expansion in _t975 is within 1e-7 of the exact value.
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
         2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
         2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)


def _t975(df: float) -> float:
    """Two-sided 95% Student t quantile. A fractional df (Welch-Satterthwaite) at or below 30 is
    rounded down: the quantile falls with df, so the interval errs wide."""
    if not df >= 1:
        return float("nan")
    if df <= len(_T975):
        return _T975[int(df) - 1]
    z = 1.959963984540054
    g = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
         (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


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


def max_task_length(config, max_new_tokens: int = 40) -> int:
    """The longest context whose prompts (up to _FIT_SLACK tokens over it, padded to a multiple
    of PAD_MULTIPLE) plus a max_new_tokens answer fit the model's positions: 8120 for SmolLM2's
    8192 at 40 new tokens."""
    room = config.max_position_embeddings - max_new_tokens
    return (room // PAD_MULTIPLE) * PAD_MULTIPLE - _FIT_SLACK


def eval_tasks(model: Pretrained, *, tasks=TASKS, lengths=(1024, 2048, 4096, 8064), samples: int = 20,
               modes=MODES, forecast=None, seed: int = 0, max_new_tokens: int = 40, progress: bool = True,
               on_row=None) -> dict:
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the task evaluation needs the model's tokenizer")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; expected one of {', '.join(TASKS)}")
    longest = max_task_length(model.config, max_new_tokens)
    if max(lengths) > longest:  # say so before building samples and compiling, not at the 8K cell
        raise ValueError(f"context length {max(lengths)} does not fit {model.config.max_position_embeddings} "
                         f"positions with a {max_new_tokens}-token answer (prompts are padded to a multiple of "
                         f"{PAD_MULTIPLE}); the longest allowed is {longest}")
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
                # seed: samples are make_sample(task, tok, length, seed + i), so rows of equal
                # (task, length, seed) hold the same prompts and can be paired, even across files
                row = {"task": task, "length": length, "mode": mode, "samples": samples, "seed": seed}
                if mode == "sparda":
                    row["mode"] = "sparda" if extra["forecast_trained"] else "sparda (untrained)"
                if task == "copy":
                    lps, hits = _teacher_forced(model, extra, mode, [s.prompt_ids for s in batch],
                                                [s.repeat for s in batch], tf_pad)
                    acc = np.array([h.mean() for h in hits])
                    nll = np.array([-x.mean() for x in lps])
                    row.update(em=float(acc.mean()), em_ci95=_ci(acc), copy_nll=float(nll.mean()),
                               copy_nll_ci95=_ci(nll), em_per_sample=[float(x) for x in acc],
                               copy_nll_per_sample=[float(x) for x in nll])
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
                               example=tok.decode(out[0])[:120], em_per_sample=[float(x) for x in em],
                               ll_per_sample=[float(x) for x in ll])
                row["seconds"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                bar.update(1)
                if on_row is not None:
                    on_row({"rows": rows})
    bar.close()
    sp = model.config.sparse
    return {"model": model.config.name, "rows": rows, "samples_per_cell": samples,
            "budget": budget_record(sp),
            "forecast_trained": extra["forecast_trained"],
            "text": "held-out quarter of the Python docs shipped with CPython (pydoc_data.topics)"}


def _per_sample(row: dict, metric: str) -> np.ndarray | None:
    """Per-sample values of "ll" (copy: -NLL of the repeat, so higher is better for every task)
    or "em"; None for rows written before they were kept."""
    if metric == "ll" and row["task"] == "copy":
        v = row.get("copy_nll_per_sample")
        return None if v is None else -np.asarray(v, np.float64)
    v = row.get(f"{metric}_per_sample")
    return None if v is None else np.asarray(v, np.float64)


def paired_differences(result: dict, reference: str = "sparse") -> list[dict]:
    """Mode - reference over the same samples, per (length, mode, task) and averaged over tasks.

    Per task: the mean of the per-sample differences d_i and a 95% Student t interval on them
    (n - 1 df), for "ll" (copy: -copy_nll) and "em" (copy: token accuracy). Cells lacking
    per-sample values in either mode, with different seeds (hence different prompts), unequal
    counts or fewer than 2 samples are left out.

    task "avg": the tasks hold different samples, so per-sample task averages cannot be paired;
    instead the mean of the per-task mean differences, whose variance is sum_t(s_t^2 / n_t) / T^2
    (tasks independent), with a t quantile at the Welch-Satterthwaite df. Averaged over the
    tasks paired at that (length, mode): "tasks" says how many.
    """
    rows = result["rows"]
    by = {(r["task"], r["length"], r["mode"]): r for r in rows}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if m != reference]
    out = []
    for length in sorted({r["length"] for r in rows}):
        for mode in modes:
            cells = []
            for task in tasks:
                r, ref = by.get((task, length, mode)), by.get((task, length, reference))
                if r is None or ref is None or r.get("seed") != ref.get("seed"):
                    continue
                cell, var = {"length": length, "mode": mode, "reference": reference, "task": task}, {}
                for metric in ("ll", "em"):
                    a, b = _per_sample(r, metric), _per_sample(ref, metric)
                    if a is None or b is None or len(a) != len(b) or len(a) < 2:
                        break
                    d = a - b
                    var[metric] = float(d.var(ddof=1)) / len(d)
                    cell[f"{metric}_diff"] = float(d.mean())
                    cell[f"{metric}_diff_ci95"] = _t975(len(d) - 1) * math.sqrt(var[metric])
                else:
                    cell["n"] = len(d)
                    cells.append((cell, var))
            if not cells:
                continue
            out.extend(c for c, _ in cells)
            avg = {"length": length, "mode": mode, "reference": reference, "task": "avg", "tasks": len(cells),
                   "n": sum(c["n"] for c, _ in cells)}
            for metric in ("ll", "em"):
                v = np.array([w[metric] for _, w in cells])
                dof = np.array([c["n"] - 1 for c, _ in cells])
                avg[f"{metric}_diff"] = float(np.mean([c[f"{metric}_diff"] for c, _ in cells]))
                # all-zero variances (every mode equal to the reference, e.g. a budget covering
                # the whole context) leave the df undefined but the interval is 0 then
                avg[f"{metric}_diff_ci95"] = (_t975(v.sum() ** 2 / (v**2 / dof).sum()) * math.sqrt(v.sum())
                                              / len(cells) if v.sum() > 0 else 0.0)
            out.append(avg)
    return out


def _excludes_zero(mean: float, half: float) -> bool:
    return not math.isnan(half) and abs(mean) > half


def _paired_markdown(diffs: list[dict], length: int, tasks: list[str], reference: str) -> list[str]:
    here = [d for d in diffs if d["length"] == length]
    if not here:
        return []
    by = {(d["mode"], d["task"]): d for d in here}
    modes = list(dict.fromkeys(d["mode"] for d in here))
    ns = sorted({d["n"] for d in here if d["task"] != "avg"})
    n = str(ns[0]) if len(ns) == 1 else f"{ns[0]} to {ns[-1]}"
    out = []
    for metric, what, scale, fmt in (
            ("ll", "answer log-likelihood per token (copy: -NLL of the repeat, higher is better)", 1, "+.3f"),
            ("em", "exact match in points (copy: token accuracy)", 100, "+.1f")):
        out.append(f"\n{length} tokens, paired difference vs {reference} (mode - {reference} on the same prompts), "
                   f"{what}: mean ± paired 95% interval (Student t), {n} samples per cell; bold where the "
                   f"interval excludes 0. avg: mean of the per-task differences, interval from their "
                   f"variances (tasks hold different samples)\n")
        out.append("| mode | " + " | ".join(tasks) + " | avg |")
        out.append("|---|" + "---|" * (len(tasks) + 1))
        for m in modes:
            cells = []
            for t in tasks + ["avg"]:
                d = by.get((m, t))
                if d is None:
                    cells.append("-")
                    continue
                mean, half = d[f"{metric}_diff"], d[f"{metric}_diff_ci95"]
                c = f"{scale * mean:{fmt}} ±{scale * half:{fmt[1:]}}"
                if t == "avg" and d["tasks"] < len(tasks):
                    c += f" ({d['tasks']} tasks)"
                cells.append(f"**{c}**" if _excludes_zero(mean, half) else c)
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def tasks_markdown(result: dict, reference: str = "sparse") -> str:
    """Per length: tasks x modes (exact match in %, copy token accuracy in %) with the
    average, then the same for the answer log-likelihood, then each mode's paired difference
    from the reference mode (rows lacking per-sample values are left out of it)."""
    rows = result["rows"]
    diffs = paired_differences(result, reference)
    # merged files (eval.report) carry no samples_per_cell of their own; the rows do
    spc = result.get("samples_per_cell")
    if spc is None:
        ns = sorted({r["samples"] for r in rows})
        spc = str(ns[0]) if len(ns) == 1 else f"{ns[0]} to {ns[-1]}"
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["task"], r["length"], r["mode"]): r for r in rows}
    out = []
    for length in sorted({r["length"] for r in rows}):
        out.append(f"\n**{length} tokens**, exact match % (copy: token accuracy %), ± 95% interval, "
                   f"{spc} samples per cell\n")
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
            avg = f"{100 * np.mean(vals):.1f}" if vals else "-"  # a run cut before any of its cells
            out.append(f"| {m} | " + " | ".join(cells) + f" | {avg} |")
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
        out.extend(_paired_markdown(diffs, length, tasks, reference))
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
    fig, ax = plt.subplots(1, 3, figsize=(15, 3.6))
    for m in modes:
        def avg(key):
            return [np.mean([r[key] for r in rows if r["mode"] == m and r["length"] == n and r["task"] != "copy"
                             and key in r] or [np.nan]) for n in lengths]
        cp = [next((r["em"] for r in rows if r["mode"] == m and r["length"] == n and r["task"] == "copy"), np.nan)
              for n in lengths]
        ax[0].plot(lengths, 100 * np.array(avg("em")), marker="o", label=m)
        # the small model's exact match sits near the floor; the answer's likelihood still moves
        ax[1].plot(lengths, avg("ll"), marker="o", label=m)
        ax[2].plot(lengths, 100 * np.array(cp), marker="o", label=m)
    ax[0].set(title="synthetic tasks, average exact match", xlabel="context tokens", ylabel="%")
    ax[1].set(title="synthetic tasks, answer log-likelihood", xlabel="context tokens", ylabel="nats / token")
    ax[2].set(title="long-range copy, token accuracy", xlabel="context tokens", ylabel="%")
    for a in ax:
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
