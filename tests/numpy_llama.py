"""An independent NumPy forward pass of a Llama-family decoder, from HF-layout weights.

Written from the HF/llama.cpp formulas, not from sparda_jax: float64 throughout, a plain
causal softmax per head, RoPE either in HF's rotate-half layout or in llama.cpp's interleaved
(GPT-J) layout, so that GGUF weights can be checked WITHOUT undoing llama.cpp's permutation.
"""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_angles(t, head_dim, theta, factors=None, magnitude=1.0):
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv = inv / np.asarray(factors, np.float64)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]  # [T, Dh/2]
    return np.cos(ang) * magnitude, np.sin(ang) * magnitude


def rope_half(x, cos, sin):
    """x [T, N, Dh]; pairs (i, i + Dh/2)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_interleaved(x, cos, sin):
    """x [T, N, Dh]; pairs (2i, 2i+1), as llama.cpp's LLAMA_ROPE_TYPE_NORM."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def softplus(x):
    return np.logaddexp(0.0, x)


def llama_forward(w: dict, tokens, *, n_layers, n_heads, n_kv_heads, head_dim, eps, theta,
                  rope="half", rope_factors=None, rope_magnitude=1.0, scale_emb=1.0,
                  residual_scale=1.0, logit_scale=1.0, tied=False, cis=False):
    """tokens: 1-D int array of one sequence -> logits [T, V] (float64).

    w maps HF names (model.layers.N.self_attn.q_proj.weight, ...) to [out, in] arrays.
    """
    f = lambda n: np.asarray(w[n], np.float64)
    t = len(tokens)
    x = f("model.embed_tokens.weight")[np.asarray(tokens)] * scale_emb
    cos, sin = rope_angles(t, head_dim, theta, rope_factors, rope_magnitude)
    apply = rope_half if rope == "half" else rope_interleaved
    g = n_heads // n_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, f(p + "input_layernorm.weight"), eps)
        q = (h @ f(p + "self_attn.q_proj.weight").T).reshape(t, n_heads, head_dim)
        k = (h @ f(p + "self_attn.k_proj.weight").T).reshape(t, n_kv_heads, head_dim)
        v = (h @ f(p + "self_attn.v_proj.weight").T).reshape(t, n_kv_heads, head_dim)
        q, k = apply(q, cos, sin), apply(k, cos, sin)
        bias = np.zeros((t, n_kv_heads))
        if cis:
            dt = v.reshape(t, -1) @ f(p + "self_attn.delta.weight").T  # [T, K]
            bias = f(p + "self_attn.A")[None, :] * softplus(dt)
        out = np.zeros((t, n_heads, head_dim))
        for hh in range(n_heads):
            kv = hh // g
            s = q[:, hh] @ k[:, kv].T / math.sqrt(head_dim) + bias[None, :, kv]
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[:, hh] = s @ v[:, kv]
        x = x + residual_scale * (out.reshape(t, -1) @ f(p + "self_attn.o_proj.weight").T)
        h = rms_norm(x, f(p + "post_attention_layernorm.weight"), eps)
        gate = h @ f(p + "mlp.gate_proj.weight").T
        up = h @ f(p + "mlp.up_proj.weight").T
        x = x + residual_scale * ((gate / (1 + np.exp(-gate)) * up) @ f(p + "mlp.down_proj.weight").T)
    x = rms_norm(x, f("model.norm.weight"), eps) * logit_scale
    head = f("model.embed_tokens.weight") if tied else f("lm_head.weight")
    return x @ head.T
