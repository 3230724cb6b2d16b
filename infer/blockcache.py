"""The device block cache: which KV block sits in which slot, and what must be copied.

Per (layer, sequence, KV head) the cache has `n_slots` slots of one 64-token block each and a
table int32 [..., n_slots] of the block id held by each slot (-1: empty). Each decode step
selects `n` blocks; `assign_slots` keeps the selected blocks that are already resident,
puts the missing ones into empty slots, then into slots whose blocks were not selected
(lowest slot first), and returns the copy list. Slots not reused keep their old (still valid) blocks, so a block
selected again a few steps later may still be resident.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

__all__ = ["SlotAssignment", "assign_slots", "empty_table"]


class SlotAssignment(struct.PyTreeNode):
    table: jax.Array     # [..., n_slots] after this step
    slots: jax.Array     # [..., n] slot of each wanted block (-1 for padding)
    copy: jax.Array      # [..., n] bool: this block must be copied from host into its slot
    n_copies: jax.Array  # int32 scalar: blocks to copy in all


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
