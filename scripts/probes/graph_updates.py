"""Which of the decode step's CUDA graphs XLA re-records at every step, and why (GPU probe).

At full depth SparDA's step ran as 33 command buffers, 17 of them re-recorded
(`command_buffer::update`) at every step (bench/results/decode_depth_graph.json, profile).
XLA re-records a graph when an allocation its commands use has a new address. This runs one
mode's engine step at minicpm4.1-8b shapes (few layers: the pattern repeats per layer) and
prints a marker line to stderr before each step, so that XLA's log lines
(TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_conversion_pass=2) can be told apart
by step: the warm-up steps record, the later ones show what moves. --same-inputs passes one
token and position buffer to every step, which tells whether the step's own inputs are what
moves; --no-staging reads the positions input directly in every layer, as the engine did before
`infer.engine._own_buffer`.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \\
      python3 scripts/probes/graph_updates.py --mode sparda --layers 4 --steps 6 2> log.txt
    python3 scripts/probes/graph_updates.py --summarize log.txt
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys

MARK = "=== graph_updates step "
_UPDATE = re.compile(r"Update command buffer.*?num_commands=(\d+); updated_allocs=(\d+)")
_EXECUTE = re.compile(r"Execute command buffer")


def summarize(lines) -> dict:
    """Per step (after each marker): graph executions, updates, and (commands, updated allocations) pairs."""
    steps, cur = {}, None
    for line in lines:
        if line.startswith(MARK):
            cur = int(line[len(MARK):].split()[0])
            steps[cur] = {"executions": 0, "updates": 0, "updated": collections.Counter()}
        elif cur is not None:
            m = _UPDATE.search(line)
            if m:
                steps[cur]["updates"] += 1
                steps[cur]["updated"][(int(m.group(1)), int(m.group(2)))] += 1
            elif _EXECUTE.search(line):
                steps[cur]["executions"] += 1
    return steps


_UPDATED = re.compile(r"Updated command buffer in (\d+) .*num_commands=(\d+)")


def update_costs(lines, min_commands: int = 100) -> dict:
    """Any XLA log with command_buffer_thunk=3 (no markers needed): per (graph's commands, moved
    allocations), the host microseconds of each re-recording of a graph of >= min_commands."""
    costs, moved = collections.defaultdict(list), {}
    for line in lines:
        m = _UPDATE.search(line)
        if m:
            moved[int(m.group(1))] = int(m.group(2))
            continue
        m = _UPDATED.search(line)
        if m and int(m.group(2)) >= min_commands:
            n = int(m.group(2))
            costs[(n, moved.get(n))].append(int(m.group(1)))
    return dict(costs)


def run(mode: str, layers: int, steps: int, batch: int, context: int, same_inputs: bool, staging: bool = True) -> None:
    import jax

    from sparda_jax.bench.decode import _build, _Ctx, _row_inputs, _stepper
    from sparda_jax.infer import engine

    if not staging:  # before the first trace of the step
        engine._own_buffer = lambda x: x

    ctx = _Ctx("minicpm4.1-8b", layers, (mode,), 0, lambda *a: None)
    state = _build(ctx, mode, context, batch)
    step = _stepper(ctx, mode, copy_impl=None, num_ctas=None)
    inputs = _row_inputs(ctx, context, batch, 0, steps)
    for i in range(steps):
        tok, pos = inputs[0 if same_inputs else i]
        print(f"{MARK}{i}", file=sys.stderr, flush=True)
        _, state, _ = step(tok, pos, state)
        jax.block_until_ready(state)
    print(f"{MARK}{steps} (end)", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="sparda")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--same-inputs", action="store_true", help="one token/position buffer for every step")
    p.add_argument("--no-staging", action="store_true", help="every layer reads the positions input itself")
    p.add_argument("--summarize", metavar="LOG", help="summarise a log written by a run instead")
    p.add_argument("--updates", metavar="LOG", help="the big graphs' re-recording costs in any such log")
    a = p.parse_args(argv)
    if a.updates:
        with open(a.updates, errors="replace") as f:
            for (n, k), us in sorted(update_costs(f).items(), key=lambda x: (x[0][0], x[0][1] or 0)):
                print(f"graph of {n} commands, {k} moved allocations: {len(us)} updates, "
                      f"median {statistics.median(us):.0f} us, max {max(us)}")
        return 0
    if a.summarize:
        with open(a.summarize, errors="replace") as f:
            for i, s in summarize(f).items():
                print(f"step {i}: {s['executions']} graph executions, {s['updates']} re-recorded; "
                      "(commands, moved allocations) x count: "
                      + ", ".join(f"{k} x{v}" for k, v in s["updated"].most_common(8)))
        return 0
    run(a.mode, a.layers, a.steps, a.batch, a.context, a.same_inputs, staging=not a.no_staging)
    return 0


if __name__ == "__main__":
    sys.exit(main())
