"""`python -m grail_exp.tune`: search-space parsing, validation-only selection, failed trials, and the CI study
(>= 6 trials on the saliency temperature that prunes, survives a killed worker, and lands in MLflow)."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from helpers.compose import compose
from helpers.models import TINY_BUILD
from helpers.tolerances import HANG_TIMEOUT_S

optuna = pytest.importorskip("optuna")


def _unloadable_model(tmp_path, tiny_model_dir) -> str:
    """A model directory that passes validation (a config.json that parses) but holds no weights or tokenizer: its
    trial fails while loading, after its MLflow run started (a missing directory is refused before the trial)."""
    d = tmp_path / "no_such_model"
    d.mkdir(exist_ok=True)
    shutil.copy(Path(tiny_model_dir) / "config.json", d / "config.json")
    return str(d)


def _tune_cfg(tmp_path, overrides=()):
    return compose(list(overrides), tmp_path, config_name="tune")


# ---------------------------------------------------------------------------------------------- parsing
def test_search_space_files_parse_to_the_documented_distributions(tmp_path):
    import optuna.distributions as D

    from grail_exp.tune import parse_search_space, tune_settings
    from grail_exp.validate import validate

    cfg = _tune_cfg(tmp_path)
    space = parse_search_space(tune_settings(cfg).params, validate(cfg))
    assert space == {"advantage.saliency_temperature": D.FloatDistribution(0.1, 10.0, log=True)}
    cfg = _tune_cfg(tmp_path, ["hparams_search=grail_weights"])
    space = parse_search_space(tune_settings(cfg).params, validate(cfg))
    assert space == {"advantage.std": D.FloatDistribution(0.1, 2.0, log=True),
                     "advantage.w_min": D.FloatDistribution(0.1, 1.0),
                     "advantage.w_max": D.FloatDistribution(1.5, 10.0, log=True)}
    # every value the grail_weights space can draw is a valid GRAIL config (w_min <= mean <= w_max)
    assert space["advantage.w_min"].high <= cfg.advantage.mean <= space["advantage.w_max"].low


def test_search_space_errors_name_every_bad_entry(tmp_path):
    import optuna.distributions as D

    from grail_exp.config import ConfigError
    from grail_exp.tune import parse_search_space
    from grail_exp.validate import validate

    cfg = validate(_tune_cfg(tmp_path))
    params = {
        "advantage.no_such_key": {"type": "float", "low": 0, "high": 1},
        "advantage": {"type": "categorical", "choices": ["grpo"]},          # a group node, not a value
        "optim.lr": {"type": "float", "low": 0.0, "high": 1e-3, "log": True},  # log needs low > 0
        "seed": {"type": "int", "low": 5, "high": 5},                       # low < high
        "loss.epsilon": {"type": "uniform", "low": 0.1, "high": 0.3},        # unknown type
        "loss.beta": {"type": "float", "low": 0.0, "high": 0.1, "scale": 2},  # unknown field
    }
    with pytest.raises(ConfigError) as err:
        parse_search_space(params, cfg)
    msg = str(err.value)
    for key in params:
        assert f"tune.params.{key}:" in msg, key
    good = {"trainer.max_steps": {"type": "int", "low": 10, "high": 40, "step": 10},
            "rollout.temperature": {"type": "float", "low": 0.5, "high": 1.5, "step": 0.25},
            "loss.loss_type": {"type": "categorical", "choices": ["dr_grpo", "dapo"]}}
    assert parse_search_space(good, cfg) == {
        "trainer.max_steps": D.IntDistribution(10, 40, step=10),
        "rollout.temperature": D.FloatDistribution(0.5, 1.5, step=0.25),
        "loss.loss_type": D.CategoricalDistribution(["dr_grpo", "dapo"])}


def test_tune_selects_on_the_validation_split_and_refuses_test_benchmarks(tmp_path):
    from grail_exp.config import ConfigError
    from grail_exp.data import load_benchmark
    from grail_exp.tune import check_selection_benchmarks, optimize
    from grail_exp.validate import validate

    cfg = validate(_tune_cfg(tmp_path, ["data.num_validation=32", "data.num_test=32"]))
    assert list(cfg.benchmark.names) == ["arithmetic_val"] and cfg.optimized_metric == "eval/arithmetic_val/acc"
    check_selection_benchmarks(cfg, cfg.optimized_metric)  # no error
    val = {p.question for p in load_benchmark("arithmetic_val", cfg)}
    test = {p.question for p in load_benchmark("arithmetic", cfg)}
    assert len(val) == 32 and len(test) == 32 and not val & test
    for bench in ("arithmetic", "paper", "math500"):
        with pytest.raises(ConfigError, match="test benchmark.*arithmetic_val"):
            optimize(_tune_cfg(tmp_path, [f"benchmark={bench}", "logger=none"]))
    with pytest.raises(ConfigError, match="tune.metric"):
        check_selection_benchmarks(cfg, "eval/arithmetic/acc")


# ---------------------------------------------------------------------------------------------- failures
def test_failed_trials_are_failed_child_runs_with_tracebacks_and_the_study_goes_on(tmp_path, tiny_model_dir):
    from mlflow.tracking import MlflowClient

    from grail_exp.tune import optimize

    bad_dir = _unloadable_model(tmp_path, tiny_model_dir)
    good = str(tiny_model_dir)
    cfg = _tune_cfg(tmp_path, [
        "trainer.max_steps=1", "trainer.eval_every=0", "trainer.prompts_per_step=2", "trainer.micro_batch_size=8",
        "rollout.num_generations=4", "rollout.max_completion_length=8", "benchmark.limit=4", "eval.n=2",
        "eval.max_tokens=8", "reward.num_workers=0", "trainer.save_final_checkpoint=false", "tune.n_trials=1",
        "tune.study_name=failing", "tune.pruner.name=none"])
    with open_dict(cfg):
        cfg.tune.params = {"advantage.saliency_temperature": {"type": "categorical", "choices": [-1.0, 1.0]},
                           "model.name_or_path": {"type": "categorical", "choices": [good, bad_dir]}}
        cfg.tune.enqueue = [{"advantage.saliency_temperature": -1.0, "model.name_or_path": good},
                            {"advantage.saliency_temperature": 1.0, "model.name_or_path": bad_dir},
                            {"advantage.saliency_temperature": 1.0, "model.name_or_path": good}]
    summary = optimize(cfg)
    assert summary["trials"] == {"COMPLETE": 1, "FAIL": 2} and summary["best_trial"] == 2
    assert summary["params"] == {"advantage.saliency_temperature": 1.0, "model.name_or_path": good}

    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    exp = client.get_experiment_by_name("grail_exp").experiment_id
    parent = client.get_run(summary["mlflow_parent_run_id"])
    assert parent.data.tags["grail_exp.role"] == "study" and parent.info.status == "FINISHED"
    children = {int(r.data.tags["optuna.trial_number"]): r for r in
                client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert sorted(children) == [0, 1, 2]
    expected = {0: ("FAILED", "FAIL", "saliency_temperature"),  # rejected by validate(): before any training
                1: ("FAILED", "FAIL", "ModelLoadError"),        # failed inside the run (model loading)
                2: ("FINISHED", "COMPLETE", None)}
    for n, (status, state, needle) in expected.items():
        r = children[n]
        assert (r.info.status, r.data.tags["optuna.state"]) == (status, state), n
        if needle:
            tb = Path(client.download_artifacts(r.info.run_id, "error/traceback.txt", str(tmp_path / f"tb{n}")))
            assert needle in tb.read_text(), n
    assert children[2].data.metrics["optuna/value"] == summary["best_value"]
    best = OmegaConf.load(tmp_path / "results" / "tune" / "failing" / "best.yaml")
    assert best.best_trial == 2 and best.params["model.name_or_path"] == good


# ---------------------------------------------------------------------------------------------- the CI study
GRACE_S = 2  # tune.grace_period_s of the crash tests
# A dead worker's trial is stale once its last heartbeat is more than GRACE_S old. Optuna compares sqlite's
# CURRENT_TIMESTAMP values, which have one-second resolution: after GRACE_S + 2 seconds of sleep the difference
# is > GRACE_S whatever the fractions (a lower bound on elapsed time, not a race).
STALE_AFTER_S = GRACE_S + 2


EASY_TASK = ["data.min_steps=1", "data.max_steps=1", "data.max_operand=20", "data.operators=+",
             "data.num_validation=64", "data.num_test=64"]


@pytest.fixture(scope="module")
def able_model_dir(tmp_path_factory):
    """A 0.1 M-parameter model warm-started on one-step additions until greedy validation accuracy >= 12 %
    (~75 SFT steps): RL needs some correct rollouts, else every advantage is 0, every trial trains nothing, all
    trials tie and none can be pruned."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import ensure_embedded_model

    task = ArithmeticTask(min_steps=1, max_steps=1, max_operand=20, operators="+", num_validation=64, num_test=64)
    warm = dict(enabled=True, lr=3e-3, batch_size=64, warmup_steps=10, max_steps=400, eval_every=25,
                eval_problems=32, target_accuracy=0.12)
    return ensure_embedded_model(dict(TINY_BUILD, seed=0), warm, task, {"enable_thinking": False}, "",
                                 tmp_path_factory.mktemp("able_cache"))


def _study_args(model_dir, untrained_dir):
    """Three optimiser steps per trial, validation reports after steps 1 and 2, each trial with its own seed
    (tune.seed_per_trial): with one seed, two or three Adam steps (sign-like at first) leave the trials'
    models so alike that the common-random-number evaluation gives equal values, and ties are never pruned.

    Which values the warm-started trials report depends on the CPU (the warm start's trajectory and every draw do),
    so the pruning the test needs is constructed: the model is searched too, and the third enqueued trial starts from
    the untrained model, which solves nothing (a validation value of 0 at every report). Once the first two trials
    (the warm-started model: >= 12 % greedy, so some of 128 sampled answers are right) have completed with values
    above 0 at step 1, the median pruner prunes it there, and its retry after the first kill on its inherited report."""
    models = f"['{model_dir}', '{untrained_dir}']"
    return [f"model.name_or_path={model_dir}", *EASY_TASK, "optim.lr=5e-4", "trainer.max_steps=3",
            "trainer.eval_every=1", "trainer.prompts_per_step=4", "rollout.num_generations=4",
            "trainer.micro_batch_size=16", "rollout.max_completion_length=20", "benchmark.limit=64", "eval.n=2",
            "eval.max_tokens=20", "reward.num_workers=0", "trainer.save_final_checkpoint=false",
            "trainer.log_entropy=false", "trainer.sample_table_every=0", "tune.n_trials=6", "tune.seed_per_trial=true",
            "tune.sampler.n_startup_trials=2", "tune.pruner.n_startup_trials=2", "tune.heartbeat_interval_s=1",
            f"tune.grace_period_s={GRACE_S}",
            f"++tune.params={{model.name_or_path: {{type: categorical, choices: {models}}}}}",  # + the temperature's
            f"tune.enqueue=[{{advantage.saliency_temperature: 1.0, model.name_or_path: '{model_dir}'}}, "
            f"{{advantage.saliency_temperature: 0.1, model.name_or_path: '{model_dir}'}}, "
            f"{{advantage.saliency_temperature: 10.0, model.name_or_path: '{untrained_dir}'}}]"]


def _killed_worker(tmp_path, args, point: str, log_name: str = "worker.log"):
    """Run `python -m grail_exp.tune` until it SIGKILLs itself at ``point`` (GRAIL_EXP_FAULT=tune_kill:...)."""
    log_file = tmp_path / log_name
    with log_file.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "grail_exp.tune", f"paths.root_dir={tmp_path}",
                               f"hydra.run.dir={tmp_path}/tune_run", *args], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "GRAIL_EXP_FAULT": f"tune_kill:{point}"},
                              timeout=HANG_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL, f"the worker was not killed at {point}:\n" + log_file.read_text()[-4000:]
    assert f"GRAIL_EXP_FAULT: killing this worker at {point.split(':')[0]}" in log_file.read_text()


def _children(client, tmp_path):
    exp = client.get_experiment_by_name("grail_exp").experiment_id
    (parent,) = client.search_runs([exp], "tags.`grail_exp.role` = 'study'")
    return parent, client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")


def _assert_stores_agree(study, client, tmp_path):
    """Every finished trial has exactly one child run, whose status and optuna.state say what Optuna says."""
    from grail_exp.sweep import CHILD_STATUS

    _, children = _children(client, tmp_path)
    runs = {}
    for r in children:
        runs.setdefault(int(r.data.tags["optuna.trial_number"]), []).append(r)
    for t in study.trials:
        assert t.state.is_finished(), (t.number, t.state)
        assert len(runs.get(t.number, [])) == 1, (t.number, runs.get(t.number))
        (r,) = runs[t.number]
        assert (r.info.status, r.data.tags.get("optuna.state")) == (CHILD_STATUS[t.state.name], t.state.name), t.number
        if t.value is not None:
            assert r.data.metrics["optuna/value"] == t.value
    assert sorted(runs) == [t.number for t in study.trials]


@pytest.mark.e2e
@pytest.mark.slow  # ~30-55 s; make test-all. A killed worker's trial at each crash point stays in the default suite
def test_ci_study_prunes_survives_a_killed_worker_and_records_every_trial(tmp_path, able_model_dir, tiny_model_dir):
    """Two workers die with SIGKILL, each between the two stores' writes of a pruned trial (deterministic fault
    injection, no timer): the first after run() ended the trial's MLflow run as KILLED and before Optuna stored
    PRUNED; the second after Optuna stored PRUNED and before the MLflow run got its tags. The third worker finishes
    the study; both stores agree on every trial."""
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from grail_exp.tune import optimize

    args = _study_args(able_model_dir, tiny_model_dir)
    storage = f"sqlite:///{tmp_path}/results/optuna.db"
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    _killed_worker(tmp_path, args, "run_ended:PRUNED", "worker1.log")
    (dead,) = [t for t in optuna.load_study(study_name="saliency_temperature", storage=storage).trials
               if t.state == TrialState.RUNNING]
    killed_trial = dead.number
    assert dead.intermediate_values  # it had reported, and was being pruned
    assert dead.params["model.name_or_path"] == str(tiny_model_dir)  # the constructed trial, whatever was sampled
    _, children = _children(client, tmp_path)
    (child,) = [r for r in children if r.data.tags["optuna.trial_number"] == str(killed_trial)]
    assert child.info.status == "KILLED" and "optuna.state" not in child.data.tags  # killed inside the window
    time.sleep(STALE_AFTER_S)  # the dead trial's heartbeat is stale now

    # The second worker: fails the stale trial (FAIL in both stores), then dies after Optuna's write of a pruned trial.
    _killed_worker(tmp_path, args, "optuna_recorded:PRUNED", "worker2.log")
    pruned_unrecorded = [t for t in optuna.load_study(study_name="saliency_temperature", storage=storage).trials
                         if t.state == TrialState.PRUNED]
    _, children = _children(client, tmp_path)
    assert [r for r in children if r.data.tags.get("optuna.state") is None
            and int(r.data.tags["optuna.trial_number"]) in {t.number for t in pruned_unrecorded}]  # in the window

    # The restarted worker, in this process (saves an interpreter start): same study, same settings.
    optimize(_tune_cfg(tmp_path, args))

    study = optuna.load_study(study_name="saliency_temperature", storage=storage)
    _assert_stores_agree(study, client, tmp_path)
    by_state = {s: [t for t in study.trials if t.state == s] for s in TrialState}
    finished = by_state[TrialState.COMPLETE] + by_state[TrialState.PRUNED]
    assert len(finished) >= 6 and not by_state[TrialState.RUNNING] and not by_state[TrialState.WAITING]
    assert by_state[TrialState.PRUNED], "no trial was pruned"
    assert [t.number for t in by_state[TrialState.FAIL]] == [killed_trial]
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed_trial]
    assert len(retried) == 1 and retried[0].state.is_finished() and retried[0].params == study.trials[killed_trial].params
    # the three enqueued values ran first, in order; later draws stay inside the log-scale range
    temps = [t.params["advantage.saliency_temperature"] for t in study.trials]
    assert temps[:3] == [1.0, 0.1, 10.0] and all(0.1 <= x <= 10.0 for x in temps)

    exp = client.get_experiment_by_name("grail_exp").experiment_id
    parents = client.search_runs([exp], "tags.`grail_exp.role` = 'study'")
    assert len(parents) == 1, "a resumed study must reuse its parent run"
    parent = parents[0]
    children = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    runs = {}
    for r in children:
        runs.setdefault(int(r.data.tags["optuna.trial_number"]), []).append(r)
    assert sorted(runs) == [t.number for t in study.trials], "every trial has a child run"
    expected_status = {TrialState.COMPLETE: ("FINISHED", "COMPLETE"), TrialState.PRUNED: ("KILLED", "PRUNED"),
                       TrialState.FAIL: ("FAILED", "FAIL")}
    for t in study.trials:
        (r,) = runs[t.number]
        assert (r.info.status, r.data.tags["optuna.state"]) == expected_status[t.state], t.number
        assert r.data.tags["optuna.study_name"] == "saliency_temperature"
        assert float(r.data.params["advantage.saliency_temperature"]) == t.params["advantage.saliency_temperature"]
        if t.state == TrialState.COMPLETE:
            assert math.isclose(r.data.metrics["optuna/value"], t.value)
            assert math.isclose(r.data.metrics["eval/arithmetic_val/acc"], t.value)
        if t.state == TrialState.PRUNED:  # pruned on the validation metric it reported at that step
            dead = t.system_attrs.get("failed_trial")
            inherited = study.trials[dead].intermediate_values if dead is not None else {}
            own = {s: v for s, v in t.intermediate_values.items() if s not in inherited}
            # A retry carries the dead trial's reports (and may be pruned on them at its first evaluation, so
            # its own run need not reach that step); its own reports are in its own run.
            assert {s: t.intermediate_values[s] for s in inherited} == inherited
            assert own or inherited
            for step, value in own.items():
                assert math.isclose(r.data.metrics[f"eval_step{step}/arithmetic_val/acc"], value)
    best = OmegaConf.load(tmp_path / "results" / "tune" / "saliency_temperature" / "best.yaml")
    assert best.best_trial == study.best_trial.number and math.isclose(best.best_value, study.best_value)
    assert best.params["advantage.saliency_temperature"] == study.best_params["advantage.saliency_temperature"]
    assert parent.info.status == "FINISHED"
    assert float(parent.data.params["best.advantage.saliency_temperature"]) == study.best_params["advantage.saliency_temperature"]
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "tune")} >= {"tune/best.yaml", "tune/trials.csv"}


@pytest.mark.e2e
@pytest.mark.parametrize("point", [
    "run_ended:COMPLETE",        # window 1: the child FINISHED, Optuna's trial still RUNNING
    "optuna_recorded:FAIL",      # window 2 of a failing trial: Optuna FAIL, the child without its tags
    "parent_created",            # the study's parent run in MLflow, its id not yet in Optuna: adopted, not doubled
    # The same two windows with the other trial outcome, and points not between the two writes (each worker costs
    # ~10 s of CPU for its imports alone): `make test-all`.
    pytest.param("optuna_recorded:COMPLETE", marks=pytest.mark.slow),  # window 2: the child without optuna.state
    pytest.param("run_ended:FAIL", marks=pytest.mark.slow),  # window 1 of a failing trial: the child FAILED
    pytest.param("trial_started", marks=pytest.mark.slow),  # Optuna has the RUNNING trial, MLflow no child run
    pytest.param("reported", marks=pytest.mark.slow),  # mid-training: a value in Optuna, the child RUNNING
])
def test_a_worker_killed_at_any_point_of_a_trial_leaves_both_stores_agreeing_after_a_restart(
        tmp_path, tiny_model_dir, point):
    """SIGKILL injected at each point of a trial where the two stores can disagree; the restarted worker
    reconciles MLflow with Optuna and finishes the study. Fails on the old write order (MLflow's outcome tags,
    then Optuna's state, no reconciliation)."""
    from mlflow.tracking import MlflowClient

    from grail_exp.tune import optimize

    model = str(tiny_model_dir) if point.endswith("COMPLETE") or ":" not in point else \
        _unloadable_model(tmp_path, tiny_model_dir)
    args = [f"model.name_or_path={model}", "trainer.max_steps=2", "trainer.eval_every=1",
            "trainer.eval_before_training=false", "trainer.prompts_per_step=2", "trainer.micro_batch_size=8",
            "rollout.num_generations=4", "rollout.max_completion_length=8", "benchmark.limit=2", "eval.n=2",
            "eval.max_tokens=8", "reward.num_workers=0", "trainer.save_final_checkpoint=false",
            "trainer.log_entropy=false", "trainer.sample_table_every=0", "tune.n_trials=1",
            "tune.max_failed_trials=2", "tune.pruner.name=none", "tune.heartbeat_interval_s=1",
            f"tune.grace_period_s={GRACE_S}", "tune.study_name=crash"]
    _killed_worker(tmp_path, args, point)
    time.sleep(STALE_AFTER_S)  # a trial left RUNNING by the dead worker is stale now

    optimize(_tune_cfg(tmp_path, args))
    study = optuna.load_study(study_name="crash", storage=f"sqlite:///{tmp_path}/results/optuna.db")
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    _assert_stores_agree(study, client, tmp_path)
    states = [t.state.name for t in study.trials]
    if point == "parent_created":  # no trial had started; _children found exactly one parent run
        assert states == ["COMPLETE"]
    elif point.startswith("optuna_recorded"):  # the outcome was stored before the kill: nothing to retry
        assert states == [point.split(":")[1]] * (1 if point.endswith("COMPLETE") else 2)
    else:  # the killed trial is FAIL (stale) and its retry ran to its outcome
        assert states == ["FAIL", "FAIL" if point.endswith("FAIL") else "COMPLETE"]
        assert study.trials[1].system_attrs["failed_trial"] == 0
    _, children = _children(client, tmp_path)
    notes = [r for r in children if r.data.tags["optuna.trial_number"] == "0"]
    if point in ("trial_started", "reported", "run_ended:COMPLETE"):  # the killed trial's FAILED run says why
        (r,) = notes
        tb = Path(client.download_artifacts(r.info.run_id, "error/traceback.txt", str(tmp_path / "tb")))
        assert "died" in tb.read_text()


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_on_a_worker_checkpoints_the_trial_and_the_restart_continues_it(tmp_path, tiny_model_dir):
    """SIGTERM mid-trial: the trial checkpoints and stays RUNNING (exit 143); the restarted study retries it with
    resume=auto from that checkpoint, into the same MLflow run."""
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    from grail_exp.tune import optimize

    args = [f"model.name_or_path={tiny_model_dir}", "trainer.max_steps=30", "trainer.eval_every=0",
            "trainer.prompts_per_step=2", "trainer.micro_batch_size=8", "rollout.num_generations=4",
            "rollout.max_completion_length=8", "benchmark.limit=2", "eval.n=2", "eval.max_tokens=8",
            "reward.num_workers=0", "loss.mask_truncated_completions=false", "tune.n_trials=1",
            "tune.pruner.name=none", "tune.heartbeat_interval_s=1", f"tune.grace_period_s={GRACE_S}"]
    proc = subprocess.Popen([sys.executable, "-m", "grail_exp.tune", f"paths.root_dir={tmp_path}",
                             f"hydra.run.dir={tmp_path}/tune_run", *args], stdout=(tmp_path / "w1.log").open("w"),
                            stderr=subprocess.STDOUT)
    db, deadline = tmp_path / "results" / "mlflow.db", time.time() + HANG_TIMEOUT_S  # against a hang only
    while True:  # until the trial has logged two optimiser steps
        assert proc.poll() is None, (tmp_path / "w1.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.5)
        try:
            client = MlflowClient(f"sqlite:///{db}")
            exp = client.get_experiment_by_name("grail_exp").experiment_id
            trial_runs = client.search_runs([exp], "tags.`grail_exp.role` = 'trial'")
            if trial_runs and len(client.get_metric_history(trial_runs[0].info.run_id, "loss")) >= 2:
                break
        except Exception:
            continue
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_TIMEOUT_S) == 143, (tmp_path / "w1.log").read_text()[-3000:]
    storage = f"sqlite:///{tmp_path}/results/optuna.db"
    (t0,) = optuna.load_study(study_name="saliency_temperature", storage=storage).trials
    assert t0.state == TrialState.RUNNING  # left for the restart
    time.sleep(STALE_AFTER_S)  # the trial's heartbeat is stale now

    summary = optimize(_tune_cfg(tmp_path, args))
    study = optuna.load_study(study_name="saliency_temperature", storage=storage)
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[1].system_attrs["failed_trial"] == 0 and summary["best_trial"] == 1
    (run,) = client.search_runs([exp], "tags.`grail_exp.role` = 'trial'")  # one run: the trial continued
    assert run.info.status == "FINISHED" and run.data.tags["optuna.retry_of"] == "0"
    assert run.data.tags["optuna.trial_number"] == "1" and run.data.tags["optuna.state"] == "COMPLETE"
    stopped = [int(k.rsplit("_", 1)[1]) for k in run.data.tags if k.startswith("resumed_at_step_")]
    assert len(stopped) == 1 and 2 <= stopped[0] < 30
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 31))
