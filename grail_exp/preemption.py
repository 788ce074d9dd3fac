"""Stop signals of a training job, and handing a preempted submitit job back to submitit for its requeue.

Kept apart from ``hydra_plugins.grail_exp_launchers`` so that ``grail_exp.run`` works without the submitit plugin installed
(the ``slurm`` extra). See ``hydra_plugins/grail_exp_launchers`` for the whole requeue sequence.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def submitit_signal() -> signal.Signals | None:
    """The signal submitit uses for timeouts and preemption, when this process is a submitit job; else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


def stop_signals() -> list[signal.Signals]:
    """Signals after which training checkpoints and stops: SIGTERM always, plus submitit's signal in its jobs."""
    extra = submitit_signal()
    return [signal.SIGTERM] + ([extra] if extra is not None and extra != signal.SIGTERM else [])


def hand_back_to_submitit() -> bool:
    """After a checkpoint written on a stop signal: let submitit requeue this job (with ``resume=auto``).

    Raises submitit's signal again, now that training's handler is gone; submitit's handler then resubmits
    the job and exits this process (``SystemExit``), so this returns only outside submitit (False)."""
    sig = submitit_signal()
    if sig is None or not callable(signal.getsignal(sig)):
        return False
    log.warning("checkpoint written; asking submitit to requeue this job")
    signal.raise_signal(sig)
    return True


def with_resume_auto(overrides: list[str]) -> list[str]:
    """A job's overrides with any ``resume=...`` replaced by ``resume=auto`` (what a requeued job runs with)."""
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    return [o for o in overrides if key(o) != "resume"] + ["resume=auto"]
