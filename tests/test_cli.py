"""The `sparda` command, end to end on the real model."""

from __future__ import annotations

import json
import re
import os

import pytest

from sparda_jax.cli import main


def test_generate_streams_an_answer(capsys):
    # 4 tokens a device program (engine_generate_steps); the one-step loop is the default, tested in test_engine.py
    assert main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                 "--system", "sparda", "--steps-per-call", "4"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "new tokens" in out.err


def test_demo_finds_the_fact(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--context", "1024", "--depths", "0.5", "--systems", "dense_resident", "sparda",
                 "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["model"] == "smollm2-135m-sparse" and record["adapter"].startswith("adapter-smollm2-135m-sparse")
    assert record["budget"]["topk"] == 24 and record["budget"]["dense_layers"] == [18]
    assert "commit" in record["environment"]
    results = record["rows"]
    assert [r["mode"] for r in results] == ["dense_resident", "sparda"]
    assert all(r["context_tokens"] == 1024 and r["correct"] for r in results), results
    assert results[0]["miss_rate"] is None and 0 < results[1]["miss_rate"] < 1
    for r in results:  # where each system's first calls went, as `generate` prints it (2 decimals)
        m = re.match(r"first calls: prefill ([0-9.]+) s = trace [0-9.]+ \+ lower ", r["first_calls"])
        assert m and abs(float(m[1]) - r["prefill_s"]) <= 0.006, r
    captured = capsys.readouterr()
    assert "dense_resident | 1024 | 0.5 | True" in captured.out
    assert "[sparda] first calls: prefill" in captured.err
    # at 1024 tokens SmolLM2's 24-block budget selects everything, and the demo says so
    assert "covers the whole 1024-token context" in captured.err


def test_info_lists_presets(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "minicpm4.1-8b" in out and "smollm2-135m" in out and "134.5M" in out


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "neither a known model name" in capsys.readouterr().err


def test_cta_counts_are_positive_integers_or_auto(capsys):
    import pytest

    for bad in ("0", "-4", "many"):
        with pytest.raises(SystemExit):
            main(["bench", "decode", "--ctas", bad])
        assert "a CTA count is a positive integer or 'auto'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="the sweep adds the autotuned choice"):
        main(["bench", "cta", "--ctas", "16", "auto"])


def test_gpu_benchmarks_refuse_a_machine_without_one(capsys, tmp_path, monkeypatch):
    import jax
    import pytest

    from sparda_jax.bench import RESULTS, default_out

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is here: the benchmarks would run")
    for name in ("select", "attention", "train", "copy"):
        assert main(["bench", name]) == 2
        err = capsys.readouterr().err
        assert f"bench {name} needs a CUDA GPU: it times" in err
        assert ("--allow-cpu" in err) == (name != "copy")
    # default results land in the repository's results folder, wherever the command runs
    monkeypatch.chdir(tmp_path)
    assert default_out("select/select.json") == str(RESULTS / "select" / "select.json")
    assert RESULTS.is_absolute() and (RESULTS / "README.md").is_file()


def test_removed_copy_options_are_refused():
    """The engine's copy experiments that lost left the CLI with the engine: asking for one is a
    usage error, not a silent default (--copy-start is realmodel's; decode and cta time the
    lanes, as their claims were measured)."""
    import pytest

    for bad in (["--copy-group", "4"], ["--copy-start", "one"], ["--overlap"], ["--topk-impl", "xla"]):
        with pytest.raises(SystemExit):
            main(["bench", "decode", *bad])


def test_launch_queues_are_set_before_the_gpu_starts(monkeypatch, capsys):
    from sparda_jax import runtime

    monkeypatch.delenv(runtime.LAUNCH_QUEUES, raising=False)
    with pytest.raises(ValueError, match="one of"):
        runtime.set_launch_queues("3x")
    assert main(["--launch-queues", "2x", "info"]) == 0  # no GPU here: set, and harmless
    assert os.environ[runtime.LAUNCH_QUEUES] == "2x"
    assert runtime.set_launch_queues("4x") == "2x"  # a value in the environment wins
    monkeypatch.setattr(runtime, "_gpu_started", lambda: True)  # as if JAX already ran on a GPU
    with pytest.raises(RuntimeError, match="before JAX first uses the GPU"):
        runtime.set_launch_queues("4x", override=True)
    assert os.environ[runtime.LAUNCH_QUEUES] == "2x"  # unchanged: CUDA would not see it
    assert main(["--launch-queues", "0.5x", "info"]) == 0  # the command still runs (the value in effect: 2x)
    monkeypatch.delenv(runtime.LAUNCH_QUEUES)
    assert main(["--launch-queues", "4x", "info"]) == 0
    assert "must be set before JAX first uses the GPU" in capsys.readouterr().err  # said, not silently ignored
    assert runtime.LAUNCH_QUEUES not in os.environ


@pytest.mark.gpu
def test_the_cli_sets_launch_queues_before_cuda_starts():
    """On a GPU machine: the CLI's in-process setting reaches CUDA only if nothing initialised the
    driver before main() sets it. A fresh process that imports the CLI finds the driver not yet
    started, and JAX's first device query starts it."""
    import subprocess
    import sys

    code = ("import sparda_jax.cli, sparda_jax.runtime as r; a = r._cuda_driver_started(); "
            "import jax; jax.devices(); print(a, r._cuda_driver_started())")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_SCALE_LAUNCH_QUEUES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_a_deep_gpu_decode_warns_once_about_default_launch_queues(monkeypatch):
    import warnings

    from sparda_jax import runtime

    monkeypatch.delenv(runtime.LAUNCH_QUEUES, raising=False)
    monkeypatch.setattr(runtime, "_warned", False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        runtime.warn_if_default_launch_queues(8)  # shallow: the queues hold its launches
        runtime.warn_if_default_launch_queues(32)
        runtime.warn_if_default_launch_queues(32)  # once per process
    assert len(w) == 1 and "CUDA_SCALE_LAUNCH_QUEUES=4x" in str(w[0].message)


def test_a_second_process_loads_the_first_ones_compiled_programs(tmp_path):
    """The CLI keeps compiled programs on disk (`runtime.enable_compilation_cache`): a second
    process that compiles the same program finds it there and stores nothing new; with
    --no-compile-cache nothing is written."""
    import subprocess
    import sys

    code = ("import sys; from sparda_jax.cli import main; import jax, jax.numpy as jnp; "
            "sys.exit(main(sys.argv[1:] + ['info', '--model', 'tiny']) or "
            "int(jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((256, 256))) != 256 * 256 * jnp.tanh(256.0)))")
    env = {**os.environ, "SPARDA_JAX_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}

    def run(*flags):
        out = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        d = tmp_path / "cache" / "xla"
        return sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) if d.exists() else []

    assert run("--no-compile-cache") == []
    first = run()
    assert any(n.startswith("jit__lambda") for n, _ in first), first
    # the second process loaded every program: no entry was written again (a miss rewrites its entry)
    assert run() == first


def test_info_knows_the_adapted_preset_and_a_backend_that_cannot_run_is_an_error_line(capsys, monkeypatch):
    """`info --model smollm2-135m-sparse` prints its (base model's) shapes; a NotImplementedError
    (a GPU-only backend forced on the CPU: `ops._dispatch`) ends with one 'sparda: error:' line,
    exit 2, not a traceback."""
    from sparda_jax import cli

    assert main(["--no-compile-cache", "info", "--model", "smollm2-135m-sparse"]) == 0
    assert "smollm2-135m-sparse" in capsys.readouterr().out

    def gpu_only(args):
        raise NotImplementedError("the Mosaic GPU selectors need a Hopper GPU")

    monkeypatch.setattr(cli, "_cmd_info", gpu_only)
    assert main(["--no-compile-cache", "info"]) == 2
    assert capsys.readouterr().err.strip() == "sparda: error: the Mosaic GPU selectors need a Hopper GPU"
