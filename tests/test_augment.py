"""Retrieval-rich training windows (train.augment): copies are exact, far enough, deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from sparda_jax.config import ConfigError
from sparda_jax.train.augment import MixedSampler, RetrievalMix, rewrite_window
from sparda_jax.train.data import WindowSampler

T = 2048


def _window(seed=0):
    return np.random.default_rng(seed).integers(0, 50_000, T).astype(np.int32)


def test_repeat_copies_a_span_beyond_the_gap():
    mix = RetrievalMix(repeat_share=1.0, span_min=64, span_max=256, min_gap=600)
    for g in range(50):
        w = _window(g)
        out, rec = rewrite_window(w, mix, np.random.default_rng(g))
        assert rec["kind"] == "repeat"
        (src, n), dest = rec["sources"][0], rec["dest"]
        assert 64 <= n <= 256 and dest >= src + n + 600 and dest + n <= T
        np.testing.assert_array_equal(out[dest:dest + n], w[src:src + n])
        keep = np.ones(T, bool)
        keep[dest:dest + n] = False
        np.testing.assert_array_equal(out[keep], w[keep])  # nothing else changes


def test_scatter_copies_disjoint_pieces_in_a_shuffled_order():
    mix = RetrievalMix(scatter_share=1.0, pieces=6, piece_min=8, piece_max=24, min_gap=512)
    orders = set()
    for g in range(50):
        w = _window(g)
        out, rec = rewrite_window(w, mix, np.random.default_rng(g))
        assert rec["kind"] == "scatter" and len(rec["sources"]) == 6
        spans = sorted(rec["sources"])
        for (s0, n0), (s1, _) in zip(spans, spans[1:]):
            assert s0 + n0 <= s1  # disjoint sources
        at = rec["dest"]
        assert at >= spans[-1][0] + spans[-1][1] + 512
        for s, n in rec["sources"]:
            assert 8 <= n <= 24
            np.testing.assert_array_equal(out[at:at + n], w[s:s + n])
            at += n
        assert at <= T
        orders.add(tuple(s for s, _ in rec["sources"]) == tuple(s for s, _ in spans))
    assert False in orders  # the copies are shuffled (in source order by chance 1 in 720)


def test_shares_set_how_often_each_rewrite_happens():
    mix = RetrievalMix(repeat_share=0.3, scatter_share=0.2)
    kinds = [rewrite_window(_window(), mix, np.random.default_rng(g))[1] for g in range(2000)]
    kinds = [None if k is None else k["kind"] for k in kinds]
    # binomial standard deviation at n=2000 is ~0.01: 0.04 is 4 of them
    assert abs(kinds.count("repeat") / 2000 - 0.3) < 0.04
    assert abs(kinds.count("scatter") / 2000 - 0.2) < 0.04
    assert abs(kinds.count(None) / 2000 - 0.5) < 0.04


def test_mixed_sampler_is_deterministic_and_keeps_the_window_offsets():
    stream = np.arange(100_000, dtype=np.int32)  # a window's content names its offset
    base = WindowSampler(stream, T, seed=3)
    mixed = MixedSampler(base, RetrievalMix(repeat_share=1.0))
    a, b = mixed.batch(5, 4), mixed.batch(5, 4)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(mixed.batch(5, 4, first=2, count=2), a[2:])
    plain = base.batch(5, 4)
    for row, orig in zip(a, plain):
        assert row[0] == orig[0] or row[-1] == orig[-1]  # the same window underneath
        assert (row != orig).any()  # rewritten (a copy of consecutive ids never equals its target)


def test_no_share_leaves_windows_alone():
    w = _window()
    out, rec = rewrite_window(w, RetrievalMix(), np.random.default_rng(0))
    assert rec is None
    np.testing.assert_array_equal(out, w)


@pytest.mark.parametrize("kw, match", [
    ({"repeat_share": 0.7, "scatter_share": 0.4}, "at most 1"),
    ({"repeat_share": -0.1}, "repeat_share"),
    ({"span_min": 600, "span_max": 500}, "span_min"),
    ({"piece_min": 0}, "piece_min"),
    ({"min_gap": -1}, "min_gap"),
])
def test_bad_mixes_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        RetrievalMix(**kw)


def test_a_window_too_short_for_the_copy_is_refused():
    mix = RetrievalMix(repeat_share=0.5, span_max=512, min_gap=1024)
    with pytest.raises(ConfigError, match="needs 2048 tokens"):
        mix.check_fits(1024)
    with pytest.raises(ConfigError, match="needs"):
        MixedSampler(WindowSampler(np.arange(5000, dtype=np.int32), 1024), mix)
    mix.check_fits(2048)
