"""The grader's process pool: long-lived worker processes that each run one job at a time under a hard deadline, and
are killed and replaced when a job overruns it or crashes them.

Why processes that can be killed (``grail_exp.grading.rewards`` explains what hangs): math-verify runs sympy on untrusted
model output, and neither its ``signal.alarm`` timeouts (main thread only, whole seconds, per expression) nor a Python
signal handler (it never runs inside a long C-level computation) bound the time an answer takes. Only a process that
is killed on overrun does. ``concurrent.futures`` is deliberately not used: a hung task in its pools cannot be killed.

The pool knows nothing of grading: ``WorkerPool(work, init=...)`` runs ``work(*job)`` in the workers and returns its
replies, or ``Failed("timeout")`` / ``Failed("error")`` for a job that overran or whose worker died. ``work`` and
``init`` must pickle (module-level functions, or ``functools.partial`` of them) for the ``spawn`` start method.

Each worker runs ``init()`` (imports, warm-up) before it reports ready, so start-up time is never charged to a job's
deadline; up to two jobs are in flight per worker (the running one and one queued behind it, so a worker never idles
during a reply's round trip); a worker that dies during start-up is replaced, and a pool whose workers keep dying
there gives up loudly. Standard library only: the workers start fast and never import torch.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_READY = "ready"


@dataclass(frozen=True)
class Failed:
    """A job without a reply: ``"timeout"`` (its worker overran the hard deadline and was killed) or ``"error"``
    (its worker died)."""

    status: str


def _worker_main(conn, work: Callable, init: Callable | None, parent: int | None = None,
                 from_main_thread: bool = True) -> None:
    """Worker loop: run ``init()``, report ready, then answer each job ``args`` with ``work(*args)``; exit on EOF/None.

    Module-level so that it pickles under the ``spawn`` start method. The worker dies with its ``parent`` however the
    parent ends (SIGKILL included; a busy worker never reads the pipe's EOF): a parent-death signal when the parent
    started it from its main thread, else a thread watching the parent's pid (the signal would come when the starting
    thread ends).
    """
    from grail_exp.preemption import die_with_parent, watch_parent

    if parent is not None:
        if from_main_thread:
            die_with_parent(parent)
        else:
            watch_parent(parent)
    # Ctrl-C goes to the whole process group; the parent decides what happens to workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if init is not None:
        init()
    conn.send(_READY)
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # parent closed the pipe or died
        if job is None:
            return
        conn.send(work(*job))


def _job_chars(job: tuple) -> int:
    return sum(len(x) for x in job if isinstance(x, str))


@dataclass
class _Worker:
    process: Any  # multiprocessing BaseProcess
    conn: Any  # multiprocessing Connection (parent end)
    ready: bool = False
    # Indices (into the current run() call) sent and not yet answered; the
    # worker runs them in order, so jobs[0] is the one running now.
    jobs: deque = field(default_factory=deque)
    deadline: float = 0.0  # hard deadline of jobs[0], or start-up deadline while not ready


# All live pools, closed at interpreter exit so that no worker outlives the parent.
_LIVE_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


atexit.register(_close_all_pools)


class WorkerPool:
    """``num_workers`` long-lived processes running ``work(*job)``, each job under ``hard_timeout_s`` seconds of wall
    time in its worker. Workers start on the first ``run`` and are reused; ``worker_restarts`` counts the workers
    replaced after a timeout or crash. ``name`` names the processes (``<name>-worker``) and the errors."""

    STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine can be slow
    STOP_GRACE_S = 1.0
    MAX_STARTUP_FAILURES = 3
    PIPELINE_DEPTH = 2  # jobs in flight per worker: the running one + one queued
    PIPELINE_MAX_CHARS = 8192  # only small jobs are queued (pipe buffers are ~64 KiB)

    def __init__(self, work: Callable, num_workers: int, hard_timeout_s: float, init: Callable | None = None,
                 mp_context: str = "spawn", name: str = "pool") -> None:
        self.work, self.init, self.name = work, init, name
        self.num_workers = num_workers
        self.hard_timeout_s = float(hard_timeout_s)
        self._ctx = multiprocessing.get_context(mp_context)
        self.workers: list[_Worker] = []
        self.worker_restarts = 0
        self._startup_failures = 0  # consecutive workers that died before becoming ready
        _LIVE_POOLS.add(self)

    def run(self, jobs: list[tuple]) -> list[Any]:
        """Each job's reply, in input order; ``Failed(status)`` for a job that timed out or lost its worker."""
        while len(self.workers) < self.num_workers:  # lazy start / top up
            self.workers.append(self._start_worker())
        results: list[Any] = [None] * len(jobs)
        try:
            self._event_loop(jobs, deque(range(len(jobs))), results)
        except BaseException:
            # Interrupted (e.g. KeyboardInterrupt): replies of in-flight jobs would
            # arrive during the next call and be misattributed, so drop those workers.
            keep = []
            for w in self.workers:
                if w.ready and not w.jobs:
                    keep.append(w)
                else:
                    _safe_close(w.conn)
                    _kill(w.process)
            self.workers = keep
            raise
        return results

    def close(self) -> None:
        """Stop all workers (idempotent). Idle workers exit on EOF; busy ones are killed."""
        workers, self.workers = self.workers, []
        for w in workers:
            _safe_close(w.conn)  # idle workers see EOF and exit by themselves
        deadline = time.monotonic() + self.STOP_GRACE_S
        for w in workers:
            if not w.jobs and w.ready:
                w.process.join(max(0.0, deadline - time.monotonic()))
            _kill(w.process)
        _LIVE_POOLS.discard(self)

    # ---- internals --------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self.work, self.init, os.getpid(),
                  threading.current_thread() is threading.main_thread()),
            name=f"{self.name}-worker",
            daemon=True,  # multiprocessing also kills daemons at exit
        )
        process.start()
        # Drop our copy of the child's end, otherwise a dead worker never reads as EOF.
        child_conn.close()
        return _Worker(process, parent_conn, deadline=time.monotonic() + self.STARTUP_TIMEOUT_S)

    def _replace_worker(self, k: int) -> None:
        old = self.workers[k]
        _safe_close(old.conn)
        _kill(old.process)
        self.workers[k] = self._start_worker()
        self.worker_restarts += 1

    def _event_loop(self, jobs: list[tuple], todo: deque[int], results: list[Any]) -> None:
        workers = self.workers
        while todo or any(w.jobs for w in workers):
            self._dispatch(jobs, todo)
            # Wait for a reply, a crash (EOF) or the nearest deadline.
            watched = [w for w in workers if w.jobs or not w.ready]
            timeout = max(0.0, min(w.deadline for w in watched) - time.monotonic())
            readable = multiprocessing.connection.wait([w.conn for w in watched], timeout)
            self._collect(readable, todo, results)
            self._kill_overrunning(todo, results)

    def _dispatch(self, jobs: list[tuple], todo: deque[int]) -> None:
        """Keep every ready worker busy. A second job is queued behind the running one so the worker never idles
        during the reply's round trip."""
        for k, w in enumerate(self.workers):
            while w.ready and todo and len(w.jobs) < self.PIPELINE_DEPTH:
                i = todo[0]
                if w.jobs and _job_chars(jobs[i]) > self.PIPELINE_MAX_CHARS:
                    break  # a big message could block on a hung worker's full pipe
                try:
                    w.conn.send(jobs[i])
                except (OSError, ValueError):  # the worker died
                    if not w.jobs:  # nothing will report it: replace it now
                        self._replace_worker(k)
                    break  # otherwise its EOF is handled in _collect
                todo.popleft()
                if not w.jobs:
                    w.deadline = time.monotonic() + self.hard_timeout_s
                w.jobs.append(i)

    def _collect(self, readable: list, todo: deque[int], results: list[Any]) -> None:
        """Collect replies; replace crashed workers."""
        for k, w in enumerate(self.workers):
            if w.conn not in readable:
                continue
            try:
                msg = w.conn.recv()
            except (EOFError, OSError) as err:
                if not w.jobs:  # died during start-up
                    w.process.join(self.STOP_GRACE_S)
                    code = w.process.exitcode
                    self._startup_failures += 1
                    if self._startup_failures > self.MAX_STARTUP_FAILURES:
                        # Systematic (e.g. an import error in the worker): give up loudly.
                        raise RuntimeError(f"{self.name} workers keep dying during start-up (last exit code {code})") from err
                else:
                    self._fail_head_job(w, "error", todo, results)
                self._replace_worker(k)
                continue
            if not w.ready:
                w.ready = msg == _READY
                self._startup_failures = 0
                continue
            results[w.jobs.popleft()] = msg
            if w.jobs:  # the queued job starts now
                w.deadline = time.monotonic() + self.hard_timeout_s

    def _kill_overrunning(self, todo: deque[int], results: list[Any]) -> None:
        """Kill workers that overran their deadline."""
        now = time.monotonic()
        for k, w in enumerate(self.workers):
            if w.jobs and w.deadline <= now:
                self._fail_head_job(w, "timeout", todo, results)
                self._replace_worker(k)
            elif not w.ready and w.deadline <= now:
                self._replace_worker(k)
                raise RuntimeError(f"{self.name} worker not ready after {self.STARTUP_TIMEOUT_S:.0f} s")

    @staticmethod
    def _fail_head_job(w: _Worker, status: str, todo: deque[int], results: list[Any]) -> None:
        """Record the running job as failed; jobs queued behind it go back to the front of ``todo``."""
        results[w.jobs.popleft()] = Failed(status)
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
