"""Hostile completions never hang, crash or escape the grader (``MathVerifier`` with short timeouts).

Every completion in ``CORPUS`` goes through the full reward path (last ``\\boxed{}`` extraction, then
math-verify in killable workers). Whatever happens inside math-verify/sympy, the batch must come back
within a bound derived from the timeouts, every result must carry a known status, and the timeout
counter must agree with the statuses.
"""

from __future__ import annotations

import time

import pytest

from grail_exp.grading.pool import WorkerPool
from grail_exp.grading.rewards import STATUSES, MathVerifier

HARD_TIMEOUT_S = 3.0
GOLD = "42"

# name -> completion. Names say what each one attacks.
CORPUS: dict[str, str] = {
    "empty string": "",
    "empty box": "The answer is \\boxed{}.",
    "whitespace box": "\\boxed{   \n\t }",
    "1 MB of text, box at the end": "x" * 1_000_000 + " so \\boxed{42}",
    "1 MB of text, no box": "The answer is 42. " * 58_000,
    "1 MB of unterminated boxes": "\\boxed{" * 150_000,
    "5000 nested braces, no box": "{" * 5000 + "42" + "}" * 5000,
    "5000 nested braces in a box": "\\boxed{" + "{" * 5000 + "42" + "}" * 5000 + "}",
    "power tower 2^2^2^100": "\\boxed{2^{2^{2^{100}}}}",
    "power tower 9^9^9^9": "\\boxed{9^{9^{9^{9}}}}",
    "huge factorial": "\\boxed{(10^{10})!}",
    "5000 nested parentheses in a box": "\\boxed{" + "(" * 5000 + "42" + ")" * 5000 + "}",
    "unicode, RTL and zero-width characters": "الجواب \u202e\\boxed{4\u200b2}\u202c \u200d\u2067٤٢\u2069 \ufeff𝟒𝟐",
    "unicode digits in a box": "\\boxed{٤٢}",
    "unbalanced: unterminated box": "So \\boxed{42",
    "unbalanced: stray closers": "}}}} \\boxed{42}}}}",
    "unbalanced: open braces inside the box": "\\boxed{\\frac{4{2}",
    "100 KB newline-heavy answer in a box": "\\boxed{" + "1+\n" * 34_000 + "1}",
    "NUL bytes": "\x00\\boxed{4\x002}\x00",
    "NUL bytes only": "\x00" * 1000,
    "LaTeX garbage": "\\boxed{\\begin{array}\\end{matrix}\\frac{}{}^^_\\sqrt[}{]}",
    "many boxes": "\\boxed{1} " * 20_000 + "\\boxed{42}",
    "a plain correct answer (the grader still works afterwards)": "Thus \\boxed{42}.",
}


@pytest.fixture(scope="module")
def hostile_results():
    verifier = MathVerifier(num_workers=2, hard_timeout_s=HARD_TIMEOUT_S, parse_timeout=1, verify_timeout=1)
    try:
        verifier.grade(["1"], ["1"])  # start the workers outside the timed region
        start = time.monotonic()
        results = verifier.score(list(CORPUS.values()), [GOLD] * len(CORPUS))
        elapsed = time.monotonic() - start
        return dict(zip(CORPUS, results)), elapsed, dict(verifier.counters), verifier.worker_restarts
    finally:
        verifier.close()


def test_corpus_returns_within_bound_with_known_statuses(hostile_results):
    results, elapsed, counters, restarts = hostile_results
    assert len(results) == len(CORPUS)
    assert all(r.status in STATUSES for r in results.values()), {k: r.status for k, r in results.items()}
    n_timeout = sum(r.status == "timeout" for r in results.values())
    # Counters include the one warm-up answer.
    assert counters["timeout"] == n_timeout
    assert counters["graded"] == len(CORPUS) + 1
    assert counters["error"] == sum(r.status == "error" for r in results.values())
    assert n_timeout >= 1  # the power towers at least must time out (math-verify's alarm or the hard kill)
    # The bound the pool enforces by construction, whatever the load: even graded one after another, every answer
    # costs at most its hard timeout, and each worker killed at the hard timeout is replaced within the pool's
    # start-up timeout (or the call fails). Plus the parent's own work (extracting boxes from 1 MB strings: well
    # under a CPU second; 60 s of wall time on a loaded machine).
    bound = len(CORPUS) * HARD_TIMEOUT_S + WorkerPool.STARTUP_TIMEOUT_S * restarts + 60.0
    assert elapsed < bound, f"{elapsed:.1f} s >= {bound:.1f} s; statuses: {[r.status for r in results.values()]}"


def test_expected_outcomes(hostile_results):
    results = hostile_results[0]
    for name in ("empty string", "empty box", "whitespace box", "1 MB of text, no box", "1 MB of unterminated boxes",
                 "5000 nested braces, no box", "unbalanced: unterminated box",
                 "unbalanced: open braces inside the box", "NUL bytes only"):
        assert results[name].status == "no_answer", name
    for name in ("1 MB of text, box at the end", "unbalanced: stray closers", "many boxes",
                 "a plain correct answer (the grader still works afterwards)"):
        assert results[name].correct and results[name].status == "ok", name
    for name in ("power tower 2^2^2^100", "power tower 9^9^9^9", "huge factorial", "5000 nested braces in a box",
                 "5000 nested parentheses in a box"):
        assert not results[name].correct and results[name].status in ("timeout", "error", "ok"), name
    # The extracted text is returned unchanged, control and invisible characters included.
    assert results["NUL bytes"].extracted == "4\x002"
    assert results["unicode, RTL and zero-width characters"].extracted == "4\u200b2"
