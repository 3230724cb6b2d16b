"""Shared runs of the offload engine for tests that compare two implementations of one part."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparda_jax import init_forecast, init_model
from sparda_jax.config import Implementations
from sparda_jax.infer.engine import EngineConfig, engine_decode_step, engine_prefill


def sparda_bf16_decode(cfg, *, tok_len: int, lengths, cache_size: int, steps: int, **implementations) -> np.ndarray:
    """Prefill two rows of random tokens (right-padded to the longer of `lengths`) in `sparda`
    mode, bf16, then decode `steps` tokens, feeding the prompt's own next tokens; returns the
    logits [steps, 2, V] as float32. implementations picks the backends under test (kv_copy=...,
    sparse_attention=...). The same seeds every call, so two calls differ only by them."""
    params, fc = init_model(cfg, jax.random.key(0)), init_forecast(cfg, jax.random.key(1))
    tok = jax.random.randint(jax.random.key(2), (2, tok_len), 0, cfg.vocab_size)
    p = jnp.asarray(lengths, jnp.int32)
    eng = EngineConfig("sparda", implementations=Implementations(**implementations))
    _, st = engine_prefill(params, tok[:, :int(p.max())], p, cfg, eng, cache_size=cache_size, forecast=fc,
                           dtype=jnp.bfloat16)
    res = []
    for _ in range(steps):
        logits, st, _ = engine_decode_step(params, tok[jnp.arange(2), p], p, st, cfg, eng, forecast=fc,
                                           dtype=jnp.bfloat16)
        res.append(logits)
        p = p + 1
    return np.asarray(jnp.stack(res).astype(jnp.float32))
