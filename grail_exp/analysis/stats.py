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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PairedResult", "benchmark_weights", "paired_delta", "paired_bootstrap", "sign_flip_test",
           "seed_spread", "compare_paired"]


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
    return PairedResult(boot.estimate, boot.lo, boot.hi, p, method, per_seed, mean, sd, n_seeds,
                        int(sum(m.shape[1] for m in d.values())))
