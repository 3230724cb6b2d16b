"""The decode step's copy plan as one Pallas Triton kernel.

Reference: `reference.plan_copies_reference` (same contract, bit-equal outputs). One program
per (sequence, KV head) holds its table [S] and wanted ids [N] in registers, padded to powers of
two (loads and stores masked to the row), and computes the assignment with [N, S] and [N, N] /
[S, S] comparison tiles: each rank the reference takes as a masked triangle sum is a row sum
here. It replaces the reference's eight small XLA kernels a layer by one (Triton, not Mosaic
GPU: integer tiles of a few dozen lanes, no tensor cores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import CopyPlan

__all__ = ["plan_copies_triton"]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(table_ref, wanted_ref, offset_ref, table_out, slots_out, src_out, dst_out, *, n_slots: int, n: int,
            n_blocks: int, kh: int):
    sp, np_ = table_ref.shape[-1], wanted_ref.shape[-1]  # padded to powers of two
    row = pl.program_id(0) * kh + pl.program_id(1)
    s_ar = jnp.arange(sp, dtype=jnp.int32)
    n_ar = jnp.arange(np_, dtype=jnp.int32)
    real = s_ar < n_slots                              # [sp] slots that exist
    in_row = n_ar < n
    # the blocks are padded past the row: every load and store is masked to it (an unmasked
    # store would write the padding over the next row's entries)
    table = pltriton.load(table_ref, mask=real, other=-1)
    wanted = pltriton.load(wanted_ref, mask=in_row, other=-1)
    valid = wanted >= 0
    match = (table[None, :] == wanted[:, None]) & valid[:, None] & real[None, :]          # [np, sp]
    resident = jnp.sum(match.astype(jnp.int32), axis=1) > 0
    # the first matching slot (the reference's argmax)
    slot_if_resident = jnp.min(jnp.where(match, s_ar[None, :], sp), axis=1)
    keep = jnp.sum(match.astype(jnp.int32), axis=0) > 0
    free = real & ~keep
    missing = valid & ~resident
    upto = n_ar[None, :] <= n_ar[:, None]                                                 # [np, np]
    miss_rank = jnp.sum((missing[None, :] & upto).astype(jnp.int32), axis=1) - 1
    prio = jnp.where(table >= 0, n_slots, 0) + s_ar
    before = (prio[None, :] < prio[:, None]) & free[None, :]                              # [sp, sp]
    free_rank = jnp.where(free, jnp.sum(before.astype(jnp.int32), axis=1), -1)
    pick = (free_rank[None, :] == miss_rank[:, None]) & missing[:, None]                  # [np, sp]
    dst_slot = jnp.min(jnp.where(pick, s_ar[None, :], sp), axis=1)
    slots = jnp.where(resident, slot_if_resident, jnp.where(missing, dst_slot, -1))
    hit = jnp.sum(pick.astype(jnp.int32), axis=0) > 0
    incoming = jnp.sum(jnp.where(pick, wanted[:, None], 0), axis=0)
    pltriton.store(table_out, jnp.where(hit, incoming, table), mask=real)
    pltriton.store(slots_out, slots, mask=in_row)
    pltriton.store(dst_out, jnp.where(missing, row * n_slots + slots, -1), mask=in_row)
    pltriton.store(src_out, jnp.where(missing, offset_ref[0] + row * n_blocks + wanted, -1), mask=in_row)


@functools.partial(jax.jit, static_argnames=("n_blocks", "interpret"))
def plan_copies_triton(table, wanted, src_offset, *, n_blocks: int, interpret: bool = False) -> CopyPlan:
    """`plan_copies_reference` in one Triton kernel (interpret: Pallas' CPU interpreter)."""
    b, kh, s = table.shape
    n = wanted.shape[-1]
    sp, np_ = _pow2(s), _pow2(n)
    row = lambda size: pl.BlockSpec((None, None, size), lambda i, j: (i, j, 0))
    kernel = functools.partial(_kernel, n_slots=s, n=n, n_blocks=n_blocks, kh=kh)
    out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, kh, s), jnp.int32),
                   *(jax.ShapeDtypeStruct((b, kh, n), jnp.int32) for _ in range(3))),
        grid=(b, kh),
        in_specs=[row(sp), row(np_), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=(row(sp), row(np_), row(np_), row(np_)),
        # one warp: the tiles are at most a few thousand lanes (S, N <= 128 in the presets)
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        # the table is updated in place: each program reads its row before it writes it
        input_output_aliases={0: 0},
        interpret=interpret,
        name="plan_copies",
    )(table, wanted, jnp.reshape(src_offset, (1,)).astype(jnp.int32))
    return CopyPlan(*out)
