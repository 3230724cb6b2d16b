"""Where a decode layer's time goes, from a committed device trace (bench.profile.layer_breakdown).

    .venv/bin/python scripts/probes/layer_breakdown.py \\
        bench/results/profiles/decode_sparda_T131072_B8_doorbell16_2e96975.trace.json.gz \\
        --out bench/results/layer_breakdown_2e96975.json

The JSON names the trace and the commit it was taken at (the last 7-40 hex digits of its name)."""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys

from sparda_jax.bench.profile import KERNEL_KINDS, after_copy, layer_breakdown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--marker", default="doorbell_wait_kernel")
    p.add_argument("--out")
    a = p.parse_args(argv)
    with gzip.open(a.trace) as f:
        trace = json.load(f)
    r = layer_breakdown(trace, a.marker)
    r["scatters_after_copy"] = after_copy(trace, "scatter")
    m = re.search(r"_([0-9a-f]{7,40})\.trace\.json\.gz$", a.trace)
    r.update(trace=a.trace, trace_commit=m.group(1) if m else None, kinds={k: list(v) for k, v in KERNEL_KINDS},
             command=" ".join(["scripts/probes/layer_breakdown.py"] + sys.argv[1:]))
    print(json.dumps(r["median_us"]), json.dumps(r["scatters_after_copy"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
