"""User-facing errors: one clear message naming the thing and the fix, not a stack trace."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

log = logging.getLogger("grail_exp")


def user_error_types() -> tuple[type[BaseException], ...]:
    from grail_exp.checkpoint import CheckpointError
    from grail_exp.config import ConfigError
    from grail_exp.models import ModelLoadError
    from grail_exp.training.update import NonFiniteLossError
    from grail_exp.tracking import TrackingError

    return (ConfigError, ModelLoadError, TrackingError, CheckpointError, NonFiniteLossError, FileNotFoundError,
            DataError)


class RunStopped(Exception):
    """Raised by a caller's hook to end a run early on purpose (e.g. ``grail_exp.tune`` pruning a trial): the
    MLflow run is KILLED, not FAILED, and keeps no traceback."""


class Preempted(RuntimeError):
    """Raised after SIGTERM once the current optimiser step is done and a checkpoint is written."""


class DataError(ValueError):
    """Malformed input data (a dataset row, a benchmark file); the message names the file and line."""


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
