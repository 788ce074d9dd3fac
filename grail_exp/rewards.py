"""Answer extraction and math-verify grading for RL with verifiable rewards.

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
``benchmark.extraction``: see ``grail_exp.extraction``.

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
that overruns. ``MathVerifier`` therefore keeps a few long-lived worker
processes (started lazily, reused across calls), sends each one answer at a
time over a ``multiprocessing`` Pipe, waits with a deadline, and on overrun
terminates/kills the worker, records ``status="timeout"`` (reward 0) and starts
a fresh worker. ``concurrent.futures`` is deliberately not used: a hung task
in its pools cannot be killed. A crashing worker is replaced the same way and
its answer counted as ``"error"``.

This module imports only the standard library (math_verify lazily, inside the
grading functions) so that spawned workers start fast; in particular it must
never import torch.

Note: the workers import ``grail_exp.rewards`` and, with the ``spawn`` start
method, the parent's ``__main__`` script (without running its main block);
keep both light for fast worker start-up.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "extract_last_boxed",
    "find_first_boxed_span",
    "strip_think",
    "grade_one",
    "GradeResult",
    "MathVerifier",
    "STATUSES",
]

# Box finding lives in grail_exp/boxed.py (shared with the extraction rules and the answer spans).
from grail_exp.boxed import (  # noqa: E402,F401  (re-exported: the grading API's names)
    _BOX_LEN,
    _BOX_OPEN,
    _matching_close,
    extract_last_boxed,
    find_first_boxed_span,
    find_last_boxed_span,
)


def strip_think(text: str) -> str:
    """Text after the last ``</think>`` (thinking models), or ``text`` unchanged if absent."""
    head, sep, tail = text.rpartition("</think>")
    return tail if sep else text


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
    (``grail_exp.extraction``, mode ``math_verify``); ``extracted`` is the text it found, None if none.
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
# Worker process
# --------------------------------------------------------------------------

_READY = "ready"
_DEBUG_SLEEP = "__sleep__:"  # test hook, honoured only with _allow_debug=True
_DEBUG_CRASH = "__crash__"


def _worker_main(conn, parse_timeout, verify_timeout, allow_debug: bool) -> None:
    """Worker loop: receive ``(pred, gold, whole)``, send back ``(correct, status, extracted)``; exit on EOF/None.

    Module-level so that it pickles under the ``spawn`` start method.
    """
    # Ctrl-C goes to the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Make sure math-verify's timeout warnings are emitted so they can be detected.
    logging.getLogger("math_verify").setLevel(logging.WARNING)
    # Warm-up (imports sympy/antlr, compiles regexes) before reporting ready,
    # so that start-up time is never charged to an answer's hard timeout.
    _grade_with_status("1", "1", parse_timeout, verify_timeout)
    conn.send(_READY)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # parent closed the pipe or died
        if job is None:
            return
        pred, gold, whole = job
        if allow_debug and pred.startswith(_DEBUG_SLEEP):
            time.sleep(float(pred[len(_DEBUG_SLEEP) :]))
            result: tuple[bool, str, str | None] = (False, "ok", pred)
        elif allow_debug and pred == _DEBUG_CRASH:
            os._exit(3)
        else:
            result = _grade_with_status(pred, gold, parse_timeout, verify_timeout, whole)
        conn.send(result)


@dataclass
class _Worker:
    process: Any  # multiprocessing BaseProcess
    conn: Any  # multiprocessing Connection (parent end)
    ready: bool = False
    # Indices (into the current grade() call) sent and not yet answered; the
    # worker grades them in order, so jobs[0] is the one running now.
    jobs: deque = field(default_factory=deque)
    deadline: float = 0.0  # hard deadline of jobs[0], or start-up deadline while not ready


# All live verifiers, closed at interpreter exit so that no worker outlives the parent.
_LIVE_VERIFIERS: "weakref.WeakSet[MathVerifier]" = weakref.WeakSet()


def _close_all_verifiers() -> None:
    for verifier in list(_LIVE_VERIFIERS):
        verifier.close()


atexit.register(_close_all_verifiers)


# --------------------------------------------------------------------------
# Pool
# --------------------------------------------------------------------------


class MathVerifier:
    """Grades answers with math-verify in killable worker processes.

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
    ``grail_exp.extraction.RULES`` (``last_balanced``, ``paper_reward``,
    ``paper_eval``, ``math_verify``). Every rule grades under the same hard
    timeout: ``math_verify`` sends the whole completion to the worker.
    """

    _STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can be slow
    _STOP_GRACE_S = 1.0
    _MAX_STARTUP_FAILURES = 3
    _PIPELINE_DEPTH = 2  # answers in flight per worker: the running one + one queued
    _PIPELINE_MAX_CHARS = 8192  # only small answers are queued (pipe buffers are ~64 KiB)

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
        from grail_exp.extraction import RULES

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
        self._allow_debug = _allow_debug
        self._ctx = multiprocessing.get_context(mp_context)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(_COUNTER_KEYS, 0)
        self.worker_restarts = 0  # workers replaced after a timeout or crash
        self._startup_failures = 0  # consecutive workers that died before becoming ready
        _LIVE_VERIFIERS.add(self)

    # ---- public API -------------------------------------------------------

    def grade(self, preds: list[str | None], golds: list[str], whole: bool = False) -> list[GradeResult]:
        """Grade extracted answers against gold answers; results in input order.

        ``None`` / empty preds are "no_answer" and are not dispatched. ``whole=True``: the preds are whole
        completions and math-verify extracts the answer (``GradeResult.extracted`` = what it found).
        """
        if len(preds) != len(golds):
            raise ValueError(f"{len(preds)} preds but {len(golds)} golds")
        results: list[GradeResult | None] = [None] * len(preds)
        todo: deque[int] = deque()
        for i, pred in enumerate(preds):
            if pred is None or not pred.strip():
                results[i] = GradeResult(False, None if whole else pred, "no_answer")
            else:
                todo.append(i)
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            if todo and self.num_workers == 0:
                for i in todo:
                    correct, status, extracted = _grade_with_status(
                        preds[i], golds[i], self.parse_timeout, self.verify_timeout, whole
                    )
                    results[i] = GradeResult(correct, extracted, status)
            elif todo:
                self._grade_in_pool(preds, golds, todo, results, whole)
            self._count(results)
        return results  # type: ignore[return-value]

    def score(self, completions: list[str], golds: list[str], extraction: str | None = None) -> list[GradeResult]:
        """Extract each completion's answer with rule ``extraction`` (default: ``self.extraction``), then ``grade``."""
        from grail_exp.extraction import RULES

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
        workers, self._workers = self._workers, []
        for w in workers:
            _safe_close(w.conn)  # idle workers see EOF and exit by themselves
        deadline = time.monotonic() + self._STOP_GRACE_S
        for w in workers:
            if not w.jobs and w.ready:
                w.process.join(max(0.0, deadline - time.monotonic()))
            _kill(w.process)
        _LIVE_VERIFIERS.discard(self)

    def __enter__(self) -> "MathVerifier":
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

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self.parse_timeout, self.verify_timeout, self._allow_debug),
            name="math-verify-worker",
            daemon=True,  # multiprocessing also kills daemons at exit
        )
        process.start()
        # Drop our copy of the child's end, otherwise a dead worker never reads as EOF.
        child_conn.close()
        return _Worker(process, parent_conn, deadline=time.monotonic() + self._STARTUP_TIMEOUT_S)

    def _replace_worker(self, k: int) -> None:
        old = self._workers[k]
        _safe_close(old.conn)
        _kill(old.process)
        self._workers[k] = self._start_worker()
        self.worker_restarts += 1

    def _grade_in_pool(
        self,
        preds: list[str | None],
        golds: list[str],
        todo: deque[int],
        results: list[GradeResult | None],
        whole: bool,
    ) -> None:
        while len(self._workers) < self.num_workers:  # lazy start / top up
            self._workers.append(self._start_worker())
        try:
            self._event_loop(preds, golds, todo, results, whole)
        except BaseException:
            # Interrupted (e.g. KeyboardInterrupt): results of in-flight jobs would
            # arrive during the next call and be misattributed, so drop those workers.
            keep = []
            for w in self._workers:
                if w.ready and not w.jobs:
                    keep.append(w)
                else:
                    _safe_close(w.conn)
                    _kill(w.process)
            self._workers = keep
            raise

    def _event_loop(
        self,
        preds: list[str | None],
        golds: list[str],
        todo: deque[int],
        results: list[GradeResult | None],
        whole: bool,
    ) -> None:
        workers = self._workers
        while todo or any(w.jobs for w in workers):
            # 1. Keep every ready worker busy. A second answer is queued behind the
            #    running one so the worker never idles during the result round trip.
            for k, w in enumerate(workers):
                while w.ready and todo and len(w.jobs) < self._PIPELINE_DEPTH:
                    i = todo[0]
                    if w.jobs and len(preds[i]) + len(golds[i]) > self._PIPELINE_MAX_CHARS:
                        break  # a big message could block on a hung worker's full pipe
                    try:
                        w.conn.send((preds[i], golds[i], whole))
                    except (OSError, ValueError):  # the worker died
                        if not w.jobs:  # nothing will report it: replace it now
                            self._replace_worker(k)
                        break  # otherwise its EOF is handled in step 3
                    todo.popleft()
                    if not w.jobs:
                        w.deadline = time.monotonic() + self.hard_timeout_s
                    w.jobs.append(i)

            # 2. Wait for a result, a crash (EOF) or the nearest deadline.
            watched = [w for w in workers if w.jobs or not w.ready]
            timeout = max(0.0, min(w.deadline for w in watched) - time.monotonic())
            readable = multiprocessing.connection.wait([w.conn for w in watched], timeout)

            # 3. Collect results; replace crashed workers.
            for k, w in enumerate(workers):
                if w.conn not in readable:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    if not w.jobs:  # died during start-up
                        w.process.join(self._STOP_GRACE_S)
                        code = w.process.exitcode
                        self._startup_failures += 1
                        if self._startup_failures > self._MAX_STARTUP_FAILURES:
                            # Systematic (e.g. an import error in the worker): give up loudly.
                            raise RuntimeError(
                                f"math-verify workers keep dying during start-up (last exit code {code})"
                            )
                    else:
                        self._fail_head_job(w, "error", preds, todo, results, whole)
                    self._replace_worker(k)
                    continue
                if not w.ready:
                    w.ready = msg == _READY
                    self._startup_failures = 0
                    continue
                correct, status, extracted = msg
                i = w.jobs.popleft()
                results[i] = GradeResult(bool(correct), extracted if whole else preds[i], status)
                if w.jobs:  # the queued answer starts now
                    w.deadline = time.monotonic() + self.hard_timeout_s

            # 4. Kill workers that overran their deadline.
            now = time.monotonic()
            for k, w in enumerate(workers):
                if w.jobs and w.deadline <= now:
                    self._fail_head_job(w, "timeout", preds, todo, results, whole)
                    self._replace_worker(k)
                elif not w.ready and w.deadline <= now:
                    self._replace_worker(k)
                    raise RuntimeError(
                        f"math-verify worker not ready after {self._STARTUP_TIMEOUT_S:.0f} s"
                    )

    @staticmethod
    def _fail_head_job(
        w: _Worker,
        status: str,
        preds: list[str | None],
        todo: deque[int],
        results: list[GradeResult | None],
        whole: bool,
    ) -> None:
        """Record the running answer as failed; answers queued behind it go back to the front of ``todo``."""
        i = w.jobs.popleft()
        results[i] = GradeResult(False, None if whole else preds[i], status)
        todo.extendleft(reversed(w.jobs))
        w.jobs.clear()


def _safe_close(conn) -> None:
    try:
        conn.close()
    except OSError:
        pass


def _kill(process, grace_s: float = 1.0) -> None:
    """Terminate, then kill, and always reap (no zombies)."""
    if process.is_alive():
        process.terminate()
        process.join(grace_s)
    if process.is_alive():
        process.kill()
    process.join()
