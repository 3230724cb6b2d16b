"""The README's main job: long-context retrieval on a real model.

A fact (who a meeting is with, and the room) is hidden at a chosen depth of a few thousand
tokens of real text (the Python docs that ship with CPython); the model is asked for it.
Deterministic for a seed.
"""

from __future__ import annotations

import random

import jax.numpy as jnp
from dataclasses import dataclass

from sparda_jax.api import Pretrained, prepare_modes, system_kwargs
from sparda_jax.text import haystack_tokens, insert_at_depth

from .engine import selector_of
from .generate import PAD_MULTIPLE, SamplingConfig, generate, longest_prompt
from .timing import CompileClock, StepTimer

__all__ = ["RetrievalCase", "make_case", "run_retrieval", "results_table"]

_FIRST = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas"]
_LAST = ["Brown", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Castillo", "Novak", "Haddad"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


@dataclass
class RetrievalCase:
    prompt_ids: list[int]
    name: str
    room: str
    depth: float
    context_tokens: int
    fact: tuple[int, int]  # the fact's tokens: prompt_ids[fact[0]:fact[1]]

    def correct(self, answer: str) -> bool:
        return self.name.split()[0] in answer and self.room in answer


def make_case(model: Pretrained, context_tokens: int, depth: float, seed: int) -> RetrievalCase:
    tok = model.tokenizer
    rng = random.Random(seed)
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    room = str(rng.randint(10, 99))
    needle = f"\nRemember this: the meeting with {name} is on {rng.choice(_DAYS)} in Room {room}.\n"
    question = "Who is the meeting with, and in which room?"
    head, tail = tok.chat_prompt("\x00").split("\x00")
    pre = tok.encode(head + "Read this document carefully.\n\n")
    post = tok.encode(f"\n\nAnswer using the text above. {question}{tail}")
    frame = len(pre) + len(post) + len(tok.encode(needle))
    n_hay = context_tokens - frame
    if n_hay < 64:  # a haystack shorter than one block would not be a retrieval task
        raise ValueError(f"context_tokens={context_tokens} leaves no room for the haystack: the prompt's frame "
                         f"and the fact take {frame} tokens and the haystack at least 64; take at least {frame + 64}")
    hay = haystack_tokens(tok.encode, n_hay, seed=seed)
    fact = tok.encode(needle)
    body = insert_at_depth(hay, fact, depth, tok.decode)
    start = len(pre) + next(i for i in range(len(body)) if body[i:i + len(fact)] == fact)
    return RetrievalCase(pre + body + post, name, room, depth, context_tokens, (start, start + len(fact)))


def run_retrieval(model: Pretrained, context_tokens: int = 4096, depths=(0.5,), seed: int = 0,
                  max_new_tokens: int = 32, systems=("dense_resident", "sparse", "sparda"), forecast=None,
                  log=print) -> list[dict]:
    """Generate an answer for each depth and system (`infer.engine.SYSTEMS`); returns one
    result dict per case: mode, context_tokens, depth, expected, answer, correct; the timing of
    `infer.timing.DecodeTiming` in seconds: prefill_s, first_decode_s (the first decode step,
    its compile and the copy library's build included), steady_decode_tokens_per_s over
    steady_decode_steps steps after the first (None below 2), total_s; first_calls (the prefill
    and the first decode call split into JAX's trace, lower and compile and the rest,
    `StepTimer.first_calls`; programs compiled for an earlier case are reused); and for offload
    systems miss_rate (blocks copied / blocks selected) and copied_bytes_per_token (else None)."""
    if model.tokenizer is None:
        raise ValueError("the retrieval demo needs a model with a tokenizer")
    longest = longest_prompt(model.config.max_position_embeddings, max_new_tokens)
    if context_tokens > longest:
        raise ValueError(f"context_tokens={context_tokens} is past what the model can take: at most {longest} "
                         f"(its context of {model.config.max_position_embeddings} less {max_new_tokens} new tokens, "
                         f"in whole {PAD_MULTIPLE}-token blocks)")
    for s in systems:
        selector_of(s)  # a clear error for an unknown system before any work
    extra = prepare_modes(model, [selector_of(s) for s in systems], seed=seed, forecast=forecast)
    results = []
    for i, depth in enumerate(depths):
        case = make_case(model, context_tokens, depth, seed + i)
        for system in systems:
            results.append(_one(model, case, system, extra, max_new_tokens, log))
    return results


def _one(model: Pretrained, case: RetrievalCase, system: str, extra: dict, max_new_tokens: int, log) -> dict:
    """One case under one system: a result dict (see `run_retrieval`)."""
    kw = system_kwargs(extra, system)
    log(f"[{system}] depth {case.depth:.2f}, {len(case.prompt_ids)} tokens: prefill, then up to {max_new_tokens} "
        f"new tokens ...")
    timer = StepTimer()
    with CompileClock() as compiles:
        timer.start()
        out, st = generate(model.params, model.config, [case.prompt_ids],
                           SamplingConfig(max_new_tokens=max_new_tokens), stop_ids=model.tokenizer.eos_ids,
                           dtype=model.dtype, return_stats=True, **kw, on_step=timer)
        t = timer.timing(max_new_tokens=max_new_tokens)
    answer = model.tokenizer.decode(out[0])
    rate = t.steady_tokens_per_s
    c = model.config
    block_bytes = 2 * c.sparse.block_size * c.head_dim * jnp.dtype(model.dtype).itemsize  # K and V, one head
    r = {
        "mode": system + (" (untrained)" if "sparda" in system and not extra["forecast_trained"] else ""),
        "context_tokens": len(case.prompt_ids),
        "depth": case.depth,
        "expected": f"{case.name}, Room {case.room}",
        "answer": answer,
        "correct": case.correct(answer),
        "prefill_s": round(t.prefill_s, 3),
        "first_decode_s": None if t.first_decode_s is None else round(t.first_decode_s, 3),
        "steady_decode_tokens_per_s": None if rate is None else round(rate, 2),
        "steady_decode_steps": t.steady_steps,
        "total_s": round(t.total_s, 3),
        "first_calls": timer.first_calls(compiles, t),
        "miss_rate": round(st["copied_blocks"] / st["selected_blocks"], 4) if st["selected_blocks"] else None,
        "copied_bytes_per_token": round(st["copied_blocks"] * block_bytes / st["steps"]) if st["steps"] else None,
    }
    log(f"[{r['mode']}] depth {case.depth:.2f}, {r['context_tokens']} tokens: {answer!r} "
        f"({'correct' if r['correct'] else 'WRONG'}; expected {r['expected']}); {t.summary()}"
        + (f", block miss rate {r['miss_rate']:.3f}, {r['copied_bytes_per_token'] / 1e6:.2f} MB copied per token"
           if r["miss_rate"] is not None else "") + f"\n[{r['mode']}] {r['first_calls']}")
    return r


def results_table(results: list[dict]) -> str:
    cols = ["mode", "context_tokens", "depth", "correct", "prefill_s", "first_decode_s", "steady_decode_tokens_per_s",
            "steady_decode_steps", "miss_rate", "copied_bytes_per_token", "answer"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in results:
        lines.append(" | ".join("-" if r[c] is None else str(r[c]) for c in cols))
    return "\n".join(lines)

