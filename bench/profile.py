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
                  (`kernels` of them, default `top`: all of a step's kernels for an inventory)
  overlap_s_per_step  time two or more streams ran at once (the copy beside compute). On the H200
                  it was 0 even between two copy lanes started together: the traced kernels ran one
                  at a time, so a trace says where device and host time go, not whether streams
                  overlap (the untraced step times say that)
  modules         with the profiler's "XLA Modules" line: the step's executions; gap_s_per_step
                  between them (the host's dispatch and sync), idle_inside_s_per_step (the device
                  waiting inside an execution: launch-bound or waiting on a stream) and the
                  largest_gaps inside, with the kernels on either side
  host_top        the host events with the most total time (names, seconds and calls per step):
                  CUDA API calls such as cuLaunchKernel / cuGraphLaunch, XLA's thunks
  host_api        the same for the CUDA API calls alone (names starting with "cu")
"""

from __future__ import annotations

import gzip
import json
import pathlib
import shutil
from collections import defaultdict

import jax

__all__ = ["profile_calls", "trace_once", "TraceWindow", "summarize_trace", "profile_lines"]


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(trace: dict, steps: int, top: int = 15, kernels: int | None = None) -> dict:
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
        # XLA's worker threads, and the ops a program ran inline on the calling thread (with the
        # CPU's async dispatch off, small programs run there whole): the op events inside its
        # "ThunkExecutor::Execute" spans, not the Python frames ($...) or the "end: ..." marks
        runs = defaultdict(list)
        for e in xs:
            if e["name"].startswith("ThunkExecutor::Execute"):
                runs[(e["pid"], e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
        inline = lambda e: (not e["name"].startswith(("$", "end: ", "ThunkExecutor")) and any(
            a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in runs.get((e["pid"], e.get("tid")), ())))
        xs = [e for e in xs if ("XLA" in thread(e) and "python" not in thread(e)) or inline(e)]
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
    ranked = sorted(by_name, key=by_name.get, reverse=True)[:top if kernels is None else kernels]
    out = {"source": source, "events": len(xs), "steps": steps, "kernels_per_step": len(xs) / steps,
           "span_s_per_step": span / steps, "busy_s_per_step": busy / steps,
           "idle_fraction": 1 - busy / span if span else None,
           "streams": {k: _union_length(v) * us / steps for k, v in sorted(by_stream.items())},
           "overlap_s_per_step": _covered_twice(list(by_stream.values())) * us / steps,
           "derived_lines_s_per_step": derived,
           "top": [{"name": n[:160], "s_per_step": by_name[n] / steps, "calls_per_step": calls[n] / steps}
                   for n in ranked]}
    modules = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("ph") == "X" and e.get("pid") in dev
               and "dur" in e and "Modules" in thread(e)]
    if source == "device" and modules:
        out["modules"] = _inside_modules(sorted(modules), sorted(zip(iv, (e["name"] for e in xs))), steps)
    host = defaultdict(float)
    host_calls = defaultdict(int)
    for e in ev:
        if e.get("ph") == "X" and "dur" in e and e.get("pid") not in dev:
            host[e["name"]] += e["dur"] * us
            host_calls[e["name"]] += 1
    if source == "device" and host:
        out["host_top"] = [{"name": n[:120], "s_per_step": host[n] / steps, "calls_per_step": host_calls[n] / steps}
                           for n in sorted(host, key=host.get, reverse=True)[:top]]
        # the CUDA API calls alone (driver cu*, runtime cuda*): launches, graph launches and
        # updates, event records and waits per step, which the top list's Python frames crowd out
        api = [n for n in host if n.startswith("cu")]
        out["host_api"] = [{"name": n[:120], "s_per_step": host[n] / steps, "calls_per_step": host_calls[n] / steps}
                           for n in sorted(api, key=host.get, reverse=True)[:top]]
    return out


def _covered_twice(per_stream) -> float:
    """Length of time during which at least two of the streams' interval sets are busy."""
    edges = []
    for ivs in per_stream:
        # a stream's own intervals merged first: its kernels never run two at once here
        merged = []
        for a, b in sorted(ivs):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        edges += [(a, 1) for a, _ in merged] + [(b, -1) for _, b in merged]
    total, depth, last = 0.0, 0, None
    for t, d in sorted(edges, key=lambda x: (x[0], x[1])):
        if depth >= 2:
            total += t - last
        depth += d
        last = t
    return total


def _inside_modules(modules, kernels, steps: int, n_gaps: int = 5) -> dict:
    """Per step: the time between module executions and the device's idle time inside them;
    the largest idle gaps inside, named by the kernels that end before and start after."""
    us = 1e-6
    between = sum(max(0.0, b0 - a1) for (_, a1), (b0, _) in zip(modules, modules[1:]))
    idle, gaps = 0.0, []
    for m0, m1 in modules:
        inside = [(max(a, m0), min(b, m1), n) for (a, b), n in kernels if b > m0 and a < m1]
        t, prev = m0, "(start)"
        for a, b, n in inside:
            if a > t:
                gaps.append((a - t, prev, n))
                idle += a - t
            if b > t:
                t, prev = b, n
        if m1 > t:
            gaps.append((m1 - t, prev, "(end)"))
            idle += m1 - t
    gaps.sort(key=lambda g: -g[0])
    return {"executions": len(modules), "gap_s_per_step": between * us / steps,
            "idle_inside_s_per_step": idle * us / steps,
            "largest_gaps": [{"s": g * us, "after": p[:80], "before": n[:80]} for g, p, n in gaps[:n_gaps]]}


def profile_calls(call, steps: int, log_dir, *, keep_trace: bool = True) -> dict:
    """Trace `steps` calls of `call()` (each blocked on) and summarise; with keep_trace the
    trace is kept as <log_dir>.trace.json.gz (for ui.perfetto.dev); log_dir is removed."""
    def run():
        for _ in range(steps):
            jax.block_until_ready(call())

    return _traced(run, steps, log_dir, keep_trace)[1]


def trace_once(call, trace_path) -> tuple:
    """Run `call()` once under the profiler -> (its result, the summary of `summarize_trace`
    with steps=1). The Chrome trace is written to trace_path (a .trace.json.gz name)."""
    trace_path = pathlib.Path(trace_path)
    name = trace_path.name.removesuffix(".gz").removesuffix(".json").removesuffix(".trace")
    log_dir = trace_path.with_name(name + ".profile-tmp")
    result, summary = _traced(call, 1, log_dir, True)
    if "trace" in summary:
        pathlib.Path(summary["trace"]).replace(trace_path)
        summary["trace"] = str(trace_path)
    return result, summary


class TraceWindow:
    """A trace started and stopped by the caller, e.g. from a `generate`'s on_step once its first
    decode call has ended, so that only the steady steps are traced. `stop(steps)` summarises
    per step (`summarize_trace`, listing `kernels` kernels); with keep_trace the trace is kept as
    <log_dir>.trace.json.gz."""

    def __init__(self, log_dir, *, keep_trace: bool = False, kernels: int | None = None):
        self.log_dir = pathlib.Path(log_dir)
        self.keep_trace = keep_trace
        self.kernels = kernels
        self.started = False

    def start(self) -> None:
        if self.started:
            raise RuntimeError("the trace window is already open")
        if self.log_dir.exists():
            shutil.rmtree(self.log_dir)
        jax.profiler.start_trace(str(self.log_dir))
        self.started = True

    def stop(self, steps: int) -> dict:
        if not self.started:
            raise RuntimeError("the trace window was never started")
        jax.profiler.stop_trace()
        self.started = False
        found = sorted(self.log_dir.glob("plugins/profile/*/*.trace.json.gz"))
        if not found:
            return {"error": f"no trace.json.gz under {self.log_dir}"}
        with gzip.open(found[-1], "rb") as f:
            summary = summarize_trace(json.load(f), steps, kernels=self.kernels)
        if self.keep_trace:
            # beside log_dir, not six folders down: the device tool brings back shallow files only
            kept = self.log_dir.with_name(self.log_dir.name + ".trace.json.gz")
            shutil.copyfile(found[-1], kept)
            summary["trace"] = str(kept)
        shutil.rmtree(self.log_dir)  # the xplane too: large, and unreadable without the profiler plugin
        return summary


def _traced(call, steps: int, log_dir, keep_trace: bool) -> tuple:
    window = TraceWindow(log_dir, keep_trace=keep_trace)
    window.start()
    try:
        result = jax.block_until_ready(call())
    except BaseException:
        jax.profiler.stop_trace()
        raise
    return result, window.stop(steps)


def profile_lines(rows, label=lambda x: f"{x.get('mode')} B={x.get('batch')}", top: int = 6,
                  key: str = "profile") -> list[str]:
    """Text lines for the rows that carry a summary under `key`: busy / span per step, idle share,
    streams and the top kernels, in milliseconds per timed step (not scaled to the full model)."""
    out = []
    for x in rows:
        p = x.get(key)
        if not p or "span_s_per_step" not in p:
            continue
        out.append(f"profile {label(x)} ({p['source']}): span {p['span_s_per_step'] * 1e3:.3f} ms/step, busy "
                   f"{p['busy_s_per_step'] * 1e3:.3f}, idle {100 * p['idle_fraction']:.0f}%, "
                   f"{p['kernels_per_step']:.0f} kernels/step; streams "
                   + ", ".join(f"{k.split()[-1]} {v * 1e3:.3f}" for k, v in p["streams"].items()))
        m = p.get("modules")
        if m:
            out.append(f"    streams overlap {p['overlap_s_per_step'] * 1e3:.3f} ms; {m['executions']} executions, "
                       f"{m['gap_s_per_step'] * 1e3:.3f} ms/step between them, {m['idle_inside_s_per_step'] * 1e3:.3f} "
                       "idle inside; largest gaps inside: " + ", ".join(
                           f"{g['s'] * 1e3:.3f} ({g['after'][:24]} -> {g['before'][:24]})" for g in m["largest_gaps"][:3]))
        out += [f"    {t['s_per_step'] * 1e3:8.3f} ms  x{t['calls_per_step']:.0f}  {t['name'][:90]}"
                for t in p["top"][:top]]
        out += [f"    host {t['s_per_step'] * 1e3:8.3f} ms  x{t['calls_per_step']:.0f}  {t['name'][:80]}"
                for t in p.get("host_top", [])[:top]]
        out += [f"    cuda {t['s_per_step'] * 1e3:8.3f} ms  x{t['calls_per_step']:.0f}  {t['name'][:80]}"
                for t in p.get("host_api", [])[:top]]
    return out

