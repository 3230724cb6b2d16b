"""The CLI's admission checks: each bad input is answered with one line naming the problem and
exit code 2, no traceback, and (where the check needs no model) before the model loads. The
model loader is replaced by the tiny preset with random weights, so no row loads SmolLM2."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from sparda_jax import api
from sparda_jax.api import Pretrained, init_model
from sparda_jax.cli import main
from sparda_jax.config import get_preset

from byte_tokenizer import ByteTokenizer

TINY = get_preset("tiny")  # max_position_embeddings 4096 = 256 blocks of 16; forced blocks 3


@pytest.fixture(scope="module")
def tiny_params():
    return init_model(TINY, jax.random.key(0))


@pytest.fixture
def loads(monkeypatch, tiny_params):
    """load_pretrained -> the tiny model; returns the list of names loaded."""
    loaded = []

    def load(name, **kw):
        loaded.append(name)
        return Pretrained(TINY, tiny_params, ByteTokenizer())

    monkeypatch.setattr(api, "load_pretrained", load)
    return loaded


def _files(tmp_path):
    """A directory, a file, and Forecast files of the tiny model's shapes: random bytes; all NaN."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "r.md").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "random.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    shapes = {"f0_cur": (64, 2, 16), "f": (2, 64, 2, 16)}
    save_file({n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}, str(tmp_path / "nan.safetensors"))


# (id, argv with {tmp} for the test's folder, message fragment, True if refused before loading)
ROWS = [
    ("generate --topk 0", ["generate", "--prompt", "x", "--topk", "0"], "SparseConfig.topk: must be >= 1", False),
    ("generate --topk below forced", ["generate", "--prompt", "x", "--topk", "2"],
     "SparseConfig.topk: (2) counts the forced blocks and must be >= init_blocks + local_blocks + 1 = 3", False),
    ("generate --topk 100000", ["generate", "--prompt", "x", "--topk", "100000"],
     "--topk 100000 exceeds the 256 blocks of tiny's whole context", False),
    ("eval --topk 2000", ["eval", "--topk", "2000"], "--topk 2000 exceeds the 256 blocks", False),
    ("eval --dense-layers 3", ["eval", "--dense-layers", "1,3"], "--dense-layers names layer 3; tiny has layers 0..2",
     False),
    ("eval --lengths 20000", ["eval", "--suite", "selection", "--lengths", "1024", "20000"],
     "--lengths 20000 exceeds tiny's context of 4096 tokens", False),
    ("demo --json dir", ["demo", "--json", "{tmp}/dir"], "is a directory; give a file path", True),
    ("demo --json under a file", ["demo", "--json", "{tmp}/file/out.json"], "cannot be created: {tmp}/file is a file",
     True),
    ("eval --out dir", ["eval", "--out", "{tmp}/dir"], "is a directory; give a file path", True),
    ("eval --out: the .md beside it is a dir", ["eval", "--out", "{tmp}/r.json"], "{tmp}/r.md is a directory", True),
    ("train --out file", ["train", "--out", "{tmp}/file"], "is an existing file; the run needs a directory", True),
    ("eval --forecast missing", ["eval", "--forecast", "{tmp}/none.safetensors"], "Forecast file not found", True),
    ("eval --forecast random bytes", ["eval", "--forecast", "{tmp}/random.safetensors"],
     "{tmp}/random.safetensors: not a readable safetensors file", False),
    ("eval --forecast NaN", ["eval", "--forecast", "{tmp}/nan.safetensors"],
     "{tmp}/nan.safetensors: tensor f0_cur has 2048 non-finite values", False),
    ("demo --forecast missing", ["demo", "--forecast", "{tmp}/none.safetensors"], "Forecast file not found", True),
    ("generate --forecast missing", ["generate", "--prompt", "x", "--forecast", "{tmp}/none.safetensors"],
     "Forecast file not found", True),
    ("demo --forecast random bytes", ["demo", "--forecast", "{tmp}/random.safetensors"],
     "{tmp}/random.safetensors: not a readable safetensors file", False),
    ("generate --forecast NaN", ["generate", "--prompt", "x", "--system", "sparda", "--forecast", "{tmp}/nan.safetensors"],
     "{tmp}/nan.safetensors: tensor f0_cur has 2048 non-finite values", False),
    ("bench copy on a CPU", ["bench", "copy"], "bench copy needs a CUDA GPU", True),
]


@pytest.mark.parametrize("argv,message,before_load", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_and_exit_2(argv, message, before_load, tmp_path, loads, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert jax.default_backend() == "cpu"  # the bench copy row's premise
    assert main(["--no-compile-cache", *argv]) == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("sparda: error:")]
    assert len(lines) == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in lines[0], err
    assert "Traceback" not in err
    if before_load:
        assert loads == []
    else:
        # the demo's default is the sparse-native model, the other commands' the base model
        assert loads == ["smollm2-135m-sparse" if argv[0] == "demo" else "smollm2-135m"]


# argparse refuses these itself: usage plus one error line, exit code 2
USAGE = [
    ("eval --seqs 0", ["eval", "--suite", "selection", "--seqs", "0"], "--seqs: must be a positive integer, got '0'"),
    ("generate --steps-per-call 0", ["generate", "--prompt", "x", "--steps-per-call", "0"],
     "--steps-per-call: must be a positive integer, got '0'"),
    ("generate --max-new-tokens 0", ["generate", "--prompt", "x", "--max-new-tokens", "0"],
     "--max-new-tokens: must be a positive integer, got '0'"),
    ("eval --samples 0", ["eval", "--samples", "0"], "--samples: must be a positive integer, got '0'"),
    ("eval --lengths -5", ["eval", "--lengths", "-5"], "--lengths: must be a positive integer"),
    ("train --eval-every -1", ["train", "--out", "x", "--eval-every", "-1"],
     "--eval-every: must be an integer >= 0, got '-1'"),
    ("finetune --select-layers 19-15", ["finetune", "--out", "x", "--select-layers", "19-15"],
     "--select-layers: layers as 15-19 or 3,7,15-19"),
    ("finetune --select-layers x", ["finetune", "--out", "x", "--select-layers", "a,3"],
     "--select-layers: layers as 15-19 or 3,7,15-19"),
    ("generate --dense-layers x", ["generate", "--prompt", "x", "--dense-layers", "all"],
     "--dense-layers: layers as 15-19 or 3,7,15-19"),
]


def test_layer_lists_parse_to_ascending_indices():
    from sparda_jax.cli import _layer_list

    assert _layer_list("15-19") == (15, 16, 17, 18, 19)
    assert _layer_list("7,3,15-16,3") == (3, 7, 15, 16)
    from sparda_jax.cli import _dense_layer_list

    assert _dense_layer_list("None") == () and _dense_layer_list("18") == (18,)


@pytest.mark.parametrize("argv,message", [u[1:] for u in USAGE], ids=[u[0] for u in USAGE])
def test_argparse_refuses(argv, message, loads, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert loads == []


def test_train_eval_every_0_means_never(tmp_path, loads, capsys):
    """--eval-every 0 trains without the held-out recall (no ZeroDivisionError) and finishes."""
    out = tmp_path / "run"
    assert main(["--no-compile-cache", "train", "--out", str(out), "--seq-len", "64", "--steps", "2", "--batch", "2",
                 "--micro-batch", "1", "--train-dtype", "float32", "--eval-every", "0", "--save-every", "2"]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert not any("recall" in r for r in rows)
    assert (out / "forecast.safetensors").is_file()


def test_a_failed_final_write_lands_in_a_fallback(tmp_path, monkeypatch, capsys):
    from sparda_jax.runtime import write_result as _write_result

    monkeypatch.chdir(tmp_path)
    blocked = tmp_path / "file"
    blocked.write_text("x")  # a file where the result's folder should be: the write fails
    got = _write_result(blocked / "out.json", '{"rows": [1]}')
    assert got.parent == tmp_path and got.name.startswith("out-") and got.suffix == ".json"
    assert got.read_text() == '{"rows": [1]}'
    assert "could not write" in capsys.readouterr().err
    assert _write_result(tmp_path / "ok" / "r.json", "{}") == tmp_path / "ok" / "r.json"


def test_generate_refuses_a_state_larger_than_memory(monkeypatch, tiny_params, loads, capsys):
    from sparda_jax.infer import memory
    from sparda_jax.infer.engine import EngineConfig, memory_report
    from sparda_jax.forecast import init_forecast
    from sparda_jax.infer.generate import SamplingConfig, generate

    need = memory_report(TINY, batch=2, context=4096, system="sparda", dtype="float32")
    weights = sum(a.nbytes for a in jax.tree.leaves(tiny_params))
    # a host just too small for the offloaded K/V (the CPU's "device" shares it), then large enough
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: int((need["host total"] + need["device total"] + weights)
                                                              / memory.HOST_MARGIN) - 1)
    monkeypatch.setattr(memory, "device_memory_limit", lambda: None)
    args = (tiny_params, TINY, [[5, 6, 7], [8, 9]], SamplingConfig(max_new_tokens=4096 - 64))
    with pytest.raises(memory.InsufficientMemory, match=r"batch 2 x 4096 tokens in system 'sparda'.*host needs"):
        generate(*args, engine=EngineConfig(system="sparda"))
    f = init_forecast(TINY, jax.random.key(1))
    out = generate(*args[:3], SamplingConfig(max_new_tokens=2), engine=EngineConfig(system="sparda"), forecast=f)
    assert [len(o) for o in out] == [2, 2]
    # the CLI's answer: one line, exit 2
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 10**6)
    assert main(["--no-compile-cache", "generate", "--prompt", "x", "--raw", "--max-new-tokens", "4000",
                 "--system", "sparda"]) == 2
    assert "does not fit this machine" in capsys.readouterr().err


def test_demo_takes_a_forecast_file_and_an_adapter_reaches_the_loader(tmp_path, loads, monkeypatch):
    """`demo --forecast FILE` hands that file's Forecast to the retrieval run (default: None, the
    model's shipped one); `--adapter FILE` reaches load_pretrained."""
    from sparda_jax import init_forecast
    from sparda_jax.infer import demo
    from sparda_jax.io.forecast_file import load_forecast, save_forecast

    f = init_forecast(TINY, jax.random.key(7))
    save_forecast(tmp_path / "f.safetensors", f, TINY)
    seen = []
    monkeypatch.setattr(demo, "run_retrieval", lambda model, **kw: seen.append(kw["forecast"]) or [])
    monkeypatch.setattr(demo, "results_table", lambda results: "")
    kw = {}
    monkeypatch.setattr(api, "load_pretrained",
                        lambda name, **k: kw.update(k) or Pretrained(TINY, init_model(TINY, jax.random.key(0)),
                                                                      ByteTokenizer()))
    assert main(["--no-compile-cache", "demo", "--context", "1024", "--forecast", str(tmp_path / "f.safetensors"),
                 "--adapter", str(tmp_path / "a.safetensors")]) == 0
    jax.tree.map(np.testing.assert_array_equal, seen[0], load_forecast(tmp_path / "f.safetensors", TINY))
    assert kw["adapter"] == str(tmp_path / "a.safetensors")
    assert main(["--no-compile-cache", "demo", "--context", "1024"]) == 0 and seen[1] is None
