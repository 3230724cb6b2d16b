"""Batched generation in any attention mode or engine system, greedy or sampled, streaming.

The prompts of a batch may differ in length: they are right-padded, prefilled together, and
each sequence then decodes at its own position (each step writes the new token's K/V into
its own slot before attending, so padding slots are overwritten before they are seen).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax.config import Implementations, ModelConfig, check_float, check_int
from sparda_jax.model import check_token_ids
from sparda_jax.modes import decode_step, prefill
from sparda_jax.programs import stored_jit

__all__ = ["SamplingConfig", "generate", "sample_next", "longest_prompt"]

PAD_MULTIPLE = 64  # prompts are padded to a multiple of this to bound recompilation


def longest_prompt(max_positions: int, max_new_tokens: int) -> int:
    """The longest prompt whose padded length plus max_new_tokens fits max_positions (may be < 1)."""
    return (max_positions - max_new_tokens) // PAD_MULTIPLE * PAD_MULTIPLE


@dataclass(frozen=True)
class SamplingConfig:
    """temperature (finite, >= 0): 0 = greedy. top_p in (0, 1] keeps the smallest set of tokens
    whose probability reaches top_p (nucleus sampling). max_new_tokens an int >= 1; seed an int
    in [0, 2**32). Raises ConfigError (a ValueError) naming the field otherwise."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self):
        c = "SamplingConfig"
        check_float(c, "temperature", self.temperature, lo=0)
        check_float(c, "top_p", self.top_p, lo=0, lo_open=True, hi=1)
        check_int(c, "max_new_tokens", self.max_new_tokens, lo=1)
        check_int(c, "seed", self.seed, lo=0, hi=2**32 - 1)


@stored_jit(static_argnames=("temperature", "top_p"))
def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [B, V] float32 -> token ids [B] int32."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep a token if the mass before it is < top_p (the first token is always kept)
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -1e30)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
             *, stop_ids: Sequence[int] = (), dtype=jnp.float32, mode: str = "dense", forecast=None,
             infinigen=None, engine=None, implementations: Implementations = Implementations(),
             return_stats: bool = False, on_step: Callable[[list[list[int]]], None] | None = None,
             pad_to: int | None = None, steps_per_call: int = 1):
    """Generate for a batch of token-id prompts; returns the new tokens of each (stop token
    excluded), and with return_stats a dict of engine counters.

    mode: an attention mode of `sparda_jax.MODES`, all KV on the device, each op's backend from
    `implementations`. engine: instead, an `infer.engine.EngineConfig` (its system, e.g. "sparda",
    whose offload systems keep the KV of layers 1..L-1 in host memory). Params may come stacked or
    per layer (`sparda_jax.layered_params`: the engine's layer loop then slices no weight).
    `on_step(generated)` is called after every step. pad_to: pad the prompts to at least this
    many tokens, so that batches of different prompt lengths share one compiled prefill and
    decode step. steps_per_call (engine only): decode that many tokens in one device program
    (`infer.engine.engine_generate_steps`, sampling on the device), then stream them: the same
    tokens and counters, without a host round trip between steps. The block budget
    `sparse.topk` is clamped to the blocks the cache holds (`_budget_within_cache`: the same
    selection, bounded memory). Raises ValueError for a token id outside [0, vocab) or a prompt
    plus max_new_tokens past the model's context, and `infer.memory.InsufficientMemory` (a
    ValueError) for a state larger than the device's or the host's memory."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if steps_per_call < 1 or (steps_per_call > 1 and engine is None):
        raise ValueError(f"steps_per_call must be 1, or > 1 with an engine (engine=EngineConfig(...)), "
                         f"got {steps_per_call}")
    lengths = np.array([len(p) for p in prompts], np.int32)
    t_pad = -(-max(int(lengths.max()), pad_to or 0) // PAD_MULTIPLE) * PAD_MULTIPLE
    cache_size = t_pad + sampling.max_new_tokens
    if cache_size > config.max_position_embeddings:
        raise ValueError(f"prompt ({lengths.max()} tokens, padded to {t_pad}) + max_new_tokens "
                         f"({sampling.max_new_tokens}) exceeds the model's context "
                         f"({config.max_position_embeddings})")
    for p in prompts:
        check_token_ids(np.asarray(p), config.vocab_size)
    # whole blocks: the compiled decode kernels take no partial one (positions past the last
    # new token are never attended)
    cache_size = -(-cache_size // config.sparse.block_size) * config.sparse.block_size
    config = _budget_within_cache(config, cache_size)
    _admit_memory(params, config, len(prompts), cache_size, engine, dtype)
    tokens = np.zeros((len(prompts), t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    run = dict(forecast=forecast, infinigen=infinigen, dtype=dtype)
    if engine is not None:
        from .engine import EngineConfig, engine_decode_step, engine_offload, engine_prefill_staged

        if not isinstance(engine, EngineConfig):
            raise TypeError(f"engine must be an EngineConfig, got {type(engine).__name__}")
        # prefill and engine_prefill hand back committed states: the decode step compiles once
        logits, state = engine_prefill_staged(params, tokens, lengths, config, engine, cache_size=cache_size, **run)

        def step_fn(params, tok, pos, state, config):
            return engine_decode_step(params, tok, pos, state, config, engine, **run)
    else:
        run.update(mode=mode, implementations=implementations)
        logits, state = prefill(params, tokens, lengths, config, cache_size=cache_size, **run)

        def step_fn(*args, **kw):
            lg, st = decode_step(*args, **run, **kw)
            return lg, st, {}
    stats = {"steps": 0, "copied_blocks": 0, "selected_blocks": 0}
    key = jax.random.key(sampling.seed)
    stop = set(int(s) for s in stop_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    positions = lengths.copy()  # on the host: the engine checks them without waiting for the device
    counts = []  # each step's device counters, read once at the end
    key, sub = jax.random.split(key)
    nxt = sample_next(logits, sub, temperature=sampling.temperature, top_p=sampling.top_p)
    # the prompt's token is read (and streamed) before the KV moves to the host and before the
    # first decode step is dispatched: the first token waits for neither, nor for that step's compile
    _record(nxt, out, done, stop)
    if on_step is not None:
        on_step(out)
    if engine is not None:
        state = engine_offload(state)  # imported with the engine's prefill above
    if steps_per_call > 1:
        return _generate_in_calls(params, config, state, nxt, key, positions, out, done, stop, stats, sampling,
                                  steps_per_call, on_step, return_stats, run, engine)
    for step in range(sampling.max_new_tokens):
        if done.all():
            break
        ahead = None
        if step < sampling.max_new_tokens - 1:
            # the next step is dispatched before this token is read on the host, so the device
            # computes it while the host reads, checks stops and streams; if every sequence has
            # stopped, that step is discarded uncounted, so tokens and stats are as if it never ran
            logits, state, st = step_fn(params, nxt, positions, state, config)
            positions = positions + 1
            key, sub = jax.random.split(key)
            ahead = (sample_next(logits, sub, temperature=sampling.temperature, top_p=sampling.top_p), st)
        if step > 0:
            _record(nxt, out, done, stop)
            if on_step is not None:
                on_step(out)
        if ahead is None or done.all():
            break
        nxt, st = ahead
        stats["steps"] += 1
        counts.append({k: st[k] for k in ("copied_blocks", "selected_blocks") if k in st})
    for c in counts:
        for k, v in c.items():
            stats[k] += int(v)
    return (out, stats) if return_stats else out


def _admit_memory(params, config: ModelConfig, batch: int, cache_size: int, engine, dtype) -> None:
    """Refuse (InsufficientMemory, with the bytes) a state that would not fit the device or the
    host, before anything is allocated. Without an engine every layer's K/V is on the device."""
    from .memory import check_fits

    weights = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(params))
    system = "dense_resident" if engine is None else engine.system
    n_slots = None if engine is None else engine.n_slots
    check_fits(config, system, batch=batch, context=cache_size, weights=weights, n_slots=n_slots, dtype=dtype)


def _budget_within_cache(config: ModelConfig, cache_size: int) -> ModelConfig:
    """The config with the block budget `sparse.topk` clamped to the blocks the cache can ever
    hold (at least the forced blocks, which the config requires).

    A clamp, not a refusal: selection sorts its ids and pads with -1 past the causal blocks, so
    any budget >= the cache's blocks selects every visible block, and the smaller one selects
    the same blocks. It only bounds what is sized by the budget (the selection's ids, the block
    cache's slots and the copy plan's [topk, n_slots] masks): a budget of 100000 on a 38-token
    prompt would otherwise allocate gigabytes. Refusing a budget past the model's whole context
    is the caller's choice (the CLI does).
    """
    sp = config.sparse
    limit = max(-(-cache_size // sp.block_size), sp.forced_blocks)
    if sp.topk <= limit:
        return config
    qk = None if sp.nosa_qk_topk is None else min(sp.nosa_qk_topk, limit)
    return config.replace(sparse=dataclasses.replace(sp, topk=limit, nosa_qk_topk=qk))


def _record(tokens, out, done, stop) -> None:
    """Append each running sequence's token, or end it at a stop token (not appended)."""
    for i, t in enumerate(np.asarray(tokens)):
        if done[i]:
            continue
        if int(t) in stop:
            done[i] = True
        else:
            out[i].append(int(t))


def _generate_in_calls(params, config, state, nxt, key, positions, out, done, stop, stats, sampling, per_call,
                       on_step, return_stats, run, engine):
    """`generate`'s decode loop with `per_call` steps a device program, after the prompt's token
    is recorded: a step counts (and its token is read) as in the one-step loop, only while some
    sequence still runs."""
    from .engine import engine_generate_steps

    remaining = sampling.max_new_tokens - 1
    while remaining > 0 and not done.all():
        n = min(per_call, remaining)
        keys = []
        for _ in range(n):  # the keys the one-step loop would split, in its order
            key, sub = jax.random.split(key)
            keys.append(sub)
        pos = positions[None] + np.arange(n, dtype=positions.dtype)[:, None]
        drawn, state, st = engine_generate_steps(params, nxt, pos, jnp.stack(keys), state, config, engine,
                                                 temperature=sampling.temperature, top_p=sampling.top_p, **run)
        positions, remaining = positions + n, remaining - n
        # the next call's first token stays on the device, committed as the first call's was (a
        # jit output): an uncommitted one would compile the program a second time
        nxt = drawn[-1]
        drawn, copied, selected = (np.asarray(x) for x in (drawn, st["copied_blocks"], st["selected_blocks"]))
        for i in range(n):
            if done.all():  # the steps past every stop token are discarded uncounted
                break
            stats["steps"] += 1
            stats["copied_blocks"] += int(copied[i])
            stats["selected_blocks"] += int(selected[i])
            _record(drawn[i], out, done, stop)
            if on_step is not None:
                on_step(out)
    return (out, stats) if return_stats else out
