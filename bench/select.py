"""`sparda bench select`: block selection time per layer, InfLLM-V2 selector vs Forecast selector
(paper Fig. 3, green), in prefill (every query of the sequence) and decode (one query per
sequence), each beside the sparse attention time of the same layer, measured in the same run.

Variants (each CHECKED against the jnp selector in f32 at highest matmul precision before it is
timed: fraction of identical ids on a slice of rows; a failed check keeps its time, flagged, and
is left out of "best"):
  forecast_xla         select_blocks_forecast(..., implementation="xla")
  forecast_mosaic_gpu  select_blocks_forecast(..., implementation="mosaic_gpu")
  infllmv2_xla         select_blocks_infllmv2(..., implementation="xla") (exact LSE)
  infllmv2_mosaic_gpu  select_blocks_infllmv2(..., implementation="mosaic_gpu")
(Runs before the names took the implementation's spelling call the last two forecast_mosaic and
infllmv2_mosaic.)
A backend that cannot run here (no Hopper GPU) or fails to compile records why.

Prefill: every variant runs on the same query slice (runs of 512 consecutive queries spread
evenly over the sequence) and is scaled by T / timed_queries to a per-layer time. Decode: `steps`
layers inside one jit (lax.map), each with its own compressed keys, so dispatch overhead and L2
reuse between layers do not flatter a ~10 us selector.

    sparda bench select --out bench/results/select/select.json
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.bench.attention import decode_case, model_shape, prefill_case, _shape_json
from sparda_jax.bench.timing import plot_and_print, Budget, ceilings, measure, query_slice, unavailable, write_json, claim_lines, pyplot_and_result, save_png
from sparda_jax.compress import compress_keys, num_chunks
from sparda_jax.envinfo import environment
from sparda_jax.select import select_blocks_forecast, select_blocks_infllmv2
from sparda_jax.bench import default_out

__all__ = ["bench_select", "selector", "id_check", "plot", "table"]

# kernels under test last: a fault that kills the process loses only them (JSON snapshots)
VARIANTS = ("forecast_xla", "infllmv2_xla", "forecast_mosaic_gpu", "infllmv2_mosaic_gpu")
# variant name -> (family, selector, implementation)
_SELECTORS = {
    "forecast_xla": ("forecast", select_blocks_forecast, "xla"),
    "infllmv2_xla": ("infllmv2", select_blocks_infllmv2, "xla"),
    "forecast_mosaic_gpu": ("forecast", select_blocks_forecast, "mosaic_gpu"),
    "infllmv2_mosaic_gpu": ("infllmv2", select_blocks_infllmv2, "mosaic_gpu"),
}
# Reduced precision only swaps near-tied blocks at the top-k boundary (a few ids in a thousand);
# a wrong mask or pooling keeps little more than the 34 forced blocks of 96 (agreement ~0.4).
AGREEMENT_BOUND = 0.95
SPEEDUP_TARGET = 2.5      # InfLLM-V2 time / Forecast time at 128K
SEL_OVER_ATTN_TARGET = 0.25
BF16 = jnp.bfloat16


def selector(name: str, sparse, n_blocks: int):
    """(family, fn(x, kc, positions) -> ids) for a variant name; x is f for Forecast, q for InfLLM-V2."""
    # the implementation is always named: the selectors' default picks the Mosaic kernels for
    # prefill on Hopper, so an "xla" row would time the kernels a second time
    if name not in _SELECTORS:
        raise ValueError(f"unknown selection variant {name!r}; one of {tuple(_SELECTORS)}")
    fam, fn, impl = _SELECTORS[name]
    return fam, functools.partial(fn, sparse=sparse, n_blocks=n_blocks, implementation=impl)


def id_check(ids, ref, bound: float = AGREEMENT_BOUND) -> dict:
    """ids, ref int [..., topk] (ascending, -1 padded): mean over rows of |ids & ref| / |ref|."""
    a = np.asarray(ids).reshape(-1, np.shape(ids)[-1])
    r = np.asarray(ref).reshape(-1, np.shape(ref)[-1])
    if a.shape != r.shape:
        return {"passed": False, "error": f"shape {a.shape} vs reference {r.shape}"}
    agree = []
    for x, y in zip(a, r):
        ys = set(y[y >= 0].tolist())
        xs = set(x[x >= 0].tolist())
        agree.append(len(xs & ys) / max(len(ys), 1) if len(xs) == len(ys) else
                     len(xs & ys) / max(len(xs | ys), 1))
    agreement = float(np.mean(agree))
    return {"id_agreement": agreement, "rows_identical": float(np.mean(np.all(a == r, axis=-1))),
            "rows": int(a.shape[0]), "bound": bound, "passed": bool(agreement >= bound)}


def _kc(key, b, t, kh, d, sparse):
    k = jax.random.normal(key, (b, t, kh, d), BF16)
    return compress_keys(k, sparse.kernel_size, sparse.kernel_stride)


def _floors(family, *, queries, visible_chunks, b, nc, h, kh, d, topk, ceil):
    """Matmul and byte floors of one selection call. queries: how many (b, t) rows; visible_chunks:
    summed over them (causal: what a kernel that skips masked tiles must compute)."""
    heads = h if family == "infllmv2" else kh
    flops = 2.0 * d * heads * visible_chunks
    nbytes = 2.0 * queries * heads * d + 2.0 * b * nc * kh * d + 4.0 * queries * kh * topk
    t_mm = flops / (ceil["matmul_tflops"] * 1e12)
    t_bw = nbytes / (ceil["hbm_gb_per_s"] * 1e9)
    return {"flops": flops, "bytes": nbytes, "floor_seconds": max(t_mm, t_bw),
            "floor_bound": "matmul" if t_mm >= t_bw else "bandwidth"}


def _best(vs: dict, family: str):
    ok = [(n, v) for n, v in vs.items() if v.get("family") == family and v.get("status") == "ok"]
    return min(ok, key=lambda nv: nv[1]["seconds_layer"])[0] if ok else None


def _summary(res: dict, attn_s: float | None, attn_name, attn_floor_s: float | None = None):
    vs = res["variants"]
    fb, ib = _best(vs, "forecast"), _best(vs, "infllmv2")
    res.update(best_forecast=fb, best_infllmv2=ib, attention_seconds_layer=attn_s, attention_variant=attn_name,
               attention_floor_seconds=attn_floor_s)
    if fb and ib:
        res["speedup_forecast"] = vs[ib]["seconds_layer"] / vs[fb]["seconds_layer"]
        # what the speedup would be with both selectors at their floors (the work ratio)
        res["speedup_at_floors"] = vs[ib]["floor_seconds"] / vs[fb]["floor_seconds"]
    if fb and attn_s:
        res["forecast_over_attention"] = vs[fb]["seconds_layer"] / attn_s
    if fb and attn_floor_s:
        # the ratio with both kernels at their floors: in decode both are bound by bytes, and the
        # selector reads every compressed key while attention reads only the selected blocks
        # (a prefill row's floor is its timed slice's: scaled like its seconds)
        res["forecast_over_attention_at_floors"] = vs[fb]["floor_seconds"] * vs[fb].get("scale", 1.0) / attn_floor_s
    if ib and attn_s:
        res["infllmv2_over_attention"] = vs[ib]["seconds_layer"] / attn_s


def _attention_time(case: dict):
    best = case.get("best_sparse")
    if best is None:
        return None, None, None
    v = case["variants"][best]
    floor = v.get("floor_seconds")  # of the timed slice in prefill: scaled like seconds_layer
    return v["seconds_layer"], best, None if floor is None else floor * v.get("scale", 1.0)


def prefill_select_case(t, b, shape, ceil, *, variants, repeats, timed_queries, max_s, budget, seed=0,
                        check_rows=64, out_rec=None, snapshot=None):
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    nb = -(-t // sp.block_size)
    kk, kq, kf = jax.random.split(jax.random.key(seed * 7919 + t + b + 2), 3)
    kc = _kc(kk, b, t, kh, d, sp)
    nc = kc.shape[1]
    sl = query_slice(t, timed_queries)
    n = len(sl)
    pos = jnp.broadcast_to(jnp.asarray(sl), (b, n))
    x = {"infllmv2": jax.random.normal(kq, (b, n, h, d), BF16), "forecast": jax.random.normal(kf, (b, n, kh, d), BF16)}
    mid = n // 2
    rows = jnp.asarray(np.unique(np.r_[np.arange(n - check_rows, n), np.arange(mid, min(n, mid + check_rows))]
                                 .clip(0, n - 1)))
    # chunks visible to each timed query (chunk c complete iff c*s + l - 1 <= p)
    vis = float(np.maximum((sl.astype(np.int64) + 1 - sp.kernel_size) // sp.kernel_stride + 1, 0).sum()) * b
    refs = {}

    def ref(family):
        if family not in refs:
            f = select_blocks_forecast if family == "forecast" else select_blocks_infllmv2
            with jax.default_matmul_precision("highest"):
                refs[family] = np.asarray(jax.jit(functools.partial(f, sparse=sp, n_blocks=nb))(
                    x[family][:1, rows].astype(jnp.float32), kc[:1].astype(jnp.float32), pos[:1, rows]))
        return refs[family]

    out = {} if out_rec is None else out_rec
    snapshot = snapshot or (lambda: None)
    for name in variants:
        if budget.exceeded():
            out[name] = {"status": budget.reason()}
            continue
        try:
            fam, fn = selector(name, sp, nb)
            fn = jax.jit(fn)
            r = ref(fam)
        except Exception as e:  # noqa: BLE001 - a missing kernel module lands here
            out[name] = {"status": unavailable(e)}
            continue
        xf = x[fam]
        rec = measure(lambda fn=fn, xf=xf: fn(xf, kc, pos), lambda o, r=r: id_check(o[:1, :, rows], r),
                      repeats=repeats, max_s=max_s)
        rec.update(family=fam, timed_queries=n, scaled=n < t, scale=t / n)
        rec.update(_floors(fam, queries=b * n, visible_chunks=vis, b=b, nc=nc, h=h, kh=kh, d=d, topk=sp.topk, ceil=ceil))
        if "seconds" in rec:
            rec["seconds_layer"] = rec["seconds"] * t / n
            rec["achieved_over_floor"] = rec["floor_seconds"] / rec["seconds"]
        out[name] = rec
        snapshot()
    return {"phase": "prefill", "T": t, "batch": b, "n_chunks": nc, "n_blocks": nb, "variants": out}


def decode_select_case(t, b, shape, ceil, *, variants, repeats, steps, max_s, budget, seed=0, out_rec=None,
                       snapshot=None):
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    nb = -(-t // sp.block_size)
    keys = jax.random.split(jax.random.key(seed * 7919 + t + 5 * b + 3), steps + 2)
    # one layer's compressed keys per step: a real decode step scores another layer's keys
    kc = jnp.stack([_kc(keys[i], b, t, kh, d, sp) for i in range(steps)])  # [steps, b, nc, kh, d]
    nc = kc.shape[2]
    pos = jnp.full((steps, b, 1), t - 1, jnp.int32)
    x = {"infllmv2": jax.random.normal(keys[-2], (steps, b, 1, h, d), BF16),
         "forecast": jax.random.normal(keys[-1], (steps, b, 1, kh, d), BF16)}
    refs = {}

    def ref(family):
        if family not in refs:
            f = select_blocks_forecast if family == "forecast" else select_blocks_infllmv2
            with jax.default_matmul_precision("highest"):
                refs[family] = np.asarray(jax.jit(functools.partial(f, sparse=sp, n_blocks=nb))(
                    x[family][0].astype(jnp.float32), kc[0].astype(jnp.float32), pos[0]))
        return refs[family]

    out = {} if out_rec is None else out_rec
    snapshot = snapshot or (lambda: None)
    for name in variants:
        if budget.exceeded():
            out[name] = {"status": budget.reason()}
            continue
        try:
            fam, fn = selector(name, sp, nb)
            r = ref(fam)
        except Exception as e:  # noqa: BLE001
            out[name] = {"status": unavailable(e)}
            continue
        looped = _looped(fn)
        xf = x[fam]
        rec = measure(lambda looped=looped, xf=xf: looped(xf, kc, pos), lambda o, r=r: id_check(o[0], r),
                      repeats=repeats, max_s=max_s)
        rec.update(family=fam, steps_per_call=steps)
        rec.update(_floors(fam, queries=b, visible_chunks=float(b * num_chunks(t, sp.kernel_size, sp.kernel_stride)),
                           b=b, nc=nc, h=h, kh=kh, d=d, topk=sp.topk, ceil=ceil))
        if "seconds" in rec:
            rec["seconds_layer"] = rec["seconds"] / steps
            rec["achieved_over_floor"] = rec["floor_seconds"] / rec["seconds_layer"]
        out[name] = rec
        snapshot()
    return {"phase": "decode", "T": t, "batch": b, "steps": steps, "n_chunks": nc, "n_blocks": nb, "variants": out}


def _looped(fn):
    return jax.jit(lambda x, kc, pos: jax.lax.map(lambda a: fn(*a), (x, kc, pos)))


def bench_select(preset: str = "minicpm4.1-8b", *, lengths=(32768, 65536, 131072), batch: int = 4,
                 decode_batches=(4,), repeats: int = 3, variants=None, timed_queries: int = 8192,
                 attention_timed_queries: int = 2048, decode_steps: int = 8, budget_s: float | None = 140.0,
                 max_s: float = 3.0, matmul_n: int = 8192, copy_mib: int = 2048, seed: int = 0,
                 with_attention: bool = True, prefill: bool = True, decode: bool = True, out=None, log=None) -> dict:
    """With `out`, the JSON is rewritten after every variant ("complete": false until the end).
    prefill / decode: run that phase's cases."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    shape = model_shape(preset)
    variants = tuple(variants or VARIANTS)
    budget = Budget(budget_s)
    ceil = ceilings(matmul_n=matmul_n, copy_mib=copy_mib)
    log(f"[select] ceilings: {ceil['matmul_tflops']:.0f} TFLOP/s bf16, {ceil['hbm_gb_per_s']:.0f} GB/s")
    config = {**_shape_json(shape), "lengths": list(lengths), "batch": batch, "decode_batches": list(decode_batches),
              "repeats": repeats, "max_seconds_per_variant": max_s, "variants": list(variants),
              "timed_queries": timed_queries, "attention_timed_queries": attention_timed_queries,
              "decode_steps_per_call": decode_steps, "budget_s": budget_s, "dtype": "bfloat16",
              "phases": [ph for ph, on in (("prefill", prefill), ("decode", decode)) if on],
              "inputs": "random bf16 q / Forecast; kc = compress_keys of random bf16 keys (a fresh one per "
                        "decode step: each step stands for another layer)",
              "check": f"ids vs the jnp selector (f32, highest precision) on batch element 0: mean "
                       f"|ids & ref| / |ref| >= {AGREEMENT_BOUND}",
              "scaling": "prefill: every variant on the same query slice (runs of 512 spread evenly), "
                         "seconds_layer = seconds * T / timed_queries; decode: seconds / steps",
              "floors": "max(matmul FLOPs over visible chunks / bf16 matmul rate, bytes / copy bandwidth); "
                        "softmax exponentials of InfLLM-V2 are not in the floor",
              "attention": "sparse attention of the same layer: best checked of mosaic_gpu (prefill: ws and simple) and xla "
                           "(bench/attention.py prefill_case / decode_case)"}
    r = {"name": "select", "complete": False, "environment": environment(), "config": config, "ceilings": ceil,
         "cases": [], "skipped": [], "claims": []}
    attn_kw = dict(repeats=repeats, max_s=max_s, budget=budget, seed=seed)

    def snapshot():
        r["elapsed_s"] = budget.elapsed()
        if out:
            write_json(r, out)

    def run(phase, t, b, fn, attn_fn, **kw):
        if budget.exceeded():
            r["skipped"].append({"phase": phase, "T": t, "batch": b, "reason": budget.reason()})
            return
        holder = {"phase": phase, "T": t, "batch": b, "incomplete": True, "variants": {}}
        r["cases"].append(holder)
        try:
            c = fn(t, b, shape, ceil, variants=variants, repeats=repeats, max_s=max_s, budget=budget, seed=seed,
                   out_rec=holder["variants"], snapshot=snapshot, **kw)
            r["cases"][-1] = c
            attn = attn_fn(t, b) if with_attention and not budget.exceeded() else {}
            _summary(c, *_attention_time(attn))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory making the inputs
            r["skipped"].append({"phase": phase, "T": t, "batch": b, "reason": unavailable(e)})
        snapshot()
        log(f"[select] {phase} T={t} B={b} done at {budget.elapsed():.0f} s")

    for t in lengths if prefill else ():
        run("prefill", t, batch, prefill_select_case,
            lambda t, b: prefill_case(t, b, shape, ceil, variants=("xla", "mosaic_gpu"),
                                      timed_queries=attention_timed_queries, **attn_kw),
            timed_queries=timed_queries)
    for t in lengths if decode else ():
        for b in decode_batches:
            run("decode", t, b, decode_select_case,
                lambda t, b: decode_case(t, b, shape, ceil, variants=("xla", "mosaic_gpu"), steps=decode_steps,
                                         **attn_kw),
                steps=decode_steps)
    for ph in ("prefill", "decode"):
        cs = [c for c in r["cases"] if c["phase"] == ph and "speedup_forecast" in c]
        if cs:
            c = max(cs, key=lambda c: (c["T"], c["batch"]))  # the paper's claim is at the longest context
            fb, ib = c["variants"][c["best_forecast"]], c["variants"][c["best_infllmv2"]]
            r["claims"].append({"claim": f"{ph} T={c['T']} B={c['batch']}: InfLLM-V2 time / Forecast time",
                                "value": c["speedup_forecast"], "target": SPEEDUP_TARGET,
                                "met": bool(c["speedup_forecast"] >= SPEEDUP_TARGET),
                                "forecast": c["best_forecast"], "infllmv2": c["best_infllmv2"],
                                "speedup_at_floors": c["speedup_at_floors"],
                                "forecast_achieved_over_floor": fb.get("achieved_over_floor"),
                                "infllmv2_achieved_over_floor": ib.get("achieved_over_floor")})
        for c in (c for c in r["cases"] if c["phase"] == ph and "forecast_over_attention" in c):
            r["claims"].append({"claim": f"{ph} T={c['T']} B={c['batch']}: Forecast selection / sparse attention time",
                                "value": c["forecast_over_attention"], "target": SEL_OVER_ATTN_TARGET,
                                "met": bool(c["forecast_over_attention"] <= SEL_OVER_ATTN_TARGET),
                                "forecast": c["best_forecast"], "attention": c["attention_variant"],
                                "ratio_at_floors": c.get("forecast_over_attention_at_floors"),
                                "forecast_achieved_over_floor":
                                    c["variants"][c["best_forecast"]].get("achieved_over_floor")})
    r["complete"] = True
    snapshot()
    return r


def table(r: dict) -> str:
    lines = ["| phase | T | B | variant | ms/layer | floor ratio | check |", "|---|---|---|---|---|---|---|"]
    for c in r["cases"]:
        for n, v in c["variants"].items():
            if "seconds_layer" not in v:
                lines.append(f"| {c['phase']} | {c['T']} | {c['batch']} | {n} | {v['status'][:50]} | | |")
                continue
            chk = "ok" if v["check"]["passed"] else f"FAIL {v['check'].get('id_agreement', 0):.2f}"
            sc = "*" if v.get("scaled") else ""
            lines.append(f"| {c['phase']} | {c['T']} | {c['batch']} | {n}{sc} | {v['seconds_layer'] * 1e3:.4g} | "
                         f"{v['achieved_over_floor']:.2f} | {chk} |")
        if c.get("attention_seconds_layer"):
            lines.append(f"| {c['phase']} | {c['T']} | {c['batch']} | attention:{c['attention_variant']} | "
                         f"{c['attention_seconds_layer'] * 1e3:.4g} | | |")
    lines += claim_lines(r)
    lines.append("* timed on a query slice and scaled (JSON: timed_queries, scale)")
    return "\n".join(lines)


def plot(json_path) -> str | None:
    """The PNG beside the JSON; None when matplotlib is missing."""
    plt, r = pyplot_and_result(json_path)
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, ph in zip(axes, ("prefill", "decode")):
        cs = [c for c in r["cases"] if c["phase"] == ph]
        for b in sorted({c["batch"] for c in cs}):
            for n in sorted({n for c in cs for n in c["variants"]}):
                pts = [(c["T"], c["variants"][n]["seconds_layer"] * 1e3) for c in cs
                       if c["batch"] == b and c["variants"].get(n, {}).get("status") == "ok"]
                if pts:
                    ax.plot(*zip(*pts), "o-", label=f"{n} B={b}")
            pts = [(c["T"], c["attention_seconds_layer"] * 1e3) for c in cs
                   if c["batch"] == b and c.get("attention_seconds_layer")]
            if pts:
                ax.plot(*zip(*pts), "k--", label=f"sparse attention B={b}")
        ax.set(xscale="log", yscale="log", xlabel="context T", ylabel="ms per layer", title=f"selection, {ph}")
        ax.legend(fontsize=7)
    return save_png(plt, fig, json_path)


def main(args) -> int:
    out = args.out or default_out("select/select.json")
    r = bench_select(args.preset, lengths=tuple(args.lengths or (32768, 65536, 131072)), batch=args.batch or 4,
                     decode_batches=tuple(args.decode_batches or (args.batch or 4,)), repeats=args.repeats,
                     variants=args.variants, timed_queries=args.timed_queries or 8192,
                     decode_steps=args.decode_steps, budget_s=args.budget_s, max_s=args.max_variant_s,
                     matmul_n=args.matmul_n, copy_mib=args.copy_mib, prefill=not args.decode_only,
                     decode=not args.prefill_only, out=out)
    return plot_and_print(r, out, plot, table)
