"""Submitit launchers that requeue a preempted or timed-out job with ``resume=auto`` (a Hydra plugin).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace package, hence this location (listed
in pyproject's packages, so a wheel carries it). Configs: conf/hydra/launcher/submitit_{slurm,local}.yaml.

``hydra/launcher=submitit_slurm`` (or ``submitit_local``) runs each multirun job through submitit. Before the
time limit (``signal_delay_s`` seconds) and on preemption, SLURM sends the job ``USR2`` (submitit's
preemption signal; ``SUBMITIT_PREEMPT_SIGNAL`` changes it). What happens then:

1. ``grail_exp.run`` catches the signal during training (``preemption.stop_signals``), finishes the current optimiser
   step, writes a checkpoint into the job's run directory and raises ``Preempted``;
2. the sweep task wrapper hands the signal back to submitit (``preemption.hand_back_to_submitit``), whose handler calls
   the launcher's ``checkpoint`` below and requeues the job (``scontrol requeue``; locally, exit code 144
   makes the local controller restart it);
3. the requeued job is the same Hydra job (same overrides, ``hydra.job.num`` and sweep directory, so the same
   run directory) plus ``resume=auto``: it continues from the latest complete checkpoint, into the same MLflow
   run. A signal that arrives outside training (model build, evaluation) requeues at once, without a
   checkpoint: the job then restarts from its last checkpoint, or from scratch if it has none.

The Hydra sweep directory is resolved once in the launching process and pickled with the launcher, so a
requeued job never re-evaluates ``${now:...}``; ``resume`` is excluded from ``hydra.job.override_dirname``
(conf/hydra/default.yaml) so that a sub-directory named after the overrides does not change either.
"""

from __future__ import annotations

import logging
from typing import Any

from grail_exp.preemption import with_resume_auto

log = logging.getLogger(__name__)

try:  # the `slurm` extra; without it Hydra's plugin scan must still import this module
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # pragma: no cover - exercised only without hydra-submitit-launcher
    LocalLauncher = SlurmLauncher = None


class _ResumeOnRequeue:
    """Mixin for the plugin's launchers: submitit calls ``checkpoint`` with the arguments of ``__call__`` when
    it requeues a job; the resubmitted call is the same job plus ``resume=auto``."""

    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        overrides = with_resume_auto(list(sweep_overrides))
        log.warning("requeueing this job with resume=auto (overrides: %s)", " ".join(overrides))
        return super().checkpoint(overrides, *args, **kwargs)  # type: ignore[misc]


if SlurmLauncher is not None:
    class ResumingSlurmLauncher(_ResumeOnRequeue, SlurmLauncher):
        pass

    class ResumingLocalLauncher(_ResumeOnRequeue, LocalLauncher):
        pass
