"""Real English text that ships with Python, for haystacks, training data and perplexity.

The default corpus is the Python reference documentation that CPython installs as
`pydoc_data.topics` (79 topics, ~490K characters, ~120K SmolLM2 tokens): technical prose
written by people, present wherever Python is, with no download.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

__all__ = ["python_docs_corpus", "corpus_split", "read_text_files", "haystack_tokens", "haystack_from_tokens",
           "insert_at_depth"]


def python_docs_corpus() -> list[str]:
    """The documents of `pydoc_data.topics`, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def corpus_split(docs: list[str], part: str) -> list[str]:
    """A fixed split of a document list: every 4th document is held out for evaluation
    ("eval"), the rest is for training and calibration ("train")."""
    if part == "eval":
        return docs[::4]
    if part == "train":
        return [d for i, d in enumerate(docs) if i % 4]
    raise ValueError(f"part must be 'train' or 'eval', got {part!r}")


def read_text_files(paths: list[str | Path]) -> list[str]:
    """Documents from .txt/.md files and directories of them (recursively, sorted)."""
    docs = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
            if not files:
                raise FileNotFoundError(f"{p}: no .txt or .md files inside")
        elif p.is_file():
            files = [p]
        else:
            raise FileNotFoundError(f"text path not found: {p}")
        docs.extend(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return docs


def haystack_tokens(encode, n_tokens: int, seed: int = 0, docs: list[str] | None = None) -> list[int]:
    """Exactly `n_tokens` tokens of real text: whole documents in a seeded order, cut at the end."""
    docs = python_docs_corpus() if docs is None else docs
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out: list[int] = []
    while len(out) < n_tokens:
        for i in order:
            out.extend(encode(docs[i] + "\n\n"))
            if len(out) >= n_tokens:
                break
    return out[:n_tokens]


def haystack_from_tokens(docs_tokens, n_tokens: int, seed: int = 0) -> np.ndarray:
    """Exactly `n_tokens` tokens (int32 [n_tokens]) of already tokenized documents (a sequence
    of 1-D integer arrays): whole documents in the seeded order of `haystack_tokens`, cut at the
    end. Documents tokenized as `encode(doc + "\n\n")` give `haystack_tokens`' windows exactly.
    Unlike `haystack_tokens`, text is never repeated: raises ValueError when the documents hold
    fewer than n_tokens tokens in all (or n_tokens < 1), TypeError for non-integer tokens."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive integer, got {n_tokens!r}")
    docs = [np.asarray(d) for d in docs_tokens]
    for i, d in enumerate(docs):
        if d.ndim != 1 or not (np.issubdtype(d.dtype, np.integer) or d.size == 0):
            raise TypeError(f"document {i}: expected a 1-D integer token array, got {d.dtype} {d.shape}")
    total = sum(d.size for d in docs)
    if total < n_tokens:
        raise ValueError(f"the documents hold {total} tokens, fewer than the {n_tokens} asked for")
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out, have = [], 0
    for i in order:
        out.append(docs[i][: n_tokens - have])
        have += out[-1].size
        if have >= n_tokens:
            break
    return np.concatenate(out).astype(np.int32)


def insert_at_depth(hay: list[int], needle: list[int], depth: float, decode) -> list[int]:
    """Insert `needle` at fraction `depth` of the haystack, just after the first token at or
    after that point whose text ends a line, so the needle reads as its own sentence."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    pos = int(len(hay) * depth)
    while pos < len(hay) and not decode([hay[pos]]).endswith("\n"):
        pos += 1
    pos = min(pos + 1, len(hay))
    return hay[:pos] + needle + hay[pos:]
