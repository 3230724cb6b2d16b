"""Training text: documents -> tokens -> fixed-length windows, deterministic and resumable.

Sample g (a global index: step * batch + i) is the window of `seq_len` tokens that starts at
an offset drawn from a generator seeded by (seed, g). The sampler holds no state, so resuming
at step s reads exactly what an uninterrupted run would have read, and every process of a
multi-host run can draw its own share of a batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sparda_jax.text import corpus_split, python_docs_corpus, read_text_files

__all__ = ["load_documents", "tokenize_documents", "is_shard_dir", "shard_stream", "token_stream", "WindowSampler"]


def load_documents(paths: list[str | Path] | None = None, split: str = "train") -> list[str]:
    """User text files / directories, or the default corpus's training split."""
    if paths:
        return read_text_files(list(paths))
    return corpus_split(python_docs_corpus(), split)


def tokenize_documents(docs: list[str], encode, separator: list[int]) -> np.ndarray:
    """One int32 stream: each document's tokens followed by `separator` (e.g. [eos])."""
    out: list[int] = []
    for d in docs:
        out.extend(encode(d))
        out.extend(separator)
    return np.asarray(out, np.int32)


def is_shard_dir(paths) -> bool:
    """Whether `paths` is one directory holding a token corpus's manifest.json (`sparda corpus build`)."""
    return bool(paths) and len(paths) == 1 and (Path(paths[0]) / "manifest.json").is_file()


def shard_stream(directory, tokenizer, eos_id: int, split: str = "train") -> np.ndarray:
    """One split of a token corpus as an int32 stream, after checking that its tokenizer's
    vocabulary size and EOS id are the model's (ValueError otherwise)."""
    from sparda_jax.corpus import load_manifest, load_split

    meta = load_manifest(directory)["tokenizer"]
    vocab = getattr(tokenizer, "vocab_size", None)
    if meta.get("eos_id") != eos_id or (vocab is not None and meta.get("vocab_size") != vocab):
        raise ValueError(f"{directory}: built with {meta}, but the model's tokenizer has vocab_size "
                         f"{vocab} and eos_id {eos_id}; rebuild the corpus with this model")
    return load_split(directory, split)


def token_stream(paths, tokenizer, separator: list[int]) -> np.ndarray:
    """The training stream: a token corpus's `train` split when `paths` is its directory, else the
    text of `load_documents(paths)` tokenized with `separator` after each document."""
    if is_shard_dir(paths):
        return shard_stream(paths[0], tokenizer, separator[0])
    return tokenize_documents(load_documents(paths, "train"), tokenizer.encode, separator)


class WindowSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0):
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 1:
            raise ValueError("tokens must be a 1-D stream")
        if len(tokens) < seq_len:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than seq_len={seq_len}; "
                             f"add text or shorten the sequences")
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def window(self, g: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, g])
        start = int(rng.integers(0, len(self.tokens) - self.seq_len + 1))
        return self.tokens[start:start + self.seq_len]

    def batch(self, step: int, batch: int, *, first: int = 0, count: int | None = None) -> np.ndarray:
        """Rows [first, first + count) of step's global batch: int32 [count, seq_len]."""
        count = batch - first if count is None else count
        return np.stack([self.window(step * batch + first + i) for i in range(count)])
