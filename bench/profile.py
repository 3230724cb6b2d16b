"""Where a jitted step's time goes: a `jax.profiler` trace of a few calls, reduced to a summary
that fits in a benchmark row.

The decode benchmark found steps 3-5x above their floors (bench/results/decode.json) with no
host synchronisation in the copy engine; the timings alone cannot say whether the device is busy
(a slow kernel), idle between kernels (launch- or host-bound), or waiting on the copy stream.
The profiler's Chrome-trace JSON (`*.trace.json.gz`, written beside the xplane) answers that,
and needs nothing beyond jax to read, so the device machine can summarise it in the same call.

Summary (per step, seconds):
  span            first device event to the last, per step; it includes the gaps between steps
                  (the host's dispatch and block_until_ready), as the benchmark's step times do
  busy            union of kernel intervals over all device streams
  idle_fraction   1 - busy / span: the part of the step no stream of the device was working
                  (high with many short kernels: launch-bound)
  kernels_per_step  device events per step
  streams         busy time of each stream (the copy engine runs on its own stream)
  derived_lines_s_per_step  the profiler's own lines under the device (XLA Modules, XLA Ops),
                  summed, not counted as busy
  top             the kernels with the most total time: name, seconds per step, calls per step
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
from collections import defaultdict

import jax

__all__ = ["profile_calls", "summarize_trace", "profile_lines"]


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(trace: dict, steps: int, top: int = 15) -> dict:
    """Reduce a Chrome-trace dict to per-step device time. Device processes are those named
    /device:...; without any (the CPU backend) the XLA host threads stand in, labelled so."""
    ev = trace.get("traceEvents", [])
    pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    tname = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev = {p for p, n in pname.items() if n.startswith("/device:")}
    source = "device"
    if not dev:  # CPU: XLA's own worker threads
        source = "host XLA threads (no device in the trace)"
        dev = set(pname)
    xs = [e for e in ev if e.get("ph") == "X" and e.get("pid") in dev and "dur" in e]
    thread = lambda e: tname.get((e["pid"], e.get("tid")), "")
    derived = {}
    if source == "device":
        # the profiler also puts derived lines ("XLA Modules", "XLA Ops", "Steps") under the
        # device; a module event spans its whole run and would count as busy: kernels are the
        # events of the "Stream #..." lines, the derived lines are reported apart
        if any(thread(e).startswith("Stream") for e in xs):
            for e in xs:
                if not thread(e).startswith("Stream"):
                    derived[thread(e)] = derived.get(thread(e), 0.0) + e["dur"] * 1e-6 / steps
            xs = [e for e in xs if thread(e).startswith("Stream")]
    else:
        xs = [e for e in xs if "XLA" in thread(e) and "python" not in thread(e)]
    if not xs:
        return {"source": source, "events": 0}
    us = 1e-6
    iv = [(e["ts"], e["ts"] + e["dur"]) for e in xs]
    span = (max(b for _, b in iv) - min(a for a, _ in iv)) * us
    busy = _union_length(iv) * us
    by_stream, by_name, calls = defaultdict(list), defaultdict(float), defaultdict(int)
    for e, (a, b) in zip(xs, iv):
        by_stream[f"{pname.get(e['pid'])} {tname.get((e['pid'], e.get('tid')), e.get('tid'))}"].append((a, b))
        by_name[e["name"]] += e["dur"] * us
        calls[e["name"]] += 1
    ranked = sorted(by_name, key=by_name.get, reverse=True)[:top]
    return {"source": source, "events": len(xs), "steps": steps, "kernels_per_step": len(xs) / steps,
            "span_s_per_step": span / steps, "busy_s_per_step": busy / steps,
            "idle_fraction": 1 - busy / span if span else None,
            "streams": {k: _union_length(v) * us / steps for k, v in sorted(by_stream.items())},
            "derived_lines_s_per_step": derived,
            "top": [{"name": n[:160], "s_per_step": by_name[n] / steps, "calls_per_step": calls[n] / steps}
                    for n in ranked]}


def profile_calls(call, steps: int, log_dir, *, keep_trace: bool = True) -> dict:
    """Trace `steps` calls of `call()` (each blocked on) and summarise; with keep_trace the
    trace.json.gz stays in log_dir for ui.perfetto.dev, the xplane is removed (large, and
    unreadable without the profiler plugin)."""
    log_dir = pathlib.Path(log_dir)
    if log_dir.exists():
        shutil.rmtree(log_dir)
    jax.profiler.start_trace(str(log_dir))
    try:
        for _ in range(steps):
            jax.block_until_ready(call())
    finally:
        jax.profiler.stop_trace()
    found = sorted(log_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not found:
        return {"error": f"no trace.json.gz under {log_dir}"}
    with gzip.open(found[-1], "rb") as f:
        summary = summarize_trace(json.load(f), steps)
    for x in log_dir.glob("plugins/profile/*/*.xplane.pb"):
        x.unlink()
    if keep_trace:
        summary["trace"] = str(found[-1])
    else:
        shutil.rmtree(log_dir)
    return summary


def profile_lines(rows, label=lambda x: f"{x.get('mode')} B={x.get('batch')}", top: int = 6) -> list[str]:
    """Text lines for the rows that carry a "profile": busy / span per step, idle share, streams
    and the top kernels, in milliseconds per timed step (not scaled to the full model)."""
    out = []
    for x in rows:
        p = x.get("profile")
        if not p or "span_s_per_step" not in p:
            continue
        out.append(f"profile {label(x)} ({p['source']}): span {p['span_s_per_step'] * 1e3:.3f} ms/step, busy "
                   f"{p['busy_s_per_step'] * 1e3:.3f}, idle {100 * p['idle_fraction']:.0f}%, "
                   f"{p['kernels_per_step']:.0f} kernels/step; streams "
                   + ", ".join(f"{k.split()[-1]} {v * 1e3:.3f}" for k, v in p["streams"].items()))
        out += [f"    {t['s_per_step'] * 1e3:8.3f} ms  x{t['calls_per_step']:.0f}  {t['name'][:90]}"
                for t in p["top"][:top]]
    return out
