"""The `sparda` command.

This is the one module that wires `sparda_jax.infer` and `sparda_jax.train` together; it
imports them inside the subcommands so that `sparda --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .config import COPY_STARTS, FORECAST_SOURCES
from .programs import enable_program_store
from .runtime import LAUNCH_QUEUE_SCALES, LAUNCH_QUEUES, enable_compilation_cache, set_launch_queues, write_result

__all__ = ["main"]

_DTYPES = ("float32", "bfloat16")



EVAL_MODES = ("dense", "sparse", "infinigen", "sparda")  # the eval tables' column order
EVAL_LENGTHS = (1024, 2048, 4096, 8192)  # SmolLM2: 1K..8K; the tasks suite caps the last at what fits
COPY_LENGTHS = (4096, 8192)


def _cta_count(s: str):
    if s == "auto":
        return s
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a CTA count is a positive integer or 'auto', got {s!r}")
    return n


def _layer_list(s: str) -> tuple[int, ...]:
    """"15-19" or "3,7,15-19" -> ascending layer indices without repeats."""
    out = set()
    try:
        for part in s.split(","):
            a, _, b = part.strip().partition("-")
            lo, hi = int(a), int(b or a)
            if lo < 0 or hi < lo:
                raise ValueError
            out.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers as 15-19 or 3,7,15-19 (indices >= 0), got {s!r}") from None
    return tuple(sorted(out))


def _positive_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}")
    return n


def _implementation(s: str) -> tuple[str, str]:
    """'OP=NAME' (a field of `Implementations` and one of its backends) -> (OP, NAME)."""
    from .config import IMPLEMENTATION_NAMES

    op, _, name = s.partition("=")
    if op not in IMPLEMENTATION_NAMES:
        raise argparse.ArgumentTypeError(f"{s!r}: OP=NAME with OP one of {', '.join(IMPLEMENTATION_NAMES)}")
    if name not in IMPLEMENTATION_NAMES[op]:
        raise argparse.ArgumentTypeError(f"{s!r}: {op}'s backends are {', '.join(IMPLEMENTATION_NAMES[op])}")
    return op, name


def _nonnegative_int(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {s!r}")
    return n


def _check_output(path, *, directory: bool = False) -> None:
    """Refuse (ValueError) an output path the command could not write, before any work: a file
    output that is an existing directory, a run directory that is an existing file, or a path
    whose nearest existing ancestor is not a writable directory (the parents are created)."""
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise ValueError(f"output {p} is an existing file; the run needs a directory")
        if not directory and p.is_dir():
            raise ValueError(f"output {p} is a directory; give a file path")
        if not os.access(p, os.W_OK | (os.X_OK if directory else 0)):
            raise ValueError(f"output {p} is not writable")
        return
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"output {p} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output {p} cannot be created: {parent} is not writable")


def _dense_layer_list(s: str) -> tuple[int, ...]:
    """--dense-layers: as _layer_list, or "none" for no dense layer."""
    return () if s.strip().lower() == "none" else _layer_list(s)


def _with_budget(model, topk: int | None, dense_layers: tuple[int, ...] | None = None):
    """The model with its block budget set to topk and its dense layers (`SparseConfig.dense_layers`)
    to dense_layers (None: the preset's). The budget counts the forced blocks (`SparseConfig`
    refuses less, naming SparseConfig.topk); more blocks than the model's whole context holds
    can never be selected, so such a budget is refused too. (Below that, budgets past a short
    prompt's blocks are clamped by `generate`.) A layer past the last is refused by name."""
    import dataclasses

    c = model.config
    changes = {}
    if topk is not None:
        blocks = -(-c.max_position_embeddings // c.sparse.block_size)
        if topk > blocks:
            raise ValueError(f"--topk {topk} exceeds the {blocks} blocks of {c.name}'s whole context "
                             f"({c.max_position_embeddings} tokens in blocks of {c.sparse.block_size})")
        changes["topk"] = topk
    if dense_layers is not None:
        if dense_layers and dense_layers[-1] >= c.num_layers:
            raise ValueError(f"--dense-layers names layer {dense_layers[-1]}; {c.name} has layers 0..{c.num_layers - 1}")
        changes["dense_layers"] = tuple(dense_layers)
    if changes:
        model.config = c.replace(sparse=dataclasses.replace(c.sparse, **changes))
    return model


def _load(args):
    import jax.numpy as jnp

    from .api import load_pretrained

    from .runtime import default_cache_dir

    t0 = time.perf_counter()
    # the converted checkpoint is kept with the compiled programs (both off with --no-compile-cache)
    cache = default_cache_dir() if getattr(args, "compile_cache", False) else None
    model = load_pretrained(args.model, dtype=getattr(jnp, args.dtype), progress=True, cache_dir=cache,
                            adapter=getattr(args, "adapter", None))
    model = _with_budget(model, getattr(args, "topk", None), getattr(args, "dense_layers", None))
    print(f"loaded {model.config.name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model


def _check_forecast_arg(args) -> None:
    """--forecast names a file that exists (checked before the model loads), or 'random'."""
    f = getattr(args, "forecast", None)
    if f and f != "random" and not Path(f).is_file():
        raise FileNotFoundError(f"Forecast file not found: {f}")


def _forecast(args, model):
    """--forecast as `prepare_modes` takes it: None (the model's shipped Forecast, else an
    untrained one), 'random', or the file's Forecast; the model's config takes the file's
    Forecast source, so an ablation's Forecast runs on the state it was trained on."""
    if not args.forecast or args.forecast == "random":
        return args.forecast or None
    import dataclasses

    from .io.forecast_file import forecast_file_source, load_forecast

    model.config = model.config.replace(forecast=dataclasses.replace(
        model.config.forecast, source=forecast_file_source(args.forecast)))
    return load_forecast(args.forecast, model.config)


def _prebuild_copy_library(systems) -> None:
    """An offload system on a CUDA GPU needs the copy library (`infer.engine.engine_prefill` starts
    its build too): started here, its first build (nvcc, seconds) also overlaps the model's load."""
    from .infer.engine import RESIDENT_SYSTEMS

    if any(s not in RESIDENT_SYSTEMS for s in systems):
        from .kernels.kv_copy import build_in_background

        build_in_background()


def _cmd_generate(args) -> int:
    from .infer.generate import SamplingConfig, generate

    if args.trace:
        _check_output(args.trace)
    _check_forecast_arg(args)
    _prebuild_copy_library([args.system])
    model = _load(args)
    forecast = _forecast(args, model)
    tok = model.tokenizer
    if tok is None:
        print("this checkpoint has no tokenizer; cannot generate from text", file=sys.stderr)
        return 2
    text = args.prompt if args.raw else tok.chat_prompt(args.prompt)
    ids = tok.encode(text)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    printed = 0

    def stream(generated):
        nonlocal printed
        s = tok.decode(generated[0])
        # hold back a trailing partial UTF-8 character until the next token completes it
        if s.endswith("\ufffd"):
            return
        sys.stdout.write(s[printed:])
        sys.stdout.flush()
        printed = len(s)

    from .api import prepare_modes, system_kwargs
    from .infer.engine import selector_of

    extra = prepare_modes(model, [selector_of(args.system)], seed=args.seed, forecast=forecast)
    kw = system_kwargs(extra, args.system)
    if args.implementation:
        import dataclasses

        from .config import Implementations

        kw["engine"] = dataclasses.replace(kw["engine"], implementations=Implementations(**dict(args.implementation)))
    from .infer.timing import CompileClock, StepTimer

    timer = StepTimer(then=stream)
    run = lambda: generate(model.params, model.config, [ids], sampling, stop_ids=tok.eos_ids,
                           dtype=model.dtype, on_step=timer, steps_per_call=args.steps_per_call, **kw)
    with CompileClock() as compiles:
        timer.start()
        if args.trace:
            from .bench.profile import trace_once

            out, summary = trace_once(run, args.trace)
        else:
            out = run()
        timing = timer.timing(steps_per_call=args.steps_per_call, max_new_tokens=args.max_new_tokens)
    tail = tok.decode(out[0])[printed:]
    sys.stdout.write(tail + "\n")
    # the first decode call (compile, the copy library's build) apart from the steady state
    print(f"[{len(ids)} prompt tokens, {len(out[0])} new tokens in {timing.total_s:.1f} s: {timing.summary()}]",
          file=sys.stderr)
    print(f"[{timer.first_calls(compiles, timing)}]", file=sys.stderr)
    if args.trace:
        _print_trace_summary(summary)
    return 0


def _print_trace_summary(summary: dict, top: int = 12) -> None:
    """--trace: where the traced call's time went, to stderr (the whole summary with the trace)."""
    err = lambda s: print(s, file=sys.stderr)
    if "error" in summary:
        err(f"[trace] {summary['error']}")
        return
    err(f"[trace] {summary.get('trace')} ({summary.get('source')}: {summary.get('events', 0)} events, "
        f"busy {summary.get('busy_s_per_step', 0):.3f} s of a {summary.get('span_s_per_step', 0):.3f} s span)")
    for title, key in (("host events, most total time", "host_top"), ("device kernels", "top")):
        rows = summary.get(key) or []
        if rows:
            err(f"[trace] {title}:")
            for r in rows[:top]:
                err(f"[trace]   {r['s_per_step']:9.3f} s  {r['calls_per_step']:7.0f} calls  {r['name']}")


def _cmd_demo(args) -> int:
    from .infer.demo import results_table, run_retrieval

    if args.json:
        _check_output(args.json)
    _check_forecast_arg(args)
    _prebuild_copy_library(args.systems)
    model = _load(args)
    forecast = _forecast(args, model)
    sp = model.config.sparse
    if sp.topk * sp.block_size >= args.context:  # every block selected: the systems cannot differ in what they read
        print(f"sparda: note: the block budget ({sp.topk} blocks of {sp.block_size} tokens) covers the whole "
              f"{args.context}-token context, so every system reads every block and the sparse ones answer as "
              f"dense does; take --context above {sp.topk * sp.block_size} or a smaller --topk", file=sys.stderr)
    results = run_retrieval(model, context_tokens=args.context, depths=tuple(args.depths),
                            systems=tuple(args.systems), seed=args.seed, forecast=forecast,
                            log=lambda s: print(s, file=sys.stderr))
    print(results_table(results))
    if args.json:
        from .envinfo import environment
        from .eval.heldout import budget_record

        record = {"model": model.config.name, "adapter": model.adapter, "dtype": args.dtype, "budget": budget_record(sp),
                  "rows": results, "command": "sparda " + " ".join(sys.argv[1:]), "environment": environment()}
        write_result(args.json, json.dumps(record, indent=2))
    return 0


def _cmd_eval(args) -> int:
    from .envinfo import environment

    if args.out:
        for suffix in ("", ".md", ".png"):
            _check_output(Path(args.out).with_suffix(suffix) if suffix else args.out)
    _check_forecast_arg(args)
    splits = None
    if args.splits and not args.text:
        raise ValueError("--splits names splits of a token corpus: give its directory with --text")
    if args.text:
        if args.suite not in ("selection", "copy"):
            raise ValueError(f"--text applies to the selection and copy suites, not {args.suite}")
        from .eval.heldout import corpus_splits

        known = corpus_splits(args.text)  # a missing or foreign manifest is refused before the model loads
        splits = args.splits or [s for s in known if s.startswith("eval-")]
        unknown = [s for s in splits if s not in known]
        if unknown or not splits:
            what = f"split {unknown[0]!r} is not in {args.text}" if unknown else \
                f"{args.text} has no eval-* split; name some with --splits"
            raise ValueError(f"{what}; its splits are {', '.join(known)}")
    if args.samples is None:
        args.samples = 8 if args.suite == "copy" else 20
    model = _load(args)
    too_long = [n for n in args.lengths or () if n > model.config.max_position_embeddings]
    if too_long:
        raise ValueError(f"--lengths {too_long[0]} exceeds {model.config.name}'s context of "
                         f"{model.config.max_position_embeddings} tokens")
    t0 = time.perf_counter()
    env = environment()
    out = Path(args.out) if args.out else None
    forecast = _forecast(args, model)

    def save(result, complete: bool):
        result.update(environment=env, command="sparda " + " ".join(sys.argv[1:]),
                      seconds=round(time.perf_counter() - t0, 1), complete=complete)
        if out is None:
            return
        if complete:
            write_result(out, json.dumps(result, indent=2))
            return
        try:  # progress: a failed write here is retried (with its fallback) at the end
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
        except OSError:
            pass

    common = dict(seed=args.seed, on_row=lambda r: save(r, False))
    texts, goals = None, None
    if splits is not None:
        from .eval.heldout import corpus_texts

        texts = corpus_texts(args.text, splits, vocab_size=model.config.vocab_size)
    if args.suite in ("selection", "copy"):
        common["texts"] = texts
    if args.suite == "selection":
        from .eval.selection import eval_selection, markdown_table

        result = eval_selection(model, lengths=tuple(args.lengths or EVAL_LENGTHS), n_seqs=args.seqs, modes=tuple(args.modes or EVAL_MODES),
                                forecast=forecast, **common)
        table = markdown_table(result)
        goals = dict(selection=result)
        intro = (f"Budget {result['budget']}; {args.seqs} windows per length of {result['text']}.\n"
                 "ppl = perplexity over all tokens (over the second half in parentheses); recall = share of\n"
                 "the layer's own InfLLM-V2 content blocks (forced blocks excluded) that the mode also chose,\n"
                 "all layers; mass = dense attention probability inside the selected blocks.\n")
    elif args.suite == "copy":
        from .eval.copy import copy_markdown, eval_copy

        result = eval_copy(model, lengths=tuple(args.lengths or COPY_LENGTHS), samples=args.samples,
                           modes=tuple(args.modes or EVAL_MODES), forecast=forecast, **common)
        table = copy_markdown(result)
        goals = dict(copy=result)
        intro = (f"Budget {result['budget']}; {args.samples} copy sequences per length from {result['text']}: "
                 f"filler, a {result['rows'][0]['passage_tokens']}-token passage, filler, the passage again.\n")
    elif args.suite == "tasks":
        from .eval.accuracy import eval_tasks, max_task_length, plot_tasks, tasks_markdown
        from .eval.tasks import TASKS

        lengths = args.lengths or [*EVAL_LENGTHS[:-1], min(EVAL_LENGTHS[-1], max_task_length(model.config) // 64 * 64)]
        result = eval_tasks(model, tasks=tuple(args.tasks or TASKS), lengths=tuple(lengths),
                            samples=args.samples, modes=tuple(args.modes or EVAL_MODES), forecast=forecast, **common)
        table = tasks_markdown(result)
        intro = (f"Budget {result['budget']}; haystacks from the {result['text']}; greedy answers of up to 40 "
                 f"tokens.\n")
        if out is not None:
            plot_tasks(result, out.with_suffix(".png"))
    else:
        from .eval.budget import budget_markdown, eval_budget

        result = eval_budget(model, topks=tuple(args.topks), length=(args.lengths or EVAL_LENGTHS)[0], samples=args.samples,
                             seqs=args.seqs, modes=tuple(args.modes or ("sparse", "sparda")),
                             tasks=tuple(args.tasks or ("niah_single", "copy")), **common)
        table = budget_markdown(result)
        intro = f"Budget sweep at {result['length']} tokens.\n"
    if goals is not None:  # the accuracy goals (the Forecast's, a sparse-native model's), where the rows allow them
        from .eval.goals import goals_markdown

        goals = goals_markdown(**goals)
    print(table)
    if goals:
        print(goals)
    save(result, True)
    if out is not None:
        write_result(out.with_suffix(".md"),
                      f"# {args.suite}: {model.config.name}\n\n{intro}\n{table}\n" + (f"{goals}\n" if goals else "") +
                      f"Command: `{result['command']}`; commit {env['commit']}; {env['device']}.\n")
    return 0


def _init_forecast_path(arg, config):
    """--init-forecast: None, 'shipped' (the package's Forecast for this model) or a file."""
    if arg != "shipped":
        return arg
    from .io.forecast_file import shipped_forecast_path

    path = shipped_forecast_path(config)
    if path is None:
        raise SystemExit(f"--init-forecast shipped: no Forecast is shipped for {config.name!r}")
    return path


def _cmd_train(args) -> int:
    import dataclasses

    from .train.augment import RetrievalMix
    from .train.objective import TrainConfig
    from .train.run import train

    _check_output(args.out, directory=True)
    if args.coordinator:
        import jax

        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    model = _load(args)
    if args.teacher:
        kernel, stride = args.teacher
        model.config = model.config.replace(forecast=dataclasses.replace(
            model.config.forecast, teacher_kernel_size=kernel, teacher_kernel_stride=stride))
    if args.supervision_k is not None:
        model.config = model.config.replace(forecast=dataclasses.replace(
            model.config.forecast, supervision_k=args.supervision_k))
    if not args.rest_bucket:
        model.config = model.config.replace(forecast=dataclasses.replace(model.config.forecast, rest_bucket=False))
    if args.forecast_source != "prev_input":
        model.config = model.config.replace(forecast=dataclasses.replace(model.config.forecast,
                                                                         source=args.forecast_source))
    mix = RetrievalMix(repeat_share=args.repeat_share, scatter_share=args.scatter_share)
    tc = TrainConfig(seq_len=args.seq_len, batch=args.batch, micro_batch=args.micro_batch, steps=args.steps,
                     lr=args.lr, dtype=args.train_dtype, seed=args.seed)
    summary = train(model, tc, args.out, data_paths=args.data, data_devices=args.data_devices,
                    save_every=args.save_every, keep=args.keep, eval_every=args.eval_every, mix=mix,
                    init_from=_init_forecast_path(args.init_forecast, model.config), override=args.override,
                    log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(summary, indent=2))
    return 0


def _init_adapter_path(arg, model):
    """--init-adapter: None, 'shipped' (the package's adapter for this base model) or a file."""
    if arg != "shipped":
        return arg
    from .api import ADAPTED_PRESETS
    from .io.adapter_file import adapter_path

    names = [name for name, base in ADAPTED_PRESETS.items() if base == model.config.name]
    path = adapter_path(names[0]) if names else None
    if path is None or not path.is_file():
        raise SystemExit(f"--init-adapter shipped: no adapter is shipped for {model.config.name!r}")
    return path


def _cmd_finetune(args) -> int:
    from .io.adapter_file import LoraConfig
    from .train.augment import RetrievalMix
    from .train.finetune import FinetuneConfig, finetune

    _check_output(args.out, directory=True)
    # the settings are checked before the model loads
    lora = LoraConfig(rank=args.rank, alpha=float(args.alpha if args.alpha is not None else 2 * args.rank))
    fc = FinetuneConfig(lora=lora, objective=args.objective, dense_weight=args.dense_weight,
                        copy_weight=args.copy_weight, select_weight=args.select_weight,
                        select_rows=args.select_rows, select_layers=args.select_layers, seq_len=args.seq_len,
                        batch=args.batch, micro_batch=args.micro_batch, steps=args.steps, lr=args.lr,
                        dtype=args.train_dtype, seed=args.seed)
    mix = RetrievalMix(repeat_share=args.repeat_share, scatter_share=args.scatter_share)
    model = _load(args)
    summary = finetune(model, fc, args.out, data_paths=args.data, data_devices=args.data_devices,
                       save_every=args.save_every, keep=args.keep, eval_every=args.eval_every,
                       eval_seqs=args.eval_seqs, mix=mix, init_from=_init_adapter_path(args.init_adapter, model),
                       override=args.override,
                       log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_corpus(args) -> int:
    from .corpus import build_corpus, corpus_info, default_corpus_dir

    if args.corpus_cmd == "info":
        print(corpus_info(args.dir))
        return 0
    out = args.out
    _check_output(out, directory=True)
    model = _load(args)
    if model.tokenizer is None:
        raise ValueError(f"{model.config.name} has no tokenizer to build a corpus with")
    t0 = time.perf_counter()
    build_corpus(out, model.tokenizer, eos_id=model.config.eos_token_ids[0], packages=args.packages,
                 kind=args.kind, shard_tokens=args.shard_tokens,
                 cache_dir=args.cache_dir or default_corpus_dir(), model_name=model.config.name,
                 log=lambda s: print(s, file=sys.stderr))
    print(corpus_info(out))
    print(f"built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


# benchmarks of GPU kernels at an 8B model's shapes (32K-128K tokens): on a CPU they run the
# references for hours and take many GiB; realmodel (SmolLM2) runs anywhere
_GPU_BENCHES = ("train", "copy", "select", "attention", "prefill", "decode", "cta")


def _cmd_bench(args) -> int:
    if args.copy_start is not None and args.name != "realmodel":
        # the full-depth decode benchmarks time the lanes, as their claims were measured (bench.decode.DECODE_COPY_START)
        raise SystemExit(f"sparda bench {args.name}: --copy-start is realmodel's ({args.name} times the lanes)")
    if args.name == "cta" and args.ctas and "auto" in args.ctas:
        raise SystemExit("sparda bench cta: --ctas takes counts; the sweep adds the autotuned choice itself")
    if args.name in _GPU_BENCHES:
        import jax

        if not any(d.platform == "gpu" for d in jax.devices()) and not (args.allow_cpu and args.name != "copy"):
            what = "the CUDA copy engine" if args.name == "copy" else f"GPU kernels at {args.preset}'s shapes"
            print(f"sparda: error: bench {args.name} needs a CUDA GPU: it times {what} (found only "
                  f"{jax.default_backend()})"
                  + ("" if args.name == "copy" else "; --allow-cpu runs it here anyway (the plain-jnp references: "
                     "take a small --preset such as tiny, short --lengths, --layers 1)"), file=sys.stderr)
            return 2
    if args.name == "train":
        from .bench.train_step import main as run
    elif args.name == "copy":
        from .bench.copy import main as run
    elif args.name == "select":
        from .bench.select import main as run
    elif args.name == "attention":
        from .bench.attention import main as run
    elif args.name in ("decode", "cta"):
        from .bench.decode import main as run
    elif args.name == "prefill":
        from .bench.prefill import main as run
    elif args.name == "realmodel":
        from .bench.realmodel import main as run
    else:  # argparse restricts the choices
        raise AssertionError(args.name)
    # defaults per benchmark: decode + prefill + cta together stay within ~7 minutes on the H200
    if args.budget_s is None:
        args.budget_s = {"decode": 200.0, "prefill": 130.0, "cta": 90.0, "realmodel": 300.0}.get(args.name, 140.0)
    if args.steps_per_call is None and args.name != "realmodel":  # realmodel: its own rule (bench.realmodel)
        args.steps_per_call = 1
    if args.repeats is None:
        args.repeats = {"decode": 6, "cta": 6}.get(args.name, 3)
    return run(args)


def _cmd_info(args) -> int:
    from .api import init_model
    from .config import get_preset, preset_names
    from .model import param_count

    import jax

    from .api import ADAPTED_DENSE_LAYERS, ADAPTED_PRESETS

    names = [args.model] if args.model else [*preset_names(), *ADAPTED_PRESETS]
    for n in names:
        # an adapted preset (the sparse-native SmolLM2) has its base model's shapes
        c = get_preset(ADAPTED_PRESETS[n] if n in ADAPTED_PRESETS else n)
        shapes = jax.eval_shape(lambda: init_model(c, jax.random.key(0)))
        dense = ADAPTED_DENSE_LAYERS.get(n, c.sparse.dense_layers)
        source = (f"{ADAPTED_PRESETS[n]} with the package's LoRA adapter for sparse attention merged in"
                  if n in ADAPTED_PRESETS else c.source) + (f"; dense layers {list(dense)}" if dense else "")
        print(f"{n:19s} {c.arch:8s} layers {c.num_layers:3d} hidden {c.hidden_size:5d} heads "
              f"{c.num_heads}/{c.num_kv_heads} d_h {c.head_dim} params {param_count(shapes) / 1e6:9.1f}M"
              f"  [{source}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparda", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="SparDA (sparse decoupled attention) in JAX: generate text and run the retrieval demo\n"
                    "under every attention system, measure accuracy, build the training corpus, train the\n"
                    "Forecast, fine-tune a model for sparse attention, and benchmark on a GPU.",
        epilog="first steps:\n  sparda demo                      the retrieval demo on SmolLM2 (dense, sparse, sparda)\n"
               "  sparda generate --prompt TEXT    stream a reply; --system picks the attention system\n"
               "  sparda COMMAND --help            the options of one command")
    p.add_argument("--launch-queues", default="4x", choices=[*LAUNCH_QUEUE_SCALES, "default"],
                   help=f"CUDA's launch-queue multiplier ({LAUNCH_QUEUES}) for this run; an exported value wins. "
                        "A full-depth decode step outgrows the default queues (sparda_jax.runtime)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not keep compiled programs and converted checkpoints on disk (default: kept under "
                        "$SPARDA_JAX_CACHE_DIR or ~/.cache/sparda-jax, so a second run skips the first one's "
                        "compiles and weight conversion)")
    p.add_argument("--no-program-store", dest="program_store", action="store_false",
                   help="keep XLA's compilation cache but not the program store (sparda_jax.programs: the prefill "
                        "and decode programs kept with their calling convention, so a second run does not trace "
                        "them)")
    sub = p.add_subparsers(dest="cmd", required=True)

    def run_args(p, product: str, *, steps: int, batch: int, micro_batch: int, save_every: int):
        """The flags `train` and `finetune` share: data and its retrieval windows, run directory,
        window, steps, batch, lr, resume, mesh, checkpoints, seed."""
        p.add_argument("--data", nargs="+", help=".txt/.md files or directories, or a token corpus directory "
                                                 "(default: the training split of the Python docs shipped with CPython)")
        p.add_argument("--out", required=True, help=f"run directory: checkpoints, metrics, {product}")
        p.add_argument("--seq-len", type=int, default=4096)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--batch", type=int, default=batch, help="effective batch (sequences per step)")
        p.add_argument("--micro-batch", type=int, default=micro_batch,
                       help="sequences per forward (gradient accumulation)")
        p.add_argument("--lr", type=float, default=5e-4)
        p.add_argument("--train-dtype", choices=_DTYPES, default="bfloat16")
        p.add_argument("--repeat-share", type=float, default=0.0,
                       help="share of training windows given a long-range repeated span (train.augment)")
        p.add_argument("--scatter-share", type=float, default=0.0,
                       help="share of training windows given a shuffled copy of scattered short spans")
        p.add_argument("--override", action="store_true",
                       help="resume although settings differ from the run's config.json (the change is recorded there)")
        p.add_argument("--data-devices", type=int, help="devices on the data-parallel mesh (default: all)")
        p.add_argument("--save-every", type=int, default=save_every)
        p.add_argument("--keep", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)

    def forecast_arg(sp):
        sp.add_argument("--forecast", metavar="FILE",
                        help="the Forecast of the sparda systems: a .safetensors (`sparda train`'s forecast.safetensors), "
                             "or 'random' for an untrained one (default: the one shipped for the model, if any)")

    def model_args(sp, default="smollm2-135m", adapter=True):
        sp.add_argument("--model", default=default,
                        help="smollm2-135m, smollm2-135m-sparse (with its sparse-attention adapter), a .gguf file "
                             "or an HF checkpoint directory (default: %(default)s)")
        if adapter:
            sp.add_argument("--adapter", metavar="FILE",
                            help="a LoRA adapter file (`sparda finetune`'s adapter.safetensors) merged into the "
                                 "model's weights; with smollm2-135m-sparse it replaces the package's adapter")
        sp.add_argument("--dtype", choices=_DTYPES, default="float32", help="compute dtype")
        sp.add_argument("--topk", type=int,
                        help="block budget, forced blocks included, at most the model's context in blocks "
                             "(generate clamps it to the blocks of its cache); default: the preset's")
        sp.add_argument("--dense-layers", type=_dense_layer_list, metavar="LAYERS",
                        help="layers that attend to every key in the sparse systems, their KV kept on the device "
                             "(e.g. 18 or 3,15-19; 'none': no layer); default: the preset's")

    g = sub.add_parser("generate", help="generate text (streaming)")
    model_args(g)
    forecast_arg(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--system", default="dense_resident",
                   choices=["dense_resident", "sparse_resident", "sparse", "infinigen", "sparda_sync", "sparda"],
                   help="attention system; the last four keep the KV of layers 1.. in host memory")
    g.add_argument("--steps-per-call", type=_positive_int, default=1,
                   help="tokens drawn per device program (sampling on the device, streamed after each call): "
                        "on a GPU at full depth, one program per step is bound by the host")
    g.add_argument("--implementation", type=_implementation, nargs="+", default=[], metavar="OP=NAME",
                   help="force an op's backend (`sparda_jax.Implementations`), e.g. sparse_attention=xla "
                        "select=xla; default: each op picks its kernel where one applies")
    g.add_argument("--trace", metavar="FILE.trace.json.gz",
                   help="profile the whole generate call (prefill, first decode call, the rest) into this "
                        "Chrome trace (ui.perfetto.dev) and print where the time went")
    g.set_defaults(fn=_cmd_generate)

    d = sub.add_parser("demo", help="long-context retrieval on the default model (the README's main job)")
    model_args(d, default="smollm2-135m-sparse")  # the model trained for sparse attention: every system can answer
    d.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    d.add_argument("--depths", type=float, nargs="+", default=[0.5],
                   help="where the fact sits, as fractions of the context")
    d.add_argument("--systems", nargs="+", default=["dense_resident", "sparse", "sparda"],
                   help="systems to compare: dense_resident sparse_resident (all KV on the device), sparse "
                        "infinigen sparda_sync sparda (KV of layers 1.. in host memory); sparda uses the "
                        "Forecast shipped for the model, or an untrained one")
    forecast_arg(d)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", help="write the results to this JSON file")
    d.set_defaults(fn=_cmd_demo)

    e = sub.add_parser("eval", help="accuracy of each mode: synthetic long-context tasks (default), "
                                    "perplexity and selection quality, long-range copy, or a budget sweep")
    model_args(e)
    e.add_argument("--suite", choices=["tasks", "selection", "copy", "budget"], default="tasks",
                   help="copy: the long-range copy task with the share of selections holding the source block")
    e.add_argument("--modes", nargs="+", help="default: dense sparse infinigen sparda (budget suite: sparse sparda)")
    e.add_argument("--lengths", type=_positive_int, nargs="+",
                   help="contexts (default 1024 2048 4096 8192; copy suite: 4096 8192; tasks suite: 8192 becomes "
                        "the longest that fits the model with the answer, 8064 for SmolLM2)")
    e.add_argument("--tasks", nargs="+", help="default: every task (budget suite: niah_single copy)")
    e.add_argument("--samples", type=_positive_int,
                   help="samples per (task, length, mode) cell (default 20; copy suite: sequences per (split, "
                        "length, mode), default 8)")
    e.add_argument("--seqs", type=_positive_int, default=4, help="selection suite: windows of held-out text per length")
    e.add_argument("--topks", type=int, nargs="+", default=[12, 16, 24, 32], help="budget suite: block budgets")
    e.add_argument("--text", metavar="DIR",
                   help="selection and copy suites: held-out text from this token corpus (sparda_jax.corpus) "
                        "instead of the Python docs' held-out quarter")
    e.add_argument("--splits", nargs="+", help="with --text: the corpus splits, a row set each (default: its "
                                               "eval-* splits)")
    e.add_argument("--seed", type=int, default=0)
    forecast_arg(e)
    e.add_argument("--out", help="write JSON here (and a Markdown table beside it)")
    e.set_defaults(fn=_cmd_eval)

    t = sub.add_parser("train", help="train the Forecast (frozen backbone); resumes from --out")
    model_args(t)
    run_args(t, "forecast.safetensors", steps=2000, batch=32, micro_batch=4, save_every=100)
    t.add_argument("--teacher", type=int, nargs=2, metavar=("KERNEL", "STRIDE"),
                   help="teacher compression (default 2 1; the paper's ablation uses 32 16)")
    t.add_argument("--supervision-k", type=_positive_int,
                   help="teacher positions kept apart in the loss, on the compressed grid (default: the preset's)")
    t.add_argument("--no-rest-bucket", dest="rest_bucket", action="store_false",
                   help="ablation: the loss compares the kept positions alone (no bucket for the rest)")
    t.add_argument("--forecast-source", choices=FORECAST_SOURCES, default="prev_input",
                   help="ablation: the state the Forecast of layer l reads: prev_input (SparDA: layer l-1's "
                        "normed input), prev_mid (layer l-1's normed state after its attention), own_input "
                        "(layer l's own input: no lead; forward-only)")
    t.add_argument("--init-forecast", metavar="FILE",
                   help="start from this Forecast .safetensors ('shipped': the one shipped for the model) "
                        "instead of a random one; the optimizer starts fresh")
    t.add_argument("--eval-every", type=_nonnegative_int, default=50,
                   help="recall on held-out text every this many steps (and at the first and last; 0: never)")
    t.add_argument("--coordinator", help="multi-host: coordinator address for jax.distributed")
    t.add_argument("--num-processes", type=int)
    t.add_argument("--process-id", type=int)
    t.set_defaults(fn=_cmd_train)

    ft = sub.add_parser("finetune", help="fine-tune a LoRA adapter of the attention projections under sparse "
                                         "attention (frozen backbone); resumes from --out")
    model_args(ft, adapter=False)  # its --init-adapter names the adapter training starts from
    run_args(ft, "adapter.safetensors", steps=60, batch=8, micro_batch=8, save_every=10)
    ft.add_argument("--rank", type=_positive_int, default=32, help="LoRA rank")
    ft.add_argument("--alpha", type=float, help="LoRA alpha: the update is scaled by alpha / rank (default 2 x rank)")
    ft.add_argument("--objective", choices=["nll", "distill"], default="nll",
                    help="nll: next-token NLL of the training text under sparse attention; distill: KL from the base "
                         "model's own dense next-token distribution (keeps an instruct model's behaviour)")
    ft.add_argument("--copy-weight", type=float, default=0.0,
                    help="add this times the sparse NLL of the tokens a long-range copy predicts (a run of 9 tokens "
                         "seen 1024+ tokens earlier): retrieval, which distill learns only where the base model's "
                         "dense mode retrieves")
    ft.add_argument("--select-weight", type=float, default=0.0,
                    help="add this times each layer's KL from its own attention to its InfLLM-V2 block scores (mean "
                         "over layers): trains the block choice, which the other terms cannot reach")
    ft.add_argument("--select-rows", type=_positive_int, default=256,
                    help="query rows per sequence the --select-weight term is computed at")
    ft.add_argument("--select-layers", type=_layer_list, default=(),
                    help="the layers the --select-weight term averages over, e.g. 15-19 or 3,15-19 (default: all)")
    ft.add_argument("--init-adapter",
                    help="start from this adapter file ('shipped': the package's adapter of the model) instead of "
                         "B = 0; the optimizer starts fresh")
    ft.add_argument("--dense-weight", type=float, default=0.0,
                    help="weight w of the dense-mode NLL in the loss (1 - w) sparse + w dense: w > 0 keeps the dense "
                         "mode of the adapted weights from drifting, 1 is the dense-only control")
    ft.add_argument("--eval-every", type=_nonnegative_int, default=20,
                    help="held-out NLL, dense and sparse, every this many steps (and at the first and last; 0: never)")
    ft.add_argument("--eval-seqs", type=_positive_int, default=2, help="held-out windows of min(seq-len, 8192) tokens")
    ft.set_defaults(fn=_cmd_finetune)

    bn = sub.add_parser("bench", help="efficiency benchmarks, each writing a JSON with its provenance")
    bn.add_argument("name", choices=["train", "copy", "select", "attention", "prefill", "decode", "cta", "realmodel"])
    bn.add_argument("--preset", default="minicpm4.1-8b")
    bn.add_argument("--seq-len", type=int, default=32768)
    bn.add_argument("--micro-batch", type=int, default=1)
    bn.add_argument("--accumulation", type=int, default=1)
    bn.add_argument("--layers", type=int, help="time fewer layers than the preset has (said in the JSON)")
    bn.add_argument("--repeats", type=int, help="timed repeats (default 3; decode/cta: timed decode steps, default 6; "
                                                "copy: use ~20)")
    bn.add_argument("--pool-mib", type=int, default=2048, help="copy: size of the pinned host pool")
    bn.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="copy: MiB per gather")
    bn.add_argument("--lengths", type=int, nargs="+", help="contexts (select/attention/prefill default 32768 65536 "
                                                           "131072; decode 131072; cta 32768)")
    bn.add_argument("--batch", type=int, help="select/attention: prefill batch (default 4)")
    bn.add_argument("--data-devices", type=int,
                    help="train: time one device and a data-parallel mesh of this many in the same run (0: all)")
    bn.add_argument("--decode-batches", type=int, nargs="+",
                    help="decode batches (attention default 16 64; select default: --batch)")
    bn.add_argument("--variants", nargs="+", help="select: forecast_xla infllmv2_xla forecast_mosaic_gpu infllmv2_mosaic_gpu; "
                                                  "attention: xla cudnn mosaic_gpu dense_xla")
    bn.add_argument("--timed-queries", type=int,
                    help="queries per sequence for sliced variants (select default 8192, attention 2048)")
    bn.add_argument("--decode-steps", type=int, default=8, help="decode steps (layers) per timed call")
    bn.add_argument("--decode-loop", choices=["map", "unroll"], default="map",
                    help="attention: the timed call's decode steps as a lax.map (a while loop) or unrolled")
    bn.add_argument("--query-correlation", type=float, default=0.0,
                    help="attention: AR(1) correlation along positions of the queries that choose the prefill "
                         "blocks (0: independent; 0.99: the tile union of SmolLM2's real selections)")
    bn.add_argument("--input-correlation", type=float, default=0.0, metavar="RHO",
                    help="prefill: embedding rows AR(1) with this rho, tokens counting up through them, so the "
                         "inputs are alike along positions as on real text (0: random tokens; in [0, 1))")
    bn.add_argument("--prefill-only", action="store_true", help="attention, select: skip the decode cases")
    bn.add_argument("--decode-only", action="store_true", help="attention, select: skip the prefill cases")
    bn.add_argument("--train-only", action="store_true",
                    help="attention: only the forward + backward (training) cases, each sparse variant's gradients "
                         "checked first (variants: xla dense_xla cudnn mosaic_gpu)")
    bn.add_argument("--weights", choices=["layered", "stacked"], default="layered",
                    help="decode: the engine's steps read per-layer weights (as generate gives them) or the "
                         "stacked tree (each step slices every layer's; XLA copies the o_proj slice)")
    bn.add_argument("--steps-per-call", type=_positive_int,
                    help="decode: decode steps in each timed call, run as one device program "
                         "(infer.engine.engine_decode_steps; XLA records its graphs once for all of them); "
                         "times stay per step (default 1). realmodel: generate's steps_per_call (default: the "
                         "largest k <= 8 that splits the decode steps into 3 or more calls of k)")
    bn.add_argument("--pipeline-only", action="store_true",
                    help="copy: only the prefetch-pattern sweep (bench_pipeline: CTAs, threads, resident)")
    bn.add_argument("--budget-s", type=float,
                    help="skip configurations started after this many seconds (select/attention 140, decode 200, "
                         "prefill 130, cta 90, realmodel 300)")
    bn.add_argument("--batches", type=int, nargs="+",
                    help="decode: batches (default 4 8 16 32); cta: batches (default 16 64); prefill: batch (default 4); "
                         "realmodel: batches (default 1 8)")
    bn.add_argument("--model", default="smollm2-135m",
                    help="realmodel: smollm2-135m, a .gguf file or an HF checkpoint directory")
    bn.add_argument("--dtype", choices=_DTYPES, help="realmodel: compute dtype (default bfloat16)")
    bn.add_argument("--profile-prefill", action="store_true",
                    help="realmodel: trace one more steady prefill per cell; its summary (device busy time, top "
                         "kernels, host events) goes into the row as prefill_profile")
    bn.add_argument("--profile-decode", action="store_true",
                    help="realmodel: trace the steady decode steps of one more generate per cell (after its first "
                         "decode call); the summary goes into the row as decode_profile")
    bn.add_argument("--implementation", type=_implementation, nargs="+", metavar="OP=NAME",
                    help="realmodel: force these backends in every cell (`sparda_jax.Implementations`), e.g. "
                         "sparse_attention=xla select=xla; recorded in the JSON's config")
    bn.add_argument("--copy-start", choices=COPY_STARTS, default=None,
                    help="realmodel: how sparda starts a layer's copy (EngineConfig.copy_start; default one): one "
                         "start and one wait of every payload, or one start per payload on a lane each")
    bn.add_argument("--first-token-implementation", type=_implementation, nargs="+", metavar="OP=NAME",
                    help="realmodel, with --first-token: run those systems again with these backends forced "
                         "(generate --implementation), e.g. sparse_attention=xla select=xla")
    bn.add_argument("--first-token-without-store", action="store_true",
                    help="realmodel, with --first-token: run those systems again with --no-program-store (XLA's "
                         "compilation cache alone), to compare the warm first token with and without the store")
    bn.add_argument("--first-token", nargs="+", metavar="SYSTEM",
                    help="realmodel: also time `sparda generate` for these systems in fresh processes, cold (an empty "
                         "compilation cache) then warm: process start to the first generated text")
    bn.add_argument("--systems", nargs="+",
                    help="the engine's systems: realmodel dense_resident sparda sparse_resident sparse sparda_sync "
                         "infinigen (default: all, in this order); decode dense_resident sparse_resident sparse "
                         "infinigen sparda_sync sparda (default: all); prefill dense_resident sparse sparda")
    bn.add_argument("--contexts", type=int, nargs="+",
                    help="realmodel: prompt tokens (default 4096 8192; shortened where prompt + new tokens pass "
                         "the model's positions)")
    bn.add_argument("--new-tokens", type=int, default=64, help="realmodel: tokens generated per sequence, greedy")
    bn.add_argument("--ctas", type=_cta_count, nargs="+", help="cta: CTA counts (default 8 16 32 64); decode: one fixed "
                                                               "count, or 'auto' (autotuned per copy size; default: the "
                                                               "paper's heuristic)")
    bn.add_argument("--reuse-fractions", type=float, nargs="*",
                    help="decode: emulated-reuse variants, fraction of rows repeating their step (default 0.5)")
    bn.add_argument("--real-miss-rate", nargs="+", metavar="[SYSTEM=]RATE",
                    help="decode: miss rates measured on a real model (one for all offload systems, or SYSTEM=RATE "
                         "pairs; sparda_sync takes sparda's); adds reuse variants emulating them")
    bn.add_argument("--real-model", help="decode: measure the real-model miss rate first (e.g. smollm2-135m)")
    bn.add_argument("--profile-steps", type=int, default=0,
                    help="decode: trace this many extra steps of the claims' rows (bench.profile): device busy/idle "
                         "time per step, per stream, top kernels; traces under <out's folder>/profiles/")
    bn.add_argument("--profile-reuse", action="store_true",
                    help="decode, with --profile-steps: trace the claims' reuse rows too (each a trace of its own)")
    bn.add_argument("--marginal-layers", type=int,
                    help="decode: also time the claims' rows with this many layers (fewer than --layers) and "
                         "estimate the full model's step from the difference (bench.decode.marginal)")
    bn.add_argument("--validate-layers", type=int,
                    help="decode, with --marginal-layers: time the batch-8 claim's rows with this many layers too "
                         "and compare with the estimate's prediction")
    bn.add_argument("--max-variant-s", type=float, default=3.0, help="fewer repeats for variants slower than this")
    bn.add_argument("--matmul-n", type=int, default=8192, help="ceiling: n of the n^3 bf16 matmul")
    bn.add_argument("--copy-mib", type=int, default=2048, help="ceiling: MiB of the device copy")
    bn.add_argument("--allow-cpu", action="store_true",
                    help="run a GPU benchmark (all but realmodel) without a GPU: the references, for a smoke test")
    bn.add_argument("--out", help="result JSON (default: the benchmark's own folder of the repository's results)")
    bn.set_defaults(fn=_cmd_bench)

    co = sub.add_parser("corpus", help="the token corpus built from Debian documentation packages")
    csub = co.add_subparsers(dest="corpus_cmd", required=True)
    cb = csub.add_parser("build", help="fetch the packages, extract their text, write token shards + manifest")
    model_args(cb, adapter=False)
    cb.add_argument("--out", required=True, help="corpus directory (manifest.json and <split>-NNNNN.npy shards)")
    cb.add_argument("--packages", nargs="+", help="only these packages (default: every source of --kind)")
    cb.add_argument("--kind", choices=("train", "eval", "all"), default="all",
                    help="train: the train and heldout splits; eval: eval-info, eval-man, eval-licenses")
    cb.add_argument("--shard-tokens", type=_positive_int, default=4 * 1024 * 1024,
                    help="the most tokens per shard file")
    cb.add_argument("--cache-dir", help="where .debs and unpacked packages are kept "
                                        "(default: $SPARDA_JAX_CACHE_DIR/corpus or ~/.cache/sparda-jax/corpus)")
    cb.set_defaults(fn=_cmd_corpus)
    ci = csub.add_parser("info", help="summarise a corpus directory")
    ci.add_argument("dir")
    ci.set_defaults(fn=_cmd_corpus)

    i = sub.add_parser("info", help="list the presets with their parameter counts")
    i.add_argument("--model", help="one preset name")
    i.set_defaults(fn=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.launch_queues != "default":
        try:
            set_launch_queues(args.launch_queues)  # before any command touches the GPU
        except RuntimeError as e:  # main() called in a process already on the GPU: run, but say so
            print(f"sparda: warning: {e}", file=sys.stderr)
    if args.compile_cache:
        try:
            enable_compilation_cache()
        except OSError as e:  # an unwritable cache costs compile time, not the run
            print(f"sparda: warning: {e}; running without the compilation cache", file=sys.stderr)
        try:
            if args.program_store:
                enable_program_store()
        except OSError as e:
            print(f"sparda: warning: {e}; running without the program store", file=sys.stderr)
    try:
        return args.fn(args)
    except (FileNotFoundError, ValueError, TypeError, NotImplementedError) as e:  # ConfigError is a ValueError
        # NotImplementedError: a backend forced where it cannot run (a GPU kernel on the CPU)
        print(f"sparda: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
