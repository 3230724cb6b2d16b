"""Count the GPU kernels of one engine decode step without a GPU: compile the step for an H100
with XLA's deviceless GPU compiler and count the kernel-launching instructions of the decode
loop's body, attributed to the source line that made each one.

    python scripts/kernel_count.py --systems dense_resident sparse sparda --context 4096 \
        --batch 1 [--implementation copy_plan=triton] --out bench/results/realmodel/kernel_count.json

Needs jax's CUDA plugin beside the project's environment (not a project dependency; about 4 GB):
    python -m venv /tmp/gv && echo "import site; site.addsitedir('$PWD/.venv/lib/python3.X/site-packages')" \
        > /tmp/gv/lib/python3.X/site-packages/project.pth
    /tmp/gv/bin/pip install "jax-cuda13-plugin[with-cuda]==<jax's version>"   # then run with /tmp/gv/bin/python

What it measures: the launch count that the decode step's host time follows (docs/decisions.md,
"The real model's decode ratio follows its kernel count"). It is a proxy: without a device XLA
skips autotuning, and the profile on the GPU also counts memcpys; at e2ef356 it gave 565, 1379
and 1576 kernels a step for dense_resident, sparse and sparda against 616, 1460 and 1600 in
an H200 profile at 55fdccb (`realmodel/decode_profile.json`). Weights are random
(the shapes are SmolLM2's); the state comes from a CPU prefill of `--context` tokens.

The library picks backends from the default device, which is the CPU here: the script makes its
dispatch see an H100 (`hopper_gpu`, `on_cuda`, the default backend, Triton's GPU info) after the
CPU prefill and before the decode step is traced. Nothing runs on the "GPU".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"

# The H100 of the device machine, as XLA's GPU compiler describes a target
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# instructions that launch nothing
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
        "add-dependency", "partition-id", "replica-id"}


def parse_args(argv=None):
    from sparda_jax.cli import _implementation
    from sparda_jax.config import COPY_STARTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["dense_resident", "sparse", "sparda"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=7, help="decode steps per program (bench realmodel's default)")
    p.add_argument("--implementation", type=_implementation, nargs="+", default=[], metavar="OP=NAME")
    p.add_argument("--copy-start", choices=COPY_STARTS, default=COPY_STARTS[0], help="EngineConfig.copy_start")
    p.add_argument("--label", default="", help="a name for this configuration in the JSON")
    p.add_argument("--top", type=int, default=40, help="source lines kept per system")
    p.add_argument("--hlo-dir", help="also write each system's optimized HLO text here (<system>.hlo.txt)")
    p.add_argument("--out", required=True, help="JSON to write (rows are appended to an existing file)")
    return p.parse_args(argv)


class Hlo:
    """A compiled module's text: its computations, and the stack frames its metadata names."""

    def __init__(self, text: str):
        self.text = text
        self.comps: dict[str, list[str]] = {}
        cur = None
        for ln in text.split("\n"):
            m = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", ln)
            if m:
                cur = m.group(2)
                self.comps[cur] = []
                if m.group(1):
                    self.entry = cur
            elif ln == "}":
                cur = None
            elif cur and ln.startswith("  "):
                self.comps[cur].append(ln)
        self.frames = self._frames(text)

    @staticmethod
    def _frames(text: str):
        tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
        sec = None
        for ln in text.split("\n"):
            s = ln.strip()
            if s in tables:
                sec = s
                continue
            m = re.match(r"^(\d+) (.*)$", s)
            if sec and m:
                rest = m.group(2)
                kv = dict(re.findall(r"(\w+)=(\d+)", rest))
                tables[sec][int(m.group(1))] = kv if kv else rest.strip('"')
            elif s.startswith(("%", "ENTRY")):
                sec = None
        return tables

    def source(self, frame_id: int) -> str:
        """The innermost frame outside site-packages: "path:line:function"."""
        t, seen = self.frames, set()
        first = None
        while frame_id and frame_id not in seen:
            seen.add(frame_id)
            f = t["StackFrames"].get(frame_id)
            if not f:
                break
            loc = t["FileLocations"][int(f["file_location_id"])]
            path = t["FileNames"][int(loc["file_name_id"])]
            name = f"{path.split('/main/')[-1]}:{loc['line']}:{t['FunctionNames'][int(loc['function_name_id'])]}"
            first = first or name
            if "site-packages" not in path:
                return name
            frame_id = int(f["parent_frame_id"])
        return first or "?"

    def kernels(self, comp: str) -> list[tuple[str, str]]:
        """(op, source) of each kernel-launching instruction of `comp`, through calls and
        conditionals; a while counts as one (its body is counted apart)."""
        out = []
        for ln in self.comps[comp]:
            m = re.match(r"^\s+(ROOT )?%[\w.\-]+ = .*? ([a-z\-]+)\(", ln)
            if not m or m.group(2) in FREE:
                continue
            op = m.group(2)
            if op in ("call", "conditional"):
                for sub in re.findall(r"%([\w.\-]+)", ln.split("calls=")[-1] if "calls=" in ln else ln):
                    if sub in self.comps and sub != comp:
                        out += self.kernels(sub)
                continue
            if op == "custom-call":
                op = "custom-call:" + (re.search(r'custom_call_target="([^"]*)"', ln) or [None, "?"])[1]
            frame = re.search(r"stack_frame_id=(\d+)", ln)
            out.append((op, self.source(int(frame.group(1))) if frame else "?"))
        return out

    def loop_body(self) -> str:
        whiles = [ln for ln in self.comps[self.entry] if " while(" in ln]
        if len(whiles) != 1:
            raise RuntimeError(f"expected the decode loop as the entry's one while, found {len(whiles)}")
        return re.search(r"body=%([\w.\-]+)", whiles[0]).group(1)


def pretend_h100():
    """Make the library's dispatch see an H100 as the default device (module docstring)."""
    import jax

    import sparda_jax.kernels.kv_copy.cuda as cuda
    import sparda_jax.ops._dispatch as dispatch
    from jax._src.pallas.triton import pallas_call_registration as triton_lowering

    dispatch.hopper_gpu.__code__ = (lambda: True).__code__  # every module's imported name sees it
    cuda.on_cuda = lambda dev=None: True
    jax.default_backend = lambda: "gpu"
    triton_lowering.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability="9.0"))


def prefilled(system: str, args, implementations, cfg, params, forecast):
    """(run, state) of a decode step after a CPU prefill of `--context` tokens: the static plan
    (the resident systems'; an offload system's is made in `count_system`) and the state."""
    import jax.numpy as jnp
    import numpy as np

    from sparda_jax.config import Implementations
    from sparda_jax.infer import engine as E

    b, t = args.batch, args.context
    resident = system in E.RESIDENT_SYSTEMS
    cpu = E.EngineConfig(system, implementations=Implementations() if resident else Implementations(kv_copy="xla"))
    _, st = E.engine_prefill(params, jnp.ones((b, t), jnp.int32), jnp.full((b,), t, jnp.int32), cfg, cpu,
                             cache_size=t + 64, forecast=forecast, dtype=jnp.bfloat16)
    if not resident:
        return None, st
    positions = np.tile(np.arange(t, t + args.steps)[:, None], (1, b)).astype(np.int32)
    eng = E.EngineConfig(system, implementations=Implementations(**implementations))
    return E.resolve(params, positions, st, cfg, eng, forecast=forecast, dtype=jnp.bfloat16)


def count_system(system: str, args, implementations, cfg, params, forecast, run, st) -> dict:
    """The kernels of one decode step of `system` (after `pretend_h100`)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from sparda_jax.config import Implementations
    from sparda_jax.infer import engine as E
    from sparda_jax.pipeline import Plan

    b, t, n = args.batch, args.context, args.steps
    topo = topologies.get_topology_desc(platform="cuda", target_config=H100, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("d",))
    dev, host = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    abstract = lambda tree, s=dev: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree)
    if system in E.RESIDENT_SYSTEMS:
        state = abstract(st)
    else:
        from sparda_jax.kernels.kv_copy.cuda import register

        register("cuda")  # builds the copy library with nvcc: its targets must exist to compile
        eng = E.EngineConfig(system, implementations=Implementations(**{"kv_copy": "cuda", **implementations}),
                             copy_start=args.copy_start)
        run = E._Run(Plan(cfg, eng.selector, False, jnp.dtype(jnp.bfloat16), eng.implementations), eng, "cuda", 16)
        state = st.replace(l0=abstract(st.l0), host=abstract(st.host, host), layers=abstract(st.layers))
    lowered = E._engine_decode_loop.jitted.lower(
        abstract(params), jax.ShapeDtypeStruct((b,), jnp.int32, sharding=dev),
        jax.ShapeDtypeStruct((n, b), jnp.int32, sharding=dev), state, abstract(forecast), None,
        jax.ShapeDtypeStruct((n, 2), jnp.uint32, sharding=dev), run=run, sampling=(0.0, 1.0))
    text = lowered.compile().as_text()
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"{system}.hlo.txt"), "w") as f:
            f.write(text)
    hlo = Hlo(text)
    body = hlo.kernels(hlo.loop_body())
    by_op = collections.Counter(op.split(":")[0] if op.startswith("fusion") else op for op, _ in body)
    by_source = collections.Counter(src for _, src in body)
    return {"system": system, "context": t, "batch": b, "kernels_per_step": len(body),
            "kernels_per_layer": round(len(body) / cfg.num_layers, 2), "by_op": dict(by_op.most_common()),
            "by_source": dict(by_source.most_common(args.top))}


def _dirty_besides(out: str, dirty: bool | None) -> bool | None:
    """The tree's tracked changes other than `out`, the JSON this script appends to (counting two
    configurations one after the other must not mark the second as dirty)."""
    import subprocess

    if not dirty:
        return dirty
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                        f":!{os.path.relpath(os.path.abspath(out), root)}"], cwd=root, capture_output=True, text=True)
    return bool(r.stdout.strip()) if r.returncode == 0 else dirty  # an out outside the tree: as git said


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from sparda_jax.config import get_preset
    from sparda_jax.envinfo import environment
    from sparda_jax.forecast import init_forecast
    from sparda_jax.model import init_params, layered_params

    cfg = get_preset("smollm2-135m")
    params = layered_params(init_params(cfg, jax.random.key(0), jax.numpy.bfloat16))
    forecast = init_forecast(cfg, jax.random.key(2), jax.numpy.bfloat16)
    env = environment()  # before the dispatch is made to see a GPU
    impl = dict(args.implementation)
    # every CPU prefill before the dispatch is made to see a GPU
    states = {system: prefilled(system, args, impl, cfg, params, forecast) for system in args.systems}
    pretend_h100()
    rows = []
    for system in args.systems:
        r = count_system(system, args, impl, cfg, params, forecast, *states[system])
        r.update(label=args.label, implementations=dict(args.implementation), copy_start=args.copy_start,
                 commit=env["commit"], dirty=_dirty_besides(args.out, env["dirty"]))
        print(f"{system:16s} {r['kernels_per_step']:5d} kernels a step ({r['kernels_per_layer']} a layer)", flush=True)
        rows.append(r)
    doc = {"name": "kernel_count", "definitions": {
        "kernels_per_step": "kernel-launching instructions (fusions, custom calls, copies) of the decode loop's "
                            "body in XLA's deviceless H100 compile: one decode step",
        "kernels_per_layer": "kernels_per_step / the model's layers",
        "by_source": "kernels per source line that made them (the innermost frame outside site-packages)"},
        "target": "NVIDIA H100 (deviceless: no autotuning)",
        "model": "smollm2-135m shapes, random bf16 weights", "environment": env, "rows": []}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    doc["rows"] += rows
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
