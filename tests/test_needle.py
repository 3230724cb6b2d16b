"""The demo's fact span and the needle probe's row shares."""

import numpy as np
import pytest

import sparda_jax as sj
from sparda_jax.eval.needle import needle_rows
from sparda_jax.infer.demo import make_case, run_retrieval
from sparda_jax.infer.generate import longest_prompt


def test_the_case_knows_where_its_fact_is():
    model = sj.load_pretrained("smollm2-135m")
    case = make_case(model, 1024, 0.5, 0)
    text = model.tokenizer.decode(case.prompt_ids[case.fact[0]:case.fact[1]])
    assert text.strip().startswith("Remember this:") and case.name in text and f"Room {case.room}" in text
    assert 0.3 * 1024 < case.fact[0] < 0.7 * 1024


def test_demo_lengths_out_of_range_name_the_allowed_ones():
    model = sj.load_pretrained("smollm2-135m")
    assert longest_prompt(8192, 32) == 8128 and longest_prompt(8192, 64) == 8128 and longest_prompt(8192, 65) == 8064
    with pytest.raises(ValueError, match="at most 8128"):
        run_retrieval(model, context_tokens=8192, systems=("dense_resident",))
    with pytest.raises(ValueError, match=r"take at least \d+") as e:
        make_case(model, 100, 0.5, 0)
    least = int(str(e.value).rsplit(" ", 1)[1])
    assert len(make_case(model, least, 0.5, 0).prompt_ids) == least  # the length it names is accepted


def test_needle_rows_counts_rows_holding_a_block():
    ids = -np.ones((2, 1, 1, 6, 3), int)  # [L, B, K, T, n]
    ids[0, 0, 0, 2:, 0] = 7                # layer 0: rows 2..5 hold block 7
    ids[1, 0, 0, 4, 1] = 9                 # layer 1: row 4 holds block 9
    np.testing.assert_allclose(needle_rows(ids, 2, [7]), [1.0, 0.0])
    np.testing.assert_allclose(needle_rows(ids, 2, [7, 9]), [1.0, 0.25])
    np.testing.assert_allclose(needle_rows(ids, 0, [7]), [4 / 6, 0.0])
