"""The training driver behind `sparda train`: data, mesh, loop, logging, checkpoints, export."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from sparda_jax.api import Pretrained
from sparda_jax.forecast import init_forecast
from sparda_jax.io.forecast_file import load_forecast, save_forecast
from sparda_jax.metrics import block_recall
from sparda_jax.modes import forward
from sparda_jax.text import haystack_from_tokens, haystack_tokens

from .augment import MixedSampler, RetrievalMix
from .checkpoint import Checkpointer
from .data import WindowSampler, is_shard_dir, load_documents, token_stream
from .objective import TrainConfig, init_state, train_step

__all__ = ["make_mesh", "shard_batch", "train", "eval_recall", "plot_metrics", "TrainingData", "training_data",
           "held_out_tokens", "run_record", "run_steps", "place_run", "step_batch"]


def make_mesh(data_devices: int | None = None, *, micro_batch: int | None = None) -> Mesh:
    """A 1-D data-parallel mesh over the first `data_devices` devices (all by default; across
    hosts after `jax.distributed.initialize()`). micro_batch: ValueError unless it splits evenly
    over the mesh."""
    devices = jax.devices()
    n = len(devices) if data_devices is None else data_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"mesh needs 1..{len(devices)} devices, asked for {n}")
    if micro_batch is not None and micro_batch % n:
        raise ValueError(f"micro_batch ({micro_batch}) must be a multiple of the data devices ({n})")
    return Mesh(np.asarray(devices[:n]), ("data",))


def shard_batch(mesh: Mesh, local: np.ndarray, global_shape: tuple[int, ...]) -> jax.Array:
    """[accumulation, micro_batch, T] with the micro-batch axis split over 'data'. Each process
    passes its own rows (all of them in a single-process run)."""
    sharding = NamedSharding(mesh, P(None, "data", None))
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def eval_recall(backbone, forecast, tokens, config, dtype) -> float:
    """Block recall (content blocks) of the Forecast's selection against each layer's own
    InfLLM-V2 choice, over all layers, on one sequence."""
    _, aux = forward(backbone, tokens, config, mode="sparda", forecast=forecast, dtype=dtype,
                     collect_selection=True)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    ids = jnp.moveaxis(aux["ids"], 0, 1).reshape(tokens.shape[0], -1, *aux["ids"].shape[3:])
    oracle = jnp.moveaxis(aux["oracle"], 0, 1).reshape(ids.shape)
    # layers folded into the KV-head axis: the recall is micro-averaged over both
    return float(block_recall(ids, oracle, pos, config.sparse))


def plot_metrics(jsonl: Path, png: Path, *, loss_label: str = "partition KL, summed over layers",
                 eval_keys: tuple[str, ...] = ("recall",), eval_label: str = "block recall vs InfLLM-V2",
                 eval_title: str = "held-out recall", eval_ylim: tuple[float, float] | None = (0, 1)) -> None:
    """Two panels from a run's metrics.jsonl: "loss" per step, and the evaluated keys (one line
    each) at the steps that have them."""
    # a Figure without pyplot: no backend is chosen, so a caller's (a notebook's) stays as it is
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    fig = Figure(figsize=(10, 3.6))
    ax = fig.subplots(1, 2)
    steps = [r["step"] for r in rows]
    ax[0].plot(steps, [r["loss"] for r in rows], lw=1)
    ax[0].set(xlabel="step", ylabel=loss_label, title="training loss")
    for key in eval_keys:
        ev = [r for r in rows if r.get(key) is not None]
        ax[1].plot([r["step"] for r in ev], [r[key] for r in ev], marker="o", label=key)
    ax[1].set(xlabel="step", ylabel=eval_label, title=eval_title)
    if eval_ylim is not None:
        ax[1].set_ylim(*eval_ylim)
    if len(eval_keys) > 1:
        ax[1].legend()
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# settings that may change on resume without changing what a step computes
_FREE = {"train.steps"}
# settings added after runs were recorded, with the value a record without them had
_ADDED = {"sparse.dense_layers": []}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def run_record(path: Path, settings: dict, step: int, *, override: bool) -> dict:
    """The run's config.json content: `settings` (JSON-ready), plus the overrides of earlier
    resumes and, where a resumed run (step > 0) changes a setting, one more entry {"step",
    "changed": {setting: [old, new]}}. A setting under "train.steps" may change freely (a run may
    be lengthened). Raises ValueError for any other change without override."""
    settings = json.loads(json.dumps(settings))  # as the record holds them: tuples become lists
    if step == 0 or not path.exists():
        return settings | {"overrides": []}
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: the run's record is unreadable ({e}); resume needs it") from None
    before, now = _flat({k: old[k] for k in settings if k in old}), _flat(settings)
    before |= {k: v for k, v in _ADDED.items() if k.split(".")[0] in old and k not in before}
    changed = {k: [before[k], v] for k, v in now.items() if k in before and before[k] != v and k not in _FREE}
    overrides = list(old.get("overrides", []))
    if changed:
        if not override:
            what = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"{path.parent}: resuming at step {step} with settings that differ from the run's "
                             f"record ({what}); pass --override to go on with the new ones (the change is "
                             f"recorded), or train into another --out")
        overrides.append({"step": step, "changed": changed})
    return settings | {"overrides": overrides}


class TrainingData(NamedTuple):
    """A run's training text: the token stream, the sampler of its windows (`batch(step, n)`),
    and the stream's record for config.json ({"tokens", "sha256"})."""

    stream: np.ndarray
    sampler: Any
    record: dict


def training_data(model: Pretrained, seq_len: int, seed: int, data_paths=None,
                  mix: RetrievalMix = RetrievalMix()) -> TrainingData:
    """The training windows of `train` and `finetune`: a token corpus's `train` split when
    data_paths is its directory, else the text files given (default: the Python docs' training
    split), in windows of seq_len tokens drawn by `WindowSampler`, a share of them rewritten by
    `mix`. Raises ValueError without a tokenizer or for too little text, ConfigError (a
    ValueError) for a mix that does not fit seq_len, TypeError for a mix of another type."""
    if not isinstance(mix, RetrievalMix):
        raise TypeError(f"mix must be a RetrievalMix, got {type(mix).__name__}")
    mix.check_fits(seq_len)
    tok = model.tokenizer
    if tok is None:
        raise ValueError("training needs the model's tokenizer")
    stream = token_stream(data_paths, tok, list(model.config.eos_token_ids[:1]))
    sampler = WindowSampler(stream, seq_len, seed)
    if mix.active:
        sampler = MixedSampler(sampler, mix)
    return TrainingData(stream, sampler, {"tokens": int(stream.size),
                                          "sha256": hashlib.sha256(stream.tobytes()).hexdigest()})


def held_out_tokens(model: Pretrained, n_tokens: int, *, seed: int, data_paths=None, count: int = 1,
                    log=print) -> jax.Array:
    """int32 [count, n_tokens] of held-out text for a run's evaluations: windows of a token
    corpus's `heldout` split (its training domains) when data_paths is its directory and the
    split holds enough text, else of the Python docs' eval split. Window i is drawn with seed
    seed + i."""
    c, tok = model.config, model.tokenizer
    held_docs = None
    if is_shard_dir(data_paths):
        from sparda_jax.eval.heldout import corpus_texts

        try:
            held_docs = corpus_texts(data_paths[0], ["heldout"], vocab_size=c.vocab_size)[0].docs
            rows = [haystack_from_tokens(held_docs, n_tokens, seed=seed + i) for i in range(count)]
        except ValueError as e:  # no heldout split, or too short: the default text instead
            log(f"held-out text from the Python docs: {e}")
            held_docs = None
    if held_docs is None:
        docs = load_documents(None, "eval")
        rows = [haystack_tokens(tok.encode, n_tokens, seed=seed + i, docs=docs) for i in range(count)]
    return jnp.asarray(np.stack([np.asarray(r, np.int32) for r in rows]), jnp.int32)


def place_run(model: Pretrained, state, dtype, mesh: Mesh, ckpt: Checkpointer, log=print) -> tuple:
    """(the frozen backbone in `dtype`, the train state) replicated on the mesh, the state
    restored from the newest checkpoint when there is one."""
    replicated = NamedSharding(mesh, P())
    backbone = jax.device_put(jax.tree.map(lambda a: a.astype(dtype), model.params), replicated)
    state = jax.device_put(state, replicated)
    restored = ckpt.restore(state)
    if restored is not None:
        state = restored
        log(f"resumed from step {int(state.step)}")
    return backbone, state


def step_batch(data: TrainingData, mesh: Mesh, step: int, *, batch: int, micro_batch: int, seq_len: int) -> jax.Array:
    """Step `step`'s windows as [batch // micro_batch, micro_batch, seq_len] on the mesh, of which
    this process reads its share of each micro-batch (the same windows on every process count)."""
    shape = (batch // micro_batch, micro_batch, seq_len)
    per_proc = micro_batch // jax.process_count()
    first = jax.process_index() * per_proc
    rows = data.sampler.batch(step, batch).reshape(shape)[:, first:first + per_proc]
    return shard_batch(mesh, rows, shape)


def run_steps(state, step_fn: Callable, evaluate: Callable, *, start: int, steps: int, tokens_per_step: int,
              eval_every: int, ckpt: Checkpointer, metrics_path: Path, progress: bool = True):
    """The loop of `train` and `finetune` over steps [start, steps).

    step_fn(state, step) -> (state, metrics): one step, done when it returns (its metrics are
    Python numbers); evaluate(state) -> {name: number}: every eval_every steps and at the first
    and last step (eval_every 0: never). Writes one line per step to metrics_path ({"step":
    step + 1, **metrics, "tokens_per_s", **evaluation}), after dropping the lines past `start`
    that an interrupted run left, and saves a checkpoint on ckpt's schedule and at the last step.
    Returns (state, the last line with the latest evaluation's values)."""
    if start == 0 and metrics_path.exists():
        metrics_path.unlink()
    # a resumed run keeps the lines up to its checkpoint and drops those after it
    if metrics_path.exists():
        kept = [l for l in metrics_path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= start]
        metrics_path.write_text("".join(k + "\n" for k in kept))
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="train", disable=not progress)
    last, evaluated = {}, {}
    with open(metrics_path, "a") as mf:
        for step in bar:
            t0 = time.perf_counter()
            state, metrics = step_fn(state, step)
            rec = {"step": step + 1, **metrics, "tokens_per_s": tokens_per_step / (time.perf_counter() - t0)}
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps or step == start):
                evaluated = evaluate(state)
                rec.update(evaluated)
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            last = rec | evaluated
            bar.set_postfix(loss=f"{rec['loss']:.4f}", **{k: f"{v:.3f}" for k, v in evaluated.items()},
                            tok_s=f"{rec['tokens_per_s']:.0f}")
            ckpt.save(step + 1, state, force=step + 1 == steps)
    return state, last


def train(model: Pretrained, tc: TrainConfig, out_dir: str | Path, *, data_paths=None, data_devices=None,
          save_every: int = 100, keep: int = 3, eval_every: int = 50, eval_len: int | None = None,
          mix: RetrievalMix = RetrievalMix(), init_from: str | Path | None = None, override: bool = False,
          progress: bool = True, log=print) -> dict:
    """Train the Forecast of `model`; resumes from out_dir/checkpoints if present. Writes
    metrics.jsonl, metrics.png, forecast.safetensors and config.json under out_dir.
    eval_every: the held-out recall every this many steps and at the first and last step; 0:
    never. mix: the share of training windows given long-range copies (`train.augment`).
    init_from: a Forecast file to start from instead of a random one (a fresh optimizer; its
    sha256 is part of the run's record, as the model's merged adapter is: `Pretrained.adapter`).
    A resumed run must have the settings its config.json records (the step count aside: a run
    may be lengthened), else ValueError; override=True continues with the new settings and
    records the change and its step in config.json's "overrides"."""
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"eval_every must be an int >= 0 (0: never), got {eval_every!r}")
    c = model.config
    span = c.sparse.forced_blocks * c.sparse.block_size
    if tc.seq_len <= span:
        raise ValueError(f"seq_len {tc.seq_len} gives no supervision: every position within "
                         f"{span} tokens of a query is a forced (init or local) block")
    data = training_data(model, tc.seq_len, tc.seed, data_paths, mix)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    held_out = held_out_tokens(model, eval_len or min(tc.seq_len, 8192), seed=tc.seed + 7, data_paths=data_paths,
                               log=log)
    init = None
    if init_from is not None:
        init_from = Path(init_from)
        init = load_forecast(init_from, c)  # FileNotFoundError / CheckpointError before any work
        init_record = {"file": init_from.name, "sha256": hashlib.sha256(init_from.read_bytes()).hexdigest()}
    mesh = make_mesh(data_devices, micro_batch=tc.micro_batch)
    n_data = mesh.devices.size
    ckpt = Checkpointer(out / "checkpoints", save_every=save_every, keep=keep)
    # the record is checked before any work on the device: a refused resume costs nothing
    record = run_record(out / "config.json", {
        "model": c.name, "train": asdict(tc), "forecast": asdict(c.forecast), "sparse": asdict(c.sparse),
        "mix": asdict(mix), "data": data.record, "adapter": model.adapter}
        | ({"init": init_record} if init is not None else {}),
        ckpt.latest_step() or 0, override=override)
    dtype = jnp.dtype(tc.dtype)
    start_forecast = init if init is not None else init_forecast(c, jax.random.key(tc.seed))
    backbone, state = place_run(model, init_state(start_forecast, tc), dtype, mesh, ckpt, log)
    (out / "config.json").write_text(json.dumps(record | {"corpus_tokens": int(data.stream.size),
                                                          "data_devices": n_data}, indent=2))

    def step_fn(state, step):
        batch = step_batch(data, mesh, step, batch=tc.batch, micro_batch=tc.micro_batch, seq_len=tc.seq_len)
        state, m = train_step(state, backbone, batch, config=c, tc=tc, mesh=mesh)
        return state, {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),  # float(): waits for the step
                       "kl_per_layer": [round(float(x), 5) for x in np.asarray(m["kl_per_layer"])]}

    metrics_path = out / "metrics.jsonl"
    state, last = run_steps(state, step_fn, lambda s: {"recall": eval_recall(backbone, s.forecast, held_out, c, dtype)},
                            start=int(state.step), steps=tc.steps, tokens_per_step=tc.batch * tc.seq_len,
                            eval_every=eval_every, ckpt=ckpt, metrics_path=metrics_path, progress=progress)
    ckpt.wait()
    ckpt.close()
    export = save_forecast(out / "forecast.safetensors", state.forecast, c,
                           metadata={"steps": int(state.step), "train": asdict(tc), "teacher": asdict(c.forecast)})
    plot_metrics(metrics_path, out / "metrics.png")
    return {"steps": int(state.step), "final": last, "forecast": str(export), "metrics": str(metrics_path)}
