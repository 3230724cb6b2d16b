"""The decode step's copy plan (slot assignment and copy task lists) with one `implementation=`
argument.

Backends (default order "xla"):
  "xla"              `plan_copies_reference`, jnp (any platform);
  "triton"           one Pallas Triton kernel on a CUDA GPU (`triton.py`);
  "triton_interpret" the same kernel under Pallas' interpreter (CPU; tests).
The kernel is not in the default order until its compiled test and a decode timing on the GPU
have run (docs/decisions.md, "The copy plan as one kernel").
"""

from __future__ import annotations

import jax

from .._dispatch import Registry
from .reference import CopyPlan, check_plan, plan_copies_reference

__all__ = ["plan_copies", "BACKENDS", "DEFAULT_ORDER"]

BACKENDS = Registry("copy_plan")
DEFAULT_ORDER = ("xla",)


@BACKENDS.register("xla")
def _xla(table, wanted, src_offset, *, n_blocks):
    return plan_copies_reference(table, wanted, src_offset, n_blocks=n_blocks)


def _triton(interpret: bool):
    def run(table, wanted, src_offset, *, n_blocks):
        if not interpret and jax.default_backend() != "gpu":
            raise NotImplementedError("the Triton copy plan needs a GPU (or 'triton_interpret')")
        check_plan(table, wanted, src_offset, n_blocks)
        from .triton import plan_copies_triton

        return plan_copies_triton(table, wanted, src_offset, n_blocks=n_blocks, interpret=interpret)

    return run


BACKENDS.register("triton")(_triton(False))
BACKENDS.register("triton_interpret")(_triton(True))


def plan_copies(table, wanted, src_offset=0, *, n_blocks: int, implementation: str | None = None) -> CopyPlan:
    """The copy plan of one decode step: table int32 [B, K, S] (block id per slot, -1 empty),
    wanted int32 [B, K, N] (ascending unique block ids, -1 padded; N <= S), src_offset an int
    scalar (where the layer's rows start in the host pool), n_blocks the pool's blocks per
    (sequence, KV head). -> `CopyPlan` (see `reference`).

    implementation: "xla" | "triton" | "triton_interpret" (module docstring), or None: the first
    of DEFAULT_ORDER that runs here. Raises NotImplementedError if the named backend cannot run.
    """
    return BACKENDS(implementation, DEFAULT_ORDER, table, wanted, src_offset, n_blocks=n_blocks)
