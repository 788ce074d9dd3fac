"""Multirun sweeps: launcher configs (basic, submitit_local, submitit_slurm), the MLflow parent/child structure,
and requeue-on-preemption with resume=auto."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.tolerances import HANG_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent


def _tiny_job_args(model_dir):
    return [f"model.name_or_path={model_dir}", "trainer.max_steps=1", "trainer.prompts_per_step=2",
            "trainer.micro_batch_size=8", "rollout.num_generations=4", "rollout.max_completion_length=8",
            "benchmark.limit=2", "eval.n=2", "eval.max_tokens=8", "trainer.eval_before_training=false",
            "reward.num_workers=0", "trainer.save_final_checkpoint=false", "loss.mask_truncated_completions=false"]


def _runs(db: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("grail_exp")
    return client, (client.search_runs([exp.experiment_id]) if exp else [])


def _with_hydra(overrides, tmp_path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[f"paths.root_dir={tmp_path}", *overrides],
                             return_hydra_config=True)


# ---------------------------------------------------------------------------------------------- configs
def test_slurm_launcher_config_composes_into_a_valid_sbatch_script(tmp_path, monkeypatch):
    """The composed launcher params pass submitit's own validation and give the sbatch flags we rely on."""
    import submitit
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu", "trainer=ddp",  # 8 devices
                       "hydra.launcher.mem_gb=64", "hydra.sweep.dir=/shared/sweep"], tmp_path)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "ResumingSlurmLauncher"
    # SlurmExecutor refuses to start without srun on PATH: a stub is enough to render the script.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    from hydra_plugins.grail_exp_launchers import submission_params

    params = submission_params(dict(launcher.params), [([], cfg)])  # what launch() submits
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    params.pop("submitit_folder")
    base = set(OmegaConf.structured(BaseQueueConf).keys())  # the plugin's own renaming (its launch())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -c pass", "uid")
    # the demo's model (trainer=ddp on 8 ranks): its plan is far below the 600 s floor of the stop signal's lead
    for flag in ("--signal=USR2@600", "--partition=gpu", "--gpus-per-node=8", "--ntasks-per-node=8",
                 "--cpus-per-task=8", "--mem=64GB", "--time=1440", "--nodes=1"):
        assert f"#SBATCH {flag}\n" in script, flag
    assert executor._executor.max_num_timeout == 3
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun.split(), srun  # a task that dies ends the job's other tasks


PAPER_RUNS = [f"experiment=paper/{m}_{s}" for m in ("qwen3_4b", "qwen3_8b", "r1_distill_llama_8b", "octothinker_3b",
                                                      "octothinker_8b") for s in ("grpo", "grail", "oar_g")]


@pytest.mark.parametrize("overrides, shape", [
    *[([run], (1, 4, 4)) for run in PAPER_RUNS],  # the paper trained each run on 4 GPUs of one node
    (["model=qwen3_8b", "advantage=grail"], (1, 4, 4)),  # the card's command
    ([], (1, 1, None)),  # the demo: one CPU process, no GPU requested
    (["trainer=ddp", "trainer.devices=2", "trainer.num_nodes=3"], (3, 2, 2)),
    (["trainer=fsdp_zero2", "trainer.devices=[0,1]"], (1, 2, 2)),  # a list of device ids
])
def test_the_slurm_job_shape_follows_the_trainer(tmp_path, overrides, shape):
    """hydra/launcher=submitit_slurm: --nodes = trainer.num_nodes, --ntasks-per-node and --gpus-per-node =
    trainer.devices (none for a CPU trainer), unless set explicitly."""
    from hydra.utils import instantiate

    from hydra_plugins.grail_exp_launchers import check_slurm_layout

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", *overrides], tmp_path)
    params = instantiate(cfg.hydra.launcher).params
    assert (params["nodes"], params["tasks_per_node"], params["gpus_per_node"]) == shape
    check_slurm_layout(params, cfg)  # what follows the trainer agrees with it


@pytest.mark.parametrize("launcher, keys", [
    (["hydra.launcher.gpus_per_node=1"], ["hydra.launcher.gpus_per_node = 1", "trainer.devices = 4"]),
    (["hydra.launcher.tasks_per_node=1", "hydra.launcher.gpus_per_node=1"],
     ["hydra.launcher.tasks_per_node = 1", "hydra.launcher.gpus_per_node = 1", "trainer.devices = 4"]),
    (["hydra.launcher.nodes=2"], ["hydra.launcher.nodes = 2", "trainer.num_nodes = 1"]),
])
def test_a_slurm_shape_that_disagrees_with_the_trainer_names_both_keys(tmp_path, launcher, keys):
    from hydra.utils import instantiate

    from grail_exp.errors import ConfigError
    from hydra_plugins.grail_exp_launchers import check_slurm_layout

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", "model=qwen3_8b", "advantage=grail", *launcher], tmp_path)
    with pytest.raises(ConfigError) as err:
        check_slurm_layout(instantiate(cfg.hydra.launcher).params, cfg)
    assert all(k in str(err.value) for k in keys), str(err.value)
    # stated alike, or GPUs asked for through gres (gpus_per_node null), it passes
    for same in (["hydra.launcher.gpus_per_node=4", "hydra.launcher.tasks_per_node=4"],
                 ["hydra.launcher.gpus_per_node=null", "hydra.launcher.gres=gpu:4"]):
        cfg = _with_hydra(["hydra/launcher=submitit_slurm", "model=qwen3_8b", "advantage=grail", *same], tmp_path)
        check_slurm_layout(instantiate(cfg.hydra.launcher).params, cfg)


CARD = ["model=qwen3_8b", "advantage=grail", "reward.num_workers=2"]
CARD_MEM_GB = 46  # tests/test_plan.py: ceil(1.1 x (5 N + 3.6 GiB)) for Qwen3-8B on 4 ranks of one node (the load)


def test_slurm_mem_follows_the_host_memory_plan_unless_set(tmp_path):
    """hydra.launcher.mem_gb unset (null): --mem is the card's planned host memory per node; a sweep gets its largest
    job's; a value at or above the plan is kept."""
    from hydra.utils import instantiate

    from hydra_plugins.grail_exp_launchers import slurm_mem_gb

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", *CARD], tmp_path)
    params = instantiate(cfg.hydra.launcher).params
    assert params["mem_gb"] is None
    assert slurm_mem_gb(params, [(CARD, cfg)]) == CARD_MEM_GB
    demo = _with_hydra(["hydra/launcher=submitit_slurm"], tmp_path)
    assert slurm_mem_gb(params, [([], demo), (CARD, cfg)]) == CARD_MEM_GB
    set_cfg = _with_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.mem_gb=200", *CARD], tmp_path)
    assert slurm_mem_gb(instantiate(set_cfg.hydra.launcher).params, [(CARD, set_cfg)]) == 200


def test_a_slurm_mem_below_the_plan_is_refused_naming_both_numbers(tmp_path):
    from hydra.utils import instantiate

    from grail_exp.errors import ConfigError
    from hydra_plugins.grail_exp_launchers import slurm_mem_gb

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.mem_gb=32", *CARD], tmp_path)
    with pytest.raises(ConfigError) as err:
        slurm_mem_gb(instantiate(cfg.hydra.launcher).params, [(CARD, cfg)])
    assert "hydra.launcher.mem_gb = 32" in str(err.value) and f"{CARD_MEM_GB} GB" in str(err.value), str(err.value)


# The card's stop lead by hand (grail_exp/timeouts.py's rule written out): 4 ranks, 32 prompts x 8 completions = 64 rows
# per rank of 512 (DeepMath's planned prompt) + 4096 completion tokens; the longest a stop waits for is the rollout (the
# generation and the old log-probs: 2 passes; beta = 0, no reference) and one optimiser step over the whole batch (k = 1:
# forward + backward = 3 passes, + 1 forward replayed under gradient checkpointing), 2 x N FLOPs per token and pass at
# 100 TFLOP/s: 2 x 8,190,735,360 x 64 x 4,608 x 6 / 1e14 = 289.9 s. The checkpoint: 16 B x N = 131.05 GB at 100 MB/s =
# 1,310.5 s. Lead: 2 x (289.9 + 1,310.5) = 3,200.9 s, in whole minutes: 3,240 s (54 min).
CARD_STOP_LEAD_S = 3240


def test_the_stop_signal_comes_as_early_as_the_plan_needs(tmp_path, caplog):
    """hydra.launcher.signal_delay_s 0 (the default): USR2 comes the card's planned step + checkpoint write (x 2) before
    the time limit (the fixed 600 s before let SLURM kill the card mid-checkpoint); a small model keeps the 600 s floor;
    a sweep gets its largest job's lead; a value set by hand is kept, and warned about when below the plan."""
    import logging

    from hydra.utils import instantiate

    from hydra_plugins.grail_exp_launchers import slurm_signal_delay

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", *CARD], tmp_path)
    assert cfg.loss.beta == 0 and cfg.trainer.devices == 4 and cfg.trainer.mini_batches_per_rollout == 1
    assert cfg.rollout.max_completion_length == 4096 and cfg.model.gradient_checkpointing and cfg.data.name == "deepmath"
    assert cfg.trainer.prompts_per_step * cfg.rollout.num_generations == 4 * 64
    params = instantiate(cfg.hydra.launcher).params
    assert params["signal_delay_s"] == 0
    assert slurm_signal_delay(params, [(CARD, cfg)]) == CARD_STOP_LEAD_S
    demo = _with_hydra(["hydra/launcher=submitit_slurm"], tmp_path)
    assert slurm_signal_delay(params, [([], demo)]) == 600
    assert slurm_signal_delay(params, [([], demo), (CARD, cfg)]) == CARD_STOP_LEAD_S
    with caplog.at_level(logging.WARNING):
        assert slurm_signal_delay(dict(params, signal_delay_s=900), [(CARD, cfg)]) == 900
    assert any("signal_delay_s = 900 is below the 3240 s" in r.getMessage() for r in caplog.records)


def test_a_time_limit_within_the_stop_lead_is_refused_naming_the_keys(tmp_path):
    from hydra.utils import instantiate

    from grail_exp.errors import ConfigError
    from hydra_plugins.grail_exp_launchers import slurm_signal_delay

    cfg = _with_hydra(["hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=50", *CARD], tmp_path)
    with pytest.raises(ConfigError) as err:
        slurm_signal_delay(instantiate(cfg.hydra.launcher).params, [(CARD, cfg)])
    msg = str(err.value)
    assert "hydra.launcher.timeout_min = 50 (3000 s)" in msg and "3240 s" in msg and "above 54" in msg, msg
    assert slurm_signal_delay(dict(instantiate(cfg.hydra.launcher).params, timeout_min=55), [(CARD, cfg)]) == 3240


@pytest.mark.e2e
def test_a_slurm_mem_below_the_plan_is_refused_before_submission(tmp_path):
    """The real launcher: `-m hydra/launcher=submitit_slurm hydra.launcher.mem_gb=32` on the card exits 2 with one line
    naming both numbers, and nothing was submitted."""
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "grail_exp.run", "-m", "hydra/launcher=submitit_slurm",
                          "hydra.launcher.mem_gb=32", *CARD, f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}"],
                         env=dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db"),
                         capture_output=True, text=True, timeout=HANG_TIMEOUT_S, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "hydra.launcher.mem_gb = 32" in line and f"{CARD_MEM_GB} GB" in line, line
    assert not list(sweep.rglob(".submitit"))


@pytest.mark.e2e
def test_a_mismatched_slurm_sweep_is_refused_before_submission(tmp_path):
    """The real launcher, end to end: `-m hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1` on the card's
    command exits 2 with one line naming both keys, and nothing was submitted (no submitit folder, no sbatch)."""
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "grail_exp.run", "-m", "hydra/launcher=submitit_slurm",
                          "hydra.launcher.gpus_per_node=1", "model=qwen3_8b", "advantage=grail",
                          f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}"],
                         env=dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db"),
                         capture_output=True, text=True, timeout=HANG_TIMEOUT_S, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "hydra.launcher.gpus_per_node = 1" in line and "trainer.devices = 4" in line
    assert "Traceback" not in out.stderr
    assert not list(sweep.rglob(".submitit"))


def test_local_launcher_config_composes(tmp_path):
    from hydra.utils import instantiate

    cfg = _with_hydra(["hydra/launcher=submitit_local"], tmp_path)
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "ResumingLocalLauncher"
    assert launcher.params["timeout_min"] == 60 and launcher.params["tasks_per_node"] == 1
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == ["resume"]
    assert "mlflow_parent_run" in cfg.hydra.callbacks


def test_a_requeued_job_runs_with_resume_auto(tmp_path):
    """submitit calls the launcher's checkpoint() with __call__'s arguments; the resubmission adds resume=auto."""
    from hydra.utils import instantiate

    from grail_exp.preemption import with_resume_auto

    assert with_resume_auto(["seed=1", "advantage=grail"]) == ["seed=1", "advantage=grail", "resume=auto"]
    assert with_resume_auto(["resume=/x/step-4", "+resume=null", "seed=1"]) == ["seed=1", "resume=auto"]
    launcher = instantiate(_with_hydra(["hydra/launcher=submitit_local"], tmp_path).hydra.launcher)
    resubmission = launcher.checkpoint(["seed=3"], "hydra.sweep.dir", 5, "job_id_for_5", {})
    assert resubmission.function is launcher
    assert resubmission.args == (["seed=3", "resume=auto"], "hydra.sweep.dir", 5, "job_id_for_5", {})


def test_stop_signals_include_submitits_only_in_its_jobs(monkeypatch):
    from grail_exp.preemption import hand_back_to_submitit, stop_signals

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert stop_signals() == [signal.SIGTERM, signal.SIGINT]
    assert hand_back_to_submitit() is False  # outside submitit: nothing to hand back
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert stop_signals() == [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2]
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert stop_signals() == [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1]
    # inside a job, the signal goes back to whatever handler submitit installed
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        assert hand_back_to_submitit() is True and got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.e2e
def test_every_run_is_tagged_with_what_ran_and_the_code(compose_cfg):
    import socket

    from grail_exp.tracking import code_tags, run_tags

    tags = run_tags(compose_cfg(["advantage=oar_g", "seed=7", "model=tiny_llama"]))
    assert (tags["model"], tags["scheme"], tags["seed"], tags["host"]) == ("tiny_llama", "oar_g", "7", socket.gethostname())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    assert tags["git.commit"] == head == tags["mlflow.source.git.commit"] and tags["git.dirty"] == str(dirty).lower()
    import torch
    import transformers

    assert tags["version.torch"] == torch.__version__ and tags["version.transformers"] == transformers.__version__
    assert "version.grail_exp" in tags and code_tags() is code_tags()  # computed once per process


# ---------------------------------------------------------------------------------------------- multiruns
@pytest.mark.e2e
def test_basic_multirun_is_one_parent_run_with_a_tagged_child_per_job(tmp_path, tiny_model_dir):
    """`python -m grail_exp.run -m advantage=grpo,grail seed=1,2 debug=fast ...` (the basic launcher)."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", "-m", "advantage=grpo,grail", "seed=1,2",
                           "debug=fast", f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}",
                           *_tiny_job_args(tiny_model_dir)], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = _runs(tmp_path / "results" / "mlflow.db")
    parents = [r for r in runs if r.data.tags.get("grail_exp.role") == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert (sweep / "mlflow_parent_run.json").is_file()
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.dir"] == str(sweep)
    assert parent.data.tags["sweep.launcher"] == "basic" and "advantage=grpo,grail" in parent.data.tags["sweep.overrides"]
    assert parent.data.tags["sweep.jobs"] == "4" and parent.data.tags["sweep.jobs_finished"] == "4"
    children = [r for r in runs if r is not parent]
    assert len(children) == 4 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    assert sorted((r.data.tags["scheme"], r.data.tags["seed"]) for r in children) == [
        ("grail", "1"), ("grail", "2"), ("grpo", "1"), ("grpo", "2")]
    for r in children:
        assert r.info.status == "FINISHED" and r.data.tags["model"] == "tiny"
        assert r.data.tags["git.commit"] == parent.data.tags["git.commit"] and r.data.tags["host"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]


@pytest.mark.e2e
@pytest.mark.slow
def test_submitit_local_multirun_of_two_jobs(tmp_path, tiny_model_dir):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", "-m", "hydra/launcher=submitit_local",
                           "advantage=grpo,grail", f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}",
                           *_tiny_job_args(tiny_model_dir)], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client, runs = _runs(tmp_path / "results" / "mlflow.db")
    (parent,) = [r for r in runs if r.data.tags.get("grail_exp.role") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["scheme"] for r in children) == ["grail", "grpo"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert parent.data.tags["sweep.launcher"] == "submitit_local"
    assert all((sweep / n / "metrics.json").is_file() for n in ("0", "1"))
    assert len(list((sweep / ".submitit").glob("*/*_0_log.out"))) == 2  # each job ran in its own process


def _children_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.mark.e2e
@pytest.mark.slow
def test_submitit_local_job_preempted_checkpoints_and_is_requeued_with_resume_auto(tmp_path, tiny_model_dir):
    """USR2 (what SLURM sends before the time limit or on preemption) mid-training: the job finishes its step,
    checkpoints, and submitit restarts it with resume=auto in the same run directory and MLflow run."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "grail_exp.run", "-m", "hydra/launcher=submitit_local", "advantage=grpo",
            f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={sweep}", *_tiny_job_args(tiny_model_dir),
            "trainer.max_steps=30", "trainer.log_every=1"]
    launcher = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = tmp_path / "results" / "mlflow.db"
    deadline, task = time.time() + HANG_TIMEOUT_S, None
    while task is None:  # wait until the job has logged two optimiser steps, then find its process
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.5)
        try:
            client, runs = _runs(db)
            child = [r for r in runs if r.data.tags.get("grail_exp.role") != "sweep"]
            if not child or len(client.get_metric_history(child[0].info.run_id, "loss")) < 2:
                continue
        except Exception:
            continue
        controllers = [int(p.name) for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
        tasks = [c for pid in controllers for c in _children_pids(pid)]
        task = tasks[0] if len(tasks) == 1 else None
    os.kill(task, signal.SIGUSR2)
    assert launcher.wait(timeout=HANG_TIMEOUT_S) == 0

    client, runs = _runs(db)
    (parent,) = [r for r in runs if r.data.tags.get("grail_exp.role") == "sweep"]
    (run,) = [r for r in runs if r is not parent]  # the requeued job continued the same MLflow run
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    resumed = [k for k in run.data.tags if k.startswith("resumed_at_step_")]
    assert len(resumed) == 1
    stopped_at = int(resumed[0].rsplit("_", 1)[1])
    assert 2 <= stopped_at < 30
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, 31))  # no step lost, none trained twice
    (log_out,) = (sweep / ".submitit").glob("*/*_0_log.out")
    text = log_out.read_text() + log_out.with_name(log_out.name.replace(".out", ".err")).read_text()
    assert "resume=auto" in text and "resuming from" in text and "step-" + str(stopped_at) in text
    assert (sweep / "0" / "checkpoints" / f"step-{stopped_at}").is_dir()


@pytest.mark.e2e
def test_paper_table_cpu_script_queues_model_seed_groups_over_lanes(tmp_path):
    """`LANES=2 bash sweeps/paper_table.sh --cpu <overrides>`: one multirun per (model, seed) with that seed's
    warm start and arms, single-threaded lanes, the caller's overrides intact, then the report with the study's
    plan. The interpreter is a recorder (the real runs are the study itself, hours)."""
    import shutil
    import uuid

    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "{calls}/$$"; printf "%s\\n" ---- >> "{calls}/$$"\n')
    fake.chmod(0o755)
    calls.mkdir()
    study = f"pytest-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PY": str(fake), "STUDY": study, "LANES": "2"}
    try:
        done = subprocess.run(["bash", "sweeps/paper_table.sh", "--cpu", "trainer.max_steps=2", "+x=a b"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    finally:
        shutil.rmtree(ROOT / "outputs" / "paper_table_cpu" / study, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    argvs = [f.read_text().split("\n----\n")[0].split("\n") for f in calls.iterdir()]
    runs = sorted((a for a in argvs if a[1] == "grail_exp.run"), key=lambda a: (a[3], a[5]))
    groups = [(a[3], a[4], a[5]) for a in runs]
    assert groups == [("model=tiny", "advantage=grpo,grail,oar_g", f"seed={s}") for s in range(1, 6)] + [
        ("model=tiny_llama", "advantage=grpo,grail", f"seed={s}") for s in range(1, 4)]
    for a in runs:
        assert a[2] == "-m" and "model.build.seed=${seed}" in a and "trainer.num_threads=1" in a
        assert f"+logger.tags.study={study}" in a and a[-2:] == ["trainer.max_steps=2", "+x=a b"]
    (report,) = [a for a in argvs if a[1] == "grail_exp.report"]
    assert "+design.tiny_llama={schemes: [grpo, grail], seeds: [1, 2, 3]}" in report
    assert "seeds=[1,2,3,4,5]" in report and f"output.name={study}" in report
    assert done.stdout.count("done: ") == 8
