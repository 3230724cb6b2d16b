"""InfiniGen's offline setup, adapted to GQA and 64-token blocks (docs/algorithm.md, "Modes").

InfiniGen (Lee et al., OSDI'24) speculates layer l's attention from layer l-1's normed input:
a partial query (layer l's W_q on that input, RoPE, then a skew and a cut to the few columns
where the query's energy lies) against a partial key cache. Offline, per layer and KV head:

- skew A: the right singular vectors of the post-RoPE queries of the group's G heads
  (calibration text). A is orthogonal, so q.k = (qA).(kA); in the skewed basis the query's
  magnitude concentrates in few columns.
- columns: the r = round(ratio * Dh) columns with the largest sum of |Q A| (ratio 0.2, the
  paper's setting), giving the projection P = A[:, cols] of shape [Dh, r].

At run time (`sparda_jax.modes`) partial queries are q_spec @ P and partial keys k @ P;
their per-head softmax scores, summed over the group and max-pooled to blocks, feed the same
top-k as every other selector.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig

__all__ = ["InfiniGenParams", "infinigen_setup", "skew_and_columns", "calibrate_on_corpus"]


class InfiniGenParams(struct.PyTreeNode):
    """proj [L, K, Dh, r]: the skew restricted to the kept columns, per layer and KV head."""

    proj: jax.Array

    @property
    def columns(self) -> int:
        return self.proj.shape[-1]


def skew_and_columns(q: np.ndarray, r: int) -> np.ndarray:
    """q [N, Dh] post-RoPE queries of one group -> P [Dh, r]."""
    q = np.asarray(q, np.float64)
    _, _, vt = np.linalg.svd(q, full_matrices=False)
    a = vt.T  # [Dh, Dh] orthogonal; columns = principal directions of the queries
    energy = np.abs(q @ a).sum(axis=0)
    cols = np.sort(np.argsort(-energy, kind="stable")[:r])
    return a[:, cols]


def infinigen_setup(params, config: ModelConfig, calib_tokens, *, ratio: float = 0.2,
                    dtype=jnp.float32) -> InfiniGenParams:
    """Run the dense model on calibration tokens int [B, T] and build the per-layer, per-KV-head
    partial projections. Use text that the evaluation does not use."""
    from .modes import forward

    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must lie in (0, 1], got {ratio}")
    r = max(1, round(ratio * config.head_dim))
    tokens = jnp.asarray(calib_tokens, jnp.int32)
    _, aux = forward(params, tokens, config, dtype=dtype, return_q=True)
    qs = aux["q"]  # [L, B, T, H, Dh]
    c = config
    qs = np.asarray(qs, np.float64).reshape(c.num_layers, -1, c.num_kv_heads, c.group_size, c.head_dim)
    proj = np.zeros((c.num_layers, c.num_kv_heads, c.head_dim, r))
    for layer in range(c.num_layers):
        for m in range(c.num_kv_heads):
            proj[layer, m] = skew_and_columns(qs[layer, :, m].reshape(-1, c.head_dim), r)
    return InfiniGenParams(jnp.asarray(proj, jnp.float32))


CALIBRATION_TOKENS = 2048


def calibrate_on_corpus(params, config: ModelConfig, encode, *, tokens: int = CALIBRATION_TOKENS, seed: int = 0,
                        ratio: float = 0.2, dtype=jnp.float32) -> InfiniGenParams:
    """`infinigen_setup` on `tokens` tokens of the training part of the default corpus (text
    that evaluation never uses)."""
    from .text import corpus_split, haystack_tokens, python_docs_corpus

    calib = haystack_tokens(encode, tokens, seed=seed, docs=corpus_split(python_docs_corpus(), "train"))
    return infinigen_setup(params, config, jnp.asarray([calib]), ratio=ratio, dtype=dtype)
