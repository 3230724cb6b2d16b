"""One dispatch for every op: a registry of named backends tried in a default order.

A backend is a function with the op's signature that raises NotImplementedError (before doing
any work) when it cannot run the inputs on this platform: wrong dtype or head dim, no Hopper
GPU. `implementation=None` tries the default order and takes the first backend that does not
raise it; a name runs that backend alone and lets its NotImplementedError through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from sparda_jax.config import IMPLEMENTATION_NAMES

__all__ = ["Registry", "hopper_gpu", "interpret_params", "lowered_once"]


def hopper_gpu() -> bool:
    """The default device is a Hopper GPU (compute capability 9.x), where the Mosaic GPU kernels
    run (wgmma, TMA)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def lowered_once(*static_argnames: str):
    """A Mosaic kernel's entry point as `jax.jit` with these static arguments: called at many
    sites of one program (layers unrolled in Python), it is traced and lowered once, and every
    site carries the same kernel module. Pallas names each lowering's kernel apart, so without
    it each site was a distinct kernel, lowered in Python and compiled by the GPU runtime on its
    first call, once per layer (docs/decisions.md, "One kernel module per op and shape")."""
    return lambda fn: jax.jit(fn, static_argnames=static_argnames)


def interpret_params(implementation: str):
    """`plgpu.InterpretGPUParams()` for "mosaic_gpu_interpret", None (compiled) otherwise."""
    if implementation != "mosaic_gpu_interpret":
        return None
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams()


class Registry:
    """The backends of one op (`op` is a key of `sparda_jax.config.IMPLEMENTATION_NAMES`); each
    registered name must be one of that op's names."""

    def __init__(self, op: str):
        if op not in IMPLEMENTATION_NAMES:
            raise KeyError(f"unknown op {op!r}; one of {tuple(IMPLEMENTATION_NAMES)}")
        self.op = op
        self.backends: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        if name not in IMPLEMENTATION_NAMES[self.op]:
            raise ValueError(f"{self.op}: {name!r} is not one of {IMPLEMENTATION_NAMES[self.op]}")

        def add(fn: Callable) -> Callable:
            self.backends[name] = fn
            return fn

        return add

    def __call__(self, implementation: str | None, order: Sequence[str], *args, **kwargs):
        """Run `implementation`, or with None the first backend of `order` that supports the inputs."""
        if implementation is not None:
            if implementation not in self.backends:
                raise ValueError(f"unknown {self.op} implementation {implementation!r}; "
                                 f"one of {tuple(self.backends)}")
            return self.backends[implementation](*args, **kwargs)
        reasons = []
        for name in order:
            try:
                return self.backends[name](*args, **kwargs)
            except NotImplementedError as e:
                reasons.append(f"{name}: {e}")
        raise NotImplementedError(f"no {self.op} backend supports these inputs: " + "; ".join(reasons))
