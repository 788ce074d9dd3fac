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
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import socket
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import ConfigError, register_configs, validate
from grail_exp.errors import RunStopped

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
    storage: Optional[str] = None  # any SQLAlchemy URL; null = sqlite:///<paths.results_dir>/optuna.db
    direction: str = "maximize"  # maximize | minimize
    metric: Optional[str] = None  # null = optimized_metric; must be a metric of a validation benchmark
    n_trials: int = 20  # the study stops once this many trials are COMPLETE or PRUNED (all workers, all restarts)
    max_failed_trials: int = 10  # this worker stops once the study has this many FAILED trials
    timeout_s: Optional[float] = None  # this worker starts no new trial after this many seconds
    params: dict = field(default_factory=dict)  # search space: {run-config key: {type, low, high, log, step, choices}}
    enqueue: list = field(default_factory=list)  # trials to run first (once per study), e.g. [{key: value}]
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    pruner: PrunerSettings = field(default_factory=PrunerSettings)
    heartbeat_interval_s: int = 60  # a running trial writes a heartbeat this often (Optuna RDB heartbeat)
    grace_period_s: Optional[int] = None  # a RUNNING trial without heartbeat this long is FAILED; null = 2 x interval
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
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    url = settings.storage
    if not url:
        results = Path(cfg.paths.results_dir).expanduser().resolve()
        results.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{results / 'optuna.db'}"
    retry = (RetryHeartbeatStaleTrialCallback(max_retry=settings.retry_stale_trials, inherit_intermediate_values=True)
             if settings.retry_stale_trials > 0 else None)
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None  # several local workers
    from grail_exp.tracking import _sqlite_init_lock

    with _sqlite_init_lock(url):  # workers creating a fresh sqlite study at once race on its schema
        return RDBStorage(url, engine_kwargs=engine, heartbeat_interval=settings.heartbeat_interval_s,
                          grace_period=settings.grace_period_s, heartbeat_stale_trial_callback=retry), url


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


# ---------------------------------------------------------------------------------------------- MLflow
class _StudyRuns:
    """The study's parent run and the lookup of each trial's child run (no-ops with logger=none)."""

    def __init__(self, cfg: DictConfig, settings, study, storage_url: str, metric: str):
        self.parent = None
        if cfg.logger.name == "none":
            return
        from grail_exp.tracking import (MlflowTracker, artifact_location_for, code_tags, tracking_uri_for)

        uri, exp, art = tracking_uri_for(cfg), cfg.logger.experiment_name, artifact_location_for(cfg)
        self.uri = uri
        existing = study.user_attrs.get("mlflow_parent_run_id")
        if existing and self._exists(uri, existing):
            self.parent = MlflowTracker(uri, exp, "", art, run_id=existing)
            log.info("continuing the study's MLflow parent run %s", existing)
            return
        tags = {"host": socket.gethostname(), **code_tags(),
                **{str(k): str(v) for k, v in (cfg.logger.get("tags") or {}).items()}, "grail_exp.role": "study", "optuna.study_name": settings.study_name,
                "optuna.storage": _public_url(storage_url), "optuna.direction": settings.direction,
                "optuna.metric": metric, "model": str(cfg.model.name), "scheme": str(cfg.advantage.name)}
        mine = MlflowTracker(uri, exp, f"study-{settings.study_name}", art, tags)
        study.set_user_attr("mlflow_parent_run_id", mine.run_id)
        winner = study.user_attrs.get("mlflow_parent_run_id")  # two workers starting at once: one parent wins
        if winner != mine.run_id:
            mine.client.delete_run(mine.run_id)
            self.parent = MlflowTracker(uri, exp, "", art, run_id=winner)
            return
        self.parent = mine
        space = OmegaConf.to_container(settings.params, resolve=True)
        mine.log_params({"search": {k: json.dumps(v) for k, v in space.items()},
                         "tune": {k: v for k, v in OmegaConf.to_container(settings, resolve=True).items()
                                  if k not in ("params", "enqueue", "storage")}})
        mine.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config/base_resolved.yaml")

    @staticmethod
    def _exists(uri: str, run_id: str) -> bool:
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(uri).get_run(run_id)
            return True
        except Exception:
            return False

    @property
    def parent_id(self) -> str | None:
        return self.parent.run_id if self.parent else None

    def trial_run(self, trial_dir: str):
        """The newest child run of this study made for ``trial_dir`` (None if the trial never created one)."""
        if not self.parent:
            return None
        runs = self.parent.client.search_runs(
            [self.parent.experiment_id],
            f"tags.`mlflow.parentRunId` = '{self.parent.run_id}' and tags.`optuna.trial_dir` = '{trial_dir}'",
            order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0] if runs else None

    def finish_trial(self, trial_dir: str, number: int, state: str, value: float | None, error: str | None,
                     name: str, tags: dict):
        """Tag the trial's child run with its Optuna outcome; a trial that failed before training started gets
        a FAILED child run of its own, with the traceback."""
        if not self.parent:
            return
        client = self.parent.client
        run = self.trial_run(trial_dir)
        if run is None:
            if error is None:
                return
            run_id = client.create_run(self.parent.experiment_id, run_name=name,
                                       tags={**tags, "mlflow.parentRunId": self.parent.run_id}).info.run_id
        else:
            run_id = run.info.run_id
        client.set_tag(run_id, "optuna.trial_number", str(number))
        client.set_tag(run_id, "optuna.state", state)
        if "optuna.retry_of" in tags:  # a retry that resumed the dead trial's run: say which trial that was
            client.set_tag(run_id, "optuna.retry_of", tags["optuna.retry_of"])
        if value is not None and math.isfinite(value):
            client.log_metric(run_id, "optuna/value", float(value))
        if error is not None:
            client.log_text(run_id, error, "error/traceback.txt")
            if run is None or run.info.status in ("RUNNING", "SCHEDULED"):
                client.set_terminated(run_id, "FAILED")

    def fail_orphans(self, study) -> None:
        """Child runs left RUNNING by a dead worker (their trial is no longer RUNNING in Optuna) -> FAILED."""
        if not self.parent:
            return
        from optuna.trial import TrialState

        running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        client = self.parent.client
        for run in client.search_runs([self.parent.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{self.parent.run_id}' and attributes.status = 'RUNNING'"):
            number = int(run.data.tags.get("optuna.trial_number", -1))
            if number not in running:
                client.set_tag(run.info.run_id, "optuna.state", "FAIL")
                client.log_text(run.info.run_id, "the worker running this trial died (no Optuna heartbeat); "
                                "the trial was marked FAIL and re-queued\n", "error/traceback.txt")
                client.set_terminated(run.info.run_id, "FAILED")
                log.warning("trial %d: its worker died; MLflow run %s marked FAILED", number, run.info.run_id)


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


def _trial_overrides(params: dict) -> str:
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in params.items())


def optimize(cfg: DictConfig) -> dict:
    """Run (or resume) the study in this process until its budget is reached; returns the summary written to
    ``best.json``."""
    import optuna
    from optuna.trial import TrialState

    from grail_exp.errors import Preempted
    from grail_exp.preemption import hand_back_to_submitit
    from grail_exp.training.job import run

    # The heartbeat / retry API and multivariate TPE are "experimental" in Optuna 5: stable enough for us, and
    # the warnings would repeat for every trial.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    settings = tune_settings(cfg)
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
    if (t.devices if isinstance(t.devices, int) else len(t.devices)) * t.get("num_nodes", 1) != 1:
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

    storage, url = _storage(settings, cfg)
    study = optuna.create_study(study_name=settings.study_name, storage=storage, direction=settings.direction,
                                load_if_exists=True)
    before = len(study.trials)
    study = optuna.load_study(study_name=settings.study_name, storage=storage,
                              sampler=_sampler(settings.sampler, before), pruner=_pruner(settings.pruner))
    if study.direction.name.lower() != settings.direction:
        raise ConfigError(f"tune.direction = {settings.direction}: study {settings.study_name!r} was created with "
                          f"{study.direction.name.lower()}")
    optuna.storages.fail_stale_trials(study)  # trials of a dead worker: FAIL, and re-queued with the same values
    for params in settings.enqueue:
        study.enqueue_trial(OmegaConf.to_container(params, resolve=True) if OmegaConf.is_config(params) else params,
                            skip_if_exists=True)
    runs = _StudyRuns(cfg, settings, study, url, metric)
    runs.fail_orphans(study)
    log.info("study %r (%s): %d trials so far, budget %d finished trials; metric %s (%s); MLflow parent %s",
             settings.study_name, _public_url(url), before, settings.n_trials, metric, settings.direction,
             runs.parent_id)
    trials_dir = Path(settings.trials_dir)

    def objective(trial: optuna.Trial) -> float:
        values = {key: _suggest(trial, key, dist) for key, dist in space.items()}
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
        retry_of = frozen.system_attrs.get("failed_trial")  # the first trial of a chain of retries, or None
        trial_dir = str((trials_dir / f"trial_{retry_of if retry_of is not None else trial.number:04d}").resolve())
        name = f"{settings.study_name}-trial{trial.number}"
        tags = {"grail_exp.role": "trial", "optuna.study_name": settings.study_name,
                "optuna.trial_number": str(trial.number), "optuna.trial_dir": trial_dir,
                "optuna.params": _trial_overrides(values)}
        if retry_of is not None:
            tags["optuna.retry_of"] = str(retry_of)
        trial.set_user_attr("run_dir", trial_dir)
        log.info("trial %d%s: %s", trial.number, f" (retry of {retry_of})" if retry_of is not None else "",
                 _trial_overrides(values))
        tcfg = copy.deepcopy(base)
        with open_dict(tcfg):
            for key, value in values.items():
                OmegaConf.update(tcfg, key, value, merge=False)
            tcfg.paths.output_dir = trial_dir
            tcfg.logger.parent_run_id = runs.parent_id
            tcfg.logger.run_name = name
            tcfg.logger.tags = {**(OmegaConf.to_container(tcfg.logger.tags) or {}), **tags}
            if settings.seed_per_trial:
                tcfg.seed = int(base.seed) + (retry_of if retry_of is not None else trial.number)
            # A retry continues the dead trial's last checkpoint, if it wrote one; a new trial always starts fresh
            # (even when this worker was itself requeued with resume=auto).
            tcfg.resume = "auto" if retry_of is not None else None

        inherited = set(frozen.intermediate_values)  # a retry carries the dead trial's reports

        def on_eval(step: int, metrics: dict) -> None:
            if metric in metrics and math.isfinite(metrics[metric]):
                if step not in inherited:
                    trial.report(float(metrics[metric]), step)
                if trial.should_prune():
                    raise _Pruned(f"pruned at step {step}: {metric} = {metrics[metric]:.4f}")

        try:
            value = run(tcfg, on_eval=on_eval)
            if value is None or not math.isfinite(value):
                raise RuntimeError(f"the run did not produce a finite {metric} (got {value})")
        except Preempted:
            # SIGTERM (or submitit's USR2): the run has checkpointed. Leave the trial RUNNING, so that it goes
            # stale and is re-queued with resume=auto when the study restarts (or submitit requeues this worker).
            hand_back_to_submitit()  # in a submitit job this requeues the worker and exits here
            raise SystemExit(143)
        except _Pruned as exc:
            runs.finish_trial(trial_dir, trial.number, "PRUNED", None, None, name, tags)
            log.info("trial %d %s", trial.number, exc)
            raise optuna.TrialPruned(str(exc)) from None
        except Exception:
            runs.finish_trial(trial_dir, trial.number, "FAIL", None, traceback.format_exc(), name, tags)
            raise  # Optuna records the trial as FAIL; catch= below keeps the study going
        finally:
            gc.collect()
            _empty_cuda_cache()
        runs.finish_trial(trial_dir, trial.number, "COMPLETE", value, None, name, tags)
        return value

    def budget_reached() -> bool:
        return _count(study, TrialState.COMPLETE, TrialState.PRUNED) >= settings.n_trials

    def after_trial(study_, trial) -> None:
        finished = _count(study, TrialState.COMPLETE, TrialState.PRUNED)
        if runs.parent:
            runs.parent.log_metrics({"trials/finished": finished, "trials/failed": _count(study, TrialState.FAIL),
                                     "trials/pruned": _count(study, TrialState.PRUNED),
                                     **({"best_value": study.best_value} if _count(study, TrialState.COMPLETE) else {})},
                                    step=trial.number)
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
                       overrides=_trial_overrides(best.params), run_dir=best.user_attrs.get("run_dir"))
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
