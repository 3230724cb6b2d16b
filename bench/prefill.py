"""`sparda bench prefill`: full-model prefill tokens/s (paper Table 3) for Dense+, Sparse and SparDA.

All KV stays on the device during prefill, as the paper does (the offload engine moves it to
the host afterwards, outside this measurement), so this measures projections, FFN, selection and
attention. Each system is `sparda_jax.modes.forward` with explicit implementations:
  dense_resident  mode "dense",  dense_attention "cudnn" (jax.nn.dot_product_attention, causal)
  sparse          mode "sparse", sparse_attention "mosaic_gpu" (the Mosaic block-sparse prefill kernel),
                  select "mosaic_gpu" (the Mosaic InfLLM-V2 selector, exact LSE)
  sparda          mode "sparda", sparse_attention and select "mosaic_gpu" (the Mosaic Forecast selector)
(fields of `Implementations`). A sparse variant whose kernels fail falls back to "xla", labelled. Called with return_kv=True, return_logits=False: the K/V every prefill must produce
are the output, and the LM head over all T tokens (f32 [B, T, vocab]: 154 GB at 4 x 128K) is not
computed; the last token's head is negligible.

Check before timing, per system: the same call at a short length (batch 1) against the XLA
reference implementations ("xla"): relative error of the last layer's
K and V, which depend on every earlier layer's attention.

Inputs: random tokens by default. Every position's query is then independent, so each token
selects nearly random blocks and a kernel tile of 4-8 tokens walks several times the selected
blocks (2.3x for tiles of 8 at 32K, attention/union_cpu_rho0.json; more at 128K, where there
are more blocks to choose from); real text selects nearly the same blocks for neighbours
(SmolLM2: 1.12-1.30x for tiles of 8, eval/results/tile_union_smollm2.json). `input_correlation`
rho > 0 gives the params an embedding table whose rows are AR(1) along the row index
(`engine_state.correlated_embedding`) and feeds tokens (offset_b + t) mod vocab, so the hidden
states are alike along positions, with the model code unchanged. Each sparse row reports the
tile union its selections really have (`_union`), so a reader sees which regime was timed.

    sparda bench prefill --out bench/results/prefill/prefill.json
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from sparda_jax.bench.engine_state import (BF16, bench_config, correlated_embedding, kwargs_for, make_extras,
                                           make_params)
from sparda_jax.bench.timing import plot_and_print, Budget, measure, rel_check, unavailable, write_json, claim_lines, pyplot_and_result, save_png
from sparda_jax.config import Implementations
from sparda_jax.envinfo import environment
from sparda_jax.infer.engine import selector_of
from sparda_jax.metrics import tile_blowup, tile_union
from sparda_jax.modes import forward
from sparda_jax.bench import default_out

__all__ = ["bench_prefill", "table", "plot", "SYSTEMS"]

SYSTEMS = ("sparse", "sparda", "dense_resident")  # the claims' pair first
LABELS = {"dense_resident": "Dense+", "sparse": "Sparse", "sparda": "SparDA"}
REL_BOUND = 2e-2  # bf16 rounding through one attention + FFN; a wrong mask or block is O(1)
TARGETS = {"sparse": 1.25, "dense_resident": 2.0}  # SparDA / Sparse, SparDA / Dense+ (paper 1.25, 2.11)
# Tiles of 4 tokens (the prefill kernel's, 64 // G at G = 16 heads per KV head) and of 8 (the
# tile of the SmolLM2 figure below)
UNION_TILES = (4, 8)
# The selections' union is measured at min(T, this), batch 1: at 32K, 96 of 512 blocks is the share
# SmolLM2's 24 of 128 had at 8K, so the numbers compare with its 1.12-1.30 directly, and one
# batch-1 32K forward per sparse system is cheap beside the timed 128K batch
UNION_LENGTH = 32768
REAL_TILE8_UNION = (1.12, 1.30)  # SmolLM2, real text, tiles of 8 (eval/results/tile_union_smollm2.json)


def _check_rho(rho: float) -> float:
    rho = float(rho)
    if not 0.0 <= rho < 1.0:  # also rejects NaN; rho = 1 would make every row the same
        raise ValueError(f"input_correlation must be in [0, 1), got {rho}")
    return rho


def _tokens(key, batch: int, t: int, vocab: int, rho: float):
    """rho = 0: random tokens (the benchmark as it always ran, same keys). rho > 0: each sequence
    counts up through the AR(1) rows of the table from its own random offset, so the 4 sequences
    differ; past `vocab` tokens a sequence wraps (one independent jump) and repeats its inputs."""
    if rho == 0.0:
        return jax.random.randint(key, (batch, t), 0, vocab, jnp.int32)
    off = jax.random.randint(key, (batch, 1), 0, vocab, jnp.int32)
    return (off + jnp.arange(t, dtype=jnp.int32)[None]) % vocab


def _inputs_text(rho: float, vocab: int) -> str:
    if rho == 0.0:
        return "random tokens"
    return (f"embedding rows AR(1) along the row index, row i = rho row(i-1) + sqrt(1 - rho^2) normal, rho = {rho}, "
            f"std 0.02, bf16 (engine_state.correlated_embedding); tokens (offset_b + t) mod {vocab}, a random "
            f"offset per sequence (past {vocab} tokens a sequence repeats itself): hidden states alike along "
            f"positions, as on real text")


def _impls(system: str, gpu: bool) -> dict:
    if selector_of(system) == "dense":
        return {"dense_attention": "cudnn" if gpu else "xla"}
    # the Mosaic selectors are the modes' default for prefill on Hopper; named here so the JSON
    # says which ran
    return {"sparse_attention": "mosaic_gpu" if gpu else "xla", "select": "mosaic_gpu" if gpu else "xla"}


def _call(params, cfg, extras, system, tokens, impls, sub_batch: int | None = None):
    """sub_batch < B: the batch goes through in B / sub_batch sequential slices inside one jit
    (the K/V come back [slices, L, sub_batch, ...]), for when the whole batch's activations do
    not fit; each 128K sequence alone keeps the GPU busy, so tokens/s is comparable."""
    kw = kwargs_for(extras, system)
    run = lambda t: forward(params, t, cfg, mode=selector_of(system), dtype=BF16, return_kv=True,
                            return_logits=False, implementations=Implementations(**impls), **kw)[1]
    b = tokens.shape[0]
    if sub_batch is None or sub_batch >= b:
        return run(tokens)
    return jax.jit(lambda t: jax.lax.map(run, t.reshape(b // sub_batch, sub_batch, -1)))(tokens)


def _finite(o) -> dict:
    return {"passed": bool(jnp.isfinite(o["k"]).all() and jnp.isfinite(o["v"]).all())}


def _check(params, cfg, extras, system, impls, t_check: int, seed: int, rho: float = 0.0) -> dict:
    tok = _tokens(jax.random.key(seed + 5), 1, t_check, cfg.vocab_size, rho)
    ref_impls = {k: "xla" for k in impls}
    got = _call(params, cfg, extras, system, tok, impls)
    ref = _call(params, cfg, extras, system, tok, ref_impls)
    ck, cv = rel_check(got["k"][-1], ref["k"][-1], REL_BOUND), rel_check(got["v"][-1], ref["v"][-1], REL_BOUND)
    return {"T": t_check, "batch": 1, "reference": ref_impls, "k_last_layer": ck, "v_last_layer": cv,
            "passed": bool(ck["passed"] and cv["passed"])}


def _union(params, cfg, extras, system, impls, t: int, seed: int, rho: float) -> dict:
    """How many blocks a prefill tile of 4 or 8 tokens walks over what one token selects, on this
    benchmark's own inputs: the same call as the timed one (batch 1) with collect_selection."""
    if t < cfg.sparse.dense_len:
        return {"T": t, "status": f"not measured: T < dense_len {cfg.sparse.dense_len} (dense attention)"}
    tok = _tokens(jax.random.key(seed + 7), 1, t, cfg.vocab_size, rho)
    _, aux = forward(params, tok, cfg, mode=selector_of(system), dtype=BF16, return_logits=False,
                     collect_selection=True, implementations=Implementations(**impls), **kwargs_for(extras, system))
    ids = aux["ids"]  # [L, B, K, T, topk]
    del aux
    last = ids[-1]
    per_layer = {str(tt): [float(tile_blowup(ids[i], tile=tt)) for i in range(ids.shape[0])] for tt in UNION_TILES}
    return {"T": t, "batch": 1, "layer": int(ids.shape[0]) - 1, "implementation": impls, "status": "ok",
            "selected_blocks_mean": float(jnp.mean(jnp.sum(last >= 0, axis=-1))),
            "union_mean_by_tile_tokens": {str(tt): float(jnp.mean(tile_union(last, tile=tt))) for tt in UNION_TILES},
            # the same statistic (and key) as eval.selection and bench attention report
            "tile_union_over_selected": {tt: v[-1] for tt, v in per_layer.items()},
            "tile_union_over_selected_mean_over_layers": {tt: sum(v) / len(v) for tt, v in per_layer.items()},
            "tile_union_over_selected_per_layer": per_layer}


def bench_prefill(preset: str = "minicpm4.1-8b", *, lengths=(131072, 65536, 32768), batch: int = 4,
                  systems=SYSTEMS, layers: int | None = 2, repeats: int = 3, max_s: float = 8.0,
                  budget_s: float | None = 130.0, check: bool = True, seed: int = 0, input_correlation: float = 0.0,
                  union_length: int | None = UNION_LENGTH, out=None, log=None) -> dict:
    """With `out`, the JSON is rewritten after every configuration ("complete": false until the end).
    input_correlation: rho of the AR(1) embedding rows (0: random tokens, see the module doc);
    union_length: the selections' tile union is measured at min(T, union_length), None: at T."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    rho = _check_rho(input_correlation)
    gpu = jax.default_backend() == "gpu"
    budget = Budget(budget_s)
    cfg, full = bench_config(preset, layers)
    params = make_params(cfg, seed)
    if rho > 0.0:
        params = {**params, "embed": {**params["embed"], "embedding": correlated_embedding(cfg, rho, seed)}}
    extras = make_extras(cfg, systems, seed)
    sp = cfg.sparse
    scale = full.num_layers / cfg.num_layers
    r = {"name": "prefill", "complete": False, "environment": environment(), "rows": [], "claims": [],
         "config": {"preset": preset, "batch": batch, "lengths": list(lengths), "systems": list(systems),
                    "layers_timed": cfg.num_layers, "scaled_to": full.num_layers,
                    "scaling": "seconds x scaled_to / layers_timed (embedding and LM head are not layers; the "
                               "head over all tokens is not computed)",
                    "repeats": repeats, "budget_s": budget_s, "dtype": "bfloat16",
                    "weights": "random (init_params, std 0.02), bf16; Forecast random (untrained), bf16",
                    "implementations": {s: _impls(s, gpu) for s in systems},
                    "selection": "sparda_jax.select via modes with Implementations.select (see implementations): "
                                 "select_blocks_infllmv2 (exact LSE) for Sparse, select_blocks_forecast for SparDA",
                    "kv_placement": "all KV on the device during prefill (as the paper); no host offload timed",
                    "output": "forward(return_kv=True, return_logits=False): every layer's K/V",
                    "check": f"same call at a short length, batch 1, vs the 'xla' implementations': rel err of the "
                             f"last layer's K and V <= {REL_BOUND}",
                    "inputs": _inputs_text(rho, cfg.vocab_size), "input_correlation": rho,
                    "selection_union": f"per sparse row: forward(collect_selection=True) with the row's inputs "
                                       f"scheme and implementations at T = "
                                       f"{'the row T' if union_length is None else f'min(row T, {union_length})'}, batch 1; "
                                       f"for the last layer (also the mean over layers, as eval.selection reports "
                                       f"SmolLM2's), the mean over tiles of {' and '.join(map(str, UNION_TILES))} "
                                       f"tokens (4: the prefill kernel's tile at G = 16) of the union of their "
                                       f"blocks over one token's selected count (sparda_jax.metrics.tile_blowup); "
                                       f"SmolLM2 on real text: {REAL_TILE8_UNION[0]}-{REAL_TILE8_UNION[1]} for "
                                       f"tiles of 8"}}

    def snapshot():
        r["elapsed_s"] = budget.elapsed()
        if out:
            write_json(r, out)

    snapshot()
    checks, unions = {}, {}
    for t in lengths:
        toks = _tokens(jax.random.key(seed + t), batch, t, cfg.vocab_size, rho)
        for system in systems:
            rec = {"system": LABELS.get(system, system), "mode": system, "T": t, "batch": batch}
            if budget.exceeded():
                rec["status"] = budget.reason()
                r["rows"].append(rec)
                continue
            impls = _impls(system, gpu)
            tried = [impls]
            if "sparse_attention" in impls and impls["sparse_attention"] != "xla":
                tried.append({"sparse_attention": "xla", "select": "xla"})
            for impls in tried:
                rec = {"system": LABELS.get(system, system), "mode": system, "T": t, "batch": batch,
                       "implementation": impls, "fallback": impls is not tried[0]}
                try:
                    key = (system, tuple(impls.items()))
                    if check and key not in checks:
                        t_check = min(t, max(2 * sp.dense_len, 2 * sp.topk * sp.block_size))
                        checks[key] = _check(params, cfg, extras, system, impls, t_check, seed, rho)
                    chk = checks.get(key, {"passed": True, "note": "not checked"})
                except Exception as e:  # noqa: BLE001 - kernel missing or failing: try the next impl
                    rec["status"] = unavailable(e)
                    r["rows"].append(rec)
                    snapshot()
                    continue
                # the whole batch first; out of memory, halves of it in sequence (said in the row)
                for sub in _sub_batches(batch):
                    m = measure(lambda impls=impls, sub=sub: _call(params, cfg, extras, system, toks, impls, sub),
                                _finite, repeats=repeats, max_s=max_s)
                    if "RESOURCE_EXHAUSTED" not in m["status"] or budget.exceeded():
                        break
                    rec.setdefault("out_of_memory", []).append({"sub_batch": sub, "status": m["status"]})
                rec.update(m)
                rec["sub_batch"] = sub
                rec["check"] = {"small": chk, "finite": m.get("check")}
                if "seconds" in rec:
                    rec["status"] = "ok" if chk["passed"] and m.get("check", {}).get("passed") else "check_failed"
                    rec["seconds_scaled"] = rec["seconds"] * scale
                    rec["tokens_per_s"] = batch * t / rec["seconds_scaled"]
                    rec["tokens_per_s_timed_layers"] = batch * t / rec["seconds"]
                if "seconds" in rec and "sparse_attention" in impls:
                    # after the timing: a failure here costs the row its union, not its time
                    t_u = t if union_length is None else min(t, union_length)
                    ukey = key + (t_u,)
                    if ukey not in unions:
                        try:
                            unions[ukey] = _union(params, cfg, extras, system, impls, t_u, seed, rho)
                        except Exception as e:  # noqa: BLE001 - e.g. out of memory
                            unions[ukey] = {"T": t_u, "status": unavailable(e)}
                    rec["selection_union"] = unions[ukey]
                r["rows"].append(rec)
                snapshot()
                log(f"[prefill] {system} T={t} {impls}: {rec['status'][:70]} {rec.get('tokens_per_s', 0):.0f} tok/s "
                    f"at {budget.elapsed():.0f} s")
                if rec["status"] in ("ok", "check_failed"):
                    break
        del toks
    ok = {(x["mode"], x["T"]): x for x in r["rows"] if x.get("status") == "ok"}
    for t in sorted({x["T"] for x in r["rows"]}, reverse=True):
        if ("sparda", t) not in ok:
            continue
        for other, target in TARGETS.items():
            if (other, t) in ok:
                v = ok[("sparda", t)]["tokens_per_s"] / ok[(other, t)]["tokens_per_s"]
                r["claims"].append({"claim": f"prefill T={t} B={batch}: SparDA / {LABELS[other]} tokens/s", "value": v,
                                    "target": target, "met": bool(v >= target)})
    r["complete"] = True
    snapshot()
    return r


def _sub_batches(batch: int):
    sub = batch
    while sub >= 1:
        yield sub
        if sub % 2:
            return
        sub //= 2


def table(r: dict) -> str:
    lines = ["| system | T | B | impl | tok/s | s (scaled) [min-max] | check |", "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        impl = ",".join(f"{v}" for v in x.get("implementation", {}).values()) + (" (fallback)" if x.get("fallback") else "")
        if x.get("sub_batch", x["batch"]) < x["batch"]:
            impl += f", {x['batch'] // x['sub_batch']} slices of {x['sub_batch']}"
        if "tokens_per_s" not in x:
            lines.append(f"| {x['system']} | {x['T']} | {x['batch']} | {impl} | {x.get('status', '')[:70]} | | |")
            continue
        s = r["config"]["scaled_to"] / r["config"]["layers_timed"]
        lines.append(f"| {x['system']} | {x['T']} | {x['batch']} | {impl} | {x['tokens_per_s']:.0f} | "
                     f"{x['seconds_scaled']:.2f} [{x['seconds_min'] * s:.2f}-{x['seconds_max'] * s:.2f}] | "
                     f"{'ok' if x['status'] == 'ok' else 'FAIL'} |")
    for x in r["rows"]:
        u = x.get("selection_union", {})
        if u.get("status") == "ok":
            lines.append(f"{x['system']} T={x['T']}: tile union / selected (last layer, measured at T={u['T']}) "
                         + ", ".join(f"{v:.2f} ({tt} tokens)" for tt, v in u["tile_union_over_selected"].items()))
    lines += claim_lines(r)
    c = r["config"]
    rho = c.get("input_correlation", 0.0)
    lines.append(f"{c['layers_timed']} of {c['scaled_to']} layers timed, scaled; implementations per row; inputs: "
                 + (f"AR(1) embedding rows, rho {rho}" if rho else "random tokens"))
    return "\n".join(lines)


def plot(json_path) -> str | None:
    plt, r = pyplot_and_result(json_path)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in SYSTEMS:
        pts = sorted((x["T"], x["tokens_per_s"]) for x in r["rows"] if x["mode"] == m and x.get("status") == "ok")
        if pts:
            ax.plot(*zip(*pts), "o-", label=LABELS[m])
    ax.set(xscale="log", xlabel="context T", ylabel="tokens/s (scaled to full model)",
           title=f"prefill, batch {r['config']['batch']}")
    ax.legend(fontsize=8)
    return save_png(plt, fig, json_path)


def main(args) -> int:
    out = args.out or default_out("prefill/prefill.json")
    b = (args.batches or [args.batch or 4])[0]
    r = bench_prefill(args.preset, lengths=tuple(args.lengths or (131072, 65536, 32768)), batch=b,
                      systems=tuple(args.systems or SYSTEMS), layers=args.layers or 2, repeats=args.repeats,
                      budget_s=args.budget_s if args.budget_s is not None else 130.0,
                      input_correlation=args.input_correlation, out=out)
    return plot_and_print(r, out, plot, table)
