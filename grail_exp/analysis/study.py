"""A study on disk: every finished arm writes its evaluation summary to ``<study.dir>/<arm>/`` at once, a restarted
study skips the arms already there, and ``python -m grail_exp.report runs.dir=<study.dir>`` reads them.

Long comparisons on a shared machine get stopped. With ``study.dir`` set (sweeps/real_model_study.sh sets it), a
training job

1. first looks for ``<study.dir>/<arm>/arm.json``: if it is there and was written with the same configuration, the
   job returns its recorded metrics without training (no MLflow run, no model load; a key the record lacks because
   it was added to the configuration later counts as its schema default); if it was written with another
   configuration, the job stops with a ``StudyError`` naming the keys that differ (never silently mixed);
2. otherwise trains as usual (``resume=auto`` continues its last checkpoint), and after its final evaluation writes
   the arm's folder, atomically (a temporary folder renamed into place, ``arm.json`` inside it):

   ``arm.json``               model, scheme, seed, run ids, the run directory (relative to ``paths.root_dir``), the
                              starting weights' sha256, the flat resolved
                              configuration (what pairing is checked on), the metrics before / after, phase times
   ``samples_before.parquet`` the evaluation before training, one row per sample (benchmark, problem_index,
                              sample_index, correct, extracted, n_tokens, completion, ...)
   ``samples_final.parquet``  the evaluation after training, same columns
   ``samples_step<N>.parquet`` each evaluation inside training (``trainer.eval_every``), same columns; it draws from
                              its own chunk seeds and puts every random stream back, so it changes nothing the training
                              computes (tested: the same arm with and without them trains bit-identically)
   ``history.csv``            the training curves (one row per optimiser step), from the run's MLflow metrics
                              (with ``logger=none``: the metrics the run logged, kept in memory)
   ``weights/step_*.parquet`` the per-token weight tables the loss used (positional profile, heatmaps)
   ``segments/<i>.diff``      the uncommitted change of a training segment that ran on a dirty tree

Provenance per training segment: each start or resume of the arm's training appends a line to
``<run dir>/study_segments.jsonl`` *when the segment starts* (the step it starts from, the time, the git commit and
whether the tree was dirty, and ``git diff HEAD`` when it was), and ``arm.json`` lists them under ``segments``: an arm
trained across several sessions names every commit that trained it.

The arm's name is ``study.arm`` or ``<model>-<scheme>-s<seed>``. Keys that cannot change what an arm computes
(paths, logging, thread count, resume) may differ between the first start and a restart (``NOT_IDENTITY``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from grail_exp.errors import UserError

log = logging.getLogger("grail_exp.analysis.study")

ARM_FILE = "arm.json"
DASH = "—"
# Flat config keys (prefixes) that may change between a study's start and its restart: where files go, how runs are
# logged, how many threads compute, whether to resume, which recipe files stated the values (recipe.*: the resolved
# values themselves are the identity, wherever they were stated), where freed heap is returned, whether a
# leading-rows backward computes its rows only (advantage.probe_rows_only before trainer.narrow_backward), whether the
# prompts' common prefix is computed once (the same numbers up to summation order, as any change of the code between a start
# and its restart). Everything else is the arm's identity.
NOT_IDENTITY = ("paths.", "hydra.", "logger.", "study.", "recipe.", "resume", "trainer.num_threads",
                "trainer.progress_log_every", "trainer.backward_heap_returns", "trainer.narrow_backward",
                "advantage.probe_rows_only", "trainer.share_prompt_prefix", "reward.num_workers",
                "optimized_metric")
HISTORY_KEYS = ("reward/mean", "accuracy", "completions/mean_length", "completions/truncated_rate", "entropy",
                "loss", "grad_norm", "frac_reward_zero_std", "weights/mean", "clip_ratio/region_mean",
                "timing/step_s", "timing/step_cpu_s", "timing/rollout_s", "timing/scheme_s", "timing/update_s",
                "memory/peak_rss_gb")


class StudyError(UserError, ValueError):
    """A study folder that does not fit the job or the report (another configuration, a missing or broken file)."""


def arm_name(cfg) -> str:
    return str(cfg.study.arm) if cfg.study.get("arm") else f"{cfg.model.name}-{cfg.advantage.name}-s{cfg.seed}"


def arm_dir(cfg) -> Path | None:
    return Path(cfg.study.dir) / arm_name(cfg) if cfg.get("study") is not None and cfg.study.get("dir") else None


def comparable(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat configuration without what cannot change what an arm computes: ``NOT_IDENTITY``, and the settings of an
    engine the arm does not sample with (an HF arm's ``rollout.vllm.*``, whose defaults change with vLLM's)."""
    keep = {k: v for k, v in flat.items() if not k.startswith(NOT_IDENTITY)}
    if keep.get("rollout.engine", "vllm") != "vllm":
        keep = {k: v for k, v in keep.items() if not k.startswith("rollout.vllm.")}
    return keep


def identity(cfg) -> dict[str, Any]:
    """The flat resolved configuration minus ``NOT_IDENTITY``, as JSON values (what a restart must match). A value
    that is an absolute path (a model directory) is written as it travels (grail_exp/analysis/portable.py: relative to
    ``paths.root_dir`` or to the code's checkout, or with its machine-specific head named), so the record commits
    without a machine's paths and a restart compares like with like; a reader opens such a path with
    ``grail_exp.analysis.portable.resolve_recorded``."""
    from omegaconf import OmegaConf

    from grail_exp.analysis.portable import code_root, portable_text
    from grail_exp.tracking import flatten

    container = OmegaConf.to_container(cfg, resolve=True)
    flat = comparable(flatten(container))
    root = cfg.paths.root_dir if cfg.get("paths") is not None and cfg.paths.get("root_dir") else None
    values = json.loads(json.dumps(flat, default=str))
    # the project is paths.root_dir and the checkout the code runs from (a shipped model directory lies in the latter)
    return {k: portable_text(v, root, (code_root(),)) if isinstance(v, str) else v for k, v in values.items()}


def differences(a: dict, b: dict, limit: int = 12) -> list[str]:
    """``key: a vs b`` for every key whose values differ (absent on one side: ``<absent>``), sorted by key."""
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
    out = [f"{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}" for k in keys[:limit]]
    return out + ([f"... and {len(keys) - limit} more"] if len(keys) > limit else [])


def schema_defaults(scheme: str | None = None, estimator: str | None = None) -> dict[str, Any]:
    """The flat default of every key the run schema types (grail_exp/config.py ``RunConfig``'s groups, and the
    dataclass of ``scheme`` / ``estimator`` under ``advantage.`` / ``estimator.``), as JSON values like
    :func:`identity`: what a key that did not exist yet when an arm was recorded stood for then."""
    import dataclasses
    import typing

    from omegaconf import OmegaConf

    from grail_exp.advantages import SCHEMES
    from grail_exp.config import RunConfig
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.tracking import flatten

    groups = {f.name: hint for f in dataclasses.fields(RunConfig)
              if dataclasses.is_dataclass(hint := typing.get_type_hints(RunConfig)[f.name])}
    if scheme in SCHEMES:
        groups["advantage"] = SCHEMES[scheme].config_class
    if estimator in ESTIMATORS:
        groups["estimator"] = ESTIMATORS[estimator].config_class
    out: dict[str, Any] = {}
    for name, node in groups.items():
        container = OmegaConf.to_container(OmegaConf.structured(node), resolve=False)
        out.update({k: v for k, v in flatten(container, f"{name}.").items() if v != "???"})
    return json.loads(json.dumps(out, default=str))


def with_defaults(recorded: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` with every key it lacks that ``current`` has filled in with its schema default (keys added to
    the configuration after the arm was recorded); a key without a schema default stays absent (a difference)."""
    added = {k: defaults[k] for k in current if k not in recorded and k in defaults}
    return {**recorded, **added}


def finished(cfg) -> dict | None:
    """The arm's record when this job's arm already finished with the same configuration; None when it has not.

    A key the record lacks counts as its schema default (:func:`schema_defaults`): an arm recorded before the key
    existed ran with what the default does. Raises ``StudyError`` when the folder holds an arm finished with another
    configuration."""
    folder = arm_dir(cfg)
    if folder is None or not (folder / ARM_FILE).is_file():
        return None
    record = read_arm(folder)
    recorded = comparable(record["config"])  # by an older version
    current = identity(cfg)
    est = cfg.get("estimator")
    defaults = schema_defaults(str(cfg.advantage.name), str(est.name) if est is not None and "name" in est else None)
    diff = differences(with_defaults(recorded, current, defaults), current)
    if diff:
        raise StudyError(f"{folder / ARM_FILE}: this arm finished with another configuration (recorded vs this "
                         f"job): {'; '.join(diff)}. Move the folder away, or set study.dir / study.arm to another one")
    return record


def _history(tracker) -> Any:
    """The run's training curves (one row per step): its MLflow metrics, or without an MLflow run (``logger=none``)
    the metrics the tracker kept in memory; None when there are neither."""
    import pandas as pd

    client, run_id = getattr(tracker, "client", None), getattr(tracker, "run_id", None)
    if client is not None and run_id is not None:
        from grail_exp.analysis.plots import fetch_histories

        hist = fetch_histories(client, [run_id], HISTORY_KEYS)[run_id]
        frame = pd.DataFrame({k: pd.Series(v, index=s) for k, (s, v) in hist.items()})
    elif getattr(tracker, "history", None):
        frame = pd.DataFrame.from_dict(tracker.history, orient="index")
        frame = frame[[k for k in HISTORY_KEYS if k in frame.columns]].dropna(how="all")  # steps that logged only others
    else:
        return None
    frame = frame.sort_index()
    frame.index.name = "step"
    return frame


def write_arm(cfg, *, run_dir: Path, start_sha256: str | None, metrics: dict, tracker) -> Path:
    """The finished arm's folder (see the module docstring), written into a temporary folder and renamed into place."""
    from grail_exp.analysis.portable import portable_path
    from grail_exp.tracking import code_tags

    folder = arm_dir(cfg)
    if not (run_dir / "eval" / "final" / "samples.parquet").is_file():  # refused before anything is written
        raise StudyError(f"{run_dir}/eval/final/samples.parquet: no final evaluation to record for study arm "
                         f"{folder.name} (trainer.eval_at_end must be true in a study)")
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in sorted((run_dir / "eval").glob("*/samples.parquet")):  # before, final and each step<N> in training
        shutil.copy2(src, tmp / f"samples_{src.parent.name}.parquet")
    before = run_dir / "eval" / "before" / "metrics.json"
    if before.is_file() and not any(k.startswith("eval_before/") for k in metrics):  # evaluated before a resume
        metrics = {**metrics, **{k.replace("eval/", "eval_before/", 1): v for k, v in json.loads(before.read_text()).items()}}
    history = _history(tracker)
    if history is not None:
        history.to_csv(tmp / "history.csv")
    segments = read_segments(run_dir)
    for i, seg in enumerate(segments):
        if seg.get("diff"):
            (tmp / "segments").mkdir(exist_ok=True)
            shutil.copy2(run_dir / f"segment_{i}.diff", tmp / seg["diff"])
    weights = sorted((run_dir / "weights").glob("step_*.parquet"))
    if weights:
        (tmp / "weights").mkdir()
        for f in weights:
            shutil.copy2(f, tmp / "weights" / f.name)
    record = {
        "arm": folder.name, "model": str(cfg.model.name), "scheme": str(cfg.advantage.name), "seed": str(cfg.seed),
        "status": "FINISHED", "run_id": getattr(tracker, "run_id", None),
        "parent_run_id": _parent_of(tracker), "run_dir": portable_path(run_dir, cfg.paths.root_dir),
        "start_weights_sha256": start_sha256, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code": code_tags(), "segments": segments, "metrics": metrics, "config": identity(cfg),
        "files": {f.relative_to(tmp).as_posix(): _file_sha256(f) for f in sorted(tmp.rglob("*")) if f.is_file()},
    }
    (tmp / ARM_FILE).write_text(json.dumps(record, indent=1, default=float))
    if folder.exists():  # a folder without arm.json is debris of nothing (arms are renamed into place whole)
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    log.info("study: arm %s recorded in %s", folder.name, folder)
    return folder


SEGMENTS_FILE = "study_segments.jsonl"


def record_segment(cfg, run_dir: Path, start_step: int) -> dict:
    """Append this training segment's provenance to ``<run dir>/study_segments.jsonl`` (rank 0, at the segment's
    start, before any training): the step it starts from, the time, the commit and dirty flag of the code that runs
    it, and the uncommitted diff when the tree is dirty (so a recorded arm never depends on a commit nobody has)."""
    from grail_exp.tracking import code_tags, uncommitted_diff

    tags = code_tags()
    seg = {"start_step": int(start_step), "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "git_commit": tags.get("git.commit", "unknown"), "git_dirty": tags.get("git.dirty", "unknown")}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SEGMENTS_FILE
    index = len(read_segments(run_dir))
    if seg["git_dirty"] == "true":
        diff_name = f"segment_{index}.diff"
        (run_dir / diff_name).write_text(uncommitted_diff())
        seg["diff"] = f"segments/{index}.diff"
    with open(path, "a") as fh:
        fh.write(json.dumps(seg) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return seg


def read_segments(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / SEGMENTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _parent_of(tracker) -> str | None:
    client, run_id = getattr(tracker, "client", None), getattr(tracker, "run_id", None)
    if client is None or run_id is None:
        return None
    return client.get_run(run_id).data.tags.get("mlflow.parentRunId")


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_arm(folder: str | os.PathLike) -> dict:
    """An arm's record with its files checked against the sha256 it recorded (``StudyError`` naming the file)."""
    folder = Path(folder)
    try:
        record = json.loads((folder / ARM_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StudyError(f"{folder / ARM_FILE}: unreadable study record ({exc})") from exc
    for name, sha in record.get("files", {}).items():
        path = folder / name
        if not path.is_file() or _file_sha256(path) != sha:
            raise StudyError(f"{path}: missing or changed since the arm was recorded (sha256 {sha[:12]}...)")
    return record


def read_study(directory: str | os.PathLike) -> list[tuple[Path, dict]]:
    """Every finished arm under ``directory`` (folders holding ``arm.json``), in name order."""
    root = Path(directory)
    if not root.is_dir():
        raise StudyError(f"runs.dir={str(root)!r}: no such study folder")
    return [(f.parent, read_arm(f.parent)) for f in sorted(root.glob(f"*/{ARM_FILE}"))]


def choose_lr(folder: str | os.PathLike, out: str | os.PathLike, expected: list[str],
              metric: str = "eval/arithmetic_val/acc") -> dict:
    """The learning rate of a sweep folder's arms with the best ``metric`` (ties: the smaller), written to ``out``.

    Every value of ``expected`` must have a finished arm (a stopped sweep is finished first, never cut short)."""
    arms = [arm for _, arm in read_study(folder)]
    found = {float(a["config"]["optim.lr"]): a for a in arms}
    missing = [x for x in expected if float(x) not in found]
    if missing:
        raise StudyError(f"{folder}: no finished arm for optim.lr = {', '.join(missing)}; run the sweep to its end")
    rows = sorted(({"lr": lr, "value": float(a["metrics"][metric]), "arm": a["arm"]} for lr, a in found.items()
                   if any(float(x) == lr for x in expected)), key=lambda r: (-r["value"], r["lr"]))
    steps = {int(a["config"]["trainer.max_steps"]) for a in arms}
    choice = {"lr": rows[0]["lr"], "metric": metric, "rule": "the best metric, ties to the smaller lr",
              "steps": sorted(steps), "candidates": sorted(rows, key=lambda r: r["lr"])}
    Path(out).write_text(json.dumps(choice, indent=1) + "\n")
    log.info("learning rate chosen: %s (%s = %.3f)", choice["lr"], metric, rows[0]["value"])
    print(json.dumps(choice))
    return choice


def step1_reward(history) -> float | None:
    """The mean training reward of step 1 in an arm's curves (a DataFrame indexed by step), or None without it."""
    if history is None or 1 not in history.index or "reward/mean" not in history:
        return None
    return float(history.loc[1, "reward/mean"])


def first_rollouts(directory: str | os.PathLike, schemes: list[str]) -> dict:
    """Per seed of a study folder: each scheme's step-1 mean training reward (``history.csv``), whether the seed is
    complete (an arm of every scheme in ``schemes``) and whether its arms drew the same first rollouts (equal step-1
    rewards: step 1 samples from the shared starting weights with the seed's stream, before any scheme acts).
    Printed as one table and returned as ``{"seeds": {seed: {...}}, "complete": [...], "equal": bool}``."""
    seeds: dict[str, dict] = {}
    for folder, arm in read_study(directory):
        path = folder / "history.csv"
        history = None
        if path.is_file():
            import pandas as pd

            history = pd.read_csv(path, index_col="step")
        seeds.setdefault(str(arm["seed"]), {})[arm["scheme"]] = step1_reward(history)
    out = {}
    for seed in sorted(seeds, key=lambda s: (len(s), s)):
        got = seeds[seed]
        complete = all(s in got for s in schemes)
        rewards = {got[s] for s in schemes if got.get(s) is not None}
        out[seed] = {"step1_reward": got, "complete": complete, "equal": complete and len(rewards) == 1}
    result = {"seeds": out, "complete": [s for s, r in out.items() if r["complete"]],
              "equal": all(r["equal"] for r in out.values() if r["complete"])}
    print("| seed | " + " | ".join(f"{s} step-1 reward" for s in schemes) + " | complete | same first rollouts |")
    print("|--:|" + "--:|" * len(schemes) + "---|---|")
    for seed, r in out.items():
        cells = [DASH if r["step1_reward"].get(s) is None else f"{r['step1_reward'][s]:.4f}" for s in schemes]
        print(f"| {seed} | " + " | ".join(cells) + f" | {'yes' if r['complete'] else 'no'} | "
              + ("yes" if r["equal"] else ("no" if r["complete"] else DASH)) + " |")
    return result

