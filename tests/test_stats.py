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


# ------------------------------------------------------------------------------------------ spread and power
def test_the_smallest_sign_flip_p_counts_non_zero_seeds_only():
    """Flipping a zero changes no sum: six seeds of which two are 0 have 2^4 distinct patterns, so the smallest p is
    2/16 = 0.125, not 2/64 (round two's pass@4: GRAIL's seeds 2 and 4 read Δ = 0). The exact test agrees: with the
    four non-zero Δ of one sign, only the all-+ and all-− patterns of those four reach |Σ|, 2 × 4 of the 64."""
    from grail_exp.analysis.stats import seed_sign_flip, seed_sign_flip_min_p

    d = [8.0, 0.0, -1.0, 0.0, -19.5, -12.5]
    assert seed_sign_flip_min_p(d) == 0.125
    assert seed_sign_flip_min_p([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == 2 / 64
    assert seed_sign_flip_min_p([0.0, 0.0, 1.0]) == 1.0  # one non-zero seed: either sign reaches it
    assert seed_sign_flip_min_p(6) == 2 / 64  # a count: all non-zero
    same_sign = [2.0, 0.0, 3.0, 0.0, 1.0, 4.0]
    assert seed_sign_flip(same_sign) == 8 / 64 == seed_sign_flip_min_p(same_sign) == _brute_force_seed_flip(same_sign)
    res = compare_paired({"b": np.array(d)[:, None] * np.ones((6, 4))}, n_boot=50)
    assert res.seed_flip_min_p == 0.125


def test_chi_square_quantiles_and_the_sd_interval_against_the_tables():
    """χ² quantiles from the printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4): df 5: 0.831 and 12.833,
    df 11: 3.816 and 21.920; to full precision against scipy. The sd interval of six values with sd 10: 10·√(5/12.8325)
    = 6.2421 to 10·√(5/0.83121) = 24.5261."""
    from scipy.stats import chi2

    from grail_exp.analysis.stats import chi2_quantile, chi2_sf, sd_interval

    assert round(chi2_quantile(0.025, 5), 3) == 0.831 and round(chi2_quantile(0.975, 5), 3) == 12.833
    assert round(chi2_quantile(0.025, 11), 3) == 3.816 and round(chi2_quantile(0.975, 11), 3) == 21.920
    for df in (1, 2, 3, 5, 6, 11, 40, 999, 1000):
        for x in (0.05, 0.9, 4.0, 17.0, float(df), 3.0 * df):
            assert chi2_sf(x, df) == pytest.approx(chi2.sf(x, df), rel=1e-10, abs=1e-300)
        assert chi2_quantile(0.975, df) == pytest.approx(chi2.ppf(0.975, df), rel=1e-10)
    lo, hi = sd_interval(10.0, 6)
    assert (lo, hi) == (pytest.approx(10 * np.sqrt(5 / 12.832502), rel=1e-6),
                        pytest.approx(10 * np.sqrt(5 / 0.8312116), rel=1e-6))
    assert (round(lo, 4), round(hi, 4)) == (6.2421, 24.5261)


def test_t_power_against_published_values_and_scipy():
    """R's documented example power.t.test(n = 20, delta = 1) (two-sample, sd 1, α 0.05: df 38, ncp √10) prints
    power = 0.8689528 (its default counts the upper tail only; the lower adds 2.3e-7); the one-sample (6.5e-7)
    power.t.test(n = 10, delta = 1, type = "one.sample") 0.8030962. G*Power's one-sample / paired t test, two-tailed
    α 0.05, power 0.80: dz = 0.5 needs N = 34 (actual power 0.8078), dz = 0.8 N = 15, dz = 0.2 N = 199. And scipy's
    noncentral t over a grid, to 1e-8."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    from grail_exp.analysis.stats import paired_t_power, seeds_needed, t_power

    assert t_power(np.sqrt(10), 38) == pytest.approx(0.8689528, abs=3e-7)
    assert paired_t_power(1.0, 1.0, 10) == pytest.approx(0.8030962, abs=1e-6)  # + the lower tail, 6.5e-7
    assert [seeds_needed(d, 1.0) for d in (0.5, 0.8, 0.2)] == [34, 15, 199]
    assert round(paired_t_power(0.5, 1.0, 34), 4) == 0.8078
    for df in (1, 2, 5, 11, 38, 300):
        c = student_t.ppf(0.975, df)
        for ncp in (0.0, 0.7, 2.0, 3.5, 6.0):
            ref = nct.sf(c, df, ncp) + nct.cdf(-c, df, ncp)
            assert t_power(ncp, df) == pytest.approx(ref, abs=1e-8), (df, ncp)


def test_power_at_six_seeds_by_brute_force_monte_carlo():
    """Independent of any t law: draw 200,000 sets of six per-seed differences N(14.5, 10.11²), run the two-sided
    paired t test at the table's t_{0.975, 5} = 2.5706 and count rejections. The rate is the power at n = 6: within
    4.5 binomial standard errors of t_power's, and near 0.8 (14.5 points is the effect six seeds detect at 80 %
    power at round two's sd of 10.11)."""
    from grail_exp.analysis.stats import detectable_effect, paired_t_power

    rng = np.random.default_rng(12345)
    reps, n, effect, sd = 200_000, 6, 14.5, 10.11
    x = rng.normal(effect, sd, size=(reps, n))
    t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / np.sqrt(n))
    rate = float((np.abs(t) > 2.5706).mean())
    power = paired_t_power(effect, sd, n)
    se = np.sqrt(power * (1 - power) / reps)
    assert abs(rate - power) < 4.5 * se + 1e-4  # + the table quantile's rounding
    assert 0.79 < power < 0.81
    assert detectable_effect(sd, n) == pytest.approx(14.5, abs=0.05)
    assert paired_t_power(detectable_effect(sd, n), sd, n) == pytest.approx(0.8, abs=1e-8)


def test_seeds_needed_is_the_smallest_n_reaching_the_power():
    """Round two's GRAIL − GRPO seed sd, 10.1114 points: a 3-point effect at 80 % needs 92 seeds (the power at 91 is
    below 0.8, at 92 above it, scipy's noncentral t), 5 points 35; the sd's own 95 % interval [6.31, 24.80] gives
    37 to 539 seeds for 3 points."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    from grail_exp.analysis.stats import sd_interval, seeds_needed

    def scipy_power(effect, sd, n):
        c = student_t.ppf(0.975, n - 1)
        ncp = effect * np.sqrt(n) / sd
        return nct.sf(c, n - 1, ncp) + nct.cdf(-c, n - 1, ncp)

    sd = 10.1114
    n3 = seeds_needed(3.0, sd)
    assert n3 == 92 and scipy_power(3.0, sd, 91) < 0.8 <= scipy_power(3.0, sd, 92)
    assert seeds_needed(5.0, sd) == 35
    lo, hi = sd_interval(sd, 6)
    assert (seeds_needed(3.0, lo), seeds_needed(3.0, hi)) == (37, 539)
    assert seeds_needed(3.0, 0.0) == 2  # no spread: the smallest test there is
    with pytest.raises(ValueError, match="effect of 0"):
        seeds_needed(0.0, sd)


def test_sd_ratio_bootstrap_on_a_case_enumerated_by_hand():
    """a = (0, 0, 2), b = (1, 3, 4), three seeds: all 27 resamples. sd(a) = 0 when seed 3 is missing or alone
    (2^3 + 1 = 9 dropped). The other 18 all have sd(a) = √(4/3) ({0,0,2} or {0,2,2}); sd(b) of their b's:
    {1,1,4} √3, {1,3,4} √(7/3), {3,3,4} √(1/3), {1,4,4} √3, {3,4,4} √(1/3), so the ratios are 1.5 (6 resamples),
    √(7/4) = 1.3229 (6) and 0.5 (6). The 2.5 % and 97.5 % points (linear, positions 0.425 and 16.575 of 0..17) are
    0.5 and 1.5; the ratio on the data √(7/3)/√(4/3) = √(7/4). With 10,000 random resamples the dropped share is
    9/27 within 5 binomial sds, and the interval the same."""
    from grail_exp.analysis.stats import sd_ratio_bootstrap

    a, b = [0.0, 0.0, 2.0], [1.0, 3.0, 4.0]
    every = np.array(list(itertools.product(range(3), repeat=3)))
    exact = sd_ratio_bootstrap(a, b, draws=every)
    assert exact.ratio == pytest.approx(np.sqrt(7 / 4), rel=1e-12)
    assert (exact.kept, exact.dropped) == (18, 9)
    assert (exact.lo, exact.hi) == (pytest.approx(0.5, rel=1e-12), pytest.approx(1.5, rel=1e-12))
    drawn = sd_ratio_bootstrap(a, b, n_boot=10_000, seed=0)
    assert drawn.kept + drawn.dropped == 10_000
    assert abs(drawn.dropped - 10_000 / 3) < 5 * np.sqrt(10_000 * (1 / 3) * (2 / 3))
    assert (drawn.lo, drawn.hi) == (pytest.approx(0.5), pytest.approx(1.5))
    with pytest.raises(ValueError, match="sd\\(a\\) is 0"):
        sd_ratio_bootstrap([1.0, 1.0], [0.0, 1.0])
