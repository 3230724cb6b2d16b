"""Write `bench/results/README.md`, the index of the committed benchmark results.

    python -m sparda_jax.bench.index            # rewrites bench/results/README.md
    python -m sparda_jax.bench.index --check    # exits 1 if the committed page is stale

Every number on the page is read from a result JSON at generation time (each JSON carries its
commit, device and command); the paper's numbers come from `PAPER_DECODE_128K`
(`bench/decode.py`) and from `PAPER_PREFILL_128K` / `PAPER_CTA_32K` below (docs/algorithm.md,
"The paper's numbers"). The only hand-written text is what each folder and file is.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from sparda_jax.bench.decode import PAPER_DECODE_128K

__all__ = ["FOLDERS", "FILES", "PAPER_PREFILL_128K", "PAPER_CTA_32K", "PAPER_SELECT_SPEEDUP_128K", "render", "main"]

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# The paper's Table 3 (prefill tokens/s, MiniCPM4.1-8B, batch 4, 128K, H100) and Table 7
# (SparDA decode tokens/s against the copy kernel's CTA count, 32K, H100).
PAPER_PREFILL_128K = {"dense_resident": 8085.8, "sparse": 13661.8, "sparda": 17087.6}
PAPER_CTA_32K = {16: {16: 918.5, 64: 737.3}, 64: {16: 1255.9, 64: 1380.2}}
# The paper's Fig. 3 (128K, batch 4): InfLLM-V2's selection time over the Forecast's, "up to" the
# prefill figure and "more than" the decode one.
PAPER_SELECT_SPEEDUP_128K = {"prefill": 2.50, "decode": 2.0}

LABELS = {"dense_resident": "Dense+", "sparse_resident": "Sparse+", "sparse": "Sparse", "infinigen": "InfiniGen",
          "sparda_sync": "SparDA-no-prefetch", "sparda": "SparDA"}

FOLDERS = {
    "attention": "block-sparse attention kernels against cuDNN dense attention (`sparda bench attention`)",
    "prefill": "full-model prefill tokens/s of Dense+, Sparse and SparDA (`sparda bench prefill`, paper Table 3)",
    "decode": "decode tokens/s of the offload engine's systems (`sparda bench decode`, paper Tables 4 and 10), "
              "and XLA's command-buffer logs of those runs (`xla_logs/`)",
    "cta": "SparDA decode against the copy kernel's CTA count (`sparda bench cta`, paper Table 7)",
    "select": "Forecast against InfLLM-V2 selection, prefill and decode (`sparda bench select`, paper Fig. 3)",
    "copy": "the UVA block gather and the prefetch pattern alone (`sparda bench copy`)",
    "train_step": "one Forecast training step at minicpm4.1-8b shapes (`sparda bench train`)",
    "profiles": "traced decode steps (`bench/profile.py` summaries, Chrome traces, per-kernel layer breakdowns)",
    "gpu_tests": "logs of the GPU-marked tests (`pytest -m gpu`) at the commit in each name",
    "realmodel": "SmolLM2-135M through `generate`, every system, as a user runs it: steady decode and prefill, the "
                 "first call apart, miss rates (`sparda bench realmodel`)",
}

# What each kept run is, and the decision or claim it backs. No measured values here: those are
# read from the files.
FILES = {
    "attention/train.json": "forward + backward vs cuDNN's at 32K-128K, batch 4, after a gradient check of each sparse variant",
    "attention/random.json": "kernels vs cuDNN, prefill batch 4 and decode batch 16/64, random selections",
    "attention/prefill_rho099.json": "prefill kernels vs cuDNN on selections alike between neighbours "
                                     "(Forecast queries AR(1), rho 0.99), the realistic case",
    "attention/decode_steps32.json": "decode attention, 32 steps a timed call as the engine issues it",
    "attention/decode_variants.json": "every decode variant, two CTAs per SM: no gain (decision: decode kernel buffers)",
    "attention/decode_ring4.json": "a 4-buffer ring against 2 buffers: slower (decision: decode kernel buffers)",
    "attention/union_cpu_rho0.json": "CPU, block unions only: prefill tiles over independent queries",
    "attention/union_cpu_rho099.json": "CPU, block unions only: prefill tiles over AR(1) rho 0.99 queries",
    "prefill/rho0999.json": "128K x 4, inputs alike along positions (AR(1) rho 0.999): the prefill claim",
    "prefill/random.json": "128K x 4, random inputs",
    "decode/claims32_split4.json": "batch 4, 32 layers: Sparse+, Sparse, SparDA-no-prefetch, SparDA in one call",
    "decode/claims32_split.json": "batch 8, 32 layers: the same four systems, random traffic and reuse",
    "decode/claims32_pool.json": "batch 8, 32 layers, Sparse and SparDA across miss rates: the ratio vs traffic",
    "decode/claims32_loop_mid.json": "batch 8, 32 layers, the miss rates between (a second call)",
    "decode/sparda32_step.json": "SparDA, 32 layers, one step a call (decision: n steps in one program)",
    "decode/sparda32_loop8.json": "SparDA, 32 layers, 8 steps a call in one program (same decision)",
    "decode/generate_loop32.json": "`generate` with 8 steps a call against 1, 32 layers",
    "decode/generate_loop8layers.json": "`generate` with 8 steps a call against 1, 8 layers",
    "decode/overlap.json": "4 layers, compute alone and copies alone beside each step (decision: the copy hides)",
    "decode/marginal.json": "steps of 4 and 2 layers, checked at 8 (decision: two layer counts)",
    "decode/resident.json": "Dense+ and Sparse+ on per-layer resident state (decision: resident state per layer)",
    "decode/resident_stacked.json": "the same (and InfiniGen) on the stacked state, before",
    "decode/depth_queue4x.json": "32 layers with CUDA_SCALE_LAUNCH_QUEUES=4x (decision: launch queues)",
    "decode/depth_graph.json": "32 layers, copies in XLA's graphs, 2 traced steps a row (same decision)",
    "decode/depth_one.json": "copy start `one` (K and V in one start): no gain over lanes",
    "decode/graph4.json": "copy start `graph` (in-graph gather, CONCURRENT scheduling): serial",
    "decode/doorbell4_lanes.json": "4 layers, asynchronous starts on lanes (against the doorbell)",
    "decode/doorbell4_doorbell.json": "4 layers, doorbell copies: the same step as the lanes",
    "decode/doorbell32_timeline.json": "doorbell step's device timeline (ring, copy, wait), 32 layers",
    "decode/pool_check.json": "the host-pool check refusing a pool placed in device memory",
    "decode/update_SKIP_TEMP.json": "NOT offload rows: XLA's SKIP_TEMP update mode put the host pools on the GPU",
    "decode/weights_layered.json": "4 layers on `layered_params` (decision: per-layer weights)",
    "decode/weights_stacked.json": "4 layers on stacked weights (same decision)",
    "decode/queues_shell.json": "32 layers, launch queues from the shell, positions staged (`_own_buffer`)",
    "decode/queues_shell_nostaging.json": "the same without the staging",
    "cta/cta.json": "SparDA at 32K, batch 16 and 64, per CTA count, the paper's heuristic and the autotuned count",
    "select/selectors.json": "Forecast vs InfLLM-V2 selection beside the layer's attention, prefill and decode",
    "select/decode_mosaic_topk.json": "decode selection, `lax.top_k` vs the Mosaic top-k: XLA's stays",
    "select/decode_count_topk.json": "decode selection, `lax.top_k` vs a top-k by counting: XLA's stays",
    "copy/gather.json": "UVA gather vs bulk copy, XLA loop and host gather per CTA count; overlap; write-back",
    "copy/pipeline.json": "the prefetch pattern alone (next layer's starts beside skinny matmuls)",
    "copy/pipeline_group.json": "the same with copy groups: no gain",
    "train_step/seq8k.json": "8K tokens",
    "train_step/seq32k.json": "32K tokens",
    "train_step/seq64k.json": "64K tokens (the paper's MiniCPM length)",
    "profiles/decode_profile_8517789.json": "3 traced steps a row at 8517789 (trace kept beside it)",
    "profiles/layer_breakdown_2e96975.json": "a decode layer's kernel time by kind, 16-layer doorbell trace",
    "profiles/layer_breakdown_sparse_a3cd03f.json": "the same for the synchronous Sparse trace",
    "profiles/prefill_sparda_4k_0c2fd73.trace.json.gz": "one warm 4K SmolLM2 SparDA prefill (H100, 0c2fd73, "
                                                       "traced up to its first token): the host's work before the "
                                                       "forward program starts (decision: host prompts)",
    "profiles/prefill_sparse_4k_0c2fd73.trace.json.gz": "the same run's Sparse prefill: the per-tile union's sort, "
                                                       "two scatters and cumsum (decision: the prefill's union)",
    "realmodel/realmodel.json": "16e5709, H100, copy_start one (the default since), 256 new tokens: SmolLM2, 4K "
                                "and 8K batch 1, every system (issue 28's claims)",
    "realmodel/realmodel_4k_lanes.json": "the same commit and machine, minutes before: copy_start lanes, 64 new "
                                         "tokens, 4K batch 1 and 8, every system",
    "realmodel/copy_start/real_512_lanes.json": "SmolLM2 (GGUF) 4K batch 1, 512 new tokens, Dense+ and SparDA with "
                                                "copy_start lanes (scripts/realmodel_variants.py; decision: one start "
                                                "of every payload)",
    "realmodel/copy_start/real_512_one.json": "the same run, copy_start one",
    "realmodel/copy_start/real_64_lanes.json": "as real_512, 64 new tokens, an earlier run on the same machine",
    "realmodel/copy_start/real_64_one.json": "the same run, copy_start one",
    "realmodel/copy_start/random_64_lanes.json": "SmolLM2's shapes with random weights, 4K batch 1, 64 new tokens, "
                                                 "copy_start lanes",
    "realmodel/copy_start/random_64_one.json": "the same run, copy_start one",
    "realmodel/kernel_count.json": "kernels of one decode step (SmolLM2 shapes, 4K batch 1) in XLA's deviceless H100 "
                                    "compile on a CPU (scripts/kernel_count.py): e2ef356, then the copy plan's rows "
                                    "with copy_plan=xla and =triton, each row with its commit",
    "realmodel/infinigen_prefill.json": "58364e4, 4K batch 1, Dense+, Sparse, InfiniGen with --profile-prefill: "
                                        "InfiniGen's two scoring passes against the rest of its prefill",
    "realmodel/infinigen_default_b1.json": "731b82d's tree (recorded as its parent 15799fb: .commit was written before "
                                           "the change was committed): 4K and 8K batch 1, every system, InfiniGen's "
                                           "prefill selection by default on the Mosaic kernels",
    "realmodel/infinigen_default_b8.json": "the same tree and machine right after: 4K and 8K batch 8, every system",
    "realmodel/token_before_move.json": "0c2fd73, 4K batch 1, every system, --profile-prefill: the first token read "
                                        "before the KV's move to the host, the prompt still checked on the device",
    "realmodel/decode_profile.json": "4K batch 1, Dense+, Sparse, SparDA with --profile-decode and --profile-prefill: "
                                     "the steady decode step's kernels and launches (what the decode ratio is made of)",
    "realmodel/union_bitmap.json": "c9ab740, 4K batch 1, every system, with the prefill's per-tile union built from a "
                                   "bitmap instead of a sort: no change above the run-to-run spread (reverted; "
                                   "decision: the prefill's union)",
    "realmodel/host_offload_probe.json": "the probe's answer: placing each layer's output in pinned host memory "
                                         "inside a 30-layer scan adds to the scan rather than hiding under it "
                                         "(decision: the first token before the KV's move)",
    "realmodel/prefill_d64.json": "SmolLM2 at 4K batch 1 after head dim 64 prefill went to the compiled Mosaic kernel: Dense+, Sparse, SparDA",
    "realmodel/select_d64.json": "the same three after head dim 64 prefill selection went to the compiled Mosaic "
                                 "selectors too (uncommitted tree at cbdd6d3: the api.py gate opened)",
    "realmodel/first_token.json": "`sparda generate` in fresh processes, cold then warm, with the converted-weights "
                                  "cache: seconds to the first token (Dense+, SparDA)",
    "realmodel/lowered_once.json": "the grid at 8ec65f6, one kernel module per op (`lowered_once`): 4K cells and "
                                   "the CLI's first token; the 240 s budget skipped the 8K ones",
    "realmodel/first_calls_xla.json": "de3f3ba: 4K batch 1, and `sparda generate` cold / warm with each first call "
                                      "split (trace, lower, compile, the rest), again with the kernels forced to XLA; "
                                      "SparDA with an untrained Forecast (its miss rate is not the shipped one's)",
    "realmodel/first_calls.json": "1f8415d (the offload state laid out in one program, the copy library built on a "
                                  "thread): 4K batch 1 and `sparda generate` cold / warm; SparDA with an untrained "
                                  "Forecast",
    "realmodel/grid.json": "1f8415d: 8K batch 1 and 8, 4K batch 1 (the 220 s budget skipped 4K batch 8)",
    "realmodel/backends_kernels.json": "aadd3b7, the shipped Forecast: 4K and 8K batch 1 with the default backends "
                                       "(the 110 s budget skipped SparDA at 8K)",
    "realmodel/backends_xla.json": "the same run's second grid, sparse attention and selection forced to XLA, and "
                                   "`sparda generate` cold / warm with the default backends and with XLA forced",
    "realmodel/program_store.json": "H200, 4K batch 1, Dense+ and SparDA, bf16: steady rows, and `sparda generate` "
                                     "cold / warm with the program store and without it (--first-token-without-store)",
    "realmodel/steady_repeat1.json": "the program store run's commit again: 4K batch 1 steady rows, Sparse too; with "
                                     "steady_repeat2.json, run right after, how far the SparDA / Dense+ decode ratio "
                                     "moves between runs",
    "realmodel/steady_repeat2.json": "as steady_repeat1.json, the run after it",
    "realmodel/prefill_named.json": "4K batch 1 with --profile-prefill once the Mosaic kernels carry their names: "
                                    "each row's prefill_profile says which kernel a warm prefill's time is in "
                                    "(SparDA: the top-k 5.0 of 20 ms, before its rows per CTA followed the row count)",
    "realmodel/prefill_topk.json": "4K and 8K batch 1 with --profile-prefill after the top-k's rows per CTA "
                                   "followed the row count (H100): the top-k 0.64 ms of a 4K prefill (5.0 before), "
                                   "SparDA's prefill 1.63x / 1.37x Dense+'s at 4K / 8K",
    "realmodel/sparse_native_dense18.json": "`--model smollm2-135m-sparse` (layer 18 dense), 4K and 8K batch 1, "
                                            "H100: what the sparse-native preset's users get",
    "realmodel/h100_repeat.json": "the base model right after sparse_native_dense18.json on the same H100: its "
                                  "baseline, and one more sample of the 4K decode ratio (0.44)",
    "realmodel/host_offload_probe.py": "the script of host_offload_probe.json",
    "select/select_smollm2_4k8k.json": "the four selectors at SmolLM2's shapes (3 KV heads, head dim 64), 4K and 8K, "
                                       "batch 1, prefill",
    "select/topk_rows_sweep.json": "the Mosaic top-k's rows per CTA at SmolLM2's prefill shapes beside XLA's "
                                   "top-k + sort: why `rows_per_cta` follows the row count (MIN_CTAS)",
    "select/topk_rows_sweep.py": "the script of topk_rows_sweep.json",
    "realmodel/program_store_cpu.json": "on the CPU (2 cores, float32, 1K prompt): `sparda generate` cold / warm with "
                                        "the program store and without it (--first-token-without-store); the warm "
                                        "first calls' trace + lower is what the store removes",
}


def _load(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def _env(d: dict) -> dict:
    return d.get("environment") or {}


def _provenance(d: dict) -> tuple[str, str, str]:
    env = _env(d)
    commit = (env.get("commit") or d.get("trace_commit") or "")[:7]
    return commit or "-", env.get("device") or "-", (env.get("time_utc") or "-")[:10]


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _decode_rows(d: dict, variant: str = "random") -> dict:
    return {r["mode"]: r["tokens_per_s"] for r in d["rows"]
            if r.get("status") == "ok" and r.get("variant") == variant and r.get("tokens_per_s")}


def _factors(tps: dict) -> dict:
    """The split of SparDA / Sparse: selector (SparDA-no-prefetch / Sparse), prefetch (SparDA /
    SparDA-no-prefetch), total, and copy-free (SparDA / Sparse+); absent where a system is."""
    out = {}
    if "sparda_sync" in tps and "sparse" in tps:
        out["selector"] = tps["sparda_sync"] / tps["sparse"]
    if "sparda" in tps and "sparda_sync" in tps:
        out["prefetch"] = tps["sparda"] / tps["sparda_sync"]
    if "sparda" in tps and "sparse" in tps:
        out["total"] = tps["sparda"] / tps["sparse"]
    if "sparda" in tps and "sparse_resident" in tps:
        out["copy-free"] = tps["sparda"] / tps["sparse_resident"]
    return out


def _decode_section() -> list[str]:
    ours = {4: "decode/claims32_split4.json", 8: "decode/claims32_split.json"}
    lines = ["### Decode, 128K (paper Tables 4 and 10, H100; ours H200, random traffic, all 32 layers timed)", "",
             "SparDA / Sparse splits into selector = SparDA-no-prefetch / Sparse (both copy synchronously), "
             "prefetch = SparDA / SparDA-no-prefetch, and copy-free = SparDA / Sparse+.", "",
             "| batch | system or factor | paper tokens/s or ratio | ours | ours from (commit) |", "|---|---|---|---|---|"]
    for b, rel in ours.items():
        d = _load(rel)
        tps, paper = _decode_rows(d), PAPER_DECODE_128K.get(b, {})
        src = f"`{rel}` ({_provenance(d)[0]})"
        for m in LABELS:
            if m in tps or m in paper:
                lines.append(f"| {b} | {LABELS[m]} | {_f(paper.get(m), 1)} | {_f(tps.get(m), 1)} | {src} |")
        fo, fp = _factors(tps), _factors(paper)
        for k in ("selector", "prefetch", "total", "copy-free"):
            if k in fo or k in fp:
                lines.append(f"| {b} | {k} | {_f(fp.get(k))} | {_f(fo.get(k))} | {src} |")
    d = _load("decode/claims32_pool.json")
    by = {}
    for r in d["rows"]:
        if r.get("status") == "ok" and r["mode"] in ("sparse", "sparda"):
            by.setdefault(r["variant"].split(" ")[0], {})[r["mode"]] = r
    lines += ["", f"SparDA / Sparse at batch 8 across the block miss rate (`decode/claims32_pool.json`, "
                  f"{_provenance(d)[0]}; paper batch 8: {_f(_factors(PAPER_DECODE_128K[8]).get('total'))}):", "",
              "| variant | SparDA miss rate | Sparse tokens/s | SparDA tokens/s | SparDA / Sparse |", "|---|---|---|---|---|"]
    for v, m in by.items():
        if "sparse" in m and "sparda" in m:
            lines.append(f"| {v} | {_f(m['sparda']['miss_rate'], 3)} | {_f(m['sparse']['tokens_per_s'], 1)} | "
                         f"{_f(m['sparda']['tokens_per_s'], 1)} | {_f(m['sparda']['tokens_per_s'] / m['sparse']['tokens_per_s'])} |")
    return lines


def _prefill_section() -> list[str]:
    runs = {"rho0999": _load("prefill/rho0999.json"), "random": _load("prefill/random.json")}
    tps = {k: {r["mode"]: r["tokens_per_s"] for r in d["rows"] if r.get("status") == "ok"} for k, d in runs.items()}
    lines = ["### Prefill, batch 4, 128K (paper Table 3, H100; ours H200, 2 of 32 layers timed and scaled)", "",
             "| system | paper tokens/s | ours, inputs alike along positions | ours, random inputs |", "|---|---|---|---|"]
    for m in ("dense_resident", "sparse", "sparda"):
        lines.append(f"| {LABELS[m]} | {_f(PAPER_PREFILL_128K[m], 1)} | {_f(tps['rho0999'].get(m), 1)} | "
                     f"{_f(tps['random'].get(m), 1)} |")
    for a, b in (("sparda", "sparse"), ("sparda", "dense_resident")):
        row = [_f(t[a] / t[b]) if a in t and b in t else "-" for t in (PAPER_PREFILL_128K, tps["rho0999"], tps["random"])]
        lines.append(f"| {LABELS[a]} / {LABELS[b]} | " + " | ".join(row) + " |")
    lines += ["", "From `prefill/rho0999.json` (" + _provenance(runs["rho0999"])[0] + ") and `prefill/random.json` ("
              + _provenance(runs["random"])[0] + ")."]
    return lines


def _cta_section() -> list[str]:
    d = _load("cta/cta.json")
    lines = ["### CTA quota, SparDA decode at 32K (paper Table 7, H100; ours H200, 4 of 32 layers timed)", "",
             "| batch | CTAs | paper tokens/s | ours tokens/s | the paper's heuristic |", "|---|---|---|---|---|"]
    seen = set()
    for r in sorted(d["rows"], key=lambda r: (r["batch"], r["num_ctas"])):
        if r.get("status") != "ok" or (r["batch"], r["num_ctas"]) in seen:
            continue
        seen.add((r["batch"], r["num_ctas"]))
        lines.append(f"| {r['batch']} | {r['num_ctas']} | {_f(PAPER_CTA_32K.get(r['batch'], {}).get(r['num_ctas']), 1)} | "
                     f"{_f(r['tokens_per_s'], 1)} | {'yes' if r.get('heuristic') else ''} |")
    lines += ["", f"From `cta/cta.json` ({_provenance(d)[0]}); where a count was timed twice the first row is shown."]
    return lines


def _select_section() -> list[str]:
    rel = "select/selectors.json"
    d = _load(rel)
    lines = ["### Selection at 128K, batch 4: InfLLM-V2's time / the Forecast's (paper Fig. 3, H100; ours H200, "
             "the fastest variant of each)", "",
             "| phase | paper | ours | ours from (commit) |", "|---|---|---|---|"]
    for phase, bound in (("prefill", "up to"), ("decode", "more than")):
        for c in d.get("claims") or []:
            if c["claim"].startswith(f"{phase} T=131072 B=4: InfLLM-V2 time / Forecast time"):
                lines.append(f"| {phase} | {bound} {_f(PAPER_SELECT_SPEEDUP_128K[phase])} | {_f(c['value'])} | "
                             f"`{rel}` ({_provenance(d)[0]}) |")
    return lines


def _train_section() -> list[str]:
    lines = ["### Forecast training step, minicpm4.1-8b shapes, 32 layers, bf16 (no paper figure)", "",
             "| file | tokens | step seconds (median) | tokens/s | peak GiB | commit |", "|---|---|---|---|---|---|"]
    for p in sorted((RESULTS / "train_step").glob("*.json"), key=lambda p: _load(f"train_step/{p.name}")["seq_len"]):
        d = _load(f"train_step/{p.name}")
        peak = d.get("peak_device_bytes")
        lines.append(f"| `train_step/{p.name}` | {d['seq_len']} | {_f(d['step_seconds_median'])} | {_f(d.get('tokens_per_s'), 0)} | "
                     f"{_f(peak / 2**30, 1) if peak else '-'} | {_provenance(d)[0]} |")
    return lines


def _realmodel_section(rel: str) -> list[str]:
    """The real model's rows, from `rel` under RESULTS."""
    d = _load(rel)
    c = d["config"]
    forced = ", ".join(f"{op}={name}" for op, name in (c.get("implementations") or {}).items() if name)
    commit, device, date = _provenance(d)
    lines = [f"### `{rel}` ({commit}, {date}): {c['model']} through `generate`, {c['dtype']}, {c['new_tokens']} new "
             f"tokens, {c['steps_per_call']} steps a call{f', backends forced: {forced}' if forced else ''}", "",
             f"{FILES.get(rel, '')} ({device}; no paper figure).", "",
             "Steady decode leaves out the first decode call; prefill is a warm call of the same shapes (the "
             "median of 3 in runs after 01c0432, one before); the first call is the cold prefill plus the first "
             "decode call (compiles, the copy library's build).", "",
             "| context | batch | system | steady tokens/s | prefill s | first call s | miss rate | status |",
             "|---|---|---|---|---|---|---|---|"]
    for x in d["rows"]:
        lines.append(f"| {x['context']} | {x['batch']} | {LABELS.get(x['system'], x['system'])} | "
                     f"{_f(x.get('steady_tokens_per_s'), 1)} | {_f(x.get('prefill_s'), 3)} | "
                     f"{_f(x.get('first_call_s'), 1)} | {_f(x.get('miss_rate'), 3)} | {x['status']} |")
    return lines


def _realmodel_sections() -> list[str]:
    """Every committed realmodel run with rows, the newest first (by its recorded time)."""
    runs = [str(p.relative_to(RESULTS)) for p in sorted((RESULTS / "realmodel").glob("*.json"))]
    runs = [r for r in runs if isinstance(_load(r), dict) and _load(r).get("rows") and "config" in _load(r)]
    lines = []
    for rel in sorted(runs, key=lambda r: _env(_load(r)).get("time_utc") or "", reverse=True):
        lines += _realmodel_section(rel) + [""]
    return lines


def _claims_section() -> list[str]:
    lines = ["## Every claim the runs recorded", "",
             "Each benchmark writes its claims (value, target, met) into its JSON; all of them, file by file.", "",
             "| file | claim | value | target | met |", "|---|---|---|---|---|"]
    for rel in _all_json():
        if rel.startswith("profiles/"):       # traced steps: where time goes, not a timing to claim on
            continue
        d = _load(rel)
        for c in (d.get("claims") or []) if isinstance(d, dict) else []:
            lines.append(f"| `{rel}` | {c['claim']} | {_f(c.get('value'), 3)} | {c.get('target', '-')} | "
                         f"{'-' if c.get('met') is None else 'yes' if c['met'] else 'no'} |")
    return lines


def _all_json() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.glob("*/*.json"))


def _folders_section() -> list[str]:
    lines = ["## Folders", ""]
    for folder in sorted(p.name for p in RESULTS.iterdir() if p.is_dir()):
        lines += [f"### `{folder}/`", "", FOLDERS.get(folder, "(undescribed)"), "",
                  "| file | what | commit | device | date |", "|---|---|---|---|---|"]
        for p in sorted((RESULTS / folder).rglob("*")):
            if not p.is_file():
                continue
            rel = str(p.relative_to(RESULTS))
            if rel.endswith(".json"):
                commit, device, date = _provenance(_load(rel))
                lines.append(f"| `{rel}` | {FILES.get(rel, '')} | {commit} | {device} | {date} |")
            elif not rel.endswith(".png"):
                what = 'XLA command-buffer log' if '/xla_logs/' in rel else FILES.get(rel, '')
                lines.append(f"| `{rel}` | {what} | - | - | - |")
        lines.append("")
    return lines


def render() -> str:
    """The page, from the committed results: a pure function of bench/results/ and the paper tables."""
    lines = ["# Benchmark results", "",
             "Generated by `python -m sparda_jax.bench.index` from the JSONs in these folders; do not edit by hand. "
             "Every number is read from the file named beside it, which records the commit, device and command of "
             "its run. Runs a later one superseded were removed (git history keeps them); the real model's runs stay "
             "side by side, the newest first, each the state at its commit. Why each result matters: "
             "`docs/decisions.md`.", "",
             "## The paper beside ours", ""]
    for section in (_decode_section, _prefill_section, _cta_section, _select_section, _train_section,
                    _realmodel_sections):
        part = section()
        lines += part + [""] if part else []
    lines += _claims_section() + [""] + _folders_section()
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed page differs from a fresh render")
    args = ap.parse_args(argv)
    page, path = render(), RESULTS / "README.md"
    if args.check:
        ok = path.is_file() and path.read_text() == page
        print("bench/results/README.md is " + ("current" if ok else "stale: run python -m sparda_jax.bench.index"))
        return 0 if ok else 1
    path.write_text(page)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
