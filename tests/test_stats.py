"""grail_exp.analysis.stats: the paired bootstrap and the sign-flip test against brute-force enumeration."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from grail_exp.analysis.stats import compare_paired, paired_bootstrap, paired_delta, seed_spread, sign_flip_test


def _exact_bootstrap(diffs: dict[str, np.ndarray], average: str = "unweighted") -> np.ndarray:
    """Every equally likely replicate of the two-level stratified bootstrap, by enumerating ordered draws:
    S^S seed tuples × Π_b n_b^{n_b} problem tuples (written without the library's counts-and-einsum form)."""
    mats = list(diffs.values())
    S = mats[0].shape[0]
    n = [m.shape[1] for m in mats]
    w = [1 / len(mats)] * len(mats) if average == "unweighted" else [nb / sum(n) for nb in n]
    per_bench = [list(itertools.product(range(nb), repeat=nb)) for nb in n]
    values = []
    for seeds in itertools.product(range(S), repeat=S):
        for draws in itertools.product(*per_bench):
            total = 0.0
            for wb, m, idx in zip(w, mats, draws):
                total += wb * np.mean([m[s, i] for s in seeds for i in idx])
            values.append(total)
    return np.array(values)


def _ks_distance(sample: np.ndarray, exact: np.ndarray) -> float:
    # Round: the same atom computed by two formulas differs in the last bits and would split a CDF step.
    sample, exact = np.round(sample, 9), np.round(exact, 9)
    grid = np.unique(np.concatenate([sample, exact]))
    f_s = np.searchsorted(np.sort(sample), grid, side="right") / sample.size
    f_e = np.searchsorted(np.sort(exact), grid, side="right") / exact.size
    return float(np.abs(f_s - f_e).max())


def _check_against_exact(diffs, average, n_boot=40_000):
    exact = _exact_bootstrap(diffs, average)
    boot = paired_bootstrap(diffs, n_boot=n_boot, alpha=0.1, seed=3, average=average)
    assert boot.estimate == pytest.approx(paired_delta(diffs, average))
    assert boot.replicates.mean() == pytest.approx(exact.mean(), abs=4 * exact.std() / np.sqrt(n_boot))
    assert boot.replicates.std() == pytest.approx(exact.std(), rel=0.03)
    # DKW: P(sup |F_n − F| > 0.012) ≤ 2 exp(−2 n ε²) ≈ 2e-5 at n = 40,000.
    assert _ks_distance(boot.replicates, exact) < 0.012
    # The interval ends are (discrete) quantiles of the exact distribution, up to the Monte-Carlo error.
    assert np.quantile(exact, 0.05 - 0.012) - 1e-12 <= boot.lo <= np.quantile(exact, 0.05 + 0.012) + 1e-12
    assert np.quantile(exact, 0.95 - 0.012) - 1e-12 <= boot.hi <= np.quantile(exact, 0.95 + 0.012) + 1e-12


def test_bootstrap_one_seed_matches_enumeration_2_benchmarks_x_3_problems():
    diffs = {"a": np.array([[1.0, 0.0, -1 / 3]]), "b": np.array([[2 / 3, 2 / 3, 0.0]])}
    _check_against_exact(diffs, "unweighted")


def test_bootstrap_two_seeds_and_unequal_benchmarks_matches_enumeration():
    # 2 seeds × (3 + 2 problems): seeds and problems resampled, problem counts unequal so the weighting matters.
    diffs = {"a": np.array([[1.0, 0.0, -1 / 3], [1 / 3, 1 / 3, 0.0]]), "b": np.array([[0.0, -1.0], [2 / 3, 1.0]])}
    _check_against_exact(diffs, "unweighted")
    _check_against_exact(diffs, "weighted")


def test_bootstrap_without_seed_resampling_only_varies_problems():
    diffs = {"a": np.array([[1.0, 0.0], [0.0, 0.0]])}
    boot = paired_bootstrap(diffs, n_boot=2000, seed=0, resample_seeds=False)
    # seed-averaged problem differences are 0.5 and 0: replicates ∈ {0, 0.25, 0.5}
    assert set(np.round(boot.replicates, 12)) <= {0.0, 0.25, 0.5}


def _exact_sign_flip(diffs, average="unweighted"):
    """Enumerate every sign pattern over all problems (zeros included) with the plain formula."""
    mats = list(diffs.values())
    x = [m.mean(axis=0) for m in mats]
    n = [len(v) for v in x]
    w = [1 / len(x)] * len(x) if average == "unweighted" else [nb / sum(n) for nb in n]

    def stat(signs):
        out, j = 0.0, 0
        for wb, v in zip(w, x):
            out += wb * np.mean([signs[j + i] * v[i] for i in range(len(v))])
            j += len(v)
        return out

    observed = abs(stat([1] * sum(n)))
    flips = list(itertools.product([1, -1], repeat=sum(n)))
    return sum(abs(stat(s)) >= observed - 1e-12 for s in flips) / len(flips)


def test_sign_flip_exact_matches_enumeration():
    diffs = {"a": np.array([[1.0, 0.0, -1 / 3], [1 / 3, 1.0, 0.0]]), "b": np.array([[2 / 3, 1.0], [1.0, 1.0]])}
    for average in ("unweighted", "weighted"):
        p, method = sign_flip_test(diffs, average=average)
        assert method == "exact"
        assert p == pytest.approx(_exact_sign_flip(diffs, average), abs=1e-12)


def test_sign_flip_all_positive_gives_the_smallest_two_sided_p():
    # m identical positive differences: only all-plus and all-minus are as extreme -> p = 2 / 2^m.
    p, _ = sign_flip_test({"a": np.ones((1, 6))})
    assert p == pytest.approx(2 / 2**6)
    assert sign_flip_test({"a": np.zeros((2, 4))}) == (1.0, "exact")


def test_sign_flip_monte_carlo_agrees_with_exact():
    rng = np.random.default_rng(1)
    diffs = {"a": rng.choice([-1.0, 0.0, 1.0, 2 / 3], size=(2, 9)), "b": rng.choice([-1.0, 1.0, 0.5], size=(2, 7))}
    exact, m1 = sign_flip_test(diffs, exact_max=20)
    mc, m2 = sign_flip_test(diffs, exact_max=4, n_perm=40_000, seed=5)
    assert (m1, m2) == ("exact", "monte-carlo")
    assert mc == pytest.approx(exact, abs=4 * np.sqrt(exact * (1 - exact) / 40_000) + 1e-4)


def test_seed_spread_and_compare_paired():
    assert seed_spread([0.1]) == (0.1, None)
    mean, sd = seed_spread([0.1, 0.3, 0.2])
    assert mean == pytest.approx(0.2) and sd == pytest.approx(0.1)
    diffs = {"a": np.array([[1.0, 0.0], [0.0, 0.0]]), "b": np.array([[1.0], [-1.0]])}
    r = compare_paired(diffs, n_boot=500)
    # seed 0: (0.5 + 1) / 2 = 0.75; seed 1: (0 - 1) / 2 = -0.5
    assert r.seed_deltas == pytest.approx([0.75, -0.5])
    assert r.delta == pytest.approx(0.125) and r.n_seeds == 2 and r.n_problems == 3
    assert r.lo <= r.delta <= r.hi


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'b'"):
        paired_delta({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="average"):
        paired_delta({"a": np.zeros((1, 3))}, average="median")


# ------------------------------------------------------------------------------------------------ seed-level tests
def _brute_force_seed_flip(d: list[float]) -> float:
    """Every one of the 2^S sign assignments, one at a time."""
    observed, hits, total = abs(sum(d)), 0, 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        total += 1
        hits += abs(sum(s * x for s, x in zip(signs, d))) >= observed - 1e-12
    return hits / total


def test_seed_level_tests_with_three_seeds_by_hand():
    """d = (1, 2, 3): mean 2, sd 1, t = 2 / (1/√3) = 2√3, df 2. For df = 2 the t law has P(|T| <= t) = t / √(t² + 2),
    so p = 1 − 2√3 / √14 = 0.07418 (also scipy's t.sf, written out here). The sign flips: the eight sums are
    ±6, ±0, ±2, ±4, only ±6 reach |6|: p = 2/8 = 0.25, the smallest p three seeds can give."""
    from scipy.stats import t as student_t

    from grail_exp.analysis.stats import seed_sign_flip, seed_sign_flip_min_p, seed_t_test

    res = seed_t_test([1.0, 2.0, 3.0])
    t_hand = 2 / (1 / np.sqrt(3))
    assert res.t == pytest.approx(t_hand, rel=1e-12) and res.df == 2
    assert res.p == pytest.approx(1 - t_hand / np.sqrt(t_hand**2 + 2), rel=1e-9)
    assert res.p == pytest.approx(2 * student_t.sf(t_hand, 2), rel=1e-9)
    half = 4.302652729911275 / np.sqrt(3)  # t_{0.975, 2} (tables: 4.303) × sd / √S
    assert (res.lo, res.hi) == (pytest.approx(2 - half, rel=1e-9), pytest.approx(2 + half, rel=1e-9))
    assert seed_sign_flip([1.0, 2.0, 3.0]) == 0.25 == _brute_force_seed_flip([1.0, 2.0, 3.0])
    assert seed_sign_flip_min_p(3) == 0.25
    # the CPU study's GRAIL per-seed Δ (+1.0, −7.6, −5.1): sums ±13.7, ±11.7, ±3.5, ±1.5 -> 4/8 reach 11.7
    assert seed_sign_flip([1.0, -7.6, -5.1]) == 0.5 == _brute_force_seed_flip([1.0, -7.6, -5.1])


def test_seed_level_tests_with_six_seeds_by_hand():
    """d = (2, 3, 1, 4, −1, 3): mean 2, squared deviations 0+1+1+4+9+1 = 16, sd = √(16/5), t = 2 / (sd/√6) = 2.7386,
    df 5; the tables put it between t_{0.975,5} = 2.571 and t_{0.99,5} = 3.365, so 0.02 < p < 0.05."""
    from scipy.stats import t as student_t

    from grail_exp.analysis.stats import seed_sign_flip, seed_sign_flip_min_p, seed_t_test

    d = [2.0, 3.0, 1.0, 4.0, -1.0, 3.0]
    res = seed_t_test(d)
    t_hand = 2 / (np.sqrt(16 / 5) / np.sqrt(6))
    assert res.t == pytest.approx(t_hand, rel=1e-12) and res.df == 5
    assert 2.571 < res.t < 3.365 and 0.02 < res.p < 0.05
    assert res.p == pytest.approx(2 * student_t.sf(t_hand, 5), rel=1e-9)
    half = student_t.ppf(0.975, 5) * np.sqrt(16 / 5) / np.sqrt(6)
    assert (res.lo, res.hi) == (pytest.approx(2 - half, rel=1e-9), pytest.approx(2 + half, rel=1e-9))
    assert seed_sign_flip(d) == pytest.approx(_brute_force_seed_flip(d), abs=0)
    assert seed_sign_flip_min_p(6) == 2 / 64
    assert seed_sign_flip([1.0] * 6) == 2 / 64  # all positive: only the all-+ and all-− assignments reach it


def test_seed_t_p_matches_scipy_for_every_small_df():
    from scipy.stats import t as student_t

    from grail_exp.analysis.stats import t_quantile, t_two_sided_p

    for df in range(1, 12):
        for t in (0.0, 0.4, 1.3, 2.2, 5.7, 40.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * student_t.sf(t, df), rel=1e-9, abs=1e-15)
        assert t_quantile(0.975, df) == pytest.approx(student_t.ppf(0.975, df), rel=1e-9)


def test_one_seed_has_no_seed_level_test():
    from grail_exp.analysis.stats import compare_paired

    res = compare_paired({"b": np.array([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])}, n_boot=200)
    assert res.seed_t_p is None and res.seed_flip_p is None and not res.seed_level()
    assert res.p_value < 0.05 and not res.significant(0.05)  # problems only: never a star


def test_holm_by_hand():
    """p = (0.01, 0.04, 0.03, 0.005), m = 4: sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 ->
    running max 0.06; in the input order (0.03, 0.06, 0.06, 0.02). Capped at 1."""
    from grail_exp.analysis.stats import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([0.2]) == [0.2]



def test_declared_rule_by_hand():
    """At least 5 of 6 seeds on one side and the t interval on that side (the interval is given, so each clause is
    tested on its own); a zero difference counts for neither side; fewer seeds than declared: not applied."""
    from grail_exp.analysis.stats import declared_rule

    d = [1.0, 2.0, 3.0, 4.0, 5.0, -1.0]
    assert declared_rule(d, 0.5, 4.0, 6, 5).verdict == "better"
    assert declared_rule(d, -0.2, 4.0, 6, 5).verdict == "not settled"  # 5 of 6, interval across 0
    assert declared_rule(d, 0.5, 4.0, 6, 6).verdict == "not settled"  # 5 of 6 short of a declared 6
    assert declared_rule([-x for x in d], -4.0, -0.5, 6, 5).verdict == "worse"
    assert declared_rule([-x for x in d], 0.5, 4.0, 6, 5).verdict == "not settled"  # negative seeds, interval above
    assert declared_rule([0.0, 1, 1, 1, 1, 1], 0.1, 1.0, 6, 5).verdict == "better"
    zeros = declared_rule([0.0, 0.0, 1, 1, 1, 1], 0.1, 1.0, 6, 5)
    assert (zeros.verdict, zeros.positive, zeros.negative) == ("not settled", 4, 0)
    partial = declared_rule([5.0, 6.0, 7.0], 2.0, 10.0, 6, 5)
    assert partial.verdict == "not applied"
    assert partial.text("grail", "grpo") == ("3 of 3 seeds positive, 0 negative: not applied yet (3 of the 6 "
                                             "declared seeds paired)")
    assert declared_rule(d, 0.5, 4.0, 6, 5).text("grail", "grpo") == \
        "5 of 6 seeds positive, 1 negative -> grail beats grpo"
    with pytest.raises(ValueError, match="declared for 6"):
        declared_rule(d + [1.0], 0.5, 4.0, 6, 5)
    with pytest.raises(ValueError, match="min_same_sign must be in 1..declared_seeds"):
        declared_rule(d, 0.5, 4.0, 6, 7)

def test_a_star_needs_both_seed_tests_and_an_interval_without_zero():
    """Six seeds of +1 point on every problem: seed t p = 0 (no spread), seed sign-flip p = 2/64 < 0.05 and the
    interval is [+1, +1]: a star. Three such seeds: the seed sign-flip cannot go below 0.25, no star."""
    from grail_exp.analysis.stats import compare_paired

    six = compare_paired({"b": np.ones((6, 5))}, n_boot=200)
    assert six.seed_flip_p == 2 / 64 and six.seed_t_p == 0.0 and six.significant(0.05)
    three = compare_paired({"b": np.ones((3, 5))}, n_boot=200)
    assert three.seed_flip_p == 0.25 and not three.significant(0.05)
    six.seed_flip_p_holm, six.seed_t_p_holm = 0.06, 0.0  # adjusted above alpha: a non-primary comparison loses it
    assert not six.significant(0.05)
    six.primary = True
    assert six.significant(0.05)
