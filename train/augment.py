"""Retrieval-rich training windows: long-range copies written into ordinary text.

Natural prose rarely makes a later token attend to one far-away block, so a Forecast trained on
it alone learns little about the blocks that retrieval needs. `RetrievalMix` rewrites a share of
the training windows so that they hold such dependencies:

  repeat   a span of the window is copied to a later place at least `min_gap` tokens after it
           (beyond the local blocks), as a repeated paragraph or a quoted passage would be;
  scatter  several short spans from different places are copied, in a shuffled order, to one
           later place (a key-value lookup: each piece's source is a different block).

Each window's rewrite is drawn from a generator seeded by (seed, g), like the window itself, so
a resumed run reads the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparda_jax.config import ConfigError, check_float, check_int

__all__ = ["RetrievalMix", "rewrite_window", "MixedSampler"]


@dataclasses.dataclass(frozen=True)
class RetrievalMix:
    """repeat_share / scatter_share: the share of windows rewritten by each kind (together at
    most 1; the rest stay as read). span_min/span_max: a repeated span's length in tokens;
    pieces: the scatter kind's number of pieces, each piece_min..piece_max tokens; min_gap: the
    least distance from a source's end to its copy's start."""

    repeat_share: float = 0.0
    scatter_share: float = 0.0
    span_min: int = 64
    span_max: int = 512
    pieces: int = 8
    piece_min: int = 8
    piece_max: int = 32
    min_gap: int = 1024

    def __post_init__(self):
        c = "RetrievalMix"
        for name in ("repeat_share", "scatter_share"):
            check_float(c, name, getattr(self, name), lo=0, hi=1)
        if self.repeat_share + self.scatter_share > 1:
            raise ConfigError(f"{c}: repeat_share + scatter_share must be at most 1, got "
                              f"{self.repeat_share} + {self.scatter_share}")
        for name in ("span_min", "span_max", "pieces", "piece_min", "piece_max"):
            check_int(c, name, getattr(self, name), lo=1)
        check_int(c, "min_gap", self.min_gap, lo=0)
        if self.span_min > self.span_max:
            raise ConfigError(f"{c}: span_min ({self.span_min}) must be <= span_max ({self.span_max})")
        if self.piece_min > self.piece_max:
            raise ConfigError(f"{c}: piece_min ({self.piece_min}) must be <= piece_max ({self.piece_max})")

    @property
    def active(self) -> bool:
        return self.repeat_share + self.scatter_share > 0

    def check_fits(self, seq_len: int) -> None:
        """Raises ConfigError if a window of seq_len tokens cannot hold a source, the gap and
        a copy of the longest span (or of all pieces)."""
        for kind, share, need in (("repeat", self.repeat_share, 2 * self.span_max + self.min_gap),
                                  ("scatter", self.scatter_share, 2 * self.pieces * self.piece_max + self.min_gap)):
            if share > 0 and need > seq_len:
                raise ConfigError(f"RetrievalMix: a {kind} rewrite needs {need} tokens, more than "
                                  f"seq_len={seq_len}; shorten the spans or the gap")


def rewrite_window(window: np.ndarray, mix: RetrievalMix, rng: np.random.Generator):
    """A copy of `window` (1-D) with at most one rewrite drawn from rng, and a record of it:
    (tokens, None) or (tokens, {"kind", "sources": [(start, length)], "dest": start}). Every
    piece is copied as it reads in the original window."""
    t = len(window)
    mix.check_fits(t)
    out = np.array(window, copy=True)
    u = rng.random()
    if u < mix.repeat_share:
        n = int(rng.integers(mix.span_min, mix.span_max + 1))
        src = int(rng.integers(0, t - 2 * n - mix.min_gap + 1))
        dest = int(rng.integers(src + n + mix.min_gap, t - n + 1))
        out[dest:dest + n] = window[src:src + n]
        return out, {"kind": "repeat", "sources": [(src, n)], "dest": dest}
    if u < mix.repeat_share + mix.scatter_share:
        lens = rng.integers(mix.piece_min, mix.piece_max + 1, size=mix.pieces)
        total = int(lens.sum())
        # the pieces' sources lie in [0, region), the copies in [dest, dest + total), dest >= region + gap
        region = int(rng.integers(total, t - total - mix.min_gap + 1))
        dest = int(rng.integers(region + mix.min_gap, t - total + 1))
        # sources: disjoint, in order, placed by drawing the free room before each piece
        free = region - total
        cuts = np.sort(rng.integers(0, free + 1, size=mix.pieces))
        starts = cuts + np.concatenate([[0], np.cumsum(lens)[:-1]])
        order = rng.permutation(mix.pieces)
        sources, at = [], dest
        for i in order:
            s, n = int(starts[i]), int(lens[i])
            out[at:at + n] = window[s:s + n]
            sources.append((s, n))
            at += n
        return out, {"kind": "scatter", "sources": sources, "dest": dest}
    return out, None


class MixedSampler:
    """A window sampler (anything with `window(g)` and `seq_len`, `seed`) whose windows go
    through `rewrite_window`; the same `batch` interface as `train.data.WindowSampler`."""

    def __init__(self, sampler, mix: RetrievalMix):
        if not isinstance(mix, RetrievalMix):
            raise TypeError(f"mix must be a RetrievalMix, got {type(mix).__name__}")
        mix.check_fits(sampler.seq_len)
        self.sampler, self.mix = sampler, mix
        self.seq_len, self.seed = sampler.seq_len, sampler.seed

    def window(self, g: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, g, 1])  # a stream apart from the window's offset
        return rewrite_window(self.sampler.window(g), self.mix, rng)[0]

    def batch(self, step: int, batch: int, *, first: int = 0, count: int | None = None) -> np.ndarray:
        count = batch - first if count is None else count
        return np.stack([self.window(step * batch + first + i) for i in range(count)])
