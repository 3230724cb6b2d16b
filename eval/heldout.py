"""Held-out text for the selection and copy suites, as tokenized documents.

Either the default, the held-out quarter of the Python docs (`sparda_jax.text.corpus_split`,
each document tokenized as `encode(doc + "\\n\\n")`, so windows equal `haystack_tokens`'), or
named splits of a token corpus written by `sparda_jax.corpus` (a directory with manifest.json
of format "sparda-tokens/1"; each document keeps the eos token that ends it in the corpus).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparda_jax.text import corpus_split, python_docs_corpus

__all__ = ["HeldoutText", "DEFAULT_SPLIT", "PYTHON_DOCS_TEXT", "python_docs_text", "corpus_texts",
           "corpus_splits", "describe"]

DEFAULT_SPLIT = "python-docs"
PYTHON_DOCS_TEXT = "held-out quarter of the Python docs shipped with CPython (pydoc_data.topics)"


@dataclass(frozen=True)
class HeldoutText:
    """One split of held-out text: `docs` are 1-D int32 token arrays (each with the separator
    that ends it); `info` is JSON-ready provenance (source, documents, tokens, shard hashes)."""

    split: str
    description: str
    docs: tuple
    info: dict

    @property
    def tokens(self) -> int:
        return int(sum(d.size for d in self.docs))


def python_docs_text(encode) -> HeldoutText:
    """The default held-out text: every 4th document of `python_docs_corpus()`."""
    docs = tuple(np.asarray(encode(d + "\n\n"), np.int32) for d in corpus_split(python_docs_corpus(), "eval"))
    n = int(sum(d.size for d in docs))
    return HeldoutText(DEFAULT_SPLIT, PYTHON_DOCS_TEXT, docs,
                       {"source": PYTHON_DOCS_TEXT, "documents": len(docs), "tokens": n})


def _manifest(directory: Path) -> dict:
    """The corpus's manifest (`sparda_jax.corpus.load_manifest`: missing directory or file,
    unreadable JSON, another format), with the tokenizer fields eval needs."""
    from sparda_jax.corpus import load_manifest

    m = load_manifest(directory)
    if not {"vocab_size", "eos_id"} <= m["tokenizer"].keys():
        raise ValueError(f"{directory / 'manifest.json'}: its 'tokenizer' needs vocab_size and eos_id")
    return m

def corpus_splits(directory) -> list[str]:
    """The split names of a token corpus, in its manifest's order."""
    return list(_manifest(Path(directory))["splits"])


def corpus_texts(directory, splits, *, vocab_size: int) -> list[HeldoutText]:
    """The given splits of a token corpus, read (and their shards' hashes verified) through
    `sparda_jax.corpus`. Raises FileNotFoundError for a missing directory or manifest,
    ValueError for an unknown split (naming the known ones), a tokenizer whose vocabulary is not
    vocab_size (the model's), a token id past it, or a split with fewer than 2 documents."""
    directory = Path(directory)
    m = _manifest(directory)
    known = list(m["splits"])
    if not splits:
        raise ValueError("no splits given")
    unknown = [s for s in splits if s not in m["splits"]]
    if unknown:
        raise ValueError(f"split {unknown[0]!r} is not in {directory}; its splits are {', '.join(known)}")
    if len(set(splits)) != len(splits):
        raise ValueError(f"a split is named twice: {' '.join(splits)}")
    tok = m["tokenizer"]
    if tok["vocab_size"] != vocab_size:
        raise ValueError(f"{directory} was tokenized with {tok.get('model')!r} ({tok['vocab_size']} tokens), "
                         f"not the model's vocabulary of {vocab_size}")
    try:
        from sparda_jax.corpus import load_split, split_documents
    except ImportError as e:
        raise ImportError(f"reading a token corpus needs sparda_jax.corpus ({e})") from e
    eos = int(tok["eos_id"])
    out = []
    for s in splits:
        stream = np.asarray(load_split(directory, s, verify=True))
        if stream.size and int(stream.max()) >= vocab_size:
            raise ValueError(f"split {s!r} of {directory} holds token id {int(stream.max())}, outside the "
                             f"vocabulary of {vocab_size}")
        docs = []
        for d in split_documents(stream, eos):
            d = np.asarray(d, np.int32)
            if d.size == 0 or (d.size == 1 and d[0] == eos):
                continue
            docs.append(d if d[-1] == eos else np.append(d, np.int32(eos)))
        if len(docs) < 2:
            raise ValueError(f"split {s!r} of {directory} holds {len(docs)} document(s); the evaluation needs at least 2")
        entry = m["splits"][s]
        info = {k: v for k, v in entry.items() if k != "shards"}
        info.update(source=str(directory), tokenizer=tok.get("model"), documents=len(docs),
                    tokens=int(sum(d.size for d in docs)),
                    shards=[{"file": x.get("file"), "sha256": x.get("sha256")} for x in entry.get("shards", [])])
        out.append(HeldoutText(s, f"split {s!r} of the token corpus {directory}", tuple(docs), info))
    return out


def describe(texts: list[HeldoutText]) -> str:
    """One line naming the text of a result ("text" field)."""
    if len(texts) == 1 and texts[0].split == DEFAULT_SPLIT:
        return texts[0].description
    return "; ".join(f"{t.description} ({t.info['documents']} documents, {t.tokens} tokens)" for t in texts)


def budget_record(sp) -> dict:
    """What a result records of the selection budget (a `SparseConfig`): block size, forced and
    total blocks, the compression, and the layers that attend densely."""
    return {"block_size": sp.block_size, "init_blocks": sp.init_blocks, "local_blocks": sp.local_blocks,
            "topk": sp.topk, "kernel_size": sp.kernel_size, "kernel_stride": sp.kernel_stride,
            "dense_layers": list(sp.dense_layers)}


def selecting_layers(config) -> np.ndarray:
    """bool [L]: the layers that select blocks (not in `sparse.dense_layers`), whose selections
    the suites' metrics count."""
    return np.array([i not in config.sparse.dense_layers for i in range(config.num_layers)])
