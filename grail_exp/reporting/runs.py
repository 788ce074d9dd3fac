"""Which runs the report reads: MLflow runs or a study folder's arms, one ``RunRecord`` per (model, scheme, seed) with
its per-sample results, the design check that makes them one study, the per-problem values of a metric, and the
footnotes on pairs that are not common random numbers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from grail_exp.analysis import metrics as M
from grail_exp.config import ConfigError
from grail_exp.errors import DataError
from grail_exp.reporting.schema import parse_metric


def arm_scheme(scheme: str, params: dict) -> str:
    """The row label of a run's scheme: ``grail+per_rollout`` when its weights were computed once per rollout batch
    (``advantage.recompute=per_rollout``), a different arm from the faithful per-update one. Batch-level schemes
    (DelTA, SHEAR) are per rollout by construction: no suffix."""
    from grail_exp.advantages import SCHEMES

    by_design = scheme in SCHEMES and SCHEMES[scheme].batch_level
    if params.get("advantage.recompute") == "per_rollout" and not by_design:
        return f"{scheme}+per_rollout"
    return scheme


@dataclass
class RunRecord:
    run_id: str
    model: str
    scheme: str
    seed: str
    status: str
    start_time: int
    params: dict
    samples: Any = None  # pandas DataFrame of per-sample results once loaded
    artifact: str | None = None
    history: Any = None  # a study folder's training curves (DataFrame indexed by step); MLflow runs: fetched
    weights_dir: Path | None = None  # a study folder's weight tables; MLflow runs: downloaded
    folder: Path | None = None  # the study folder's arm this record was read from (nothing of it is in MLflow)
    frames: dict = field(default_factory=dict)  # a study arm's evaluations read so far, by step (endpoint.steps)


def letter(i: int) -> str:
    """0 -> a, 25 -> z, 26 -> aa, ..."""
    out = ""
    while True:
        out = chr(ord("a") + i % 26) + out
        i = i // 26 - 1
        if i < 0:
            return out


class Notes:
    """Lettered footnotes, deduplicated by text, in order of first use."""

    def __init__(self):
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return letter(self.texts.index(text))


def _field(run, keys: list[str]) -> str | None:
    for k in keys:
        if k in run.data.tags:
            return run.data.tags[k]
        if k in run.data.params:
            return run.data.params[k]
    return None


def search_runs(client, cfg: DictConfig) -> list:
    """The MLflow runs selected by ``cfg.runs`` (explicit ids, or experiments + parent + tag filters)."""
    sel = cfg.runs
    if sel.run_ids:
        return [client.get_run(r) for r in sel.run_ids]
    names = list(sel.experiment_names or [cfg.logger.experiment_name])
    exp_ids = []
    for name in names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise ConfigError(f"runs.experiment_names: no MLflow experiment {name!r} in this tracking store")
        exp_ids.append(exp.experiment_id)
    clauses = [f"tags.`{k}` = '{v}'" for k, v in dict(sel.tags).items()]
    if sel.parent_run_id:
        clauses.append(f"tags.`mlflow.parentRunId` = '{sel.parent_run_id}'")
    if sel.filter:
        clauses.append(sel.filter)  # MLflow filters have no OR: plain conjunction
    runs, token = [], None
    while True:
        page = client.search_runs(exp_ids, " and ".join(clauses), max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def select_runs(client, raw_runs: list, cfg: DictConfig, notes: Notes, tmp: Path):
    """Usable runs per (model, scheme, seed) and the row-level footnotes.

    Returns ``(arms, row_notes, ignored)``: ``arms[(model, scheme)][seed] = RunRecord`` with samples loaded;
    ``row_notes[(model, scheme)]`` footnote letters; ``ignored`` a list of sentences about runs that are not
    model/scheme runs (e.g. a sweep's parent run)."""
    import pandas as pd

    f = cfg.fields
    by_arm_seed: dict[tuple, list[RunRecord]] = defaultdict(list)
    ignored = []
    for run in raw_runs:
        if run.data.tags.get("job") == "report":
            continue  # our own output
        model, scheme, seed = _field(run, list(f.model)), _field(run, list(f.scheme)), _field(run, list(f.seed))
        if model is None or scheme is None:
            ignored.append(f"run {run.info.run_id} ({run.info.run_name}) names no model/scheme")
            continue
        scheme = arm_scheme(scheme, run.data.params)
        rec = RunRecord(run.info.run_id, model, scheme, seed if seed is not None else "?", run.info.status,
                        run.info.start_time or 0, dict(run.data.params))
        by_arm_seed[(model, scheme, rec.seed)].append(rec)

    arms: dict[tuple, dict[str, RunRecord]] = defaultdict(dict)
    row_notes: dict[tuple, list[str]] = defaultdict(list)
    for (model, scheme, seed), recs in by_arm_seed.items():
        arm = (model, scheme)
        chosen = None
        for rec in sorted(recs, key=lambda r: -r.start_time):  # the latest usable run of a seed wins
            if rec.status != "FINISHED":
                row_notes[arm].append(notes.mark(
                    f"{model} × {scheme}, seed {seed}: run {rec.run_id} is {rec.status}; not used"))
                continue
            path = _find_artifact(client, rec.run_id, list(cfg.samples_artifacts))
            if path is None:
                row_notes[arm].append(notes.mark(
                    f"{model} × {scheme}, seed {seed}: run {rec.run_id} has no per-sample artifact "
                    f"({', '.join(cfg.samples_artifacts)}); not used"))
                continue
            if chosen is None:
                local = client.download_artifacts(rec.run_id, path, str(tmp / rec.run_id))
                rec.samples, rec.artifact = pd.read_parquet(local), path
                _check_samples(rec)
                chosen = rec
            else:
                row_notes[arm].append(notes.mark(
                    f"{model} × {scheme}, seed {seed}: an older finished run {rec.run_id} of the same seed "
                    f"is ignored (the latest, {chosen.run_id}, is used)"))
        if chosen is not None:
            arms[arm][seed] = chosen
        else:
            arms.setdefault(arm, {})
    return arms, row_notes, ignored


def _find_artifact(client, run_id: str, candidates: list[str]) -> str | None:
    for path in candidates:
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        try:
            if any(a.path == path for a in client.list_artifacts(run_id, parent)):
                return path
        except Exception:
            continue
    return None


def _check_samples(rec: RunRecord) -> None:
    need = {"benchmark", "problem_index", "sample_index", "correct"}
    missing = need - set(rec.samples.columns)
    if missing:
        raise DataError(f"run {rec.run_id}: {rec.artifact} lacks columns {sorted(missing)}")


def select_study_arms(cfg: DictConfig, notes: Notes):
    """Like ``select_runs``, from a study folder (``runs.dir``): every arm recorded there is finished by
    construction (grail_exp/analysis/study.py writes an arm only after its final evaluation)."""
    import pandas as pd

    from grail_exp.analysis.study import read_study

    arms: dict[tuple, dict[str, RunRecord]] = defaultdict(dict)
    for folder, arm in read_study(cfg.runs.dir):
        params = {k: str(v) for k, v in arm["config"].items()}
        if arm.get("start_weights_sha256"):
            params["start_weights.sha256"] = arm["start_weights_sha256"]
        scheme = arm_scheme(arm["scheme"], params)
        rec = RunRecord(arm.get("run_id") or folder.name, arm["model"], scheme, str(arm["seed"]), arm["status"], 0,
                        params, artifact=str(folder / "samples_final.parquet"))
        rec.samples = pd.read_parquet(folder / "samples_final.parquet")
        rec.folder = folder
        _check_samples(rec)
        if (folder / "history.csv").is_file():
            rec.history = pd.read_csv(folder / "history.csv", index_col="step")
        rec.weights_dir = folder / "weights" if (folder / "weights").is_dir() else None
        key = (rec.model, rec.scheme)
        if rec.seed in arms[key]:
            raise ConfigError(f"runs.dir={cfg.runs.dir}: two arms record {rec.model} × {rec.scheme}, seed {rec.seed} "
                              f"({arms[key][rec.seed].artifact} and {rec.artifact}); keep one")
        arms[key][rec.seed] = rec
    return arms, defaultdict(list), []


def check_design(arms: dict, cfg: DictConfig) -> None:
    """``design_check.strict``: refuse (ConfigError) a study whose arms are not comparable, naming what differs.

    Compared: ``same_everywhere`` between the arms of a model, ``same_within_seed`` between the arms of a seed,
    ``same_within_scheme`` between the arms of a scheme. A key one arm lacks counts as its schema default
    (grail_exp/analysis/study.py ``schema_defaults``: an arm recorded before the key existed ran with what the default does).
    Refused too: a seed outside ``seeds``; and, when no ``seeds`` are declared, an arm without its baseline partner.
    A declared seed that still lacks arms (a study in progress) is not refused: the table footnotes it as missing and
    pairs only the seeds both arms have."""
    from fnmatch import fnmatch

    dc = cfg.design_check
    if not dc.strict:
        return
    within = lambda k: any(fnmatch(k, p) for p in dc.same_within_seed)  # noqa: E731
    in_scheme = lambda k: any(fnmatch(k, p) for p in dc.same_within_scheme) and not within(k)  # noqa: E731

    def everywhere(k):
        return any(fnmatch(k, p) for p in dc.same_everywhere) and not within(k) and not in_scheme(k)

    label = lambda r: f"{r.model} × {r.scheme}, seed {r.seed} ({r.run_id})"  # noqa: E731
    problems = []
    expected = {str(s) for s in cfg.seeds} if cfg.seeds else None
    by_model: dict[str, list] = defaultdict(list)
    by_seed: dict[tuple, list] = defaultdict(list)
    by_scheme: dict[tuple, list] = defaultdict(list)
    for (model, scheme), seeds in arms.items():
        base = arms.get((model, cfg.baseline), {})
        for seed, rec in seeds.items():
            by_model[model].append(rec)
            by_seed[(model, seed)].append(rec)
            by_scheme[(model, scheme)].append(rec)
            if expected is not None and seed not in expected:
                problems.append(f"{label(rec)}: seed {seed} is not one of seeds = {sorted(expected)}")
            if scheme != cfg.baseline and seed not in base and (expected is None or seed not in expected):
                problems.append(f"{label(rec)}: no {cfg.baseline} run of seed {seed} to pair it with")
    value = _param_or_default()
    for groups, keep in ((by_model, everywhere), (by_seed, within), (by_scheme, in_scheme)):
        for recs in groups.values():
            recs = sorted(recs, key=lambda r: (r.scheme != cfg.baseline, seed_key(r.seed), r.scheme))
            first = recs[0]
            for rec in recs[1:]:
                for k in sorted(k for k in set(first.params) | set(rec.params) if keep(k)):
                    a, b = value(first, k), value(rec, k)
                    if a != b:
                        problems.append(f"{k}: {a} in {label(first)} vs {b} in {label(rec)}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise ConfigError("the study's arms are not comparable (design_check.strict=true); they must share the "
                          "starting weights and training order within a seed, the scheme's settings within a "
                          "scheme, and evaluation, data and budget everywhere:\n"
                          + "\n".join(f"  - {p}" for p in shown))


def _param_or_default():
    """``value(rec, key)``: the run's parameter, else the key's schema default for the run's scheme (as a string,
    like the parameters), else ``<absent>``."""
    from grail_exp.analysis.study import schema_defaults

    cache: dict[tuple, dict] = {}

    def value(rec, key: str) -> str:
        if key in rec.params:
            return rec.params[key]
        kind = (rec.params.get("advantage.name"), rec.params.get("estimator.name"))
        if kind not in cache:
            cache[kind] = schema_defaults(*kind)
        return str(cache[kind][key]) if key in cache[kind] else "<absent>"

    return value


def seed_key(s: str):
    try:
        return (0, float(s), s)
    except ValueError:
        return (1, 0.0, s)


def per_problem_values(samples, spec: str) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """``{benchmark: (problem_indices, values, n)}`` for one metric; n = samples per problem (the largest).

    A benchmark where pass@k is undefined (some problem has fewer than k samples) is left out."""
    kind, k = parse_metric(spec)
    out = {}
    df = samples.sort_values(["benchmark", "problem_index", "sample_index"])
    for bench, part in df.groupby("benchmark", sort=False):
        groups = part.groupby("problem_index", sort=True)
        idx = np.array(list(groups.groups), dtype=np.int64)
        correct = [g["correct"].to_numpy(dtype=bool) for _, g in groups]
        n = max(len(c) for c in correct)
        if kind == "acc":
            vals = M.acc_at_n(correct)
        elif kind == "maj":
            answers = [list(g["extracted"]) if "extracted" in g else [None] * len(g) for _, g in groups]
            vals = M.maj_at_n(answers, correct)
        else:  # pass@k, or pass@n_i per problem
            if k is not None and min(len(c) for c in correct) < k:
                continue
            vals = np.array([M.pass_at_k(len(c), int(c.sum()), k or len(c)) for c in correct])
        out[str(bench)] = (idx, np.asarray(vals, dtype=np.float64), n)
    return out


def metric_label(spec: str, ns: set[int]) -> str:
    kind, k = parse_metric(spec)
    n = str(next(iter(ns))) if len(ns) == 1 else "n"
    return {"acc": f"acc@{n}", "maj": f"maj@{n}"}.get(kind, f"pass@{k if k is not None else n}")


def endpoint_samples(rec: RunRecord, steps, key: str = "endpoint.steps") -> list:
    """A study arm's evaluations at ``steps`` (EndpointConfig: step N is ``samples_step<N>.parquet``, the arm's last
    step ``trainer.max_steps`` its final evaluation ``samples_final.parquet``), read once; a step the arm did not
    evaluate is refused, naming ``key``, the arm and the steps it has."""
    import pandas as pd

    last = rec.params.get("trainer.max_steps")
    last = int(float(last)) if last not in (None, "None") else None
    out = []
    for step in steps:
        step = int(step)
        if step not in rec.frames:
            path = None
            if step == last:
                rec.frames[step] = rec.samples
            elif rec.folder is not None and (rec.folder / f"samples_step{step}.parquet").is_file():
                path = rec.folder / f"samples_step{step}.parquet"
                rec.frames[step] = pd.read_parquet(path)
            else:
                have = sorted(int(f.stem[len("samples_step"):]) for f in rec.folder.glob("samples_step*.parquet")) \
                    if rec.folder is not None else []
                have_text = ", ".join([str(h) for h in have] + ([f"{last} (final)"] if last is not None else []))
                where = rec.folder if rec.folder is not None else f"run {rec.run_id}"
                raise ConfigError(f"{key} = {[int(x) for x in steps]}: {rec.model} × {rec.scheme}, seed {rec.seed} "
                                  f"({where}) has no evaluation at step {step} (it has: {have_text or 'none'}); "
                                  f"declare steps every arm evaluated (trainer.eval_every) or leave the arm out")
            if path is not None:
                need = {"benchmark", "problem_index", "sample_index", "correct"} - set(rec.frames[step].columns)
                if need:
                    raise DataError(f"{path}: lacks columns {sorted(need)}")
        out.append(rec.frames[step])
    return out


def endpoint_values(rec: RunRecord, spec: str, steps, key: str = "endpoint.steps") -> dict:
    """``per_problem_values`` of the arm's endpoint: the final evaluation (``steps`` null), else each problem's value
    averaged over the evaluations at ``steps`` (acc@n averaged over checkpoints). Every evaluation must hold the same
    problems of the same benchmarks."""
    if steps is None:
        return per_problem_values(rec.samples, spec)
    per = [per_problem_values(frame, spec) for frame in endpoint_samples(rec, steps, key)]
    out = {}
    for bench, (idx, _, _) in per[0].items():
        parts = [p.get(bench) for p in per]
        if any(p is None or not np.array_equal(p[0], idx) for p in parts) or any(set(p) != set(per[0]) for p in per):
            raise DataError(f"{key} = {[int(x) for x in steps]}: {rec.model} × {rec.scheme}, seed {rec.seed} evaluated "
                            f"other problems or benchmarks at these steps; the endpoint averages one problem's values")
        out[bench] = (idx, np.mean([p[1] for p in parts], axis=0), max(p[2] for p in parts))
    return out


def pairing_notes(arms: dict, cfg: DictConfig, notes: Notes) -> dict[tuple, list[str]]:
    """Footnotes for paired runs whose evaluation settings differ (then the pairs are not common random numbers)."""
    out: dict[tuple, list[str]] = defaultdict(list)
    for (model, scheme), seeds in arms.items():
        base = arms.get((model, cfg.baseline), {})
        if scheme == cfg.baseline:
            continue
        for seed, rec in seeds.items():
            partner = base.get(seed)
            if partner is None:
                continue
            diff = [f"{k}: {rec.params[k]} vs {partner.params[k]}" for k in cfg.pairing_params
                    if k in rec.params and k in partner.params and rec.params[k] != partner.params[k]]
            if diff:
                out[(model, scheme)].append(notes.mark(
                    f"{model} × {scheme}, seed {seed}: evaluation settings differ from {cfg.baseline} "
                    f"({'; '.join(diff)}): paired by problem, but not with common random numbers"))
            first = first_step_rewards(rec, partner)
            if first is not None and first[0] != first[1]:
                out[(model, scheme)].append(notes.mark(
                    f"{model} × {scheme}, seed {seed}: step-1 training reward {first[0]:.4g} vs {first[1]:.4g} for "
                    f"{cfg.baseline}: the two arms' first rollouts differ, so training did not start from common "
                    f"random numbers (the same model and seed draw the same step-1 rollouts in every arm)"))
    return out


def first_step_rewards(rec: RunRecord, partner: RunRecord) -> tuple[float, float] | None:
    """The step-1 mean training reward of two arms of a seed, when both recorded their curves. Step 1's rollouts come
    from the shared starting weights and the seed's stream, before any scheme acted: equal in every arm of a seed."""
    from grail_exp.analysis.study import step1_reward

    got = step1_reward(rec.history), step1_reward(partner.history)
    return None if None in got else got
