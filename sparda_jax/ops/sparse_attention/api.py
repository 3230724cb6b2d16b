"""Block-sparse GQA attention with one `implementation=` argument.

Backends (default order "mosaic_gpu", "xla"):
  "xla"                  the jnp reference (`reference.py`; any platform, any block_ids layout);
  "mosaic_gpu"           the Pallas Mosaic GPU kernels on a Hopper GPU: Tq > 1 goes to the
                         prefill kernel (`prefill.py`; bias allowed, any order of block ids),
                         Tq == 1 to the decode kernel (`decode.py`; no bias, block ids as
                         the selectors emit them: ascending, unique, -1 padding at the end).
                         bf16/f16, 64-token blocks, head dim 64 or 128, decode on a cache of
                         whole blocks;
  "mosaic_gpu_interpret" the same kernels under `plgpu.InterpretGPUParams()` (CPU; tests), for
                         any head dim that is a multiple of 64.
A Mosaic backend raises NotImplementedError for inputs outside that envelope, so None falls
back to "xla" there.

Every backend of `sparse_attention` is differentiable in q, k, v and bias through one custom
VJP (`vjp.py`) with residuals (q, k, v, ids, positions, bias, out, lse): "xla" runs the
memory-bounded jnp backward (`reference.sparse_attention_backward_reference`); the Mosaic
backends take the lse that the prefill kernel returns (Tq > 1) or the jnp reference's (decode),
and the Mosaic backends run the Mosaic backward kernels (`prefill_backward.py`) for Tq > 1,
the jnp backward for decode.
`paged_sparse_attention` has no custom VJP.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .._dispatch import Registry, hopper_gpu, interpret_params
from ..dense_attention.reference import check_qkv
from .reference import check_block_ids, paged_sparse_attention_reference, sparse_attention_backward_reference
from .vjp import REFERENCE_FORWARD, Forward, differentiable

__all__ = ["sparse_attention", "paged_sparse_attention", "BACKENDS", "PAGED_BACKENDS", "DEFAULT_ORDER"]

BACKENDS = Registry("sparse_attention")
PAGED_BACKENDS = Registry("sparse_attention")
DEFAULT_ORDER = ("mosaic_gpu", "xla")
BLOCK = 64  # the kernels' block size


def _mosaic_support(implementation: str, q, k, v, block_size: int, bias) -> None:
    """Raise NotImplementedError unless the Mosaic kernels (compiled or interpreted) take these inputs."""
    decode = q.shape[1] == 1
    if implementation == "mosaic_gpu" and not hopper_gpu():
        raise NotImplementedError("the Mosaic GPU kernels need a Hopper GPU")
    if block_size != BLOCK:
        raise NotImplementedError(f"the Mosaic GPU kernels take {BLOCK}-token blocks, got {block_size}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"the Mosaic GPU kernels take bf16/f16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if decode and bias is not None:
        raise NotImplementedError("the Mosaic GPU decode kernel (Tq == 1) takes no bias")
    if decode and k.ndim == 4 and k.shape[1] % BLOCK:  # the paged pools [B, K, n_slots, bs, D] are whole blocks
        raise NotImplementedError(f"the Mosaic GPU decode kernel takes a cache of whole {BLOCK}-token blocks, "
                                  f"got {k.shape[1]} positions")
    d = q.shape[-1]
    # compiled: the head dims the kernels were validated at on the H200; interpreted: their rule
    dims_ok = d in (64, 128) if implementation == "mosaic_gpu" else d % 64 == 0
    if not dims_ok:
        raise NotImplementedError(f"the Mosaic GPU {'decode' if decode else 'prefill'} kernel does not take head dim {d}")


def _check_block_size(block_size) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def _check_ids_below(ids, bound: int, what: str) -> None:
    """Raise ValueError if a concrete int array `ids` holds a value >= bound. Traced ids (under
    jit) are not checked: that would cost a device round trip per call."""
    if isinstance(ids, jax.core.Tracer):
        return
    top = int(np.max(np.asarray(ids), initial=-1))
    if top >= bound:
        raise ValueError(f"{what} must be < {bound} (or < 0 for padding), got {top}")


@BACKENDS.register("xla")
def _xla(q, k, v, block_ids, q_positions, *, block_size, bias, config):
    return differentiable(REFERENCE_FORWARD, q, k, v, block_ids, q_positions, block_size=block_size, bias=bias)


@dataclasses.dataclass(frozen=True)
class _MosaicOut:
    """The Mosaic kernels' forward as a hashable callable (a static argument of the VJP):
    out, or with_lse (out, lse): the prefill kernel's own lse, the jnp reference's for decode."""
    implementation: str
    config: object
    with_lse: bool = False

    def __call__(self, q, k, v, block_ids, q_positions, bias, block_size):
        interpret = interpret_params(self.implementation)
        if q.shape[1] > 1:
            from .prefill import sparse_prefill_attention

            return sparse_prefill_attention(q, k, v, block_ids, q_positions.astype(jnp.int32), bias=bias,
                                            interpret=interpret, return_lse=self.with_lse)
        from .decode import sparse_decode_attention

        out = sparse_decode_attention(q[:, 0], k, v, block_ids[:, :, 0].astype(jnp.int32),
                                      q_positions[:, 0].astype(jnp.int32), config=self.config,
                                      interpret=interpret)[:, None]
        if not self.with_lse:
            return out
        return out, REFERENCE_FORWARD.out_and_lse(q, k, v, block_ids, q_positions, bias, block_size)[1]


@dataclasses.dataclass(frozen=True)
class _MosaicBackward:
    """The Mosaic backward kernels (`prefill_backward.py`) for Tq > 1; the jnp backward for decode."""
    implementation: str

    def __call__(self, q, k, v, block_ids, q_positions, bias, out, lse, dout, block_size):
        if q.shape[1] == 1:
            return sparse_attention_backward_reference(q, k, v, block_ids, q_positions, out, lse, dout,
                                                       block_size=block_size, bias=bias)
        from .prefill_backward import sparse_prefill_attention_backward

        return sparse_prefill_attention_backward(q, k, v, block_ids, q_positions.astype(jnp.int32), out, lse,
                                                 dout.astype(q.dtype), bias=bias,
                                                 interpret=interpret_params(self.implementation))


def _mosaic(implementation):
    def run(q, k, v, block_ids, q_positions, *, block_size, bias, config):
        check_qkv(q, k, v, q_positions)
        check_block_ids(q, k, block_ids)
        _mosaic_support(implementation, q, k, v, block_size, bias)
        forward = Forward(_MosaicOut(implementation, config), _MosaicOut(implementation, config, with_lse=True),
                          _MosaicBackward(implementation))
        return differentiable(forward, q, k, v, block_ids, q_positions, block_size=block_size, bias=bias)
    return run


for _name in ("mosaic_gpu", "mosaic_gpu_interpret"):
    BACKENDS.register(_name)(_mosaic(_name))


def sparse_attention(q, k, v, block_ids, q_positions, *, block_size: int = 64, bias=None,
                     implementation: str | None = None, config=None):
    """Block-sparse attention over the selected blocks.

    q [B, Tq, H, D]; k, v [B, S, K, D]; block_ids int [B, K, Tq, n] (-1 = padding, repeats
    count once); q_positions int [B, Tq]; bias optional float [B, S, K] added to each key's
    logit (NOSA's cis). -> [B, Tq, H, D] in q's dtype; a query with no visible key gets zeros.

    Block ids must be < n_blocks = ceil(S / block_size). Concrete ids are checked (ValueError);
    under jit, where they are traced, they are not (an id >= n_blocks gives undefined results).

    implementation: "xla" | "mosaic_gpu" | "mosaic_gpu_interpret" (module docstring), or None:
    the first of DEFAULT_ORDER that supports the inputs.
    config: the Mosaic decode kernel's tuning, `decode.DecodeConfig` (Tq == 1); None: its
    defaults. Ignored by "xla". The prefill kernel has none.
    Differentiable in q, k, v and bias (custom VJP; the backward of the backend, module docstring).
    Raises ValueError for block_size < 1, ids out of range, mismatched shapes or a config with
    Tq > 1 (any backend); NotImplementedError if the named backend cannot run the inputs.
    """
    if config is not None and jnp.ndim(q) == 4 and q.shape[1] > 1:
        raise ValueError(f"config tunes the decode kernel (Tq == 1); the prefill kernel has none (Tq = {q.shape[1]})")
    _check_block_size(block_size)
    check_qkv(q, k, v, q_positions)
    check_block_ids(q, k, block_ids)
    _check_ids_below(block_ids, -(-k.shape[1] // block_size), f"block ids (of {k.shape[1]} keys in "
                     f"{block_size}-token blocks)")
    return BACKENDS(implementation, DEFAULT_ORDER, q, k, v, block_ids, q_positions, block_size=block_size,
                    bias=bias, config=config)


@PAGED_BACKENDS.register("xla")
def _paged_xla(q, k_pool, v_pool, slots, block_ids, q_positions, *, block_size, bias_pool, config):
    return paged_sparse_attention_reference(q, k_pool, v_pool, slots, block_ids, q_positions,
                                            block_size=block_size, bias_pool=bias_pool)


def _paged_mosaic(implementation):
    def run(q, k_pool, v_pool, slots, block_ids, q_positions, *, block_size, bias_pool, config):
        if q.shape[1] != 1:
            raise NotImplementedError("the paged Mosaic GPU kernel covers decode (Tq == 1)")
        _mosaic_support(implementation, q, k_pool, v_pool, block_size, bias_pool)
        from .decode import paged_sparse_decode_attention

        out = paged_sparse_decode_attention(q[:, 0], k_pool, v_pool, slots[:, :, 0],
                                            block_ids[:, :, 0].astype(jnp.int32),
                                            q_positions[:, 0].astype(jnp.int32), config=config,
                                            interpret=interpret_params(implementation))
        return out[:, None]
    return run


for _name in ("mosaic_gpu", "mosaic_gpu_interpret"):
    PAGED_BACKENDS.register(_name)(_paged_mosaic(_name))


def paged_sparse_attention(q, k_pool, v_pool, slots, block_ids, q_positions, *, block_size: int = 64,
                           bias_pool=None, implementation: str | None = None, config=None):
    """Block-sparse attention reading K/V through a slot table (the engine's block cache).

    q [B, Tq, H, D]; k_pool, v_pool [B, K, n_slots, block_size, D]; slots and block_ids int
    [B, K, Tq, n]: block block_ids[i] sits in slot slots[i] (block id < 0: padding);
    bias_pool optional [B, K, n_slots, block_size]. -> [B, Tq, H, D] in q's dtype, the result of
    `sparse_attention` on the contiguous cache.

    implementation: "xla", or "mosaic_gpu" / "mosaic_gpu_interpret": the paged decode kernel
    (Tq == 1, no bias, 64-token blocks, bf16/f16, block ids ascending and unique with -1 padding
    at the end, as the selectors emit them); None: the first of DEFAULT_ORDER that supports the
    inputs. config: the kernel's `decode.DecodeConfig` (None: its defaults).
    Raises ValueError for block_size < 1.
    """
    _check_block_size(block_size)
    return PAGED_BACKENDS(implementation, DEFAULT_ORDER, q, k_pool, v_pool, slots, block_ids, q_positions,
                          block_size=block_size, bias_pool=bias_pool, config=config)
