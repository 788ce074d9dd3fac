"""Tests for grail_exp.analysis.metrics (pure numpy; fast)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest

from grail_exp.analysis.metrics import (
    MetricWithCI,
    acc_at_n,
    average_over_benchmarks,
    bootstrap_ci,
    format_table,
    maj_at_n,
    normalize_answer,
    pass_at_k,
    pass_at_k_per_problem,
    summarize_benchmark,
    to_dataframe,
    to_jsonable,
)

# A tiny hand-checkable benchmark: 4 problems x 3 samples.
TINY = np.array(
    [
        [1, 0, 0],  # c=1
        [1, 1, 1],  # c=3
        [0, 0, 0],  # c=0
        [0, 1, 1],  # c=2
    ],
    dtype=bool,
)


# --------------------------------------------------------------------------- #
# pass@k
# --------------------------------------------------------------------------- #
def _brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) with >= 1 correct."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(i < c for i in s) for s in subsets)
    return hits / len(subsets)


def test_pass_at_k_matches_brute_force_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_values():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset has a correct one
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)
    # Large n stays finite and in range (no huge binomials).
    v = pass_at_k(10_000, 7, 100)
    assert 0.0 < v < 1.0


@pytest.mark.parametrize(
    "n, c, k, fragment",
    [
        (3, 1, 0, "k >= 1"),
        (3, 1, -2, "k >= 1"),
        (3, 1, 4, "k <= n"),
        (3, 4, 1, "0 <= c <= n"),
        (3, -1, 1, "0 <= c <= n"),
        (3, 1, 1.5, "integer k"),
    ],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        pass_at_k(n, c, k)


def test_pass_at_k_per_problem_hand_computed():
    # pass@2 with n=3: c=1 -> 1 - C(2,2)/C(3,2) = 2/3; c=3 -> 1; c=0 -> 0; c=2 -> 1.
    np.testing.assert_allclose(pass_at_k_per_problem(TINY, 2), [2 / 3, 1.0, 0.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(pass_at_k_per_problem(TINY, 1), [1 / 3, 1.0, 0.0, 2 / 3], atol=1e-12)


def test_pass_at_1_equals_acc_and_pass_at_n_equals_any_correct():
    rng = np.random.default_rng(1)
    correct = rng.random((50, 6)) < 0.4
    np.testing.assert_allclose(pass_at_k_per_problem(correct, 1), acc_at_n(correct), atol=1e-12)
    np.testing.assert_array_equal(pass_at_k_per_problem(correct, 6), correct.any(axis=1).astype(float))
    assert acc_at_n(TINY).mean() == pytest.approx((1 / 3 + 1 + 0 + 2 / 3) / 4)


def test_ragged_input_uses_each_problems_n():
    ragged = [[1, 0, 0, 0], [1, 1], [0, 0, 1]]
    np.testing.assert_allclose(acc_at_n(ragged), [0.25, 1.0, 1 / 3])
    np.testing.assert_allclose(
        pass_at_k_per_problem(ragged, 2), [pass_at_k(4, 1, 2), 1.0, pass_at_k(3, 1, 2)], atol=1e-12
    )
    with pytest.raises(ValueError, match="problem 1"):
        pass_at_k_per_problem(ragged, 3)


def test_bad_correct_values_and_k_errors():
    with pytest.raises(ValueError, match="booleans or 0/1"):
        acc_at_n([[0, 2, 1]])
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k_per_problem(TINY, 0)
    with pytest.raises(ValueError, match="pass@4 is undefined for problem 0"):
        pass_at_k_per_problem(TINY, 4)
    with pytest.raises(ValueError, match="problem 0"):
        summarize_benchmark(TINY, ks=[4])


# --------------------------------------------------------------------------- #
# maj@n
# --------------------------------------------------------------------------- #
def test_normalize_answer():
    assert normalize_answer("  $ \\frac{1}{2} $ ") == "\\frac{1}{2}"
    assert normalize_answer("$$x  +\n 1$$") == "x + 1"
    assert normalize_answer("   ") is None
    assert normalize_answer("$$") is None
    assert normalize_answer(None) is None


def test_maj_at_n_hand_built():
    answers = [
        ["4", "4", "5"],  # clear winner "4", one "4" verified -> 1
        ["4", "5", "5"],  # winner "5", none verified -> 0
        ["7", "8", None],  # tie 7/8 -> first occurrence "7", verified -> 1
        ["8", "7", None],  # tie -> "8" wins, only "7" verified -> 0
        [None, None, None],  # no votes -> 0
        ["$12$", " 12 ", "13"],  # normalisation merges "$12$" and " 12 " -> 1
        [None, None, "3"],  # the only vote wins
        ["x + 1", "$x  + 1$", "y"],  # whitespace collapsed; verified only on the 2nd copy -> 1
    ]
    correct = [
        [0, 1, 0],
        [1, 0, 0],
        [1, 0, 0],
        [0, 1, 0],
        [0, 0, 0],
        [1, 0, 0],
        [0, 0, 1],
        [0, 1, 0],
    ]
    np.testing.assert_array_equal(maj_at_n(answers, correct), [1, 0, 1, 0, 0, 1, 1, 1])


def test_maj_at_n_length_mismatch():
    with pytest.raises(ValueError, match=r"answers\[0\] has 2 samples"):
        maj_at_n([["1", "2"]], [[1, 0, 0]])
    with pytest.raises(ValueError, match="answers has 2 problems"):
        maj_at_n([["1"], ["2"]], [[1]])


# --------------------------------------------------------------------------- #
# Bootstrap
# --------------------------------------------------------------------------- #
def test_bootstrap_reproducible_and_contains_point():
    rng = np.random.default_rng(3)
    values = (rng.random(200) < 0.4).astype(float)
    a = bootstrap_ci(values, n_boot=500, seed=7)
    b = bootstrap_ci(values, n_boot=500, seed=7)
    c = bootstrap_ci(values, n_boot=500, seed=8)
    assert a == b
    assert a != c
    assert a[0] <= values.mean() <= a[1]


def test_bootstrap_degenerate_inputs():
    assert bootstrap_ci(np.array([0.7])) == (0.7, 0.7)
    assert bootstrap_ci(np.full(50, 0.25)) == (0.25, 0.25)
    with pytest.raises(ValueError, match="at least one problem"):
        bootstrap_ci(np.array([]))


def test_bootstrap_width_matches_normal_approximation():
    rng = np.random.default_rng(11)
    n, p = 400, 0.3
    values = (rng.random(n) < p).astype(float)
    lo, hi = bootstrap_ci(values, n_boot=2000, seed=0)
    p_hat = values.mean()
    normal_width = 2 * 1.96 * np.sqrt(p_hat * (1 - p_hat) / n)
    assert abs((hi - lo) - normal_width) / normal_width < 0.15


def test_bootstrap_coverage():
    rng = np.random.default_rng(2024)
    p, n, trials = 0.3, 100, 200
    data = (rng.random((trials, n)) < p).astype(float)
    covered = 0
    for t in range(trials):
        lo, hi = bootstrap_ci(data[t], n_boot=500, seed=t)
        covered += lo <= p <= hi
    assert 0.88 <= covered / trials <= 0.99


# --------------------------------------------------------------------------- #
# Summaries and averages
# --------------------------------------------------------------------------- #
def test_metric_with_ci_formatting():
    m = MetricWithCI(0.4531, 0.41, 0.498)
    assert str(m) == "45.3 [41.0, 49.8]"
    assert m.format(digits=2) == "45.31 [41.00, 49.80]"
    assert m.format(ci=False) == "45.3"
    assert m.to_dict() == {"value": 0.4531, "lo": 0.41, "hi": 0.498}


def test_summarize_benchmark_fields():
    answers = [["1", "2", "2"], ["3", "3", "3"], [None, "4", "5"], ["6", "7", "7"]]
    truncated = np.array([[0, 0, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0]], dtype=bool)
    n_tokens = np.arange(12).reshape(4, 3)
    s = summarize_benchmark(TINY, answers=answers, truncated=truncated, n_tokens=n_tokens, n_boot=200)
    assert s["n_problems"] == 4 and s["n_samples"] == 3
    assert s["acc"].value == pytest.approx(0.5)
    assert sorted(s["pass_at_k"]) == [1, 2, 3]
    assert s["pass_at_k"][1].value == pytest.approx(s["acc"].value)
    assert s["pass_at_k"][3].value == pytest.approx(0.75)  # 3 of 4 problems have a correct sample
    assert s["pass_at_k"][2].value == pytest.approx((2 / 3 + 1 + 0 + 1) / 4)
    # maj: p0 winner "2" (samples 1,2 wrong) -> 0; p1 "3" -> 1; p2 tie 4/5 -> "4" wrong -> 0; p3 "7" -> 1.
    assert s["maj"].value == pytest.approx(0.5)
    assert s["nulls"] == 1
    assert s["truncation_rate"] == pytest.approx(3 / 12)
    assert s["mean_tokens"] == pytest.approx(5.5)
    for m in [s["acc"], s["maj"], *s["pass_at_k"].values()]:
        assert 0.0 <= m.lo <= m.value <= m.hi <= 1.0

    s2 = summarize_benchmark(TINY, extracted_none=np.zeros((4, 3), bool), ks=[3, 1])
    assert s2["maj"] is None and s2["nulls"] == 0 and sorted(s2["pass_at_k"]) == [1, 3]
    assert s2["truncation_rate"] is None and s2["mean_tokens"] is None

    with pytest.raises(ValueError, match=r"truncated\[1\] has 2 samples"):
        summarize_benchmark(TINY, truncated=[[0, 0, 0], [0, 0], [0, 0, 0], [0, 0, 0]])


def test_summarize_ragged_defaults_to_common_ks():
    s = summarize_benchmark([[1, 0, 0, 1], [0, 1], [1, 1, 1]], n_boot=100)
    assert s["n_samples"] == 4 and s["n_samples_min"] == 2 and s["n_samples_total"] == 9
    assert sorted(s["pass_at_k"]) == [1, 2]


def test_to_jsonable_is_plain_json():
    s = summarize_benchmark(TINY, answers=[["1"] * 3] * 4, n_boot=100)
    j = to_jsonable(s)
    assert "_per_problem" not in j
    assert set(j["pass_at_k"]) == {"1", "2", "3"}
    assert set(j["acc"]) == {"value", "lo", "hi"}
    assert json.loads(json.dumps(j, allow_nan=False)) == j
    # A JSON round-trip can still be tabulated.
    assert "pass@3" in format_table({"tiny": j})


def _bench(rows: list[list[int]], seed: int = 0) -> dict:
    return summarize_benchmark(np.array(rows, dtype=bool), n_boot=300, seed=seed)


def test_average_unweighted_vs_weighted():
    # A: 2 problems, acc 1.0; B: 6 problems, acc 0.25 (per-problem [1,0,0,0,0,0.5]).
    a = _bench([[1, 1], [1, 1]])
    b = _bench([[1, 1], [0, 0], [0, 0], [0, 0], [0, 0], [1, 0]])
    avg = average_over_benchmarks({"A": a, "B": b}, n_boot=400)
    assert avg["unweighted"]["acc"].value == pytest.approx((1.0 + 0.25) / 2)
    assert avg["weighted"]["acc"].value == pytest.approx((2 * 1.0 + 6 * 0.25) / 8)
    # pass@2: A = 1, B = 2/6.
    assert avg["unweighted"]["pass_at_k"][2].value == pytest.approx((1 + 2 / 6) / 2)
    assert avg["weighted"]["pass_at_k"][2].value == pytest.approx((2 + 2) / 8)
    assert avg["unweighted"]["n_problems"] == 8 and avg["unweighted"]["n_benchmarks"] == 2
    assert avg["unweighted"]["maj"] is None
    for key in ("unweighted", "weighted"):
        m = avg[key]["acc"]
        assert m.lo <= m.value <= m.hi
        # A has zero variance, so only B's resampling spreads the CI; it must still be non-trivial.
        assert m.hi > m.lo
    # Reproducible and independent of the dict order (per-benchmark seed streams).
    again = average_over_benchmarks({"B": b, "A": a}, n_boot=400)
    assert again["unweighted"]["acc"] == avg["unweighted"]["acc"]
    assert again["weighted"]["pass_at_k"][1] == avg["weighted"]["pass_at_k"][1]


def test_average_stratified_ci_width_shrinks_with_more_benchmarks():
    rng = np.random.default_rng(5)
    summaries = {f"b{i}": summarize_benchmark(rng.random((100, 3)) < 0.5, n_boot=200) for i in range(4)}
    avg = average_over_benchmarks(summaries, n_boot=500)
    one = summaries["b0"]["acc"]
    m = avg["unweighted"]["acc"]
    # Averaging 4 independent benchmarks of equal size halves the standard error.
    assert (m.hi - m.lo) == pytest.approx((one.hi - one.lo) / 2, rel=0.3)
    # Equal sizes: weighted and unweighted coincide.
    assert avg["weighted"]["acc"].value == pytest.approx(m.value)


def test_average_requires_per_problem_arrays():
    j = to_jsonable(_bench([[1, 0]]))
    with pytest.raises(ValueError, match="_per_problem"):
        average_over_benchmarks({"A": j})


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #
def test_format_table_markdown():
    ans = [["1", "1", "2"]] * 4
    summaries = {
        "math500": summarize_benchmark(TINY, answers=ans, n_boot=100),
        "aime|24": summarize_benchmark(TINY[:2], answers=ans[:2], n_boot=100),
    }
    avg = average_over_benchmarks(summaries, n_boot=100)
    table = format_table(summaries, avg)
    lines = table.splitlines()
    assert len(lines) == 2 + 2 + 2  # header, separator, 2 benchmarks, 2 averages
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert len({len(line) for line in lines}) == 1  # aligned columns
    cells = [c.strip() for c in lines[1].strip("|").split("|")]
    assert all(set(c) <= set("-:") and "-" in c for c in cells)
    assert "acc@3" in lines[0] and "pass@1" in lines[0] and "pass@3" in lines[0] and "maj@3" in lines[0]
    assert "avg (unweighted)" in table and "avg (weighted)" in table
    assert "aime\\|24" in table  # pipe escaped so the row keeps its columns
    assert "50.0 [" in lines[2]  # math500 acc = 0.5 in percent with a CI

    plain = format_table(summaries, metrics=("acc", "pass@2"), ci=False)
    assert "[" not in plain and len(plain.splitlines()) == 4
    with pytest.raises(ValueError, match="unknown metric"):
        format_table(summaries, metrics=("f1",))


def test_to_dataframe_long_format():
    summaries = {"A": _bench([[1, 0, 1], [0, 0, 1]]), "B": _bench([[1, 1, 1]])}
    avg = average_over_benchmarks(summaries, n_boot=100)
    df = to_dataframe(summaries, avg)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns)[:6] == ["benchmark", "metric", "k", "value", "lo", "hi"]
    # per row: acc + pass@1..3 (no maj): 4 rows x (2 benchmarks + 2 averages)
    assert len(df) == 16
    row = df[(df.benchmark == "A") & (df.metric == "pass@k") & (df.k == 3)].iloc[0]
    assert row.value == pytest.approx(1.0)
    assert set(df.benchmark) == {"A", "B", "avg (unweighted)", "avg (weighted)"}
    assert df["k"].dtype == np.int64
