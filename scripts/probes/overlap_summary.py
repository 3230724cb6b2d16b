"""The overlap probe's runs (JSON lines: a header, then one case a line) -> $OUT/overlap_probe.json
and a table per run. Usage: overlap_summary.py RUN.jsonl ... (the run's name from the file name)."""
import json
import os
import sys


def load(path):
    head, cases = None, []
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            print(f"{path}: skipped a line that is not JSON: {line[:80]}")
            continue
        if d.get("header"):
            head = d
        else:
            cases.append(d)
    name = os.path.basename(path).removeprefix("overlap_probe_").removesuffix(".jsonl")
    return dict(head or {}, run=name, cases=cases)


def table(d):
    out = [f"\nrun {d['run']}: CUDA_DEVICE_MAX_CONNECTIONS '{d.get('CUDA_DEVICE_MAX_CONNECTIONS', '?')}', "
           f"pool {d.get('pool_mib', '?')} MiB, {d.get('sms', '?')} SMs, driver {d.get('driver', '?')}",
           f"{'case':17} {'work':26} {'cp':>2} {'ctas':>4} {'first':>5} {'copy ms':>8} {'work ms':>8} {'total':>8} "
           f"{'/max':>6} {'/sum':>6}"]
    alone = {(c["case"], c["work"], c["ctas"]): c for c in d["cases"]}
    for c in d["cases"]:
        line = (f"{c['case']:17} {c['work']:26} {c['copies']:2d} {c['ctas']:4d} {str(c['copy_first'])[0]:>5} "
                f"{c['copy_ms']:8.3f} {c['work_ms']:8.3f} {c['total_ms']:8.3f}")
        ref = None
        try:
            if c["case"].startswith("together"):
                ref = (alone[("copy_alone", "none", c["ctas"])]["copy_ms"], alone[("work_alone", c["work"], 16)]["work_ms"])
            elif c["case"] in ("two_spins", "spin_and_copy"):
                sp = alone[("spin_alone", "spin", 1)]["work_ms"]
                ref = (sp, sp) if c["case"] == "two_spins" else (alone[("copy_alone", "none", 16)]["copy_ms"], sp)
        except KeyError:  # a run cut short: its reference case is missing
            ref = None
        if ref:
            line += f" {c['total_ms'] / max(ref):6.2f} {c['total_ms'] / sum(ref):6.2f}"
        out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    runs = [load(p) for p in sys.argv[1:]]
    json.dump({"name": "overlap_probe", "commit": os.environ.get("SPARDA_COMMIT"),
               "command": "scripts/probes/overlap_probe.sh", "runs": runs},
              open(os.path.join(os.environ.get("OUT", "."), "overlap_probe.json"), "w"), indent=1)
    for d in runs:
        print(table(d))
