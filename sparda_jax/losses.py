"""Forecast training targets and the partition KL (docs/algorithm.md, "Training the Forecast").

Two grids, kept apart on purpose: compressed positions (chunks of the (32, 16) key compression;
`ForecastConfig.supervision_k` counts these) and 64-token blocks (`SparseConfig.topk` counts
those). Everything here lives on the compressed grid.

- Teacher (target layer l, group m): sum over the G true query heads of layer l of a softmax
  over a FINE compression of layer l's keys ((2, 1) by default), max-pooled onto the student's
  grid: coarse position c takes the max over the fine windows inside its tokens
  [c*s, c*s + l). Raw sums are G, not 1: the partition KL renormalizes.
- Student: softmax of F . Kc / sqrt(Dh) over the visible coarse positions, F the Forecast that
  selects layer l (F_{l-1}; F0_cur for layer 0).
- Both: causal visibility; positions overlapping the init or local blocks are excluded (they are
  forced anyway); the teacher's top `supervision_k` remaining positions form the kept set.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .attention import NEG_INF
from .compress import chunk_visible, compress_keys, num_chunks
from .config import ForecastConfig, SparseConfig

__all__ = ["partition_kl", "teacher_scores", "student_probs", "excluded_positions", "layer_loss",
           "check_grids", "selection_alignment"]


def check_grids(sparse: SparseConfig, fc: ForecastConfig) -> None:
    """The fine windows must tile the coarse ones: stride and size differences divisible."""
    l, s, lf, sf = sparse.kernel_size, sparse.kernel_stride, fc.teacher_kernel_size, fc.teacher_kernel_stride
    if s % sf or (l - lf) % sf or lf > l:
        raise ValueError(f"ForecastConfig.teacher_kernel_size/stride ({lf}, {sf}) must tile the student grid "
                         f"({l}, {s}): stride and size differences divisible by {sf}, size <= {l}")


def _safe(z):
    return jnp.where(z > 0, z, 1.0)


def partition_kl(p_teacher: jax.Array, p_student: jax.Array, k: int, *, rest: bool = True) -> jax.Array:
    """KL(teacher || student) over k + 1 buckets: the teacher's k largest positions, and one
    "rest" bucket holding everything else; both sides renormalized. Last axis = positions.
    rest=False (an ablation): the k kept positions alone, both sides renormalized over them, so
    mass the student puts outside the kept set goes unpenalized.

    Inputs are non-negative scores (0 = excluded / invisible); they need not sum to 1.
    Positions where the teacher is 0 never enter the kept set. A row whose teacher mass is 0
    gives 0. Returns the KL per row (shape = input shape without the last axis).
    """
    if p_teacher.shape != p_student.shape:
        raise ValueError(f"teacher {p_teacher.shape} and student {p_student.shape} shapes differ")
    n = p_teacher.shape[-1]
    k = min(k, n)
    t = p_teacher.astype(jnp.float32)
    s = p_student.astype(jnp.float32)
    tz = jnp.sum(t, axis=-1, keepdims=True)
    sz = jnp.sum(s, axis=-1, keepdims=True)
    # where-guarded denominators: dividing by max(z, tiny) would put 1/tiny**2 into the gradient
    t = t / _safe(tz)
    s = s / _safe(sz)
    _, idx = jax.lax.top_k(t, k)
    kept = jnp.zeros(t.shape, bool)
    kept = jnp.put_along_axis(kept, idx, True, axis=-1, inplace=False) & (t > 0)
    if not rest:  # renormalize both over the kept set; the rest bucket's term below is then 0
        t = jnp.where(kept, t, 0.0)
        s = jnp.where(kept, s, 0.0)
        t = t / _safe(jnp.sum(t, axis=-1, keepdims=True))
        s = s / _safe(jnp.sum(s, axis=-1, keepdims=True))
    t_rest = jnp.sum(jnp.where(kept, 0.0, t), axis=-1)
    s_rest = jnp.sum(jnp.where(kept, 0.0, s), axis=-1)
    eps = 1e-12
    kl_kept = jnp.sum(jnp.where(kept, t * (jnp.log(jnp.maximum(t, eps)) - jnp.log(jnp.maximum(s, eps))), 0.0), -1)
    kl_rest = jnp.where(t_rest > 0, t_rest * (jnp.log(jnp.maximum(t_rest, eps)) - jnp.log(jnp.maximum(s_rest, eps))),
                        0.0)
    return jnp.where(tz[..., 0] > 0, kl_kept + kl_rest, 0.0)


def excluded_positions(n_c: int, q_positions, sparse: SparseConfig) -> jax.Array:
    """bool [B, tq, N_c]: compressed positions whose window overlaps an init or local block."""
    c = jnp.arange(n_c)
    first = (c * sparse.kernel_stride) // sparse.block_size
    last = (c * sparse.kernel_stride + sparse.kernel_size - 1) // sparse.block_size
    q_blk = (q_positions // sparse.block_size)[..., None]
    return (first.reshape(1, 1, -1) < sparse.init_blocks) | (last.reshape(1, 1, -1) >= q_blk - sparse.local_blocks)


def teacher_scores(q, k, q_positions, sparse: SparseConfig, fc: ForecastConfig, n_c: int) -> jax.Array:
    """q [B, tq, H, D] (layer l's true queries), k [B, S, K, D] -> [B, K, tq, n_c] float32:
    group-summed fine softmax, max-pooled onto the coarse grid; 0 where the coarse position is
    invisible."""
    check_grids(sparse, fc)
    lf, sf = fc.teacher_kernel_size, fc.teacher_kernel_stride
    b, tq, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    kf = compress_keys(k, lf, sf)  # [B, N_f, K, D]
    nf = kf.shape[1]
    logits = jnp.einsum("BTKGD,BNKD->BKGTN", q.astype(jnp.float32).reshape(b, tq, kh, g, d),
                        kf.astype(jnp.float32)) / math.sqrt(d)
    vis = chunk_visible(jnp.arange(nf), q_positions, lf, sf)[:, None, None]
    logits = jnp.where(vis, logits, NEG_INF)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) * vis
    p = jnp.sum(p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30), axis=2)  # [B, K, tq, N_f]
    # coarse c <- max over fine j in [c*s/sf, (c*s + l - lf)/sf]
    window = (sparse.kernel_size - lf) // sf + 1
    stride = sparse.kernel_stride // sf
    need = (n_c - 1) * stride + window
    p = jnp.pad(p, [(0, 0)] * 3 + [(0, max(0, need - nf))])[..., :need]
    pooled = jax.lax.reduce_window(p, -jnp.inf, jax.lax.max, (1, 1, 1, window), (1, 1, 1, stride), "VALID")
    cvis = chunk_visible(jnp.arange(n_c), q_positions, sparse.kernel_size, sparse.kernel_stride)[:, None]
    return jnp.where(cvis, pooled, 0.0)


def student_probs(f, kc, q_positions, sparse: SparseConfig) -> jax.Array:
    """f [B, tq, K, D], kc [B, N_c, K, D] -> softmax over visible positions [B, K, tq, N_c]."""
    d = f.shape[-1]
    logits = jnp.einsum("BTKD,BNKD->BKTN", f.astype(jnp.float32), kc.astype(jnp.float32)) / math.sqrt(d)
    vis = chunk_visible(jnp.arange(kc.shape[1]), q_positions, sparse.kernel_size, sparse.kernel_stride)[:, None]
    logits = jnp.where(vis, logits, NEG_INF)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)) * vis
    return p / _safe(jnp.sum(p, axis=-1, keepdims=True))


def layer_loss(f, q, k, q_positions, sparse: SparseConfig, fc: ForecastConfig, *, q_chunk: int = 256):
    """Mean partition KL of one layer over rows (B, K, query) that have supervision.

    f [B, T, K, D] the Forecast selecting this layer (carries the gradient); q [B, T, H, D] and
    k [B, S, K, D] the layer's true queries and keys (no gradient). Chunked over queries.
    Returns (sum of KL, number of rows).

    The gradient with respect to f is computed chunk by chunk in the forward pass and is the
    only thing kept for the backward pass (a custom VJP). Differentiating through the chunk scan
    instead made JAX stack each chunk's masks as residuals, [T, T]-sized per layer even under
    `jax.checkpoint` (32 GiB of them for minicpm4.1-8b at 32K); the fused gradient keeps memory at O(q_chunk * S) plus f's own size.
    """
    return _layer_loss(f, jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), q_positions, sparse, fc, q_chunk)


def _layer_loss_and_grad(f, q, k, q_positions, sparse, fc, q_chunk):
    """(sum of KL, rows) and d(sum of KL)/df, one query chunk at a time."""
    kc = compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
    n_c = kc.shape[1]
    b, t = q.shape[:2]
    c = max(1, min(q_chunk, t))
    n = -(-t // c)
    pad = n * c - t

    def split(a, fill=0):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)

    def one(carry, xs):
        fc_, qc, pc = xs
        keep = ~excluded_positions(n_c, pc, sparse)[:, None]  # [B, 1, c, N_c]
        teacher = teacher_scores(qc, k, pc, sparse, fc, n_c) * keep
        has = jnp.sum(teacher, axis=-1) > 0

        def kl_of(f_):
            kl = partition_kl(teacher, student_probs(f_, kc, pc, sparse) * keep, fc.supervision_k,
                              rest=fc.rest_bucket)  # [B, K, c]
            return jnp.sum(jnp.where(has, kl, 0.0))

        kl, pull = jax.vjp(kl_of, fc_)
        (g,) = pull(jnp.ones_like(kl))
        return (carry[0] + kl, carry[1] + jnp.sum(has)), g

    (total, rows), g = jax.lax.scan(one, (jnp.float32(0), jnp.int32(0)), (split(f), split(q), split(q_positions, -1)))
    g = jnp.moveaxis(g, 0, 1).reshape(b, n * c, *f.shape[2:])[:, :t]
    return (total, rows), g


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _layer_loss(f, q, k, q_positions, sparse, fc, q_chunk):
    return _layer_loss_and_grad(f, q, k, q_positions, sparse, fc, q_chunk)[0]


def _layer_loss_fwd(f, q, k, q_positions, sparse, fc, q_chunk):
    out, g = _layer_loss_and_grad(f, q, k, q_positions, sparse, fc, q_chunk)
    return out, g


def _layer_loss_bwd(sparse, fc, q_chunk, res, ct):
    # the teacher's inputs get no gradient (the backbone is frozen); rows is an integer count
    return (ct[0] * res).astype(res.dtype), None, None, None


_layer_loss.defvjp(_layer_loss_fwd, _layer_loss_bwd)


def selection_alignment(q, k, q_positions, sparse: SparseConfig, fc: ForecastConfig):
    """How far a layer's own InfLLM-V2 scores are from its own attention, for training the model
    (not a Forecast) so that its selection keeps the blocks its attention reads.

    q [B, r, H, D] (the layer's queries at r rows), k [B, S, K, D] (its keys), q_positions int
    [B, r]. Student: the group-summed softmax over the (kernel_size, kernel_stride) compressed
    keys, the score the sparse mode's top-k ranks (differentiable in q and k). Teacher: the same
    on fc's fine grid, max-pooled onto the coarse one (`teacher_scores`), under stop_gradient.
    Init and local positions are left out (forced anyway). Returns (sum of the partition KL over
    rows with supervision, number of those rows)."""
    n_c = num_chunks(k.shape[1], sparse.kernel_size, sparse.kernel_stride)
    coarse = dataclasses.replace(fc, teacher_kernel_size=sparse.kernel_size,
                                 teacher_kernel_stride=sparse.kernel_stride)
    keep = ~excluded_positions(n_c, q_positions, sparse)[:, None]
    teacher = jax.lax.stop_gradient(teacher_scores(q, k, q_positions, sparse, fc, n_c)) * keep
    student = teacher_scores(q, k, q_positions, sparse, coarse, n_c) * keep
    has = jnp.sum(teacher, axis=-1) > 0
    kl = partition_kl(teacher, student, fc.supervision_k, rest=fc.rest_bucket)
    return jnp.sum(jnp.where(has, kl, 0.0)), jnp.sum(has)
