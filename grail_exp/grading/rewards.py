"""The reward: math-verify grading of a completion's answer against the gold answer, under hard timeouts.

The reward
----------
The reward is binary: 1 if the model's answer is mathematically equivalent to
the gold answer, else 0. Following the reference rule, the graded answer is the
content of the LAST balanced ``\\boxed{...}`` in the completion (models often
box intermediate results; the final box is the committed answer). Both sides
are wrapped in ``$...$`` before ``math_verify.parse`` so that math-verify's
LaTeX extractor treats the bare box content as inline math, then compared with
``math_verify.verify(gold, pred)`` (gold first: verify is not symmetric).
Other extraction rules (the GRAIL reference's own, or math-verify's extraction
over the whole completion) are chosen by ``reward.extraction`` /
``benchmark.extraction``: see ``grail_exp.grading.extraction``.

Why worker processes and hard timeouts
--------------------------------------
math-verify runs sympy on untrusted model output. Some answers
(``2^{2^{2^{...}}}``, huge factorials, pathological LaTeX) make sympy compute
for minutes or forever. math-verify guards itself with ``signal.alarm``, but

* alarms only work in a process's main thread (training loops and dataloaders
  are often threaded), have whole-second granularity, and are per expression,
  so one answer can legitimately take several multiples of the timeout;
* a Python signal handler only runs between bytecodes, so a long computation
  inside a C extension (e.g. a giant integer power) is not interrupted at all.

The only reliable bound is to grade in separate processes and kill a process
that overruns. ``MathVerifier`` therefore grades in a ``grail_exp.grading.pool``
``WorkerPool``: a few long-lived worker processes (started lazily, reused across
calls), one answer at a time each, under a hard deadline; on overrun the worker
is killed, the answer records ``status="timeout"`` (reward 0) and a fresh
worker starts. A crashing worker is replaced the same way and its answer
counted as ``"error"``.

This module imports only the standard library (math_verify lazily, inside the
grading functions) so that spawned workers start fast; in particular it must
never import torch.

Note: the workers import ``grail_exp.grading.rewards`` and, with the ``spawn`` start
method, the parent's ``__main__`` script (without running its main block);
keep both light for fast worker start-up.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass

from grail_exp import faults
from grail_exp.grading.pool import Failed, WorkerPool

__all__ = ["grade_one", "GradeResult", "MathVerifier", "STATUSES"]


# --------------------------------------------------------------------------
# Grading a single answer
# --------------------------------------------------------------------------

STATUSES = ("ok", "no_answer", "timeout", "error")
_COUNTER_KEYS = ("graded", "correct", "no_answer", "timeout", "error")


@dataclass
class GradeResult:
    """Outcome of grading one answer.

    ``status`` is one of ``STATUSES``: "ok" (graded; ``correct`` may be
    False), "no_answer" (no box / empty box), "timeout" (math-verify timed
    out or the worker was killed), "error" (exception or worker crash).
    """

    correct: bool
    extracted: str | None
    status: str


class _TimeoutLogCatcher(logging.Handler):
    """Notices math-verify's internal timeouts.

    With the default ``raise_on_error=False``, ``parse``/``verify`` swallow
    their own ``TimeoutException`` and just log "Timeout during ...", returning
    ``[]``/False. We keep the reference call unchanged and detect the timeout
    from the log record instead (only records from this thread count, so
    concurrent in-process graders do not see each other's timeouts).
    Attaching a handler also keeps these warnings off stderr.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.thread_id = threading.get_ident()
        self.timed_out = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread_id and str(record.msg).startswith("Timeout during"):
            self.timed_out = True


def _alarm_seconds(timeout: float | None) -> int | None:
    # signal.alarm takes whole seconds (a float raises TypeError inside math-verify).
    if timeout is None or timeout <= 0:
        return None
    return max(1, math.ceil(timeout))


def _whole_completion_config():
    """math-verify's extraction over a whole completion, configured as TRL's ``accuracy_reward``.

    huggingface/trl ``trl/rewards/accuracy_rewards.py``: LaTeX only, ``\\boxed{}`` tried first
    (``boxed_match_priority=0``), no anchor-free extraction, ``first_match``, and its normalisation (no repair of
    malformed operators, so ``\\frac43`` is not read as 4/3: "we require the answer in correct latex").
    """
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    # equations=True (TRL's) still shortens "a = b = c" to "c", but latex2sympy2_extended logs a deprecation
    # warning on every parse with it: its logger is quietened to errors (it logs nothing else).
    logging.getLogger("latex2sympy2_extended.math_normalization").setLevel(logging.ERROR)
    norm = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed="all",
                               units=True)
    return [LatexExtractionConfig(normalization_config=norm, boxed_match_priority=0, try_extract_without_anchor=False)]


def _grade_with_status(
    pred: str | None, gold: str, parse_timeout: float | None, verify_timeout: float | None, whole: bool = False
) -> tuple[bool, str, str | None]:
    """Grade one answer; returns ``(correct, status, extracted)``.

    ``whole=False``: ``pred`` is an extracted answer, parsed as ``$pred$`` (``extracted`` = ``pred``).
    ``whole=True``: ``pred`` is a whole completion and math-verify extracts the answer itself
    (``grail_exp.grading.extraction``, mode ``math_verify``); ``extracted`` is the text it found, None if none.
    """
    if pred is None or not pred.strip():
        return False, "no_answer", pred if not whole else None
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    if threading.current_thread() is threading.main_thread():
        parse_s, verify_s = _alarm_seconds(parse_timeout), _alarm_seconds(verify_timeout)
    else:
        # signal.alarm raises ValueError outside the main thread; None disables it.
        parse_s = verify_s = None

    extracted = None if whole else pred
    catcher = _TimeoutLogCatcher()
    mv_logger = logging.getLogger("math_verify")
    mv_logger.addHandler(catcher)
    try:
        gold_parsed = parse("$" + gold + "$", parsing_timeout=parse_s)
        if whole:
            pred_parsed = parse(pred, extraction_config=_whole_completion_config(), extraction_mode="first_match",
                                parsing_timeout=parse_s)
            extracted = str(pred_parsed[-1]) if pred_parsed else None  # [sympy object, the text it matched]
        else:
            pred_parsed = parse("$" + pred + "$", parsing_timeout=parse_s)
        correct = bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_s))
    except TimeoutException:  # derives from BaseException: `except Exception` misses it
        return False, "timeout", extracted
    except Exception:
        return False, "error", extracted
    finally:
        mv_logger.removeHandler(catcher)
    if not correct and catcher.timed_out:
        return False, "timeout", extracted
    if whole and not pred_parsed:
        return False, "no_answer", None
    return correct, "ok", extracted


def grade_one(
    pred: str | None, gold: str, parse_timeout: int = 5, verify_timeout: int = 5
) -> bool:
    """Reference rule: ``verify(parse("$gold$"), parse("$pred$"))``, in the calling process.

    None / empty ``pred`` -> False; any exception or timeout -> False. Uses
    math-verify's own ``signal.alarm`` timeouts (disabled when not called from
    the main thread), so there is no hard bound here: use ``MathVerifier``.
    """
    return _grade_with_status(pred, gold, parse_timeout, verify_timeout)[0]


# --------------------------------------------------------------------------
# Grading in the worker pool
# --------------------------------------------------------------------------

def _start_grading_worker(parse_timeout, verify_timeout) -> None:
    """A grading worker's start-up, before it reports ready: math-verify's timeout warnings switched on (so that
    ``_TimeoutLogCatcher`` sees them), and a warm-up grade (imports sympy/antlr, compiles regexes), so that start-up
    time is never charged to an answer's hard timeout."""
    logging.getLogger("math_verify").setLevel(logging.WARNING)
    _grade_with_status("1", "1", parse_timeout, verify_timeout)


def _grade_in_worker(pred: str, gold: str, whole: bool, *, parse_timeout, verify_timeout,
                     allow_debug: bool) -> tuple[bool, str, str | None]:
    """One job of the pool: ``(correct, status, extracted)`` of ``_grade_with_status``."""
    if allow_debug and faults.grading_answer(pred):  # test-only: "__sleep__:<s>" hangs, "__crash__" dies
        return False, "ok", pred
    return _grade_with_status(pred, gold, parse_timeout, verify_timeout, whole)


class MathVerifier:
    """Grades answers with math-verify in killable worker processes (``grail_exp.grading.pool.WorkerPool``).

    ``num_workers`` long-lived workers are started on first use and reused.
    Each answer gets at most ``hard_timeout_s`` seconds of wall time in its
    worker (keep it larger than the math-verify timeouts, which are whole
    seconds per parse/comparison); an overrunning worker is killed and
    replaced and the answer is a "timeout". ``num_workers=0`` grades in the
    calling thread with math-verify's own alarms only (none at all outside
    the main thread): no hard timeout in that mode.

    ``counters`` (cumulative): ``graded`` = every answer returned by
    ``grade``/``score``, = #ok + ``no_answer`` + ``timeout`` + ``error``;
    ``correct`` <= #ok. Calls are serialised by a lock.

    ``extraction``: the rule ``score`` uses unless told otherwise, a key of
    ``grail_exp.grading.extraction.RULES`` (``last_balanced``, ``paper_reward``,
    ``paper_eval``, ``math_verify``). Every rule grades under the same hard
    timeout: ``math_verify`` sends the whole completion to the worker.
    """

    def __init__(
        self,
        num_workers: int = 2,
        hard_timeout_s: float = 15.0,
        parse_timeout: int = 5,
        verify_timeout: int = 5,
        mp_context: str = "spawn",
        extraction: str = "last_balanced",
        _allow_debug: bool = False,
    ) -> None:
        from grail_exp.grading.extraction import RULES

        if extraction not in RULES:
            raise ValueError(f"unknown extraction rule {extraction!r}; valid: {', '.join(RULES)}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if hard_timeout_s <= 0:
            raise ValueError(f"hard_timeout_s must be > 0, got {hard_timeout_s}")
        self.num_workers = num_workers
        self.hard_timeout_s = float(hard_timeout_s)
        self.parse_timeout = parse_timeout
        self.verify_timeout = verify_timeout
        self.mp_context = mp_context
        self.extraction = extraction
        self._lock = threading.Lock()
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(_COUNTER_KEYS, 0)
        self._pool = None
        if num_workers:
            work = functools.partial(_grade_in_worker, parse_timeout=parse_timeout, verify_timeout=verify_timeout,
                                     allow_debug=_allow_debug)
            init = functools.partial(_start_grading_worker, parse_timeout, verify_timeout)
            self._pool = WorkerPool(work, num_workers, hard_timeout_s, init=init, mp_context=mp_context,
                                    name="math-verify")

    @property
    def worker_restarts(self) -> int:
        """Workers replaced after a timeout or crash."""
        return self._pool.worker_restarts if self._pool is not None else 0

    # ---- public API -------------------------------------------------------

    def grade(self, preds: list[str | None], golds: list[str], whole: bool = False) -> list[GradeResult]:
        """Grade extracted answers against gold answers; results in input order.

        ``None`` / empty preds are "no_answer" and are not dispatched. ``whole=True``: the preds are whole
        completions and math-verify extracts the answer (``GradeResult.extracted`` = what it found).
        """
        if len(preds) != len(golds):
            raise ValueError(f"{len(preds)} preds but {len(golds)} golds")
        results: list[GradeResult | None] = [None] * len(preds)
        todo: list[int] = []
        for i, pred in enumerate(preds):
            if pred is None or not pred.strip():
                results[i] = GradeResult(False, None if whole else pred, "no_answer")
            else:
                todo.append(i)
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            if todo and self._pool is None:
                for i in todo:
                    correct, status, extracted = _grade_with_status(
                        preds[i], golds[i], self.parse_timeout, self.verify_timeout, whole
                    )
                    results[i] = GradeResult(correct, extracted, status)
            elif todo:
                replies = self._pool.run([(preds[i], golds[i], whole) for i in todo])
                for i, reply in zip(todo, replies):
                    if isinstance(reply, Failed):
                        results[i] = GradeResult(False, None if whole else preds[i], reply.status)
                    else:
                        correct, status, extracted = reply
                        results[i] = GradeResult(bool(correct), extracted if whole else preds[i], status)
            self._count(results)
        return results  # type: ignore[return-value]

    def score(self, completions: list[str], golds: list[str], extraction: str | None = None) -> list[GradeResult]:
        """Extract each completion's answer with rule ``extraction`` (default: ``self.extraction``), then ``grade``."""
        from grail_exp.grading.extraction import RULES

        rule = self.extraction if extraction is None else extraction
        if rule not in RULES:
            raise ValueError(f"unknown extraction rule {rule!r}; valid: {', '.join(RULES)}")
        extract = RULES[rule]
        if extract is None:  # math_verify: the worker extracts from the whole completion
            return self.grade(list(completions), golds, whole=True)
        return self.grade([extract(c) for c in completions], golds)

    def close(self) -> None:
        """Stop all workers (idempotent). Idle workers exit on EOF; busy ones are killed."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # ---- internals --------------------------------------------------------

    def _count(self, results: list[GradeResult | None]) -> None:
        for r in results:
            assert r is not None
            self.counters["graded"] += 1
            self.counters["correct"] += int(r.correct)
            if r.status != "ok":
                self.counters[r.status] += 1
