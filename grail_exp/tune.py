"""``python -m grail_exp.tune``: an Optuna study over the run config, selecting on a validation split, with pruning.

    python -m grail_exp.tune                                            # GRAIL's saliency temperature (default)
    python -m grail_exp.tune hparams_search=grail_weights tune.n_trials=30
    python -m grail_exp.tune tune.storage=postgresql://user@db/optuna    # several workers, one study
    python -m grail_exp.tune trainer.max_steps=50 trainer.eval_every=10  # any run override applies to every trial

The search space is a file of ``conf/hparams_search/`` (``tune.params``: ``key: {type, low, high, log}`` per
run-config key). Each trial is the run config with the trial's values set, trained in this process by
``grail_exp.run.run``. Every ``trainer.eval_every`` steps the run evaluates on the validation benchmark; the
hook below reports the value (``trial.report``) and, when the pruner says so (median of earlier trials at the
same step, by default), stops the run (``errors.RunStopped``): the trial is PRUNED. The objective is the final
value of ``optimized_metric`` (``tune.metric``), which must be a validation benchmark's metric: tuning on a test
benchmark is refused, so that the test numbers stay an unbiased comparison.

Persistence: the study lives in an RDB (``tune.storage``; default sqlite ``<results>/optuna.db``), so a killed
worker is resumed by running the same command again: finished trials stay, the sampler is re-seeded with its
seed + the number of trials so far (deterministic, no repeated draws), and a trial that was RUNNING when its
worker died stops sending heartbeats, is marked FAIL once its heartbeat is ``tune.grace_period_s`` old, and is
re-queued with the same values (``tune.retry_stale_trials``); the retry reuses the dead trial's run directory
with ``resume=auto``, so with ``trainer.checkpoint_every`` it continues from its last checkpoint. The budget
``tune.n_trials`` counts finished (COMPLETE or PRUNED) trials of the study, over all workers and restarts.
A worker stopped by SIGTERM (or, as a submitit job, by SLURM's USR2 before its time limit) lets the running trial
checkpoint, leaves it RUNNING and exits 143 (submitit requeues it): the trial is then retried from that checkpoint.

MLflow: one parent run per study (its id is a study attribute, so restarts and other workers reuse it), one
child run per trial with tags ``optuna.study_name``, ``optuna.trial_number``, ``optuna.state`` (COMPLETE,
PRUNED, FAIL). A failed trial is a FAILED child with ``error/traceback.txt`` (also when it failed before
training started) and the study goes on. The best parameters go to ``<results>/tune/<study>/best.yaml`` (and
``.json``, ``trials.csv``) and to the parent run.

Crash consistency (the two stores agree after a crash at any point): Optuna is the record and MLflow follows it.
A trial's outcome is written to Optuna first (``study.optimize`` stores the state when the objective returns)
and to its child run second (``after_trial``); every worker start, and every stale trial a worker fails,
reconciles the child runs with Optuna (``StudyRuns.reconcile``, grail_exp/sweep.py): COMPLETE -> FINISHED,
PRUNED -> KILLED, FAIL -> FAILED, with ``optuna.state`` equal to Optuna's state, and a FAILED child made for a FAIL
trial that died before it had one. A kill between the two writes is therefore repaired on the next start: before
Optuna's write the trial goes stale and is FAIL in both stores (and re-queued); after it, the child takes
Optuna's state. ``GRAIL_EXP_FAULT=tune_kill:<point>[:<trial number or state>]`` SIGKILLs the worker at one of
``CRASH_POINTS`` (test-only fault injection: ``grail_exp/faults.py``).
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from grail_exp import faults
from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import ConfigError, register_configs
from grail_exp.errors import RunStopped
from grail_exp.sweep import StudyRuns, trial_overrides
from grail_exp.validate import validate
from grail_exp.world import configured_world_size

log = logging.getLogger("grail_exp.tune")
register_configs()


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class SamplerSettings:
    name: str = "tpe"  # tpe (Optuna's TPESampler) | random
    seed: int = 0  # sampler seed; a resumed study uses seed + trials so far. Parallel workers: give each its own
    n_startup_trials: int = 5  # tpe: random trials before the model is used (Optuna default 10)
    multivariate: bool = True  # tpe: joint model of the parameters (Falkner et al. 2018's BOHB-style TPE)


@dataclass
class PrunerSettings:
    name: str = "median"  # median (MedianPruner) | percentile | none
    n_startup_trials: int = 3  # no pruning until this many trials are COMPLETE (Optuna default 5)
    n_warmup_steps: int = 0  # optimiser steps before a trial can be pruned
    interval_steps: int = 1  # check every report (reports come every trainer.eval_every steps)
    percentile: float = 50.0  # percentile: prune below this percentile of earlier trials at the same step


@dataclass
class TuneSettings:
    """``tune:`` in conf/tune.yaml; ``params`` and ``study_name`` come from ``hparams_search``."""

    study_name: str = MISSING  # the study in the storage; reusing a name resumes (or joins) that study
    storage: str | None = None  # any SQLAlchemy URL; null = sqlite:///<paths.results_dir>/optuna.db
    direction: str = "maximize"  # maximize | minimize
    metric: str | None = None  # null = optimized_metric; must be a metric of a validation benchmark
    n_trials: int = 20  # the study stops once this many trials are COMPLETE or PRUNED (all workers, all restarts)
    max_failed_trials: int = 10  # this worker stops once the study has this many FAILED trials
    timeout_s: float | None = None  # this worker starts no new trial after this many seconds
    params: dict = field(default_factory=dict)  # search space: {run-config key: {type, low, high, log, step, choices}}
    enqueue: list = field(default_factory=list)  # trials to run first (once per study), e.g. [{key: value}]
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    pruner: PrunerSettings = field(default_factory=PrunerSettings)
    heartbeat_interval_s: int = 60  # a running trial writes a heartbeat this often (Optuna RDB heartbeat)
    grace_period_s: int | None = None  # a RUNNING trial without heartbeat this long is FAILED; null = 2 x interval
    retry_stale_trials: int = 1  # re-queue a trial whose worker died this many times (same values, resume=auto)
    # false: every trial runs with the same `seed` (common random numbers: trials differ only by their values,
    # a paired comparison); true: trial n runs with seed + n (independent noise; a value that wins is less
    # likely to win by its seed's luck, but more trials are needed to see small effects)
    seed_per_trial: bool = False
    results_dir: str = MISSING  # best.yaml / best.json / trials.csv
    trials_dir: str = MISSING  # one run directory per trial: <trials_dir>/trial_<NNNN>


PARAM_TYPES = ("float", "int", "categorical")


def tune_settings(cfg: DictConfig) -> TuneSettings:
    """``cfg.tune`` merged into its typed schema (a wrong key or type names itself)."""
    if cfg.get("tune") is None:
        raise ConfigError("tune: missing; run `python -m grail_exp.tune` (conf/tune.yaml), not grail_exp.run")
    try:  # resolved against the whole config first: results_dir and trials_dir interpolate paths.*
        merged = OmegaConf.merge(OmegaConf.structured(TuneSettings), OmegaConf.to_container(cfg.tune, resolve=True))
    except Exception as exc:
        raise ConfigError(f"tune: {exc}".split("\n    ")[0]) from exc
    return merged  # a DictConfig typed as TuneSettings


def parse_search_space(params: Any, cfg: DictConfig) -> dict:
    """``tune.params`` -> {key: optuna distribution}, checked against the (validated) run config.

    Each key is a dotted run-config key holding a value (not a group: tune one group option per study);
    ``float``/``int`` need ``low < high`` (``log`` needs ``low > 0`` and no ``step``), ``categorical`` needs
    ``choices``. Raises ``ConfigError`` listing every problem."""
    import optuna.distributions as D

    errors, out = [], {}
    if not params:
        raise ConfigError("tune.params: empty search space; pick one with hparams_search=<file of conf/hparams_search>")
    missing = object()
    for key, spec in dict(params).items():
        where = f"tune.params.{key}"
        current = OmegaConf.select(cfg, str(key), default=missing)
        if current is missing:
            errors.append(f"{where}: no such key in the run config")
            continue
        if OmegaConf.is_config(current):
            errors.append(f"{where}: is a config node, not a value (tune one option of a config group per study)")
            continue
        spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
        if not isinstance(spec, dict) or spec.get("type") not in PARAM_TYPES:
            errors.append(f"{where}: needs type: {' | '.join(PARAM_TYPES)} (got {spec!r})")
            continue
        unknown = set(spec) - {"type", "low", "high", "log", "step", "choices"}
        if unknown:
            errors.append(f"{where}: unknown field(s) {sorted(unknown)}")
            continue
        kind, low, high, logscale, step = spec["type"], spec.get("low"), spec.get("high"), spec.get("log", False), spec.get("step")
        if kind == "categorical":
            choices = spec.get("choices")
            if not choices:
                errors.append(f"{where}: categorical needs a non-empty choices list")
            else:
                out[key] = D.CategoricalDistribution(list(choices))
            continue
        if low is None or high is None or not low < high:
            errors.append(f"{where}: needs low < high (got low={low!r}, high={high!r})")
        elif logscale and low <= 0:
            errors.append(f"{where}: log scale needs low > 0 (got {low!r})")
        elif logscale and step is not None:
            errors.append(f"{where}: log and step cannot be combined")
        elif kind == "int":
            out[key] = D.IntDistribution(int(low), int(high), log=bool(logscale), step=int(step or 1))
        else:
            out[key] = D.FloatDistribution(float(low), float(high), log=bool(logscale), step=step)
    if errors:
        raise ConfigError("invalid search space:\n  - " + "\n  - ".join(errors))
    return out


def check_selection_benchmarks(cfg: DictConfig, metric: str) -> None:
    """Refuse to select hyper-parameters on a test benchmark."""
    from grail_exp.data.benchmarks import BENCHMARK_SPLITS

    names = list(cfg.benchmark.names)
    test = [b for b in names if BENCHMARK_SPLITS.get(b) != "validation"]
    validation = sorted(b for b, s in BENCHMARK_SPLITS.items() if s == "validation")
    if test:
        raise ConfigError(
            f"benchmark.names = {names}: {', '.join(test)} {'is a test benchmark' if len(test) == 1 else 'are test benchmarks'}; "
            f"tuning must select on a validation split ({', '.join(validation)}), e.g. benchmark=arithmetic_val, "
            "so that the test numbers stay unbiased")
    parts = metric.split("/")
    if len(parts) != 3 or parts[0] != "eval" or parts[1] not in names:
        raise ConfigError(f"tune.metric = {metric!r}: must be eval/<benchmark>/<metric> for a benchmark in "
                          f"benchmark.names ({', '.join(names)})")


# ---------------------------------------------------------------------------------------------- Optuna objects
def _storage(settings, cfg: DictConfig):
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    url = settings.storage
    if not url:
        results = Path(cfg.paths.results_dir).expanduser().resolve()
        results.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{results / 'optuna.db'}"
    retry = (RetryHeartbeatStaleTrialCallback(max_retry=settings.retry_stale_trials, inherit_intermediate_values=True)
             if settings.retry_stale_trials > 0 else None)
    on_stale = _OnStaleTrial(retry)
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # several local workers
    from grail_exp.tracking import sqlite_init_lock

    try:
        with sqlite_init_lock(url):  # workers creating a fresh sqlite study at once race on its schema
            storage = RDBStorage(url, engine_kwargs=engine, heartbeat_interval=settings.heartbeat_interval_s,
                                 grace_period=settings.grace_period_s, heartbeat_stale_trial_callback=on_stale)
    except Exception as exc:  # a malformed URL, a missing driver, an unreachable or locked database
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"tune.storage={_public_url(url)!r}: cannot open the Optuna storage: "
                          f"{type(exc).__name__}: {first}") from exc
    return storage, url, on_stale


class _OnStaleTrial:
    """Optuna's callback for a trial this worker has just marked FAIL because its worker stopped sending
    heartbeats: re-queue it (``tune.retry_stale_trials``), then mark its MLflow child FAILED (``runs``, set once
    the study's parent run is known)."""

    def __init__(self, retry):
        self.retry = retry
        self.runs: StudyRuns | None = None

    def __call__(self, study, trial) -> None:
        if self.retry is not None:
            self.retry(study, trial)
        if self.runs is not None:
            self.runs.reconcile(study, only=trial.number)


def _sampler(s, n_trials_so_far: int):
    import optuna

    seed = s.seed + n_trials_so_far  # a restarted worker must not replay the draws of the first one
    if s.name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.n_startup_trials, multivariate=s.multivariate)
    if s.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ConfigError(f"tune.sampler.name = {s.name!r}: must be one of: tpe, random")


def _pruner(p):
    import optuna

    if p.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps,
                                           interval_steps=p.interval_steps)
    if p.name == "percentile":
        return optuna.pruners.PercentilePruner(p.percentile, n_startup_trials=p.n_startup_trials,
                                               n_warmup_steps=p.n_warmup_steps, interval_steps=p.interval_steps)
    if p.name == "none":
        return optuna.pruners.NopPruner()
    raise ConfigError(f"tune.pruner.name = {p.name!r}: must be one of: median, percentile, none")


def _public_url(url: str) -> str:
    """The storage URL without its password (it goes into MLflow tags and files)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def _count(study, *states) -> int:
    return len(study.get_trials(deepcopy=False, states=states))



@dataclass
class _TrialInfo:
    """What the objective knows about one execution of a trial, for recording its outcome after Optuna's write."""

    number: int
    trial_dir: str
    tags: dict
    resumes_checkpoint: bool  # a retry whose directory has a checkpoint: run() continues that checkpoint's run
    error: str | None = None


# ---------------------------------------------------------------------------------------------- fault injection
# The points of a trial's life at which ``GRAIL_EXP_FAULT=tune_kill:<point>`` SIGKILLs the worker; between them,
# the two stores are written in this order: MLflow child created (by run) -> Optuna RUNNING trial reported
# (``reported``) -> MLflow child ended by run (FINISHED / KILLED / FAILED) -> Optuna state -> MLflow tags.
CRASH_POINTS = (
    "parent_created",   # the study's MLflow parent run exists; Optuna does not know its id yet
    "trial_started",    # Optuna has the RUNNING trial; no MLflow child run yet
    "reported",         # mid-training, right after an intermediate value went to Optuna; the child is RUNNING
    "run_ended",        # run() has ended the child run; Optuna has not stored the outcome (the first window)
    "optuna_recorded",  # Optuna has stored the outcome; the child run has not got its tags (the second window)
)


# ---------------------------------------------------------------------------------------------- the study
class _Pruned(RunStopped):
    pass


def _suggest(trial, key: str, dist) -> Any:
    import optuna.distributions as D

    if isinstance(dist, D.CategoricalDistribution):
        return trial.suggest_categorical(key, dist.choices)
    if isinstance(dist, D.IntDistribution):
        return trial.suggest_int(key, dist.low, dist.high, log=dist.log, step=dist.step)
    return trial.suggest_float(key, dist.low, dist.high, log=dist.log, step=dist.step)


def trial_base(cfg: DictConfig, settings) -> tuple[DictConfig, str, dict]:
    """The configuration every trial starts from (``optimized_metric`` set to the study's metric, no ``tune`` node), the
    metric, and the parsed search space — after refusing what a study cannot run (one key named in each error)."""
    if settings.direction not in ("maximize", "minimize"):
        raise ConfigError(f"tune.direction = {settings.direction!r}: must be maximize or minimize")
    base = copy.deepcopy(cfg)
    checked = validate(copy.deepcopy(base))
    metric = settings.metric or checked.optimized_metric
    if not metric:
        raise ConfigError("tune.metric: null and optimized_metric is null: nothing to optimise")
    check_selection_benchmarks(checked, metric)
    space = parse_search_space(settings.params, checked)
    t = checked.trainer
    if configured_world_size(t) != 1:
        # Trials run inside this process; a data-parallel launcher would re-launch the tune command per rank, and a
        # pruning decision taken on rank 0 would leave the other ranks waiting at their next all-reduce.
        raise ConfigError(f"trainer.devices = {t.devices}, trainer.num_nodes = {t.get('num_nodes', 1)}: tuning runs "
                          "single-process trials; run several workers on one study instead (tune.storage, -m "
                          "tune.sampler.seed=0,1,...)")
    if not checked.trainer.eval_at_end:
        raise ConfigError("trainer.eval_at_end = false: the objective is the final evaluation; set it to true")
    if settings.pruner.name != "none" and not checked.trainer.eval_every:
        log.warning("trainer.eval_every = 0: no intermediate reports, so no trial can be pruned")
    with open_dict(base):
        base.optimized_metric = metric
        base.tune = None  # the trial runs do not need the study settings
    return base, metric, space


def trial_config(base: DictConfig, values: dict, settings, trial_dir: str, parent_id, name: str, tags: dict,
                 seed_offset: int, retry: bool) -> DictConfig:
    """One trial's run configuration: the sampled ``values`` over ``base``, its own run directory and MLflow child
    run, its seed (``tune.seed_per_trial``), and ``resume=auto`` for a retry of a dead trial."""
    tcfg = copy.deepcopy(base)
    with open_dict(tcfg):
        for key, value in values.items():
            OmegaConf.update(tcfg, key, value, merge=False)
        tcfg.paths.output_dir = trial_dir
        tcfg.logger.parent_run_id = parent_id
        tcfg.logger.run_name = name
        tcfg.logger.tags = {**(OmegaConf.to_container(tcfg.logger.tags) or {}), **tags}
        if settings.seed_per_trial:
            tcfg.seed = int(base.seed) + seed_offset
        # A retry continues the dead trial's last checkpoint, if it wrote one; a new trial always starts fresh
        # (even when this worker was itself requeued with resume=auto).
        tcfg.resume = "auto" if retry else None
    return tcfg


def record_trial(study, trial, runs, info) -> None:
    """Optuna has stored ``trial``'s outcome: now its MLflow child run, then the study's counters on the parent run."""
    from optuna.trial import TrialState

    faults.tune_kill("optuna_recorded", trial.number, trial.state.name)
    if info is not None:
        try:
            runs.record(trial, info)
        except Exception as exc:  # the tracking server is down: the study goes on; the next start reconciles
            log.warning("trial %d: its MLflow run was not updated (%s: %s); the next start of the study "
                        "copies Optuna's outcome to it", trial.number, type(exc).__name__, exc)
    if runs.parent:
        runs.parent.log_metrics({"trials/finished": _count(study, TrialState.COMPLETE, TrialState.PRUNED),
                                 "trials/failed": _count(study, TrialState.FAIL),
                                 "trials/pruned": _count(study, TrialState.PRUNED),
                                 **({"best_value": study.best_value} if _count(study, TrialState.COMPLETE) else {})},
                                step=trial.number)


def run_trial(trial, tcfg: DictConfig, metric: str, inherited: set, info) -> float:
    """Train one trial's run and return its metric, reporting each evaluation to Optuna for pruning. ``inherited``:
    the steps a dead trial already reported (a retry carries them). A stop signal leaves the trial RUNNING (it is
    re-queued with resume=auto); a failure is recorded in ``info`` and raised (Optuna marks the trial FAIL)."""
    import optuna

    from grail_exp.errors import Preempted, StoppedBySignal
    from grail_exp.job import run
    from grail_exp.preemption import exit_code, hand_back_to_submitit

    def on_eval(step: int, metrics: dict) -> None:
        if metric in metrics and math.isfinite(metrics[metric]):
            if step not in inherited:
                trial.report(float(metrics[metric]), step)
                faults.tune_kill("reported", trial.number)
            if trial.should_prune():
                raise _Pruned(f"pruned at step {step}: {metric} = {metrics[metric]:.4f}")

    # The outcome goes to Optuna when this function returns (or raises) and to MLflow after that, in
    # after_trial: Optuna is the record, and a crash in between is repaired from it (StudyRuns.reconcile).
    try:
        value = run(tcfg, on_eval=on_eval)
        if value is None or not math.isfinite(value):
            raise RuntimeError(f"the run did not produce a finite {metric} (got {value})")
    except (Preempted, StoppedBySignal) as exc:
        # A stop signal (SIGTERM, Ctrl-C, submitit's USR2): the run has checkpointed (or had not started training).
        # Leave the trial RUNNING, so that it goes stale and is re-queued with resume=auto when the study restarts (or
        # submitit requeues this worker).
        hand_back_to_submitit()  # in a submitit job this requeues the worker and exits here
        raise SystemExit(exit_code(exc.signum)) from exc
    except _Pruned as exc:
        faults.tune_kill("run_ended", trial.number, "PRUNED")
        log.info("trial %d %s", trial.number, exc)
        raise optuna.TrialPruned(str(exc)) from None
    except Exception:
        info.error = traceback.format_exc()
        faults.tune_kill("run_ended", trial.number, "FAIL")
        raise  # Optuna records the trial as FAIL; optimize's catch= keeps the study going
    finally:
        gc.collect()
        _empty_cuda_cache()
    faults.tune_kill("run_ended", trial.number, "COMPLETE")
    return value


def optimize(cfg: DictConfig) -> dict:
    """Run (or resume) the study in this process until its budget is reached; returns the summary written to
    ``best.json``."""
    import optuna
    from optuna.trial import TrialState

    # The heartbeat / retry API and multivariate TPE are "experimental" in Optuna 5: stable enough for us, and
    # the warnings would repeat for every trial.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    settings = tune_settings(cfg)
    base, metric, space = trial_base(cfg, settings)

    storage, url, on_stale = _storage(settings, cfg)
    study = optuna.create_study(study_name=settings.study_name, storage=storage, direction=settings.direction,
                                load_if_exists=True)
    before = len(study.trials)
    study = optuna.load_study(study_name=settings.study_name, storage=storage,
                              sampler=_sampler(settings.sampler, before), pruner=_pruner(settings.pruner))
    if study.direction.name.lower() != settings.direction:
        raise ConfigError(f"tune.direction = {settings.direction}: study {settings.study_name!r} was created with "
                          f"{study.direction.name.lower()}")
    runs = StudyRuns(cfg, settings, study, _public_url(url), metric)
    on_stale.runs = runs
    optuna.storages.fail_stale_trials(study)  # trials of a dead worker: FAIL in both stores, re-queued
    runs.reconcile(study)  # whatever an earlier crash left between the two stores
    for params in settings.enqueue:
        study.enqueue_trial(OmegaConf.to_container(params, resolve=True) if OmegaConf.is_config(params) else params,
                            skip_if_exists=True)
    log.info("study %r (%s): %d trials so far, budget %d finished trials; metric %s (%s); MLflow parent %s",
             settings.study_name, _public_url(url), before, settings.n_trials, metric, settings.direction,
             runs.parent_id)
    trials_dir = Path(settings.trials_dir)
    pending: dict[int, _TrialInfo] = {}  # trial number -> what after_trial records in MLflow

    def objective(trial: optuna.Trial) -> float:
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
        retry_of = frozen.system_attrs.get("failed_trial")  # the first trial of a chain of retries, or None
        trial_dir = str((trials_dir / f"trial_{retry_of if retry_of is not None else trial.number:04d}").resolve())
        trial.set_user_attr("run_dir", trial_dir)
        name = f"{settings.study_name}-trial{trial.number}"
        tags = {"grail_exp.role": "trial", "optuna.study_name": settings.study_name,
                "optuna.trial_number": str(trial.number), "optuna.trial_dir": trial_dir}
        if retry_of is not None:
            tags["optuna.retry_of"] = str(retry_of)
        from grail_exp.checkpoint import latest_checkpoint

        info = pending[trial.number] = _TrialInfo(
            trial.number, trial_dir, tags,
            resumes_checkpoint=retry_of is not None and latest_checkpoint(Path(trial_dir) / "checkpoints") is not None)
        faults.tune_kill("trial_started", trial.number)
        values = {key: _suggest(trial, key, dist) for key, dist in space.items()}
        tags["optuna.params"] = trial_overrides(values)
        log.info("trial %d%s: %s", trial.number, f" (retry of {retry_of})" if retry_of is not None else "",
                 trial_overrides(values))
        tcfg = trial_config(base, values, settings, trial_dir, runs.parent_id, name, tags,
                            retry_of if retry_of is not None else trial.number, retry=retry_of is not None)

        return run_trial(trial, tcfg, metric, set(frozen.intermediate_values), info)

    def budget_reached() -> bool:
        return _count(study, TrialState.COMPLETE, TrialState.PRUNED) >= settings.n_trials

    def after_trial(study_, trial) -> None:
        record_trial(study_, trial, runs, pending.pop(trial.number, None))
        if budget_reached() or _count(study, TrialState.FAIL) >= settings.max_failed_trials:
            study_.stop()

    if not budget_reached() and _count(study, TrialState.FAIL) < settings.max_failed_trials:
        study.optimize(objective, n_trials=None, timeout=settings.timeout_s, catch=(Exception,),
                       callbacks=[after_trial], gc_after_trial=True)
    summary = write_best(study, settings, url, metric, runs.parent_id)
    if runs.parent:
        _log_best(runs.parent, summary, Path(settings.results_dir))
        runs.parent.end("FINISHED" if budget_reached() else "KILLED")
    return summary


def _empty_cuda_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def write_best(study, settings, storage_url: str, metric: str, parent_run_id: str | None) -> dict:
    """``best.yaml`` / ``best.json`` (the best trial's values as overrides) and ``trials.csv`` under ``results_dir``."""
    from optuna.trial import TrialState

    out = Path(settings.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {s.name: _count(study, s) for s in TrialState if _count(study, s)}
    summary: dict[str, Any] = {"study": settings.study_name, "storage": _public_url(storage_url), "metric": metric,
                               "direction": settings.direction, "trials": counts,
                               "mlflow_parent_run_id": parent_run_id, "best_trial": None}
    if _count(study, TrialState.COMPLETE):
        best = study.best_trial
        summary.update(best_trial=best.number, best_value=best.value, params=dict(best.params),
                       overrides=trial_overrides(best.params), run_dir=best.user_attrs.get("run_dir"))
    else:
        log.warning("no trial of study %r is COMPLETE yet: no best parameters", settings.study_name)
    (out / "best.json").write_text(json.dumps(summary, indent=2))
    (out / "best.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(summary)))
    try:
        study.trials_dataframe().to_csv(out / "trials.csv", index=False)
    except Exception as exc:  # pandas missing: the table is a convenience
        log.warning("trials.csv not written: %s", exc)
    if summary["best_trial"] is not None:
        log.info("best trial %d: %s = %.4f with %s (written to %s)", summary["best_trial"], metric,
                 summary["best_value"], summary["overrides"], out / "best.yaml")
    return summary


def _log_best(parent, summary: dict, out: Path) -> None:
    if summary.get("best_trial") is not None:
        parent.log_params({f"best.{k}": v for k, v in summary["params"].items()} | {"best.trial": summary["best_trial"]})
        parent.set_tags({"best.overrides": summary["overrides"]})
    for name in ("best.yaml", "best.json", "trials.csv"):
        if (out / name).exists():
            parent.log_artifact(str(out / name), "tune")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="tune")
def main(cfg: DictConfig) -> float | None:
    from grail_exp.errors import exit_on_user_error

    with exit_on_user_error():
        summary = optimize(cfg)
    return summary.get("best_value")


if __name__ == "__main__":
    main()
