"""``python -m grail_exp.run``: validate → build → train → evaluate → return the objective.

    python -m grail_exp.run                                   # embedded default, a few minutes on a CPU
    python -m grail_exp.run advantage=grpo trainer.max_steps=2
    python -m grail_exp.run model=qwen3_8b advantage=grail    # a paper model: its paper recipe, on a GPU node

The return value is ``optimized_metric`` of the final evaluation (e.g. ``eval/arithmetic/acc``), so
Hydra sweepers and Optuna can optimise it. The job itself is ``grail_exp.job``.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import register_configs
from grail_exp.job import default_run_name, run, train  # noqa: F401  (the library API, re-exported)

log = logging.getLogger("grail_exp")
register_configs()
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; harmless, and noise in every run's output.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from grail_exp.errors import Preempted, StoppedBySignal, exit_on_user_error
    from grail_exp.preemption import exit_now

    if _is_multirun():
        # Task wrapper: in a sweep one failed job is recorded (MLflow status FAILED + traceback artifact,
        # logged by train()) and the sweep goes on; the objective of a failed job is NaN.
        try:
            return run(cfg)
        except (Preempted, StoppedBySignal) as exc:
            from grail_exp.preemption import hand_back_to_submitit

            hand_back_to_submitit()  # in a submitit job: requeued with resume=auto; this process exits here
            # Outside submitit every job runs in this process: a stop signal stops the whole multirun (a stopped
            # study), not just this job. The same command with resume=auto continues it from this checkpoint.
            sys.exit(stopped(exc, cfg, multirun=True))
        except Exception as exc:
            log.error("job failed (the sweep continues): %s: %s", type(exc).__name__, exc)
            return math.nan
    try:
        with exit_on_user_error():
            return run(cfg)
    except (Preempted, StoppedBySignal) as exc:
        exit_now(stopped(exc, cfg))


def stopped(exc: BaseException, cfg: DictConfig, multirun: bool = False) -> int:
    """The one line of a job a stop signal ended, on stderr, and its exit code (128 + the signal: 143 SIGTERM, 130
    SIGINT). Before training: what it was doing. After a step: the step, the checkpoint ``resume=auto`` continues
    from, and the command that does."""
    from grail_exp.errors import Preempted
    from grail_exp.preemption import before_training_line, exit_code, launcher_speaks, signal_name

    if launcher_speaks():  # a rank that Lightning's launcher started beside itself: the launcher prints the line
        return exit_code(exc.signum)
    if not isinstance(exc, Preempted):
        print(before_training_line(exc.signum, exc.stage), file=sys.stderr, flush=True)
        return exit_code(exc.signum)
    from grail_exp.checkpoint import latest_checkpoint

    run_dir = cfg.paths.output_dir
    ckpt = latest_checkpoint(Path(run_dir) / "checkpoints")
    name = signal_name(exc.signum) + ("" if exc.here else " on another rank")
    what = "interrupted" if exc.signum == signal.SIGINT else "preempted"
    again = f"python -m grail_exp.run <same overrides> hydra.run.dir={run_dir} resume=auto"
    if multirun:
        again = ("the multirun stops after this job's checkpoint; rerun the same command with resume=auto (same "
                 "hydra.sweep.dir) to continue it")
    print(f"{what} at step {exc.step} ({name}): checkpoint {ckpt}; to go on: {again}", file=sys.stderr, flush=True)
    return exit_code(exc.signum)


if __name__ == "__main__":
    main()
