"""The shared base of the kernel tests (tests/test_kernel_*.py): what each test level can run
(capabilities), the tolerances with their reasons, and the checks every kernel test makes.

Three levels, as every Mosaic GPU kernel has them:
- interpret: the kernel under Pallas' Mosaic GPU interpreter on the CPU (`INTERPRET`), random
  inputs against the op's jnp reference;
- lowering: the compiled form lowered for sm_90 on the CPU (`lower_for_hopper`): layouts, TMA
  shapes, wgmma rules and the SMEM budget, without a GPU;
- compiled: on a GPU, marked `gpu` (conftest.py skips those without one).
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

# ------------------------------------------------------------------------------ capabilities

INTERPRET = plgpu.InterpretGPUParams()
gpu = pytest.mark.gpu  # compiled on a CUDA GPU; skipped without one


def interpret(*, detect_races: bool = False):
    """Interpreter parameters; detect_races runs the interpreter's race detector."""
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def mosaic_kernel_modules(lowered) -> int:
    """How many distinct Mosaic GPU kernel modules a lowered program carries (each is compiled by
    the GPU runtime on its first call)."""
    return len(set(re.findall(r'kernel_hash = "([^"]*)"', lowered.as_text())))


def lower_for_hopper(fn, *args, **kwargs):
    """Trace `fn` under jit and lower it for CUDA: the Mosaic GPU lowering for sm_90 runs on the CPU."""
    return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


# -------------------------------------------------------------------------------- tolerances

# The attention kernels round P to q's dtype before the PV matmul and round their output; the
# plain jnp path in q's dtype only rounds its output. So a kernel may carry up to this many
# times the plain path's error against the f32 reference (FlashAttention's tests do the same).
ROUNDED_P_FACTOR = 3.0
# The plain path's error is floored here: with f32-exact inputs it could be ~0 and demand an
# exact kernel, which rounds P to 16 bits.
PLAIN_ERROR_FLOOR = 1e-3
# A kernel output against the "xla" backend's, both bf16 (dispatch tests): each carries ~2e-3
# (decode, 1 query) to ~4e-3 (prefill, a longer softmax) relative rounding error, and the
# kernel also rounds P to bf16.
BF16_PAIR_DECODE = 5e-3
BF16_PAIR_PREFILL = 1e-2
# A bf16 model run through the kernel against the same model through "xla": the rounding of
# every layer's attention compounds over the layers and steps.
BF16_MODEL = 2e-2
# Block selection is exact: the kernels and the reference rank the same scores, ties to the
# lower id, so ids compare equal (no tolerance), except where noted at the test (f32 sums in
# another order may swap exact near-ties on the GPU).


# ------------------------------------------------------------------------------------ checks

def _is_var(v) -> bool:
    return v is not None and not hasattr(v, "val")  # a jaxpr variable, not a literal (unhashable)


def _sub_jaxprs(params) -> list:
    """The jaxprs an equation's params hold (a closed jaxpr, a jaxpr, or tuples of them: cond's
    branches)."""
    out = []
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            sub = getattr(x, "jaxpr", x)
            if hasattr(sub, "eqns"):
                out.append(sub)
    return out


def padded_block_accesses(fn, *args) -> tuple[list[str], list[str]]:
    """(padded, unmasked) over every Pallas kernel that fn(*args) calls: the refs whose block
    reaches past its array (a blocked dim its block size does not divide), and the accesses to
    them without a mask: plain reads and writes, or `pltriton.load` / `store` given no mask,
    anywhere in the kernel body (control flow included). Compiled with Triton such a store
    writes over the next block's elements and such a read runs off the array; the interpreter
    pads the arrays and cannot see it. A mask's extent is not checked."""
    padded, unmasked = [], []

    def accesses(jaxpr, refs: dict):
        for e in jaxpr.eqns:
            ref = e.invars[0] if e.invars else None
            if _is_var(ref) and ref in refs:
                if e.primitive.name in ("get", "swap"):
                    unmasked.append(f"{refs[ref]} ({e.primitive.name})")
                elif e.primitive.name in ("masked_load", "masked_swap"):  # (ref, idx, mask, other) / (ref, idx, val, mask)
                    mask = jax.tree_util.tree_unflatten(e.params["args_tree"], e.invars)[
                        2 if e.primitive.name == "masked_load" else 3]
                    if mask is None:
                        unmasked.append(f"{refs[ref]} ({e.primitive.name} without a mask)")
            for sub in _sub_jaxprs(e.params):  # its operands end-aligned with the sub-jaxpr's inputs
                inner = dict(zip(sub.invars[::-1], e.invars[::-1]))
                accesses(sub, {v: refs[o] for v, o in inner.items() if _is_var(o) and o in refs})

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                gm, kernel = e.params["grid_mapping"], e.params["jaxpr"]
                refs = {}
                for ref, bm in zip(kernel.invars[gm.num_index_operands:], gm.block_mappings):
                    dims = [(getattr(d, "block_size", None), n) for d, n in zip(bm.block_shape, bm.array_aval.shape)]
                    if any(isinstance(b, int) and n % b for b, n in dims):
                        refs[ref] = f"{e.params['name']}: {bm.array_aval.shape} in blocks {bm.block_shape}"
                padded.extend(refs.values())
                accesses(kernel, refs)
            for sub in _sub_jaxprs(e.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return padded, unmasked


def rel_error(a, ref) -> float:
    """||a - ref|| / ||ref||, in float64."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def assert_attention_close(out, exact, plain, like):
    """A kernel's attention output `out` against the f32 reference `exact`, given the plain jnp
    path's output `plain` in the kernel's dtype; `like` is the query (out's shape and dtype)."""
    chex.assert_equal_shape([out, like])
    chex.assert_type(out, like.dtype)
    chex.assert_tree_all_finite(out.astype(jnp.float32))
    err, base = rel_error(out, exact), rel_error(plain, exact)
    assert err <= ROUNDED_P_FACTOR * max(base, PLAIN_ERROR_FLOOR), (err, base)


def assert_ids_equal(got, want):
    """Selected block ids: int32, the reference's shape, equal id for id."""
    chex.assert_type(got, jnp.int32)
    chex.assert_shape(got, np.shape(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def assert_same_up_to_near_ties(got, ref, scores, rtol):
    """Rows may differ only by swapping blocks whose reference scores lie within rtol of the
    row's k-th largest score: f32 sums in another order can reorder exact near-ties, nothing else."""
    got, ref, scores = np.asarray(got), np.asarray(ref), np.asarray(scores)
    bad = np.nonzero(np.any(got != ref, axis=-1))
    for idx in zip(*bad):
        row = scores[idx]
        kth = np.sort(row)[::-1][ref.shape[-1] - 1]
        diff = set(got[idx].tolist()) ^ set(ref[idx].tolist())
        diff.discard(-1)
        assert all(abs(row[i] - kth) <= rtol * abs(kth) for i in diff), (idx, sorted(diff), kth)
    assert len(bad[0]) <= 1e-3 * np.prod(ref.shape[:-1])


def ranked_chunk_scores(score_fn, x, pos, sp, *, chunk: int):
    """score_fn(x chunk [1, chunk, ...], pos chunk) -> block scores [1, K, chunk, nb], mapped over
    chunks of a batch-1 sequence's queries, then ranked as `finalize_topk` ranks them: forced
    blocks +inf, non-candidates -inf. The reference scores `assert_same_up_to_near_ties` takes."""
    t = x.shape[1]
    chunks = lambda a: jnp.moveaxis(a.reshape(1, t // chunk, chunk, *a.shape[2:]), 1, 0)
    scores = jax.lax.map(lambda a: score_fn(a[0], a[1]), (chunks(x), chunks(pos)))
    scores = jnp.moveaxis(scores, 0, 2)
    scores = scores.reshape(1, scores.shape[1], t, scores.shape[-1])
    nb = scores.shape[-1]
    blk, qblk = jnp.arange(nb).reshape(1, 1, 1, nb), (pos // sp.block_size)[:, None, :, None]
    cand = blk <= qblk
    forced = cand & ((blk < sp.init_blocks) | (blk >= qblk - sp.local_blocks))
    return jnp.where(forced, jnp.inf, jnp.where(cand, scores, -jnp.inf))
