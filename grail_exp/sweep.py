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
Optuna studies (``python -m grail_exp.tune``) make their own parent: the callback leaves them alone.
"""

from __future__ import annotations

import logging
import socket
from collections import Counter
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class MlflowParentRun(Callback):
    def __init__(self) -> None:
        self.tracker = None  # the parent run's tracker, in the launching process only

    def __getstate__(self) -> dict:  # submitit pickles the callbacks into every job: never the MLflow client
        return {**self.__dict__, "tracker": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from grail_exp.tracking import (MlflowTracker, artifact_location_for, code_tags, read_parent_file,
                                        tracking_uri_for, write_parent_file)

        logger_cfg = config.get("logger")
        if logger_cfg is None or logger_cfg.get("name") != "mlflow" or config.get("tune") is not None:
            return
        hc = config.hydra
        overrides = list(hc.overrides.task)
        uri = tracking_uri_for(config)
        tags = {"host": socket.gethostname(), **code_tags(),
                **{str(k): str(v) for k, v in (logger_cfg.get("tags") or {}).items()}, "grail_exp.role": "sweep", "sweep.dir": str(hc.sweep.dir), "sweep.overrides": " ".join(overrides)[:5000],
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

    def _continue(self, previous: dict | None, uri: str, logger_cfg, name: str, artifacts: str, overrides) -> bool:
        """Reopen the parent run an earlier start of this sweep directory made (same store); False if there is none."""
        from mlflow.tracking import MlflowClient

        from grail_exp.tracking import MlflowTracker

        if previous is None or previous.get("tracking_uri") != uri:
            return False
        try:
            old = MlflowClient(tracking_uri=uri).get_run(previous["run_id"])
        except Exception:  # the store was replaced or the run deleted: a new parent
            return False
        self.tracker = MlflowTracker(uri, logger_cfg.experiment_name, name, artifacts, run_id=previous["run_id"])
        restarts = int(old.data.tags.get("sweep.restarts", 0)) + 1
        self.tracker.set_tags({"sweep.restarts": restarts,
                               f"sweep.overrides_restart{restarts}": " ".join(overrides)[:5000]})
        log.info("MLflow parent run %s continued (restart %d of this sweep directory)", self.tracker.run_id, restarts)
        return True

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
