"""The custom VJP of block-sparse attention: any backend's forward, and its backward.

`differentiable(forward, ...)` wraps a backend's forward in a `jax.custom_vjp` whose residuals
are (q, k, v, block_ids, q_positions, bias, out, lse) and whose backward is the backend's
(`Forward.backward`) or by default `reference.sparse_attention_backward_reference` (memory
O(chunk * selected keys), never [Tq, S]). A `Forward` names how the backend makes `out`, and
`out` with `lse` under differentiation (the jnp reference and the Mosaic prefill kernel return
both from one pass).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from .reference import (sparse_attention_backward_reference, sparse_attention_reference,
                        sparse_attention_reference_with_lse)

__all__ = ["Forward", "differentiable", "REFERENCE_FORWARD"]


class Forward(NamedTuple):
    """A backend's forward for the VJP, and optionally its backward (hashable callables; static
    under jit).

    out:         (q, k, v, block_ids, q_positions, bias, block_size) -> out [B, Tq, H, D], q's dtype;
    out_and_lse: same arguments -> (out, lse [B, Tq, H] float32: the natural log-sum-exp of
                 each query head's visible logits, -inf where none is visible);
    backward:    (q, k, v, block_ids, q_positions, bias, out, lse, dout, block_size) ->
                 (dq, dk, dv, dbias or None); None: `sparse_attention_backward_reference`.
    """
    out: Callable
    out_and_lse: Callable
    backward: Callable | None = None


def _reference_out_and_lse(q, k, v, block_ids, q_positions, bias, block_size):
    return sparse_attention_reference_with_lse(q, k, v, block_ids, q_positions, block_size=block_size, bias=bias)


def _reference_out(q, k, v, block_ids, q_positions, bias, block_size):
    return sparse_attention_reference(q, k, v, block_ids, q_positions, block_size=block_size, bias=bias)


REFERENCE_FORWARD = Forward(_reference_out, _reference_out_and_lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(forward: Forward, block_size: int, q, k, v, block_ids, q_positions, bias):
    return forward.out(q, k, v, block_ids, q_positions, bias, block_size)


def _attention_fwd(forward, block_size, q, k, v, block_ids, q_positions, bias):
    out, lse = forward.out_and_lse(q, k, v, block_ids, q_positions, bias, block_size)
    return out, (q, k, v, block_ids, q_positions, bias, out, lse)


def _attention_bwd(forward, block_size, residuals, dout):
    q, k, v, block_ids, q_positions, bias, out, lse = residuals
    if forward.backward is None:
        dq, dk, dv, dbias = sparse_attention_backward_reference(q, k, v, block_ids, q_positions, out, lse, dout,
                                                                block_size=block_size, bias=bias)
    else:
        dq, dk, dv, dbias = forward.backward(q, k, v, block_ids, q_positions, bias, out, lse, dout, block_size)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    # integer ids and positions: no cotangent
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dbias


_attention.defvjp(_attention_fwd, _attention_bwd)


def differentiable(forward: Forward, q, k, v, block_ids, q_positions, *, block_size: int, bias=None):
    """forward.out(q, k, v, block_ids, q_positions, bias, block_size) with gradients for q, k, v
    and bias from forward.backward or the jnp backward (block_ids and q_positions get none).
    Shapes as in `sparse_attention`; checking them is the caller's."""
    return _attention(forward, block_size, q, k, v, block_ids, q_positions, bias)
