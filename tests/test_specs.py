"""The named benchmark specs are well-formed: each command parses with the real CLI parser and names
only options that parser defines, names are unique, there are at most 20, and every result lands
under <out>/<benchmark>/."""
import argparse
import sys
from pathlib import Path

import pytest

from sparda_jax.bench import specs as S
from sparda_jax.cli import build_parser

# engine flags that leave the CLI with issue 27 (the engine keeps the measured best): no spec may use them
REMOVED_FLAGS = ("--copy-start", "--copy-group", "--skip-copies", "--graph-scheduling", "--copy-in-graph",
                 "--no-copy-in-graph", "--topk-impl")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_names_unique_and_under_twenty():
    names = [s.name for s in S.SPECS]
    assert len(names) == len(set(names)), names
    assert 0 < len(names) <= 20
    assert set(S.BY_NAME) == set(names)


@pytest.mark.parametrize("spec", [s for s in S.SPECS if s.argv is not None], ids=lambda s: s.name)
def test_spec_parses_with_the_cli(spec, tmp_path):
    parser = build_parser()
    cmd = spec.command(tmp_path)
    assert cmd[:3] == [sys.executable, "-m", "sparda_jax.cli"]
    args = parser.parse_args(cmd[3:])  # SystemExit (a failure) on an unknown option or bad value
    assert args.cmd == spec.argv[0]
    assert Path(args.out) == tmp_path / spec.benchmark / f"{spec.name}.json"
    if args.cmd == "bench":
        assert args.name == spec.benchmark  # the folder is the bench subcommand's name
    # every option token spelled exactly as the subcommand defines it (argparse would accept a prefix)
    defined = set(_subparser(parser, spec.argv[0])._option_string_actions)
    used = [t for t in spec.argv if t.startswith("--")]
    assert set(used) <= defined, set(used) - defined
    assert not set(used) & set(REMOVED_FLAGS)


def test_eval_specs_name_real_tasks():
    from sparda_jax.eval.tasks import TASKS

    for s in S.SPECS:
        if s.argv and "--tasks" in s.argv:
            i = s.argv.index("--tasks") + 1
            tasks = []
            while i < len(s.argv) and not s.argv[i].startswith("--"):
                tasks.append(s.argv[i])
                i += 1
            assert tasks and set(tasks) <= set(TASKS), (s.name, tasks)


def test_outputs_under_out_benchmark(tmp_path):
    for s in S.SPECS:
        out = s.out_path(tmp_path)
        assert out.parent == tmp_path / s.benchmark and out.name == f"{s.name}.json"
        assert 0 < s.timeout_s <= 600, s.name  # the device tool's limit for one command
        assert s.claim
    gpu = S.BY_NAME["gpu-tests"].command(tmp_path)
    assert gpu[1:4] == ["-m", "pytest", "-m"] and gpu[4] == "gpu"
    assert gpu[-1] == f"--junitxml={tmp_path / 'gpu_tests' / 'gpu-tests.xml'}"


def test_runner_writes_record_under_benchmark_folder(tmp_path, monkeypatch):
    """run_spec runs the command and records its exit status and log under <out>/<benchmark>/."""
    spec = S.Spec("echo", "copy", ("info", "--model", "no-such-preset"), 60, "a test")
    monkeypatch.setattr(S.Spec, "command", lambda self, out: [sys.executable, "-c", "print('hi'); raise SystemExit(3)"])
    rc = S.run_spec(spec, tmp_path)
    assert rc == 3
    import json
    rec = json.loads((tmp_path / "copy" / "echo.run.json").read_text())
    assert rec["returncode"] == 3 and rec["spec"] == "echo" and rec["log_tail"] == ["hi"]
    assert (tmp_path / "copy" / "echo.log").read_text() == "hi\n"


def test_main_rejects_unknown_spec(capsys):
    with pytest.raises(SystemExit):
        S.main(["no-such-spec", "--out", "/tmp/x"])
    assert S.main(["--list"]) == 0
    assert "decode-split4" in capsys.readouterr().out
