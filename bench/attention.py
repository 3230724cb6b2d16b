"""`sparda bench attention`: block-sparse attention vs cuDNN dense attention (paper Fig. 3, blue).

Prefill (batch 4, causal, every query of the sequence):
  mosaic_gpu  sparse_attention(..., implementation="mosaic_gpu"), Tq = T (the prefill kernel; the
              union metadata is built inside the timed call, as per layer)
  xla         the jnp reference, timed on an evenly spread query slice and scaled (it does the
              same work for every query)
  cudnn       jax.nn.dot_product_attention(is_causal=True, implementation="cudnn"), full T
  dense_xla   the chunked jnp dense reference on the query slice (CPU smoke tests; not default)
  -> effective TFLOP/s on the keys each query really attends (4 * D * H * sum of attended keys)
     over cuDNN's TFLOP/s with the standard causal count (4 * B * H * D * T^2 / 2).
Decode (batch >= 16, one query per sequence at the end of the context):
  mosaic_gpu  the Mosaic GPU decode kernel with its default `DecodeConfig`; xla the reference;
  mosaic_gpu@s<S>n<N>  the same with `DecodeConfig(stages=S, n_split=N)`: S K/V buffers (S - 1
                 blocks in flight) and N KV splits (mosaic_gpu@s2 is s2n4, kept for old results)
  cudnn       dense decode through key_value_seq_lengths
  -> bytes of selected K/V read per second over the HBM bandwidth of a large copy (read + write).
Train (`--train-only`; batch and selections as prefill): the value and the gradients in q, k, v of
the loss sum(out * ct) (ct a random bf16 cotangent [B, T, H, D]), forward + backward in one jit:
  mosaic_gpu  sparse_attention's custom VJP with the Mosaic prefill kernel and its Mosaic backward
              kernels, full T;  xla  the same VJP with the jnp forward and backward, on the query
              slice and scaled;  cudnn  jax.nn.dot_product_attention(implementation="cudnn"),
              causal, full T;  dense_xla  autodiff of the chunked jnp dense reference on the query
              slice, skipped (with the reason) where its compiled program needs more device memory
              than is free.
  -> ms per layer for forward + backward, and the dense baseline's time over each sparse
     variant's (cuDNN's on the GPU); goal at 128K: TRAIN_TARGET. Before any timing, each sparse
     variant's gradients are checked at one small size (`train_grad_check`) against autodiff of
     the jnp forward in f32; a variant that fails it is reported and not timed. Each timed case
     also checks dq on a few rows of the last sequence (the largest offsets) against that
     autodiff, and that every gradient is finite.
Every variant is checked against the f32 reference before it is timed; a failed check keeps its
time but is flagged and excluded from "best". Block ids come from a real selector (the XLA
Forecast selector) on random inputs: random weights choose nearly random content blocks, the
worst case for the prefill kernel's per-tile block union, which is measured and reported.

    sparda bench attention --out bench/results/attention/attention.json
    sparda bench attention --train-only --query-correlation 0.99 --out bench/results/attention/train.json
"""

from __future__ import annotations

import functools
import re
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.attention import (dense_attention, dense_attention_reference, sparse_attention,
                                  sparse_attention_reference)
from sparda_jax.bench.timing import plot_and_print, Budget, ceilings, measure, query_slice, rel_check, unavailable, write_json, claim_lines, pyplot_and_result, save_png
from sparda_jax.compress import compress_keys
from sparda_jax.config import get_preset
from sparda_jax.envinfo import environment
from sparda_jax.ops.sparse_attention.decode import DecodeConfig
from sparda_jax.ops.sparse_attention.prefill import tile_tokens_for
from sparda_jax.metrics import tile_blowup, tile_union
from sparda_jax.select import select_blocks_forecast
from sparda_jax.bench import default_out

__all__ = ["bench_attention", "prefill_case", "decode_case", "train_case", "train_grad_check", "model_shape", "plot",
           "table"]

# The kernels under test run last in each case: a fault that kills the process then loses only
# them, and the JSON snapshot written after every variant keeps the rest.
PREFILL_VARIANTS = ("xla", "cudnn", "mosaic_gpu")
DECODE_VARIANTS = ("xla", "cudnn", "mosaic_gpu", "mosaic_gpu@split", "mosaic_gpu@s2n4", "mosaic_gpu@s2n8",
                   "mosaic_gpu@s2n16", "mosaic_gpu@s3n4")
# "mosaic_gpu@split": the default decode kernel's pass over the blocks alone, without the XLA combine
# of its splits (the combine's cost is mosaic_gpu's time less this one); checked after combining
# the decode kernel as first measured (2 K/V buffers, 4 splits); the default at batch >= 64 since
# two CTAs fit an SM (smaller batches get more splits: default_n_split)
DECODE_S2 = dict(stages=2, n_split=4)


def _decode_choice(name: str) -> DecodeConfig | None:
    """"mosaic_gpu@s<S>n<N>" -> DecodeConfig(stages=S, n_split=N); "mosaic_gpu@s2" (old results) -> s2n4."""
    if name == "mosaic_gpu@s2":
        return DecodeConfig(**DECODE_S2)
    m = re.fullmatch(r"mosaic_gpu@s(\d+)n(\d+)", name)
    return None if m is None else DecodeConfig(stages=int(m[1]), n_split=int(m[2]))


SPARSE = ("mosaic_gpu", "xla")
INTERPRETED = ("mosaic_gpu_interpret",)  # the kernels run by the CPU interpreter: harness tests only
# bf16 rounding of P and of the output is ~2^-8 relative per element; the Frobenius error of a
# correct bf16 kernel stays near 4e-3, a wrong block or mask gives O(1).
REL_ERR_BOUND = 2e-2
PREFILL_TARGET = 0.5  # sparse effective TFLOP/s / cuDNN dense TFLOP/s
TRAIN_VARIANTS = ("xla", "dense_xla", "cudnn", "mosaic_gpu")
TRAIN_TARGET = 3.0        # cuDNN forward + backward time / sparse forward + backward time, at TRAIN_GOAL_T
TRAIN_GOAL_T = 131072
PAPER_TRAIN_SPEEDUP = 4.61  # InfLLM-V2 over FlashAttention, forward + backward at 128K on an H100
# forward 4 D flops per (query head, attended key), backward 10 D (QK^T again, dV, dP, dQ, dK)
TRAIN_FLOP_FACTOR = 3.5
DECODE_TARGET = 0.7   # selected K/V bytes/s / HBM copy bandwidth
BF16 = jnp.bfloat16


def model_shape(preset: str) -> dict:
    c = get_preset(preset)
    return {"preset": preset, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "sparse": c.sparse}


def _shape_json(shape: dict) -> dict:
    s = shape["sparse"]
    return {**{k: v for k, v in shape.items() if k != "sparse"},
            "block_size": s.block_size, "topk": s.topk, "init_blocks": s.init_blocks,
            "local_blocks": s.local_blocks, "compression": [s.kernel_size, s.kernel_stride]}


def correlated_normal(key, shape, rho: float, dtype=BF16):
    """Standard normal [B, T, ...] whose rows follow x_t = rho x_(t-1) + sqrt(1 - rho^2) e_t along
    T: neighbouring queries alike, as a trained model's are (rho = 0: independent rows)."""
    e = jax.random.normal(key, shape, jnp.float32)
    if rho == 0.0:
        return e.astype(dtype)
    e = e.at[:, 1:].multiply(math.sqrt(1.0 - rho * rho))
    a = jnp.full(shape[:2] + (1,) * (len(shape) - 2), rho, jnp.float32).at[:, 0].set(0.0)
    # a linear recurrence as an associative scan: (a1, b1) then (a2, b2) is (a1 a2, a2 b1 + b2)
    _, x = jax.lax.associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]),
                                    (jnp.broadcast_to(a, shape), e), axis=1)
    return x.astype(dtype)


@functools.partial(jax.jit, static_argnames=("sparse", "n_blocks", "rho"))
def _forecast_ids(key, k, positions, *, sparse, n_blocks, rho: float = 0.0):
    f = correlated_normal(key, (*positions.shape, k.shape[2], k.shape[3]), rho)
    kc = compress_keys(k, sparse.kernel_size, sparse.kernel_stride)
    return select_blocks_forecast(f, kc, positions, sparse, n_blocks=n_blocks)


@functools.partial(jax.jit, static_argnames=("block_size",))
def attended_keys(ids, positions, *, block_size):
    """ids [B, K, Tq, n] (unique, -1 padded), positions [B, Tq] -> [B, K, Tq]: keys each query
    sees in its selected blocks (causal inside its own block)."""
    n = jnp.clip(positions[:, None, :, None] - ids * block_size + 1, 0, block_size)
    return jnp.sum(jnp.where(ids >= 0, n, 0), axis=-1)


def _rand(key, shape):
    # per leading index: 128K-token q has 2^31 elements, at the edge of one random-bits call
    if len(shape) > 1 and np.prod(shape) > 2**28:
        return jnp.concatenate([jax.random.normal(kk, (1, *shape[1:]), BF16)
                                for kk in jax.random.split(key, shape[0])])
    return jax.random.normal(key, shape, BF16)


def _check_positions(sl: np.ndarray, rows: int) -> np.ndarray:
    """Check rows inside the timed slice: its last queries (most context) and a middle run."""
    mid = len(sl) // 2
    return np.unique(np.concatenate([sl[-rows:], sl[mid: mid + rows]]))


def _floor(flops: float, nbytes: float, ceil: dict) -> float:
    return max(flops / (ceil["matmul_tflops"] * 1e12), nbytes / (ceil["hbm_gb_per_s"] * 1e9))


def _timed_record(rec: dict, *, full: bool, t: int, n_slice: int, scale: float, flops: float, io_bytes: float,
                  ceil: dict, **extra) -> dict:
    """A variant's measured record completed with what was timed (all t queries, or a slice of
    n_slice scaled by `scale` to the layer) and, where it has seconds, the layer's seconds, the
    effective TFLOP/s and its roofline floor (flops, and io_bytes over the timed share)."""
    rec.update(timed_queries=t if full else n_slice, scaled=not full, scale=1.0 if full else scale,
               flops_counted=flops, **extra)
    if "seconds" in rec:
        s = rec["seconds"]
        rec["seconds_layer"] = s * (1.0 if full else scale)
        rec["tflops_effective"] = flops / s / 1e12
        rec["floor_seconds"] = _floor(flops, io_bytes * (1.0 if full else n_slice / t), ceil)
        rec["achieved_over_floor"] = rec["floor_seconds"] / s
    return rec


def _best(variants: dict, names, key: str, larger: bool = True):
    ok = [(n, v) for n, v in variants.items() if n in names and v.get("status") == "ok" and v.get(key)]
    if not ok:
        return None
    return (max if larger else min)(ok, key=lambda nv: nv[1][key])[0]


def prefill_case(t: int, b: int, shape: dict, ceil: dict, *, variants=PREFILL_VARIANTS, repeats: int = 3,
                 timed_queries: int | None = 2048, max_s: float = 3.0, budget: Budget | None = None,
                 check_rows: int = 64, seed: int = 0, out_rec: dict | None = None, snapshot=None,
                 query_correlation: float = 0.0) -> dict:
    """One prefill layer at context t, batch b; the Forecast queries choosing the blocks are
    AR(1) along positions with `query_correlation` (`correlated_normal`). `out_rec` (filled per variant) and `snapshot()`
    (called after each) let the caller save partial results."""
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    g, bs = h // kh, sp.block_size
    kq, kk, kv, kf = jax.random.split(jax.random.key(seed * 7919 + t + b), 4)
    q, k, v = _rand(kq, (b, t, h, d)), _rand(kk, (b, t, kh, d)), _rand(kv, (b, t, kh, d))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ids = jax.block_until_ready(_forecast_ids(kf, k, pos, sparse=sp, n_blocks=-(-t // bs), rho=query_correlation))

    att = np.asarray(attended_keys(ids, pos, block_size=bs)).astype(np.int64)  # [b, kh, t]
    # The prefill kernel's tile (64 // padded G tokens); 8: the tile the union is compared at.
    kernel_tile = tile_tokens_for(g)
    tiles = sorted({8, kernel_tile})
    unions = {tt: np.asarray(tile_union(ids, tile=tt)).astype(np.int64) for tt in tiles}
    u8 = unions[8]
    n_ids = np.asarray(jnp.sum(ids >= 0, axis=-1)).astype(np.int64)
    flops_att = 4.0 * d * g * att.sum()
    # what a kernel computes when each tile of tt tokens walks the union of their blocks
    flops_union = {tt: 4.0 * d * (tt * g) * bs * u.sum() for tt, u in unions.items()}
    flops_dense = 4.0 * b * h * d * t * t / 2
    io_bytes = 2.0 * (2 * q.size + 2 * k.size) + 4.0 * ids.size  # q, o, k, v, ids once each

    sl = query_slice(t, timed_queries)
    cp = _check_positions(sl, check_rows)
    cp_in_sl = np.searchsorted(sl, cp)
    sl_j, cp_j, cpsl_j = jnp.asarray(sl), jnp.asarray(cp), jnp.asarray(cp_in_sl)
    slice_scale = t / len(sl)
    sl_att = np.asarray(att[:, :, sl]).sum()

    refs = {}

    def ref(kind):
        # f32 queries make the reference return f32; K/V stay bf16 (exact in f32) and are upcast
        # inside, so the 128K reference does not need f32 copies of the cache.
        if kind not in refs:
            q0 = q[:1, cp_j].astype(jnp.float32)
            with jax.default_matmul_precision("highest"):
                if kind == "sparse":
                    f = jax.jit(functools.partial(sparse_attention_reference, block_size=bs))
                    refs[kind] = f(q0, k[:1], v[:1], ids[:1, :, cp_j], pos[:1, cp_j])
                else:
                    refs[kind] = jax.jit(dense_attention_reference)(q0, k[:1], v[:1], pos[:1, cp_j])
        return refs[kind]

    out_rec = {} if out_rec is None else out_rec
    snapshot = snapshot or (lambda: None)
    for name in variants:
        if budget is not None and budget.exceeded():
            out_rec[name] = {"status": budget.reason()}
            continue
        full = name != "xla" and name != "dense_xla"
        try:
            if name in SPARSE:
                r = ref("sparse")
                impl = "xla" if name == "xla" else "mosaic_gpu"
                fn = jax.jit(functools.partial(sparse_attention, block_size=bs, implementation=impl))
                if full:
                    call = lambda fn=fn: fn(q, k, v, ids, pos)  # noqa: E731
                else:
                    q_s, ids_s, pos_s = q[:, sl_j], ids[:, :, sl_j], pos[:, sl_j]
                    call = lambda fn=fn: fn(q_s, k, v, ids_s, pos_s)  # noqa: E731
                flops = flops_att if full else 4.0 * d * g * sl_att
            elif name == "cudnn":
                r = ref("dense")
                fn = jax.jit(functools.partial(dense_attention, implementation="cudnn"))
                call = lambda fn=fn: fn(q, k, v)  # noqa: E731
                flops = flops_dense
            elif name == "dense_xla":
                r = ref("dense")
                fn = jax.jit(dense_attention_reference)
                q_s, pos_s = q[:, sl_j], pos[:, sl_j]
                call = lambda fn=fn: fn(q_s, k, v, pos_s)  # noqa: E731
                flops = 4.0 * h * d * float(np.sum(sl.astype(np.int64) + 1)) * b
            else:
                raise ValueError(f"unknown prefill variant {name!r}")
        except Exception as e:  # noqa: BLE001
            out_rec[name] = {"status": unavailable(e)}
            continue
        rows = cp_j if full else cpsl_j
        rec = measure(call, lambda o, r=r, rows=rows: rel_check(o[:1, rows], r, REL_ERR_BOUND),
                      repeats=repeats, max_s=max_s)
        _timed_record(rec, full=full, t=t, n_slice=int(len(sl)), scale=slice_scale, flops=flops, io_bytes=io_bytes,
                      ceil=ceil)
        if "seconds" in rec and name in SPARSE:  # the floor of the kernel's tiles' block union too
            share = 1.0 if full else len(sl) / t
            rec["union_tile_tokens"] = kernel_tile
            rec["floor_union_seconds"] = _floor(flops_union[kernel_tile] * share, io_bytes * share, ceil)
            rec["achieved_over_union_floor"] = rec["floor_union_seconds"] / rec["seconds"]
        out_rec[name] = rec
        snapshot()

    res = {
        "T": t, "batch": b,
        "attended_keys_mean": float(att.mean()), "selected_blocks_mean": float(n_ids.mean()),
        "union_mean_by_tile_tokens": {str(tt): float(u.mean()) for tt, u in unions.items()},
        # the union over what one token selects, as eval.selection reports it for a real model
        "tile_union_over_selected": {str(tt): float(tile_blowup(ids, tile=tt)) for tt in unions},
        "union_mean_tile8": float(u8.mean()), "union_tile8_over_topk": float(u8.mean()) / sp.topk,
        "flops_attended": flops_att, "flops_union_walk_by_tile_tokens": {str(tt): f for tt, f in flops_union.items()},
        "flops_dense_causal": flops_dense,
        "density_vs_dense_causal": flops_att / flops_dense,
        "check_rows": int(len(cp)), "check_batch_element": 0,
        "variants": out_rec,
    }
    bs_name = _best(out_rec, SPARSE, "tflops_effective")
    bd_name = _best(out_rec, ("cudnn", "dense_xla"), "tflops_effective")
    res["best_sparse"], res["best_dense"] = bs_name, bd_name
    if bs_name and bd_name:
        ratio = out_rec[bs_name]["tflops_effective"] / out_rec[bd_name]["tflops_effective"]
        res["ratio_sparse_over_dense_tflops"] = ratio
        res["target"] = PREFILL_TARGET
        res["met"] = bool(ratio >= PREFILL_TARGET)
        # the best ratio a kernel that walks each tile's block union could reach (at its floor)
        best = out_rec[bs_name]
        res["ratio_if_sparse_at_union_floor"] = (best["flops_counted"] / best["floor_union_seconds"] / 1e12
                                                 / out_rec[bd_name]["tflops_effective"])
    return res


def _sparse_attend(q, k, v, ids, pos, *, block_size, implementation):
    return sparse_attention(q, k, v, ids, pos, block_size=block_size, implementation=implementation)


def _sparse_ref_attend(q, k, v, ids, pos, *, block_size):
    # the plain jnp forward: autodiff through it never meets the custom VJP's backward
    return sparse_attention_reference(q, k, v, ids, pos, block_size=block_size)


def _cudnn_attend(q, k, v, ids, pos):
    return dense_attention(q, k, v, implementation="cudnn")


def _dense_ref_attend(q, k, v, ids, pos):
    return dense_attention_reference(q, k, v, pos)


DENSE_TRAIN = ("cudnn", "dense_xla")


def _train_attend(name: str, block_size: int):
    """Train variant `name` as (q, k, v, ids, pos) -> out. Raises ValueError for an unknown name."""
    if name in SPARSE + INTERPRETED:
        return functools.partial(_sparse_attend, block_size=block_size, implementation=name)
    if name == "cudnn":
        return _cudnn_attend
    if name == "dense_xla":
        return _dense_ref_attend
    raise ValueError(f"unknown train variant {name!r}; known: {TRAIN_VARIANTS + INTERPRETED}")


def _train_step(attend):
    """jit of (q, k, v, ct, ids, pos) -> (loss, (dq, dk, dv)), loss = sum(attend(q, k, v, ids, pos)
    * ct) in float32: one layer's attention in a training step, forward and backward. Every array
    is an argument (a closed-over one would be baked into the program as a constant)."""
    def run(q, k, v, ct, ids, pos):
        def loss(q_, k_, v_):
            return jnp.sum(attend(q_, k_, v_, ids, pos).astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(run)


def _memory_fit(compiled) -> tuple[float | None, str | None]:
    """(GiB a compiled program allocates besides its arguments, or None where XLA does not say;
    a skip reason when that exceeds the device's free memory, else None). Devices without memory
    statistics (the CPU) are never refused."""
    try:
        m = compiled.memory_analysis()
        need = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    except Exception:  # noqa: BLE001 - no analysis on this backend: run it and see
        return None, None
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return need / 2**30, None
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if need > free:
        return need / 2**30, (f"skipped: needs {need / 2**30:.1f} GiB of device memory besides its inputs, "
                              f"{free / 2**30:.1f} GiB free")
    return need / 2**30, None


def train_grad_check(name: str, shape: dict, *, t: int, queries: int, batch: int = 1, seed: int = 0,
                     query_correlation: float = 0.0, bound: float = REL_ERR_BOUND) -> dict:
    """Sparse train variant `name`'s gradients (dq, dk, dv of sum(out * ct), bf16 inputs) against
    autodiff of the plain jnp forward (`sparse_attention_reference`, the same inputs in float32,
    highest matmul precision) for `queries` queries at the end of a `t`-token context, batch
    `batch`, block ids chosen as in the timed cases.

    Returns {"T", "queries", "batch", "bound", "dq", "dk", "dv" (each `rel_check`: relative
    Frobenius and max abs error), "max_rel_err", "max_abs_err", "loss_abs_err", "passed",
    "status"}: status "ok", "grad_check_failed", or "unavailable: ..." (the variant cannot run
    here; then only T, queries, batch, bound, passed and status)."""
    if not 0 < queries <= t:
        raise ValueError(f"the gradient check needs 0 < queries <= t, got queries={queries}, t={t}")
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    bs = sp.block_size
    kq, kk, kv, kf, kc = jax.random.split(jax.random.key(seed * 7919 + 17 * t + queries), 5)
    q, ct = _rand(kq, (batch, queries, h, d)), _rand(kc, (batch, queries, h, d))
    k, v = _rand(kk, (batch, t, kh, d)), _rand(kv, (batch, t, kh, d))
    pos = jnp.broadcast_to(jnp.arange(t - queries, t, dtype=jnp.int32), (batch, queries))
    ids = _forecast_ids(kf, k, pos, sparse=sp, n_blocks=-(-t // bs), rho=query_correlation)
    rec = {"T": t, "queries": queries, "batch": batch, "bound": bound}
    try:
        loss, got = jax.block_until_ready(_train_step(_train_attend(name, bs))(q, k, v, ct, ids, pos))
    except Exception as e:  # noqa: BLE001 - e.g. no Hopper GPU here
        return rec | {"passed": False, "status": unavailable(e)}
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        want_loss, want = _train_step(functools.partial(_sparse_ref_attend, block_size=bs))(*f32, ct, ids, pos)
    for gname, a, w in zip(("dq", "dk", "dv"), got, want):
        rec[gname] = rel_check(a, w, bound)
    chk = [rec[g] for g in ("dq", "dk", "dv")]
    rec["max_rel_err"] = max(c["rel_err"] for c in chk)
    rec["max_abs_err"] = max(c["max_abs_err"] for c in chk)
    # the loss, a sum of signed terms, can be near zero: its error is recorded, not judged
    rec["loss_abs_err"] = abs(float(loss) - float(want_loss))
    rec["passed"] = all(c["passed"] for c in chk)
    rec["status"] = "ok" if rec["passed"] else "grad_check_failed"
    return rec


def _train_check(o, rows, ref, seq: int) -> dict:
    """dq on `rows` of sequence `seq` against the reference's, and every gradient and the loss finite."""
    loss, (dq, dk, dv) = o
    chk = rel_check(dq[seq:seq + 1, rows], ref, REL_ERR_BOUND)
    finite = bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(x))) for x in (dq, dk, dv))
    chk["grads_finite"] = finite
    chk["passed"] = bool(chk["passed"] and finite)
    return chk


def train_case(t: int, b: int, shape: dict, ceil: dict, *, variants=TRAIN_VARIANTS, repeats: int = 3,
               timed_queries: int | None = 2048, max_s: float = 3.0, budget: Budget | None = None,
               check_rows: int = 64, seed: int = 0, out_rec: dict | None = None, snapshot=None,
               query_correlation: float = 0.0, blocked: dict | None = None) -> dict:
    """One layer's attention forward + backward at context t, batch b, on the prefill case's inputs
    and block ids (`prefill_case`), with a random bf16 cotangent. blocked: {variant: status} of
    variants not to time (a failed or unavailable gradient check); they keep that status.
    `out_rec` (filled per variant) and `snapshot()` (called after each) as in `prefill_case`."""
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    g, bs = h // kh, sp.block_size
    kq, kk, kv, kf = jax.random.split(jax.random.key(seed * 7919 + t + b), 4)
    q, k, v = _rand(kq, (b, t, h, d)), _rand(kk, (b, t, kh, d)), _rand(kv, (b, t, kh, d))
    ct = _rand(jax.random.fold_in(kq, 1), (b, t, h, d))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ids = jax.block_until_ready(_forecast_ids(kf, k, pos, sparse=sp, n_blocks=-(-t // bs), rho=query_correlation))

    att = np.asarray(attended_keys(ids, pos, block_size=bs)).astype(np.int64)  # [b, kh, t]
    n_ids = np.asarray(jnp.sum(ids >= 0, axis=-1)).astype(np.int64)
    flops_att = TRAIN_FLOP_FACTOR * 4.0 * d * g * att.sum()
    flops_dense = TRAIN_FLOP_FACTOR * 4.0 * b * h * d * t * t / 2
    io_bytes = 2.0 * (3 * q.size + 4 * k.size) + 4.0 * ids.size  # q, ct, dq, k, v, dk, dv, ids once each

    sl = query_slice(t, timed_queries)
    cp = _check_positions(sl, check_rows)
    sl_j, cp_j, cpsl_j = jnp.asarray(sl), jnp.asarray(cp), jnp.asarray(np.searchsorted(sl, cp))
    slice_scale = t / len(sl)
    sl_att = np.asarray(att[:, :, sl]).sum()
    seq = b - 1  # the last sequence: the largest offsets into q, ct and the gradients

    refs = {}

    def ref(kind):
        # dq of the checked rows by autodiff of the jnp forward on those rows alone (a query's dq
        # depends on its own row only); f32 queries, bf16 K/V upcast inside
        if kind not in refs:
            attend = functools.partial(_sparse_ref_attend, block_size=bs) if kind == "sparse" else _dense_ref_attend

            def loss(q_, k_, v_, ids_, pos_, ct_):
                return jnp.sum(attend(q_, k_, v_, ids_, pos_) * ct_.astype(jnp.float32))
            with jax.default_matmul_precision("highest"):
                refs[kind] = jax.jit(jax.grad(loss))(q[seq:seq + 1, cp_j].astype(jnp.float32), k[seq:seq + 1],
                                                     v[seq:seq + 1], ids[seq:seq + 1, :, cp_j],
                                                     pos[seq:seq + 1, cp_j], ct[seq:seq + 1, cp_j])
        return refs[kind]

    blocked = blocked or {}
    out_rec = {} if out_rec is None else out_rec
    snapshot = snapshot or (lambda: None)
    for name in variants:
        if budget is not None and budget.exceeded():
            out_rec[name] = {"status": budget.reason()}
            continue
        if name in blocked:
            out_rec[name] = {"status": blocked[name]}
            continue
        full = name not in ("xla", "dense_xla")
        args = ((q, k, v, ct, ids, pos) if full else
                (q[:, sl_j], k, v, ct[:, sl_j], ids[:, :, sl_j], pos[:, sl_j]))
        try:
            t0 = time.perf_counter()
            compiled = _train_step(_train_attend(name, bs)).lower(*args).compile()
            compile_s = time.perf_counter() - t0
            need, reason = _memory_fit(compiled)
            if reason is None:
                r = ref("dense" if name in DENSE_TRAIN else "sparse")
        except Exception as e:  # noqa: BLE001
            out_rec[name] = {"status": unavailable(e)}
            snapshot()
            continue
        if reason is not None:
            out_rec[name] = {"status": reason, "memory_gib": need}
            snapshot()
            continue
        if name in DENSE_TRAIN:
            keys = float(np.sum(sl.astype(np.int64) + 1))  # the slice's causal keys per (sequence, head)
            flops = flops_dense if full else TRAIN_FLOP_FACTOR * 4.0 * h * d * keys * b
        else:
            flops = flops_att if full else TRAIN_FLOP_FACTOR * 4.0 * d * g * sl_att
        rows = cp_j if full else cpsl_j
        rec = measure(lambda compiled=compiled, args=args: compiled(*args),
                      lambda o, r=r, rows=rows: _train_check(o, rows, r, seq), repeats=repeats, max_s=max_s)
        _timed_record(rec, full=full, t=t, n_slice=int(len(sl)), scale=slice_scale, flops=flops, io_bytes=io_bytes,
                      ceil=ceil, compile_seconds=compile_s, memory_gib=need)
        out_rec[name] = rec
        del args, compiled
        snapshot()

    res = {
        "T": t, "batch": b,
        "attended_keys_mean": float(att.mean()), "selected_blocks_mean": float(n_ids.mean()),
        "flops_attended": flops_att, "flops_dense_causal": flops_dense,
        "density_vs_dense_causal": flops_att / flops_dense,
        "check_rows": int(len(cp)), "check_batch_element": seq,
        "variants": out_rec,
    }
    ok = {n: v["seconds_layer"] for n, v in out_rec.items() if v.get("status") == "ok" and v.get("seconds_layer")}
    dense = next((n for n in DENSE_TRAIN if n in ok), None)  # cuDNN wherever it ran
    if dense is not None:
        res["dense_baseline"] = dense
        for n in ok:
            if n not in DENSE_TRAIN:
                out_rec[n]["speedup_over_dense"] = ok[dense] / ok[n]
    best = min((n for n in ok if n in SPARSE), key=ok.get, default=None)  # interpreted runs never count
    res["best_sparse"] = best
    if best and dense:
        res["speedup_sparse_over_dense"] = ok[dense] / ok[best]
        if t == TRAIN_GOAL_T:
            res["target"] = TRAIN_TARGET
            res["met"] = bool(res["speedup_sparse_over_dense"] >= TRAIN_TARGET)
    return res


# H100/H200 L2: 50 MB. Positions recur within one timed call only when the other steps' bytes
# between two visits of one are at least 5x that (LRU-like replacement keeps nothing of it).
L2_GUARD_BYTES = 256 * 2**20


def _looped(one, dense: bool, loop: str = "map"):
    """jit of `steps` decode steps; the cache goes in as an argument (a closed-over array would be
    baked into the program as a constant). loop "map": a lax.map (an XLA while loop, whose trip
    costs the GPU a predicate read by the host each step); "unroll": the steps as straight-line
    calls, as the engine's layers issue the kernel."""
    if loop not in ("map", "unroll"):
        raise ValueError(f"loop must be 'map' or 'unroll', got {loop!r}")
    step = (lambda a, k, v: one(a[0], k, v, a[2])) if dense else (lambda a, k, v: one(a[0], k, v, a[1], a[2]))

    def run(q, k, v, ids, pos):
        if loop == "map":
            return jax.lax.map(lambda a: step(a, k, v), (q, ids, pos))
        return jnp.stack([step((q[i], ids[i], pos[i]), k, v) for i in range(q.shape[0])])
    return jax.jit(run)


def decode_case(t: int, b: int, shape: dict, ceil: dict, *, variants=DECODE_VARIANTS, repeats: int = 3,
                steps: int = 8, max_s: float = 3.0, budget: Budget | None = None, seed: int = 0,
                out_rec: dict | None = None, snapshot=None, loop: str = "map") -> dict:
    """`steps` decode steps run inside one jit (lax.map), each with its own query, position and
    block ids: per-call dispatch (~10 us) would otherwise dominate a ~30 us kernel. Positions are
    spaced by more than the local window so consecutive steps share few blocks and L2 does not
    serve the next step's K/V (a real decode step reads another layer's cache). A context too
    short for `steps` such positions cycles through the ones it has, when the bytes the other
    steps read between two visits of a position exceed L2 many times over (L2_GUARD_BYTES; each
    step also draws its own block ids, so only the forced blocks recur); else fewer steps run."""
    h, kh, d, sp = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["sparse"]
    bs = sp.block_size
    spacing = (sp.local_blocks + 2) * bs
    distinct = max(1, min(steps, (t - bs) // spacing))
    per_step_bound = b * kh * sp.topk * bs * d * 2 * 2  # K and V of every selected block, bf16
    if (distinct - 1) * per_step_bound < L2_GUARD_BYTES:
        steps = distinct
    kq, kk, kv, kf = jax.random.split(jax.random.key(seed * 7919 + t + 3 * b + 1), 4)
    k, v = _rand(kk, (b, t, kh, d)), _rand(kv, (b, t, kh, d))
    q = _rand(kq, (steps, b, 1, h, d))
    p = np.array([t - 1 - (i % distinct) * spacing for i in range(steps)], np.int32)
    pos_bs = jnp.broadcast_to(jnp.asarray(p)[None], (b, steps))  # [b, steps]
    ids = _forecast_ids(kf, k, pos_bs, sparse=sp, n_blocks=-(-t // bs))  # [b, kh, steps, topk]
    ids = jnp.moveaxis(ids, 2, 0)[:, :, :, None]  # [steps, b, kh, 1, topk]
    pos = jnp.moveaxis(pos_bs, 1, 0)[:, :, None]  # [steps, b, 1]
    itemsize = 2
    n_sel = np.asarray(jnp.sum(ids >= 0, axis=-1)).astype(np.int64)  # [steps, b, kh, 1]
    bytes_sel = float(n_sel.sum()) * bs * d * itemsize * 2 / steps  # K and V, whole blocks (TMA boxes)
    bytes_dense = float(b * kh * d * itemsize * 2 * (p.astype(np.int64) + 1).sum()) / steps

    # checked on the first few sequences: the dense reference upcasts the whole cache to f32
    nc = min(b, 4)
    q0 = q[0, :nc].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        r = jax.jit(functools.partial(sparse_attention_reference, block_size=bs))(
            q0, k[:nc], v[:nc], ids[0, :nc], pos[0, :nc])
        r_dense = (jax.jit(dense_attention_reference)(q0, k[:nc], v[:nc], pos[0, :nc])
                   if "cudnn" in variants else None)

    out_rec = {} if out_rec is None else out_rec
    snapshot = snapshot or (lambda: None)
    for name in variants:
        if budget is not None and budget.exceeded():
            out_rec[name] = {"status": budget.reason()}
            continue
        if name in SPARSE + INTERPRETED:
            looped = _looped(functools.partial(sparse_attention, block_size=bs, implementation=name), False, loop)
            nbytes, rr = bytes_sel, r
        elif _decode_choice(name) is not None:
            looped = _looped(functools.partial(sparse_attention, block_size=bs, implementation="mosaic_gpu",
                                               config=_decode_choice(name)), False, loop)
            nbytes, rr = bytes_sel, r
        elif name == "mosaic_gpu@split":
            from sparda_jax.ops.sparse_attention.decode import combine_splits, sparse_decode_split_pass

            def split(q1, k1, v1, ids1, pos1):
                return sparse_decode_split_pass(q1[:, 0], k1, v1, ids1[:, :, 0].astype(jnp.int32),
                                                pos1[:, 0].astype(jnp.int32))
            looped = _looped(split, False, loop)
            nbytes, rr = bytes_sel, r
        elif name == "cudnn":
            looped = _looped(functools.partial(dense_attention, implementation="cudnn"), True, loop)
            nbytes, rr = bytes_dense, r_dense
        else:
            out_rec[name] = {"status": f"unavailable: unknown decode variant {name!r}"}
            continue
        if name == "mosaic_gpu@split":  # combine step 0's splits (untimed) for the check
            def check(o, rr=rr):
                out = combine_splits(o[0][0, :nc], o[1][0, :nc]).reshape(nc, 1, -1, rr.shape[-1])
                return rel_check(out.astype(BF16), rr, REL_ERR_BOUND)
        else:
            def check(o, rr=rr):
                return rel_check(o[0, :nc], rr, REL_ERR_BOUND)
        rec = measure(lambda looped=looped: looped(q, k, v, ids, pos), check, repeats=repeats, max_s=max_s)
        rec["steps_per_call"] = steps
        if "seconds" in rec:
            s = rec["seconds"] / steps
            rec.update(seconds_per_step=s, seconds_layer=s, bytes_per_step=nbytes,
                       gb_per_s=nbytes / s / 1e9, vs_hbm=nbytes / s / 1e9 / ceil["hbm_gb_per_s"])
            rec["floor_seconds"] = nbytes / (ceil["hbm_gb_per_s"] * 1e9)
            rec["achieved_over_floor"] = rec["floor_seconds"] / s
        out_rec[name] = rec
        snapshot()
    res = {"T": t, "batch": b, "steps": steps, "distinct_positions": distinct, "positions": p.tolist(),
           "bytes_between_visits": (distinct - 1) * bytes_sel if steps > distinct else None,
           "selected_blocks_mean": float(n_sel.mean()), "bytes_selected_per_step": bytes_sel,
           "bytes_dense_per_step": bytes_dense, "variants": out_rec}
    best = _best(out_rec, SPARSE + tuple(v for v in out_rec if _decode_choice(v)), "gb_per_s")  # interpreted runs never count
    res["best_sparse"] = best
    if best:
        res["ratio_bytes_per_s_over_hbm"] = out_rec[best]["vs_hbm"]
        res["target"] = DECODE_TARGET
        res["met"] = bool(out_rec[best]["vs_hbm"] >= DECODE_TARGET)
    return res


def bench_attention(preset: str = "minicpm4.1-8b", *, lengths=(32768, 65536, 131072), batch: int = 4,
                    decode_batches=(16, 64), repeats: int = 3, variants=None, timed_queries: int = 2048,
                    decode_steps: int = 8, budget_s: float | None = 140.0, max_s: float = 3.0,
                    matmul_n: int = 8192, copy_mib: int = 2048, seed: int = 0, query_correlation: float = 0.0,
                    decode: bool = True, prefill: bool = True, train: bool = False, decode_loop: str = "map",
                    grad_check_t: int = 8192, grad_check_queries: int = 256, out=None, log=None) -> dict:
    """decode_loop: how the decode steps of one timed call are issued (`_looped`). Runs the prefill,
    decode and train cases asked for (train: after each sparse train variant's gradient check,
    `train_grad_check` at grad_check_t tokens, grad_check_queries queries, batch 1); with `out`,
    the JSON is rewritten after every variant ("complete": false until the end) so a crash keeps
    what was measured."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    shape = model_shape(preset)
    budget = Budget(budget_s)
    ceil = ceilings(matmul_n=matmul_n, copy_mib=copy_mib)
    log(f"[attention] ceilings: {ceil['matmul_tflops']:.0f} TFLOP/s bf16, {ceil['hbm_gb_per_s']:.0f} GB/s")
    # one --variants list serves both phases; each phase keeps the names it knows
    pv = PREFILL_VARIANTS if variants is None else tuple(v for v in variants if v in PREFILL_VARIANTS + ("dense_xla",))
    dv = DECODE_VARIANTS if variants is None else tuple(v for v in variants if v in DECODE_VARIANTS + INTERPRETED
                                                        or _decode_choice(v) is not None)
    tv = TRAIN_VARIANTS if variants is None else tuple(v for v in variants if v in TRAIN_VARIANTS + INTERPRETED)
    config = {**_shape_json(shape), "lengths": list(lengths), "batch": batch, "decode_batches": list(decode_batches),
              "repeats": repeats, "max_seconds_per_variant": max_s, "prefill_variants": list(pv),
              "decode_variants": list(dv), "train_variants": list(tv) if train else [],
              "timed_queries_for_slice_variants": timed_queries,
              "decode_steps_per_call": decode_steps, "decode_loop": decode_loop, "budget_s": budget_s, "dtype": "bfloat16",
              "block_ids_source": "select_blocks_forecast (XLA) on random bf16 Forecast queries and the "
                                  "compressed random keys: random weights choose nearly random content "
                                  "blocks beyond the forced init/local ones (no realistic pattern assumed)"
                                  if query_correlation == 0 else
                                  f"select_blocks_forecast (XLA) on Forecast queries AR(1) along positions, "
                                  f"rho = {query_correlation} (bench.attention.correlated_normal): neighbouring "
                                  f"tokens choose alike, as on real text; rho 0.99 gives the tile union that "
                                  f"SmolLM2's own selections show (eval/results/tile_union_smollm2.json)",
              "query_correlation": query_correlation,
              "flop_counts": "sparse: 4 * D * H * (keys each query attends in its blocks, causal); dense: "
                             "4 * B * H * D * T^2 / 2; slice variants count their own queries",
              "slice_note": "xla / dense_xla are timed on `timed_queries` queries in runs of 512 spread "
                            "evenly over the sequence and scaled by T / timed_queries to seconds_layer",
              "decode_note": "steps_per_call decode steps in one jit (lax.map or unrolled: decode_loop), positions spaced beyond the "
                             "local window; bytes = selected blocks x 64 tokens x D x 2 B x (K and V)"}
    if train:
        config["train_note"] = (
            f"one jit: loss = sum(out * ct) in f32 (ct random bf16 [B, T, H, D]) and its gradients in q, k, v; "
            f"flops = {TRAIN_FLOP_FACTOR} x the forward's (backward 2.5 x forward); xla / dense_xla on the query "
            f"slice and scaled like prefill's (their O(T) zeroing of dk, dv is scaled with it); speedup = the dense "
            f"baseline's seconds_layer (cuDNN where it ran) / the sparse variant's; goal {TRAIN_TARGET}x at "
            f"T={TRAIN_GOAL_T} (InfLLM-V2 reports {PAPER_TRAIN_SPEEDUP}x over FlashAttention on an H100)")
        config["grad_check"] = {"T": grad_check_t, "queries": grad_check_queries, "batch": 1,
                                "bound": REL_ERR_BOUND, "reference": "autodiff of sparse_attention_reference, "
                                "f32 inputs, highest precision; queries at the context's end"}
    r = {"name": "attention", "complete": False, "environment": environment(), "config": config,
         "ceilings": ceil, "prefill": [], "decode": [], "train": [], "skipped": [], "claims": []}

    def snapshot():
        r["elapsed_s"] = budget.elapsed()
        if out:
            write_json(r, out)

    def run(phase, t, b, fn, **kw):
        if budget.exceeded():
            r["skipped"].append({"phase": phase, "T": t, "batch": b, "reason": budget.reason()})
            return
        holder = {"T": t, "batch": b, "incomplete": True, "variants": {}}
        r[phase].append(holder)
        try:
            r[phase][-1] = fn(t, b, shape, ceil, out_rec=holder["variants"], snapshot=snapshot, repeats=repeats,
                              max_s=max_s, budget=budget, seed=seed, **kw)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory making the inputs
            r[phase].pop()
            r["skipped"].append({"phase": phase, "T": t, "batch": b, "reason": unavailable(e)})
        snapshot()
        log(f"[attention] {phase} T={t} B={b} done at {budget.elapsed():.0f} s")

    for t in lengths if prefill else ():
        run("prefill", t, batch, prefill_case, variants=pv, timed_queries=timed_queries,
            query_correlation=query_correlation)
    for t in lengths if decode else ():
        for b in decode_batches:
            run("decode", t, b, decode_case, variants=dv, steps=decode_steps, loop=decode_loop)
    if train:
        # a sparse variant is timed only after its gradients pass the check
        r["train_grad_check"] = {}
        for name in (n for n in tv if n not in DENSE_TRAIN):
            r["train_grad_check"][name] = train_grad_check(name, shape, t=grad_check_t, queries=grad_check_queries,
                                                           seed=seed, query_correlation=query_correlation)
            snapshot()
            gc = r["train_grad_check"][name]
            log(f"[attention] gradient check {name}: {gc['status'][:80]}"
                + (f", max rel err {gc['max_rel_err']:.2g}" if "max_rel_err" in gc else ""))
        blocked = {n: c["status"] for n, c in r["train_grad_check"].items() if not c["passed"]}
        for t in lengths:
            run("train", t, batch, train_case, variants=tv, timed_queries=timed_queries,
                query_correlation=query_correlation, blocked=blocked)
    for c in r["prefill"]:
        if "ratio_sparse_over_dense_tflops" in c:
            v = c["variants"][c["best_sparse"]]
            rho = f" (queries AR(1), rho {query_correlation})" if query_correlation else ""
            r["claims"].append({"claim": f"prefill T={c['T']}{rho}: sparse effective TFLOP/s / dense TFLOP/s",
                                "value": c["ratio_sparse_over_dense_tflops"], "target": PREFILL_TARGET,
                                "met": c["met"], "sparse": c["best_sparse"], "dense": c["best_dense"],
                                "achieved_over_floor": v.get("achieved_over_floor"),
                                "achieved_over_union_floor": v.get("achieved_over_union_floor"),
                                "ratio_if_sparse_at_union_floor": c.get("ratio_if_sparse_at_union_floor")})
    for c in r["decode"]:
        if "ratio_bytes_per_s_over_hbm" in c:
            r["claims"].append({"claim": f"decode T={c['T']} B={c['batch']}: selected K/V bytes/s / HBM copy bandwidth",
                                "value": c["ratio_bytes_per_s_over_hbm"], "target": DECODE_TARGET, "met": c["met"],
                                "sparse": c["best_sparse"],
                                "achieved_over_floor": c["variants"][c["best_sparse"]].get("achieved_over_floor")})
    for c in r["train"]:
        if "target" in c:
            r["claims"].append({"claim": f"train T={c['T']} B={c['batch']}: dense forward + backward time / sparse "
                                         f"(paper: {PAPER_TRAIN_SPEEDUP}x over FlashAttention, H100)",
                                "value": c["speedup_sparse_over_dense"], "target": c["target"], "met": c["met"],
                                "sparse": c["best_sparse"], "dense": c["dense_baseline"],
                                "paper": PAPER_TRAIN_SPEEDUP})
    r["complete"] = True
    snapshot()
    return r


def _fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def table(r: dict) -> str:
    c = r["ceilings"]
    lines = [f"ceilings: {c['matmul_tflops']:.0f} TFLOP/s bf16 matmul, {c['hbm_gb_per_s']:.0f} GB/s copy",
             "| phase | T | B | variant | ms/layer | TFLOP/s or GB/s | vs ceiling | floor ratio | check |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ph in ("prefill", "decode", "train"):
        for cs in r.get(ph, []):
            for n, v in cs["variants"].items():
                if "seconds_layer" not in v:
                    lines.append(f"| {ph} | {cs['T']} | {cs['batch']} | {n} | {v['status'][:50]} | | | | |")
                    continue
                rate = v.get("gb_per_s") if ph == "decode" else v.get("tflops_effective")
                vs = v.get("vs_hbm") if ph == "decode" else rate / c["matmul_tflops"]
                chk = "ok" if v["check"]["passed"] else f"FAIL {v['check']['rel_err']:.2g}"
                sc = "*" if v.get("scaled") else ""
                lines.append(f"| {ph} | {cs['T']} | {cs['batch']} | {n}{sc} | {v['seconds_layer'] * 1e3:.3g} | "
                             f"{rate:.4g} | {_fmt(vs, '.2f')} | {_fmt(v.get('achieved_over_floor'), '.2f')} | {chk} |")
    for cs in r["prefill"]:
        if "union_mean_tile8" in cs:
            lines.append(f"prefill T={cs['T']}: mean union of blocks over 8-token tiles {cs['union_mean_tile8']:.0f} "
                         f"(topk {r['config']['topk']})")
    for n, gc in r.get("train_grad_check", {}).items():
        err = (f"max rel err {gc['max_rel_err']:.2g}, max abs err {gc['max_abs_err']:.2g}, "
               if "max_rel_err" in gc else "")
        lines.append(f"gradient check {n} (T={gc['T']}, last {gc['queries']} queries): {err}bound {gc['bound']}: "
                     f"{gc['status'][:80]}")
    for cs in r.get("train", []):
        sp = [f"{n} {v['speedup_over_dense']:.2f}x" for n, v in cs["variants"].items() if "speedup_over_dense" in v]
        if sp:
            lines.append(f"train T={cs['T']} B={cs['batch']}: {cs['dense_baseline']} time / sparse time: "
                         f"{', '.join(sp)}")
    lines += claim_lines(r)
    lines.append("* timed on a query slice and scaled (JSON: timed_queries, scale); train: ms/layer is forward + "
                 "backward")
    return "\n".join(lines)


def _plot_prefill(ax, r) -> None:
    for n in sorted({n for cs in r["prefill"] for n in cs["variants"]}):
        pts = [(cs["T"], cs["variants"][n]["tflops_effective"]) for cs in r["prefill"]
               if cs["variants"].get(n, {}).get("tflops_effective")]
        if pts:
            ax.plot(*zip(*pts), "o-", label=n)
    ax.axhline(r["ceilings"]["matmul_tflops"], ls="--", c="gray", label="bf16 matmul")
    ax.set(xscale="log", xlabel="context T", ylabel="TFLOP/s (sparse: attended keys)",
           title=f"prefill, batch {r['config']['batch']}")
    ax.legend(fontsize=7)


def _plot_decode(ax, r) -> None:
    for n in sorted({n for cs in r["decode"] for n in cs["variants"]}):
        for b in r["config"]["decode_batches"]:
            pts = [(cs["T"], cs["variants"][n]["gb_per_s"]) for cs in r["decode"]
                   if cs["batch"] == b and cs["variants"].get(n, {}).get("gb_per_s")]
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"{n} B={b}")
    ax.axhline(r["ceilings"]["hbm_gb_per_s"], ls="--", c="gray", label="HBM copy")
    ax.set(xscale="log", xlabel="context T", ylabel="GB/s (K/V read)", title="decode")
    ax.legend(fontsize=7)


def _plot_train(ax_ms, ax_x, r) -> None:
    """Forward + backward ms per layer by variant; each sparse variant's speedup over the dense
    baseline, with the goal and the paper's figure at TRAIN_GOAL_T."""
    cases = r["train"]
    for n in sorted({n for cs in cases for n in cs["variants"]}):
        pts = [(cs["T"], cs["variants"][n]["seconds_layer"] * 1e3) for cs in cases
               if cs["variants"].get(n, {}).get("status") == "ok"]
        if pts:
            ax_ms.plot(*zip(*pts), "o-", label=n + ("*" if n in ("xla", "dense_xla") else ""))
        sp = [(cs["T"], cs["variants"][n]["speedup_over_dense"]) for cs in cases
              if "speedup_over_dense" in cs["variants"].get(n, {})]
        if sp:
            ax_x.plot(*zip(*sp), "o-", label=n)
    ax_ms.set(xscale="log", yscale="log", xlabel="context T", ylabel="ms per layer, forward + backward",
              title=f"train, batch {r['config']['batch']} (* query slice, scaled)")
    ax_ms.legend(fontsize=7)
    ax_x.axhline(1.0, ls=":", c="gray")
    ax_x.plot([TRAIN_GOAL_T], [TRAIN_TARGET], "k_", ms=20, label=f"goal {TRAIN_TARGET}x")
    ax_x.plot([TRAIN_GOAL_T], [PAPER_TRAIN_SPEEDUP], "r*", label=f"InfLLM-V2 (H100) {PAPER_TRAIN_SPEEDUP}x")
    dense = {cs.get("dense_baseline") for cs in cases} - {None}
    ax_x.set(xscale="log", xlabel="context T", ylabel=f"{'/'.join(sorted(dense)) or 'dense'} time / sparse time",
             title="train: speedup over dense")
    ax_x.legend(fontsize=7)


def plot(json_path) -> str | None:
    """The PNG beside the JSON; None when matplotlib is missing. Prefill and decode panels (both
    when the run has no train cases, as before), then the train panels."""
    plt, r = pyplot_and_result(json_path)
    if plt is None:
        return None
    train = bool(r.get("train"))
    phases = [ph for ph in ("prefill", "decode") if r[ph] or not train]
    fig, axes = plt.subplots(1, len(phases) + 2 * train, figsize=(5.5 * (len(phases) + 2 * train), 4), squeeze=False)
    axes = list(axes[0])
    for ph in phases:
        (_plot_prefill if ph == "prefill" else _plot_decode)(axes.pop(0), r)
    if train:
        _plot_train(axes[0], axes[1], r)
    return save_png(plt, fig, json_path)


def main(args) -> int:
    out = args.out or default_out("attention/attention.json")
    if args.prefill_only + args.decode_only + args.train_only > 1:
        print("sparda: error: bench attention takes one of --prefill-only, --decode-only, --train-only",
              file=sys.stderr)
        return 2
    r = bench_attention(args.preset, lengths=tuple(args.lengths or (32768, 65536, 131072)),
                        batch=args.batch or 4, decode_batches=tuple(args.decode_batches or (16, 64)),
                        repeats=args.repeats, variants=args.variants, timed_queries=args.timed_queries or 2048,
                        decode_steps=args.decode_steps, budget_s=args.budget_s, max_s=args.max_variant_s,
                        matmul_n=args.matmul_n, copy_mib=args.copy_mib,
                        query_correlation=args.query_correlation,
                        decode=not (args.prefill_only or args.train_only),
                        prefill=not (args.decode_only or args.train_only), train=args.train_only,
                        decode_loop=args.decode_loop, out=out)
    return plot_and_print(r, out, plot, table)
