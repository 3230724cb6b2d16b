"""The Debian-package token corpus: text extraction, dedupe, splits, shards, manifest and loading,
on a small .deb built here (no network)."""

import gzip
import hashlib
import json
import shutil
import subprocess

import numpy as np
import pytest

from sparda_jax import corpus
from sparda_jax.corpus import (SourceSpec, build_corpus, corpus_info, html_to_text, info_to_text, load_split,
                               man_to_text, pod_to_text, split_documents)
from tests.byte_tokenizer import ByteTokenizer

PKG = "sparda-test-doc"
DOC = f"usr/share/doc/{PKG}"

PARAGRAPH = ("The quick brown fox jumps over the lazy dog while the patient reader follows every word of "
             "this sentence, which exists only to make a paragraph of ordinary English prose. ")
HTML = f"""<!DOCTYPE html><html class="sidebar-visible"><head><title>Page title</title>
<style>body {{ color: red }}</style><script>var navigation = 1;</script></head>
<body><nav class="navbar">Home | Next | Previous</nav>
<div class="sphinxsidebar"><h3>Quick search</h3><p>Search the documentation here.</p></div>
<div class="body"><h1>Chapter one<a class="headerlink" href="#c">¶</a></h1>
<p>{PARAGRAPH * 2}</p>
<ul><li>first item</li><li>second <b>bold</b> item</li><li><a class="nav-link">Next</a></li></ul>
<pre>int main(void)
{{
    return 0;
}}</pre>
<p>{PARAGRAPH}Ends here &amp; now.</p></div>
<footer>Copyright 2024 Footer Text</footer></body></html>
"""
RST = "Guide\n=====\n\n" + PARAGRAPH * 6 + "\n\nSecond section\n--------------\n\n" + PARAGRAPH * 2
GZ_TEXT = "Notes\n\n" + PARAGRAPH * 5
MAN = (".\\\" a comment\n.TH TOOL 1 2024-01-01\n.SH NAME\ntool \\- do a thing\n.SH DESCRIPTION\n"
       ".B tool\nreads \\fIfiles\\fP and writes \\(lqtext\\(rq.\n.PP\n" + PARAGRAPH * 4 + "\n.BR ls (1)\n"
       ".TP\n.B \\-v\nBe\nverbose.\n.nf\nline one\n  line two\n.fi\n")
INFO = ("This is tool.info, produced by makeinfo.\n\n\x1f\nFile: tool.info,  Node: Top,  Next: Usage,  Up: (dir)\n\n"
        "Tool\n****\n\n" + PARAGRAPH * 3 + "\n\n* Menu:\n\n* Usage::     How to use it.\n\n"
        "\x1f\nFile: tool.info,  Node: Usage,  Prev: Top,  Up: Top\n\n1 Usage\n*******\n\n" + PARAGRAPH * 2 +
        "\n\n\x1f\nTag Table:\nNode: Top\x7f70\nNode: Usage\x7f400\n\x1f\nEnd Tag Table\n")
LICENSE = "Permission is hereby granted, free of charge, to any person obtaining a copy. " * 10


def _make_deb(tmp_path, extra_rst: int = 0):
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed")
    root = tmp_path / "pkgroot"
    files = {
        f"{DOC}/html/page.html": HTML.encode(),
        f"{DOC}/a-guide.rst": RST.encode(),
        f"{DOC}/b-guide-copy.rst": RST.encode(),  # an exact duplicate of a-guide.rst
        f"{DOC}/notes.txt.gz": gzip.compress(GZ_TEXT.encode()),
        f"{DOC}/short.txt": b"Too short to keep.\n",
        f"{DOC}/copyright": LICENSE.encode(),
        "usr/share/man/man1/tool.1.gz": gzip.compress(MAN.encode()),
        "usr/share/info/tool.info.gz": gzip.compress(INFO.encode()),
    }
    for i in range(extra_rst):
        files[f"{DOC}/more/doc{i:02d}.rst"] = (f"Document {i}\n\n" + PARAGRAPH * 5).encode()
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text(f"Package: {PKG}\nVersion: 1.0-1\nArchitecture: all\n"
                                         "Maintainer: Test <test@example.org>\nDescription: test docs\n")
    cache = tmp_path / "cache"
    (cache / "debs").mkdir(parents=True)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(root), str(cache / "debs" / f"{PKG}_1.0-1_all.deb")],
                   check=True, capture_output=True)
    return cache


SOURCES = (
    SourceSpec(PKG, "train", (f"{DOC}/**/*.html", f"{DOC}/**/*.rst", f"{DOC}/**/*.txt", f"{DOC}/**/*.txt.gz"),
               corpus._TRAIN_EXCLUDE),
    SourceSpec(PKG, "eval-man", ("usr/share/man/man*/*.gz",), reader="man"),
    SourceSpec(PKG, "eval-info", ("usr/share/info/*.info*.gz",), reader="info"),
    SourceSpec(PKG, "eval-licenses", (f"{DOC}/copyright",), reader="text"),
)


def _build(tmp_path, cache, **kw):
    kw.setdefault("shard_tokens", 1500)
    return build_corpus(tmp_path / "out", ByteTokenizer(), eos_id=0, vocab_size=256, model_name="bytes",
                        cache_dir=cache, sources=SOURCES, progress=False, **kw)


def _index(out):
    lines = (out / "documents.tsv").read_text().splitlines()
    return [dict(zip(lines[0].split("\t"), row.split("\t"))) for row in lines[1:]]


def test_html_to_text_keeps_content_and_drops_furniture():
    text = html_to_text(HTML)
    lines = text.splitlines()
    assert lines[0] == "Chapter one"  # the heading, without the ¶ anchor
    assert (PARAGRAPH * 2).strip() in lines
    assert "- first item" in lines and "- second bold item" in lines and "-" not in lines
    assert "int main(void)\n{\n    return 0;\n}" in text  # <pre> verbatim
    assert lines[-1] == PARAGRAPH + "Ends here & now."
    for junk in ("Page title", "color", "navigation", "Home | Next", "Quick search", "Search the", "Footer", "¶"):
        assert junk not in text, junk


def test_pod_man_info_to_text():
    pod = "=head1 NAME\n\nperlfoo - B<bold> and C<< $a <=> $b >> see L<the docs|perlfunc/open> E<gt> x\n\n=cut\n"
    assert pod_to_text(pod) == "NAME\n\nperlfoo - bold and $a <=> $b see the docs > x"
    man = man_to_text(MAN)
    assert man == ("TOOL(1)\n\nNAME\n\ntool - do a thing\n\nDESCRIPTION\n\n"
                   "tool reads files and writes \"text\".\n\n" + PARAGRAPH * 4 + "ls(1)\n\n"
                   "-v\nBe verbose.\nline one\n  line two")
    info = info_to_text(INFO)
    assert "Node:" not in info and "Menu" not in info and "Usage::" not in info and "Tag Table" not in info
    assert "Tool\n****" in info and "1 Usage\n*******" in info and (PARAGRAPH * 2).strip() in info


def test_build_splits_dedupe_and_round_trip(tmp_path):
    cache = _make_deb(tmp_path)
    manifest = _build(tmp_path, cache)
    out = tmp_path / "out"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["format"] == "sparda-tokens/1" and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"] == {"model": "bytes", "vocab_size": 256, "eos_id": 0}
    rows = _index(out)
    by_split = {}
    for r in rows:
        by_split.setdefault(r["split"], []).append(r["path"])
    train_paths = sorted(by_split.get("train", []) + by_split.get("heldout", []))
    # short.txt dropped (< 500 chars), b-guide-copy.rst dropped (duplicate of a-guide.rst), copyright excluded
    assert train_paths == [f"{DOC}/a-guide.rst", f"{DOC}/html/page.html", f"{DOC}/notes.txt.gz"]
    assert by_split["eval-man"] == ["usr/share/man/man1/tool.1.gz"]
    assert by_split["eval-info"] == ["usr/share/info/tool.info.gz"]
    assert by_split["eval-licenses"] == [f"{DOC}/copyright"]

    tok = ByteTokenizer()
    def tidy(t):  # the documented normalisation: trailing spaces of lines and of the text stripped
        return "\n".join(line.rstrip() for line in t.splitlines()).strip()

    expected_text = {f"{DOC}/a-guide.rst": tidy(RST), f"{DOC}/notes.txt.gz": tidy(GZ_TEXT),
                     f"{DOC}/html/page.html": html_to_text(HTML), f"{DOC}/copyright": tidy(LICENSE)}
    for split, paths in by_split.items():
        stream = load_split(out, split)
        assert stream.dtype == np.int32 and stream.ndim == 1
        s = manifest["splits"][split]
        assert stream.size == s["tokens"] == sum(sh["tokens"] for sh in s["shards"])
        assert s["documents"] == len(paths)
        docs = split_documents(stream, 0)
        assert len(docs) == len(paths) and stream[-1] == 0
        for path, d in zip(paths, docs):
            if path in expected_text:  # independent reference: encode the expected text, then EOS
                assert d.tolist() == tok.encode(expected_text[path]), path
        assert s["sources"][PKG]["version"] == "1.0-1"
        assert s["sources"][PKG]["files"] == len(paths) and s["sources"][PKG]["tokens"] == stream.size
    # shards: whole documents, each at most shard_tokens unless one document alone is longer
    for s in manifest["splits"].values():
        for sh in s["shards"]:
            arr = np.load(out / sh["file"])
            assert arr.dtype == np.uint16 and arr[-1] == 0
            assert arr.size <= 1500 or np.count_nonzero(arr == 0) == 1
            assert hashlib.sha256((out / sh["file"]).read_bytes()).hexdigest() == sh["sha256"]
    assert sum(len(s["shards"]) for s in manifest["splits"].values()) > len(manifest["splits"])  # some split has 2+
    info = corpus_info(out)
    assert "eval-man: 1 documents" in info and f"{PKG} 1.0-1" in info


def test_heldout_is_a_stable_disjoint_hash_split(tmp_path, monkeypatch):
    cache = _make_deb(tmp_path, extra_rst=24)
    monkeypatch.setattr(corpus, "HELDOUT_MODULUS", 3)
    _build(tmp_path, cache, kind="train")
    rows = _index(tmp_path / "out")
    held = {r["path"] for r in rows if r["split"] == "heldout"}
    train = {r["path"] for r in rows if r["split"] == "train"}
    assert held and train and not held & train
    want = {p for p in held | train
            if int.from_bytes(hashlib.sha256(f"{PKG}/{p}".encode()).digest()[:8], "big") % 3 == 0}
    assert held == want
    # the streams are disjoint too: no held-out document appears in the train split
    train_docs = {d.tobytes() for d in split_documents(load_split(tmp_path / "out", "train"), 0)}
    assert not any(d.tobytes() in train_docs for d in split_documents(load_split(tmp_path / "out", "heldout"), 0))
    assert set(json.loads((tmp_path / "out/manifest.json").read_text())["splits"]) == {"train", "heldout"}


def test_load_split_errors(tmp_path):
    cache = _make_deb(tmp_path)
    manifest = _build(tmp_path, cache, kind="eval")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no split 'train'.*eval-info, eval-man, eval-licenses"):
        load_split(out, "train")
    shard = out / manifest["splits"]["eval-man"]["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x5
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        load_split(out, "eval-man")
    assert load_split(out, "eval-man", verify=False).size == manifest["splits"]["eval-man"]["tokens"]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="eval-man-00000.npy.*missing"):
        load_split(out, "eval-man")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_split(tmp_path / "nowhere", "eval-man")
    m = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**m, "format": "sparda-tokens/0"}))
    with pytest.raises(ValueError, match="format"):
        load_split(out, "eval-info")
    (out / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        load_split(out, "eval-info")
    with pytest.raises(ValueError, match="no eval source names"):
        _build(tmp_path, cache, kind="eval", packages=["linux-doc-6.1"])


def test_documents_holding_the_eos_id_are_dropped(tmp_path):
    cache = _make_deb(tmp_path)
    logged = []
    # with the byte tokenizer and eos_id = ord("P"), the licence ("Permission ...") and the man page
    # ("DESCRIPTION") hold the EOS id; the other documents do not
    m = build_corpus(tmp_path / "out", ByteTokenizer(), eos_id=ord("P"), vocab_size=256, cache_dir=cache,
                     sources=SOURCES, progress=False, log=logged.append)
    assert set(m["splits"]) in ({"train", "eval-info"}, {"train", "heldout", "eval-info"})
    assert any("dropped 2 documents" in line and f"{PKG}/{DOC}/copyright" in line for line in logged)
    for split in m["splits"]:
        stream = load_split(tmp_path / "out", split)
        assert len(split_documents(stream, ord("P"))) == m["splits"][split]["documents"]


def test_rebuilding_some_splits_keeps_the_others(tmp_path):
    cache = _make_deb(tmp_path)
    first = _build(tmp_path, cache, kind="eval")
    info_before = load_split(tmp_path / "out", "eval-info")
    again = build_corpus(tmp_path / "out", ByteTokenizer(), eos_id=0, vocab_size=256, model_name="bytes",
                         cache_dir=cache, sources=SOURCES[:2], progress=False)  # train and eval-man only
    assert {"train", "eval-man", "eval-info", "eval-licenses"} <= set(again["splits"])
    assert again["splits"]["eval-info"] == first["splits"]["eval-info"]
    np.testing.assert_array_equal(load_split(tmp_path / "out", "eval-info"), info_before)
    assert {r["split"] for r in _index(tmp_path / "out")} >= {"train", "eval-man", "eval-info", "eval-licenses"}
    # another tokenizer starts the manifest afresh
    other = build_corpus(tmp_path / "out", ByteTokenizer(), eos_id=1, vocab_size=256, model_name="bytes",
                         cache_dir=cache, sources=SOURCES[1:2], progress=False)
    assert set(other["splits"]) == {"eval-man"}
    assert sorted(f.name for f in (tmp_path / "out").glob("*.npy")) == ["eval-man-00000.npy"]
    assert {r["split"] for r in _index(tmp_path / "out")} == {"eval-man"}


def test_large_vocab_uses_uint32_and_train_reads_the_shards(tmp_path):
    from sparda_jax.train.data import is_shard_dir, token_stream

    cache = _make_deb(tmp_path)
    manifest = build_corpus(tmp_path / "out", ByteTokenizer(), eos_id=0, vocab_size=70_000, cache_dir=cache,
                            sources=SOURCES, kind="train", progress=False)
    assert manifest["dtype"] == "uint32"
    assert np.load(tmp_path / "out" / manifest["splits"]["train"]["shards"][0]["file"]).dtype == np.uint32
    out = str(tmp_path / "out")
    assert is_shard_dir([out]) and not is_shard_dir([out, out])
    np.testing.assert_array_equal(token_stream([out], ByteTokenizer(), [0]), load_split(out, "train"))
    with pytest.raises(ValueError, match="eos_id"):
        token_stream([out], ByteTokenizer(), [2])


def test_cli_corpus_info(tmp_path, capsys):
    from sparda_jax.cli import main

    cache = _make_deb(tmp_path)
    _build(tmp_path, cache, kind="eval")
    assert main(["corpus", "info", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer bytes (vocab 256, eos 0)" in out and "eval-info: 1 documents" in out
    assert main(["corpus", "info", str(tmp_path / "nowhere")]) == 2
    assert "corpus directory not found" in capsys.readouterr().err
