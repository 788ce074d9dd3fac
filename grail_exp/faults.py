"""Test-only fault injection: a crash, a stop or a hang at a known point of a real run, so that a recovery test
kills the process where it means to instead of racing a timer (docs/developer.md, "Faults injected, never raced").

Every function here is a no-op unless the environment variable ``GRAIL_EXP_FAULT`` names its fault (the grader's
hooks: unless ``MathVerifier(_allow_debug=True)``); the production code calls them at the marked points:

    GRAIL_EXP_FAULT=stall_checkpoint:<N>               training/checkpoint_writer.py: hang mid-write of step N's checkpoint
    GRAIL_EXP_FAULT=raise_in_checkpoint:<N>[:rank<R>]  training/checkpoint_writer.py: a RuntimeError in a rank's own
                                                       part of step N's checkpoint
    GRAIL_EXP_FAULT=kill_eval_after_chunks:<N>         evaluate: SIGKILL right after the N-th cached chunk
    GRAIL_EXP_FAULT=term_at_step:<N>[:<scheme>]        training/module.py: SIGTERM at the end of optimiser step N
    GRAIL_EXP_FAULT=int_at_step:<N>[:<scheme>]         training/module.py: SIGINT (Ctrl-C) there instead
    GRAIL_EXP_FAULT=ready_at:<point>:<dir>             distributed.py, point ``rendezvous``: write <dir>/<point>.rank<R>
    GRAIL_EXP_FAULT=hold_at:<point>:<dir>              the same, then wait there until signalled
    GRAIL_EXP_FAULT=kill_after_step:<N>[:<scheme>]     training/module.py: SIGKILL after step N's checkpoint decision
    GRAIL_EXP_FAULT=tune_kill:<point>[:<trial|state>]  tune: SIGKILL at a point of a trial's life (tune.CRASH_POINTS)
    answers "__sleep__:<s>" / "__crash__"              rewards.py's grading worker: hang <s> seconds / die

The step faults and ``raise_in_checkpoint`` take a further ``:rank<R>`` (e.g. ``term_at_step:1:rank1``): only
data-parallel rank R fires, as when a signal reaches one rank of a job. ``ready_at`` marks a point where a process waits by itself (a rank at
the rendezvous of a world that cannot form): the file holds the process's pid, so that a test signals a process it
knows is there. ``hold_at`` keeps the process at that point after writing its file (a world that would form, held
there: the preflight's rehearsal ranks, whose world is always one node).

Each fault logs one ``GRAIL_EXP_FAULT: ...`` warning first (tests look for it). Standard library only: the grading
workers import this module.
"""

from __future__ import annotations

import logging
import os
import signal
import time

ENV = "GRAIL_EXP_FAULT"
log = logging.getLogger("grail_exp.faults")


def _fault() -> str:
    return os.environ.get(ENV, "")


def _sigkill() -> None:
    """Die at once, without cleanup (as the OOM killer or a lost node would), once the log lines are out."""
    logging.shutdown()  # flushes every handler: the warning above must reach the test
    os.kill(os.getpid(), signal.SIGKILL)


def stall_checkpoint(step: int) -> None:
    """``stall_checkpoint:<N>``: stall mid-write of step N's checkpoint (its files written, not yet renamed into
    place) until the process is killed, so that a test can SIGKILL it while the checkpoint is half written, however
    slow the machine. It gives up when its parent (the test) has gone, or after an hour."""
    if _fault() != f"stall_checkpoint:{step}":
        return
    log.warning("GRAIL_EXP_FAULT: stalling mid-write of checkpoint step %d", step)
    parent, end = os.getppid(), time.monotonic() + 3600
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.5)


class InjectedFault(RuntimeError):
    """The error ``raise_in_checkpoint`` raises: a bug or a failure no handler expects, on one rank."""


def raise_in_checkpoint(step: int, rank: int) -> None:
    """``raise_in_checkpoint:<N>[:rank<R>]``: raise ``InjectedFault`` (a ``RuntimeError``, not an ``OSError``) while
    this rank writes its own part of step N's checkpoint (on every rank, or only on rank R): the other ranks must learn
    it at the checkpoint's agreement point instead of waiting for this rank until the process group's timeout."""
    if _at_step("raise_in_checkpoint", step, "", rank):
        log.warning("GRAIL_EXP_FAULT: raise_in_checkpoint at step %d on rank %d", step, rank)
        raise InjectedFault(f"GRAIL_EXP_FAULT raise_in_checkpoint at step {step} on rank {rank}")


_chunks_put = 0  # evaluation chunks this process has cached


def kill_eval_after_chunks() -> None:
    """``kill_eval_after_chunks:<N>``: called once per evaluation chunk written to the completion cache; SIGKILLs
    this process right after its N-th, so that a test kills an evaluation at a known point."""
    global _chunks_put
    _chunks_put += 1
    if _fault() == f"kill_eval_after_chunks:{_chunks_put}":
        log.warning("GRAIL_EXP_FAULT: killing this process after %d cached chunks", _chunks_put)
        _sigkill()


def _at_step(point: str, step: int, scheme: str, rank: int) -> bool:
    """Whether the fault names ``point`` at optimiser ``step``, and, where it says so, this ``scheme`` and this
    data-parallel ``rank`` (``rank<R>``; without it every rank fires)."""
    name, *fields = _fault().split(":")
    if name != point or not fields or int(fields[0]) != step:
        return False
    for field in fields[1:]:
        if field.startswith("rank") and field[4:].isdigit():
            if int(field[4:]) != rank:
                return False
        elif field != scheme:
            return False
    return True


def term_at_step(step: int, scheme: str, rank: int = 0) -> None:
    """``term_at_step:<N>[:<scheme>][:rank<R>]``: at the end of optimiser step N (of any job, or only of jobs
    training ``scheme``; on every rank, or only on rank R), send this process SIGTERM before the step's checkpoint
    decision, as if the signal had arrived during step N: the run checkpoints step N and stops (all ranks, when one
    got it)."""
    if _at_step("term_at_step", step, scheme, rank):
        log.warning("GRAIL_EXP_FAULT: term_at_step at step %d of %s on rank %d", step, scheme, rank)
        os.kill(os.getpid(), signal.SIGTERM)


def int_at_step(step: int, scheme: str, rank: int = 0) -> None:
    """``int_at_step:<N>[:<scheme>][:rank<R>]``: as ``term_at_step``, with SIGINT (what Ctrl-C sends)."""
    if _at_step("int_at_step", step, scheme, rank):
        log.warning("GRAIL_EXP_FAULT: int_at_step at step %d of %s on rank %d", step, scheme, rank)
        os.kill(os.getpid(), signal.SIGINT)


def ready_at(point: str, rank: int = 0) -> None:
    """``ready_at:<point>:<dir>``: at ``point`` write ``<dir>/<point>.rank<R>`` (atomically) holding this process's
    pid, and go on; ``hold_at:<point>:<dir>``: the same, then stay there until a signal ends the process."""
    name, _, rest = _fault().partition(":")
    want, _, folder = rest.partition(":")
    if name not in ("ready_at", "hold_at") or want != point or not folder:
        return
    log.warning("GRAIL_EXP_FAULT: %s %s on rank %d (pid %d)", name, point, rank, os.getpid())
    path = os.path.join(folder, f"{point}.rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while name == "hold_at":
        time.sleep(0.1)  # short slices: the stop handler runs between them


def kill_after_step(step: int, scheme: str, rank: int = 0) -> None:
    """``kill_after_step:<N>[:<scheme>][:rank<R>]``: SIGKILL this process after optimiser step N's checkpoint
    decision (of any job, or only of jobs training ``scheme``; on every rank, or only on rank R): a study is stopped
    mid-arm at a known point."""
    if _at_step("kill_after_step", step, scheme, rank):
        log.warning("GRAIL_EXP_FAULT: kill_after_step at step %d of %s on rank %d", step, scheme, rank)
        _sigkill()


def tune_kill(point: str, number: int, state: str | None = None) -> None:
    """``tune_kill:<point>[:<trial number or state>]``: SIGKILL this Optuna worker at ``point`` (one of
    ``tune.CRASH_POINTS``) of the first trial whose number or state matches (any trial when neither is given)."""
    fault = _fault()
    if not fault.startswith("tune_kill:"):
        return
    want, _, which = fault[len("tune_kill:"):].partition(":")
    if want == point and which in ("", str(number), state):
        log.warning("GRAIL_EXP_FAULT: killing this worker at %s of trial %d (%s)", point, number, state)
        _sigkill()


GRADING_SLEEP = "__sleep__:"  # an answer "__sleep__:<seconds>" hangs the grading worker that long
GRADING_CRASH = "__crash__"  # an answer "__crash__" kills the grading worker (exit code 3)


def grading_answer(answer: str) -> bool:
    """The grading worker's hooks, honoured only under ``MathVerifier(_allow_debug=True)`` (its caller checks):
    ``__sleep__:<s>`` sleeps ``s`` seconds and returns True (the caller reports the answer as graded, wrong);
    ``__crash__`` ends the worker at once. Any other answer: False, grade it."""
    if answer.startswith(GRADING_SLEEP):
        time.sleep(float(answer[len(GRADING_SLEEP):]))
        return True
    if answer == GRADING_CRASH:
        os._exit(3)
    return False
