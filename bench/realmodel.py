"""`sparda bench realmodel`: a real model through `generate`, as a user runs it, every system.

One row per (system, context, batch). The prompts are real text (`sparda_jax.text.haystack_tokens`
on the model's own tokenizer, one seeded document order per batch row), the same tokens for every
system; decoding is greedy with no stop token, so every row draws `new_tokens` tokens a sequence.
Each cell runs `generate` on the same shapes, cold then warm:

  cold   the first call: its prefill (compile included: cold_prefill_s), its first decode device
         call (the decode program's compile, the copy library's build on a CUDA GPU, and the call's
         `steps_per_call` steps: first_decode_s); first_call_s is their sum. Its later decode calls
         of full size give the steady rate (`infer.timing.DecodeTiming`): steady_tokens_per_s =
         batch x steady_steps / steady_s. Its `return_stats` counters give the offload systems'
         miss_rate = copied_blocks / selected_blocks and bytes_copied_per_token (`BYTES_FORMULA`).
  warm   WARM_REPEATS more calls on the same prompts, each stopped once the prompt's token is read:
         prefill_s, the steady prefill (nothing left to compile), is their median
         (prefill_s_samples: each; one sample of a ~0.05 s prefill moved 2x between runs).

Systems map to `generate`'s engine as `sparda generate --system` maps them (`api.system_kwargs`).
A prompt plus its new tokens must fit the model's positions: where `context` (padded to a
multiple of 64) + new_tokens does not, the prompt is shortened to the longest multiple of 64 that
fits, and the row says so. A failing cell becomes a row with its error; cells started after the
budget are recorded as skipped.

    sparda bench realmodel --out bench/results/realmodel/realmodel.json
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.api import Pretrained, prepare_modes, system_kwargs
from sparda_jax.bench.engine_state import block_bytes
from sparda_jax.bench.profile import TraceWindow, profile_calls, profile_lines
from sparda_jax.bench.timing import Budget, plot_and_print, pyplot_and_result, save_png, write_json
from sparda_jax.config import COPY_STARTS, Implementations
from sparda_jax.envinfo import environment
from sparda_jax.infer.engine import OFFLOAD_SYSTEMS, selector_of
from sparda_jax.infer.engine import SYSTEMS as ENGINE_SYSTEMS
from sparda_jax.infer.generate import PAD_MULTIPLE, SamplingConfig, generate, longest_prompt
from sparda_jax.infer.timing import StepTimer
from sparda_jax.text import haystack_tokens
from sparda_jax.bench import default_out

__all__ = ["SYSTEMS", "CONTEXTS", "BATCHES", "NEW_TOKENS", "WARM_REPEATS", "MAX_STEPS_PER_CALL", "BYTES_FORMULA",
           "DEFAULT_OUT", "default_steps_per_call", "prompt_length", "check_inputs", "make_prompts", "bench_realmodel",
           "claims", "table", "plot", "cli_first_token", "main"]

# every engine system, the claims' pair first: a budget that runs out skips the others
SYSTEMS = ("dense_resident", "sparda", "sparse_resident", "sparse", "sparda_sync", "infinigen")
CONTEXTS = (4096, 8192)  # SmolLM2: 8192 is its whole context, so that prompt is shortened
BATCHES = (1, 8)
NEW_TOKENS = 64
WARM_REPEATS = 3
DECODE_KERNELS = 1000  # a decode profile lists every kernel of the step: an inventory per layer
MAX_STEPS_PER_CALL = 8  # the decode claims' steps a program (docs/decisions.md, "n decode steps in one program")
DEFAULT_OUT = default_out("realmodel/realmodel.json")
BYTES_FORMULA = ("bytes_copied_per_token = copied_blocks x block_bytes / (decode steps x batch); block_bytes = "
                 "2 (K and V) x block_size x head_dim x itemsize(dtype): one KV head's block, the unit copied_blocks "
                 "counts (one per sequence, KV head and offloaded layer)")
LABELS = {"dense_resident": "Dense+", "sparse_resident": "Sparse+", "sparse": "Sparse", "infinigen": "InfiniGen",
          "sparda_sync": "SparDA-no-prefetch", "sparda": "SparDA"}
# issue 28's targets at 4K, batch 1: SparDA's steady decode at least half Dense+'s, every system's
# steady prefill within 1.5x of Dense+'s
DECODE_RATIO_TARGET = 0.5
PREFILL_RATIO_TARGET = 1.5


def default_steps_per_call(new_tokens: int, cap: int = MAX_STEPS_PER_CALL) -> int:
    """The largest k <= cap that splits the new_tokens - 1 decode steps (the first token comes from
    the prefill) into at least 3 calls of k: the first call and two steady ones, and no shorter
    last call (it would compile a program of its own). 1 when none does."""
    steps = new_tokens - 1
    return max([k for k in range(1, cap + 1) if steps % k == 0 and steps // k >= 3], default=1)


def prompt_length(context: int, new_tokens: int, max_positions: int) -> int:
    """The prompt tokens of a `context` row: context, or, where context (padded to a multiple of
    `PAD_MULTIPLE`) + new_tokens passes max_positions, the longest multiple of PAD_MULTIPLE that
    fits. Raises ValueError for a context past max_positions or no room for a prompt."""
    if context > max_positions:
        raise ValueError(f"context {context} exceeds the model's {max_positions} positions")
    if -(-context // PAD_MULTIPLE) * PAD_MULTIPLE + new_tokens <= max_positions:
        return context
    fit = longest_prompt(max_positions, new_tokens)
    if fit < 1:
        raise ValueError(f"new_tokens {new_tokens} leave no room for a prompt in {max_positions} positions")
    return fit


def check_inputs(config, *, systems, contexts, batches, new_tokens: int, steps_per_call: int | None) -> None:
    """Raise ValueError for what the run cannot do, before any work: an unknown or no system, a
    context < 1 or (with a config) past its positions, a batch < 1, new_tokens < 2 (no decode step
    to time), steps_per_call < 1. config None: the checks that need no model."""
    if not systems:
        raise ValueError("no systems given")
    unknown = [s for s in systems if s not in ENGINE_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {list(ENGINE_SYSTEMS)}")
    if not contexts or not batches:
        raise ValueError("no contexts or no batches given")
    for name, values in (("context", contexts), ("batch", batches)):
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"a {name} must be an integer >= 1, got {bad[0]!r}")
    if not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens must be an integer >= 2 (the first comes from the prefill), got {new_tokens!r}")
    if steps_per_call is not None and (not isinstance(steps_per_call, int) or steps_per_call < 1):
        raise ValueError(f"steps_per_call must be an integer >= 1, got {steps_per_call!r}")
    if config is not None:
        for c in contexts:
            try:
                prompt_length(c, new_tokens, config.max_position_embeddings)
            except ValueError as e:
                raise ValueError(f"{config.name}: {e}") from None


def make_prompts(encode, n_tokens: int, batch: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of exactly n_tokens tokens of real text, row i from seed + i."""
    return [haystack_tokens(encode, n_tokens, seed=seed + i) for i in range(batch)]


class _PrefillRead(Exception):
    """Stops the warm call once the prompt's token is read."""


def _stop_at_first_token(generated) -> None:
    raise _PrefillRead


def _copy_libraries() -> set[str]:
    from sparda_jax.kernels.kv_copy.cuda import library_cache_dir

    # the CUDA copy's builds (libsparda_gather_<source hash>.so), not its CPU twin's (libsparda_gather_host_*)
    return {p.name for p in library_cache_dir().glob("libsparda_gather_*.so") if not p.name.startswith(
        "libsparda_gather_host_")}


def _cell(model: Pretrained, prompts, system: str, extra: dict, new_tokens: int, k: int,
          profile_prefill: bool = False, implementations: Implementations = Implementations(),
          profile_decode: bool = False, copy_start: str = COPY_STARTS[0]) -> dict:
    """One (system, prompts) cell: the timing and traffic fields of a row (see the module doc);
    with profile_prefill, "prefill_profile": one more warm prefill traced (`bench.profile`); with
    profile_decode, "decode_profile": one more warm generate traced from the end of its first
    decode call to its last token (the steady steps only); implementations: the ops' backends in
    the system's engine; copy_start: its `EngineConfig.copy_start`."""
    kw = system_kwargs(extra, system)
    kw["engine"] = dataclasses.replace(kw["engine"], implementations=implementations, copy_start=copy_start)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)
    run = dict(dtype=model.dtype, steps_per_call=k, **kw)
    batch = len(prompts)
    libs = _copy_libraries()
    timer = StepTimer()
    timer.start()
    out, stats = generate(model.params, model.config, prompts, sampling, return_stats=True, on_step=timer, **run)
    cold = timer.timing(steps_per_call=k, max_new_tokens=new_tokens)
    stamps = [round(s - timer.t0, 7) for s in timer.stamps]
    built = bool(_copy_libraries() - libs)

    def prefill_only():
        warm = StepTimer(then=_stop_at_first_token)
        warm.start()
        try:
            generate(model.params, model.config, prompts, sampling, on_step=warm, **run)
            raise AssertionError("the warm call was not stopped at its first token")
        except _PrefillRead:
            return warm.stamps[0] - warm.t0

    warm_s = [prefill_only() for _ in range(WARM_REPEATS)]
    profile = None
    if profile_prefill:
        with tempfile.TemporaryDirectory() as d:
            profile = profile_calls(prefill_only, 1, Path(d) / "trace", keep_trace=False)
    decode_profile = None
    if profile_decode:
        with tempfile.TemporaryDirectory() as d:
            window, seen = TraceWindow(Path(d) / "trace", kernels=DECODE_KERNELS), []

            def open_after_first_call(_):
                seen.append(None)
                if len(seen) == k + 1:  # the prompt's token, then the first decode call's k
                    window.start()

            generate(model.params, model.config, prompts, sampling, on_step=open_after_first_call, **run)
            if window.started:
                decode_profile = window.stop(len(seen) - 1 - k)
    rate = cold.steady_tokens_per_s
    offload = system in OFFLOAD_SYSTEMS
    bb = block_bytes(model.config, model.dtype)
    tokens = stats["steps"] * batch
    r = {
        "steady_tokens_per_s": None if rate is None else rate * batch,
        "steady_steps": cold.steady_steps,
        "steady_s": cold.steady_s,
        "prefill_s": float(np.median(warm_s)),
        "prefill_s_samples": warm_s,
        "first_call_s": None if cold.first_decode_s is None else cold.prefill_s + cold.first_decode_s,
        "cold_prefill_s": cold.prefill_s,
        "first_decode_s": cold.first_decode_s,
        "first_call_steps": cold.first_call_steps,
        "total_s": cold.total_s,
        "generated_tokens": [len(o) for o in out],
        "decode_steps": stats["steps"],
        "stamps_s": stamps,
        "copied_blocks": stats["copied_blocks"] if offload else None,
        "selected_blocks": stats["selected_blocks"] if offload else None,
        "miss_rate": stats["copied_blocks"] / stats["selected_blocks"] if offload and stats["selected_blocks"]
        else None,
        "block_bytes": bb if offload else None,
        "bytes_copied_per_token": stats["copied_blocks"] * bb / tokens if offload and tokens else None,
    }
    if profile is not None:
        r["prefill_profile"] = profile
    if decode_profile is not None:
        r["decode_profile"] = decode_profile
    if offload:
        from sparda_jax.kernels.kv_copy import resolve_implementation

        r["kv_copy"] = resolve_implementation(kw["engine"].implementations.kv_copy)
        r["copy_library_built"] = built if r["kv_copy"] == "cuda" else None
    return r


_FIELDS = ("steady_tokens_per_s", "steady_steps", "steady_s", "prefill_s", "prefill_s_samples", "first_call_s",
           "cold_prefill_s", "first_decode_s", "first_call_steps", "total_s", "generated_tokens", "decode_steps",
           "stamps_s", "copied_blocks", "selected_blocks", "miss_rate", "block_bytes", "bytes_copied_per_token")


def _compilation_cache() -> dict:
    d = jax.config.jax_compilation_cache_dir
    on = bool(jax.config.jax_enable_compilation_cache and d)
    entries = None
    if on and Path(d).is_dir():
        entries = sum(1 for _ in Path(d).iterdir())
    return {"enabled": on, "dir": d if on else None, "entries_at_start": entries}


def bench_realmodel(model: Pretrained, *, systems=SYSTEMS, contexts=CONTEXTS, batches=BATCHES,
                    new_tokens: int = NEW_TOKENS, steps_per_call: int | None = None, seed: int = 0,
                    budget: Budget | None = None, out: str | Path | None = None, command: str | None = None,
                    log=None, progress: bool = True, profile_prefill: bool = False,
                    implementations: Implementations = Implementations(), profile_decode: bool = False,
                    copy_start: str = COPY_STARTS[0]) -> dict:
    """Run every (context, batch, system) cell, in that nesting order, and return the result dict
    (written to `out` after each cell when given): environment, config, compilation_cache,
    copy_libraries_at_start, definitions, rows (one per cell: system, context, prompt_tokens,
    batch, new_tokens, steps_per_call, status "ok" | "error" | "skipped", error or reason, and
    the module doc's fields, None where not measured), claims (`claims`), complete.
    steps_per_call None: `default_steps_per_call(new_tokens)`. profile_prefill: each row's
    "prefill_profile", the summary of one more warm prefill under the profiler (device busy time,
    top kernels, host events: `bench.profile.summarize_trace`); profile_decode: each row's
    "decode_profile", the same for the steady decode steps of one more warm generate, listing every
    kernel (`DECODE_KERNELS`).
    implementations: each op's backend in every cell (None fields: the op picks; in config);
    copy_start: the engine's `EngineConfig.copy_start` in every cell (in config).
    Raises ValueError (`check_inputs`) before any work; a cell's own failure is its row's error."""
    from tqdm import tqdm

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    if model.tokenizer is None:
        raise ValueError("the realmodel benchmark needs a model with a tokenizer (its prompts are real text)")
    systems, contexts, batches = tuple(systems), tuple(contexts), tuple(batches)
    check_inputs(model.config, systems=systems, contexts=contexts, batches=batches, new_tokens=new_tokens,
                 steps_per_call=steps_per_call)
    k = default_steps_per_call(new_tokens) if steps_per_call is None else steps_per_call
    budget = budget or Budget(None)
    c = model.config
    r = {"name": "realmodel", "complete": False, "environment": environment(), "command": command,
         "config": {"model": c.name, "dtype": jnp.dtype(model.dtype).name, "systems": list(systems),
                    "contexts": list(contexts), "batches": list(batches), "new_tokens": new_tokens,
                    "steps_per_call": k, "steps_per_call_default": steps_per_call is None, "seed": seed,
                    "budget_s": budget.seconds, "max_position_embeddings": c.max_position_embeddings,
                    "block_size": c.sparse.block_size, "topk": c.sparse.topk,
                    "dense_layers": list(c.sparse.dense_layers),
                    "implementations": dataclasses.asdict(implementations), "copy_start": copy_start},
         "compilation_cache": _compilation_cache(), "copy_libraries_at_start": sorted(_copy_libraries()),
         "definitions": {
             "steady_tokens_per_s": "tokens of all sequences per second over the full-size decode calls after the "
                                    "first (infer.timing.DecodeTiming): batch x steady_steps / steady_s",
             "prefill_s": f"the median of {WARM_REPEATS} more generates on the same prompts, each up to its first "
                          "token read (nothing compiles; an offload system moves the KV to the host after that "
                          "token, in its first decode call); prefill_s_samples: each",
             "first_call_s": "cold_prefill_s + first_decode_s: the first generate's prefill and its first decode "
                             "call (compiles, the copy library's build, first_call_steps steps)",
             "stamps_s": "the first generate's token reads, seconds from its start ([0]: the prompt's token)",
             "miss_rate": "copied_blocks / selected_blocks over the first generate's decode steps",
             "bytes_copied_per_token": BYTES_FORMULA,
             "copy_library_built": "a new copy library appeared in the library cache during the row (CUDA only)"},
         "rows": [], "claims": []}
    prompts_by_len: dict[int, list[list[int]]] = {}
    extra = None
    cells = [(t, b, s) for t in contexts for b in batches for s in systems]
    bar = tqdm(cells, desc="realmodel", unit="cell", file=sys.stderr, disable=not progress)
    for t, b, s in bar:
        bar.set_postfix_str(f"{s} T={t} B={b}")
        n = prompt_length(t, new_tokens, c.max_position_embeddings)
        row = {"system": s, "context": t, "prompt_tokens": n, "batch": b, "new_tokens": new_tokens,
               "steps_per_call": k, "status": "ok", "error": None, **dict.fromkeys(_FIELDS)}
        if n != t:
            row["note"] = (f"prompt shortened to {n} tokens: {n} + {new_tokens} new tokens fit {c.name}'s "
                           f"{c.max_position_embeddings} positions")
        if budget.exceeded():
            row.update(status="skipped", error=budget.reason().removeprefix("skipped: "))
        else:
            t0 = time.perf_counter()
            try:
                if extra is None:  # the Forecast, InfiniGen's calibration: once, for every system
                    extra = prepare_modes(model, [selector_of(x) for x in systems], seed=seed)
                    r["forecast_trained"] = extra["forecast_trained"] if "sparda" in {selector_of(x) for x in systems} \
                        else None
                if len(prompts_by_len.get(n, ())) < b:
                    prompts_by_len[n] = make_prompts(model.tokenizer.encode, n, max(batches), seed)
                row.update(_cell(model, prompts_by_len[n][:b], s, extra, new_tokens, k, profile_prefill,
                                 implementations, profile_decode, copy_start))
            except Exception as e:  # noqa: BLE001 - one failing cell must not stop the grid
                msg = str(e).splitlines()[0][:400] if str(e) else ""
                row.update(status="error", error=f"{type(e).__name__}: {msg}")
            row["cell_s"] = time.perf_counter() - t0
        r["rows"].append(row)
        log(_row_line(row))
        for line in profile_lines([row], label=lambda x: f"prefill {x['system']} T={x['context']} B={x['batch']}",
                                  key="prefill_profile"):
            log(line)
        for line in profile_lines([row], label=lambda x: f"decode {x['system']} T={x['context']} B={x['batch']}",
                                  key="decode_profile"):
            log(line)
        if out is not None:
            write_json(r, out)
    r["claims"] = claims(r["rows"])
    r["complete"] = True
    r["seconds"] = budget.elapsed()
    if out is not None:
        write_json(r, out)
    return r


def _g(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row_line(x: dict) -> str:
    head = f"[{x['system']} T={x['context']} B={x['batch']}]"
    if x["status"] != "ok":
        return f"{head} {x['status']}: {x['error']}"
    s = (f"{head} steady {_g(x['steady_tokens_per_s'], '.1f')} tok/s, prefill {_g(x['prefill_s'], '.3f')} s, "
         f"first call {_g(x['first_call_s'], '.2f')} s (cold prefill {_g(x['cold_prefill_s'], '.2f')} s + first "
         f"decode call {_g(x['first_decode_s'], '.2f')} s)")
    if x.get("miss_rate") is not None:
        s += f", miss rate {x['miss_rate']:.3f}, {x['bytes_copied_per_token'] / 1e3:.1f} kB copied per token"
    return s


def claims(rows: list[dict]) -> list[dict]:
    """Issue 28's targets at context 4096, batch 1 (where the rows hold them): SparDA / Dense+
    steady decode tokens/s (at least `DECODE_RATIO_TARGET`), and each other system's steady
    prefill seconds / Dense+'s (at most `PREFILL_RATIO_TARGET`)."""
    at = {x["system"]: x for x in rows if x["context"] == 4096 and x["batch"] == 1 and x["status"] == "ok"}
    dense = at.get("dense_resident")
    if dense is None:
        return []
    out = []
    sparda = at.get("sparda")
    if sparda and sparda["steady_tokens_per_s"] and dense["steady_tokens_per_s"]:
        v = sparda["steady_tokens_per_s"] / dense["steady_tokens_per_s"]
        out.append({"claim": "SparDA / Dense+ steady decode tokens/s, 4K batch 1 (at least)", "value": v,
                    "target": DECODE_RATIO_TARGET, "met": v >= DECODE_RATIO_TARGET})
    for s, x in at.items():
        if s != "dense_resident" and x["prefill_s"] and dense["prefill_s"]:
            v = x["prefill_s"] / dense["prefill_s"]
            out.append({"claim": f"{LABELS[s]} / Dense+ steady prefill seconds, 4K batch 1 (at most)", "value": v,
                        "target": PREFILL_RATIO_TARGET, "met": v <= PREFILL_RATIO_TARGET})
    return out


def table(r: dict) -> str:
    """The rows as a Markdown table, then the claims."""
    cols = ("system", "T", "prompt", "B", "k", "steady tok/s", "prefill s", "first call s", "cold prefill s",
            "first decode s", "miss rate", "kB copied/token", "status")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for x in r["rows"]:
        kb = None if x.get("bytes_copied_per_token") is None else x["bytes_copied_per_token"] / 1e3
        cells = (x["system"], x["context"], x["prompt_tokens"], x["batch"], x["steps_per_call"],
                 _g(x["steady_tokens_per_s"], ".1f"), _g(x["prefill_s"], ".3f"), _g(x["first_call_s"], ".2f"),
                 _g(x["cold_prefill_s"], ".2f"), _g(x["first_decode_s"], ".2f"), _g(x["miss_rate"], ".3f"),
                 _g(kb, ".1f"), x["status"] if x["status"] == "ok" else f"{x['status']}: {x['error'][:60]}")
        lines.append("| " + " | ".join(str(v) for v in cells) + " |")
    lines += [f"{cl['claim']}: {cl['value']:.2f} (target {cl['target']}, {'met' if cl['met'] else 'MISSED'})"
              for cl in r.get("claims", [])]
    return "\n".join(lines)


def plot(json_path) -> str | None:
    """Beside the JSON (same name, .png): steady decode tokens/s per system, bars grouped by
    (context, batch), log scale, Dense+'s value marked across each group; and the steady prefill
    seconds the same way."""
    plt, r = pyplot_and_result(json_path)
    if plt is None:
        return None
    systems = r["config"]["systems"]
    groups = list(dict.fromkeys((x["context"], x["batch"]) for x in r["rows"]))
    ok = {(x["context"], x["batch"], x["system"]): x for x in r["rows"] if x["status"] == "ok"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    w = 0.8 / max(len(systems), 1)
    for ax, key, ylabel in ((axes[0], "steady_tokens_per_s", "steady decode tokens/s (all sequences)"),
                            (axes[1], "prefill_s", "steady prefill seconds")):
        for j, s in enumerate(systems):
            xs, ys = [], []
            for i, (t, b) in enumerate(groups):
                v = ok.get((t, b, s), {}).get(key)
                if v:
                    xs.append(i - 0.4 + w * (j + 0.5))
                    ys.append(v)
            ax.bar(xs, ys, w, label=LABELS.get(s, s))
        label = "Dense+ (dense_resident)"
        for i, (t, b) in enumerate(groups):
            v = ok.get((t, b, "dense_resident"), {}).get(key)
            if v:
                ax.hlines(v, i - 0.45, i + 0.45, colors="k", linestyles="--", label=label)
                label = None  # one legend entry
        values = [x[key] for x in ok.values() if x.get(key)]
        if values:  # log bars rise from well below the smallest, so none reads as zero
            ax.set_ylim(min(values) / 3, max(values) * 2)
        ax.set_xticks(range(len(groups)), [f"T={t}\nB={b}" for t, b in groups])
        ax.set(yscale="log", ylabel=ylabel)
    env = r.get("environment") or {}
    axes[0].set_title(f"{r['config']['model']} {r['config']['dtype']}, {r['config']['new_tokens']} new tokens, "
                      f"{r['config']['steps_per_call']} steps a call", fontsize=9)
    axes[1].set_title(f"{env.get('device', '?')}, commit {(env.get('commit') or '?')[:7]}", fontsize=9)
    axes[1].legend(fontsize=7)
    return save_png(plt, fig, json_path)


def cli_first_token(model_name: str, prompt: str, *, systems=("dense_resident", "sparda"), dtype="bfloat16",
                    new_tokens: int = 32, implementation: tuple[str, ...] = (), program_store: bool = True,
                    log=print) -> list[dict]:
    """`sparda generate` as a user runs it, per system twice in fresh processes: "cold" with an
    empty compilation cache (and copy-library folder), then "warm" with the one the cold run
    filled. Per run: first_token_s (process start to the first generated text on stdout),
    total_s (to the process's exit), the exit code, and the lines it printed: the model's load,
    the timing and the first calls' split (trace, lower, compile, the rest). implementation:
    `generate --implementation` values (OP=NAME) for every run, also in each row. program_store:
    False runs the CLI with --no-program-store (XLA's cache alone), also in each row."""
    import os
    import subprocess
    import tempfile

    rows = []
    for system in systems:
        with tempfile.TemporaryDirectory(prefix="sparda-cold-") as cache:
            env = os.environ | {"SPARDA_JAX_CACHE_DIR": cache}
            for run in ("cold", "warm"):
                cmd = [sys.executable, "-m", "sparda_jax.cli", *([] if program_store else ["--no-program-store"]),
                       "generate", "--model", model_name, "--dtype", dtype,
                       "--system", system, "--raw", "--temperature", "0", "--max-new-tokens", str(new_tokens),
                       "--prompt", prompt] + (["--implementation", *implementation] if implementation else [])
                t0 = time.perf_counter()
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                first = p.stdout.read(1)
                t_first = time.perf_counter() - t0
                rest, err = p.communicate()
                total = time.perf_counter() - t0
                lines = err.decode(errors="replace").splitlines()
                last = lambda keep: next((l for l in reversed(lines) if keep(l)), None)
                row = {"system": system, "implementation": list(implementation), "program_store": program_store,
                       "run": run,
                       "first_token_s": round(t_first, 3) if first else None,
                       "total_s": round(total, 3), "returncode": p.returncode,
                       "load_line": last(lambda l: l.startswith("loaded ")),
                       "timing_line": last(lambda l: l.startswith("[") and not l.startswith("[first calls")),
                       "first_calls_line": last(lambda l: l.startswith("[first calls"))}
                if p.returncode:
                    row["error"] = err.decode(errors="replace")[-600:]
                rows.append(row)
                forced = "".join(f" {x}" for x in implementation) + ("" if program_store else " (no program store)")
                log(f"[realmodel] sparda generate --system {system}{forced} ({run}): first "
                    f"token {row['first_token_s']} s, exit {p.returncode} at {total:.1f} s\n  {row['first_calls_line']}")
    return rows


def main(args) -> int:
    """The `sparda bench realmodel` command: args.model, dtype, systems, contexts, batches,
    new_tokens, steps_per_call, budget_s, out."""
    from sparda_jax.api import load_pretrained

    budget = Budget(args.budget_s)  # from here: the model's load and the modes' preparation count too
    systems = tuple(args.systems or SYSTEMS)
    contexts, batches = tuple(args.contexts or CONTEXTS), tuple(args.batches or BATCHES)
    check_inputs(None, systems=systems, contexts=contexts, batches=batches, new_tokens=args.new_tokens,
                 steps_per_call=args.steps_per_call)
    if args.first_token:
        check_inputs(None, systems=tuple(args.first_token), contexts=contexts, batches=batches,
                     new_tokens=args.new_tokens, steps_per_call=args.steps_per_call)
    elif getattr(args, "first_token_implementation", None) or getattr(args, "first_token_without_store", False):
        raise ValueError("--first-token-implementation and --first-token-without-store rerun the --first-token "
                         "systems: give --first-token too")
    out = args.out or DEFAULT_OUT
    model = load_pretrained(args.model, dtype=getattr(jnp, args.dtype or "bfloat16"), progress=True)
    r = bench_realmodel(model, systems=systems, contexts=contexts, batches=batches, new_tokens=args.new_tokens,
                        steps_per_call=args.steps_per_call, budget=budget, out=out,
                        command="sparda " + " ".join(sys.argv[1:]), profile_prefill=args.profile_prefill,
                        profile_decode=args.profile_decode,
                        implementations=Implementations(**dict(args.implementation or ())),
                        copy_start=getattr(args, "copy_start", None) or COPY_STARTS[0])
    if args.first_token:
        # a prompt of the first context's length, as text (the CLI tokenizes it again)
        text = model.tokenizer.decode(make_prompts(model.tokenizer.encode, contexts[0] - args.new_tokens, 1)[0])
        runs = lambda impl, store=True: cli_first_token(args.model, text, systems=tuple(args.first_token),
                                                        dtype=args.dtype or "bfloat16", implementation=impl,
                                                        program_store=store)
        rows = runs(())
        if getattr(args, "first_token_without_store", False):  # the same runs with XLA's cache alone
            rows += runs((), store=False)
        if args.first_token_implementation:  # the same runs with these backends forced
            rows += runs(tuple(f"{op}={name}" for op, name in args.first_token_implementation))
        r["cli_first_token"] = {"prompt_chars": len(text), "context": contexts[0], "rows": rows}
        write_json(r, out)
    return plot_and_print(r, out, plot, table)
