"""LoRA fine-tuning of a backbone under InfLLM-V2 sparse attention (`sparda finetune`).

A model trained with dense attention loses text it can no longer see when it runs sparse (mode
"sparse": each layer attends only to the blocks its own queries select). Fine-tuning it under
that mode teaches it to make do with what the selection keeps. The adapters sit on the attention
projections alone (q, k, v, o; `io.adapter_file.LoraConfig`): the sparse pattern changes what
attention sees, while the MLPs read the same kind of input as before and stay untouched.

The adapter is its own pytree ({target: {"a", "b"}}, float32 masters), merged into the frozen
backbone's weights before each forward (`io.adapter_file.merge_adapter`: W + alpha/r * A @ B),
so the model code is the same for training and inference. B starts at zero: step 0 is the base
model. The loss (`FinetuneConfig.objective`) is the next-token NLL of the merged model in mode
"sparse" on the training text, or ("distill") its KL divergence from the base model's own dense
next-token distribution, which keeps what the base model does with a prompt (an instruct model's
answers) while it learns to do it under sparse attention; raw documentation text alone teaches a
chat model to continue documentation. The gradient reaches the adapter through
`sparse_attention`'s custom VJP, while the block choice (a top-k) carries none.
`FinetuneConfig.dense_weight` mixes in the same term for the dense mode of the merged weights.
Since the top-k passes no gradient, `FinetuneConfig.select_weight` adds a term that trains the
selection itself: each layer's InfLLM-V2 scores (its queries against its compressed keys) are
pulled toward its own fine-grained attention (`losses.selection_alignment`), so the blocks the
sparse mode keeps are those the layer's attention would read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from sparda_jax.api import Pretrained
from sparda_jax.config import (ConfigError, Implementations, ModelConfig, SparseConfig, check_float,
                               check_instance, check_int)
from sparda_jax.io.adapter_file import LoraConfig, adapter_shapes, load_adapter, merge_adapter, save_adapter
from sparda_jax.losses import selection_alignment
from sparda_jax.modes import LayerView, forward

from .augment import RetrievalMix
from .checkpoint import Checkpointer
from .objective import check_run_settings, make_optimizer, mean_grads
from .run import held_out_tokens, make_mesh, place_run, plot_metrics, run_record, run_steps, step_batch, training_data

__all__ = ["FinetuneConfig", "OBJECTIVES", "AdapterState", "init_adapter", "token_nll", "token_kl", "copy_positions",
           "selection_rows", "SelectionTap", "finetune_loss", "init_adapter_state", "finetune_step", "heldout_nll", "finetune"]


OBJECTIVES = ("nll", "distill")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """The adapter (`lora`), the loss, the batch and the optimizer of a fine-tuning run.

    objective: "nll" (default) or "distill" (the KL from the base model's dense distribution;
    module docstring). dense_weight w in [0, 1]: the loss is (1 - w) * L_sparse + w * L_dense,
    L the objective's term for that mode of the merged weights. The merged weights serve the
    dense mode too (short prompts, the dense baseline the sparse mode is measured against): w > 0
    keeps that mode from drifting, and w = 1 is the control run that adapts to the data alone.
    w = 0 (default) skips the dense pass. copy_weight c >= 0 adds c times the sparse NLL of the
    tokens a long-range copy predicts (`copy_positions`: the token and the 8 before it occurred
    together at least 1024 tokens earlier), the retrieval the demo and the copy task ask for,
    which "distill" inherits only where the base model's dense mode retrieves. select_weight
    s >= 0 adds s times the mean over layers of `losses.selection_alignment` at `select_rows`
    query rows per sequence (`selection_rows`): the only term whose gradient reaches the block
    choice. select_layers: the layers that mean runs over (ascending, no repeats; empty: all), to
    aim the term where the choice costs most.
    Defaults: 60 steps of 8 sequences of 4096 tokens (a short first run; docs/finetune.md has
    the longer one), AdamW at a constant 5e-4 (betas 0.9 / 0.999, no weight decay), grad-norm
    clip 1, bf16 compute. `steps` is left out of equality and
    hash: a step computes the same whatever the run's length, so a lengthened run reuses the
    compiled step.
    """

    lora: LoraConfig = LoraConfig()
    objective: str = "nll"
    dense_weight: float = 0.0
    copy_weight: float = 0.0
    select_weight: float = 0.0
    select_rows: int = 256
    select_layers: tuple[int, ...] = ()
    seq_len: int = 4096
    batch: int = 8
    micro_batch: int = 8
    steps: int = dataclasses.field(default=60, compare=False)
    lr: float = 5e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip: float = 1.0
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        c = "FinetuneConfig"
        check_instance(c, "lora", self.lora, LoraConfig)
        check_float(c, "dense_weight", self.dense_weight, lo=0, hi=1)
        check_float(c, "copy_weight", self.copy_weight, lo=0)
        check_float(c, "select_weight", self.select_weight, lo=0)
        check_int(c, "select_rows", self.select_rows, lo=1)
        layers = self.select_layers
        if (not isinstance(layers, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
                or list(layers) != sorted(set(layers))):
            raise ConfigError(f"{c}.select_layers: must be a tuple of ascending layer indices >= 0 without repeats "
                              f"(empty: all layers), got {layers!r}")
        if layers and self.select_weight == 0:
            raise ConfigError(f"{c}.select_layers: given without select_weight > 0; the term it aims is off")
        if not isinstance(self.objective, str) or self.objective not in OBJECTIVES:
            raise ConfigError(f"{c}.objective: must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        check_run_settings(c, self)

    @property
    def accumulation(self) -> int:
        return self.batch // self.micro_batch


@functools.partial(jax.jit, static_argnames=("config", "lora"))
def init_adapter(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
    """A fresh adapter, float32: A ~ N(0, 1 / in) (in: the projection's fan-in), B = 0, so the
    merged model equals the base model."""
    out = {}
    for t, shapes in adapter_shapes(config, lora).items():
        key, sub = jax.random.split(key)
        a = shapes["a"]
        out[t] = {"a": jax.random.normal(sub, a, jnp.float32) / math.sqrt(a[1]),
                  "b": jnp.zeros(shapes["b"], jnp.float32)}
    return out


def token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """logits [B, T, V], tokens int [B, T] -> float32 [B, T - 1]: -log p(tokens[:, t + 1] | the
    tokens up to t)."""
    z = logits[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(z, tokens[:, 1:, None], axis=-1)[..., 0]
    return jax.nn.logsumexp(z, axis=-1) - picked


COPY_NGRAM = 8     # a copied token continues a run of this many tokens seen before
COPY_MIN_GAP = 1024  # that far back at least (beyond the local window: retrieval, not recency)
_HASH = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09,
         0x7FEB352D)  # odd multipliers of a wrapping uint32 hash of the COPY_NGRAM + 1 tokens


def copy_positions(tokens: jax.Array, *, n: int = COPY_NGRAM, min_gap: int = COPY_MIN_GAP) -> jax.Array:
    """tokens int [B, T] -> bool [B, T - 1]: prediction t (of tokens[:, t + 1]) is a copy when the
    n + 1 tokens ending at t + 1 occurred, in the same order, ending at least min_gap positions
    earlier. n + 1 tokens are hashed to uint32 (a collision marks an ordinary token: harmless)."""
    if n + 1 > len(_HASH):
        raise ValueError(f"n must be at most {len(_HASH) - 1}, got {n}")
    b, t = tokens.shape
    x = tokens.astype(jnp.uint32)
    h = jnp.zeros((b, t), jnp.uint32)
    for i in range(n + 1):  # h[e] = sum_i tokens[e - i] * C_i  (mod 2^32)
        h = h + jnp.pad(x, ((0, 0), (i, 0)))[:, :t] * jnp.uint32(_HASH[i])
    pos = jnp.arange(t, dtype=jnp.int32)

    short = pos < n  # windows cut by the sequence's start: grouped apart from the full ones

    def first_seen(hr):  # per position: the first position of its group (the same hash, both full)
        order = jnp.lexsort((pos, hr, short))
        hs, ss = hr[order], short[order]
        change = (hs[1:] != hs[:-1]) | (ss[1:] != ss[:-1])
        group = jnp.cumsum(jnp.concatenate([jnp.zeros(1, jnp.int32), change.astype(jnp.int32)]))
        first = jax.ops.segment_min(pos[order], group, num_segments=t)[group]
        return jnp.zeros(t, jnp.int32).at[order].set(first)

    first = jax.vmap(first_seen)(h)
    copied = ~short[None, :] & (first <= pos[None, :] - min_gap)
    return copied[:, 1:]


def selection_rows(seq_len: int, sparse: SparseConfig, count: int) -> tuple[int, ...]:
    """`count` query positions spread evenly over those with a block left to choose: from the
    first position past the init, local and own blocks to the sequence's end. ValueError when
    fewer than `count` positions are there."""
    first = (sparse.init_blocks + sparse.local_blocks + 1) * sparse.block_size
    if seq_len - first < count:
        raise ValueError(f"select_rows {count}: a {seq_len}-token window has {max(0, seq_len - first)} positions "
                         f"past its forced blocks")
    return tuple(first + (i * (seq_len - first)) // count for i in range(count))


@dataclasses.dataclass(frozen=True)
class SelectionTap:
    """Per layer: `losses.selection_alignment` of the layer's queries at `rows` against its keys,
    the teacher on the fine (2, 1) grid; returns (sum of KL, rows with supervision)."""

    config: ModelConfig
    rows: tuple[int, ...]

    def __call__(self, view: LayerView):
        idx = jnp.asarray(self.rows, jnp.int32)
        fine = dataclasses.replace(self.config.forecast, teacher_kernel_size=2, teacher_kernel_stride=1)
        return selection_alignment(view.q[:, idx], view.k, view.positions[:, idx], self.config.sparse, fine)


def _parts(fc: FinetuneConfig) -> tuple[str, ...]:
    modes = ("sparse", "dense") if fc.dense_weight > 0 else ("sparse",)
    extra = (("nll_copy",) if fc.copy_weight > 0 else ()) + (("select_kl",) if fc.select_weight > 0 else ())
    if fc.objective == "nll":
        return tuple(f"nll_{m}" for m in modes) + extra
    return tuple(f"kl_{m}" for m in modes) + ("nll_sparse",) + extra


def token_kl(teacher_logits, logits):
    """[B, T, V] each -> float32 [B, T]: KL(softmax(teacher) || softmax(logits)) per position."""
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(t) * (t - jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)), axis=-1)


def finetune_loss(adapter: dict, backbone: dict, tokens: jax.Array, *, config: ModelConfig, fc: FinetuneConfig,
                  implementations: Implementations = Implementations()):
    """(1 - w) * L_sparse + w * L_dense (+ fc.copy_weight * the sparse NLL at `copy_positions`,
    + fc.select_weight * the sparse pass's mean `selection_alignment` over fc.select_layers (all: empty);
    w = fc.dense_weight, the dense pass only when w > 0) of
    the backbone with the adapter merged in, computed in fc.dtype, each term a mean over all
    B * (T - 1) next-token predictions: the NLL of tokens[:, 1:] ("nll"), or the KL from the
    base backbone's dense distribution ("distill"). tokens int [B, T]; implementations: the ops'
    backends (`modes.forward`). Returns (loss, {part: float32 scalar} for `_parts(fc)`;
    "distill" also reports the sparse NLL)."""
    params = merge_adapter(backbone, adapter, fc.lora)
    dtype = jnp.dtype(fc.dtype)
    run = lambda p, mode: forward(p, tokens, config, mode=mode, dtype=dtype, implementations=implementations)
    modes = ("sparse", "dense") if fc.dense_weight > 0 else ("sparse",)
    logits = {m: run(params, m) for m in modes if m != "sparse" or fc.select_weight == 0}
    if fc.select_weight > 0:
        tap = SelectionTap(config, selection_rows(tokens.shape[1], config.sparse, fc.select_rows))
        logits["sparse"], aux = forward(params, tokens, config, mode="sparse", dtype=dtype,
                                        implementations=implementations, tap=tap)
        kl, rows = aux["tap"]  # [L] each
        per_layer = kl / jnp.maximum(rows, 1).astype(jnp.float32)
        select_kl = jnp.mean(per_layer[jnp.asarray(fc.select_layers)] if fc.select_layers else per_layer)
    nll_modes = modes if fc.objective == "nll" else ("sparse",)
    nll = {m: token_nll(logits[m], tokens) for m in nll_modes}
    parts = {f"nll_{m}": jnp.mean(v) for m, v in nll.items()}
    if fc.copy_weight > 0:
        mask = copy_positions(tokens)
        parts["nll_copy"] = jnp.sum(jnp.where(mask, nll["sparse"], 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    if fc.objective == "distill":
        teacher = jax.lax.stop_gradient(run(backbone, "dense")[:, :-1])
        parts |= {f"kl_{m}": jnp.mean(token_kl(teacher, logits[m][:, :-1])) for m in modes}
    term = "nll" if fc.objective == "nll" else "kl"
    w = fc.dense_weight
    loss = parts[f"{term}_sparse"] if w == 0 else (1 - w) * parts[f"{term}_sparse"] + w * parts[f"{term}_dense"]
    if fc.copy_weight > 0:
        loss = loss + fc.copy_weight * parts["nll_copy"]
    if fc.select_weight > 0:
        parts["select_kl"] = select_kl
        loss = loss + fc.select_weight * select_kl
    return loss, {k: parts[k] for k in _parts(fc)}


class AdapterState(struct.PyTreeNode):
    step: jax.Array
    adapter: dict  # float32 master parameters
    opt_state: optax.OptState


def init_adapter_state(adapter: dict, fc: FinetuneConfig) -> AdapterState:
    # a copy: finetune_step donates the state, and the caller may still hold these arrays
    adapter = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), adapter)
    return AdapterState(jnp.zeros((), jnp.int32), adapter, make_optimizer(fc).init(adapter))


@functools.partial(jax.jit, static_argnames=("config", "fc", "mesh"), donate_argnames=("state",))
def finetune_step(state: AdapterState, backbone: dict, batch: jax.Array, *, config: ModelConfig,
                  fc: FinetuneConfig, mesh: Mesh | None = None):
    """batch int [accumulation, micro_batch, T] -> (new state, metrics {"loss", "grad_norm",
    "nll_sparse"[, "nll_dense"]}). Only the adapter is differentiated and updated; gradients
    and losses are averaged over the micro-batches (each has the same number of predictions);
    mesh: the data-parallel mesh whose 'data' axis splits each micro-batch (`mean_grads`)."""
    grad_fn = jax.value_and_grad(functools.partial(finetune_loss, config=config, fc=fc), has_aux=True)
    loss, parts, grads = mean_grads(grad_fn, state.adapter, backbone, batch,
                                    {k: jnp.float32(0) for k in _parts(fc)}, mesh=mesh)
    updates, opt_state = make_optimizer(fc).update(grads, state.opt_state, state.adapter)
    adapter = optax.apply_updates(state.adapter, updates)
    return AdapterState(state.step + 1, adapter, opt_state), {"loss": loss, "grad_norm": optax.tree.norm(grads),
                                                               **parts}


def heldout_nll(params: dict, tokens: jax.Array, config: ModelConfig, dtype) -> dict:
    """Mean next-token NLL of tokens int [B, T] under the dense and the sparse mode, over all
    predictions and over those made from position T/2 on ("_late", `eval.selection`'s late
    half): {"heldout_dense", "heldout_sparse", "heldout_dense_late", "heldout_sparse_late"} as
    Python floats."""
    out = {}
    for mode in ("dense", "sparse"):
        every, late = _mean_nll(forward(params, tokens, config, mode=mode, dtype=dtype), tokens)
        out[f"heldout_{mode}"], out[f"heldout_{mode}_late"] = float(every), float(late)
    return {k: out[k] for k in ("heldout_dense", "heldout_sparse", "heldout_dense_late", "heldout_sparse_late")}


_merge = jax.jit(merge_adapter, static_argnums=2)


@jax.jit
def _mean_nll(logits, tokens):
    nll = token_nll(logits, tokens)
    return jnp.mean(nll), jnp.mean(nll[:, tokens.shape[1] // 2:])


def finetune(model: Pretrained, fc: FinetuneConfig, out_dir: str | Path, *, data_paths=None, data_devices=None,
             save_every: int = 10, keep: int = 3, eval_every: int = 20, eval_len: int | None = None,
             eval_seqs: int = 2, mix: RetrievalMix = RetrievalMix(), init_from: str | Path | None = None,
             override: bool = False, progress: bool = True, log=print) -> dict:
    """Fine-tune a LoRA adapter of `model` under sparse attention; resumes from
    out_dir/checkpoints if present. Writes metrics.jsonl (per step: loss, its NLL parts,
    grad_norm, tokens/s; with an evaluation, `heldout_nll`'s four numbers), metrics.png,
    adapter.safetensors (`io.adapter_file`) and config.json under out_dir.

    Data (data_paths, mix), the held-out text (eval_seqs windows of eval_len tokens, default
    min(seq_len, 8192)), the mesh (data_devices), checkpoints (save_every, keep) and the resume
    rules (override) are `train.run.train`'s. eval_every: every this many steps and at the
    first and last step; 0: never. init_from: an adapter file of this model to start from
    instead of B = 0 (a fresh optimizer; its sha256 is part of the run's record), with fc.lora's
    rank, alpha and targets. Raises ValueError for a seq_len at which the model's sparse mode
    sees every block (or runs dense: below `sparse.dense_len`), for an init_from of another
    LoRA shape, and as `train` does.
    """
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"eval_every must be an int >= 0 (0: never), got {eval_every!r}")
    if isinstance(eval_seqs, bool) or not isinstance(eval_seqs, int) or eval_seqs < 1:
        raise ValueError(f"eval_seqs must be an int >= 1, got {eval_seqs!r}")
    if not isinstance(fc, FinetuneConfig):
        raise TypeError(f"fc must be a FinetuneConfig, got {type(fc).__name__}")
    c = model.config
    sp = c.sparse
    if fc.seq_len <= sp.topk * sp.block_size or fc.seq_len < sp.dense_len:
        raise ValueError(f"seq_len {fc.seq_len}: {c.name}'s sparse mode is dense there (a budget of {sp.topk} "
                         f"blocks of {sp.block_size} tokens, dense below {sp.dense_len} tokens); fine-tune on "
                         f"longer sequences")
    if fc.select_weight > 0:
        selection_rows(fc.seq_len, sp, fc.select_rows)  # ValueError before any work
    if fc.select_layers and fc.select_layers[-1] >= c.num_layers:
        raise ValueError(f"select_layers {fc.select_layers}: {c.name} has layers 0-{c.num_layers - 1}")
    init = None
    if init_from is not None:
        init_from = Path(init_from)
        init, lora = load_adapter(init_from, c)  # FileNotFoundError / CheckpointError before any work
        if lora != fc.lora:
            raise ValueError(f"{init_from}: an adapter of {lora}, the run's is {fc.lora}")
        init_record = {"file": init_from.name, "sha256": hashlib.sha256(init_from.read_bytes()).hexdigest()}
    data = training_data(model, fc.seq_len, fc.seed, data_paths, mix)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    held_out = held_out_tokens(model, eval_len or min(fc.seq_len, 8192), seed=fc.seed + 7, data_paths=data_paths,
                               count=eval_seqs, log=log)
    mesh = make_mesh(data_devices, micro_batch=fc.micro_batch)
    n_data = mesh.devices.size
    ckpt = Checkpointer(out / "checkpoints", save_every=save_every, keep=keep)
    # checked before any work on the device: a refused resume costs nothing
    record = run_record(out / "config.json", {
        "model": c.name, "train": asdict(fc), "sparse": asdict(sp), "mix": asdict(mix), "data": data.record,
        "adapter": model.adapter}
        | ({"init": init_record} if init is not None else {}), ckpt.latest_step() or 0, override=override)
    dtype = jnp.dtype(fc.dtype)
    start = init if init is not None else init_adapter(c, fc.lora, jax.random.key(fc.seed))
    backbone, state = place_run(model, init_adapter_state(start, fc), dtype, mesh, ckpt, log)
    (out / "config.json").write_text(json.dumps(record | {"corpus_tokens": int(data.stream.size),
                                                          "data_devices": n_data}, indent=2))

    def step_fn(state, step):
        batch = step_batch(data, mesh, step, batch=fc.batch, micro_batch=fc.micro_batch, seq_len=fc.seq_len)
        state, m = finetune_step(state, backbone, batch, config=c, fc=fc, mesh=mesh)
        return state, {k: float(v) for k, v in m.items()}  # float(): waits for the step

    def evaluate(state):
        return heldout_nll(_merge(backbone, state.adapter, fc.lora), held_out, c, dtype)

    metrics_path = out / "metrics.jsonl"
    state, last = run_steps(state, step_fn, evaluate, start=int(state.step), steps=fc.steps,
                            tokens_per_step=fc.batch * fc.seq_len, eval_every=eval_every, ckpt=ckpt,
                            metrics_path=metrics_path, progress=progress)
    ckpt.wait()
    ckpt.close()
    export = save_adapter(out / "adapter.safetensors", state.adapter, c, fc.lora,
                          metadata={"steps": int(state.step), "train": asdict(fc), "sparse": asdict(sp)})
    plot_metrics(metrics_path, out / "metrics.png", loss_label="next-token NLL (training windows)",
                 eval_keys=("heldout_dense", "heldout_sparse"), eval_label="NLL (nats / token)", eval_title="held-out NLL",
                 eval_ylim=None)
    return {"steps": int(state.step), "final": last, "adapter": str(export), "metrics": str(metrics_path)}
