"""Submitit launchers that requeue a preempted or timed-out job with ``resume=auto`` (a Hydra plugin).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace package, hence this location (listed
in pyproject's packages, so a wheel carries it). Configs: conf/hydra/launcher/submitit_{slurm,local}.yaml.

``hydra/launcher=submitit_slurm`` (or ``submitit_local``) runs each multirun job through submitit. Before the
time limit (``signal_delay_s`` seconds; 0, the default, = what the plan says a stop needs: ``slurm_signal_delay``) and
on preemption, SLURM sends the job ``USR2`` (submitit's preemption signal; ``SUBMITIT_PREEMPT_SIGNAL`` changes it).
What happens then:

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
else (``check_slurm_layout``). Its ``--mem`` follows the memory planner's host memory per node (``slurm_mem_gb``) unless
``hydra.launcher.mem_gb`` is set; a set value below the plan is refused before submission, naming both numbers. srun
runs the tasks with ``--kill-on-bad-exit=1`` (``srun_args``): a task that dies (a crash, the OOM killer) ends the job's
other tasks at once instead of leaving them in a collective until the process group's timeout.

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


def slurm_mem_gb(params: dict, jobs: list) -> int | None:
    """The ``--mem`` (GB per node) for a sweep's jobs ``[(overrides, composed config), ...]``: the largest of their
    memory plans' host memory per node (``memory.planned_mem_gb``: the plan + its margin) when ``hydra.launcher.mem_gb``
    is unset (null), the value set otherwise. A set value below a job's plan is refused before submission, naming both
    numbers; memory asked for per GPU or per CPU (``mem_per_gpu`` / ``mem_per_cpu``) is left as it is (None)."""
    from grail_exp.errors import ConfigError
    from grail_exp.memory import planned_mem_gb

    if params.get("mem_per_gpu") is not None or params.get("mem_per_cpu") is not None:
        return params.get("mem_gb")
    planned = [(planned_mem_gb(cfg), list(overrides)) for overrides, cfg in jobs]
    planned = [(gb, o) for gb, o in planned if gb is not None]
    if not planned:
        return params.get("mem_gb")
    need, overrides = max(planned, key=lambda x: x[0])
    set_gb = params.get("mem_gb")
    if set_gb is None:
        return need
    if int(set_gb) < need:
        job = f" (job overrides: {' '.join(overrides)})" if overrides else ""
        raise ConfigError(f"hydra.launcher.mem_gb = {set_gb} is below the {need} GB of host memory per node the memory "
                          f"plan needs{job}: leave it unset (it follows the plan) or set at least {need}. Details: "
                          "python -m grail_exp.plan <the same overrides>")
    return int(set_gb)


KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"


def srun_args(params: dict) -> list[str]:
    """srun's arguments for the job's tasks: any the launcher was given, plus ``--kill-on-bad-exit=1`` unless they say
    otherwise. A rank that exits non-zero outside the points where the ranks agree on a failure (a crash, an OOM kill,
    a lost node) would otherwise leave every other rank of the job waiting in its next collective until the process
    group's timeout (44 minutes for an 8B model), holding the nodes; SLURM then ends them at once."""
    args = list(params.get("srun_args") or [])
    if not any(a == "-K" or a.startswith("--kill-on-bad-exit") for a in args):
        args.append(KILL_ON_BAD_EXIT)
    return args


def slurm_signal_delay(params: dict, jobs: list) -> int:
    """``--signal=USR2@<seconds>`` for a sweep's jobs ``[(overrides, composed config), ...]``: with
    ``hydra.launcher.signal_delay_s`` 0 (the default), the largest of their planned stop leads (``memory.stop_lead``:
    the longest step a stop waits for plus the checkpoint write, with margin; at least 600 s); a set value is kept (a
    value below the plan is warned about: storage faster than the plan's assumes makes it right). Refused before
    submission, naming both keys, when the lead would leave the job no time before its stop signal."""
    from grail_exp.errors import ConfigError
    from grail_exp.memory import stop_lead

    planned = [(stop_lead(cfg), list(overrides)) for overrides, cfg in jobs]
    (need, how), overrides = max(planned, key=lambda x: x[0][0]) if planned else ((0, ""), [])
    set_s = int(params.get("signal_delay_s") or 0)
    lead = set_s or need
    job = f" (job overrides: {' '.join(overrides)})" if overrides else ""
    if set_s and set_s < need:
        log.warning("hydra.launcher.signal_delay_s = %d is below the %d s the plan gives a stop to finish its step and "
                    "write its checkpoint%s: %s; the job may be killed mid-checkpoint unless its storage is faster",
                    set_s, need, job, how)
    limit = 60 * int(params.get("timeout_min") or 0)
    if limit and lead >= limit:
        raise ConfigError(f"hydra.launcher.timeout_min = {params.get('timeout_min')} ({limit} s) is not longer than the "
                          f"stop signal's lead of {lead} s (hydra.launcher.signal_delay_s = {set_s}"
                          f"{'' if set_s else ': the plan, ' + how}){job}: the job would be stopped as it starts. "
                          f"Raise hydra.launcher.timeout_min above {-(-lead // 60)}")
    return lead


def submission_params(params: dict, jobs: list) -> dict:
    """The launcher's values as submitted for a sweep's jobs ``[(overrides, composed config), ...]`` (one array job):
    ``--mem`` and the stop signal's lead from the largest plan, srun's arguments."""
    out = dict(params, mem_gb=slurm_mem_gb(params, jobs), signal_delay_s=slurm_signal_delay(params, jobs))
    out["srun_args"] = srun_args(out)
    return out


if SlurmLauncher is not None:
    class ResumingSlurmLauncher(_ResumeOnRequeue, SlurmLauncher):
        def launch(self, job_overrides, initial_job_idx):
            from grail_exp.errors import exit_on_user_error

            # Before anything reaches sbatch: every job's composed trainer against the one set of launcher values
            # (one line on stderr, exit 2, as every user error of the entry points).
            with exit_on_user_error():
                jobs = []
                for overrides in job_overrides:
                    job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                    check_slurm_layout(self.params, job_cfg, list(overrides))
                    jobs.append((overrides, job_cfg))
                self.params = submission_params(self.params, jobs)  # one array job: the largest plan
            return super().launch(job_overrides, initial_job_idx)

    class ResumingLocalLauncher(_ResumeOnRequeue, LocalLauncher):
        pass
