"""Execute a notebook top to bottom and keep its outputs: the copy a reader opens under
notebooks/executed/ (the notebooks in notebooks/ are stored without outputs).

    python scripts/execute_notebook.py notebooks/offload_gpu.ipynb $OUT/notebooks

Writes DEST/<name>.ipynb (outputs kept, with the commit and device in its metadata) and the
figures the notebook saves (it runs with DEST as its working directory). Exits 1 if a cell fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("dest", type=Path, help="folder for the executed copy and its figures")
    ap.add_argument("--timeout", type=int, default=900, help="seconds a cell may run")
    args = ap.parse_args()
    import nbclient
    import nbformat

    if not args.notebook.is_file():
        raise SystemExit(f"no notebook at {args.notebook}")
    nb = nbformat.read(args.notebook, as_version=4)
    args.dest.mkdir(parents=True, exist_ok=True)
    client = nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(args.dest)}})
    t0 = time.perf_counter()
    failed = None
    try:
        client.execute(cwd=str(args.dest))
    except nbclient.exceptions.CellExecutionError as e:
        failed = e
    import jax

    nb.metadata["sparda_execution"] = {"commit": os.environ.get("SPARDA_COMMIT", "unknown"),
                                       "device": jax.devices()[0].device_kind,
                                       "seconds": round(time.perf_counter() - t0, 1)}
    out = args.dest / args.notebook.name
    nbformat.write(nb, out)
    print(f"{out}: {nb.metadata['sparda_execution']}")
    if failed is not None:
        print(f"a cell failed: {str(failed)[-2000:]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
