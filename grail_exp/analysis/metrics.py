"""Evaluation metrics for math-reasoning benchmarks (pure numpy; no torch).

Every benchmark is evaluated by drawing ``n`` samples per problem and marking
each sample correct or not with a verifier. The input to this module is thus,
per benchmark, a boolean matrix ``correct`` of shape ``(n_problems, n_samples)``
or, when some samples are missing (a crashed generation, a filtered sample), a
*ragged* list of per-problem lists in which every problem has its own ``n_i``.

Metrics (all are fractions in [0, 1]; only the formatting converts to percent)
------------------------------------------------------------------------------
``acc`` (Acc@n, "accuracy")
    Mean over problems of ``c_i / n_i`` (``c_i`` correct samples out of
    ``n_i``). This is the "accuracy" of the GRAIL paper, which samples n = 3
    answers per problem and reports Acc@3. It equals pass@1.

``pass@k``
    Probability that at least one of ``k`` samples drawn without replacement
    from the ``n_i`` generated ones is correct, averaged over problems, using
    the unbiased estimator of Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code" (the Codex paper):
    ``pass@k = 1 - C(n - c, k) / C(n, k)``.
    The GRAIL paper reports Pass@3 with n = 3, i.e. pass@n = the fraction of
    problems with at least one correct sample.

``maj`` (maj@n, majority voting / self-consistency)
    The most frequent extracted answer of a problem wins the vote; the problem
    counts as solved iff that answer is correct (Wang et al. 2023,
    "Self-Consistency Improves Chain of Thought Reasoning in Language Models";
    maj@k is also used by Lewkowycz et al. 2022, "Minerva").

Confidence intervals
    Percentile bootstrap over *problems* (Efron & Tibshirani 1993): problems
    are resampled with replacement, the metric's mean is recomputed for each
    resample, and the ``alpha/2`` and ``1 - alpha/2`` percentiles of those
    means bound the interval. Samples are never resampled on their own: the
    per-problem value already summarises the ``n`` samples, and problems are
    the independent unit.

Averages over benchmarks
    The GRAIL paper averages each metric *unweighted* over its six benchmarks
    (every benchmark counts the same regardless of its size). We report that
    and the problem-count-*weighted* mean (= the pooled mean over all
    problems). Both CIs come from one *stratified* bootstrap: each benchmark's
    problems are resampled independently, and each bootstrap replicate's
    per-benchmark means are averaged (unweighted or weighted).

Design of the summaries
-----------------------
:func:`summarize_benchmark` returns a plain ``dict``. Besides the reported
numbers it keeps the per-problem arrays it used under the private key
``"_per_problem"`` (``{"acc": array, "pass_at_k": {k: array}, "maj": array |
None}``) so that :func:`average_over_benchmarks` can run the stratified
bootstrap. :func:`to_jsonable` drops every key starting with ``"_"``, so a
summary read back from JSON can be tabulated but not averaged with CIs.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MetricWithCI",
    "pass_at_k",
    "pass_at_k_per_problem",
    "acc_at_n",
    "maj_at_n",
    "normalize_answer",
    "bootstrap_ci",
    "summarize_benchmark",
    "average_over_benchmarks",
    "to_jsonable",
    "format_table",
    "to_dataframe",
]

# Row labels of the two average rows in tables and data frames.
AVG_UNWEIGHTED_LABEL = "avg (unweighted)"
AVG_WEIGHTED_LABEL = "avg (weighted)"


# --------------------------------------------------------------------------- #
# Input handling
# --------------------------------------------------------------------------- #
def _as_rows(values: Any, name: str) -> list[np.ndarray]:
    """Turn a 2-D array or a ragged list of per-problem lists into 1-D rows."""
    if isinstance(values, np.ndarray):
        if values.ndim != 2:
            raise ValueError(
                f"{name} must be 2-D (n_problems, n_samples), got shape {values.shape}"
            )
        return [values[i] for i in range(values.shape[0])]
    rows = []
    for i, row in enumerate(values):
        arr = np.asarray(row)
        if arr.ndim != 1:
            raise ValueError(f"{name}[{i}] must be a 1-D sequence of samples, got shape {arr.shape}")
        rows.append(arr)
    return rows


def _correct_rows(correct: Any) -> list[np.ndarray]:
    """Validate ``correct`` and return one boolean row per problem."""
    rows = _as_rows(correct, "correct")
    out = []
    for i, row in enumerate(rows):
        if row.dtype != bool:
            # Accept 0/1 integers (or floats) but nothing else: a silently
            # truthy 2 or 0.5 would mean the caller passed rewards, not flags.
            if row.size and not np.isin(row, (0, 1)).all():
                raise ValueError(f"correct[{i}] must contain only booleans or 0/1, got {row!r}")
            row = row.astype(bool)
        out.append(row)
    return out


def _counts(correct: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-problem (n_i, c_i): number of samples and number of correct ones."""
    rows = _correct_rows(correct)
    n = np.array([r.size for r in rows], dtype=np.int64)
    c = np.array([int(r.sum()) for r in rows], dtype=np.int64)
    return n, c


def _check_aligned(rows: list[np.ndarray], n: np.ndarray, name: str) -> None:
    """Make sure a per-sample side array has the same layout as ``correct``."""
    if len(rows) != len(n):
        raise ValueError(f"{name} has {len(rows)} problems but correct has {len(n)}")
    for i, (row, n_i) in enumerate(zip(rows, n)):
        if row.size != n_i:
            raise ValueError(f"{name}[{i}] has {row.size} samples but correct[{i}] has {n_i}")


# --------------------------------------------------------------------------- #
# Per-problem metrics
# --------------------------------------------------------------------------- #
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate for one problem with ``c`` of ``n`` samples correct.

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code"
    (the Codex paper), eq. (1)::

        pass@k = 1 - C(n - c, k) / C(n, k)

    i.e. one minus the probability that ``k`` samples drawn without
    replacement from the ``n`` are all wrong. The binomial ratio is evaluated
    in the numerically stable product form of the paper's reference code,
    ``C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)``, which never builds
    huge binomials. When ``n - c < k`` every k-subset contains a correct
    sample and the result is exactly 1.0.

    Raises ValueError for k < 1, k > n, c < 0 or c > n.
    """
    for label, x in (("n", n), ("c", c), ("k", k)):
        if isinstance(x, (bool, np.bool_)) or not float(x).is_integer():
            raise ValueError(f"pass@k needs an integer {label}, got {x!r}")
    n, c, k = int(n), int(c), int(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n (number of samples), got k={k} > n={n}")
    if c < 0 or c > n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_per_problem(correct: Any, k: int) -> np.ndarray:
    """Per-problem unbiased pass@k (Chen et al. 2021), shape ``(n_problems,)``.

    ``correct`` is a boolean ``(n_problems, n_samples)`` array or a ragged list
    of per-problem lists; each problem uses its own ``n_i``. A ``k`` larger
    than some problem's ``n_i`` is an error naming that problem.
    """
    n, c = _counts(correct)
    k = int(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    too_small = np.flatnonzero(n < k)
    if too_small.size:
        i = int(too_small[0])
        raise ValueError(
            f"pass@{k} is undefined for problem {i}: it has only n={int(n[i])} samples "
            f"({too_small.size} problem(s) have fewer than {k})"
        )
    return np.array([pass_at_k(n_i, c_i, k) for n_i, c_i in zip(n, c)], dtype=np.float64)


def acc_at_n(correct: Any) -> np.ndarray:
    """Per-problem accuracy ``c_i / n_i``, shape ``(n_problems,)``.

    The GRAIL paper's "accuracy" (Acc@n, n = 3) is the mean of this array
    over problems. It equals unbiased pass@1. A problem with no samples at all
    cannot be scored and raises ValueError.
    """
    n, c = _counts(correct)
    empty = np.flatnonzero(n == 0)
    if empty.size:
        raise ValueError(f"acc is undefined for problem {int(empty[0])}: it has no samples")
    return c / n


_WS = re.compile(r"\s+")


def normalize_answer(answer: str | None) -> str | None:
    """Light normalisation used for voting: strip whitespace and surrounding
    ``$`` signs (``$x$``, ``$$x$$``), collapse internal whitespace to one space.

    Returns None for None and for answers that are empty after normalisation
    (an empty string is no answer and must not win a vote).
    """
    if answer is None:
        return None
    s = str(answer).strip()
    while len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    s = _WS.sub(" ", s)
    return s or None


def maj_at_n(answers: Sequence[Sequence[str | None]], correct: Any) -> np.ndarray:
    """Per-problem majority-vote correctness (0.0 / 1.0), shape ``(n_problems,)``.

    Self-consistency (Wang et al. 2023) / maj@k (Lewkowycz et al. 2022): the
    normalised extracted answers (see :func:`normalize_answer`) vote; None
    (and empty) answers do not vote. The winner is the most frequent answer,
    ties broken by first occurrence among the samples. The problem counts as
    solved iff at least one sample carrying the winning answer is marked
    correct (the verifier may accept equivalent forms that the light
    normalisation does not merge, so one verified sample is enough). A
    problem with no votes scores 0.
    """
    rows = _correct_rows(correct)
    if len(answers) != len(rows):
        raise ValueError(f"answers has {len(answers)} problems but correct has {len(rows)}")
    out = np.zeros(len(rows), dtype=np.float64)
    for i, (ans_row, ok_row) in enumerate(zip(answers, rows)):
        ans_row = list(ans_row)
        if len(ans_row) != ok_row.size:
            raise ValueError(
                f"answers[{i}] has {len(ans_row)} samples but correct[{i}] has {ok_row.size}"
            )
        votes: dict[str, int] = {}  # insertion order = first occurrence
        solved: dict[str, bool] = {}
        for ans, ok in zip(ans_row, ok_row):
            key = normalize_answer(ans)
            if key is None:
                continue
            votes[key] = votes.get(key, 0) + 1
            solved[key] = solved.get(key, False) or bool(ok)
        if votes:
            # max() returns the first maximal item, i.e. the earliest answer on ties.
            winner = max(votes, key=votes.__getitem__)
            out[i] = 1.0 if solved[winner] else 0.0
    return out


# --------------------------------------------------------------------------- #
# Bootstrap
# --------------------------------------------------------------------------- #
def _percentiles(means: np.ndarray, alpha: float) -> tuple[float, float]:
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)


def _check_boot_args(n_boot: int, alpha: float) -> None:
    if int(n_boot) < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def bootstrap_ci(
    per_problem_values: np.ndarray,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap ``(1 - alpha)`` CI of the mean over problems.

    Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13: draw
    ``n_boot`` resamples of the problems with replacement (one
    ``rng.integers`` call of shape ``(n_boot, n_problems)``), take each
    resample's mean and return its ``alpha/2`` and ``1 - alpha/2`` quantiles.
    ``np.random.default_rng(seed)`` makes the result reproducible; because the
    index matrix depends only on (seed, n_boot, n_problems), all metrics of one
    benchmark are resampled with the same problems.

    A single problem or zero-variance input returns ``(v, v)`` exactly.
    """
    values = np.asarray(per_problem_values, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("bootstrap_ci needs at least one problem")
    _check_boot_args(n_boot, alpha)
    if values.size == 1 or np.all(values == values[0]):
        v = float(values[0])
        return v, v
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, values.size, size=(int(n_boot), values.size))
    return _percentiles(values[idx].mean(axis=1), alpha)


@dataclass(frozen=True)
class MetricWithCI:
    """A point estimate with its confidence interval, all as fractions in [0, 1]."""

    value: float
    lo: float
    hi: float

    def format(self, digits: int = 1, ci: bool = True, percent: bool = True) -> str:
        """``"45.3 [41.0, 49.8]"`` (percent by default); ``ci=False`` gives ``"45.3"``."""
        scale = 100.0 if percent else 1.0
        text = f"{self.value * scale:.{digits}f}"
        if ci:
            text += f" [{self.lo * scale:.{digits}f}, {self.hi * scale:.{digits}f}]"
        return text

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, float]:
        return {"value": float(self.value), "lo": float(self.lo), "hi": float(self.hi)}


def _with_ci(values: np.ndarray, n_boot: int, alpha: float, seed: int) -> MetricWithCI:
    lo, hi = bootstrap_ci(values, n_boot=n_boot, alpha=alpha, seed=seed)
    return MetricWithCI(float(np.mean(values)), lo, hi)


# --------------------------------------------------------------------------- #
# Benchmark summaries
# --------------------------------------------------------------------------- #
def summarize_benchmark(
    correct: Any,
    answers: Sequence[Sequence[str | None]] | None = None,
    truncated: Any = None,
    n_tokens: Any = None,
    extracted_none: Any = None,
    ks: Iterable[int] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
    protocol: str = "standard",
) -> dict[str, Any]:
    """Summarise one benchmark's samples.

    Arguments are per-sample arrays of the same (possibly ragged) layout as
    ``correct``: ``answers`` (extracted answers, None if extraction failed),
    ``truncated`` (hit the generation limit), ``n_tokens`` (completion
    lengths), ``extracted_none`` (answer extraction failed; if omitted, it is
    derived from ``answers``).

    Returns a dict:

    - ``n_problems``: int; ``n_samples``: nominal n = the largest per-problem
      sample count; ``n_samples_min``: the smallest (< n_samples only when
      ragged); ``n_samples_total``: total samples scored;
    - ``acc``: MetricWithCI of the mean per-problem accuracy (Acc@n);
    - ``pass_at_k``: ``{k: MetricWithCI}`` for ``k`` in ``ks`` or, by default,
      ``1..n_samples_min`` (every k that all problems support);
    - ``maj``: MetricWithCI of maj@n, or None without ``answers``;
    - ``nulls``: number of samples whose extracted answer is None (None when
      neither ``extracted_none`` nor ``answers`` is given);
    - ``truncation_rate``: fraction of *samples* truncated, or None;
    - ``mean_tokens``: mean completion length over *samples*, or None;
    - ``ci``: ``{"method", "n_boot", "alpha", "seed"}`` describing the CIs;
    - ``_per_problem``: the per-problem arrays behind acc/pass@k/maj (used by
      :func:`average_over_benchmarks`, dropped by :func:`to_jsonable`).

    All CIs use the same bootstrap indices (same seed, same problem count).

    ``protocol="paper"``: the GRAIL reference evaluation (declare-lab/grail ``src/eval/eval_results_base.py``),
    for rows that already exclude the samples it drops (empty completions). A problem left with no sample
    scores 0 on every metric; pass@k of a problem with ``n_i < k`` samples is pass@n_i (any of them correct:
    the reference's Pass@3 is ``any(correct)`` over whatever samples remain); ks default to ``1..n_max``;
    ``mean_tokens`` averages over the samples with an extracted answer only (``answers`` not None), 0.0 when
    there is none.
    """
    if protocol not in ("standard", "paper"):
        raise ValueError(f"protocol must be 'standard' or 'paper', got {protocol!r}")
    rows = _correct_rows(correct)
    if not rows:
        raise ValueError("summarize_benchmark needs at least one problem")
    n = np.array([r.size for r in rows], dtype=np.int64)
    n_min, n_max = int(n.min()), int(n.max())
    _check_boot_args(n_boot, alpha)

    paper = protocol == "paper"
    k_list = sorted({int(k) for k in ks}) if ks is not None else list(range(1, (n_max if paper else n_min) + 1))
    acc_pp, pass_pp = _accuracy_per_problem(rows, n, k_list, paper)
    maj_pp = maj_at_n(answers, rows) if answers is not None else None

    def ci(values: np.ndarray) -> MetricWithCI:
        return _with_ci(values, n_boot, alpha, seed)

    nulls, truncation_rate, mean_tokens = _sample_counts(n, answers, truncated, n_tokens, extracted_none, paper)
    return {
        "n_problems": len(rows),
        "n_samples": n_max,
        "n_samples_min": n_min,
        "n_samples_total": int(n.sum()),
        "acc": ci(acc_pp),
        "pass_at_k": {k: ci(v) for k, v in pass_pp.items()},
        "maj": ci(maj_pp) if maj_pp is not None else None,
        "nulls": nulls,
        "truncation_rate": truncation_rate,
        "mean_tokens": mean_tokens,
        "ci": {"method": "percentile bootstrap over problems", "n_boot": int(n_boot),
               "alpha": float(alpha), "seed": int(seed)},
        "protocol": protocol,
        "_per_problem": {"acc": acc_pp, "pass_at_k": pass_pp, "maj": maj_pp},
    }


def _accuracy_per_problem(rows: list[np.ndarray], n: np.ndarray, k_list: list[int], paper: bool):
    """(Acc@n per problem, {k: pass@k per problem}); ``paper``: the GRAIL reference's rules (``summarize_benchmark``)."""
    if not paper:
        return acc_at_n(rows), {k: pass_at_k_per_problem(rows, k) for k in k_list}
    c = np.array([int(r.sum()) for r in rows], dtype=np.int64)
    acc_pp = np.where(n > 0, c / np.maximum(n, 1), 0.0)
    return acc_pp, {k: np.array([pass_at_k(n_i, c_i, min(k, n_i)) if n_i else 0.0 for n_i, c_i in zip(n, c)])
                    for k in k_list}


def _sample_counts(n: np.ndarray, answers, truncated, n_tokens, extracted_none, paper: bool):
    """(nulls, truncation rate, mean tokens) of a benchmark's samples, each None when its input is not given; ``n``:
    the samples per problem the per-sample arrays must align with (``summarize_benchmark``'s arguments)."""
    nulls: int | None = None
    if extracted_none is not None:
        none_rows = _as_rows(extracted_none, "extracted_none")
        _check_aligned(none_rows, n, "extracted_none")
        nulls = int(sum(np.asarray(r, dtype=bool).sum() for r in none_rows))
    elif answers is not None:
        nulls = int(sum(a is None for row in answers for a in row))

    truncation_rate: float | None = None
    if truncated is not None:
        trunc_rows = _as_rows(truncated, "truncated")
        _check_aligned(trunc_rows, n, "truncated")
        flags = np.concatenate([np.asarray(r, dtype=bool) for r in trunc_rows])
        truncation_rate = float(flags.mean()) if flags.size else 0.0  # size 0: every sample dropped (paper)

    mean_tokens: float | None = None
    if n_tokens is not None:
        tok_rows = _as_rows(n_tokens, "n_tokens")
        _check_aligned(tok_rows, n, "n_tokens")
        tokens = np.concatenate([np.asarray(r, dtype=np.float64) for r in tok_rows])
        if paper and answers is not None:  # the reference counts tokens of samples with an extracted answer only
            tokens = tokens[np.array([a is not None for row in answers for a in row], dtype=bool)]
            mean_tokens = float(tokens.mean()) if tokens.size else 0.0
        else:
            mean_tokens = float(tokens.mean())
    return nulls, truncation_rate, mean_tokens


def _combine_benchmarks(per_bench: list[np.ndarray], boot_idx: list[np.ndarray], weights: np.ndarray,
                        alpha: float) -> tuple[MetricWithCI, MetricWithCI]:
    """(unweighted, problem-weighted) mean of one metric over benchmarks, each with its stratified-bootstrap interval:
    ``per_bench`` the per-problem values of each benchmark, ``boot_idx`` each benchmark's resample indices."""
    points = np.array([float(np.mean(v)) for v in per_bench])
    # (n_benchmarks, n_boot): each benchmark's resample means.
    boot_means = np.stack([np.asarray(v, dtype=np.float64)[idx].mean(axis=1) for v, idx in zip(per_bench, boot_idx)])
    out = []
    for w in (np.full(len(per_bench), 1.0 / len(per_bench)), weights):
        value = float(w @ points)
        if all(np.all(v == v[0]) for v in per_bench):
            lo = hi = value  # no variance anywhere: CI collapses as in bootstrap_ci
        else:
            lo, hi = _percentiles(w @ boot_means, alpha)
        out.append(MetricWithCI(value, lo, hi))
    return out[0], out[1]


def _benchmark_seed(seed: int, name: str) -> np.random.SeedSequence:
    # A per-benchmark stream derived from (seed, name) keeps the strata
    # independent (two benchmarks of equal size must not share indices) and
    # makes the result independent of the order of the summaries dict.
    return np.random.SeedSequence([int(seed), zlib.crc32(name.encode("utf-8"))])


def _per_problem_arrays(summaries: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """Each summary's ``_per_problem`` arrays, in order; a summary without them (read back from JSON) is an error."""
    if not summaries:
        raise ValueError("average_over_benchmarks needs at least one benchmark summary")
    for name, s in summaries.items():
        if "_per_problem" not in s:
            raise ValueError(
                f"summary {name!r} has no '_per_problem' arrays (was it loaded from JSON?); "
                "pass the dicts returned by summarize_benchmark"
            )
    return [s["_per_problem"] for s in summaries.values()]


def _combined_metrics(pp: list[dict], combine) -> tuple[dict[str, Any], dict[str, Any]]:
    """(unweighted, weighted) rows of acc, pass@k for the ks every benchmark has, and maj (None unless every benchmark
    has it), each from ``combine`` over the benchmarks' per-problem arrays."""
    unweighted: dict[str, Any] = {}
    weighted: dict[str, Any] = {}
    unweighted["acc"], weighted["acc"] = combine([p["acc"] for p in pp])
    common_ks = sorted(set.intersection(*(set(p["pass_at_k"]) for p in pp)))
    unweighted["pass_at_k"], weighted["pass_at_k"] = {}, {}
    for k in common_ks:
        unweighted["pass_at_k"][k], weighted["pass_at_k"][k] = combine([p["pass_at_k"][k] for p in pp])
    if all(p["maj"] is not None for p in pp):
        unweighted["maj"], weighted["maj"] = combine([p["maj"] for p in pp])
    else:
        unweighted["maj"] = weighted["maj"] = None
    return unweighted, weighted


def _sample_means(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[float | None, float | None]]:
    """``truncation_rate`` and ``mean_tokens`` over benchmarks: (unweighted mean, mean weighted by sample counts), or
    (None, None) unless every benchmark has the value."""
    n_total_samples = np.array([s.get("n_samples_total", 0) for s in summaries.values()], dtype=np.float64)
    out = {}
    for key in ("truncation_rate", "mean_tokens"):
        vals = [s.get(key) for s in summaries.values()]
        if all(v is not None for v in vals) and n_total_samples.sum() > 0:
            arr = np.array(vals, dtype=np.float64)
            out[key] = (float(arr.mean()), float(n_total_samples @ arr / n_total_samples.sum()))
        else:
            out[key] = (None, None)
    return out


def _average_counts(summaries: Mapping[str, Mapping[str, Any]], n_problems: int) -> dict[str, Any]:
    """The counts an average row carries: benchmarks, problems, the largest and smallest n, nulls (None unless every
    benchmark has them)."""
    nulls = [s.get("nulls") for s in summaries.values()]
    return {
        "n_benchmarks": len(summaries),
        "n_problems": n_problems,
        "n_samples": max(int(s["n_samples"]) for s in summaries.values()),
        "n_samples_min": min(int(s.get("n_samples_min", s["n_samples"])) for s in summaries.values()),
        "nulls": int(sum(nulls)) if all(v is not None for v in nulls) else None,
    }


def average_over_benchmarks(
    summaries: Mapping[str, Mapping[str, Any]],
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """Average metrics over benchmarks with stratified-bootstrap CIs.

    ``unweighted``: the paper's average, ``mean_b value_b`` (every benchmark
    counts the same). ``weighted``: ``sum_b N_b value_b / sum_b N_b`` with
    ``N_b`` problems (= pooled mean over all problems).

    CI: for every benchmark, ``n_boot`` resamples of its own problems are drawn
    independently (stratified bootstrap; one index matrix per benchmark, shared
    by all of its metrics); each replicate's per-benchmark means are combined
    with the unweighted or the weighted formula and the percentiles of the
    combined replicates form the interval.

    Returns ``{"unweighted": row, "weighted": row, "benchmarks": [names]}``
    where each row has the same keys as a benchmark summary used by tables:
    ``acc``, ``pass_at_k`` (the ks common to all benchmarks), ``maj`` (None
    unless every benchmark has it), ``n_problems`` (total), ``n_samples``
    (largest n), ``n_samples_min``, ``n_benchmarks``, ``nulls`` (total),
    ``truncation_rate`` / ``mean_tokens`` (unweighted mean over benchmarks or
    sample-count-weighted mean; None unless every benchmark has them).

    Every summary must carry ``_per_problem`` (i.e. come straight from
    :func:`summarize_benchmark`, not from JSON).
    """
    _check_boot_args(n_boot, alpha)
    names = list(summaries)
    pp = _per_problem_arrays(summaries)
    n_prob = np.array([len(p["acc"]) for p in pp], dtype=np.float64)
    weights = n_prob / n_prob.sum()

    # One index matrix per benchmark, shared by all metrics of that benchmark.
    boot_idx = [
        np.random.default_rng(_benchmark_seed(seed, name)).integers(0, int(m), size=(int(n_boot), int(m)))
        for name, m in zip(names, n_prob)
    ]

    unweighted, weighted = _combined_metrics(pp, lambda per_bench: _combine_benchmarks(per_bench, boot_idx, weights,
                                                                                         alpha))

    for key, (u, w) in _sample_means(summaries).items():
        unweighted[key], weighted[key] = u, w
    common = _average_counts(summaries, int(n_prob.sum()))
    unweighted.update(common)
    weighted.update(common)
    return {
        "unweighted": unweighted,
        "weighted": weighted,
        "benchmarks": names,
        "ci": {"method": "stratified percentile bootstrap over problems", "n_boot": int(n_boot),
               "alpha": float(alpha), "seed": int(seed)},
    }


# --------------------------------------------------------------------------- #
# Export
# --------------------------------------------------------------------------- #
def to_jsonable(summary: Any) -> Any:
    """Convert a summary (or average, or dict of them) to plain JSON types.

    MetricWithCI -> ``{"value", "lo", "hi"}``; non-string dict keys (the ks of
    ``pass_at_k``) -> strings; numpy scalars/arrays -> Python numbers/lists;
    non-finite floats -> None (strict JSON has no NaN); keys starting with
    ``"_"`` (the private per-problem arrays) are dropped.
    """
    if isinstance(summary, MetricWithCI):
        return to_jsonable(summary.to_dict())
    if isinstance(summary, Mapping):
        return {str(k): to_jsonable(v) for k, v in summary.items()
                if not (isinstance(k, str) and k.startswith("_"))}
    if isinstance(summary, (list, tuple)):
        return [to_jsonable(v) for v in summary]
    if isinstance(summary, np.ndarray):
        return [to_jsonable(v) for v in summary.tolist()]
    if isinstance(summary, (bool, np.bool_)):
        return bool(summary)
    if isinstance(summary, (int, np.integer)):
        return int(summary)
    if isinstance(summary, (float, np.floating)):
        f = float(summary)
        return f if math.isfinite(f) else None
    return summary


def _metric_of(row: Mapping[str, Any], metric: str) -> MetricWithCI | None:
    """Fetch ``acc``, ``maj``, ``pass@K`` or ``pass@n`` (largest k) from a summary row."""
    if metric in ("acc", "maj"):
        return row.get(metric)
    if metric.startswith("pass@"):
        table = row.get("pass_at_k") or {}
        # Summaries read back from JSON have string keys.
        table = {int(k): (v if isinstance(v, MetricWithCI) else MetricWithCI(**v)) for k, v in table.items()}
        if not table:
            return None
        k = max(table) if metric == "pass@n" else int(metric[len("pass@"):])
        return table.get(k)
    raise ValueError(f"unknown metric {metric!r}")


_PLAIN_METRICS = ("truncation_rate", "mean_tokens", "nulls", "n_problems")


def _check_metric_name(metric: str) -> None:
    if metric in ("acc", "maj", "pass@n") or metric in _PLAIN_METRICS:
        return
    if metric.startswith("pass@") and metric[len("pass@"):].isdigit():
        return
    raise ValueError(
        f"unknown metric {metric!r}; use 'acc', 'maj', 'pass@<k>', 'pass@n' or one of {_PLAIN_METRICS}"
    )


def _cell(row: Mapping[str, Any], metric: str, ci: bool) -> str:
    if metric in _PLAIN_METRICS:
        v = row.get(metric)
        if v is None:
            return "n/a"
        if metric == "truncation_rate":
            return f"{100.0 * v:.1f}"
        if metric == "mean_tokens":
            return f"{v:.1f}"
        return str(int(v))
    m = _metric_of(row, metric)
    if m is None:
        return "n/a"
    if not isinstance(m, MetricWithCI):  # from JSON
        m = MetricWithCI(**m)
    return m.format(digits=1, ci=ci)


def _header(metric: str, rows: list[Mapping[str, Any]]) -> str:
    ns = {int(r["n_samples"]) for r in rows if r.get("n_samples") is not None}
    n_label = str(ns.pop()) if len(ns) == 1 else "n"
    if metric == "acc":
        return f"acc@{n_label}"
    if metric == "maj":
        return f"maj@{n_label}"
    if metric == "pass@n":
        ks = set()
        for r in rows:
            table = r.get("pass_at_k") or {}
            if table:
                ks.add(max(int(k) for k in table))
        return f"pass@{ks.pop()}" if len(ks) == 1 else "pass@n"
    if metric == "truncation_rate":
        return "trunc %"
    if metric == "mean_tokens":
        return "tokens"
    if metric == "n_problems":
        return "problems"
    return metric


def format_table(
    summaries: Mapping[str, Mapping[str, Any]],
    average: Mapping[str, Any] | None = None,
    metrics: Sequence[str] = ("acc", "pass@1", "pass@n", "maj"),
    ci: bool = True,
) -> str:
    """Render summaries as an aligned GitHub-flavoured Markdown table.

    One row per benchmark, then ``avg (unweighted)`` and ``avg (weighted)``
    when ``average`` (from :func:`average_over_benchmarks`) is given. Columns:
    ``benchmark``, ``problems`` and one per metric. Metrics: ``acc``, ``maj``,
    ``pass@<k>``, ``pass@n`` (the largest k of each row), and the plain
    ``truncation_rate`` (percent), ``mean_tokens``, ``nulls``, ``n_problems``.
    Rates are in percent with one decimal; ``ci=True`` appends
    ``[lo, hi]``. Missing values read ``n/a``. Headers show the sample count
    when all rows share it (``acc@3``, ``pass@3``).
    """
    for metric in metrics:
        _check_metric_name(metric)
    labelled: list[tuple[str, Mapping[str, Any]]] = list(summaries.items())
    if average is not None:
        labelled += [(AVG_UNWEIGHTED_LABEL, average["unweighted"]), (AVG_WEIGHTED_LABEL, average["weighted"])]
    rows_only = [r for _, r in labelled]

    header = ["benchmark", "problems"] + [_header(m, list(summaries.values()) or rows_only) for m in metrics]
    body = [
        [str(name).replace("|", "\\|"), str(row.get("n_problems", "n/a"))]
        + [_cell(row, m, ci) for m in metrics]
        for name, row in labelled
    ]
    widths = [max(3, len(header[j]), *(len(r[j]) for r in body)) for j in range(len(header))]

    def line(cells: list[str]) -> str:
        # First column left-aligned (names), numbers right-aligned.
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(padded) + " |"

    separator = "| " + " | ".join(
        ["-" * widths[0]] + ["-" * (w - 1) + ":" for w in widths[1:]]
    ) + " |"
    return "\n".join([line(header), separator] + [line(r) for r in body])


def to_dataframe(
    summaries: Mapping[str, Mapping[str, Any]],
    average: Mapping[str, Any] | None = None,
):
    """Long-format ``pandas.DataFrame`` for ``mlflow.log_table``.

    Columns: ``benchmark``, ``metric`` (``"acc"``, ``"pass@k"``, ``"maj"``),
    ``k`` (the k of pass@k; the sample count n for acc@n and maj@n, so the
    column is always an integer), ``value``, ``lo``, ``hi`` (fractions in
    [0, 1]) and ``n_problems``. Average rows use the benchmark labels
    ``"avg (unweighted)"`` and ``"avg (weighted)"``. Plain statistics without
    a CI (truncation rate, tokens, nulls) are left to :func:`to_jsonable`.
    """
    import pandas as pd  # local: keep the module importable for pure-numpy users

    labelled: list[tuple[str, Mapping[str, Any]]] = list(summaries.items())
    if average is not None:
        labelled += [(AVG_UNWEIGHTED_LABEL, average["unweighted"]), (AVG_WEIGHTED_LABEL, average["weighted"])]

    records = []
    for name, row in labelled:
        n = int(row["n_samples"])

        def add(metric: str, k: int, m: Any, name=name, row=row) -> None:
            if m is None:
                return
            if not isinstance(m, MetricWithCI):
                m = MetricWithCI(**m)
            records.append({"benchmark": str(name), "metric": metric, "k": int(k), "value": float(m.value),
                            "lo": float(m.lo), "hi": float(m.hi), "n_problems": int(row["n_problems"])})

        add("acc", n, row.get("acc"))
        for k, m in sorted(((int(k), m) for k, m in (row.get("pass_at_k") or {}).items())):
            add("pass@k", k, m)
        add("maj", n, row.get("maj"))

    columns = ["benchmark", "metric", "k", "value", "lo", "hi", "n_problems"]
    df = pd.DataFrame.from_records(records, columns=columns)
    return df.astype({"k": "int64", "n_problems": "int64", "value": "float64", "lo": "float64", "hi": "float64"})
