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

``hydra/launcher=submitit_slurm`` sizes each job from its trainer (nodes = ``trainer.num_nodes``, tasks and GPUs per
node = ``trainer.devices``) and refuses, before submitting anything, a job whose launcher values were set to something
else (``check_slurm_layout``).

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


def check_slurm_layout(params: dict, job_cfg, overrides: list[str] = ()) -> None:
    """Refuse a SLURM job whose shape disagrees with its trainer, naming both keys: ``hydra.launcher.nodes`` vs
    ``trainer.num_nodes``, ``tasks_per_node`` vs ``trainer.devices`` (Lightning runs one task per rank) and, for a GPU
    trainer, ``gpus_per_node`` vs ``trainer.devices`` (null = GPUs requested another way, e.g. ``gres``). The launcher
    values follow the trainer by default (conf/hydra/launcher/submitit_slurm.yaml); a mismatch was set explicitly, or
    a sweep varies the trainer's shape, which one launcher cannot follow."""
    from grail_exp.errors import ConfigError
    from grail_exp.world import devices_per_node

    t = job_cfg.trainer
    devices, nodes = devices_per_node(t.devices), int(t.get("num_nodes", 1) or 1)
    wrong = []
    if int(params.get("nodes") or 1) != nodes:
        wrong.append(f"hydra.launcher.nodes = {params.get('nodes')} but trainer.num_nodes = {nodes}")
    if int(params.get("tasks_per_node") or 1) != devices:
        wrong.append(f"hydra.launcher.tasks_per_node = {params.get('tasks_per_node')} but trainer.devices = {t.devices} "
                     f"(Lightning runs one task per rank)")
    gpus = params.get("gpus_per_node")
    if str(t.accelerator) != "cpu" and gpus is not None and int(gpus) != devices:
        wrong.append(f"hydra.launcher.gpus_per_node = {gpus} but trainer.devices = {t.devices}")
    if wrong:
        job = f" (job overrides: {' '.join(overrides)})" if overrides else ""
        raise ConfigError("the SLURM job's shape disagrees with its trainer" + job + ": " + "; ".join(wrong)
                          + ". Leave the launcher keys unset (they follow the trainer) or set both sides alike")


if SlurmLauncher is not None:
    class ResumingSlurmLauncher(_ResumeOnRequeue, SlurmLauncher):
        def launch(self, job_overrides, initial_job_idx):
            from grail_exp.errors import exit_on_user_error

            # Before anything reaches sbatch: every job's composed trainer against the one set of launcher values
            # (one line on stderr, exit 2, as every user error of the entry points).
            with exit_on_user_error():
                for overrides in job_overrides:
                    job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                    check_slurm_layout(self.params, job_cfg, list(overrides))
            return super().launch(job_overrides, initial_job_idx)

    class ResumingLocalLauncher(_ResumeOnRequeue, LocalLauncher):
        pass
