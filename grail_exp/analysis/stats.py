"""Paired statistics for comparing two training schemes on the same benchmark problems (pure numpy).

The input is a matrix of per-problem differences per benchmark,

    D_b[s, i] = v_X(s, b, i) − v_G(s, b, i)        shape (S, n_b)

for training seed s (the seeds both arms have), benchmark b and problem i, where v is a per-problem metric
(acc@n = c/n, or unbiased pass@k) of scheme X and of the baseline G (GRPO) trained with the same seed. Pairing by
(benchmark, problem) is valid because both arms answer the same problems; it is tight because the evaluation draws
every chunk of problems from the same sampling seed in both arms (common random numbers, grail_exp/evaluate.py).

The statistic is the paired mean difference, averaged over seeds, then over problems within a benchmark, then over
benchmarks (unweighted, as the GRAIL paper averages its six benchmarks; or weighted by problem count):

    Δ = Σ_b w_b · mean_s mean_i D_b[s, i],     w_b = 1/B (unweighted) or n_b / Σ n (weighted)

**Confidence interval — two-level (seeds × problems) paired bootstrap.** Seeds and problems are crossed (every seed
is evaluated on every problem), so a replicate resamples both independently, the "pigeonhole" bootstrap for crossed
designs (Owen 2007, "The pigeonhole bootstrap", Ann. Appl. Stat. 1(2)): S seeds drawn with replacement (only when
S > 1; one draw shared by all benchmarks, since a seed is one trained model), and, independently for each
benchmark (stratified), n_b problems drawn with replacement; the replicate is Σ_b w_b times the mean of D_b
over the drawn (seed, problem) pairs. The interval is the percentile interval of the replicates (Efron &
Tibshirani 1993, ch. 13). It covers problem sampling, the evaluation's sampling noise (inside each v) and, with
several seeds, the training-seed spread; with one seed it says nothing about training noise.

**Significance — paired sign-flip (randomisation) test, stratified by benchmark.** Let x_{b,i} = mean_s D_b[s, i]
(the seed-averaged per-problem difference). Under H0 "the scheme label does not matter", for every problem the
results of the two arms are exchangeable, so every sign pattern ε ∈ {±1}^N of T(ε) = Σ_b (w_b / n_b) Σ_i ε_{b,i}
x_{b,i} is equally likely (Fisher 1935; the "approximate randomisation" test of Noreen 1989, recommended for paired
NLP comparisons by Dror et al. 2018, ACL). Two-sided p = P(|T(ε)| ≥ |T(1)|): exact by enumerating all 2^m patterns
of the m non-zero x (zeros contribute nothing) when m ≤ ``exact_max``, else Monte Carlo with the (1 + hits) /
(1 + n_perm) estimator (Phipson & Smyth 2010), which never reports p = 0. Flips are per problem and each keeps its
benchmark's weight w_b / n_b, so the null distribution respects the strata. We chose this over a bootstrap p-value
because it is exact (valid at any sample size, no inversion of an interval) and assumption-free given the pairing.
What it tests: whether the difference between these trained models is larger than problem-to-problem and
sampling variation — the trained models are held fixed (averaged over seeds), so training-seed variation is *not*
part of its null; it is reported separately as the per-seed Δ (mean ± sd over seeds) and enters the bootstrap CI.
It answers "did these trained models differ", labelled so in the report ("these trained models only").

**Significance of the scheme — seed-level tests.** Whether a *scheme* beats the baseline is a question about
training runs, and the unit of replication is the training seed: d_s = Δ of seed s (the per-seed paired difference,
averaged over problems and benchmarks as Δ is), s = 1..S. Two tests of E[d] = 0 on those S numbers:

* the paired t test: t = mean(d) / (sd(d) / √S) with sd the sample standard deviation (ddof = 1), two-sided p from
  Student's t with df = S − 1 (its CDF in closed form for integer df, Abramowitz & Stegun 26.7.3–4), and the
  t interval mean(d) ± t_{1−α/2, S−1} · sd(d) / √S;
* the exact seed-level sign-flip test: p = #{ε ∈ {±1}^S : |Σ ε_s d_s| ≥ |Σ d_s|} / 2^S over all 2^S sign
  assignments (no normality assumption). Its smallest attainable p is 2 / 2^m with m the non-zero d_s (3 seeds:
  0.25, 6 seeds: 0.031, 6 seeds of which two are 0: 0.125): with few seeds it cannot reject at 5 %, whatever the
  data, and the report says so.

The report stars a difference only when both seed-level p-values are below α (Holm-adjusted outside the declared
primary comparison, :func:`holm`) and the two-level bootstrap interval excludes 0. With one seed there is no
seed-level test ("1 seed, problems only") and never a star.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PairedResult", "benchmark_weights", "paired_delta", "paired_bootstrap", "sign_flip_test",
           "seed_spread", "compare_paired", "t_two_sided_p", "t_quantile", "seed_t_test", "seed_sign_flip",
           "seed_sign_flip_min_p", "nonzero_seeds", "holm", "declared_rule", "normal_cdf", "chi2_sf", "chi2_quantile",
           "sd_interval", "t_power", "paired_t_power", "seeds_needed", "detectable_effect", "SdRatio",
           "sd_ratio_bootstrap"]


def _as_matrices(diffs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validate ``{benchmark: (S, n_b)}``: 2-D, finite, the same S everywhere, at least one problem."""
    if not diffs:
        raise ValueError("paired statistics need at least one benchmark")
    out, n_seeds = {}, None
    for name, d in diffs.items():
        d = np.asarray(d, dtype=np.float64)
        if d.ndim == 1:
            d = d[None, :]
        if d.ndim != 2 or d.shape[1] == 0 or d.shape[0] == 0:
            raise ValueError(f"differences of {name!r} must be (seeds, problems) with both > 0, got {d.shape}")
        if not np.isfinite(d).all():
            raise ValueError(f"differences of {name!r} contain non-finite values")
        if n_seeds is not None and d.shape[0] != n_seeds:
            raise ValueError(f"every benchmark needs the same seeds: {name!r} has {d.shape[0]}, others {n_seeds}")
        n_seeds = d.shape[0]
        out[name] = d
    return out


def benchmark_weights(n_problems: Sequence[int], average: str = "unweighted") -> np.ndarray:
    """w_b: 1/B (``unweighted``, the paper's average) or n_b / Σ n (``weighted``, the pooled mean)."""
    n = np.asarray(n_problems, dtype=np.float64)
    if average == "unweighted":
        return np.full(n.size, 1.0 / n.size)
    if average == "weighted":
        return n / n.sum()
    raise ValueError(f"average must be 'unweighted' or 'weighted', got {average!r}")


def paired_delta(diffs: Mapping[str, np.ndarray], average: str = "unweighted") -> float:
    """Δ = Σ_b w_b · mean over seeds and problems of D_b."""
    d = _as_matrices(diffs)
    w = benchmark_weights([m.shape[1] for m in d.values()], average)
    return float(sum(wb * m.mean() for wb, m in zip(w, d.values())))


@dataclass
class BootstrapResult:
    estimate: float  # Δ on the data
    lo: float  # percentile interval
    hi: float
    replicates: np.ndarray = field(repr=False)  # (n_boot,) the bootstrap distribution


def paired_bootstrap(diffs: Mapping[str, np.ndarray], n_boot: int = 10_000, alpha: float = 0.05, seed: int = 0,
                     average: str = "unweighted", resample_seeds: bool = True) -> BootstrapResult:
    """Two-level stratified paired bootstrap of Δ (module docstring): seeds (if S > 1 and ``resample_seeds``)
    and, per benchmark, problems are drawn with replacement; percentile ``1 − alpha`` interval."""
    d = _as_matrices(diffs)
    if int(n_boot) < 1 or not 0 < alpha < 1:
        raise ValueError(f"need n_boot >= 1 and 0 < alpha < 1, got n_boot={n_boot}, alpha={alpha}")
    rng = np.random.default_rng(seed)
    mats = list(d.values())
    n_seeds = mats[0].shape[0]
    w = benchmark_weights([m.shape[1] for m in mats], average)
    if n_seeds > 1 and resample_seeds:
        seed_counts = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=n_boot)  # (R, S)
    else:
        seed_counts = np.ones((n_boot, n_seeds))
    reps = np.zeros(n_boot)
    for wb, m in zip(w, mats):
        n_b = m.shape[1]
        per_problem = seed_counts @ m / n_seeds  # (R, n_b): each problem's mean over the drawn seeds
        drawn = rng.integers(0, n_b, size=(n_boot, n_b))  # (R, n_b): problems drawn with replacement
        reps += wb * np.take_along_axis(per_problem, drawn, axis=1).mean(axis=1)
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return BootstrapResult(paired_delta(d, average), float(lo), float(hi), reps)


def sign_flip_test(diffs: Mapping[str, np.ndarray], average: str = "unweighted", n_perm: int = 10_000,
                   seed: int = 0, exact_max: int = 16) -> tuple[float, str]:
    """Two-sided paired sign-flip test of Δ = 0, stratified by benchmark (module docstring).

    ``diffs`` as for :func:`paired_bootstrap`; seeds are averaged per problem first. Returns ``(p, method)`` with
    method ``"exact"`` (all 2^m sign patterns of the m non-zero problems) or ``"monte-carlo"``.
    """
    d = _as_matrices(diffs)
    mats = list(d.values())
    w = benchmark_weights([m.shape[1] for m in mats], average)
    # T(ε) = Σ_j ε_j a_j with a_j = (w_b / n_b) · x_{b,i}; only non-zero terms can change sign.
    a = np.concatenate([wb / m.shape[1] * m.mean(axis=0) for wb, m in zip(w, mats)])
    a = a[a != 0]
    if a.size == 0:
        return 1.0, "exact"
    observed = abs(a.sum())
    tol = 1e-12 * max(1.0, np.abs(a).sum())  # ties with |T_obs| count as "as extreme" despite rounding
    if a.size <= exact_max:
        m = a.size
        hits = 0
        for start in range(0, 2**m, 1 << 16):  # all patterns, in blocks of 65,536
            codes = np.arange(start, min(2**m, start + (1 << 16)))
            signs = 1 - 2 * ((codes[:, None] >> np.arange(m)) & 1)  # (block, m) of ±1
            hits += int((np.abs(signs @ a) >= observed - tol).sum())
        return hits / 2**m, "exact"
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_perm, 4096):
        block = min(4096, n_perm - start)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(block, a.size))
        hits += int((np.abs(signs @ a) >= observed - tol).sum())
    return (1 + hits) / (1 + n_perm), "monte-carlo"


def seed_spread(per_seed: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof = 1) of the per-seed Δ; sd is None with one seed."""
    x = np.asarray(per_seed, dtype=np.float64)
    if x.size == 0:
        raise ValueError("seed_spread needs at least one seed")
    return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None)


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer ``df`` >= 1, in closed form (Abramowitz & Stegun 26.7.3 for odd
    df, 26.7.4 for even): with θ = atan(|t| / √df), A = P(|T| <= |t|) is a finite series in sin θ and cos θ."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    if math.isinf(t):
        return 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:  # (2/π)[θ + sin θ (cos θ + (2/3) cos³ θ + ... + (2·4···(df−3))/(1·3···(df−2)) cos^(df−2) θ)]
        term, series = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c2 * (2 * k) / (2 * k + 1)
        a = 2 / math.pi * (theta + math.sin(theta) * series)
    else:  # sin θ [1 + (1/2) cos² θ + (1·3)/(2·4) cos⁴ θ + ... + (1·3···(df−3))/(2·4···(df−2)) cos^(df−2) θ]
        term, series = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= c2 * (2 * k - 1) / (2 * k)
        a = math.sin(theta) * series
    return float(min(1.0, max(0.0, 1.0 - a)))


def t_quantile(prob: float, df: int) -> float:
    """The ``prob`` quantile (0.5 < prob < 1) of Student's t with integer ``df``: bisection on
    :func:`t_two_sided_p` (monotone in t) to 1e-12."""
    if not 0.5 < prob < 1:
        raise ValueError(f"prob must be in (0.5, 1), got {prob}")
    target = 2 * (1 - prob)  # two-sided tail beyond the quantile
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return (lo + hi) / 2


@dataclass
class SeedTest:
    """The seed-level paired t test of the per-seed differences (module docstring); None fields with one seed."""

    t: float | None
    df: int
    p: float | None
    lo: float | None  # the 1 − α t interval of the mean per-seed difference
    hi: float | None


def seed_t_test(per_seed: Sequence[float], alpha: float = 0.05) -> SeedTest:
    """Paired t test over seeds: t = mean / (sd / √S), df = S − 1, two-sided p, and the t interval. Identical
    non-zero differences (sd = 0) give t = ±inf, p = 0; all-zero differences give t = 0, p = 1."""
    d = np.asarray(per_seed, dtype=np.float64)
    n = d.size
    if n < 2:
        return SeedTest(None, max(n - 1, 0), None, None, None)
    mean, se = float(d.mean()), float(d.std(ddof=1)) / math.sqrt(n)
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))  # an sd of rounding noise is no spread
    if se <= tol:
        t = 0.0 if abs(mean) <= tol else math.copysign(math.inf, mean)
    else:
        t = mean / se
    half = t_quantile(1 - alpha / 2, n - 1) * se
    return SeedTest(float(t), n - 1, t_two_sided_p(t, n - 1), mean - half, mean + half)


def seed_sign_flip(per_seed: Sequence[float]) -> float | None:
    """Exact two-sided sign-flip p over seeds: the share of the 2^S sign assignments ε with |Σ ε_s d_s| >= |Σ d_s|
    (ties within rounding count); None with no seed."""
    d = np.asarray(per_seed, dtype=np.float64)
    if d.size == 0:
        return None
    codes = np.arange(2 ** d.size)
    signs = 1 - 2 * ((codes[:, None] >> np.arange(d.size)) & 1)  # (2^S, S) of ±1
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))
    return float((np.abs(signs @ d) >= abs(d.sum()) - tol).mean())


def seed_sign_flip_min_p(per_seed: Sequence[float] | int) -> float:
    """The smallest p the exact seed-level sign-flip test can reach: 2 / 2^m with m the number of **non-zero**
    per-seed differences (flipping a zero changes nothing, so two zeros among six seeds leave 2 / 2^4 = 0.125, not
    0.031); 1 when m <= 1. An int is a count of seeds taken as all non-zero."""
    m = int(per_seed) if isinstance(per_seed, (int, np.integer)) else nonzero_seeds(per_seed)
    return 1.0 if m <= 1 else 2.0 / 2 ** m


def nonzero_seeds(per_seed: Sequence[float]) -> int:
    """The per-seed differences that are not 0 within rounding (the sign-flip test's tolerance for ties)."""
    d = np.asarray(per_seed, dtype=np.float64)
    tol = 1e-12 * max(1.0, float(np.abs(d).sum())) if d.size else 0.0
    return int((np.abs(d) > tol).sum())


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input order: with p_(1) <= ... <= p_(m),
    p̃_(j) = max_{i <= j} min(1, (m − i + 1) p_(i))."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p, kind="stable")
    out, running = np.empty_like(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (p.size - rank) * p[i]))
        out[i] = running
    return out.tolist()


# ----------------------------------------------------------------------------------- seed spread and power
# How many seeds a comparison needs, and what the seeds one has can detect: the seed-level paired t test above, at
# the spread the per-seed differences show. Pure numpy + math: the chi-square law in closed form for integer df
# (Abramowitz & Stegun 26.4.4-5), the noncentral t power by numerical integration over the sample sd.


def normal_cdf(x):
    """Φ(x) = erfc(−x/√2) / 2, elementwise."""
    return 0.5 * np.vectorize(math.erfc, otypes=[float])(-np.asarray(x, dtype=np.float64) / math.sqrt(2.0))


def chi2_sf(x: float, df: int) -> float:
    """P(χ²_df >= x) for integer ``df`` >= 1 (Abramowitz & Stegun 26.4.4 / 26.4.5), summed in log space so large df
    do not underflow: even df, e^(−x/2) Σ_{k<df/2} (x/2)^k / k!; odd df, 2 Q(√x) + 2 φ(√x) Σ_{r=1}^{(df−1)/2}
    x^(r−½) / (1·3···(2r−1)) with Q the normal upper tail and φ the normal density."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    if x <= 0:
        return 1.0
    if df % 2 == 0:
        logs = [-x / 2 + k * math.log(x / 2) - math.lgamma(k + 1) for k in range(df // 2)]
        base = 0.0
    else:
        r = np.arange(1, (df - 1) // 2 + 1)
        # log 2φ(√x) + (r − ½) log x − log(1·3···(2r−1)),  1·3···(2r−1) = (2r)! / (2^r r!)
        logs = [math.log(2) - x / 2 - 0.5 * math.log(2 * math.pi) + (k - 0.5) * math.log(x)
                - (math.lgamma(2 * k + 1) - k * math.log(2) - math.lgamma(k + 1)) for k in r]
        base = math.erfc(math.sqrt(x / 2))  # 2 Q(√x)
    if logs:
        top = max(logs)
        base += math.exp(top) * sum(math.exp(v - top) for v in logs)
    return float(min(1.0, max(0.0, base)))


def chi2_quantile(prob: float, df: int) -> float:
    """The ``prob`` quantile (0 < prob < 1) of χ²_df: bisection on :func:`chi2_sf` to 1e-12 relative."""
    if not 0 < prob < 1:
        raise ValueError(f"prob must be in (0, 1), got {prob}")
    lo, hi = 0.0, float(df) + 10 * math.sqrt(2 * df) + 10
    while chi2_sf(hi, df) > 1 - prob:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > 1 - prob else (lo, mid)
    return (lo + hi) / 2


def sd_interval(sd: float, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The 1 − α interval of a normal population's sd from the sample sd of ``n`` values: sd·√((n−1)/χ²_{1−α/2,n−1})
    to sd·√((n−1)/χ²_{α/2,n−1}). Six values give [0.62, 2.45] × sd, twelve [0.71, 1.70] × sd."""
    if n < 2:
        raise ValueError(f"an sd interval needs n >= 2 values, got {n}")
    df = n - 1
    return (sd * math.sqrt(df / chi2_quantile(1 - alpha / 2, df)), sd * math.sqrt(df / chi2_quantile(alpha / 2, df)))


def t_power(ncp: float, df: int, alpha: float = 0.05) -> float:
    """Power of the two-sided level-α t test with ``df`` degrees of freedom when the statistic is noncentral t with
    noncentrality ``ncp``: P(|T'| > c), c = t_{1−α/2, df}. With T' = (Z + ncp) / U, U = √(χ²_df / df) independent of
    Z ~ N(0, 1), P(|T'| > c) = ∫ [Φ(ncp − c u) + Φ(−ncp − c u)] g(u) du, g the density of U,
    g(u) = 2 (df/2)^(df/2) / Γ(df/2) · u^(df−1) e^(−df u²/2); the integral by Simpson's rule on 4,000 intervals
    over the range holding all but a negligible part of U's mass."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if not math.isfinite(ncp):
        return 1.0
    c = t_quantile(1 - alpha / 2, int(df))
    spread = 10 / math.sqrt(df)
    u = np.linspace(max(0.0, 1 - spread), 1 + spread + (4.0 if df < 4 else 0.0), 4001)
    half = df / 2
    log_norm = math.log(2) + half * math.log(half) - math.lgamma(half)
    g = np.zeros_like(u)
    pos = u > 0
    g[pos] = np.exp(log_norm + (df - 1) * np.log(u[pos]) - half * u[pos] ** 2)
    if df == 1:  # u^0 = 1 at u = 0
        g[~pos] = math.exp(log_norm)
    f = (normal_cdf(ncp - c * u) + normal_cdf(-ncp - c * u)) * g
    h = u[1] - u[0]
    integral = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return float(min(1.0, max(0.0, integral)))


def paired_t_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t test over ``n`` seeds to detect a mean difference ``effect`` when the per-seed
    differences have sd ``sd``: :func:`t_power` with ncp = effect √n / sd and df = n − 1."""
    if n < 2:
        raise ValueError(f"a paired t test needs n >= 2, got {n}")
    ncp = math.inf if sd == 0 else abs(effect) * math.sqrt(n) / sd
    return t_power(ncp, n - 1, alpha)


def seeds_needed(effect: float, sd: float, power: float = 0.8, alpha: float = 0.05, max_n: int = 10**7) -> int:
    """The smallest n >= 2 whose two-sided paired t test (level α) detects ``effect`` with at least ``power`` at the
    seed sd ``sd`` (:func:`paired_t_power`, which grows with n): doubling, then bisection."""
    if effect == 0:
        raise ValueError("no number of seeds detects an effect of 0")
    if paired_t_power(effect, sd, 2, alpha) >= power:
        return 2
    lo, hi = 2, 4
    while paired_t_power(effect, sd, hi, alpha) < power:
        lo, hi = hi, hi * 2
        if hi > max_n:
            raise ValueError(f"more than {max_n} seeds needed for effect {effect} at sd {sd}")
    while hi - lo > 1:  # power(lo) < target <= power(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if paired_t_power(effect, sd, mid, alpha) < power else (lo, mid)
    return hi


def detectable_effect(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest mean difference the two-sided paired t test over ``n`` seeds (level α) detects with ``power`` at
    the seed sd ``sd``: ncp solving :func:`t_power` (ncp, n − 1) = power by bisection, times sd / √n."""
    if n < 2:
        raise ValueError(f"a paired t test needs n >= 2, got {n}")
    lo, hi = 0.0, 1.0
    while t_power(hi, n - 1, alpha) < power:
        hi *= 2
    while hi - lo > 1e-10 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_power(mid, n - 1, alpha) < power else (lo, mid)
    return (lo + hi) / 2 * sd / math.sqrt(n)


@dataclass
class SdRatio:
    """sd(b) / sd(a) of paired per-seed values and its seed-bootstrap percentile interval (:func:`sd_ratio_bootstrap`)."""

    ratio: float
    lo: float
    hi: float
    kept: int  # resamples with sd(a) > 0
    dropped: int  # resamples with sd(a) = 0 (the ratio is undefined there)


def sd_ratio_bootstrap(a: Sequence[float], b: Sequence[float], n_boot: int = 10_000, seed: int = 0,
                       alpha: float = 0.05, draws: np.ndarray | None = None) -> SdRatio:
    """The ratio of sample sds sd(b) / sd(a) (ddof = 1) of per-seed values a_s, b_s measured on the same seeds, and
    its 1 − α seed-bootstrap percentile interval: each resample draws the S seeds with replacement (the pair
    (a_s, b_s) together; ``np.random.default_rng(seed).integers(0, S, (n_boot, S))``, or the index rows ``draws``),
    recomputes both sds, and keeps sd(b) / sd(a); resamples with sd(a) = 0 (within rounding) are dropped and
    counted. The interval is ``np.quantile`` (linear) of the kept ratios at α/2 and 1 − α/2."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"need two per-seed vectors of the same length >= 2, got {a.shape} and {b.shape}")
    tol = 1e-12 * max(1.0, float(np.abs(a).max()))
    sd_a = float(a.std(ddof=1))
    if sd_a <= tol:
        raise ValueError("sd(a) is 0 on the data: the ratio is undefined")
    if draws is None:
        draws = np.random.default_rng(seed).integers(0, a.size, size=(int(n_boot), a.size))
    draws = np.asarray(draws)
    sa, sb = a[draws].std(axis=1, ddof=1), b[draws].std(axis=1, ddof=1)
    keep = sa > tol
    ratios = sb[keep] / sa[keep]
    lo, hi = np.quantile(ratios, [alpha / 2, 1 - alpha / 2]) if ratios.size else (math.nan, math.nan)
    return SdRatio(float(b.std(ddof=1)) / sd_a, float(lo), float(hi), int(keep.sum()), int((~keep).sum()))


@dataclass
class Decision:
    """A declared decision rule applied to the per-seed differences (:func:`declared_rule`)."""

    verdict: str  # better | worse | not settled | not applied (fewer paired seeds than declared)
    positive: int  # seeds with d_s > 0
    negative: int  # seeds with d_s < 0
    n_seeds: int  # paired seeds the rule saw
    declared_seeds: int
    min_same_sign: int
    holm_p: float | None = None  # the Holm-adjusted seed-level t p over a declared family, when there is one
    alpha: float = 0.05

    def text(self, scheme: str, baseline: str) -> str:
        counts = f"{self.positive} of {self.n_seeds} seeds positive, {self.negative} negative"
        holm = "" if self.holm_p is None else f", Holm-adjusted p {self.holm_p:.3f}"
        if self.verdict == "not applied":
            return (f"{counts}{holm}: not applied yet ({self.n_seeds} of the {self.declared_seeds} declared seeds "
                    "paired)")
        said = {"better": f"{scheme} beats {baseline}", "worse": f"{scheme} is worse than {baseline}",
                "not settled": f"not settled by {self.n_seeds} seeds"}[self.verdict]
        return f"{counts}{holm} -> {said}"


def declared_rule(per_seed: Sequence[float], t_lo: float | None, t_hi: float | None, declared_seeds: int,
                  min_same_sign: int, holm_p: float | None = None, alpha: float = 0.05) -> Decision:
    """A study's rule declared before its seeds ran: the scheme is **better** only if at least ``min_same_sign`` of
    the per-seed differences d_s are > 0 *and* the seed-level t interval [t_lo, t_hi] lies above 0; **worse** by the
    mirror rule (at least ``min_same_sign`` below 0 and the interval below 0); otherwise **not settled**. A zero d_s
    counts for neither side. Applied only once ``declared_seeds`` seeds are paired (fewer: **not applied**, so a
    partial study never reads as decided); more paired seeds than declared is refused (the rule was not declared for
    them). With ``holm_p`` (the comparison's seed-level t p, Holm-adjusted over a family of primary comparisons
    declared with the rule), "better" and "worse" also need ``holm_p < alpha``: an adjustment only makes claims
    harder."""
    if not 1 <= min_same_sign <= declared_seeds:
        raise ValueError(f"min_same_sign must be in 1..declared_seeds ({declared_seeds}), got {min_same_sign}")
    d = np.asarray(per_seed, dtype=np.float64)
    if d.size > declared_seeds:
        raise ValueError(f"{d.size} paired seeds, but the rule was declared for {declared_seeds}")
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    family_ok = holm_p is None or holm_p < alpha
    if d.size < declared_seeds or t_lo is None or t_hi is None:
        verdict = "not applied"
    elif pos >= min_same_sign and t_lo > 0 and family_ok:
        verdict = "better"
    elif neg >= min_same_sign and t_hi < 0 and family_ok:
        verdict = "worse"
    else:
        verdict = "not settled"
    return Decision(verdict, pos, neg, int(d.size), declared_seeds, min_same_sign, holm_p, alpha)


@dataclass
class PairedResult:
    """Everything a table cell of Δ(X vs baseline) reports (fractions, not percent)."""

    delta: float
    lo: float
    hi: float
    p_value: float
    p_method: str  # exact | monte-carlo
    seed_deltas: list[float]  # Δ of each paired seed (same order as the seeds given)
    seed_mean: float
    seed_sd: float | None  # None with one seed
    n_seeds: int
    n_problems: int
    # seed-level tests on seed_deltas (module docstring); None with one seed
    seed_t: float | None = None
    seed_df: int = 0
    seed_t_p: float | None = None
    seed_t_lo: float | None = None  # the t interval of the mean per-seed Δ
    seed_t_hi: float | None = None
    seed_flip_p: float | None = None
    seed_flip_min_p: float = 1.0  # the smallest p the seed sign-flip can reach: 2 / 2^(non-zero per-seed Δ)
    # set by the report: whether this is the declared primary comparison, and Holm-adjusted seed-level p-values
    # over the other comparisons of its row (None for the primary one, and with one seed)
    primary: bool = False
    seed_t_p_holm: float | None = None
    seed_flip_p_holm: float | None = None
    decision: dict | None = None  # set by the report on the primary comparison when a rule is declared (Decision)

    def seed_level(self) -> bool:
        """Whether seed-level tests exist (two or more paired seeds)."""
        return self.n_seeds >= 2 and self.seed_t_p is not None and self.seed_flip_p is not None

    def significant(self, alpha: float) -> bool:
        """The report's star: both seed-level p-values (Holm-adjusted unless primary) below ``alpha`` and the
        two-level bootstrap interval excluding 0. Never with one seed (problems only)."""
        if not self.seed_level():
            return False
        t_p = self.seed_t_p if self.primary or self.seed_t_p_holm is None else self.seed_t_p_holm
        f_p = self.seed_flip_p if self.primary or self.seed_flip_p_holm is None else self.seed_flip_p_holm
        return t_p < alpha and f_p < alpha and not self.lo <= 0 <= self.hi

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def compare_paired(diffs: Mapping[str, np.ndarray], average: str = "unweighted", n_boot: int = 10_000,
                   alpha: float = 0.05, seed: int = 0, n_perm: int = 10_000, exact_max: int = 16,
                   resample_seeds: bool = True) -> PairedResult:
    """Δ, its two-level bootstrap interval, the sign-flip p-value and the per-seed spread in one call."""
    d = _as_matrices(diffs)
    boot = paired_bootstrap(d, n_boot=n_boot, alpha=alpha, seed=seed, average=average,
                            resample_seeds=resample_seeds)
    p, method = sign_flip_test(d, average=average, n_perm=n_perm, seed=seed, exact_max=exact_max)
    n_seeds = next(iter(d.values())).shape[0]
    per_seed = [paired_delta({b: m[s:s + 1] for b, m in d.items()}, average) for s in range(n_seeds)]
    mean, sd = seed_spread(per_seed)
    t = seed_t_test(per_seed, alpha)
    flip = seed_sign_flip(per_seed) if n_seeds >= 2 else None
    return PairedResult(boot.estimate, boot.lo, boot.hi, p, method, per_seed, mean, sd, n_seeds,
                        int(sum(m.shape[1] for m in d.values())), seed_t=t.t, seed_df=t.df, seed_t_p=t.p,
                        seed_t_lo=t.lo, seed_t_hi=t.hi, seed_flip_p=flip,
                        seed_flip_min_p=seed_sign_flip_min_p(per_seed))
