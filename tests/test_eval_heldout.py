"""Held-out text for the selection and copy suites (token corpus splits), the copy suite's
sequences and source-block share, the goal checks, and their CLI plumbing, on the tiny preset
with random weights and a byte tokenizer."""

from __future__ import annotations

import hashlib
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparda_jax import api
from sparda_jax.api import Pretrained, init_model
from sparda_jax.cli import main
from sparda_jax.config import get_preset
from sparda_jax.eval import report
from sparda_jax.eval.copy import CopySequence, copy_sequence, eval_copy, source_share
from sparda_jax.eval.goals import goal_checks, goals_markdown, goals_text, native_goal_checks
from sparda_jax.eval.heldout import corpus_texts, python_docs_text
from sparda_jax.text import corpus_split, haystack_from_tokens, haystack_tokens, python_docs_corpus

from byte_tokenizer import ByteTokenizer

TINY = get_preset("tiny")  # blocks of 16, init 1, local 1, topk 4; vocabulary 256
EOS = 0
SPLITS = ("train", "heldout", "eval-info", "eval-man", "eval-licenses")


# ------------------------------------------------------------------------- the fixture corpus

def _stand_in_corpus() -> types.ModuleType:
    """A test-only reader of the sparda-tokens/1 format, used while sparda_jax.corpus is absent
    (the corpus branch delivers the real one; the tests then run against it)."""
    mod = types.ModuleType("sparda_jax.corpus")

    def load_split(directory, split, *, verify=True):
        m = json.loads((directory / "manifest.json").read_text())
        parts = []
        for sh in m["splits"][split]["shards"]:
            path = directory / sh["file"]
            if verify and hashlib.sha256(path.read_bytes()).hexdigest() != sh["sha256"]:
                raise ValueError(f"{path}: sha256 mismatch")
            parts.append(np.load(path))
        return np.concatenate(parts)

    def split_documents(tokens, eos_id):
        ends = np.flatnonzero(tokens == eos_id)
        return [d for d in np.split(tokens, ends + 1) if d.size]  # each keeps its eos

    mod.load_split, mod.split_documents = load_split, split_documents
    return mod


@pytest.fixture
def corpus_module(monkeypatch):
    try:
        import sparda_jax.corpus as mod  # noqa: F401
    except ImportError:
        monkeypatch.setitem(sys.modules, "sparda_jax.corpus", _stand_in_corpus())


def _doc(rng, n, lo, hi):
    """A document of n tokens drawn from [lo, hi) (never the eos)."""
    return rng.integers(lo, hi, n).astype(np.uint16)


def write_corpus(directory, sizes: dict[str, list[int]], vocab_size: int = 256, seed: int = 0):
    """A token corpus in the sparda-tokens/1 format: per split, documents of the given sizes,
    each followed by EOS, in two shards. Split s draws its tokens from its own range."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    splits = {}
    for i, (name, docs) in enumerate(sizes.items()):
        stream = np.concatenate([np.append(_doc(rng, n, 2 + 40 * i, 42 + 40 * i), np.uint16(EOS)) for n in docs])
        half = stream.size // 2
        shards = []
        for j, part in enumerate((stream[:half], stream[half:])):
            f = f"{name}-{j:03d}.npy"
            np.save(directory / f, part)
            shards.append({"file": f, "tokens": int(part.size),
                           "sha256": hashlib.sha256((directory / f).read_bytes()).hexdigest()})
        splits[name] = {"shards": shards, "documents": len(docs), "tokens": int(stream.size)}
    (directory / "manifest.json").write_text(json.dumps(
        {"format": "sparda-tokens/1", "tokenizer": {"model": "bytes", "vocab_size": vocab_size, "eos_id": EOS},
         "splits": splits}))
    return directory


@pytest.fixture(scope="module")
def tiny_params():
    return init_model(TINY, jax.random.key(0))


@pytest.fixture
def tiny(tiny_params):
    return Pretrained(TINY, tiny_params, ByteTokenizer())


@pytest.fixture
def loads(monkeypatch, tiny):
    loaded = []

    def load(name, **kw):
        loaded.append(name)
        return tiny

    monkeypatch.setattr(api, "load_pretrained", load)
    return loaded


# ------------------------------------------------------------------------------------ windows

def test_haystack_from_tokens_equals_haystack_tokens_on_the_default_text():
    enc = ByteTokenizer().encode
    docs = python_docs_text(enc).docs
    eval_docs = corpus_split(python_docs_corpus(), "eval")
    for seed in (0, 7):
        got = haystack_from_tokens(docs, 5000, seed)
        assert got.dtype == np.int32 and got.shape == (5000,)
        assert got.tolist() == haystack_tokens(enc, 5000, seed=seed, docs=eval_docs)
    with pytest.raises(ValueError, match="hold 10 tokens, fewer than the 11 asked for"):
        haystack_from_tokens([np.arange(4), np.arange(6)], 11)


# -------------------------------------------------------------------------- copy sequences

# SmolLM2's budget: blocks of 64, 1 init block, 8 local blocks
SMOL = dict(block_size=64, init_blocks=1, local_blocks=8)


def _range_docs(n_docs=8, size=1000):
    """Even documents hold tokens in [1000, 2000), odd ones in [3000, 4000)."""
    rng = np.random.default_rng(1)
    return [rng.integers(1000 if i % 2 == 0 else 3000, 2000 if i % 2 == 0 else 4000, size) for i in range(n_docs)]


def test_copy_sequence_layout():
    docs = _range_docs()
    s = copy_sequence(docs, 4096, seed=3, **SMOL)
    t, p = s.tokens, s.passage_tokens
    assert t.dtype == np.int32 and t.shape == (4096,) and p == 256
    assert s.source == 2 * 64 and s.repeat == 4096 - 256  # after init_blocks + 1 blocks; the repeat ends it
    assert s.source // 64 > SMOL["init_blocks"]  # a filler block follows the init block: the source is content
    assert np.array_equal(t[s.source:s.source + p], t[s.repeat:])
    passage = np.r_[s.source:s.source + p]
    filler = np.setdiff1d(np.arange(s.repeat), passage)
    assert np.all((t[passage] >= 1000) & (t[passage] < 2000))  # passage: even documents only
    assert np.all((t[filler] >= 3000) & (t[filler] < 4000))  # filler: odd documents only
    assert s.repeat - s.source == 3712  # the repeat starts ~3.5K tokens after its source at 4K
    again = copy_sequence(docs, 4096, seed=3, **SMOL)
    assert np.array_equal(again.tokens, t)
    assert not np.array_equal(copy_sequence(docs, 4096, seed=4, **SMOL).tokens, t)


def test_copy_sequence_refuses_lengths_without_room():
    docs = _range_docs()
    # 128 prefix + 2 x 256 passage + a gap keeping the source out of the 8-block local window:
    # the repeat must start >= 9 * 64 + 1 = 577 tokens after the source, so 321 filler tokens
    s = copy_sequence(docs, 961, seed=0, **SMOL)
    for j in range(1, 256):  # the predicted token's source block lies outside every query's local window
        assert (s.repeat + j) // 64 - (s.source + j + 1) // 64 > SMOL["local_blocks"]
    with pytest.raises(ValueError, match="length 960 leaves no room .* the shortest length is 961"):
        copy_sequence(docs, 960, seed=0, **SMOL)
    with pytest.raises(ValueError, match="leaves no room"):
        copy_sequence(docs, 500, seed=0, **SMOL)
    with pytest.raises(ValueError, match="filler documents hold 4000 tokens, fewer than the 4096 filler tokens"):
        copy_sequence(docs, 4608, seed=0, **SMOL)
    with pytest.raises(ValueError, match="at least 2 documents"):
        copy_sequence(docs[:1], 1024, seed=0, **SMOL)
    # the passage's text is the filler's (which holds the whole document): no draw is free of it
    same = [docs[0][:300], docs[0][:300].copy()] * 3
    with pytest.raises(ValueError, match="free of 32-token runs"):
        copy_sequence(same, 1024, seed=0, **SMOL)


# ---------------------------------------------------------------------- source-block share

def _seq(source=40, repeat=200, p=24, length=224):
    return CopySequence(np.zeros(length, np.int32), source, repeat, p)


def _by_hand(ids, seq, bs, shift):
    """Per layer: rows (b, k, query at repeat offset 1 .. P-1) whose selection holds the block
    of source + j + shift."""
    L, B, K = ids.shape[:3]
    hits = [0] * L
    for layer in range(L):
        for b in range(B):
            for k in range(K):
                for j in range(1, seq.passage_tokens):
                    if (seq.source + j + shift) // bs in set(ids[layer, b, k, seq.repeat + j].tolist()):
                        hits[layer] += 1
    return np.array(hits), B * K * (seq.passage_tokens - 1)


def test_source_share_against_a_hand_count():
    seq, bs, L, K, n = _seq(), 16, 4, 2, 3
    ids = np.full((L, 1, K, seq.repeat + seq.passage_tokens, n), -1, np.int32)
    ids[..., 0] = 0  # the init block is always chosen; it never holds the source here
    target = (seq.source + np.arange(seq.passage_tokens) + 1) // bs  # by query offset j

    def share(x, shift=1):
        h, r = source_share(jnp.asarray(x), seq, block_size=bs, shift=shift)
        return h.sum() / r.sum(), h / r

    always = ids.copy()
    always[:, :, :, seq.repeat:, 1] = target
    assert share(always)[0] == 1.0
    assert share(ids)[0] == 0.0
    half = ids.copy()
    half[:2] = always[:2]  # the first two of four layers
    total, per_layer = share(half)
    assert total == 0.5 and per_layer.tolist() == [1.0, 1.0, 0.0, 0.0]
    # the copy share (shift 0) of a selection holding the next token's source block: the queries
    # whose own token's copy sits in the same block, counted independently
    h0, rows = _by_hand(always, seq, bs, shift=0)
    assert 0 < h0[0] < rows
    got_h, got_r = source_share(always, seq, block_size=bs, shift=0)
    assert got_h.tolist() == h0.tolist() and got_r.tolist() == [rows] * L
    # a scattered selection, one KV head only on some queries
    rng = np.random.default_rng(0)
    mixed = rng.integers(-1, (seq.repeat + seq.passage_tokens) // bs, ids.shape).astype(np.int32)
    for shift in (0, 1):
        h, r = _by_hand(mixed, seq, bs, shift)
        got_h, got_r = source_share(mixed, seq, block_size=bs, shift=shift)
        assert got_h.tolist() == h.tolist() and set(got_r.tolist()) == {r}


# ------------------------------------------------------------------------ suites end to end

def test_eval_copy_rows_and_nll_span(tmp_path, tiny, corpus_module):
    """The copy NLL is the mean NLL of the repeat's tokens, checked against the dense logits of
    the whole sequence; Sparse's selection is its own oracle."""
    d = write_corpus(tmp_path / "c", {"eval-man": [400] * 6, "eval-info": [300] * 8})
    texts = corpus_texts(d, ["eval-man", "eval-info"], vocab_size=TINY.vocab_size)
    r = eval_copy(tiny, lengths=(640,), samples=2, modes=("dense", "sparse"), texts=texts, progress=False)
    rows = {(x["split"], x["mode"]): x for x in r["rows"]}
    assert set(rows) == {(s, m) for s in ("eval-man", "eval-info") for m in ("dense", "sparse")}
    assert r["splits"]["eval-man"]["documents"] == 6 and "eval-info" in r["text"]
    sp = TINY.sparse
    for i, split in enumerate(("eval-man", "eval-info")):
        seq = copy_sequence(texts[i].docs, 640, 0, block_size=sp.block_size, init_blocks=sp.init_blocks,
                            local_blocks=sp.local_blocks)
        lp = np.asarray(jax.nn.log_softmax(tiny.logits(seq.tokens[None])[0], axis=-1))
        want = -float(np.mean([lp[p - 1, seq.tokens[p]] for p in range(seq.repeat, 640)]))
        dense = rows[split, "dense"]
        assert dense["copy_nll_per_sample"][0] == pytest.approx(want, rel=1e-4)
        assert "source_share" not in dense
        sparse = rows[split, "sparse"]
        assert sparse["source_share"] == sparse["oracle_source_share"]
        assert sparse["source_share_per_layer"] == sparse["oracle_source_share_per_layer"]
        assert len(sparse["source_share_per_layer"]) == TINY.num_layers and 0 <= sparse["copy_share"] <= 1
        assert (sparse["source_start"], sparse["repeat_start"]) == (seq.source, seq.repeat)


def test_dense_layers_select_nothing_in_the_suites(tmp_path, tiny_params, corpus_module):
    """A dense layer (`sparse.dense_layers`) computes a selection it does not read: the copy
    suite gives it no source share (the pooled share is the other layers'), the selection suite
    no recall and all of its attention mass."""
    import dataclasses

    from sparda_jax.eval.selection import eval_selection

    config = TINY.replace(sparse=dataclasses.replace(TINY.sparse, dense_layers=(1,)))
    model = Pretrained(config, tiny_params, ByteTokenizer())
    d = write_corpus(tmp_path / "c", {"eval-man": [400] * 6})
    texts = corpus_texts(d, ["eval-man"], vocab_size=TINY.vocab_size)
    r = eval_copy(model, lengths=(640,), samples=2, modes=("sparse",), texts=texts, progress=False)
    row = r["rows"][0]
    per = row["source_share_per_layer"]
    assert per[1] is None and None not in (per[0], per[2]) and r["budget"]["dense_layers"] == [1]
    # equal rows per layer; the per-layer shares are rounded to 4 digits
    assert row["source_share"] == pytest.approx((per[0] + per[2]) / 2, abs=1e-4)
    s = eval_selection(model, lengths=(640,), n_seqs=1, modes=("sparse",), texts=texts, progress=False)["rows"][0]
    assert s["recall_per_layer"][1] is None and s["recall"] == 1.0  # InfLLM-V2 is its own oracle elsewhere
    assert s["attention_mass_per_layer"][1] == 1.0 and s["attention_mass_per_layer"][0] < 1


def test_cli_selection_and_copy_on_corpus_splits(tmp_path, loads, corpus_module, capsys):
    d = write_corpus(tmp_path / "c", {s: [300] * 6 for s in SPLITS})
    out = tmp_path / "sel.json"
    assert main(["--no-compile-cache", "eval", "--suite", "selection", "--text", str(d), "--splits", "eval-info",
                 "eval-man", "--lengths", "256", "--seqs", "1", "--modes", "dense", "sparse", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["split"], r["mode"]) for r in res["rows"]] == [
        ("eval-info", "dense"), ("eval-info", "sparse"), ("eval-man", "dense"), ("eval-man", "sparse")]
    assert "'eval-info'" in res["text"] and "'eval-man'" in res["text"]
    assert set(res["splits"]) == {"eval-info", "eval-man"} and res["environment"]["commit"]
    md = out.with_suffix(".md").read_text()
    assert "**eval-info**" in md and "**eval-man**" in md
    cp = tmp_path / "copy.json"
    assert main(["--no-compile-cache", "eval", "--suite", "copy", "--text", str(d), "--lengths", "640",
                 "--samples", "1", "--modes", "sparse", "--out", str(cp)]) == 0
    res = json.loads(cp.read_text())
    assert [r["split"] for r in res["rows"]] == ["eval-info", "eval-man", "eval-licenses"]  # default: eval-*
    assert "source 640" in cp.with_suffix(".md").read_text()
    assert "Goals: none checkable" in cp.with_suffix(".md").read_text()  # no sparda rows here
    merged = tmp_path / "all.md"
    assert report.main([str(merged), str(out), str(cp)]) == 0
    text = merged.read_text()
    assert "**eval-man**" in text and "source share per layer" in text and "at commit" in text


@pytest.mark.parametrize("argv,message,before_load", [
    (["--suite", "copy", "--splits", "eval-man"], "--splits names splits of a token corpus: give its directory", True),
    (["--suite", "tasks", "--text", "{d}"], "--text applies to the selection and copy suites, not tasks", True),
    (["--suite", "copy", "--text", "{d}/none"], "corpus directory not found: {d}/none", True),
    (["--suite", "copy", "--text", "{d}", "--splits", "eval-xyz"],
     "split 'eval-xyz' is not in {d}; its splits are train, heldout, eval-info, eval-man, eval-licenses", True),
    (["--suite", "selection", "--text", "{d}", "--splits", "eval-man", "--lengths", "2048"],
     "split 'eval-man' holds 903 tokens, fewer than the 2048 of a window (--lengths)", False),
    (["--suite", "copy", "--text", "{d}", "--splits", "eval-man", "--lengths", "900"],
     "split 'eval-man': the filler documents hold 301 tokens, fewer than the 388 filler tokens", False),
])
def test_cli_refuses_bad_text(tmp_path, loads, corpus_module, capsys, argv, message, before_load):
    d = write_corpus(tmp_path / "c", {"train": [100] * 4, "heldout": [100] * 2, "eval-info": [100] * 2,
                                      "eval-man": [300] * 3, "eval-licenses": [100] * 2})
    assert main(["--no-compile-cache", "eval", *(a.format(d=d) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert message.format(d=d) in err and "Traceback" not in err
    assert (loads == []) == before_load


def test_corpus_texts_refuses_foreign_corpora(tmp_path, corpus_module):
    d = write_corpus(tmp_path / "c", {"eval-man": [50] * 3}, vocab_size=49152)
    with pytest.raises(ValueError, match="not the model's vocabulary of 256"):
        corpus_texts(d, ["eval-man"], vocab_size=256)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        corpus_texts(tmp_path, ["eval-man"], vocab_size=256)
    (d / "manifest.json").write_text(json.dumps({"format": "other/2"}))
    with pytest.raises(ValueError, match="format 'other/2', expected 'sparda-tokens/1'"):
        corpus_texts(d, ["eval-man"], vocab_size=256)


# ------------------------------------------------------------------------------------ goals

def _sel_row(split, length, mode, recall, ppl_late):
    return {"split": split, "length": length, "mode": mode, "recall": recall, "ppl_late": ppl_late, "ppl": ppl_late,
            "tokens_late": 100, "recall_hits": round(recall * 1000), "recall_total": 1000}


def test_goal_checks_thresholds_and_pooling():
    sel = {"rows": [_sel_row("a", 4096, "sparse", 1.0, 10.0), _sel_row("a", 4096, "sparda (trained)", 0.92, 10.1),
                    _sel_row("a", 8192, "sparse", 1.0, 10.0), _sel_row("a", 8192, "sparda (trained)", 0.879, 10.09),
                    _sel_row("b", 4096, "sparse", 1.0, 12.0), _sel_row("b", 4096, "sparda (trained)", 0.90, 12.2)]}
    copy = {"rows": [{"suite": "copy", "split": "a", "length": 4096, "mode": "sparse", "copy_nll": 1.0,
                      "copy_nll_per_sample": [0.9, 1.1]},
                     {"suite": "copy", "split": "a", "length": 4096, "mode": "sparda (trained)", "copy_nll": 1.15,
                      "copy_nll_per_sample": [1.1, 1.2]},
                     {"suite": "copy", "split": "b", "length": 4096, "mode": "sparse", "copy_nll": 2.0,
                      "copy_nll_per_sample": [2.0, 2.0]},
                     {"suite": "copy", "split": "b", "length": 4096, "mode": "sparda (trained)", "copy_nll": 2.4,
                      "copy_nll_per_sample": [2.4, 2.4]}]}
    got = {(c["goal"], c["split"], c["length"]): c for c in goal_checks(sel, copy)}
    assert got["copy NLL", "a", 4096]["passed"] and not got["copy NLL", "b", 4096]["passed"]
    # pooled: (1.1 + 1.2 + 2.4 + 2.4) / 4 = 1.775 against (0.9 + 1.1 + 2 + 2) / 4 = 1.5: 1.183
    pooled = got["copy NLL", "all splits", 4096]
    assert pooled["value"] == pytest.approx(1.775) and pooled["reference"] == pytest.approx(1.5)
    assert not pooled["passed"]
    assert got["recall", "a", 4096]["passed"] and not got["recall", "a", 8192]["passed"]
    assert got["recall", "all splits", 4096]["value"] == pytest.approx(0.91)  # (920 + 900) / 2000
    assert got["late-half ppl", "a", 4096]["passed"] and got["late-half ppl", "a", 8192]["passed"]
    assert not got["late-half ppl", "b", 4096]["passed"]  # 12.2 / 12 = 1.0167
    assert ("recall", "b", 8192) not in got  # not measured: no check
    text = goals_text(goal_checks(sel, copy))
    assert "- FAIL recall >= 0.88: sparda (trained) 0.879; a, 8192 tokens" in text
    assert "- PASS copy NLL <= 1.15 x sparse: sparda (trained) 1.150 vs sparse 1.000 (ratio 1.150); a, 4096" in text
    assert "none checkable" in goals_text(goal_checks({"rows": [_sel_row("a", 1024, "sparse", 1, 9)]}))
    # a split without the reference's row drops out of the pooled ratio (like with like)
    cut = {"rows": [r for r in copy["rows"] if not (r["split"] == "b" and r["mode"] == "sparse")]}
    pooled = {(c["goal"], c["split"]): c for c in goal_checks(None, cut)}["copy NLL", "all splits"]
    assert pooled["value"] == pytest.approx(1.15) and pooled["reference"] == pytest.approx(1.0)


def test_a_length_the_budget_covers_gets_no_verdict():
    rows = [{"suite": "copy", "split": "a", "length": n, "mode": m, "copy_nll": v, "copy_nll_per_sample": [v]}
            for n in (1024, 4096) for m, v in (("sparse", 1.0), ("sparda (trained)", 1.0))]
    budget = {"block_size": 64, "init_blocks": 1, "local_blocks": 8, "topk": 24}  # 1536 tokens
    got = {c["length"]: c for c in goal_checks(None, {"rows": rows, "budget": budget})}
    assert got[1024]["passed"] is None and got[4096]["passed"] is True
    text = goals_text(list(got.values()))
    assert "- n/a copy NLL" in text and "1024 tokens (the block budget covers every block: no verdict)" in text
    assert "- PASS copy NLL" in text
    assert goal_checks(None, {"rows": rows})[0]["passed"] is True  # no budget recorded: judged as before


def test_native_goal_checks_compare_sparse_with_its_own_dense_mode():
    sel = {"rows": [_sel_row("a", 4096, "dense", 1.0, 10.0), _sel_row("a", 4096, "sparse", 1.0, 10.1),
                    _sel_row("a", 8192, "dense", 1.0, 10.0), _sel_row("a", 8192, "sparse", 1.0, 10.11),
                    _sel_row("a", 4096, "sparda (trained)", 0.95, 99.0)]}
    copy = {"rows": [{"suite": "copy", "split": "a", "length": 4096, "mode": m, "copy_nll": v, "copy_nll_per_sample": [v]}
                     for m, v in (("dense", 0.5), ("sparse", 0.6), ("sparda (trained)", 9.0))]
            + [{"suite": "copy", "split": "a", "length": 8192, "mode": m, "copy_nll": v, "copy_nll_per_sample": [v]}
               for m, v in (("dense", 0.5), ("sparse", 0.61))]}
    got = {(c["goal"], c["length"]): c for c in native_goal_checks(sel, copy)}
    assert set(got) == {("copy NLL", 4096), ("copy NLL", 8192), ("late-half ppl", 4096), ("late-half ppl", 8192)}
    assert got["copy NLL", 4096]["passed"] and not got["copy NLL", 8192]["passed"]  # 1.2 exactly; 1.22
    assert got["late-half ppl", 4096]["passed"] and not got["late-half ppl", 8192]["passed"]  # 1.01; 1.011
    assert all(c["mode"] == "sparse" and c["target"].endswith("x dense") for c in got.values())  # sparda: not its goal
    both = goals_markdown(sel, copy)  # the Forecast's goals, then the model's own
    assert both.index("Goals of the Forecast") < both.index("own dense mode") and "none checkable" not in both
    no_sparda = {"rows": [r for r in copy["rows"] if r["mode"] != "sparda (trained)"]}
    assert "Goals of the Forecast" not in goals_markdown(None, no_sparda) and "own dense mode" in goals_markdown(
        None, no_sparda)
    assert "- FAIL copy NLL <= 1.20 x dense: sparse 0.610 vs dense 0.500" in goals_text(
        native_goal_checks(None, copy), "dense", "Sparse against its own dense mode")


def test_report_merges_old_and_split_selection_files_and_checks_the_goals(tmp_path):
    env = {"environment": {"commit": "abc", "device": "cpu"}, "command": "sparda eval"}
    old = dict(_sel_row("python-docs", 4096, "sparse", 1.0, 10.0))
    del old["split"]  # a file written before splits were recorded
    new = _sel_row("python-docs", 4096, "sparda (trained)", 0.95, 10.2)
    copy = [{"suite": "copy", "split": "python-docs", "length": 4096, "mode": m, "copy_nll": v,
             "copy_nll_per_sample": [v], "copy_nll_ci95": None} for m, v in (("sparse", 1.26), ("sparda (trained)", 2.5))]
    files = []
    for name, rows in (("old", [old]), ("new", [new]), ("copy", copy)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"rows": rows, **env}))
    out = tmp_path / "all.md"
    assert report.main([str(out), *map(str, files)]) == 0
    text = out.read_text()
    # one selection table: the old file's rows are the Python docs' split (the copy table's heading names it)
    assert "**None**" not in text and text.count("**python-docs**") == 1
    assert text.count("| sparse | 10.000 | 10.000 | 1.000 | 1 |") == 1
    assert "- PASS recall >= 0.92: sparda (trained) 0.950; python-docs, 4096 tokens" in text
    assert "- FAIL late-half ppl <= 1.01 x sparse: sparda (trained) 10.200 vs sparse 10.000 (ratio 1.020)" in text
    assert "- FAIL copy NLL <= 1.15 x sparse: sparda (trained) 2.500 vs sparse 1.260 (ratio 1.984)" in text
    # "{mode}" in a label keeps each row's mode: another model's rows beside, in no goal
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"rows": [_sel_row("python-docs", 4096, "sparse", 1.0, 20.0)], **env}))
    assert report.main([str(out), *map(str, files), f"{base}=base model, {{mode}}"]) == 0
    text = out.read_text()
    assert "| base model, sparse | 20.000 |" in text and "vs sparse 10.000" in text and "vs sparse 20" not in text
