"""One MLflow parent run per multirun: a Hydra callback (``hydra.callbacks`` in conf/hydra/default.yaml).

``on_multirun_start`` runs once, in the process that launches the sweep, before any job: it creates the parent
run and writes its id to ``<sweep dir>/mlflow_parent_run.json``; a multirun restarted in the same sweep directory
(a stopped study, rerun with ``resume=auto``) continues that parent run instead, so its jobs old and new stay one
study. Every job (in this process with the basic
launcher, or in submitit's processes, on any node that sees the sweep directory) reads that file in
``tracking.build_tracker`` and nests its run under the parent. ``on_multirun_end`` counts the children by
status (a failed job is a FAILED child with its traceback; the sweep goes on) and closes the parent.

The parent carries the sweep's command-line overrides, directory, launcher, the code tags of every run
(git commit, versions, host) and ``logger.tags`` (so a study spread over several multiruns can share a tag).
Optuna studies (``python -m grail_exp.tune``) make their own parent (``StudyRuns``, below): the callback leaves them
alone. ``StudyRuns`` also finds each trial's child run and keeps it in agreement with Optuna's record of the trial
(``reconcile``: the crash consistency of grail_exp/tune.py).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import uuid
from collections import Counter
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from grail_exp import faults

log = logging.getLogger(__name__)


class MlflowParentRun(Callback):
    def __init__(self) -> None:
        self.tracker = None  # the parent run's tracker, in the launching process only

    def __getstate__(self) -> dict:  # submitit pickles the callbacks into every job: never the MLflow client
        return {**self.__dict__, "tracker": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from grail_exp.tracking import (
            MlflowTracker,
            artifact_location_for,
            code_tags,
            read_parent_file,
            tracking_uri_for,
            write_parent_file,
        )

        logger_cfg = config.get("logger")
        if logger_cfg is None or logger_cfg.get("name") != "mlflow" or config.get("tune") is not None:
            return
        hc = config.hydra
        overrides = list(hc.overrides.task)
        uri = tracking_uri_for(config)
        tags = {"host": socket.gethostname(), **code_tags(),
                **{str(k): str(v) for k, v in (logger_cfg.get("tags") or {}).items()},
                "grail_exp.role": "sweep", "sweep.dir": str(hc.sweep.dir), "sweep.overrides": " ".join(overrides)[:5000],
                "sweep.launcher": str(hc.runtime.choices.get("hydra/launcher", "basic")), "task_name": str(config.task_name)}
        name = f"sweep-{config.task_name}-{str(hc.sweep.dir).rstrip('/').rsplit('/', 1)[-1]}"
        previous = read_parent_file(hc.sweep.dir)
        again = previous is not None and previous.get("tracking_uri") == uri
        self.tracker = MlflowTracker(uri, logger_cfg.experiment_name, name, artifact_location_for(config), tags,
                                     run_id=previous["run_id"] if again else None)
        if again:
            restarts = int(self.tracker.client.get_run(self.tracker.run_id).data.tags.get("sweep.restarts", 0)) + 1
            self.tracker.set_tags({"sweep.restarts": restarts, f"sweep.overrides_restart{restarts}": " ".join(overrides)[:5000]})
            log.info("MLflow parent run %s continued (restart %d of this sweep directory)", self.tracker.run_id, restarts)
            return
        self.tracker.log_text("\n".join(overrides) + "\n", "sweep/overrides.txt")
        self.tracker.log_text(OmegaConf.to_yaml({k: v for k, v in config.items() if k != "hydra"}, resolve=False),
                              "sweep/base_config.yaml")
        path = write_parent_file(hc.sweep.dir, self.tracker.run_id, uri)
        log.info("MLflow parent run %s for this sweep (%s)", self.tracker.run_id, path)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.tracker is None:
            return
        from grail_exp.tracking import child_runs

        try:
            counts = Counter(r.info.status for r in child_runs(self.tracker, self.tracker.run_id))
            self.tracker.set_tags({"sweep.jobs": sum(counts.values()),
                                   **{f"sweep.jobs_{s.lower()}": n for s, n in sorted(counts.items())}})
            if counts.get("FAILED"):
                log.warning("%d of %d jobs of this sweep FAILED (see their error/traceback.txt in MLflow)",
                            counts["FAILED"], sum(counts.values()))
        finally:
            self.tracker.end("FINISHED")
            self.tracker = None


# ---------------------------------------------------------------------------------------------- Optuna studies
def trial_overrides(params: dict) -> str:
    """A trial's parameters as the command-line overrides that reproduce it (``optuna.params``)."""
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in params.items())


class StudyRuns:
    """An Optuna study's MLflow parent run (one per study: its id is a study attribute, so restarts and other workers
    reuse it) and the lookup of each trial's child run (no-ops with logger=none). ``settings``: the study's
    ``tune`` settings (grail_exp/tune.py); ``storage``: the Optuna storage URL without its password."""

    def __init__(self, cfg: DictConfig, settings, study, storage: str, metric: str):
        self.parent = None
        if cfg.logger.name == "none":
            return
        from grail_exp.tracking import MlflowTracker, artifact_location_for, code_tags, tracking_uri_for

        uri, exp, art = tracking_uri_for(cfg), cfg.logger.experiment_name, artifact_location_for(cfg)
        self.uri = uri
        existing = study.user_attrs.get("mlflow_parent_run_id")
        if existing and self._exists(uri, existing):
            self.parent = MlflowTracker(uri, exp, "", art, run_id=existing)
            log.info("continuing the study's MLflow parent run %s", existing)
            return
        # The parent run is written to MLflow before its id goes to Optuna. A token written to Optuna first and
        # tagged on the parent finds a parent whose worker died between the two writes, instead of making a second.
        if not study.user_attrs.get("mlflow_parent_token"):
            study.set_user_attr("mlflow_parent_token", uuid.uuid4().hex)
        token = study.user_attrs["mlflow_parent_token"]
        orphan = self._find_parent(uri, exp, token)
        if orphan is not None:
            study.set_user_attr("mlflow_parent_run_id", orphan)
            self.parent = MlflowTracker(uri, exp, "", art, run_id=orphan)
            log.info("adopting the study's MLflow parent run %s (its worker died before recording it)", orphan)
            return
        tags = {"host": socket.gethostname(), **code_tags(), "optuna.parent_token": token,
                **{str(k): str(v) for k, v in (cfg.logger.get("tags") or {}).items()},
                "grail_exp.role": "study", "optuna.study_name": settings.study_name,
                "optuna.storage": storage, "optuna.direction": settings.direction,
                "optuna.metric": metric, "model": str(cfg.model.name), "scheme": str(cfg.advantage.name)}
        mine = MlflowTracker(uri, exp, f"study-{settings.study_name}", art, tags)
        faults.tune_kill("parent_created", -1)
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
    def _find_parent(uri: str, experiment_name: str, token: str) -> str | None:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(experiment_name)
        if exp is None:
            return None
        found = client.search_runs([exp.experiment_id], f"tags.`optuna.parent_token` = '{token}'", max_results=1,
                                   order_by=["attributes.start_time ASC"])
        return found[0].info.run_id if found else None

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

    def _children(self, filter_string: str = "") -> list:
        """Child runs of the study's parent run (newest first), optionally narrowed by an MLflow filter."""
        where = f"tags.`mlflow.parentRunId` = '{self.parent.run_id}'" + (f" and {filter_string}" if filter_string else "")
        return self.parent.client.search_runs([self.parent.experiment_id], where, max_results=50000,
                                              order_by=["attributes.start_time DESC"])

    def run_of(self, info):
        """The child run that this execution of a trial (``info``: its number, trial_dir, tags, error and whether it
        resumes a checkpoint; grail_exp/tune.py) created or resumed, or None if it never got that far: the
        one tagged with the trial's number, else (a retry continuing the dead trial's checkpoint with
        ``resume=auto``, which reuses its MLflow run) the newest run of the trial directory."""
        runs = self._children(f"tags.`optuna.trial_dir` = '{info.trial_dir}'")
        for run in runs:
            if run.data.tags.get("optuna.trial_number") == str(info.number):
                return run
        return runs[0] if runs and info.resumes_checkpoint else None

    def record(self, trial, info) -> None:
        """Copy the outcome that Optuna has just stored for ``trial`` to its child run."""
        if self.parent:
            self._agree(trial, self.run_of(info), info.tags, info.error)

    def reconcile(self, study, only: int | None = None) -> None:
        """Make every finished trial's child run agree with Optuna (the record), whatever a crash left behind:
        status and ``optuna.state`` from the trial's state, ``optuna/value``; a FAIL trial without a child run gets
        a FAILED one. Idempotent; a trial still RUNNING (a live worker) is left alone, and so is any run of its
        directory (a live retry continuing a dead trial's run). ``only``: one trial's number."""
        if not self.parent:
            return
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        live_dirs = {t.user_attrs.get("run_dir") for t in trials if t.state == TrialState.RUNNING}
        by_number: dict[str, list] = {}
        continued = set()
        for run in self._children():
            by_number.setdefault(run.data.tags.get("optuna.trial_number"), []).append(run)
            if "optuna.continues_trial" in run.data.tags:
                continued.add(run.data.tags["optuna.continues_trial"])
        for t in trials:
            if t.state.name not in CHILD_STATUS or (only is not None and t.number != only):
                continue
            mine = [r for r in by_number.get(str(t.number), []) if r.data.tags.get("optuna.trial_dir") not in live_dirs]
            if not mine and (str(t.number) in continued or t.user_attrs.get("run_dir") in live_dirs):
                continue  # its run is continued by a retry, which records it
            tags = self._trial_tags(study, t)
            note = ("reconciled with Optuna: the trial is FAIL there; its worker died (no heartbeat, or between "
                    "Optuna's write and this one) before it recorded the failure here\n")
            for run in mine or [None]:
                if not self._agrees(t, run):
                    log.warning("trial %d: MLflow run %s disagreed with Optuna (%s); set to %s", t.number,
                                run.info.run_id if run else "(none)", child_state(run), t.state.name)
                    self._agree(t, run, tags, note if t.state == TrialState.FAIL else None)

    @staticmethod
    def _trial_tags(study, trial) -> dict:
        tags = {"grail_exp.role": "trial", "optuna.study_name": study.study_name,
                "optuna.trial_number": str(trial.number), "optuna.params": trial_overrides(trial.params)}
        if trial.user_attrs.get("run_dir"):
            tags["optuna.trial_dir"] = trial.user_attrs["run_dir"]
        if trial.system_attrs.get("failed_trial") is not None:
            tags["optuna.retry_of"] = str(trial.system_attrs["failed_trial"])
        return tags

    @staticmethod
    def _agrees(trial, run) -> bool:
        if run is None:
            return False
        if (run.info.status, run.data.tags.get("optuna.state")) != (CHILD_STATUS[trial.state.name], trial.state.name):
            return False
        return trial.value is None or not math.isfinite(trial.value) or \
            run.data.metrics.get("optuna/value") == float(trial.value)

    def _agree(self, trial, run, tags: dict, error: str | None) -> None:
        """Write Optuna's outcome of ``trial`` to ``run`` (a new FAILED child run if None and the trial failed)."""
        state = trial.state.name
        client = self.parent.client
        if run is None:
            if state != "FAIL":
                return  # an outcome without a run never happens: the run is made before training
            name = f"{tags.get('optuna.study_name')}-trial{trial.number}"
            run_id = client.create_run(self.parent.experiment_id, run_name=name,
                                       tags={**tags, "mlflow.parentRunId": self.parent.run_id}).info.run_id
            status = None
        else:
            run_id, status = run.info.run_id, run.info.status
            before = run.data.tags.get("optuna.trial_number")
            if before is not None and before != str(trial.number):  # a retry took over the dead trial's run
                client.set_tag(run_id, "optuna.continues_trial", before)
        client.set_tag(run_id, "optuna.trial_number", str(trial.number))
        client.set_tag(run_id, "optuna.state", state)
        if "optuna.retry_of" in tags:  # a retry that resumed the dead trial's run: say which trial that was
            client.set_tag(run_id, "optuna.retry_of", tags["optuna.retry_of"])
        if trial.value is not None and math.isfinite(trial.value):
            client.log_metric(run_id, "optuna/value", float(trial.value))
        if error is not None:
            client.log_text(run_id, error, "error/traceback.txt")
        if status != CHILD_STATUS[state]:
            client.set_terminated(run_id, CHILD_STATUS[state])


# Optuna's state of a finished trial -> the status of its MLflow child run (``optuna.state`` is the state itself).
CHILD_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def child_state(run) -> str:
    return "no child run" if run is None else f"{run.info.status}, optuna.state={run.data.tags.get('optuna.state')}"
