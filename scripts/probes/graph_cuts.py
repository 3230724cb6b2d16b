"""Which ops of an optimized XLA GPU module run outside its command buffers (CUDA graphs).

XLA's command-buffer pass wraps runs of graph-compatible ops of the entry computation into
`call`s of computations named command_buffer*; everything else in the entry is launched on
its own, each a cut between graphs. For each *after_optimizations.txt given, prints the
number of graphs and their sizes, the ops left outside (by opcode, custom calls by target)
and the start of the entry's schedule as a compact sequence.

    python3 scripts/probes/graph_cuts.py dump/*after_optimizations.txt

The XLA of jax 0.11.2 forms its graphs later, from thunks (command_buffer_conversion_pass): its
optimized HLO has no command_buffer computations, so there every op reads as outside (stage
`hlo-graphs` at 4ed2ee0). What it still shows is the schedule; for the graphs themselves use
the thunk sequence (`scripts/probes/graph_updates.py`, stage `graph-updates`).
"""

from __future__ import annotations

import collections
import re
import sys

# entries that launch nothing
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
         "partition-id", "replica-id"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLEE = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")


def computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines ("ENTRY" for the entry's)."""
    comps, name, body = {}, None, []
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and name is None:
            name, body = ("ENTRY" if head.group(1) else head.group(2)), []
        elif line.startswith("}") and name is not None:
            comps[name] = body
            name = None
        elif name is not None:
            body.append(line)
    return comps


def op_of(line: str) -> tuple[str, str] | None:
    m = _INSTR.match(line)
    if not m:
        return None
    op = m.group(2)
    if op == "custom-call":
        t = _TARGET.search(line)
        return op, f"custom-call[{t.group(1) if t else '?'}]"
    return op, op


def summarize(text: str, show: int = 80) -> dict:
    comps = computations(text)
    entry = comps.get("ENTRY", [])
    graphs, outside, seq = [], collections.Counter(), []
    for line in entry:
        o = op_of(line)
        if o is None or o[0] in _FREE:
            continue
        callee = _CALLEE.search(line)
        if o[0] == "call" and callee and "command_buffer" in callee.group(1):
            inner = [op_of(x) for x in comps.get(callee.group(1), [])]
            n = sum(1 for x in inner if x is not None and x[0] not in _FREE)
            graphs.append(n)
            seq.append(f"CB{n}")
        else:
            outside[o[1]] += 1
            seq.append(o[1].replace("custom-call", "cc"))
    return {"graphs": len(graphs), "ops_in_graphs": sum(graphs), "graph_sizes": graphs,
            "ops_outside": sum(outside.values()), "outside_by_op": dict(outside.most_common()),
            "schedule_head": seq[:show]}


def main(paths: list[str]) -> int:
    for p in paths:
        with open(p) as f:
            s = summarize(f.read())
        print(f"== {p.rsplit('/', 1)[-1][:100]}")
        print(f"   {s['graphs']} graphs holding {s['ops_in_graphs']} ops; {s['ops_outside']} ops outside")
        print("   graph sizes: " + " ".join(map(str, s["graph_sizes"][:60])))
        print("   outside: " + ", ".join(f"{k} x{v}" for k, v in list(s["outside_by_op"].items())[:25]))
        print("   schedule: " + " ".join(s["schedule_head"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
