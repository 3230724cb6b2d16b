"""`sparda bench decode` / `sparda bench cta`: decode tokens/s of every system (paper Table 4)
and vs the copy kernel's CTA quota (Table 7), through `infer.engine.engine_decode_step`.

Systems (`EngineConfig.system`): dense_resident (Dense+), sparse_resident (Sparse+), sparse, infinigen,
sparda_sync (SparDA without prefetch), sparda. Random weights of the preset's shapes; the
decode state is built directly (`bench/engine_state.py`: random bf16 K/V of `context` tokens in
the pinned host pools, compressed keys from those keys), not by a prefill.

Per configuration (mode, context, batch):
  feasibility  `memory_report` of the FULL model + its weights against this machine's host memory
               and the device allocator limit; a configuration that does not fit is reported and
               not run, whatever the number of layers timed
  check        step 0 (cold block cache) of row 0 against the resident decode of the same row
               (`modes.decode_step`, batch 1, same K/V, same token): relative error of the logits;
               the step-0 copy counts must equal the selected counts (the cache starts empty)
  timing       warm-up steps outside the timed region (compile included), then `steps` steps
               dispatched back to back with one wait at the end (tokens/s, step_seconds), as a
               generation loop that keeps its tokens on the device runs them: the host dispatches
               step i+1 while step i runs. Then `steps` more each timed with its own
               block_until_ready (sync_*: median, min, max), which adds the host's dispatch of
               every step to the device time; scaled by the layer factor below, that fixed cost
               would count as often as the layers do
  traffic      miss rate = copied / selected blocks over the timed steps; bytes copied per step
Layers: `layers` are built and timed and the step time is scaled by full / timed layers (every
layer >= 1 does the same work; layer 0, resident, and the embedding/LM head are counted as if
they were offloaded layers). The JSON says "layers_timed" and "scaled_to".

Random weights choose nearly random blocks, so consecutive steps reuse few of them. Variant
"reuse=f": a fraction f of the rows repeats step 0 (same token, same position) every step, so its
selections repeat and it copies nothing after step 0; the other rows advance. This is an
emulation of a lower miss rate, labelled so; `--real-miss-rate` derives f from a miss rate
measured on a real model (f = 1 - real / random), `real_miss_rate` measures one (SmolLM2 on real
text) when the model is installed.

    sparda bench decode --out bench/results/decode/decode.json
    sparda bench cta --out bench/results/cta/cta.json
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.bench.engine_state import (BF16, bench_config, block_bytes, build_state, feasibility, kwargs_for,
                                           make_extras, make_params, row_tokens, weights_bytes)
from sparda_jax.bench.timing import plot_and_print, Budget, ceilings, rel_check, unavailable, write_json, claim_lines, pyplot_and_result, save_png
from sparda_jax.compress import group_tokens
from sparda_jax.envinfo import environment
from sparda_jax.config import Implementations
from sparda_jax.infer.engine import (OFFLOAD_SYSTEMS, RESIDENT_SYSTEMS, EngineConfig, engine_decode_step, engine_decode_steps,
                                     selector_of)
from sparda_jax.model import layered_params
from sparda_jax.modes import decode_step, stacked_state
from sparda_jax.kernels.kv_copy import unaliased_copies
from sparda_jax.bench import default_out

__all__ = ["bench_decode", "bench_cta", "decode_config", "marginal", "real_fractions", "at_miss_rate", "real_miss_rate", "table", "cta_table", "plot", "decomposition",
           "DECODE_COPY_START"]

MODES = ("dense_resident", "sparse_resident", "sparse", "infinigen", "sparda_sync", "sparda")
LABELS = {"dense_resident": "Dense+", "sparse_resident": "Sparse+", "sparse": "Sparse", "infinigen": "InfiniGen",
          "sparda_sync": "SparDA-no-prefetch", "sparda": "SparDA"}
# bf16 weights and activations; batch 1 and batch B matmuls round differently, and a near-tied
# block at the top-k boundary may swap: a few 1e-3..1e-2. A wrong slot/table mapping attends to
# other random K/V: O(1).
LOGIT_BOUND = 5e-2
SPEEDUP_TARGET = 1.7        # SparDA / Sparse tokens/s at batch 8, 128K (paper 1.69 on H100)
PREFETCH_MIN_BATCH = 16     # SparDA > SparDA-no-prefetch from this batch on
# The paper's decode tokens/s at 128K on the H100 (Table 4; Table 10 for SparDA-no-prefetch), so its
# SparDA / Sparse splits into the same factors as ours (`decomposition`). Sparse+ is OOM past batch 4.
PAPER_DECODE_128K = {4: {"sparse_resident": 189.5, "sparse": 167.8, "sparda_sync": 247.3, "sparda": 240.2},
                     8: {"sparse": 279.5, "sparda": 471.2},
                     16: {"sparse": 447.9, "sparda_sync": 505.9, "sparda": 705.3},
                     64: {"sparse": 788.9, "sparda_sync": 696.9, "sparda": 1000.1}}
# (factor, slower system, faster system): tokens/s of the second over the first. selector x prefetch
# = total: the Forecast's selection against InfLLM-V2's with both copies synchronous, then the copy
# one layer ahead; copy_free: SparDA against Sparse+, which keeps all KV on the GPU and copies none.
FACTORS = (("selector", "sparse", "sparda_sync"), ("prefetch", "sparda_sync", "sparda"), ("total", "sparse", "sparda"),
           ("copy_free", "sparse_resident", "sparda"))
# how sparda starts its copies in these benchmarks (EngineConfig.copy_start): the lanes, with which
# the committed claims were measured
DECODE_COPY_START = "lanes"


def _log_default(s):
    print(s, file=sys.stderr, flush=True)


def _h2d_gb_per_s(mib: int = 512, repeats: int = 5) -> float | None:
    """Pinned host -> device bandwidth of one bulk copy: the PCIe floor's denominator."""
    try:
        from sparda_jax.infer.engine import host_pool

        x = host_pool(jax.random.normal(jax.random.key(0), (mib * 2**19,), BF16))  # placed as the pools are
        f = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device))
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
        return mib * 2**20 / float(np.median(ts)) / 1e9
    except Exception:  # noqa: BLE001 - CPU backends without memory spaces
        return None


class _Ctx:
    """What every configuration of one run shares: configs, weights, extras, references."""

    def __init__(self, preset, layers, modes, seed, log, weights: str = "layered", steps_per_call: int = 1):
        self.cfg, self.full = bench_config(preset, layers)
        self.params = make_params(self.cfg, seed)  # stacked: the resident reference's scan reads these
        if weights not in ("layered", "stacked"):
            raise ValueError(f"weights must be 'layered' or 'stacked', got {weights!r}")
        # what the engine's steps read: per layer as `generate` gives them, or stacked (every step
        # slices each layer's weights)
        self.step_params = layered_params(self.params) if weights == "layered" else self.params
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        # > 1: each call runs that many steps in one program (`engine_decode_steps`); every time and
        # count a row reports is still per step
        self.steps_per_call = steps_per_call
        self.extras = make_extras(self.cfg, modes, seed)
        self.weights_full = weights_bytes(self.full)
        self.seed = seed
        self.tok_key = jax.random.key(seed + 7)
        self.refs: dict = {}
        self.log = log

    def tokens(self, step, batch):
        return row_tokens(self.tok_key, step, batch=batch, vocab=self.cfg.vocab_size)

    def reference(self, mode: str, context: int):
        """Row 0's step-0 logits from the resident decode (batch 1), once per selector and context."""
        sel = selector_of(mode)
        key = (sel, context)
        if key not in self.refs:
            res_mode = {"dense": "dense_resident", "sparse": "sparse_resident"}.get(sel, "sparse_resident")
            # stacked: the reference runs the scan over layers, not the engine's per-layer loop
            st = stacked_state(build_state(self.cfg, batch=1, context=context, mode=res_mode, seed=self.seed,
                                           infinigen=self.extras["infinigen"]))
            if sel == "infinigen":  # the resident sparse state has no partial keys: add them
                st = st.replace(pk=jnp.einsum("LBSKD,LKDR->LBSKR", st.kv.k.astype(jnp.float32),
                                              self.extras["infinigen"].proj))
            logits, _ = decode_step(self.params, self.tokens(0, 1), jnp.full((1,), context, jnp.int32), st, self.cfg,
                                    mode=sel, dtype=BF16, **kwargs_for(self.extras, mode))
            self.refs[key] = np.asarray(logits[0], np.float32)
        return self.refs[key]


def _build(ctx: _Ctx, mode: str, context: int, batch: int, calls: int = 0):
    """The row's state, with room for `calls` calls' steps (64 positions at least)."""
    state = build_state(ctx.cfg, batch=batch, context=context, mode=mode, seed=ctx.seed,
                        infinigen=ctx.extras["infinigen"], extra_tokens=max(64, calls * ctx.steps_per_call))
    jax.block_until_ready(state)
    return state


def _row_inputs(ctx: _Ctx, context: int, batch: int, n_rep: int, n: int) -> list:
    """Every call's (tokens, positions), made before any timed region: rows < n_rep repeat step 0.
    With ctx.steps_per_call = k > 1 a call is k steps: tokens and positions [k, B]. A repeated
    position must start a compression group (`CompressedKeys.append` restarts it there; elsewhere
    it would count the key again)."""
    g = group_tokens(ctx.cfg.sparse.kernel_size, ctx.cfg.sparse.kernel_stride)
    if n_rep and context % g:
        raise ValueError(f"repeating rows need a context that is a multiple of gcd(kernel_size, kernel_stride) "
                         f"= {g}, got {context}")
    rows = np.arange(batch)
    tok0 = ctx.tokens(0, batch)
    k = ctx.steps_per_call
    steps = []
    for i in range(n * k):
        pos = np.where(rows < n_rep, context, context + i).astype(np.int32)
        tok = jnp.where(jnp.asarray(rows < n_rep), tok0, ctx.tokens(i, batch))
        steps.append((tok, pos))
    if k == 1:
        return steps
    return [(jnp.stack([t for t, _ in steps[i:i + k]]), np.stack([p for _, p in steps[i:i + k]]))
            for i in range(0, n * k, k)]


def _stepper(ctx: _Ctx, mode: str, *, copy_impl, num_ctas):
    """step(tokens, positions, state) -> (logits, state, stats) of the row's mode and copy settings:
    one step, or with ctx.steps_per_call > 1 that many (`engine_decode_steps`: inputs, logits and
    stats with a leading step axis)."""
    kw = kwargs_for(ctx.extras, mode)
    run = engine_decode_step if ctx.steps_per_call == 1 else engine_decode_steps
    # the lanes, as the committed decode and CTA claims were measured (docs/decisions.md, "One start
    # of every payload": at these shapes one start timed as the lanes)
    engine = EngineConfig(mode, num_ctas=num_ctas, implementations=Implementations(kv_copy=copy_impl),
                          copy_start=DECODE_COPY_START)

    def step(tok, pos, st):
        return run(ctx.step_params, tok, pos, st, ctx.cfg, engine, dtype=BF16, **kw)
    return step


def _first_step(ctx: _Ctx, x):
    """The first step's part of a call's output (its logits or a counter)."""
    return x if ctx.steps_per_call == 1 else x[0]


def _per_step(ctx: _Ctx, stats: list, name: str) -> float:
    """A counter's mean per step over calls' stats."""
    return float(np.mean([int(np.sum(s[name])) for s in stats])) / ctx.steps_per_call


def _back_to_back(call, carry, lo: int, hi: int, host_period: list | None = None):
    """Seconds per call of call(i, carry) -> (carry, out) for i in lo..hi-1, dispatched back to
    back with one wait at the end, as a generation loop that keeps its tokens on the device runs
    them: the host dispatches call i+1 while call i runs. Returns (seconds, carry, outs).
    host_period: appends the host's seconds per call until the last returned, before the wait.
    Close to the result, the calls were bound by the host, unless full launch queues held it
    back."""
    outs = []
    t0 = time.perf_counter()
    for i in range(lo, hi):
        carry, out = call(i, carry)
        outs.append(out)
    if host_period is not None:
        host_period.append((time.perf_counter() - t0) / max(1, hi - lo))
    jax.block_until_ready((carry, outs))
    return (time.perf_counter() - t0) / max(1, hi - lo), carry, outs


def decode_config(ctx: _Ctx, mode: str, context: int, batch: int, *, steps: int, warmup: int,
                  reuse_fraction: float = 0.0, num_ctas: int | None = None, copy_impl: str | None = None,
                  check: bool = True, profile_steps: int = 0, profile_dir=None) -> dict:
    """One row: a (system, context, batch, traffic) configuration checked, then timed."""
    cfg, full = ctx.cfg, ctx.full
    n_rep = int(round(reuse_fraction * batch))
    per_call = ctx.steps_per_call
    rec = {"mode": mode, "system": LABELS.get(mode, mode), "T": context, "batch": batch,
           "variant": "random" if n_rep == 0 else f"reuse={n_rep / batch:.2f}",
           "repeating_rows": n_rep, "num_ctas": num_ctas,
           "layers_timed": cfg.num_layers, "steps_per_call": per_call, "copy_start": DECODE_COPY_START}
    feas = feasibility(full, mode, batch=batch, context=context, weights=ctx.weights_full)
    rec["feasibility"] = {k: feas[k] for k in ("fits", "reason", "host_need_bytes", "device_need_bytes",
                                               "host_bytes", "device_limit_bytes", "layers")}
    if not feas["fits"]:
        rec["status"] = f"infeasible at {full.num_layers} layers: {feas['reason']}"
        return rec
    calls = 1 + warmup + 2 * steps + profile_steps
    t_build = time.perf_counter()
    state = _build(ctx, mode, context, batch, calls)
    rec["state_build_seconds"] = time.perf_counter() - t_build
    step = _stepper(ctx, mode, copy_impl=copy_impl, num_ctas=num_ctas)
    inputs = _row_inputs(ctx, context, batch, n_rep, calls)

    t0 = time.perf_counter()
    logits, state, stats = step(*inputs[0], state)
    jax.block_until_ready((logits, state))
    rec["first_call_seconds"] = time.perf_counter() - t0  # compile + cold cache
    lg = np.asarray(_first_step(ctx, logits), np.float32)
    chk = {"finite": bool(np.isfinite(np.asarray(logits, np.float32)).all())}
    sel0, cop0 = int(_first_step(ctx, stats["selected_blocks"])), int(_first_step(ctx, stats["copied_blocks"]))
    if mode in OFFLOAD_SYSTEMS:
        want = (cfg.num_layers - 1) * batch * cfg.num_kv_heads * min(cfg.sparse.topk, -(-(context + 1) // cfg.sparse.block_size))
        chk.update(step0_selected_blocks=sel0, step0_copied_blocks=cop0, step0_selected_expected=want,
                   counts_ok=bool(sel0 == want and cop0 == sel0))
    if check and selector_of(mode) != "dense":
        try:
            chk["vs_resident_row0"] = rel_check(lg[0], ctx.reference(mode, context), LOGIT_BOUND)
        except Exception as e:  # noqa: BLE001 - the reference may not fit; say so
            chk["vs_resident_row0"] = {"passed": False, "error": unavailable(e)}
    elif selector_of(mode) == "dense":
        chk["vs_resident_row0"] = "not checked: dense_resident is the reference system (finite logits only)"
    chk["passed"] = bool(chk["finite"] and chk.get("counts_ok", True)
                         and (not isinstance(chk.get("vs_resident_row0"), dict) or chk["vs_resident_row0"]["passed"]))
    rec["check"] = chk
    del logits, lg

    advance = _advancer(step, inputs)
    state = _back_to_back(advance, state, 1, 1 + warmup)[1]
    host_period = []
    pipelined, state, got = _back_to_back(advance, state, 1 + warmup, 1 + warmup + steps, host_period)
    ts, host = [], []
    unaliased_copies(copy_impl, reset=True)  # whole-buffer copies XLA's buffer choices cost the copy calls
    for i in range(1 + warmup + steps, 1 + warmup + 2 * steps):
        t0 = time.perf_counter()
        out = step(*inputs[i], state)
        host.append(time.perf_counter() - t0)  # the call returns once every launch is enqueued
        jax.block_until_ready(out[:2])
        ts.append(time.perf_counter() - t0)
        _, state, st = out
        got.append(st)
    unaliased = unaliased_copies(copy_impl, reset=True)
    if profile_steps and profile_dir is not None:
        from sparda_jax.bench.profile import profile_calls

        it = iter(inputs[1 + warmup + 2 * steps:])
        holder = [state]

        def call():
            out = step(*next(it), holder[0])
            holder[0] = out[1]
            return out[:2]

        rec["profile"] = profile_calls(call, profile_steps, profile_dir)
        if per_call > 1:  # the profile's "steps" are the calls it traced
            rec["profile"]["steps_per_call"] = per_call
        state = holder[0]
    del state
    copied, selected = _per_step(ctx, got, "copied_blocks"), _per_step(ctx, got, "selected_blocks")
    # per step from here on: a call ran k steps
    pipelined, host_period = pipelined / per_call, [host_period[0] / per_call]
    ts, host = [t / per_call for t in ts], [t / per_call for t in host]
    med = float(np.median(ts))
    scale = full.num_layers / cfg.num_layers
    per_layer_copy_scale = (full.num_layers - 1) / (cfg.num_layers - 1)
    bb = block_bytes(cfg)
    rec.update(
        status="ok" if chk["passed"] else "check_failed",
        steps_timed=steps * per_call, warmup_steps=warmup * per_call, step_seconds=pipelined, tokens_per_s_timed_layers=batch / pipelined,
        step_seconds_scaled=pipelined * scale, tokens_per_s=batch / (pipelined * scale),
        sync_step_seconds=med, sync_step_seconds_min=float(min(ts)), sync_step_seconds_max=float(max(ts)),
        sync_tokens_per_s=batch / (med * scale),
        # host time to dispatch one step (median): a step dispatched back to back takes at least this
        host_dispatch_seconds=float(np.median(host)),
        # the host's time in the timed back-to-back steps (`_back_to_back`): near step_seconds when host-bound
        host_period_seconds=host_period[0],
        copied_blocks_per_step=copied, selected_blocks_per_step=selected,
        # the copy engine's calls whose output XLA placed apart from its input (each first copied
        # the whole cache on XLA's stream): expected 0
        unaliased_calls_per_step=unaliased[0] / steps, unaliased_bytes_per_step=unaliased[1] / steps,
        miss_rate=copied / selected if selected else None,
        bytes_copied_per_step=copied * bb, bytes_copied_per_step_scaled=copied * bb * per_layer_copy_scale)
    return rec


def _advancer(step, inputs):
    def advance(i, st):
        _, st, stats = step(*inputs[i], st)
        return st, stats
    return advance


def marginal(hi: dict, lo: dict, *, full_layers: int) -> dict:
    """A full-model step from two layer counts (rows `hi` and `lo` of one configuration, timed
    with L_hi > L_lo layers): every layer after the first few costs the same, so
        per_layer = (step(L_hi) - step(L_lo)) / (L_hi - L_lo)
        step(full) ~ step(L_hi) + (full - L_hi) * per_layer.
    Scaling step(L_hi) by full / L_hi instead counts the step's fixed costs (embedding, LM head,
    the resident layer 0, the host's dispatch) and, with prefetch, the pipeline's fill and drain
    (the first copy has only layer 0 to hide behind, the last layer's compute nothing) full / L_hi
    times."""
    lh, ll = hi["layers_timed"], lo["layers_timed"]
    if not lh > ll >= 1:
        raise ValueError(f"marginal: need layers_timed hi > lo >= 1, got {lh} and {ll}")
    per = (hi["step_seconds"] - lo["step_seconds"]) / (lh - ll)
    step = hi["step_seconds"] + (full_layers - lh) * per
    out = {"layers": [ll, lh], "scaled_to": full_layers, "step_seconds_lo": lo["step_seconds"],
           "per_layer_seconds": per, "step_seconds_extrapolated": step,
           "tokens_per_s_extrapolated": hi["batch"] / step if step > 0 else None,
           "miss_rate_lo": lo.get("miss_rate")}
    return out


def _order(modes, batches):
    """Run the claims' configurations first: a budget cut then loses the context rows."""
    def rank(mb):
        m, b = mb
        if b == 8 and m in ("sparse", "sparda"):
            return 0
        if b >= PREFETCH_MIN_BATCH and m in ("sparda", "sparda_sync", "sparse"):
            return 1
        if m in OFFLOAD_SYSTEMS and m != "infinigen":
            return 2
        return 3 if m in RESIDENT_SYSTEMS else 4
    pairs = [(m, b) for b in batches for m in modes]
    return sorted(pairs, key=lambda mb: (rank(mb), mb[1], modes.index(mb[0])))


def _floors(rec, ctx, ceil, h2d):
    """Full-model floor of one step: weights and attended K/V read from HBM, copies over PCIe."""
    if rec.get("status") != "ok" or not ceil:
        return
    full, b, t = ctx.full, rec["batch"], rec["T"]
    sp = full.sparse
    kv_tok = 2 * full.num_kv_heads * full.head_dim * 2  # K and V per token, bf16
    keys = t if selector_of(rec["mode"]) == "dense" else sp.topk * sp.block_size
    hbm = ctx.weights_full + full.num_layers * b * keys * kv_tok
    t_hbm = hbm / (ceil["hbm_gb_per_s"] * 1e9)
    t_pcie = rec["bytes_copied_per_step_scaled"] / (h2d * 1e9) if h2d else 0.0
    rec.update(floor_hbm_bytes=hbm, floor_seconds=max(t_hbm, t_pcie),
               floor_bound="pcie" if t_pcie > t_hbm else "hbm",
               achieved_over_floor=max(t_hbm, t_pcie) / rec["step_seconds_scaled"])


def _ok(rows, **kw):
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in kw.items())]


def real_fractions(real: float, random: float, batch: int) -> list[float]:
    """Repeating-row fractions that emulate a miss rate `real` at `batch` rows whose random
    traffic misses `random`: whole rows repeat, so the miss rate moves in steps of random /
    batch (0.078 at batch 8) and one fraction rarely hits `real`. The two row counts around it,
    so that a row's step time can be interpolated to `real` (`at_miss_rate`); 0 rows is the
    random row itself and is not returned."""
    n = float(np.clip(1 - real / random, 0, 1)) * batch
    counts = {int(np.floor(n + 1e-9)), int(np.ceil(n - 1e-9))}
    return [c / batch for c in sorted(counts) if c > 0]


def at_miss_rate(rows: list[dict], target: float, estimate: str) -> dict | None:
    """A mode's step time at miss rate `target`, linear between the two rows (one configuration,
    several repeating-row counts) whose measured miss rates bracket it; a row at the target is
    taken as it is. Step time is compute + copy without prefetch (linear in the bytes) and
    max(compute, copy) with it (convex: the chord lies above, so SparDA's is overstated). None
    when no two rows bracket the target."""
    pts = sorted((x["miss_rate"], _step_seconds(x, estimate)) for x in rows
                 if x.get("miss_rate") is not None and _step_seconds(x, estimate))
    for (m0, s0), (m1, s1) in zip(pts, pts[1:] or pts):  # one row: paired with itself
        if m0 <= target <= m1:
            s = s0 if m1 == m0 else s0 + (s1 - s0) * (target - m0) / (m1 - m0)
            return {"miss_rate": target, "step_seconds": s, "tokens_per_s": rows[0]["batch"] / s,
                    "between": [m0, m1]}
    return None


def _step_seconds(x, estimate):
    """A row's full-model step seconds by an estimate (see `_tokens_per_s`)."""
    if estimate == "scaled":
        return x["step_seconds_scaled"]
    return x.get("marginal", {}).get("step_seconds_extrapolated")


def _tokens_per_s(x, estimate):
    """A row's full-model tokens/s by an estimate: "scaled" (step x full / timed layers) or
    "marginal" (`marginal`); None where the row has no such estimate."""
    s = _step_seconds(x, estimate)
    return x["batch"] / s if s and s > 0 else None


ESTIMATES = {"scaled": "", "marginal": " (marginal-layer estimate)"}


def _claims(r):
    rows = r["rows"]
    out = []
    for est, suffix in ESTIMATES.items():
        for t in sorted({x["T"] for x in rows}, reverse=True)[:1]:  # the longest context
            a = {x["mode"]: x for x in _ok(rows, T=t, batch=8, variant="random")}
            if "sparda" in a and "sparse" in a and _tokens_per_s(a["sparse"], est) and _tokens_per_s(a["sparda"], est):
                v = _tokens_per_s(a["sparda"], est) / _tokens_per_s(a["sparse"], est)
                out.append({"claim": f"decode T={t} B=8: SparDA / Sparse tokens/s{suffix}", "value": v,
                            "target": SPEEDUP_TARGET, "met": bool(v >= SPEEDUP_TARGET), "estimate": est,
                            "sparda_miss_rate": a["sparda"]["miss_rate"], "sparse_miss_rate": a["sparse"]["miss_rate"]})
            # at the miss rates measured on the real model (emulated by repeating rows, interpolated)
            at = {}
            for m in ("sparse", "sparda"):
                mine = [x for x in _ok(rows, T=t, batch=8, mode=m)
                        if x["variant"] == "random" or "target_miss_rate" in x]
                targets = {x["target_miss_rate"] for x in mine if "target_miss_rate" in x}
                if len(targets) == 1:
                    at[m] = at_miss_rate(mine, targets.pop(), est)
            if at.get("sparse") and at.get("sparda"):
                v = at["sparda"]["tokens_per_s"] / at["sparse"]["tokens_per_s"]
                out.append({"claim": f"decode T={t} B=8: SparDA / Sparse tokens/s at the real-model miss rates "
                                     f"(interpolated){suffix}", "value": v, "target": SPEEDUP_TARGET,
                            "met": bool(v >= SPEEDUP_TARGET), "estimate": est, "sparda": at["sparda"],
                            "sparse": at["sparse"]})
            for b in sorted({x["batch"] for x in rows if x["batch"] >= PREFETCH_MIN_BATCH}):
                a = {x["mode"]: x for x in _ok(rows, T=t, batch=b, variant="random")}
                if ("sparda" in a and "sparda_sync" in a and _tokens_per_s(a["sparda"], est)
                        and _tokens_per_s(a["sparda_sync"], est)):
                    v = _tokens_per_s(a["sparda"], est) / _tokens_per_s(a["sparda_sync"], est)
                    out.append({"claim": f"decode T={t} B={b}: SparDA / SparDA-no-prefetch tokens/s{suffix}",
                                "value": v, "target": 1.0, "met": bool(v > 1.0), "estimate": est})
    best = {}
    for t in sorted({x["T"] for x in rows}):
        for m in r["config"]["modes"]:
            ok = _ok(rows, T=t, mode=m, variant="random")
            fits = [x["batch"] for x in rows if x["T"] == t and x["mode"] == m and x.get("feasibility", {}).get("fits")]
            if ok:
                x = max(ok, key=lambda x: x["tokens_per_s"])
                best.setdefault(str(t), {})[m] = {"batch": x["batch"], "tokens_per_s": x["tokens_per_s"],
                                                  "tokens_per_s_marginal": _tokens_per_s(x, "marginal"),
                                                  "largest_feasible_batch_tried": max(fits) if fits else None}
    return out, best


def _traffic(x) -> str:
    """A row's traffic without its note: "random", "reuse=0.62", ... (the real-model rows' variants
    name their mode's target, so Sparse's and SparDA's pair by this)."""
    return x["variant"].split(" ")[0]


def _factors(tps: dict) -> dict:
    return {name: tps[hi] / tps[lo] for name, lo, hi in FACTORS if tps.get(lo) and tps.get(hi)}


def decomposition(r: dict) -> list[dict]:
    """SparDA / Sparse on random traffic split into factors (`FACTORS`), per context and batch
    where a factor beyond the total can be formed, beside the paper's at its two nearest batches
    (`PAPER_DECODE_128K`, H100, 128K, its real traffic): which part of the speedup comes from the
    cheaper selector and which from hiding the copy. `by_traffic`: the factors that the emulated
    reuse rows give (Sparse+ copies nothing, so its one row pairs with every traffic). Only rows of
    one run are divided."""
    out = []
    rows = r["rows"]
    for t in sorted({x["T"] for x in rows}):
        for b in sorted({x["batch"] for x in rows if x["T"] == t}):
            ok = _ok(rows, T=t, batch=b)
            resident = {x["mode"]: x["tokens_per_s"] for x in ok if x["mode"] == "sparse_resident"}
            at = lambda v: {**resident, **{x["mode"]: x["tokens_per_s"] for x in ok if _traffic(x) == v}}
            f = _factors(at("random"))
            if not set(f) - {"total"}:
                continue
            by_traffic = []
            for v in sorted({_traffic(x) for x in ok if _traffic(x) != "random" and x.get("miss_rate") is not None}):
                g = _factors(at(v))
                if g:
                    by_traffic.append({"variant": v, "miss_rate": {x["mode"]: x["miss_rate"] for x in ok
                                                                   if _traffic(x) == v}, "factors": g})
            near = sorted(PAPER_DECODE_128K, key=lambda pb: (abs(pb - b), pb))[:2]
            out.append({"T": t, "batch": b, "factors": f, "by_traffic": by_traffic,
                        "paper_h100_128k": {str(pb): _factors(PAPER_DECODE_128K[pb]) for pb in sorted(near)}})
    return out


def decomposition_lines(r: dict) -> list[str]:
    fmt = lambda f: ", ".join(f"{k} {v:.2f}" for k, v in f.items())
    lines = []
    for d in r.get("decomposition") or decomposition(r):
        lines.append(f"split T={d['T']} B={d['batch']} (tokens/s ratios), random traffic: {fmt(d['factors'])}"
                     + "".join(f"; {x['variant']} (miss {max(x['miss_rate'].values()):.3f}): {fmt(x['factors'])}"
                               for x in d["by_traffic"])
                     + " | paper (H100, its traffic) " + "; ".join(f"B={pb}: {fmt(f)}"
                                                                   for pb, f in d["paper_h100_128k"].items()))
    return lines


def bench_decode(preset: str = "minicpm4.1-8b", *, lengths=(131072,), batches=(4, 8, 16, 32), modes=MODES,
                 layers: int | None = 4, steps: int = 6, warmup: int = 2, reuse_fractions=(0.5,),
                 real_miss_rates: dict | None = None, real_model: str | None = None, num_ctas: int | None = None,
                 copy_impl: str | None = None, budget_s: float | None = 200.0, check: bool = True,
                 with_ceilings: bool = True, profile_steps: int = 0, profile_reuse: bool = False,
                 weights: str = "layered", marginal_layers: int | None = None,
                 validate_layers: int | None = None, steps_per_call: int = 1, seed: int = 0,
                 out=None, log=None) -> dict:
    """With `out`, the JSON is rewritten after every configuration ("complete": false until the end).
    profile_steps: trace that many extra steps of every random-traffic row of the claims' pairs
    (with profile_reuse, of their reuse rows too)
    (`bench.profile`), their traces under <out's folder>/profiles/.
    marginal_layers: also time every claims' row with that many layers (fewer than `layers`) and
    estimate the full model's step from the two (`marginal`, rec["marginal"]); the claims are then
    also made on that estimate. validate_layers: time the batch-8 claim's rows (every traffic)
    with that many layers (more than `layers`) too and compare with the estimate's prediction.
    steps_per_call: run that many decode steps in each call, in one device program
    (`engine_decode_steps`), instead of one step a call; times and counts stay per step."""
    log = log or _log_default
    modes = tuple(modes)
    budget = Budget(budget_s)
    r = {"name": "decode", "complete": False, "environment": environment(), "rows": [], "claims": []}

    def snapshot():
        r["elapsed_s"] = budget.elapsed()
        if out:
            write_json(r, out)

    ceil, h2d = None, None
    if with_ceilings:
        try:
            ceil = ceilings(matmul_n=4096, copy_mib=1024, repeats=5)
        except Exception as e:  # noqa: BLE001
            r["ceilings_error"] = unavailable(e)
        h2d = _h2d_gb_per_s()
    r["ceilings"] = {**(ceil or {}), "h2d_gb_per_s": h2d}
    ctx_kw = dict(steps_per_call=steps_per_call)
    ctx = _Ctx(preset, layers, modes, seed, log, weights, **ctx_kw)
    for name, n in (("marginal_layers", marginal_layers), ("validate_layers", validate_layers)):
        if n is not None and not 2 <= n <= ctx.full.num_layers:  # the engine keeps layer 0 on the device
            raise ValueError(f"{name}={n}: need 2 to {ctx.full.num_layers} (the preset's layers)")
    if marginal_layers is not None and marginal_layers >= ctx.cfg.num_layers:
        raise ValueError(f"marginal_layers={marginal_layers} must be fewer than the layers timed ({ctx.cfg.num_layers})")
    if validate_layers is not None and (marginal_layers is None or validate_layers <= ctx.cfg.num_layers):
        raise ValueError("validate_layers needs marginal_layers and more layers than the layers timed")
    ctx_lo = (_Ctx(preset, marginal_layers, modes, seed, log, weights, **ctx_kw)
              if marginal_layers else None)
    r["config"] = _run_config(ctx, preset, modes=list(modes), lengths=list(lengths), batches=list(batches), steps=steps,
                              warmup=warmup, reuse_fractions=list(reuse_fractions), num_ctas=num_ctas,
                              copy_impl=copy_impl, budget_s=budget_s, weights=weights,
                              marginal_layers=marginal_layers, validate_layers=validate_layers,
                              steps_per_call=steps_per_call)
    if real_model:
        try:
            r["real_model"] = real_miss_rate(real_model, log=log)
            real_miss_rates = {**{m: v["miss_rate"] for m, v in r["real_model"]["modes"].items()},
                               **(real_miss_rates or {})}
        except Exception as e:  # noqa: BLE001 - the model may not be installed there
            r["real_model"] = {"status": unavailable(e)}
    r["config"]["real_miss_rates"] = real_miss_rates
    snapshot()

    def run(mode, t, b, **kw):
        if budget.exceeded():
            r["rows"].append({"mode": mode, "T": t, "batch": b, "status": budget.reason(),
                              "variant": "random" if not kw.get("reuse_fraction") else "reuse"})
            return None
        try:
            prof = {}
            if profile_steps and claim_pair(mode, b) and (profile_reuse or not kw.get("reuse_fraction")):
                tag = f"_reuse{kw['reuse_fraction']:.2f}" if kw.get("reuse_fraction") else ""
                prof = dict(profile_steps=profile_steps, profile_dir=pathlib.Path(out or ".").parent / "profiles"
                            / f"decode_{mode}_T{t}_B{b}{tag}")
            rec = decode_config(ctx, mode, t, b, steps=steps, warmup=warmup, num_ctas=num_ctas, copy_impl=copy_impl,
                                check=check, **prof, **kw)
            _floors(rec, ctx, ceil, h2d)
            again = dict(steps=steps, warmup=warmup, num_ctas=num_ctas, copy_impl=copy_impl, check=False, **kw)
            if ctx_lo is not None and rec.get("status") == "ok" and claim_pair(mode, b):
                lo = decode_config(ctx_lo, mode, t, b, **again)
                if lo.get("status") == "ok":
                    rec["marginal"] = marginal(rec, lo, full_layers=ctx.full.num_layers)
                else:
                    rec["marginal"] = {"status": lo.get("status")}
            if (validate_layers and "per_layer_seconds" in rec.get("marginal", {}) and b == 8
                    and mode in ("sparse", "sparda")):
                rec["marginal"]["validation"] = validate(rec, mode, t, b, again)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, go on
            rec = {"mode": mode, "T": t, "batch": b, "status": unavailable(e),
                   "variant": "random" if not kw.get("reuse_fraction") else "reuse"}
        r["rows"].append(rec)
        snapshot()
        log(f"[decode] {mode} T={t} B={b} {rec.get('variant')}: {rec.get('status')[:80]} "
            f"{rec.get('tokens_per_s', 0):.1f} tok/s (scaled), miss {rec.get('miss_rate')} at {budget.elapsed():.0f} s")
        return rec

    ctx_v = []

    def validate(rec, mode, t, b, again):
        """The estimate's prediction for validate_layers layers against a row timed with them."""
        if not ctx_v:
            ctx_v.append(_Ctx(preset, validate_layers, modes, seed, log, weights, **ctx_kw))
        x = decode_config(ctx_v[0], mode, t, b, **again)
        if x.get("status") != "ok":
            return {"layers": validate_layers, "status": x.get("status")}
        m = rec["marginal"]
        pred = rec["step_seconds"] + (validate_layers - rec["layers_timed"]) * m["per_layer_seconds"]
        scaled = rec["step_seconds"] * validate_layers / rec["layers_timed"]
        return {"layers": validate_layers, "step_seconds_measured": x["step_seconds"],
                "step_seconds_predicted": pred, "relative_error": pred / x["step_seconds"] - 1,
                "step_seconds_by_scaling": scaled, "relative_error_by_scaling": scaled / x["step_seconds"] - 1}

    def claim_pair(m, b):
        return (b == 8 and m in ("sparse", "sparda")) or (b >= PREFETCH_MIN_BATCH and m in ("sparda", "sparda_sync"))

    for t in lengths:
        for m, b in _order(modes, batches):
            base = run(m, t, b)
            # emulated reuse for the claims' pairs, right after their random-traffic row: the step is
            # compiled already (same plan and shapes), so a variant costs a state and a few steps
            if base is None or base.get("status") != "ok" or not claim_pair(m, b) or not base.get("miss_rate"):
                continue
            fracs = [(f, None) for f in reuse_fractions]
            if real_miss_rates and real_miss_rates.get(m) is not None:
                fracs += [(f, real_miss_rates[m]) for f in real_fractions(real_miss_rates[m], base["miss_rate"], b)]
            for f, target in fracs:
                if round(f * b) > 0:
                    rec = run(m, t, b, reuse_fraction=f)
                    if rec is not None and target is not None:
                        rec["target_miss_rate"] = target
                        rec["variant"] += f" (real-model target {target:.3f})"
    r["claims"], r["best_feasible"] = _claims(r)
    r["decomposition"] = decomposition(r)
    r["complete"] = True
    snapshot()
    return r


def _run_config(ctx, preset, **kw):
    return {"preset": preset, "layers_timed": ctx.cfg.num_layers, "scaled_to": ctx.full.num_layers,
            "scaling": "step seconds x scaled_to / layers_timed; bytes copied x (scaled_to - 1) / (layers_timed - 1)",
            "heads": ctx.cfg.num_heads, "kv_heads": ctx.cfg.num_kv_heads, "head_dim": ctx.cfg.head_dim,
            "block_size": ctx.cfg.sparse.block_size, "topk": ctx.cfg.sparse.topk,
            "local_blocks": ctx.cfg.sparse.local_blocks, "init_blocks": ctx.cfg.sparse.init_blocks,
            "dtype": "bfloat16", "weights": "random (init_params, std 0.02), bf16",
            "weights_bytes_full": ctx.weights_full,
            "state": "built directly: random normal bf16 K/V of T tokens per row (layers >= 1 in pinned host pools), "
                     "compressed keys from those keys, empty block cache (engine_state.build_state); no prefill",
            "check": f"step 0 row 0 logits vs modes.decode_step (resident, batch 1, same K/V and token): rel err <= "
                     f"{LOGIT_BOUND}; offload step-0 copied == selected == (L-1) B K topk",
            "attention": "the defaults: offload systems paged_sparse_attention (the paged Mosaic decode kernel on "
                         "Hopper in bf16, else the jnp reference); sparse_resident sparse_attention (Mosaic decode "
                         "kernel on Hopper); dense_resident cuDNN where it applies",
            "selection": "sparda_jax.select defaults: XLA in decode (faster than the kernels there, select.json)",
            "num_ctas_default": "paper heuristic (16 below batch 32, else 32) when num_ctas is None",
            "reuse_variant": "rows < round(f B) repeat step 0's token and position, so their selections repeat; "
                             "an emulation of block reuse, not real traffic",
            "real_model_variant": "f = 1 - real_miss_rate / measured random miss rate (same mode and batch)",
            "feasibility": "memory_report of the full model + weights vs 0.85 x host RAM and 0.9 x device allocator "
                           "limit; infeasible configurations are not run",
            **kw}


def real_miss_rate(model: str = "smollm2-135m", *, context: int = 4096, steps: int = 24, modes=("sparse", "sparda"),
                   seed: int = 0, log=None) -> dict:
    """Block miss rate of the engine on a real model and real text (the Python docs shipped with
    CPython), steps 2.. of greedy decoding (step 1 starts from an empty block cache)."""
    from sparda_jax.api import load_pretrained, mode_kwargs, prepare_modes
    from sparda_jax.infer.engine import engine_prefill
    from sparda_jax.text import haystack_tokens

    log = log or _log_default
    m = load_pretrained(model, dtype=jnp.float32)
    ids = haystack_tokens(m.tokenizer.encode, context, seed=seed)
    extra = prepare_modes(m, [selector_of(x) for x in modes], seed=seed)
    res = {"model": model, "context": context, "steps": steps, "text": "haystack_tokens of the Python docs",
           "forecast_trained": extra.get("forecast_trained"), "topk": m.config.sparse.topk, "modes": {}}
    for mode in modes:
        kw = mode_kwargs(extra, selector_of(mode))
        kw.pop("mode")
        engine = EngineConfig(mode)
        last, st = engine_prefill(m.params, jnp.asarray([ids]), jnp.asarray([context]), m.config, engine,
                                  cache_size=context + steps + 1, dtype=m.dtype, **kw)
        tok = jnp.argmax(last, axis=-1).astype(jnp.int32)
        cop = sel = 0
        for i in range(steps):
            logits, st, s = engine_decode_step(m.params, tok, jnp.asarray([context + i], jnp.int32), st, m.config,
                                               engine, dtype=m.dtype, **kw)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if i > 0:
                cop += int(s["copied_blocks"])
                sel += int(s["selected_blocks"])
        res["modes"][mode] = {"miss_rate": cop / sel if sel else None, "copied_blocks": cop, "selected_blocks": sel}
        log(f"[decode] real model {model} {mode}: miss rate {res['modes'][mode]['miss_rate']}")
    return res


# --------------------------------------------------------------------------------------- cta

def bench_cta(preset: str = "minicpm4.1-8b", *, context: int = 32768, batches=(16, 64), ctas=(8, 16, 32, 64),
              mode: str = "sparda", layers: int | None = 4, steps: int = 6, warmup: int = 2,
              budget_s: float | None = 90.0, check: bool = True, seed: int = 0, out=None, log=None) -> dict:
    """Decode tokens/s vs the copy kernel's CTA quota (paper Table 7); heuristic vs best."""
    from sparda_jax.kernels.kv_copy import paper_num_ctas

    log = log or _log_default
    budget = Budget(budget_s)
    r = {"name": "cta", "complete": False, "environment": environment(), "rows": [], "claims": []}
    ctx = _Ctx(preset, layers, (mode,), seed, log)
    copy_impl = "cuda" if jax.default_backend() == "gpu" else "xla"
    r["config"] = _run_config(ctx, preset, mode=mode, T=context, batches=list(batches), ctas=list(ctas), steps=steps,
                              warmup=warmup, budget_s=budget_s, copy_impl=copy_impl,
                              heuristic="paper_num_ctas: 16 below batch 32, else 32")
    if copy_impl != "cuda":
        r["config"]["note"] = "no GPU: the XLA reference copy ignores num_ctas; the rows only test the harness"

    def snapshot():
        r["elapsed_s"] = budget.elapsed()
        if out:
            write_json(r, out)

    snapshot()
    # per batch: the heuristic's count first, then the paper's alternative (Table 7 compares 16 and
    # 64), then the rest; batches interleaved so that a budget cut leaves both with a comparison
    per_b = {}
    for b in batches:
        h = paper_num_ctas(b)
        alt = 64 if h == 16 else 16
        rest = sorted(set(ctas) - {h, alt})
        per_b[b] = [h] + ([alt] if alt in ctas else []) + rest
    order = [(b, per_b[b][i]) for i in range(max(map(len, per_b.values()))) for b in batches if i < len(per_b[b])]
    for b, c in order:
        h = paper_num_ctas(b)
        if budget.exceeded():
            r["rows"].append({"mode": mode, "T": context, "batch": b, "num_ctas": c, "status": budget.reason()})
            continue
        try:
            rec = decode_config(ctx, mode, context, b, steps=steps, warmup=warmup, num_ctas=c, copy_impl=copy_impl,
                                check=check)
        except Exception as e:  # noqa: BLE001
            rec = {"mode": mode, "T": context, "batch": b, "num_ctas": c, "status": unavailable(e)}
        rec["heuristic"] = c == h
        r["rows"].append(rec)
        snapshot()
        log(f"[cta] B={b} CTAs={c}: {rec.get('status', '')[:60]} {rec.get('tokens_per_s', 0):.1f} tok/s "
            f"at {budget.elapsed():.0f} s")
    if copy_impl == "cuda":  # the autotuned quota (one timing sweep per copy size), beside the fixed ones
        from sparda_jax.kernels.kv_copy import autotune_num_ctas

        sp, c_ = ctx.cfg.sparse, ctx.cfg
        for b in batches:
            if budget.exceeded():
                break
            try:
                c = autotune_num_ctas(b * c_.num_kv_heads * sp.topk, (sp.block_size, c_.head_dim), "bfloat16")
                rec = decode_config(ctx, mode, context, b, steps=steps, warmup=warmup, num_ctas=c, copy_impl=copy_impl,
                                    check=check)
            except Exception as e:  # noqa: BLE001
                rec = {"mode": mode, "T": context, "batch": b, "num_ctas": None, "status": unavailable(e)}
            rec["heuristic"], rec["autotuned"] = False, True
            r["rows"].append(rec)
            snapshot()
    for b in batches:
        h = paper_num_ctas(b)
        ok = _ok(r["rows"], batch=b)
        hr = [x for x in ok if x["heuristic"]]
        if ok and hr:
            best = max(ok, key=lambda x: x["tokens_per_s"])
            v = hr[0]["tokens_per_s"] / best["tokens_per_s"]
            r["claims"].append({"claim": f"cta T={context} B={b}: heuristic ({h} CTAs) / best ({best['num_ctas']} CTAs) "
                                         "tokens/s", "value": v, "target": 0.95, "met": bool(v >= 0.95),
                                "target_note": "ours: the heuristic within 5% of the best count measured",
                                "heuristic_ctas": h, "best_ctas": best["num_ctas"]})
    r["complete"] = True
    snapshot()
    return r


# ------------------------------------------------------------------------------------ output

def _fmt_row(x, cols):
    if x.get("status") != "ok" and "tokens_per_s" not in x:
        return f"| {' | '.join(str(x.get(c, '')) for c in cols[:4])} | {x.get('status', '')[:70]} |"
    mr = "-" if x.get("miss_rate") is None else f"{x['miss_rate']:.3f}"
    mb = x.get("bytes_copied_per_step_scaled", 0) / 1e6
    chk = "ok" if x["check"]["passed"] else "FAIL"
    sync = (f"{x['sync_tokens_per_s']:.1f}" if "sync_tokens_per_s" in x else "-")  # older JSONs: per-step sync only
    host = (f"{x['step_seconds'] * 1e3:.2f} / {x['host_dispatch_seconds'] * 1e3:.2f}"
            if "host_dispatch_seconds" in x else "-")
    return (f"| {x.get('system', x['mode'])} | {x['T']} | {x['batch']} | {x.get('variant', '')} | "
            f"{x['tokens_per_s']:.1f} | {x['step_seconds_scaled'] * 1e3:.1f} | {host} | {sync} | {mr} | {mb:.1f} | {chk} |")


def _marginal_line(x) -> str:
    m = x["marginal"]
    s = (f"marginal {LABELS.get(x['mode'], x['mode'])} T={x['T']} B={x['batch']} {x['variant']}: layers {m['layers'][0]} "
         f"and {m['layers'][1]}: {m['per_layer_seconds'] * 1e3:.3f} ms/layer, {m['scaled_to']} layers "
         f"{m['step_seconds_extrapolated'] * 1e3:.1f} ms, "
         # None where the timings' noise made the estimate <= 0 (CPUs)
         + ("-" if m["tokens_per_s_extrapolated"] is None else f"{m['tokens_per_s_extrapolated']:.1f}") + " tok/s")
    if "step_seconds_predicted" in m.get("validation", {}):
        v = m["validation"]
        s += (f"; at {v['layers']} layers measured {v['step_seconds_measured'] * 1e3:.2f} ms, predicted "
              f"{v['step_seconds_predicted'] * 1e3:.2f} ({v['relative_error']:+.1%}), by scaling "
              f"{v['step_seconds_by_scaling'] * 1e3:.2f} ({v['relative_error_by_scaling']:+.1%})")
    return s


def table(r: dict) -> str:
    c = r["config"]
    cols = ["system", "T", "batch", "variant"]
    lines = ["| system | T | B | traffic | tok/s | ms/step | timed layers: ms/step / host ms | tok/s, each step waited "
             "for | miss rate | MB copied/step | check |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = sorted(r["rows"], key=lambda x: (x["T"], MODES.index(x["mode"]) if x["mode"] in MODES else 9,
                                            x["batch"], str(x.get("variant"))))
    for x in rows:
        lines.append(_fmt_row({**x, "system": LABELS.get(x["mode"], x["mode"])}, cols))
    lines += claim_lines(r)
    lines += decomposition_lines(r)
    lines += [_marginal_line(x) for x in rows if "per_layer_seconds" in x.get("marginal", {})]
    for t, bm in r.get("best_feasible", {}).items():
        lines.append(f"best feasible T={t}: " + ", ".join(f"{LABELS.get(m, m)} B={v['batch']} {v['tokens_per_s']:.1f} tok/s"
                                                          for m, v in bm.items()))
    lines.append(f"{c['layers_timed']} of {c['scaled_to']} layers timed, times and bytes scaled to {c['scaled_to']}; "
                 "feasibility from memory_report of the full model")
    from sparda_jax.bench.profile import profile_lines

    lines += profile_lines(rows, label=lambda x: f"{LABELS.get(x['mode'], x['mode'])} T={x['T']} B={x['batch']} "
                                                 f"{x.get('variant', '')}")
    return "\n".join(lines)


def cta_table(r: dict) -> str:
    lines = ["| B | CTAs | heuristic | tok/s | ms/step | miss rate | check |", "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        if "tokens_per_s" not in x:
            lines.append(f"| {x['batch']} | {x.get('num_ctas')} | | {x.get('status', '')[:70]} | | | |")
            continue
        how = "yes" if x["heuristic"] else ("auto" if x.get("autotuned") else "")
        lines.append(f"| {x['batch']} | {x['num_ctas']} | {how} | {x['tokens_per_s']:.1f} | "
                     f"{x['step_seconds_scaled'] * 1e3:.1f} | {x['miss_rate']:.3f} | "
                     f"{'ok' if x['check']['passed'] else 'FAIL'} |")
    lines += claim_lines(r)
    c = r["config"]
    lines.append(f"{c['mode']}, T={c['T']}; {c['layers_timed']} of {c['scaled_to']} layers timed and scaled")
    return "\n".join(lines)


def traffic_groups(rows) -> dict:
    """{(T, batch): rows} of the completed rows whose context and batch some mode ran at more than
    one block miss rate (random traffic and emulated-reuse rows): those get a plot by traffic."""
    groups = {}
    for x in rows:
        if x.get("status") == "ok" and x.get("miss_rate") is not None:
            groups.setdefault((x["T"], x["batch"]), []).append(x)
    return {k: v for k, v in sorted(groups.items())
            if any(len({round(x["miss_rate"], 3) for x in v if x["mode"] == m}) > 1 for m in MODES)}


COLORS = {m: f"C{i}" for i, m in enumerate(MODES)}  # one color per system in every panel


def _plot_traffic(ax, rows, target):
    """Step ms vs block miss rate per system, SparDA's floor (HBM or PCIe) beside; SparDA / Sparse
    (rows paired by variant) on a second axis, with the target where there is one."""
    for m in MODES:
        pts = sorted((x["miss_rate"], x["step_seconds_scaled"] * 1e3) for x in rows if x["mode"] == m)
        if pts:
            ax.plot(*zip(*pts), "o-", color=COLORS[m], label=LABELS[m])
    floor = sorted((x["miss_rate"], x["floor_seconds"] * 1e3) for x in rows if x["mode"] == "sparda"
                   and x.get("floor_seconds"))
    if floor:
        ax.plot(*zip(*floor), "x", color="gray", label="SparDA's floor (HBM or PCIe), its rows")
    ax.set(xlabel="block miss rate", ylabel="ms a step (scaled to full model)")
    sparse = {_traffic(x): x for x in rows if x["mode"] == "sparse"}
    pairs = sorted((x["miss_rate"], sparse[_traffic(x)]["step_seconds_scaled"] / x["step_seconds_scaled"])
                   for x in rows if x["mode"] == "sparda" and _traffic(x) in sparse)
    handles = ax.get_legend_handles_labels()[0]
    if pairs:
        ax2 = ax.twinx()
        ax2.plot(*zip(*pairs), "k--", marker="s", label="SparDA / Sparse")
        if target is not None:
            ax2.axhline(target, color="red", lw=0.8, ls=":", label=f"target {target}")
        ax2.set_ylabel("SparDA / Sparse")
        handles += ax2.get_legend_handles_labels()[0]
    # one legend for both axes, under the plot: inside it would hide the points
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)


def _plot_split(ax, d):
    """Bars of one `decomposition` entry's factors: this run's (random traffic, then each reuse
    row's) beside the paper's."""
    names = [n for n, _, _ in FACTORS]
    series = ([("here, random traffic", d["factors"])]
              + [(f"here, miss {max(x['miss_rate'].values()):.2f}", x["factors"]) for x in d["by_traffic"]]
              + [(f"paper (H100) B={pb}", f) for pb, f in d["paper_h100_128k"].items()])
    w = 0.8 / len(series)
    for i, (label, f) in enumerate(series):
        at = [j for j, n in enumerate(names) if n in f]
        ax.bar([j + (i - (len(series) - 1) / 2) * w for j in at], [f[names[j]] for j in at], width=w, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), ["selector\n(no-prefetch / Sparse)", "prefetch\n(SparDA / no-prefetch)",
                                      "total\n(SparDA / Sparse)", "copy-free\n(SparDA / Sparse+)"], fontsize=7)
    ax.set(ylabel="tokens/s ratio", title=f"SparDA / Sparse, split: T={d['T']} B={d['batch']}")
    ax.legend(fontsize=7)


def plot(json_path) -> str | None:
    """decode.png (tokens/s vs batch per system on random traffic; beside it, for each context and
    batch timed at several miss rates, the step and SparDA / Sparse by miss rate, and for each
    `decomposition` entry its factors beside the paper's) or cta.png
    from the JSON; None without matplotlib."""
    plt, r = pyplot_and_result(json_path)
    if plt is None:
        return None
    ok = [x for x in r["rows"] if x.get("status") == "ok"]
    groups = traffic_groups(ok) if r["name"] != "cta" else {}
    split = decomposition(r) if r["name"] != "cta" else []
    n = 1 + len(groups) + len(split)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.6 if n > 1 else 4), squeeze=False)
    ax = axes[0][0]
    if r["name"] == "cta":
        for b in sorted({x["batch"] for x in ok}):
            pts = sorted((x["num_ctas"], x["tokens_per_s"]) for x in ok if x["batch"] == b and not x.get("autotuned"))
            ax.plot(*zip(*pts), "o-", label=f"B={b}")
        ax.set(xscale="log", xlabel="copy CTAs", ylabel="tokens/s", title="decode vs CTA quota")
    else:
        for t, ls in zip(sorted({x["T"] for x in ok}), ("-", "--", ":", "-.") * 4):
            for m in MODES:
                pts = sorted((x["batch"], x["tokens_per_s"]) for x in ok
                             if x["T"] == t and x["mode"] == m and x.get("variant") == "random")
                if pts:
                    ax.plot(*zip(*pts), "o", ls=ls, color=COLORS[m], label=f"{LABELS[m]} T={t}")
        ax.set(xscale="log", xlabel="batch", ylabel="tokens/s (scaled to full model)", title="decode, random traffic")
    ax.legend(fontsize=7)
    for a, ((t, b), rows) in zip(axes[0][1:], groups.items()):
        _plot_traffic(a, rows, SPEEDUP_TARGET if b == 8 else None)
        a.set_title(f"decode T={t} B={b} by traffic")
    for a, d in zip(axes[0][1 + len(groups):], split):
        _plot_split(a, d)
    return save_png(plt, fig, json_path)


def _parse_real(items) -> dict | None:
    """["0.1"] -> the same rate for every offload system; ["sparse=0.13", "sparda=0.09"] -> per system."""
    if not items:
        return None
    real = {}
    for it in items:
        m, _, v = it.rpartition("=")
        for mode in ([m] if m else ("sparse", "sparda", "sparda_sync", "infinigen")):
            real[mode] = float(v)
    if "sparda" in real and "sparda_sync" not in real:
        real["sparda_sync"] = real["sparda"]  # the same selector: the same blocks
    return real


def main(args) -> int:
    if args.name == "cta":  # the CLI refused "auto" among --ctas
        out = args.out or default_out("cta/cta.json")
        r = bench_cta(args.preset, context=(args.lengths or [32768])[0], batches=tuple(args.batches or (16, 64)),
                      ctas=tuple(args.ctas or (8, 16, 32, 64)), layers=args.layers or 4, steps=args.repeats,
                      budget_s=args.budget_s if args.budget_s is not None else 90.0, out=out)
        printer = cta_table
    else:
        out = args.out or default_out("decode/decode.json")
        real = _parse_real(args.real_miss_rate)
        r = bench_decode(args.preset, lengths=tuple(args.lengths or (131072,)), batches=tuple(args.batches or (4, 8, 16, 32)),
                         modes=tuple(args.systems or MODES), layers=args.layers or 4, steps=args.repeats,
                         reuse_fractions=tuple(args.reuse_fractions if args.reuse_fractions is not None else (0.5,)),
                         real_miss_rates=real, real_model=args.real_model, num_ctas=args.ctas[0] if args.ctas else None,
                         budget_s=args.budget_s if args.budget_s is not None else 200.0,
                         profile_steps=args.profile_steps, profile_reuse=args.profile_reuse, weights=args.weights,
                         marginal_layers=args.marginal_layers, validate_layers=args.validate_layers,
                         steps_per_call=args.steps_per_call, out=out)
        printer = table
    return plot_and_print(r, out, plot, printer)
