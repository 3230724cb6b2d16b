"""Does the new token's write into its cache slot cost less when the slot is computed once?

In the 16-layer doorbell trace (2e96975) the two scatters that write the new token's K and V into
their slot took 9.8 and 6.0 us of each layer, for 16 rows of 128 values. One reading: XLA fuses the
slot's computation (a sum over the 96 selected ids) into each scatter, so every thread of both
scatters recomputes it. `--variant barrier` materializes the slot first (an optimization barrier),
which leaves the scatters only their stores; `--variant as-is` runs the engine unchanged. The
rest of the arguments go to `sparda bench decode`, so the two variants run one after the other in
separate processes, in one device call (stage `write-token-ab`).

    python3 scripts/probes/write_token_ab.py --variant barrier -- --lengths 131072 --batches 8 ...
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax


def _slot_behind_barrier(slots, ids, pos, bs: int):
    """infer.engine._own_slot, materialized before the scatters that use it."""
    from sparda_jax.infer.engine import _own_slot

    return jax.lax.optimization_barrier(_own_slot(slots, ids, pos, bs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["as-is", "barrier"], required=True)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then `sparda bench decode` arguments")
    a = p.parse_args()
    if a.variant == "barrier":
        from sparda_jax.infer import engine

        # looked up when the step is traced
        engine._write_token = functools.partial(engine._write_token, slot_of=_slot_behind_barrier)
    from sparda_jax.cli import main as cli

    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    return cli(["bench", "decode", *rest])


if __name__ == "__main__":
    sys.exit(main())
