"""The backbone in every attention mode, for prefill and for decode with a device KV cache.

Modes (docs/algorithm.md, "Modes"):
  dense      full causal attention
  sparse     InfLLM-V2: each layer selects its blocks from its own queries
  sparda     the Forecast: layer l's blocks come from F_{l-1} (F0_cur at layer 0)
  infinigen  training-free cross-layer speculation: layer l's blocks come from layer l-1's
             normed input times layer l's query weights, skewed and cut to a few columns
             (`sparda_jax.infinigen`), scored against partial keys; layer 0 uses InfLLM-V2
NOSA models (arch "nosa") add the query-agnostic cis stage after the mode's selector, and
cis as an attention bias. Below `sparse.dense_len` keys attention is dense (MiniCPM4); a
batch decides by its longest sequence.

Every layer is `pipeline.layer_step`; prefill hands it the layer's own K/V (`PromptKV`), decode
the layer's `DecodeState`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .compress import CompressedKeys
from .config import Implementations, ModelConfig
from .forecast import selector_kernels
from .model import (DecoderLayer, KVCache, check_layers, check_tokens, commit_to_params_device, embed, layer_params,
                    per_layer, rope_tables, stacked, unembed)
from .pipeline import MODES, Ctx, DecodeState, LayerIn, Plan, PromptKV, layer_step, run_layers
from .programs import stored_jit

__all__ = ["MODES", "Mode", "LayerView", "forward", "prefill", "decode_step", "DecodeState", "layered_state",
           "stacked_state", "forward_cached", "decode_step_plan", "decode_program"]

Mode = Literal["dense", "sparse", "sparda", "infinigen"]


def _validate(config: ModelConfig, mode: str, forecast, infinigen, implementations):
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "sparda" and forecast is None:
        raise ValueError("mode 'sparda' needs forecast params (sparda_jax.forecast.init_forecast "
                         "or a trained Forecast)")
    if mode == "infinigen" and infinigen is None:
        raise ValueError("mode 'infinigen' needs its offline setup (sparda_jax.infinigen.infinigen_setup)")
    if not config.sparse.exact_lse and mode in ("sparse", "infinigen"):
        raise NotImplementedError("the coarse-LSE option is available through select_blocks_infllmv2 "
                                  "(kc_coarse); the model runs exact LSE")
    if not isinstance(implementations, Implementations):
        raise TypeError(f"implementations must be a sparda_jax.Implementations, got {type(implementations).__name__}")


def check_lead_forecast(config: ModelConfig, mode: str, path: str) -> None:
    """NotImplementedError for a sparda run whose Forecast reads another state than the previous
    layer's input (an ablation): `path` selects the next layer's blocks from that input only."""
    if mode == "sparda" and config.forecast.source != "prev_input":
        raise NotImplementedError(f"{path} runs the Forecast on the previous layer's input (forecast.source "
                                  f"'prev_input'); source {config.forecast.source!r} is an accuracy ablation "
                                  f"that only `forward` runs")


def layer_inputs(params, forecast, infinigen, *, unroll: bool = False, dense_layers: tuple[int, ...] = ()):
    """Each layer's `LayerIn`: the backbone's layer params, the selector kernel that picks the
    layer's blocks (sparda), the InfiniGen projection, `first` (layer 0) and `dense` (one of
    `dense_layers`; None for every layer when there are none). Stacked on a leading L axis for
    a scan, or with unroll a tuple with static `first` and `dense`; layered params
    (`model.layered_params`) are then used as they are, so no weight is sliced in the step."""
    sel = selector_kernels(forecast) if forecast is not None else None
    ig = infinigen.proj if infinigen is not None else None
    layers = params["layers"]
    n = len(layers) if isinstance(layers, tuple) else int(jax.tree.leaves(layers)[0].shape[0])
    if not unroll:
        dense = jnp.isin(jnp.arange(n), jnp.asarray(dense_layers, jnp.int32)) if dense_layers else None
        return LayerIn(stacked(layers), sel, ig, jnp.arange(n) == 0, dense)
    at = lambda t, i: None if t is None else jax.tree.map(lambda a: a[i], t)
    return tuple(LayerIn(layer_params(layers, i), at(sel, i), at(ig, i), i == 0,
                         (i in dense_layers) if dense_layers else None) for i in range(n))


# ----------------------------------------------------------------------------------- prefill

class LayerView(NamedTuple):
    """What a `tap` sees of one layer during `forward` (all traced arrays).

    h, h_prev: this and the previous layer's normed input [B, T, D] (h_prev is 0 at layer 0);
    mid_prev: the previous layer's normed state after its attention (0 at layer 0);
    q [B, T, H, Dh], k, v [B, T, K, Dh]: post-RoPE queries and keys, values; positions [B, T];
    cos, sin: RoPE tables; sel: this layer's selector kernel (F0_cur or F_{l-1}) or None;
    first: a traced bool, true at layer 0.
    """

    h: jax.Array
    h_prev: jax.Array
    mid_prev: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    sel: jax.Array | None
    first: jax.Array


@stored_jit(static_argnames=("plan", "return_kv", "return_q", "tap", "return_logits"))
def _forward(params, tokens, forecast, infinigen, *, plan: Plan, return_kv: bool, return_q: bool, tap=None,
             return_logits: bool = True, logits_at=None):
    c = plan.config
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_tables(c, positions)
    ctx = Ctx(DecoderLayer(c, dtype=plan.dtype), cos, sin, positions, -(-t // c.sparse.block_size))

    # the previous layer's state a sparda selection reads (config.forecast.source)
    sel_mid = plan.mode == "sparda" and c.forecast.source == "prev_mid"

    def body(carry, lin):
        x, h_prev, mid_prev = carry
        # Masks built from positions alone are the same in every layer: XLA hoists them out of
        # the layer loop and materializes them for all query chunks at once ([T, T]-sized).
        # Tying positions to this layer's input keeps them inside.
        pos, x = jax.lax.optimization_barrier((positions, x))
        x, _, out = layer_step(plan, ctx._replace(positions=pos), lin, x, mid_prev if sel_mid else h_prev,
                               PromptKV())
        p, aux = out.p, {}
        if return_kv:
            aux["k"], aux["v"] = p.k, p.v
            if p.cis is not None:
                aux["cis"] = p.cis
        if return_q:
            aux["q"] = p.q
        if plan.collect:
            aux["ids"], aux["oracle"] = out.ids, out.oracle
        if tap is not None:
            aux["tap"] = tap(LayerView(p.h, h_prev, mid_prev, p.q, p.k, p.v, pos, cos, sin, lin.sel, lin.first))
        return (x, p.h, out.mid), aux

    x = embed(params, tokens, c, plan.dtype)
    zero = jnp.zeros_like(x)
    lins = layer_inputs(params, forecast, infinigen, dense_layers=c.sparse.dense_layers)
    (x, _, _), aux = run_layers(body, (x, zero, zero), lins, unroll=False)
    if logits_at is not None:  # only these rows reach the LM head ([B, T, vocab] is huge at long T)
        x = jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
    return (unembed(params, x, c) if return_logits else None), aux


def _int32(x):
    """x as int32, on the host when it is there (a device op would be a program of its own)."""
    return x.astype(jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32)


def forward(params, tokens, config: ModelConfig, *, mode: Mode = "dense", forecast=None, infinigen=None,
            dtype=jnp.float32, implementations: Implementations = Implementations(), return_kv: bool = False,
            return_q: bool = False, collect_selection: bool = False, tap=None, return_logits: bool = True,
            logits_at=None):
    """Prefill-style forward over whole sequences from position 0 in any mode.

    tokens int [B, T] -> float32 logits [B, T, vocab], and with return_kv / collect_selection
    a dict of per-layer arrays with a leading L axis: k, v [L, B, T, K, Dh] (and NOSA's cis
    [L, B, T, K]); q [L, B, T, H, Dh] (post-RoPE queries); ids, oracle [L, B, K, T, topk]
    (the mode's selection and the InfLLM-V2 selection from the layer's true queries).
    tap: a hashable function of a `LayerView` whose per-layer outputs come back stacked as
    aux["tap"] (the Forecast's training loss is one); return_logits=False skips the LM head;
    implementations: each op's backend (None fields: the platform's fastest valid one);
    logits_at int [B, n] computes logits only at those positions ([B, n, vocab]).
    Raises ValueError for a token id outside [0, vocab) when the tokens are concrete (not
    under jit). The length is not checked against `max_position_embeddings` here (benchmarks
    time contexts past it); `Pretrained.logits` and the CLI check it.
    """
    _validate(config, mode, forecast, infinigen, implementations)
    check_layers(params, config)
    # host tokens stay host arrays: checked with NumPy and sent with the program's call, not
    # reduced on the device and read back before the prefill can start
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    check_tokens(tokens, None, config.vocab_size)
    dense = mode == "dense" or tokens.shape[1] < config.sparse.dense_len
    plan = Plan(config, mode, dense, jnp.dtype(dtype), implementations, collect_selection and not dense)
    logits, aux = _forward(params, tokens, forecast, infinigen, plan=plan, return_kv=return_kv,
                           return_q=return_q, tap=tap, return_logits=return_logits,
                           logits_at=None if logits_at is None else _int32(logits_at))
    if return_kv or return_q or collect_selection or tap is not None:
        return logits, aux
    return logits


# ------------------------------------------------------------------------------------ decode

def layered_state(state: DecodeState) -> tuple[DecodeState, ...]:
    """The state as one DecodeState per layer (no leading L axis). `decode_step` then runs its
    layers as a Python loop that updates each layer's buffers in place; a stacked state goes
    through a scan that slices each layer out and restacks it (a copy of the state a step)."""
    return per_layer(state)


def stacked_state(layers: tuple[DecodeState, ...]) -> DecodeState:
    """The inverse of `layered_state`."""
    return stacked(layers)


@stored_jit(static_argnames=("config", "cache_size", "sparse_state"))
def _build_state(config: ModelConfig, aux, lengths, cache_size: int, infinigen, sparse_state: bool) -> DecodeState:
    """The decode state from the prefill's K/V (one program: op by op, each pad and compression
    step would be traced and looked up in the compilation cache in every process)."""
    sp = config.sparse
    t = aux["k"].shape[2]
    pad = ((0, 0), (0, 0), (0, cache_size - t), (0, 0), (0, 0))
    kv = KVCache(jnp.pad(aux["k"], pad), jnp.pad(aux["v"], pad))
    ckeys = ccis = cis = pk = None
    if sparse_state:
        ckeys = jax.vmap(lambda k: CompressedKeys.from_keys(k, cache_size, sp.kernel_size, sp.kernel_stride,
                                                            lengths=lengths))(aux["k"])
    if config.has_cis:
        cis = jnp.pad(aux["cis"], pad[:4])
        if sparse_state:
            ccis = jax.vmap(lambda c: CompressedKeys.from_keys(c[..., None].astype(jnp.float32), cache_size,
                                                               sp.kernel_size, sp.kernel_stride, lengths=lengths)
                            )(aux["cis"])
    if infinigen is not None:
        pk = jnp.einsum("LBSKD,LKDR->LBSKR", kv.k.astype(jnp.float32), infinigen.proj)
    return DecodeState(kv, ckeys, cis, ccis, pk)


def prefill(params, tokens, lengths, config: ModelConfig, *, cache_size: int, mode: Mode = "dense",
            forecast=None, infinigen=None, dtype=jnp.float32, implementations: Implementations = Implementations()):
    """Run right-padded prompts tokens [B, T] (real lengths [B]) and build the decode state
    with room for `cache_size` positions. Returns (logits of each last real token [B, V], state).

    The state always carries compressed keys when the mode is sparse, even if this prefill
    itself ran dense (short prompt): decode may cross dense_len.
    """
    if cache_size < tokens.shape[1]:
        raise ValueError(f"cache_size ({cache_size}) < prompt length ({tokens.shape[1]})")
    lengths = _int32(lengths)
    logits, aux = forward(params, tokens, config, mode=mode, forecast=forecast, infinigen=infinigen, dtype=dtype,
                          implementations=implementations, return_kv=True, logits_at=(lengths - 1)[:, None])
    state = _build_state(aux=aux, lengths=lengths, infinigen=infinigen if mode == "infinigen" else None,
                         config=config, cache_size=cache_size, sparse_state=mode != "dense")
    return commit_to_params_device((logits[:, 0], state), params)


@stored_jit(static_argnames=("plan",), donate_argnames=("state",))
def decode_program(params, tokens, positions, state, forecast, infinigen, *, plan: Plan):
    """The jitted decode step of a `decode_step_plan`: tokens, positions int [B, 1]. state: a
    stacked DecodeState (the layers run as a scan) or a tuple of per-layer ones (a Python loop,
    each layer's buffers updated in place); the new state comes back in the layout given."""
    c = plan.config
    unroll = isinstance(state, tuple)
    cos, sin = rope_tables(c, positions)
    size = (state[0] if unroll else state).size
    ctx = Ctx(DecoderLayer(c, dtype=plan.dtype), cos, sin, positions, -(-size // c.sparse.block_size))
    lin = layer_inputs(params, forecast, infinigen, unroll=unroll, dense_layers=c.sparse.dense_layers)

    def body(carry, xs):
        x, h_prev = carry
        lin_l, st = xs
        x, st, out = layer_step(plan, ctx, lin_l, x, h_prev, st)
        return (x, out.p.h), st

    x = embed(params, tokens, c, plan.dtype)
    xs = tuple(zip(lin, state)) if unroll else (lin, state)
    (x, _), new_state = run_layers(body, (x, jnp.zeros_like(x)), xs, unroll=unroll)
    return unembed(params, x, c)[:, 0], new_state


def decode_step(params, tokens, positions, state: DecodeState, config: ModelConfig, *, mode: Mode = "dense",
                forecast=None, infinigen=None, dtype=jnp.float32, dense: bool | None = None,
                implementations: Implementations = Implementations()):
    """One token per sequence: tokens int [B], positions int [B] (where each token goes).
    Returns (logits [B, V], new state). `dense` (static) overrides the dense_len rule, which
    is otherwise applied to the longest sequence (host-side: positions must be concrete).
    state: a DecodeState from `prefill`, or its `layered_state` (faster: no copy of the state;
    the new state comes back in the layout given)."""
    plan = decode_step_plan(params, positions, state, config, mode=mode, forecast=forecast, infinigen=infinigen,
                            dtype=dtype, dense=dense, implementations=implementations)
    return decode_program(params, tokens[:, None], positions[:, None], state, forecast, infinigen, plan=plan)


def decode_step_plan(params, positions, state, config: ModelConfig, *, mode: Mode = "dense", forecast=None,
                     infinigen=None, dtype=jnp.float32, dense: bool | None = None,
                     implementations: Implementations = Implementations()) -> Plan:
    """`decode_step`'s checks and its static plan, for callers that trace the step themselves
    (`decode_program(params, tokens[:, None], positions[:, None], state, ..., plan=plan)`).
    positions: every position the plan will decode (host-side)."""
    _validate(config, mode, forecast, infinigen, implementations)
    check_lead_forecast(config, mode, "the cached decode")
    check_layers(params, config)
    if dense is None:
        dense = mode == "dense" or int(np.max(np.asarray(positions))) + 1 < config.sparse.dense_len
    plan = Plan(config, mode, bool(dense), jnp.dtype(dtype), implementations)
    if isinstance(state, tuple) and len(state) != config.num_layers:
        raise ValueError(f"a layered decode state needs one DecodeState per layer ({config.num_layers}), "
                         f"got {len(state)}")
    if not plan.dense and (state[0] if isinstance(state, tuple) else state).ckeys is None:
        raise ValueError("this decode state has no compressed keys: prefill it with a sparse mode")
    return plan


def forward_cached(params, tokens, positions, cache: KVCache, config: ModelConfig, *, dtype=jnp.float32,
                   implementations: Implementations = Implementations()):
    """Dense decode of tokens [B, 1] at positions [B, 1] against a plain KVCache; returns
    (logits [B, 1, V], cache)."""
    logits, state = decode_step(params, tokens[:, 0], positions[:, 0], DecodeState(cache), config, dtype=dtype,
                                dense=True, implementations=implementations)
    return logits[:, None], state.kv
