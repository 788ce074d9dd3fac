"""Checkpointing, exact resume and fault tolerance (SIGKILL mid-write, SIGTERM, failing sweep jobs)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from grail_exp.checkpoint import complete_checkpoints, load_rank_state, load_training_state
from helpers.compose import compose
from helpers.fakes import AlternatingVerifier
from helpers.states import states_equal
from helpers.tolerances import HANG_TIMEOUT_S


def _cfg(run_dir: Path, model_dir, extra=()):
    return compose([f"model.name_or_path={model_dir}", f"paths.output_dir={run_dir}", "trainer.prompts_per_step=4",
                    "trainer.micro_batch_size=16", "rollout.num_generations=4", "rollout.max_completion_length=40",
                    "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                    *extra], run_dir.parent)




@pytest.mark.parametrize("scheme, mu, first_leg, k, extra", [
    ("grpo", 1, 2, 1, []), ("grail", 1, 2, 1, []), ("grail", 2, 1, 1, []), ("grpo", 2, 3, 2, []),
    ("grpo", 1, 3, 2, ["optim.schedule_unit=rollout_batch", "optim.warmup_steps=3"]),
    ("grail", 1, 1, 2, ["advantage.recompute=per_rollout"]),
    pytest.param("oar_g", 1, 2, 1, [], marks=pytest.mark.slow)])
def test_four_steps_equal_two_plus_resume_plus_two(tmp_path, formatted_model_dir, monkeypatch, scheme, mu, first_leg,
                                                   k, extra):
    """Bit-identical parameters and optimiser state; (grail, mu=2, 1) resumes mid-rollout-batch from the buffer, (grpo,
    mu=2, 3, k=2) in the second epoch's second mini-batch; the rollout-batch lr schedule mid-batch (its warmup factor
    1/3 held over the batch's second step); per_rollout weights of the second mini-batch, computed before the first
    step, carried by the buffer."""
    import grail_exp.grading.rewards
    from grail_exp.run import run

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    common = [f"advantage={scheme}", f"loss.num_iterations={mu}", "logger=none", f"trainer.mini_batches_per_rollout={k}",
              *extra]
    if scheme == "grail":
        common.append("advantage.symmetry=both")
    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    run(_cfg(straight, formatted_model_dir, [*common, "trainer.max_steps=4"]))
    run(_cfg(split, formatted_model_dir, [*common, f"trainer.max_steps={first_leg}"]))
    run(_cfg(split, formatted_model_dir, [*common, "trainer.max_steps=4", "resume=auto"]))

    a, b = straight / "checkpoints" / "step-4", split / "checkpoints" / "step-4"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = load_training_state(a), load_training_state(b)
    assert states_equal(sa["optimizer"], sb["optimizer"]) and states_equal(sa["scheduler"], sb["scheduler"])
    assert sa["step"] == sb["step"] == 4 and sa["round"] == sb["round"]
    ra, rb = load_rank_state(a, 0), load_rank_state(b, 0)
    assert states_equal(ra["rng"]["torch"], rb["rng"]["torch"])
    start = load_file(Path(formatted_model_dir) / "model.safetensors")
    assert any(not torch.equal(start[k], wa[k]) for k in wa)  # training really changed the weights


def test_checkpoint_is_a_loadable_hf_model_and_state_is_weights_only(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grail_exp.run import run

    run_dir = tmp_path / "r" / "run"
    run(_cfg(run_dir, tiny_model_dir, ["logger=none", "trainer.max_steps=3", "trainer.checkpoint_every=1",
                                       "trainer.keep_last_checkpoints=2", "loss.mask_truncated_completions=false"]))
    ckpts = complete_checkpoints(run_dir / "checkpoints")
    assert [c.name for c in ckpts] == ["step-2", "step-3"]  # keep_last pruning
    AutoModelForCausalLM.from_pretrained(ckpts[-1], use_safetensors=True)
    AutoTokenizer.from_pretrained(ckpts[-1])
    torch.load(ckpts[-1] / "training_state.pt", weights_only=True)  # no pickled code
    assert not list((run_dir / "checkpoints").glob("*.tmp-*"))


def _run_cli(args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "grail_exp.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}, **kw)


def _cli_args(run_dir, model_dir, tmp_path, extra=()):
    return [f"model.name_or_path={model_dir}", f"hydra.run.dir={run_dir}", f"paths.root_dir={tmp_path}",
            "trainer.prompts_per_step=2", "trainer.micro_batch_size=8", "rollout.num_generations=4",
            "rollout.max_completion_length=16", "trainer.eval_before_training=false", "benchmark.limit=4", "eval.n=2",
            "advantage=grpo", "loss.mask_truncated_completions=false", *extra]


@pytest.mark.e2e
def test_sigkill_during_checkpoint_write_then_resume_auto(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    args = _cli_args(run_dir, tiny_model_dir, tmp_path, ["trainer.max_steps=3", "trainer.checkpoint_every=1"])
    proc = _run_cli(args, env={"GRAIL_EXP_FAULT": "stall_checkpoint:2"})
    deadline = time.time() + HANG_TIMEOUT_S
    while not list((run_dir / "checkpoints").glob("step-2.tmp-*")):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "the stalled checkpoint never appeared"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_TIMEOUT_S)
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")] == ["step-1"]

    proc = _run_cli(args + ["resume=auto"])
    out = proc.communicate(timeout=HANG_TIMEOUT_S)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "resuming from" in out and "step-1" in out
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")][-1] == "step-3"
    assert not list((run_dir / "checkpoints").glob("*.tmp-*"))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("grail_exp").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # the same MLflow run continued
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert steps[-1] == 3 and 1 in steps


@pytest.mark.e2e
def test_killed_in_the_final_evaluation_then_resume_auto_evaluates_and_finishes(tmp_path, tiny_model_dir):
    """Stopped after its last step, in the final evaluation: the restarted run trains nothing, evaluates from the
    completion cache and writes the final evaluation (a study records its arm from it)."""
    run_dir = tmp_path / "run"
    args = _cli_args(run_dir, tiny_model_dir, tmp_path, ["trainer.max_steps=2", "trainer.checkpoint_every=1",
                                                         "eval.batch_size=4", "eval.max_tokens=16",
                                                         "trainer.eval_cache=true"])
    killed = _run_cli(args, env={"GRAIL_EXP_FAULT": "kill_eval_after_chunks:1"})
    out = killed.communicate(timeout=HANG_TIMEOUT_S)[0]
    assert killed.returncode == -signal.SIGKILL and "GRAIL_EXP_FAULT: killing this process after 1" in out, out[-3000:]
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")][-1] == "step-2"
    assert not (run_dir / "eval" / "final" / "summary.json").exists()

    resumed = _run_cli(args + ["resume=auto"])
    out = resumed.communicate(timeout=HANG_TIMEOUT_S)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert (run_dir / "eval" / "final" / "summary.json").is_file()
    assert "only the closing (final checkpoint and evaluation) is left" in out
    assert "step 3" not in out and "step 1/2" not in out  # nothing trained again
    assert len(pd.read_parquet(run_dir / "eval" / "final" / "samples.parquet")) == 4 * 2  # benchmark.limit x eval.n


@pytest.mark.e2e
def test_sigterm_writes_a_checkpoint_before_exit(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    proc = _run_cli(_cli_args(run_dir, tiny_model_dir, tmp_path, ["trainer.max_steps=500", "trainer.log_every=1"]))
    import sqlite3

    from mlflow.tracking import MlflowClient

    db = tmp_path / "results" / "mlflow.db"
    deadline = time.time() + HANG_TIMEOUT_S
    while True:  # wait until training is under way (a step's loss is in the store)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline
        time.sleep(1.0)
        if not db.exists():
            continue
        # Read-only sqlite, not an MlflowClient: a client opening a store that the job is still creating runs the
        # schema migration too, and the two migrations collide (the job then fails with "table
        # _alembic_tmp_metrics already exists" — seen in CI under load).
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                if con.execute("select count(*) from metrics where key = 'loss'").fetchone()[0]:
                    break
        except sqlite3.Error:
            continue
    c = MlflowClient(f"sqlite:///{db}")
    runs = c.search_runs([c.get_experiment_by_name("grail_exp").experiment_id])
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=HANG_TIMEOUT_S)[0]
    assert proc.returncode == 143, out[-3000:]
    assert "resume=auto" in out
    ckpts = complete_checkpoints(run_dir / "checkpoints")
    assert len(ckpts) == 1 and load_training_state(ckpts[0])["step"] >= 1
    assert c.get_run(runs[0].info.run_id).info.status == "KILLED"


@pytest.mark.e2e
def test_sweep_continues_past_a_failing_job(tmp_path, tiny_model_dir):
    # A job that fails after its MLflow run started: its model directory passes validation (a config.json that
    # parses) but holds no weights or tokenizer, so loading fails (a missing directory is refused before the run).
    (tmp_path / "no_such_model").mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path / "no_such_model" / "config.json")
    proc = subprocess.run(
        [sys.executable, "-m", "grail_exp.run", "-m", f"model.name_or_path={tiny_model_dir},{tmp_path}/no_such_model",
         f"paths.root_dir={tmp_path}", "trainer.max_steps=1", "trainer.prompts_per_step=2", "trainer.micro_batch_size=8",
         "rollout.num_generations=4", "rollout.max_completion_length=8", "trainer.eval_before_training=false",
         "benchmark.limit=2", "eval.n=2", "advantage=grpo", "loss.mask_truncated_completions=false"],
        capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("grail_exp").experiment_id])
    by_path = {r.data.params.get("model.name_or_path"): r for r in runs}
    assert by_path[str(tiny_model_dir)].info.status == "FINISHED"
    failed = by_path[f"{tmp_path}/no_such_model"]
    assert failed.info.status == "FAILED"
    tb = client.download_artifacts(failed.info.run_id, "error/traceback.txt", str(tmp_path))
    assert "ModelLoadError" in Path(tb).read_text()


def _one_process_module(model, step: int):
    """The parts of a RLVRModule a checkpoint write reads, for one process under the local backend."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from grail_exp.training.backends.local import LocalBackend

    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(step=step, progress=SimpleNamespace(step=step), policy=model, optimizers=lambda: opt,
                           lr_schedulers=lambda: sched, backend=LocalBackend.__new__(LocalBackend),
                           scheme_generator=torch.Generator(), cfg=OmegaConf.create({"trainer": {"strategy": "auto"}}),
                           update=SimpleNamespace(state_dict=dict), rollout=SimpleNamespace(state_dict=dict),
                           tracker=None, terms=[])


def test_disk_full_on_checkpoint_is_one_clear_error_and_leaves_no_partial_checkpoint(tmp_path, tiny_model, tiny_tokenizer,
                                                                                     monkeypatch):
    import errno

    from grail_exp.checkpoint import CheckpointError
    from grail_exp.training.checkpoint_writer import write_checkpoint

    root = tmp_path / "checkpoints"
    position = {"round": 1, "buffer": None}
    write_checkpoint(root, _one_process_module(tiny_model, 1), tiny_tokenizer, position, keep_last=None, export_hf=True)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match="no space left"):
        write_checkpoint(root, _one_process_module(tiny_model, 2), tiny_tokenizer, position, keep_last=None,
                         export_hf=True)
    assert [c.name for c in complete_checkpoints(root)] == ["step-1"] and not list(root.glob("*.tmp-*"))


@pytest.mark.e2e
def test_unreachable_tracking_server_fails_fast(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", f"paths.root_dir={tmp_path}"],
                          env={**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"},
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 2
    assert "unreachable" in proc.stderr and "logger=none" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_missing_model_dir_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", f"paths.root_dir={tmp_path}", "logger=none",
                           f"model.name_or_path={tmp_path}/nope"], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 2 and "no Hugging Face model there" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_resume_from_a_non_checkpoint_is_one_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", f"paths.root_dir={tmp_path}", "logger=none",
                           f"resume={tmp_path}"], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 2 and "not a complete checkpoint" in proc.stderr


@pytest.mark.e2e
def test_parallel_jobs_can_create_one_sqlite_store_at_once(tmp_path):
    """Parallel sweep jobs (e.g. submitit_local) initialising the same fresh sqlite store must not race."""
    code = ("import sys; from grail_exp.tracking import MlflowTracker; "
            f"t = MlflowTracker('sqlite:///{tmp_path}/mlflow.db', 'exp', sys.argv[1], '{tmp_path.as_uri()}/art'); "
            "t.log_metrics({'x': 1.0}, step=1); t.end()")
    procs = [subprocess.Popen([sys.executable, "-c", code, f"job{i}"], stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    errs = [p.communicate(timeout=HANG_TIMEOUT_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert len(c.search_runs([c.get_experiment_by_name("exp").experiment_id])) == 3


def test_random_streams_kept_puts_back_every_global_stream_a_block_seeds_and_draws():
    import random as pyrandom

    from grail_exp.checkpoint import random_streams_kept, seed_started_streams

    def draws():
        return pyrandom.random(), float(np.random.rand()), torch.rand(3).tolist()

    torch.manual_seed(11), pyrandom.seed(11), np.random.seed(11)
    expected = draws()
    torch.manual_seed(11), pyrandom.seed(11), np.random.seed(11)
    with random_streams_kept():
        seed_started_streams(0)
        pyrandom.seed(0), np.random.seed(0)
        draws()
    assert draws() == expected


def test_seeding_before_cuda_starts_queues_no_cuda_seed():
    """``torch.manual_seed`` before CUDA initializes queues a seed that CUDA applies when it starts — after any block
    that meant to keep the run's streams, replacing the run's own seed. ``seed_started_streams`` queues none."""
    from grail_exp.checkpoint import seed_started_streams

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA already started in this process: nothing is queued either way")
    tracker = torch.cuda._lazy_seed_tracker
    before = tracker.get_calls()
    seed_started_streams(5)
    assert tracker.get_calls() == before and torch.initial_seed() == 5
    torch.manual_seed(5)  # the control: the plain call does queue one
    assert tracker.get_calls() != before


@pytest.mark.parametrize("key, step, want", [
    (None, 1, False), ("final", 1, False), ("every", 1, True),  # a periodic checkpoint (step 1 of 3)
    (None, 3, True), ("final", 3, True), ("every", 3, True),  # the last step's: the final checkpoint
])
def test_the_hf_export_goes_into_the_final_checkpoint_unless_every_is_asked(tmp_path, monkeypatch, key, step, want):
    """Which checkpoints carry the full Hugging Face weights where resume does not need them (FSDP): by default
    (trainer.export_hf_weights=final) the final one only, every one with `every`; Saver.checkpoint hands the decision
    to the writer."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    import grail_exp.training.checkpoint_writer as checkpoint_writer
    from grail_exp.job import Saver

    trainer = {"max_steps": 3, "keep_last_checkpoints": 3, "save_weights_only_every": 0}
    if key is not None:
        trainer["export_hf_weights"] = key
    cfg = OmegaConf.create({"trainer": trainer, "paths": {"output_dir": str(tmp_path)}})
    module = SimpleNamespace(step=step, rank=1)
    seen = []
    monkeypatch.setattr(checkpoint_writer, "write_checkpoint", lambda *a, export_hf, **k: seen.append(export_hf))
    Saver(cfg, SimpleNamespace(tokenizer=None), None).checkpoint(module, {"round": 1, "buffer": None})
    assert seen == [want]
    seen.clear()
    module.step += 1  # a new step
    Saver(cfg, SimpleNamespace(tokenizer=None), None).checkpoint(module, {"round": 1, "buffer": None}, final=True)
    assert seen == [True]  # a run's final checkpoint (a stop's is not final) always carries them
