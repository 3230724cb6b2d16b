"""Where XLA scheduled the copy engine's calls: the ENTRY computation of each optimized HLO module
in a dump folder (`--xla_dump_to=DIR --xla_dump_hlo_as_text`), in schedule order, as one line of
symbols; and, for modules dumped before copy insertion (`--xla_dump_hlo_pass_re=copy-insertion`),
how many starts an optimization barrier orders. Usage: hlo_order.py DIR [--all] (only modules
with copy starts unless --all).

  S<lane>   sparda_gather_start on a lane (S* with K and V in one start)
  W         sparda_gather_wait               G   sparda_gather_blocks (synchronous)
  M<id>     sparda_mark                      |   opt-barrier
  gemm      cuBLAS / cuBLASLt custom call    tgemm  a Triton GEMM fusion    dot  another dot fusion
  f         any other fusion or kernel       COPY   a copy XLA inserted (COPY! when it copies a
            buffer a start wrote and its wait has not yet taken: it would read it mid-copy)
"""

from __future__ import annotations

import pathlib
import re
import sys

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape", "broadcast", "iota"}


def _entry(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            lines.append(line)
    return lines


def _symbol(opcode: str, rest: str, rtype: str) -> str | None:
    if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        if target == "sparda_gather_start":  # several results: K and V in one start
            lane = re.search(r"lane = (\d+)", rest)
            return "S*" if rtype.lstrip().startswith("(") else f"S{lane.group(1) if lane else '?'}"
        return {"sparda_gather_wait": "W", "sparda_gather_blocks": "G", "sparda_scatter_blocks": "scatter",
                "sparda_gather_dma_start": "Sdma"}.get(target) or (
            f"M{re.search(r'id = (-?\d+)', rest).group(1)}" if target == "sparda_mark" else
            "gemm" if "cublas" in target else f"cc:{target}")
    if opcode == "fusion":
        if "__triton_gemm" in rest or "triton_gemm" in rest:
            return "tgemm"
        if "__cublas" in rest:
            return "gemm"
        return "dot" if ("dot_general" in rest or "__ynn_fusion" in rest) else "f"
    if opcode in ("copy", "copy-start"):
        return "COPY"
    if opcode == "opt-barrier":
        return "|"
    if opcode in _SKIP or opcode == "copy-done":
        return None
    return "f"


def order(text: str) -> tuple[list[str], dict]:
    """The ENTRY's schedule as symbols, and counts; COPY! for a copy of a started buffer."""
    started, out = set(), []
    for line in _entry(text):
        m = _INSTR.match(line)
        if not m:
            continue
        name, rtype, opcode, rest = m.groups()
        sym = _symbol(opcode, rest, rtype)
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        if opcode == "get-tuple-element" and operands and operands[0] in started:
            started.add(name)  # an element of a start's result is a started buffer too
        if sym and sym.startswith("S"):
            started.add(name)
        if sym == "W":
            started.difference_update(operands)
        if sym == "COPY" and any(o in started for o in operands):
            sym = "COPY!"
        if sym:
            out.append(sym)
    counts = {}
    for s in out:
        counts[s] = counts.get(s, 0) + 1
    return out, counts


def unordered_starts(text: str) -> tuple[int, list[str]]:
    """(starts, the names of those not ordered by an optimization barrier): a start is ordered
    when a slice of its result reaches an opt-barrier (through slices, bitcasts, fusions, tuples),
    as `_after_start` arranges. Run on a module before copy insertion (`--xla_dump_hlo_pass_re=
    copy-insertion`): later passes remove the barriers. XLA drops barrier outputs that nothing
    uses, and a start whose slice was dropped may be scheduled anywhere before its wait."""
    users, op, starts = {}, {}, []
    for line in _entry(text):
        m = _INSTR.match(line)
        if not m:
            continue
        name, _, opcode, rest = m.groups()
        op[name] = opcode
        for o in set(re.findall(r"%([\w.\-]+)", rest.split("), ")[0])):
            users.setdefault(o, []).append(name)
        if opcode == "custom-call" and 'custom_call_target="sparda_gather_start"' in rest:
            starts.append(name)
    passing = {"fusion", "slice", "bitcast", "tuple", "get-tuple-element", "reshape", "opt-barrier"}
    unordered = []
    for st in starts:
        seen, todo, ok = set(), [st], False
        while todo and not ok:
            for u in users.get(todo.pop(), []):
                if u in seen or op.get(u) not in passing:
                    continue
                ok = op[u] == "opt-barrier"
                seen.add(u)
                todo.append(u)
        if not ok:
            unordered.append(st)
    return len(starts), unordered


def _compact(seq: list[str]) -> str:
    """Runs of plain kernels shown as f*n, so the copy calls stand out."""
    parts, run = [], 0
    for s in seq:
        if s == "f":
            run += 1
            continue
        if run:
            parts.append("f" if run == 1 else f"f*{run}")
            run = 0
        parts.append(s)
    if run:
        parts.append("f" if run == 1 else f"f*{run}")
    return " ".join(parts)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    show_all = "--all" in argv
    folder = pathlib.Path([a for a in argv if a != "--all"][0])
    files = sorted(folder.rglob("*after_optimizations.txt"))
    if not files:
        print(f"no *after_optimizations.txt under {folder}")
        return 1
    for f in files:
        seq, counts = order(f.read_text())
        if not show_all and not any(s.startswith("S") for s in seq):
            continue
        print(f"{f.name}: {counts}")
        print("  " + _compact(seq))
    for f in sorted(folder.rglob("*before_copy-insertion.txt")):
        n, bad = unordered_starts(f.read_text())
        if n:
            print(f"{f.name}: {n - len(bad)} of {n} starts ordered by a barrier" + (f"; not: {bad}" if bad else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
