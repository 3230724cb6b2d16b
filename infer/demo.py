"""The README's main job: long-context retrieval on a real model.

A fact (who a meeting is with, and the room) is hidden at a chosen depth of a few thousand
tokens of real text (the Python docs that ship with CPython); the model is asked for it.
Deterministic for a seed.
"""

from __future__ import annotations

import random
import time

import jax.numpy as jnp
from dataclasses import dataclass

from sparda_jax.api import Pretrained, mode_kwargs, prepare_modes
from sparda_jax.text import haystack_tokens, insert_at_depth

from .engine import EngineConfig, selector_of
from .generate import SamplingConfig, generate

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
    n_hay = context_tokens - len(pre) - len(post) - len(tok.encode(needle))
    if n_hay < 64:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for the haystack")
    hay = haystack_tokens(tok.encode, n_hay, seed=seed)
    body = insert_at_depth(hay, tok.encode(needle), depth, tok.decode)
    return RetrievalCase(pre + body + post, name, room, depth, context_tokens)


def run_retrieval(model: Pretrained, context_tokens: int = 4096, depths=(0.5,), seed: int = 0,
                  max_new_tokens: int = 32, systems=("dense_resident", "sparse", "sparda"), forecast=None,
                  log=print) -> list[dict]:
    """Generate an answer for each depth and system (`infer.engine.ENGINE_MODES`); returns one
    result dict per case, with the offload systems' block miss rate and bytes copied."""
    if model.tokenizer is None:
        raise ValueError("the retrieval demo needs a model with a tokenizer")
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
    t0 = time.perf_counter()
    steps = []
    kw = mode_kwargs(extra, selector_of(system))
    kw.pop("mode")
    out, st = generate(model.params, model.config, [case.prompt_ids],
                       SamplingConfig(max_new_tokens=max_new_tokens), stop_ids=model.tokenizer.eos_ids,
                       dtype=model.dtype, engine=EngineConfig(system), return_stats=True, **kw,
                       on_step=lambda g: steps.append(time.perf_counter()))
    total = time.perf_counter() - t0
    answer = model.tokenizer.decode(out[0])
    first = steps[0] - t0 if steps else total
    decode_s = (steps[-1] - steps[0]) if len(steps) > 1 else 0.0
    c = model.config
    block_bytes = 2 * c.sparse.block_size * c.head_dim * jnp.dtype(model.dtype).itemsize  # K and V, one head
    r = {
        "mode": system + (" (untrained)" if "sparda" in system and not extra["forecast_trained"] else ""),
        "context_tokens": len(case.prompt_ids),
        "depth": case.depth,
        "expected": f"{case.name}, Room {case.room}",
        "answer": answer,
        "correct": case.correct(answer),
        "prefill_s": round(first, 3),
        "decode_tokens_per_s": round((len(steps) - 1) / decode_s, 2) if decode_s > 0 else None,
        "total_s": round(total, 3),
        "miss_rate": round(st["copied_blocks"] / st["selected_blocks"], 4) if st["selected_blocks"] else None,
        "copied_bytes_per_token": round(st["copied_blocks"] * block_bytes / st["steps"]) if st["steps"] else None,
    }
    log(f"[{r['mode']}] depth {case.depth:.2f}, {r['context_tokens']} tokens: {answer!r} "
        f"({'correct' if r['correct'] else 'WRONG'}; expected {r['expected']}); "
        f"prefill {r['prefill_s']:.2f} s (compile included on a mode's first case), "
        f"decode {r['decode_tokens_per_s']} tok/s"
        + (f", block miss rate {r['miss_rate']:.3f}, {r['copied_bytes_per_token'] / 1e6:.2f} MB copied per token"
           if r["miss_rate"] is not None else ""))
    return r


def results_table(results: list[dict]) -> str:
    cols = ["mode", "context_tokens", "depth", "correct", "prefill_s", "decode_tokens_per_s", "miss_rate",
            "copied_bytes_per_token", "answer"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in results:
        lines.append(" | ".join(str(r[c]) for c in cols))
    return "\n".join(lines)

