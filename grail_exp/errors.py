"""User-facing errors: one clear message naming the thing and the fix, not a stack trace.

A mistake in what the user gave (a config value, a path, a data file, a checkpoint) raises a ``UserError``
subclass whose message names the key (``data.num_validation=256: ...``) or the file (``<file>:<line>: ...``) and
says what to do. Every command-line entry point runs inside ``exit_on_user_error``, which prints
``error: <message>`` on stderr and exits 2; anything else is a bug and keeps its traceback. Raise sites deep in
the code (data sources, benchmarks, model loading, resume, tune settings) raise these types directly, so the CLI
needs no knowledge of them.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

log = logging.getLogger("grail_exp")


class UserError(Exception):
    """A mistake in the user's input, not a bug: the CLI prints the message alone (no traceback) and exits 2."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work. The message names the key(s) and the fix."""


class DataError(UserError, ValueError):
    """Malformed or unusable input data (a dataset, a benchmark file, a data config that cannot produce what is
    asked); the message names the file and line, or the config key."""


class MissingDependencyError(UserError, ImportError):
    """An optional dependency that the chosen config needs is not installed; the message says how to install it."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """``UserError`` and the few user-caused errors that are not subclasses of it (OS errors for missing files)."""
    return (UserError, FileNotFoundError)


class LayoutError(UserError, RuntimeError):
    """The processes a run actually got are not the layout its config asks for (a world size other than
    trainer.devices x trainer.num_nodes, ranks sampling the same prompts): stopping beats N silent one-rank runs."""


class RunStopped(Exception):
    """Raised by a caller's hook to end a run early on purpose (e.g. ``grail_exp.tune`` pruning a trial): the
    MLflow run is KILLED, not FAILED, and keeps no traceback."""


class Preempted(RuntimeError):
    """Raised on every rank once the ranks agreed on a stop signal (SIGTERM, SIGINT, submitit's) at the end of
    optimiser ``step`` and its checkpoint is written. ``signum``: the signal (the largest number any rank received,
    so SIGTERM over SIGINT); ``here``: whether this rank received one itself."""

    def __init__(self, message: str, signum: int = 15, step: int | None = None, here: bool = True):
        super().__init__(message)
        self.signum, self.step, self.here = int(signum), step, here


class StoppedBySignal(BaseException):
    """A stop signal before the first optimiser step (model load, rendezvous, engine build, the evaluation before
    training): no step to agree on and nothing to save, so the job ends at once (``grail_exp.preemption``).
    ``stage``: what the job was doing. A ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the
    way out holds it up."""

    def __init__(self, signum: int, stage: str):
        super().__init__(f"signal {signum} during {stage}")
        self.signum, self.stage = int(signum), stage


@contextmanager
def exit_on_user_error(code: int = 2, extra: tuple[type[BaseException], ...] = ()):
    """Turn a known user error into ``error: <message>`` on stderr and exit ``code``.

    Anything else is a bug and keeps its traceback. Set ``GRAIL_EXP_TRACEBACK=1`` to see tracebacks of
    user errors too.
    """
    import os

    try:
        yield
    except user_error_types() + tuple(extra) as exc:
        if os.environ.get("GRAIL_EXP_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(code)
