"""A/B the engine's decode switches on the GPU with `bench realmodel`'s cells, in one process:
SmolLM2's shapes with random bf16 weights (no GGUF to carry) or the real model, the package's
trained Forecast either way. One JSON per variant under --out-dir, each with its own Dense+ row,
so every ratio is taken within one run.

    python scripts/realmodel_variants.py --out-dir $OUT [--model smollm2.gguf] [--batches 1 8]

With random weights the selections (and so the miss rates) are not the real model's: the rows
rank the variants' step times, they are not the benchmark's claims.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

VARIANTS = {  # name: (implementations, copy_start)
    "one": ({}, "one"),
    "lanes": ({}, "lanes"),
    "triton_one": ({"copy_plan": "triton", "select": "triton"}, "one"),
    "triton_lanes": ({"copy_plan": "triton", "select": "triton"}, "lanes"),
}


class _Bytes:
    """Text as UTF-8 bytes (ids 1..255): real prompts' lengths without the model's tokenizer."""

    eos_ids = (0,)

    def encode(self, text):
        return [b if b else 1 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--model", help="a SmolLM2 GGUF (default: random weights of its shapes)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--systems", nargs="+", default=["dense_resident", "sparda"])
    p.add_argument("--contexts", nargs="+", type=int, default=[4096])
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparda_jax.bench.realmodel import bench_realmodel
    from sparda_jax.api import Pretrained, load_pretrained
    from sparda_jax.config import Implementations, get_preset
    from sparda_jax.model import init_params

    if args.model:
        model = load_pretrained(args.model, dtype=jnp.bfloat16)
    else:
        cfg = get_preset("smollm2-135m")
        model = Pretrained(cfg, init_params(cfg, jax.random.key(0), jnp.bfloat16), _Bytes(), dtype=jnp.bfloat16)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"{'variant':12s} {'system':16s} {'ctx':>5s} {'b':>2s} {'tok/s':>9s} {'/dense':>7s}", flush=True)
    for name in args.variants:
        impl, start = VARIANTS[name]
        t0 = time.perf_counter()
        r = bench_realmodel(model, systems=args.systems, contexts=args.contexts, batches=args.batches,
                            new_tokens=args.new_tokens, out=os.path.join(args.out_dir, f"variant_{name}.json"),
                            command="python " + " ".join(sys.argv), progress=False,
                            implementations=Implementations(**impl), copy_start=start)
        dense = {(x["context"], x["batch"]): x.get("steady_tokens_per_s") for x in r["rows"]
                 if x["system"] == "dense_resident"}
        for x in r["rows"]:
            tps, d = x.get("steady_tokens_per_s"), dense.get((x["context"], x["batch"]))
            ratio = f"{tps / d:7.3f}" if tps and d else "      -"
            print(f"{name:12s} {x['system']:16s} {x['context']:5d} {x['batch']:2d} "
                  f"{tps or float('nan'):9.1f} {ratio}  {x.get('status')} {x.get('error') or ''}", flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
