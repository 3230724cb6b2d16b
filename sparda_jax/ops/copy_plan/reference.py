"""The jnp reference of the decode step's copy plan: slot assignment in the device block cache
and the copy's task lists.

Per (sequence b, KV head k) the cache has S slots of one block each and a table int32 [S] of
the block id each slot holds (-1: empty). A step wants N blocks (ascending unique ids, -1
padded). `assign_slots` keeps the wanted blocks that are resident, puts the missing ones into
empty slots first, then into slots whose blocks were not wanted (lowest slot first), so a block
wanted again a few steps later may still be resident. `plan_copies_reference` adds the task
lists: task (b, k, i) copies block wanted[b, k, i] from its row of the host pool into slot
slots[b, k, i] of the cache, or is -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["SlotAssignment", "CopyPlan", "assign_slots", "plan_copies_reference", "empty_table", "check_plan"]


class SlotAssignment(struct.PyTreeNode):
    table: jax.Array     # [..., n_slots] after this step
    slots: jax.Array     # [..., n] slot of each wanted block (-1 for padding)
    copy: jax.Array      # [..., n] bool: this block must be copied from host into its slot
    n_copies: jax.Array  # int32 scalar: blocks to copy in all


class CopyPlan(struct.PyTreeNode):
    """A step's copy plan: the table after it [B, K, S], each wanted block's slot [B, K, N]
    (-1 for padding), and the task lists src, dst [B, K, N] int32: the flat block index of the
    block to copy in the host pool and of its slot in the cache [B, K, S] (-1: no task)."""

    table: jax.Array
    slots: jax.Array
    src: jax.Array
    dst: jax.Array

    @property
    def n_copies(self) -> jax.Array:
        return jnp.sum(self.src >= 0).astype(jnp.int32)


def empty_table(shape: tuple[int, ...], n_slots: int) -> jax.Array:
    return jnp.full((*shape, n_slots), -1, jnp.int32)


def assign_slots(table: jax.Array, wanted: jax.Array, *, reuse: bool = True) -> SlotAssignment:
    """table int [..., n_slots]; wanted int [..., n] unique block ids, -1 padded.
    With reuse=False every wanted block is copied (the no-cache baseline)."""
    n_slots, n = table.shape[-1], wanted.shape[-1]
    if n_slots < n:
        raise ValueError(f"the cache needs at least as many slots ({n_slots}) as selected blocks ({n})")
    if not reuse:
        table = jnp.full_like(table, -1)
    valid = wanted >= 0
    match = (table[..., None, :] == wanted[..., :, None]) & valid[..., :, None]  # [..., n, n_slots]
    resident = jnp.any(match, axis=-1)
    slot_if_resident = jnp.argmax(match, axis=-1)
    keep = jnp.any(match, axis=-2)  # [..., n_slots] slots holding a wanted block
    free = ~keep
    missing = valid & ~resident
    # the rank of each missing block among the missing ones: a masked sum over a triangle, not
    # jnp.cumsum, which XLA's GPU backend lowers to a reduce_window run by one CTA of n threads
    ar = jnp.arange(n)
    upto = (ar[None, :] <= ar[:, None]).reshape((1,) * (wanted.ndim - 1) + (n, n))
    miss_rank = jnp.sum(missing[..., None, :] & upto, axis=-1) - 1  # [..., n]
    # fill empty slots first, then evict unselected blocks, lowest slot first: a block that
    # was not selected now may be selected again soon, so it stays as long as there is room
    prio = jnp.where(table >= 0, n_slots, 0) + jnp.arange(n_slots).reshape((1,) * (table.ndim - 1) + (-1,))
    before = (prio[..., None, :] < prio[..., :, None]) & free[..., None, :]  # [..., s, s']: s' first
    free_rank = jnp.where(free, jnp.sum(before, axis=-1), -1)
    pick = (free_rank[..., None, :] == miss_rank[..., :, None]) & missing[..., :, None]
    dst = jnp.argmax(pick, axis=-1)
    slots = jnp.where(resident, slot_if_resident, jnp.where(missing, dst, -1)).astype(jnp.int32)
    # write the missing blocks' ids into their new slots
    hit = jnp.any(pick, axis=-2)  # [..., n_slots] slots that receive a block
    incoming = jnp.sum(jnp.where(pick, wanted[..., :, None], 0), axis=-2)
    new_table = jnp.where(hit, incoming, table).astype(jnp.int32)
    return SlotAssignment(new_table, slots, missing, jnp.sum(missing).astype(jnp.int32))


def check_plan(table, wanted, src_offset, n_blocks: int) -> None:
    """ValueError/TypeError unless table [B, K, S] and wanted [B, K, N] are int32 with N <= S,
    src_offset an int32 scalar and n_blocks >= 1."""
    if table.ndim != 3 or wanted.ndim != 3 or table.shape[:2] != wanted.shape[:2]:
        raise ValueError(f"table [B, K, S] and wanted [B, K, N] must share B, K; got {table.shape}, {wanted.shape}")
    if table.dtype != jnp.int32 or wanted.dtype != jnp.int32:
        raise TypeError(f"table and wanted must be int32, got {table.dtype}, {wanted.dtype}")
    if wanted.shape[-1] > table.shape[-1]:
        raise ValueError(f"the cache needs at least as many slots ({table.shape[-1]}) as wanted blocks "
                         f"({wanted.shape[-1]})")
    if jnp.shape(src_offset) != () or not jnp.issubdtype(jnp.result_type(src_offset), jnp.integer):
        raise TypeError(f"src_offset must be an integer scalar, got {jnp.shape(src_offset)} "
                        f"{jnp.result_type(src_offset)}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"n_blocks must be an int >= 1, got {n_blocks!r}")


def plan_copies_reference(table, wanted, src_offset, *, n_blocks: int) -> CopyPlan:
    """`assign_slots` and its task lists: dst = (b * K + k) * S + slot, src = src_offset +
    (b * K + k) * n_blocks + block id, for the blocks that must be copied; -1 elsewhere.
    n_blocks: the host pool's blocks per (sequence, KV head); src_offset: where the pool's
    rows start (0, or the layer's row times B * K * n_blocks in a pool of every layer)."""
    check_plan(table, wanted, src_offset, n_blocks)
    b, kh, s = table.shape
    a = assign_slots(table, wanted)
    row = (jnp.arange(b)[:, None, None] * kh + jnp.arange(kh)[None, :, None]).astype(jnp.int32)
    dst = jnp.where(a.copy, row * s + a.slots, -1).astype(jnp.int32)
    src = jnp.where(a.copy, jnp.asarray(src_offset, jnp.int32) + row * n_blocks + wanted, -1).astype(jnp.int32)
    return CopyPlan(a.table, a.slots, src, dst)
