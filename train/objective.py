"""The Forecast's training objective over a whole model, and the train state and step.

Only the Forecast trains. The backbone runs under `stop_gradient` (nothing upstream of the
Forecast depends on its parameters, so no backward pass goes through the backbone), and each
layer's loss is computed inside the layer scan by a `tap` (`sparda_jax.modes.LayerView`), so
memory holds one layer's queries and keys at a time, not L of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, PartitionSpec as P

from sparda_jax.config import ConfigError, ModelConfig, check_float, check_instance, check_int
from sparda_jax.forecast import forecast_from_hidden
from sparda_jax.losses import layer_loss
from sparda_jax.modes import MODES, LayerView, forward

__all__ = ["ForecastLossTap", "TrainConfig", "check_run_settings", "TrainState", "forecast_loss", "make_optimizer", "init_state",
           "mean_grads", "train_step"]


@dataclasses.dataclass(frozen=True)
class ForecastLossTap:
    """Per layer: the partition KL of the Forecast that selects this layer (F0_cur on h at layer
    0, else F_{l-1} on the previous layer's state that `config.forecast.source` names) against
    this layer's teacher. Returns (KL summed over rows, rows)."""

    config: ModelConfig
    dtype: str = "float32"
    q_chunk: int = 256

    def __post_init__(self):
        check_instance("ForecastLossTap", "config", self.config, ModelConfig)
        check_instance("ForecastLossTap", "dtype", self.dtype, str)
        check_int("ForecastLossTap", "q_chunk", self.q_chunk, lo=1)

    def __call__(self, view: LayerView):
        source = self.config.forecast.source
        prev = {"prev_input": view.h_prev, "prev_mid": view.mid_prev, "own_input": view.h}[source]
        f = forecast_from_hidden(jnp.where(view.first, view.h, prev), view.sel, view.cos, view.sin,
                                 jnp.dtype(self.dtype))
        return layer_loss(f, view.q, view.k, view.positions, self.config.sparse, self.config.forecast,
                          q_chunk=self.q_chunk)


def forecast_loss(forecast, backbone, tokens, config: ModelConfig, *, dtype="float32", backbone_mode="dense",
                  q_chunk: int = 256):
    """Sum over layers of the mean partition KL per supervised row. tokens int [B, T].
    Returns (loss, per-layer mean KL [L])."""
    backbone = jax.lax.stop_gradient(backbone)
    tap = ForecastLossTap(config, jnp.dtype(dtype).name, q_chunk)
    _, aux = forward(backbone, tokens, config, mode=backbone_mode, forecast=forecast, dtype=dtype, tap=tap,
                     return_logits=False)
    kl, rows = aux["tap"]
    per_layer = kl / jnp.maximum(rows, 1).astype(jnp.float32)
    return jnp.sum(per_layer), per_layer


def check_run_settings(c: str, cfg) -> None:
    """The checks a run's config shares (`TrainConfig`, `train.finetune.FinetuneConfig`): its
    sizes (seq_len, batch, micro_batch dividing batch, steps), seed, optimizer numbers (lr, eps,
    clip, weight_decay, b1, b2) and dtype (float32 or bfloat16). Raises ConfigError naming `c`."""
    for name in ("seq_len", "batch", "micro_batch", "steps"):
        check_int(c, name, getattr(cfg, name), lo=1)
    check_int(c, "seed", cfg.seed, lo=0, hi=2**32 - 1)
    check_float(c, "lr", cfg.lr, lo=0, lo_open=True)
    check_float(c, "eps", cfg.eps, lo=0, lo_open=True)
    check_float(c, "clip", cfg.clip, lo=0, lo_open=True)
    check_float(c, "weight_decay", cfg.weight_decay, lo=0)
    for name in ("b1", "b2"):
        check_float(c, name, getattr(cfg, name), lo=0, hi=1, hi_open=True)
    if cfg.batch % cfg.micro_batch:
        raise ConfigError(f"{c}.batch: ({cfg.batch}) must be a multiple of micro_batch ({cfg.micro_batch})")
    if not isinstance(cfg.dtype, str) or cfg.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"{c}.dtype: must be float32 or bfloat16, got {cfg.dtype!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The paper's recipe by default (docs/algorithm.md, "Training the Forecast"): AdamW, constant lr 5e-4, weight decay
    0.01, betas (0.9, 0.95), eps 1e-6, grad-norm clip 0.5, effective batch 32, 2000 steps, bf16."""

    seq_len: int = 4096
    batch: int = 32
    micro_batch: int = 4
    steps: int = 2000
    lr: float = 5e-4
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-6
    clip: float = 0.5
    dtype: str = "bfloat16"
    backbone_mode: str = "dense"
    q_chunk: int = 256
    seed: int = 0

    def __post_init__(self):
        check_run_settings("TrainConfig", self)
        check_int("TrainConfig", "q_chunk", self.q_chunk, lo=1)
        if not isinstance(self.backbone_mode, str) or self.backbone_mode not in MODES:
            raise ConfigError(f"TrainConfig.backbone_mode: must be one of {MODES}, got {self.backbone_mode!r}")

    @property
    def accumulation(self) -> int:
        return self.batch // self.micro_batch


def make_optimizer(tc) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; tc: a `TrainConfig` or anything with its clip, lr, b1, b2,
    eps and weight_decay (`train.finetune.FinetuneConfig`)."""
    return optax.chain(
        optax.clip_by_global_norm(tc.clip),
        optax.adamw(tc.lr, b1=tc.b1, b2=tc.b2, eps=tc.eps, weight_decay=tc.weight_decay),
    )


class TrainState(struct.PyTreeNode):
    step: jax.Array
    forecast: dict  # float32 master parameters
    opt_state: optax.OptState


def init_state(forecast, tc: TrainConfig) -> TrainState:
    # a copy: train_step donates the state, and the caller may still hold these arrays
    forecast = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), forecast)
    return TrainState(jnp.zeros((), jnp.int32), forecast, make_optimizer(tc).init(forecast))


def mean_grads(value_and_grad, params, backbone, batch, zero_aux, *, mesh: Mesh | None = None):
    """(loss, aux, grads) of value_and_grad(params, backbone, tokens) -> ((loss, aux), grads),
    averaged over the micro-batches of batch int [accumulation, micro_batch, T].

    With a mesh of more than one device, each device runs its share of every micro-batch (the
    'data' axis of the mesh splits the micro-batch axis) under `shard_map`, so every op, the
    Mosaic kernels included, runs on local rows, and the averages are then averaged across
    devices (`pmean`): equal to one device's for any micro-batch the mesh splits evenly, since
    every row carries the same weight in the loss. params and backbone are replicated."""
    def local(params, backbone, batch):
        def micro(acc, tokens):
            (loss, aux), g = value_and_grad(params, backbone, tokens)
            return jax.tree.map(jnp.add, acc, (loss, aux, g)), None

        zero = (jnp.float32(0), zero_aux, jax.tree.map(jnp.zeros_like, params))
        total, _ = jax.lax.scan(micro, zero, batch)
        return jax.tree.map(lambda x: x / batch.shape[0], total)

    if mesh is None or mesh.size == 1:
        return local(params, backbone, batch)
    if batch.shape[1] % mesh.size:
        raise ValueError(f"micro_batch ({batch.shape[1]}) must be a multiple of the mesh's {mesh.size} devices")
    # check_vma off: the model's scans start their carries from constants, which the varying-axes
    # check would have to be told about op by op; the gradient is taken inside, per device
    sharded = jax.shard_map(lambda p, b, t: jax.lax.pmean(local(p, b, t), "data"), mesh=mesh,
                            in_specs=(P(), P(), P(None, "data", None)), out_specs=P(), check_vma=False)
    return sharded(params, backbone, batch)


@functools.partial(jax.jit, static_argnames=("config", "tc", "mesh"), donate_argnames=("state",))
def train_step(state: TrainState, backbone, batch, *, config: ModelConfig, tc: TrainConfig, mesh: Mesh | None = None):
    """batch int [accumulation, micro_batch, T] -> (new state, metrics). Gradients are averaged
    over the micro-batches (every micro-batch has the same number of supervised rows); mesh:
    the data-parallel mesh whose 'data' axis splits each micro-batch (`mean_grads`)."""
    loss_fn = functools.partial(forecast_loss, config=config, dtype=tc.dtype, backbone_mode=tc.backbone_mode,
                                q_chunk=tc.q_chunk)
    grad_fn = jax.value_and_grad(lambda f, b, t: loss_fn(f, b, t), has_aux=True)
    loss, per_layer, grads = mean_grads(grad_fn, state.forecast, backbone, batch,
                                        jnp.zeros((config.num_layers,), jnp.float32), mesh=mesh)
    updates, opt_state = make_optimizer(tc).update(grads, state.opt_state, state.forecast)
    forecast = optax.apply_updates(state.forecast, updates)
    metrics = {"loss": loss, "kl_per_layer": per_layer, "grad_norm": optax.tree.norm(grads)}
    return TrainState(state.step + 1, forecast, opt_state), metrics
