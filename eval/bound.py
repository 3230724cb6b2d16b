"""The best a selector of the same budget can do: blocks chosen by the layer's own attention.

`attention_mass_topk` ranks each (KV head, query)'s visible blocks by the attention mass its G
query heads put on them under full causal attention (summed over the group), then applies the
InfLLM-V2 rules (init and local blocks forced, `topk` in all, sorted, -1 padded:
`finalize_topk`). `oracle_forward` is the model in sparse mode with that selection in every
layer. No selector that reads less than the whole attention can keep more of it, so its copy
NLL bounds from below what training the selection (`--select-weight`) or a better Forecast can
reach at this budget. It reads every key for every query: an analysis tool, not an inference mode.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from sparda_jax.config import Implementations, ModelConfig, SparseConfig
from sparda_jax.model import DecoderLayer, embed, rope_tables, unembed
from sparda_jax.modes import layer_inputs
from sparda_jax.ops.dense_attention import dense_attention
from sparda_jax.ops.sparse_attention import sparse_attention
from sparda_jax.compress import compress_keys
from sparda_jax.pipeline import Ctx, KeySide, Plan, oracle_blocks, project
from sparda_jax.select import finalize_topk

__all__ = ["attention_mass_topk", "oracle_forward"]


def attention_mass_topk(q, k, q_positions, sparse: SparseConfig, *, n_blocks: int, q_chunk: int = 512):
    """q [B, T, H, D], k [B, S, K, D], q_positions int [B, T] -> int32 [B, K, T, topk]: per KV
    head and query, the blocks holding the most causal attention mass of its G heads (forced
    blocks included, as `select_blocks_infllmv2` lays them out). Chunked over queries."""
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    pad_s = n_blocks * sparse.block_size - s
    kf = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, max(0, pad_s)), (0, 0), (0, 0)))[:, :n_blocks * sparse.block_size]
    key_pos = jnp.arange(kf.shape[1])

    def one(qc, pc):  # [B, c, H, D], [B, c]
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", qc.astype(jnp.float32).reshape(b, -1, kh, g, d), kf) / math.sqrt(d)
        vis = (key_pos[None, None, :] <= pc[:, :, None]) & (key_pos < s)[None, None, :]  # [B, c, S]
        p = jax.nn.softmax(jnp.where(vis[:, None, None], logits, -jnp.inf), axis=-1)
        mass = jnp.sum(p.reshape(*p.shape[:-1], n_blocks, sparse.block_size), axis=(2, -1))  # [B, K, c, N_b]
        return finalize_topk(mass, pc, sparse.topk, sparse)

    c = max(1, min(q_chunk, t))
    n = -(-t // c)
    qp = jnp.pad(q, ((0, 0), (0, n * c - t), (0, 0), (0, 0)))
    pp = jnp.pad(q_positions, ((0, 0), (0, n * c - t)), constant_values=-1)
    ids = jax.lax.map(lambda i: one(jax.lax.dynamic_slice_in_dim(qp, i * c, c, 1),
                                    jax.lax.dynamic_slice_in_dim(pp, i * c, c, 1)), jnp.arange(n))
    return jnp.moveaxis(ids, 0, 2).reshape(b, kh, n * c, -1)[:, :, :t]


@functools.partial(jax.jit, static_argnames=("config", "dtype", "oracle_layers", "layer_topk"))
def oracle_forward(params, tokens, config: ModelConfig, *, dtype=jnp.float32, logits_at=None,
                   oracle_layers: tuple[int, ...] | None = None, layer_topk: tuple[tuple[int, int], ...] = ()):
    """tokens int [B, T] -> (float32 logits [B, T, vocab], ids [L, B, K, T, topk]): the backbone
    with every layer attending to its `attention_mass_topk` blocks (the sparse mode's budget).
    logits_at int [B, n]: logits at those positions only ([B, n, vocab]), as `forward`'s.
    oracle_layers: only these layers take the oracle's blocks, the others InfLLM-V2's as the
    sparse mode chooses them (None: every layer), to find the layers whose choice costs most.
    layer_topk ((layer, topk), ...): those InfLLM-V2 layers choose `topk` blocks instead of the
    config's (ids then padded with -1 to the largest budget), to price a larger budget there.
    The config's dense layers (`sparse.dense_layers`) attend to every key, as in the sparse mode
    (their ids: InfLLM-V2's choice, unused); naming one in oracle_layers or layer_topk is refused."""
    c = config
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_tables(c, positions)
    n_blocks = -(-t // c.sparse.block_size)
    plan = Plan(c, "sparse", False, jnp.dtype(dtype), Implementations())
    ctx = Ctx(DecoderLayer(c, dtype=plan.dtype), cos, sin, positions, n_blocks)
    x = embed(params, tokens, c, plan.dtype)
    if oracle_layers is not None and c.has_cis:
        raise NotImplementedError("oracle_layers: InfLLM-V2's choice here has no NOSA cis stage; use a model without cis")
    if oracle_layers is not None and not all(0 <= i < c.num_layers for i in oracle_layers):
        raise ValueError(f"oracle_layers {oracle_layers} name layers outside 0..{c.num_layers - 1}")
    budgets = dict(layer_topk)
    if not all(0 <= i < c.num_layers and k >= c.sparse.forced_blocks for i, k in budgets.items()):
        raise ValueError(f"layer_topk {layer_topk}: layers in 0..{c.num_layers - 1}, budgets of at least the "
                         f"{c.sparse.forced_blocks} forced blocks")
    if budgets and (oracle_layers is None or set(budgets) & set(oracle_layers)):
        raise ValueError(f"layer_topk {layer_topk}: its layers must choose with InfLLM-V2 (not in oracle_layers)")
    dense = set(c.sparse.dense_layers)
    if dense & (set(budgets) | set(oracle_layers or ())):
        raise ValueError(f"layers {sorted(dense)} attend densely (sparse.dense_layers): not in oracle_layers or "
                         f"layer_topk")
    chosen = []
    for i, lin in enumerate(layer_inputs(params, None, None, unroll=True)):
        p = project(plan, ctx, lin, x)
        if oracle_layers is None and i not in dense or i in (oracle_layers or ()):
            ids = attention_mass_topk(p.q, p.k, positions, c.sparse, n_blocks=n_blocks)
        else:
            kc = compress_keys(p.k, c.sparse.kernel_size, c.sparse.kernel_stride)
            layer_plan = plan if i not in budgets else dataclasses.replace(
                plan, config=c.replace(sparse=dataclasses.replace(c.sparse, topk=budgets[i])))
            ids = oracle_blocks(layer_plan, ctx, p.q, KeySide(kc=kc))
        attn = (dense_attention(p.q, p.k, p.v) if i in dense
                else sparse_attention(p.q, p.k, p.v, ids, positions, block_size=c.sparse.block_size))
        x, _ = ctx.layer.apply({"params": lin.params}, x, attn, method="finish_mid")
        chosen.append(ids)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
    width = max(ids.shape[-1] for ids in chosen)
    pad = lambda ids: jnp.pad(ids, ((0, 0),) * 3 + ((0, width - ids.shape[-1]),), constant_values=-1)
    return unembed(params, x, c), jnp.stack([pad(ids) for ids in chosen])
