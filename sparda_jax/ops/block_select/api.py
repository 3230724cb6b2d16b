"""Block selection with one `implementation=` argument (InfLLM-V2, Forecast and InfiniGen selectors).

Backends:
  "xla"                  the jnp reference (`reference.py`; any platform, coarse LSE allowed);
  "mosaic_gpu"           the Pallas Mosaic GPU selectors on a Hopper GPU (`forecast_mgpu.py`,
                         `infllmv2_mgpu.py`: scoring fused with the pooling and the forced /
                         causal rules, then a top-k without sort): bf16/f16, head dim 64 or 128,
                         <= 2048 blocks, exact LSE;
  "mosaic_gpu_interpret" the same kernels under `plgpu.InterpretGPUParams()` (CPU; tests), for
                         any head dim that is a multiple of 64;
  "triton"               the reference's scoring, then its top-k stage as one Pallas Triton kernel
                         (`topk_triton.py`) on a GPU: rows of <= 256 blocks (small models'
                         decode); "triton_interpret" the same under Pallas' interpreter.
Default order: prefill (Tq > 1) "mosaic_gpu", "xla"; decode (Tq == 1) "xla" alone, the faster
there. InfiniGen's Mosaic selector (`infinigen_mgpu.py`: partial dims <= 64, 64-token blocks,
16-bit kernel_dtype) follows the same order. A Mosaic or Triton backend raises
NotImplementedError for inputs outside its envelope, and the default order then falls back to
"xla". "triton" is taken by name only until its compiled test and a decode timing run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sparda_jax.config import SparseConfig

from .._dispatch import Registry, hopper_gpu, interpret_params
from .reference import (_check, _check_forecast, _check_sparse, check_infllmv2, n_blocks_for, nosa_refine, select_blocks_forecast_reference,
                        select_blocks_infinigen_reference, select_blocks_infllmv2_reference)

__all__ = ["select_blocks_infllmv2", "select_blocks_forecast", "select_blocks_nosa", "select_blocks_infinigen",
           "INFLLMV2_BACKENDS", "FORECAST_BACKENDS", "INFINIGEN_BACKENDS", "default_order", "MOSAIC_MAX_BLOCKS"]

INFLLMV2_BACKENDS = Registry("select")
FORECAST_BACKENDS = Registry("select")
INFINIGEN_BACKENDS = Registry("select")
MOSAIC_MAX_BLOCKS = 2048  # the kernels' top-k row (128K tokens of 64-token blocks)


def default_order(x) -> tuple[str, ...]:
    """The backends None tries for queries (or Forecasts) x [B, Tq, heads, D]."""
    return ("mosaic_gpu", "xla") if x.shape[1] > 1 else ("xla",)


def _mosaic_support(implementation, x, nb: int, *, head_dim: bool = True) -> None:
    """NotImplementedError unless the Mosaic selectors can run x [..., D] with rows of nb blocks
    here; head_dim False leaves D to the caller (InfiniGen's partial dims)."""
    if implementation == "mosaic_gpu" and not hopper_gpu():
        raise NotImplementedError("the Mosaic GPU selectors need a Hopper GPU")
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"the Mosaic GPU selectors take bf16/f16, got {x.dtype}")
    d = x.shape[-1]
    if head_dim and not (d in (64, 128) if implementation == "mosaic_gpu" else d % 64 == 0):
        raise NotImplementedError(f"the Mosaic GPU selectors do not take head dim {d}")
    if nb > MOSAIC_MAX_BLOCKS:
        raise NotImplementedError(f"the Mosaic GPU top-k takes rows of <= {MOSAIC_MAX_BLOCKS} blocks, got {nb}")


@INFLLMV2_BACKENDS.register("xla")
def _infllmv2_xla(q, kc, q_positions, sparse, *, kc_coarse, n_blocks, q_chunk):
    return select_blocks_infllmv2_reference(q, kc, q_positions, sparse, kc_coarse=kc_coarse, n_blocks=n_blocks,
                                            q_chunk=q_chunk)


def _infllmv2_mosaic(implementation):
    def run(q, kc, q_positions, sparse, *, kc_coarse, n_blocks, q_chunk):
        if not sparse.exact_lse:
            raise NotImplementedError("the Mosaic GPU InfLLM-V2 selector takes exact LSE only")
        _mosaic_support(implementation, q, n_blocks)
        from .infllmv2_mgpu import infllmv2_select

        q, kc = jax.lax.stop_gradient((q, kc))  # the block choice carries no gradient; the kernel has no JVP

        return infllmv2_select(q, kc.astype(q.dtype), q_positions, sparse, n_blocks=n_blocks,
                               interpret=interpret_params(implementation))
    return run


@FORECAST_BACKENDS.register("xla")
def _forecast_xla(f, kc, q_positions, sparse, *, n_blocks, q_chunk):
    return select_blocks_forecast_reference(f, kc, q_positions, sparse, n_blocks=n_blocks, q_chunk=q_chunk)


def _forecast_mosaic(implementation):
    def run(f, kc, q_positions, sparse, *, n_blocks, q_chunk):
        _mosaic_support(implementation, f, n_blocks)
        from .forecast_mgpu import forecast_select

        f, kc = jax.lax.stop_gradient((f, kc))  # the block choice carries no gradient; the kernel has no JVP

        return forecast_select(f, kc.astype(f.dtype), q_positions, sparse, n_blocks=n_blocks,
                               interpret=interpret_params(implementation))
    return run


@INFINIGEN_BACKENDS.register("xla")
def _infinigen_xla(qp, pk, q_positions, sparse, *, head_dim, n_blocks, q_chunk, kernel_dtype):
    return select_blocks_infinigen_reference(qp, pk, q_positions, sparse, head_dim=head_dim, n_blocks=n_blocks,
                                             q_chunk=q_chunk)


def _infinigen_mosaic(implementation):
    def run(qp, pk, q_positions, sparse, *, head_dim, n_blocks, q_chunk, kernel_dtype):
        from .infinigen_mgpu import MAX_GROUP, PARTIAL_DIM, infinigen_select

        qp = qp if kernel_dtype is None else qp.astype(kernel_dtype)
        _mosaic_support(implementation, qp, n_blocks, head_dim=False)
        if qp.shape[-1] > PARTIAL_DIM or sparse.block_size != 64 or qp.shape[2] // pk.shape[2] > MAX_GROUP:
            raise NotImplementedError(f"the Mosaic GPU InfiniGen selector takes <= {PARTIAL_DIM} partial dims, "
                                      f"64-token blocks and <= {MAX_GROUP} query heads per KV head, got "
                                      f"{qp.shape[-1]}, {sparse.block_size} and {qp.shape[2] // pk.shape[2]}")
        qp, pk = jax.lax.stop_gradient((qp, pk))  # the block choice carries no gradient; the kernel has no JVP
        return infinigen_select(qp, pk, q_positions, sparse, head_dim=head_dim, n_blocks=n_blocks,
                                interpret=interpret_params(implementation))
    return run


def _triton_finalize(implementation: str, nb: int):
    """The Triton top-k as a `finalize` of the reference selectors; NotImplementedError outside
    its envelope (a GPU, or the interpreter; rows of <= MAX_BLOCKS blocks)."""
    from .topk_triton import MAX_BLOCKS, finalize_topk_triton

    if implementation == "triton" and jax.default_backend() != "gpu":
        raise NotImplementedError("the Triton top-k needs a GPU (or 'triton_interpret')")
    if nb > MAX_BLOCKS:
        raise NotImplementedError(f"the Triton top-k takes rows of <= {MAX_BLOCKS} blocks, got {nb}")
    return functools.partial(finalize_topk_triton, interpret=implementation == "triton_interpret")


def _triton(implementation: str):
    """The reference selectors' scoring in XLA, their top-k stage in one Triton kernel."""
    def infllmv2(q, kc, q_positions, sparse, *, kc_coarse, n_blocks, q_chunk):
        return select_blocks_infllmv2_reference(q, kc, q_positions, sparse, kc_coarse=kc_coarse, n_blocks=n_blocks,
                                                q_chunk=q_chunk, finalize=_triton_finalize(implementation, n_blocks))

    def forecast(f, kc, q_positions, sparse, *, n_blocks, q_chunk):
        return select_blocks_forecast_reference(f, kc, q_positions, sparse, n_blocks=n_blocks, q_chunk=q_chunk,
                                                finalize=_triton_finalize(implementation, n_blocks))

    def infinigen(qp, pk, q_positions, sparse, *, head_dim, n_blocks, q_chunk, kernel_dtype):
        return select_blocks_infinigen_reference(qp, pk, q_positions, sparse, head_dim=head_dim, n_blocks=n_blocks,
                                                 q_chunk=q_chunk, finalize=_triton_finalize(implementation, n_blocks))

    return infllmv2, forecast, infinigen


for _name in ("triton", "triton_interpret"):
    for _registry, _fn in zip((INFLLMV2_BACKENDS, FORECAST_BACKENDS, INFINIGEN_BACKENDS), _triton(_name)):
        _registry.register(_name)(_fn)

for _name in ("mosaic_gpu", "mosaic_gpu_interpret"):
    INFLLMV2_BACKENDS.register(_name)(_infllmv2_mosaic(_name))
    FORECAST_BACKENDS.register(_name)(_forecast_mosaic(_name))
    INFINIGEN_BACKENDS.register(_name)(_infinigen_mosaic(_name))


def select_blocks_infllmv2(q, kc, q_positions, sparse: SparseConfig, *, kc_coarse=None,
                           n_blocks: int | None = None, q_chunk: int = 128,
                           implementation: str | None = None) -> jax.Array:
    """InfLLM-V2 selection from the true queries. q [B, Tq, H, D], kc [B, N_c, K, D],
    q_positions int [B, Tq] -> int32 [B, K, Tq, sparse.topk] (ascending, -1 padded).
    Exact LSE unless `kc_coarse` is given (`reference.infllmv2_chunk_scores`);
    `sparse.exact_lse=False` without kc_coarse is a ValueError. n_blocks: the row length
    (default `n_blocks_for(N_c)`). implementation: see the module docstring.
    Raises TypeError if sparse is not a SparseConfig; ValueError for mismatched shapes (H must
    be a multiple of K)."""
    nb = check_infllmv2(q, kc, q_positions, sparse, kc_coarse, n_blocks)
    return INFLLMV2_BACKENDS(implementation, default_order(q), q, kc, q_positions, sparse, kc_coarse=kc_coarse,
                             n_blocks=nb, q_chunk=q_chunk)


def select_blocks_forecast(f, kc, q_positions, sparse: SparseConfig, *, n_blocks: int | None = None,
                           q_chunk: int = 512, implementation: str | None = None) -> jax.Array:
    """SparDA selection from the Forecast. f [B, Tq, K, D] (one head per KV head), kc
    [B, N_c, K, D], q_positions int [B, Tq] -> int32 [B, K, Tq, sparse.topk].
    implementation: see the module docstring. Raises TypeError if sparse is not a SparseConfig."""
    _check_sparse(sparse)
    _check_forecast(f, kc, q_positions)
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)
    return FORECAST_BACKENDS(implementation, default_order(f), f, kc, q_positions, sparse, n_blocks=nb,
                             q_chunk=q_chunk)


def select_blocks_nosa(q, kc, cis_c, q_positions, sparse: SparseConfig, *, n_blocks: int | None = None,
                       q_chunk: int = 128, implementation: str | None = None) -> jax.Array:
    """NOSA's two stages. Query-aware: the InfLLM-V2 selection with budget
    `sparse.nosa_qk_topk` (forced blocks included; `implementation` is its backend);
    query-agnostic: `reference.nosa_refine` (XLA). -> int32 [B, K, Tq, sparse.topk]."""
    _check_sparse(sparse)
    _check(q, kc, q_positions, "H")
    if sparse.nosa_qk_topk is None:
        raise ValueError("select_blocks_nosa needs sparse.nosa_qk_topk")
    nb = n_blocks or n_blocks_for(kc.shape[1], sparse)
    stage1 = dataclasses.replace(sparse, topk=sparse.nosa_qk_topk)
    qk_ids = select_blocks_infllmv2(q, kc, q_positions, stage1, n_blocks=nb, q_chunk=q_chunk,
                                    implementation=implementation)
    return nosa_refine(qk_ids, cis_c, q_positions, sparse, n_blocks=nb, q_chunk=q_chunk)


def select_blocks_infinigen(qp, pk, q_positions, sparse: SparseConfig, *, head_dim: int, n_blocks: int | None = None,
                            q_chunk: int = 64, implementation: str | None = None, kernel_dtype=None) -> jax.Array:
    """InfiniGen's selection from speculated token scores. qp [B, Tq, H, r] partial queries, pk
    [B, S, K, r] partial keys, q_positions int [B, Tq] -> int32 [B, K, Tq, sparse.topk]
    (`reference.infinigen_chunk_scores`). "xla" scores in f32; a Mosaic backend rounds qp and pk
    to kernel_dtype (None: qp's dtype), which must be bf16/f16 (the model's compute dtype).
    implementation: see the module docstring."""
    _check_sparse(sparse)
    nb = n_blocks or -(-pk.shape[1] // sparse.block_size)
    return INFINIGEN_BACKENDS(implementation, default_order(qp), qp, pk, q_positions, sparse, head_dim=head_dim,
                              n_blocks=nb, q_chunk=q_chunk, kernel_dtype=kernel_dtype)
