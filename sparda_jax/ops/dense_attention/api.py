"""Dense causal GQA attention with one `implementation=` argument.

Backends (default order "cudnn", "xla"):
  "xla"   `dense_attention_reference`, the chunked jnp code (any platform, any query layout,
          bias allowed);
  "cudnn" `jax.nn.dot_product_attention(implementation="cudnn")` on a GPU, bf16/f16, no bias,
          for two layouts: causal prefill (q_positions None) and decode (Tq == 1, key j
          visible iff j <= q_positions[b, 0]). Raises NotImplementedError otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._dispatch import Registry
from .reference import check_qkv, dense_attention_reference, resolve_positions

__all__ = ["dense_attention", "BACKENDS", "DEFAULT_ORDER"]

BACKENDS = Registry("dense_attention")
DEFAULT_ORDER = ("cudnn", "xla")


@BACKENDS.register("xla")
def _xla(q, k, v, q_positions=None, *, bias=None):
    return dense_attention_reference(q, k, v, q_positions, bias=bias)


@BACKENDS.register("cudnn")
def _cudnn(q, k, v, q_positions=None, *, bias=None):
    if jax.default_backend() != "gpu":
        raise NotImplementedError("cudnn attention needs a GPU")
    if bias is not None:
        raise NotImplementedError("the cudnn path takes no per-key bias")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"cudnn attention takes bf16/f16, got {q.dtype}")
    if q_positions is None:
        check_qkv(q, k, v, resolve_positions(q, k, None))
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    check_qkv(q, k, v, q_positions)
    if q.shape[1] != 1:
        raise NotImplementedError(f"cudnn attention with explicit positions covers decode (Tq == 1), got Tq={q.shape[1]}")
    lengths = (q_positions[:, 0] + 1).astype(jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")


def dense_attention(q, k, v, q_positions=None, *, bias=None, implementation: str | None = None):
    """Causal GQA attention. q [B, Tq, H, D]; k, v [B, S, K, D]; q_positions int [B, Tq] or None
    (causal prefill, Tq == S); bias optional float [B, S, K] added to each key's logit.
    -> [B, Tq, H, D] in q's dtype; a query with no visible key gets zeros.

    implementation: "xla" | "cudnn" (see the module docstring), or None: the first of
    DEFAULT_ORDER that supports the inputs. Raises NotImplementedError if the named backend
    cannot run them, ValueError on a bad name or shapes.
    """
    return BACKENDS(implementation, DEFAULT_ORDER, q, k, v, q_positions, bias=bias)
