"""The GPU runs that back the README's claims, as named specs (data), and one command that runs them.

    python -m sparda_jax.bench.specs --list
    python -m sparda_jax.bench.specs NAME [NAME ...] [--out DIR]

Each spec is a `sparda` CLI command (or the GPU-marked tests) with its timeout; its result goes to
`DIR/<benchmark>/<name>.json` (DIR: --out, else $OUT, else ./out), its log beside it as `<name>.log`,
and a run record (command, exit status, seconds) as `<name>.run.json`. Every spec ends well inside
the device tool's 10 minutes a command. Engine choices are left at the engine's defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Spec:
    """One named GPU run.

    name: unique, the command line's handle. benchmark: the results folder (`bench` subcommand,
    "eval" or "gpu_tests"). argv: the `sparda` CLI arguments without --out (None for the GPU
    tests, which run pytest). timeout_s: the run is killed past it. claim: what it backs.
    env: variables set for the run. needs_model: needs SPARDA_SMOLLM2_GGUF (SmolLM2's GGUF).
    """

    name: str
    benchmark: str
    argv: tuple[str, ...] | None
    timeout_s: int
    claim: str
    env: tuple[tuple[str, str], ...] = ()
    needs_model: bool = False

    def out_path(self, out_dir: str | os.PathLike) -> Path:
        """Where the run's JSON goes: `<out_dir>/<benchmark>/<name>.json`."""
        return Path(out_dir) / self.benchmark / f"{self.name}.json"

    def command(self, out_dir: str | os.PathLike) -> list[str]:
        """The full command (with this interpreter) writing its JSON under `out_dir`."""
        out = str(self.out_path(out_dir))
        if self.argv is None:  # the GPU tests: pytest's JUnit report, and the run record, are the results
            return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rf", "-p", "no:cacheprovider", "tests",
                    f"--junitxml={out[:-len('.json')]}.xml"]
        return [sys.executable, "-m", "sparda_jax.cli", *self.argv, "--out", out]


_HIGHEST = (("JAX_DEFAULT_MATMUL_PRECISION", "highest"),)
# the batch-8 claim's rows: 128K, every one of the 32 layers timed, 8 decode steps in one program
_FULL32 = ("--lengths", "131072", "--batches", "8", "--layers", "32", "--repeats", "12", "--steps-per-call", "8")
# SmolLM2's block miss rates per system (measured by `decode-real-model`)
_SMOL_MISS = ("--real-miss-rate", "sparse=0.122", "sparda=0.086")
_EVAL = ("eval", "--suite", "tasks", "--samples", "20")

SPECS: tuple[Spec, ...] = (
    Spec("gpu-tests", "gpu_tests", None, 540, "every GPU-marked test passes (kernels, copy engine, engine, cuDNN)",
         env=_HIGHEST),
    Spec("attention-prefill", "attention",
         ("bench", "attention", "--prefill-only", "--query-correlation", "0.99", "--variants", "cudnn", "mosaic_gpu"),
         300, "prefill attention kernel vs cuDNN's TFLOP/s on selections as alike as SmolLM2's"),
    Spec("attention-decode", "attention",
         ("bench", "attention", "--decode-only", "--decode-batches", "16", "64", "--decode-steps", "32",
          "--variants", "mosaic_gpu", "--repeats", "10"),
         300, "decode attention kernel's fraction of the HBM copy rate, 32K-128K, batch 16 and 64"),
    Spec("attention-train", "attention",
         ("bench", "attention", "--train-only", "--query-correlation", "0.99", "--budget-s", "330"), 480,
         "block-sparse attention forward + backward (Mosaic and jnp backward) vs cuDNN's at 32K-128K, batch 4, "
         "after a gradient check of each sparse variant; goal >= 3x cuDNN at 128K"),
    Spec("copy", "copy", ("bench", "copy", "--repeats", "10", "--sizes", "1", "8", "32"), 300,
         "host-to-device gather bandwidth of the KV copy (UVA gather vs bulk copy)"),
    Spec("select", "select", ("bench", "select", "--budget-s", "420"), 540,
         "Forecast vs InfLLM-V2 selectors: speedup and share of the layer's attention time, prefill and decode"),
    Spec("prefill", "prefill", ("bench", "prefill", "--lengths", "131072", "--budget-s", "190",
                                "--input-correlation", "0.999"), 300,
         "prefill tokens/s at 128K, batch 4: SparDA / Sparse and SparDA / Dense+ (Table 3)"),
    Spec("decode-real-model", "decode", ("bench", "decode", "--real-model", "smollm2-135m"), 400,
         "decode systems vs batch at 128K with SmolLM2's measured block miss rates (Table 4)", needs_model=True),
    Spec("decode-claims8", "decode",
         ("bench", "decode", *_FULL32, "--systems", "sparse", "sparda", "--reuse-fractions", "0.62", *_SMOL_MISS,
          "--budget-s", "500"), 580,
         "SparDA / Sparse at batch 8, full depth: random traffic, the peak miss rate, SmolLM2's miss rates"),
    Spec("decode-split8", "decode",
         ("bench", "decode", *_FULL32, "--systems", "sparse", "sparda", "sparse_resident", "sparda_sync",
          "--reuse-fractions", "0.62", "--budget-s", "520"), 590,
         "the batch-8 ratio split: selector (SparDA-no-prefetch / Sparse), prefetch, SparDA / Sparse+"),
    Spec("decode-split4", "decode",
         ("bench", "decode", "--lengths", "131072", "--batches", "4", "--layers", "32", "--repeats", "12",
          "--steps-per-call", "8", "--systems", "sparse", "sparda", "sparse_resident", "sparda_sync",
          "--reuse-fractions", "--budget-s", "480"), 560,
         "the batch-4 split on random traffic (the paper's batch 4, Table 10)"),
    Spec("decode-resident", "decode",
         ("bench", "decode", "--systems", "dense_resident", "sparse_resident", "infinigen", "--batches", "4", "8", "16",
          "--budget-s", "260"), 330, "Dense+, Sparse+ and InfiniGen decode tokens/s at 128K, batch 4-16"),
    Spec("cta", "cta", ("bench", "cta", "--repeats", "16", "--budget-s", "150"), 260,
         "decode tokens/s vs the copy's CTA quota at 32K (Table 7)"),
    Spec("train-32k", "train", ("bench", "train", "--preset", "minicpm4.1-8b", "--seq-len", "32768", "--repeats", "3",
                                "--data-devices", "0"), 420,
         "the 8B model's Forecast training step at 32K: its time on one GPU, and where the machine has more, "
         "data parallel on all of them with the scaling"),
    Spec("train-64k", "train", ("bench", "train", "--preset", "minicpm4.1-8b", "--seq-len", "65536", "--repeats", "2"),
         400, "the 8B model's Forecast training step at the paper's 64K"),
    # the budget counts from the command's start (load, calibration included); a cell started before it
    # ends (an offload system's cold compile included) well before the timeout
    Spec("realmodel", "realmodel", ("bench", "realmodel", "--budget-s", "240", "--first-token", "dense_resident",
                                    "sparda"), 540,
         "SmolLM2 through generate, 4K/8K x batch 1/8, every system: steady decode and prefill, the first call "
         "apart; SparDA / Dense+ steady decode at 4K batch 1; `sparda generate` cold and warm in fresh processes",
         needs_model=True),
    Spec("eval-tasks-2k", "eval", (*_EVAL, "--lengths", "2048"), 580,
         "SmolLM2 accuracy table, every task and mode, at 2K", env=_HIGHEST, needs_model=True),
    Spec("eval-tasks-4k", "eval", (*_EVAL, "--lengths", "4096"), 580,
         "SmolLM2 accuracy table, every task and mode, at 4K", env=_HIGHEST, needs_model=True),
    Spec("eval-tasks-8k-a", "eval", (*_EVAL, "--lengths", "8064", "--tasks", "niah_single", "niah_multikey",
                                     "niah_multivalue", "niah_multiquery"), 580,
         "SmolLM2 accuracy table at 8K (8064 with the answer), the needle tasks", env=_HIGHEST, needs_model=True),
    Spec("eval-tasks-8k-b", "eval", (*_EVAL, "--lengths", "8064", "--tasks", "vt", "cwe", "fwe", "copy"), 580,
         "SmolLM2 accuracy table at 8K (8064 with the answer), the other tasks", env=_HIGHEST, needs_model=True),
)

BY_NAME: dict[str, Spec] = {s.name: s for s in SPECS}


def run_spec(spec: Spec, out_dir: str | os.PathLike) -> int:
    """Run `spec`, its output under `out_dir/<benchmark>/`; returns its exit status (124 on timeout).
    Prints the log's last lines; writes `<name>.log` and `<name>.run.json`."""
    folder = spec.out_path(out_dir).parent
    folder.mkdir(parents=True, exist_ok=True)
    cmd = spec.command(out_dir)
    log = folder / f"{spec.name}.log"
    env = {**os.environ, **dict(spec.env)}
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=spec.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = time.monotonic() - t0
    tail = log.read_text(errors="replace").splitlines()[-30:]
    record = {"spec": spec.name, "benchmark": spec.benchmark, "claim": spec.claim, "command": cmd,
              "env": dict(spec.env), "returncode": rc, "seconds": round(seconds, 1), "timeout_s": spec.timeout_s,
              "commit": os.environ.get("SPARDA_COMMIT"), "log_tail": tail}
    (folder / f"{spec.name}.run.json").write_text(json.dumps(record, indent=1))
    print(f"== {spec.name}: rc {rc} in {seconds:.0f} s -> {spec.out_path(out_dir)}")
    print("\n".join(tail[-15:]))
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparda_jax.bench.specs", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", metavar="NAME", help="specs to run, in order")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="results folder (default $OUT, else ./out)")
    p.add_argument("--list", action="store_true", help="print every spec's name, timeout and command")
    args = p.parse_args(argv)
    if args.list or not args.names:
        for s in SPECS:
            print(f"{s.name:18s} {s.timeout_s:4d} s  {' '.join(s.argv) if s.argv else 'pytest -m gpu tests'}")
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown spec(s) {unknown}; known: {list(BY_NAME)}")
    missing = [n for n in args.names if BY_NAME[n].needs_model and not os.environ.get("SPARDA_SMOLLM2_GGUF")]
    if missing:
        print(f"warning: {missing} need SmolLM2's GGUF (SPARDA_SMOLLM2_GGUF unset)", file=sys.stderr)
    rcs = [run_spec(BY_NAME[n], args.out) for n in args.names]
    return max(rcs, default=0)


if __name__ == "__main__":
    sys.exit(main())
