"""The selectors' last stage (`reference.finalize_topk`) as one Pallas Triton kernel, for short
rows (decode on small models).

Reference: `reference.finalize_topk` (same contract, the same ids). One program per (sequence,
KV head, query) holds its row of block scores, padded to a power of two, and ranks it with an
[N_b, N_b] comparison tile: block i is chosen iff its score is above -inf and fewer than topk
blocks outrank it (a higher score, or an equal one at a lower id: lax.top_k's order); its place
in the ascending output is the count of chosen blocks below it. The reference's mask, top-k,
sort and two padding passes are five XLA kernels; this is one. Scores are finite or +-inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from sparda_jax.config import SparseConfig

__all__ = ["finalize_topk_triton", "MAX_BLOCKS"]

MAX_BLOCKS = 256  # the row's comparison tile is MAX_BLOCKS^2 lanes (SmolLM2's 8K decode has 129 blocks)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel(scores_ref, pos_ref, out_ref, *, nb: int, topk: int, block_size: int, init: int, local: int,
            force: bool):
    nbp, tkp = scores_ref.shape[-1], out_ref.shape[-1]
    k = jnp.arange(nbp, dtype=jnp.int32)
    p = pos_ref[0]
    q_blk = jnp.where(p >= 0, p // block_size, -1)
    candidate = (k <= q_blk) & (k < nb)
    # the blocks are padded past the row: loads and stores are masked to it (an unmasked store
    # would write the padding over the next row's ids)
    s = jnp.where(candidate, pltriton.load(scores_ref, mask=k < nb, other=-jnp.inf), -jnp.inf)
    if force:
        forced = candidate & ((k < init) | (k >= q_blk - local))
        s = jnp.where(forced, jnp.inf, s)
    # outranks[i, j]: block j comes before block i in lax.top_k's order
    outranks = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (k[None, :] < k[:, None]))
    rank = jnp.sum(outranks.astype(jnp.int32), axis=1)
    chosen = (s > -jnp.inf) & (rank < topk)
    below = chosen[None, :] & (k[None, :] < k[:, None])
    place = jnp.sum(below.astype(jnp.int32), axis=1)  # [nbp]: its index in the ascending output
    slot = jnp.arange(tkp, dtype=jnp.int32)
    at = chosen[None, :] & (place[None, :] == slot[:, None])  # [tkp, nbp]
    ids = jnp.sum(jnp.where(at, k[None, :], 0), axis=1)
    pltriton.store(out_ref, jnp.where(jnp.sum(at.astype(jnp.int32), axis=1) > 0, ids, -1), mask=slot < topk)


@functools.partial(jax.jit, static_argnames=("topk", "sparse", "force", "interpret"))
def finalize_topk_triton(block_scores: jax.Array, q_positions: jax.Array, topk: int, sparse: SparseConfig,
                         force: bool = True, *, interpret: bool = False) -> jax.Array:
    """`reference.finalize_topk` in one Triton kernel: block scores [B, K, tq, N_b] (N_b <=
    MAX_BLOCKS) -> ids int32 [B, K, tq, topk]. interpret: Pallas' CPU interpreter."""
    b, kh, tq, nb = block_scores.shape
    if nb > MAX_BLOCKS:
        raise NotImplementedError(f"the Triton top-k takes rows of <= {MAX_BLOCKS} blocks, got {nb}")
    nbp, tkp = _pow2(nb), _pow2(topk)
    kernel = functools.partial(_kernel, nb=nb, topk=topk, block_size=sparse.block_size, init=sparse.init_blocks,
                               local=sparse.local_blocks, force=force)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, kh, tq, topk), jnp.int32),
        grid=(b, kh, tq),
        in_specs=[pl.BlockSpec((None, None, None, nbp), lambda i, j, t: (i, j, t, 0)),
                  pl.BlockSpec((None, 1), lambda i, j, t: (i, t))],
        out_specs=pl.BlockSpec((None, None, None, tkp), lambda i, j, t: (i, j, t, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4 if nbp <= 128 else 8, num_stages=1),
        interpret=interpret,
        name="finalize_topk",
    )(block_scores.astype(jnp.float32), q_positions.astype(jnp.int32))
