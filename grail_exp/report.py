"""``python -m grail_exp.report``: the paper's table from MLflow runs, with paired statistics against a baseline.

    python -m grail_exp.report runs.parent_run_id=<id of a sweep's parent run>
    python -m grail_exp.report +runs.tags.task_name=paper_table output.name=paper_table_cpu
    python -m grail_exp.report 'runs.run_ids=[<id>,<id>,...]' baseline=grpo 'metrics=[acc,pass@3]'
    python -m grail_exp.report runs.dir=results/real_model_study/<study> design_check.strict=true   # a study folder

Rows are model × scheme, columns the benchmarks and their average (unweighted over benchmarks, as the GRAIL paper
reports), one table per metric (acc@n, pass@k, maj@n). Every non-baseline cell carries its Δ against the
baseline scheme trained on the same model and seeds; a second table gives each Δ with its paired 95 % interval,
the spread of the per-seed Δ, the seed-level tests that decide a star (paired t over seeds and the exact seed
sign-flip, with the smallest p it can reach; Holm-adjusted outside the declared ``primary_metric``) and the
per-problem sign-flip p ("these trained models only"); then each arm's truncation rate and mean completion length
(statistics: grail_exp/analysis/stats.py).

**Where the numbers come from.** Each training run's final evaluation logs its per-sample results
(``eval/final/samples.parquet``: benchmark, problem_index, sample_index, correct, extracted, ...). The report reads
them back, computes per-problem values (c/n for acc, the unbiased pass@k, majority vote), and pairs arm X with the
baseline by (seed, benchmark, problem_index): both arms of a seed answered the same problems, sampled from the same
per-chunk seeds (common random numbers, grail_exp/evaluate.py), so per-problem differences cancel most of the
sampling noise.

**A study folder** (``runs.dir``, written by training jobs with ``study.dir`` set, grail_exp/analysis/study.py) stands in for
MLflow: each finished arm's ``arm.json`` (model, scheme, seed, flat configuration, starting weights' sha256),
``samples_final.parquet``, ``history.csv`` and ``weights/`` give the same table and plots, from files that can be
committed with the results.

**A study that is not one is refused** with ``design_check.strict=true``: arms of a model must agree on every key
of ``design_check.same_everywhere`` (evaluation, data, budget, optimiser, ...), the arms of a seed on
``design_check.same_within_seed`` (starting weights, training order) and the arms of a scheme on
``design_check.same_within_scheme`` (``advantage.*``); a key an older arm lacks counts as its schema default; seeds
outside ``seeds`` are not allowed (without ``seeds``, every non-baseline seed needs its baseline run; with them, a
declared seed still missing arms is footnoted, not refused). The error names each key, its values and the runs that differ.
Without it, differing evaluation settings are footnoted (``pairing_params``).

**Nothing is dropped silently.** A run that is not FINISHED, has no per-sample artifact, lacks a benchmark, or has
no baseline partner for its seed is named in a lettered footnote, and the cells it would have filled read "—" or
say which seeds they use. Unpaired cells (no common seed) show the arm's value with "Δ —".
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from grail_exp.analysis import metrics as M
from grail_exp.analysis import stats
from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import ConfigError, LoggerConfig, PathsConfig, register_configs
from grail_exp.errors import DataError
from grail_exp.analysis.portable import portable_text

log = logging.getLogger("grail_exp.report")

AVG = "avg"
# The paper's benchmark order; other benchmarks follow alphabetically.
PAPER_ORDER = ["math500", "aime24", "amc23", "minerva_math", "college_math_200", "olympiadbench_200"]
_METRIC = re.compile(r"^(acc|maj|pass@(\d+|n))$")
DASH = "—"
ONE_SEED = "1 seed, problems only"  # a Δ of one trained pair: its tests resample problems only


def arm_scheme(scheme: str, params: dict) -> str:
    """The row label of a run's scheme: ``grail+per_rollout`` when its weights were computed once per rollout batch
    (``advantage.recompute=per_rollout``), a different arm from the faithful per-update one. Batch-level schemes
    (DelTA, SHEAR) are per rollout by construction: no suffix."""
    from grail_exp.advantages import SCHEMES

    by_design = scheme in SCHEMES and SCHEMES[scheme].batch_level
    if params.get("advantage.recompute") == "per_rollout" and not by_design:
        return f"{scheme}+per_rollout"
    return scheme


# ----------------------------------------------------------------------------------------------- config schema
# The report's schema (conf/report.yaml), beside its validator below; stored as ``report_schema`` when this module
# is imported (tests/conftest.compose imports it for config_name="report").
@dataclass
class RunSelection:
    """Which MLflow runs the report reads (all filters are ANDed)."""

    experiment_names: Optional[list[str]] = None  # experiments searched; null = [logger.experiment_name]
    run_ids: list[str] = field(default_factory=list)  # explicit runs; when given, the filters below are ignored
    parent_run_id: Optional[str] = None  # children of this run (tag mlflow.parentRunId): one sweep or study
    tags: dict = field(default_factory=dict)  # tag filters, e.g. {task_name: paper_table}
    filter: Optional[str] = None  # an extra MLflow search filter, e.g. "params.loss.beta = '0.0'"
    # A study folder instead of MLflow (grail_exp/analysis/study.py: one <arm>/arm.json + samples per finished arm); when
    # set, the filters above are not used
    dir: Optional[str] = None


@dataclass
class RunFields:
    """Where a run says what it is: the first run tag or param of each list that exists (run.py sets the tags)."""

    model: list[str] = field(default_factory=lambda: ["model", "model.name"])
    scheme: list[str] = field(default_factory=lambda: ["advantage", "advantage.name"])
    seed: list[str] = field(default_factory=lambda: ["seed"])


@dataclass
class StatsConfig:
    """Paired statistics (grail_exp/analysis/stats.py)."""

    n_boot: int = 10_000  # bootstrap replicates of the two-level (seeds × problems) paired bootstrap
    alpha: float = 0.05  # 1 − confidence level of the interval; also the significance level marked with *
    seed: int = 0  # RNG seed of the bootstrap and Monte-Carlo sign flips (the report is reproducible)
    n_perm: int = 10_000  # Monte-Carlo sign-flip patterns when the exact test is too large
    exact_max: int = 16  # exact sign-flip test (all 2^m patterns) up to m non-zero per-problem differences
    resample_seeds: bool = True  # resample training seeds too (when there are >= 2); false = problems only


@dataclass
class OutputConfig:
    dir: str = MISSING  # where <name>.md, <name>.tex, <name>.json and <name>_plots/ go (default results/report)
    name: str = "report"  # file stem
    title: Optional[str] = None  # heading; null = "Paired comparison vs <baseline>"


@dataclass
class PlotsConfig:
    enabled: bool = True  # training curves, pass@k vs k and token-weight plots per model (grail_exp/analysis/plots.py)
    curves: list[str] = field(default_factory=lambda: ["reward/mean", "accuracy", "completions/mean_length",
                                                       "entropy", "kl", "clip_ratio/region_mean"])
    weights: bool = True  # positional profile and weight-vs-entropy from the runs' weights/step_*.parquet
    weights_max_files: int = 10  # weight tables read per run, evenly spread over training


@dataclass
class DesignCheck:
    """What makes a set of runs one study (grail_exp/report.py ``check_design``); flat config keys, fnmatch patterns."""

    strict: bool = False  # true: refuse a report whose arms differ where they must agree (else footnotes only)
    # must agree between every run of a model (a key matching same_within_seed is exempt)
    same_everywhere: list[str] = field(default_factory=lambda: [
        "model.*", "data.*", "benchmark.*", "eval.*", "rollout.*", "loss.*", "optim.*", "estimator.*",
        "reward.extraction", "reward.overlong_buffer.*",
        "trainer.max_steps", "trainer.prompts_per_step", "trainer.mini_batches_per_rollout", "trainer.precision",
        "trainer.logprob_dtype", "trainer.eval_before_training", "task_name"])
    # must agree between the arms of a seed: the starting weights and what the run seed sets per seed
    same_within_seed: list[str] = field(default_factory=lambda: [
        "start_weights.sha256", "data.train_seed", "model.build.seed", "seed"])
    # must agree between the arms of one scheme (its settings differ from another scheme's by design)
    same_within_scheme: list[str] = field(default_factory=lambda: ["advantage.*"])


@dataclass
class DecisionConfig:
    """A decision rule declared before a study's seeds ran, applied to each row's primary comparison
    (grail_exp/analysis/stats.py ``declared_rule``): "beats" only if at least ``min_same_sign`` of the ``seeds``
    paired seeds have Δ > 0 and the seed-level t interval lies above 0; "is worse" by the mirror rule; otherwise
    "not settled". Not applied until ``seeds`` seeds are paired. null = no rule declared (no line in the report)."""

    seeds: Optional[int] = None  # the number of seeds the rule was declared for
    min_same_sign: Optional[int] = None  # seeds whose Δ must share the claimed sign
    # none | holm: the rows' primary comparisons (and those of family_dirs) are one family, Holm-adjusted over their
    # seed-level t p-values; "beats" / "is worse" then also need the adjusted p below stats.alpha
    multiplicity: str = "none"
    # other study folders whose primary comparisons belong to the family (read with this report's settings and
    # seeds); a comparison not yet decidable there (fewer paired seeds than declared) counts as p = 1
    family_dirs: list[str] = field(default_factory=list)


@dataclass
class EndpointConfig:
    """Which evaluations of an arm each per-problem value comes from (a study folder's arms record one per
    ``trainer.eval_every`` steps, grail_exp/analysis/study.py): null = the final evaluation alone; a list of steps =
    the per-problem value averaged over those evaluations (acc@n averaged over checkpoints). Step N is read from
    ``samples_step<N>.parquet``, except an arm's last step (its ``trainer.max_steps``), which is its final
    evaluation, ``samples_final.parquet`` (an evaluation inside training skips the last step: the final one is it)."""

    steps: Optional[list[int]] = None  # e.g. [40, 50, 60]
    name: Optional[str] = None  # its name in the report, e.g. B; null: "the final evaluation" / "steps 40, 50, 60"


@dataclass
class PowerConfig:
    """Power statements (the spread and pooled sections): the two-sided paired t test over seeds at ``stats.alpha``,
    its power from the noncentral t (grail_exp/analysis/stats.py ``t_power``)."""

    level: float = 0.8  # the power a seed count must reach
    effects: list[float] = field(default_factory=lambda: [3.0, 5.0])  # percentage points: seeds needed for each


@dataclass
class SpreadConfig:
    """The seed spread of each row's primary comparison under the report's endpoint (A) and under a second one (B):
    both sds with chi-square intervals, sd_B / sd_A with a seed-bootstrap interval, the seeds each endpoint needs
    (``power``). null steps: no section."""

    steps: Optional[list[int]] = None  # endpoint B's evaluations, e.g. [40, 50, 60] (the endpoint.steps convention)
    name: Optional[str] = None  # e.g. B
    rule_ratio: Optional[float] = None  # a rule declared beforehand: "B when sd_B <= rule_ratio · sd_A" (e.g. 0.5)
    n_boot: int = 10_000  # seed-bootstrap resamples of the ratio
    seed: int = 0  # its generator's seed


@dataclass
class PooledConfig:
    """Secondary, descriptive: each row's per-seed primary Δ (the report's endpoint) pooled with the same comparison
    in other study folders (mean, t interval, the effect detectable at ``power.level``); no verdict."""

    dirs: list[str] = field(default_factory=list)  # e.g. [results/real_model_study/six_seeds]


@dataclass
class ReportConfig:
    """Schema of ``python -m grail_exp.report`` (conf/report.yaml)."""

    logger: LoggerConfig = MISSING  # where the runs are (tracking_uri, experiment_name) and the report is logged
    paths: PathsConfig = field(default_factory=PathsConfig)
    runs: RunSelection = field(default_factory=RunSelection)
    fields: RunFields = field(default_factory=RunFields)
    # per-sample artifacts, the first that exists wins: training runs' final evaluation, then evaluate runs
    samples_artifacts: list[str] = field(default_factory=lambda: ["eval/final/samples.parquet",
                                                                  "eval/eval/samples.parquet"])
    baseline: str = "grpo"  # the scheme every other scheme is compared with (the paper: GRPO)
    models: Optional[list[str]] = None  # row order / rows that must appear (missing ones read "—"); null = found
    schemes: Optional[list[str]] = None  # likewise for schemes; null = found, baseline first
    seeds: Optional[list[str]] = None  # the seeds every arm should have; missing ones are footnoted
    # The cells a study planned per model where they differ from schemes / seeds (keys: schemes, seeds; an absent
    # key = the top-level one), e.g. the CPU study's +design.tiny_llama="{schemes: [grpo, grail], seeds: [1, 2, 3]}"
    # beside tiny Qwen3 x three schemes x seeds 1-5: a cell outside its model's plan is no row and not "missing";
    # a planned cell without a finished run still is. (Untyped: OmegaConf cannot add typed values with +key=.)
    design: dict[str, Any] = field(default_factory=dict)
    benchmarks: Optional[list[str]] = None  # columns; null = every benchmark found (paper order first)
    metrics: list[str] = field(default_factory=lambda: ["acc", "pass@n"])  # acc | pass@<k> | pass@n | maj
    # The declared primary comparison: this metric on the avg column (or the only benchmark); its seed-level p-values
    # are used as they are, every other comparison of a row is Holm-adjusted. null, or a metric not in metrics: all
    primary_metric: Optional[str] = "acc"
    average: str = "unweighted"  # the avg column: unweighted over benchmarks (paper) | weighted by problems
    # run params that must agree between paired runs for common random numbers (those both runs have)
    pairing_params: list[str] = field(default_factory=lambda: [
        "eval.seed", "eval.n", "eval.temperature", "eval.top_p", "eval.top_k", "eval.max_tokens", "eval.sampling",
        "benchmark.limit", "benchmark.olympiad_gold"])
    design_check: DesignCheck = field(default_factory=DesignCheck)
    decision: DecisionConfig = field(default_factory=DecisionConfig)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    power: PowerConfig = field(default_factory=PowerConfig)
    spread: SpreadConfig = field(default_factory=SpreadConfig)
    pooled: PooledConfig = field(default_factory=PooledConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    log_to: str = "auto"  # auto (the parent run if runs.parent_run_id, else a new report run) | report | parent | none
    plots: PlotsConfig = field(default_factory=PlotsConfig)
    task_name: str = "report"


register_configs()
ConfigStore.instance().store(name="report_schema", node=ReportConfig)


def _steps_errors(key: str, steps) -> list[str]:
    if steps is None:
        return []
    steps = list(steps)
    if not steps or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in steps) \
            or len(set(steps)) != len(steps):
        return [f"{key} = {steps}: a list of distinct optimiser steps >= 1 (e.g. [40, 50, 60]), or null"]
    return []


def _endpoint_errors(cfg: DictConfig) -> list[str]:
    """The checkpoint-averaged endpoint, the spread and pooled sections and the family of a declared rule: keys that
    read a study folder's evaluations inside training or other study folders."""
    errors = _steps_errors("endpoint.steps", cfg.endpoint.steps) + _steps_errors("spread.steps", cfg.spread.steps)
    folders = {"endpoint.steps": cfg.endpoint.steps is not None, "spread.steps": cfg.spread.steps is not None,
               "pooled.dirs": bool(cfg.pooled.dirs), "decision.family_dirs": bool(cfg.decision.family_dirs)}
    for key, used in folders.items():
        if used and cfg.runs.dir is None:
            errors.append(f"{key}: needs runs.dir (a study folder): MLflow runs are read at their final evaluation")
    for key in ("spread.steps", "pooled.dirs", "decision.family_dirs"):
        if folders[key] and not _has_primary(cfg):
            errors.append(f"{key}: works on the primary comparison, but primary_metric = {cfg.primary_metric} is not "
                          f"one of metrics = {list(cfg.metrics)}")
    for key in ("pooled.dirs", "decision.family_dirs"):
        for d in OmegaConf.select(cfg, key) or []:
            if not Path(str(d)).expanduser().is_dir():
                errors.append(f"{key}: {str(d)!r} is no directory (a study folder)")
    if not 0 < cfg.power.level < 1 or not cfg.power.effects or any(e <= 0 for e in cfg.power.effects):
        errors.append(f"power.level = {cfg.power.level}, power.effects = {list(cfg.power.effects)}: need 0 < level < 1"
                      " and effects > 0 (percentage points)")
    if cfg.spread.rule_ratio is not None and cfg.spread.rule_ratio <= 0:
        errors.append(f"spread.rule_ratio = {cfg.spread.rule_ratio}: must be > 0 (or null)")
    if cfg.spread.n_boot < 1:
        errors.append(f"spread.n_boot = {cfg.spread.n_boot}: must be >= 1")
    return errors


def validate_report(cfg: DictConfig) -> None:
    errors = []
    for m in cfg.metrics:
        if not _METRIC.match(str(m)):
            errors.append(f"metrics: {m!r} is not acc | maj | pass@<k> | pass@n")
    if not cfg.metrics:
        errors.append("metrics: empty")
    if cfg.primary_metric is not None and not _METRIC.match(str(cfg.primary_metric)):
        errors.append(f"primary_metric = {cfg.primary_metric!r}: not acc | maj | pass@<k> | pass@n (or null)")
    rule = cfg.decision
    if (rule.seeds is None) != (rule.min_same_sign is None):
        errors.append(f"decision.seeds = {rule.seeds}, decision.min_same_sign = {rule.min_same_sign}: set both "
                      "(a declared rule) or neither")
    elif rule.seeds is not None:
        if rule.seeds < 2 or not 1 <= rule.min_same_sign <= rule.seeds:
            errors.append(f"decision.seeds = {rule.seeds}, decision.min_same_sign = {rule.min_same_sign}: need "
                          "seeds >= 2 and 1 <= min_same_sign <= seeds")
        if not _has_primary(cfg):
            primary = "null" if cfg.primary_metric is None else cfg.primary_metric
            errors.append(f"decision: the rule applies to the primary comparison, but primary_metric = {primary} "
                          f"is not one of metrics = {list(cfg.metrics)}")
        if cfg.seeds is not None and len(cfg.seeds) != rule.seeds:
            errors.append(f"decision.seeds = {rule.seeds}, but seeds lists {len(cfg.seeds)}: "
                          f"{list(cfg.seeds)}")
    if rule.multiplicity not in ("none", "holm"):
        errors.append(f"decision.multiplicity = {rule.multiplicity!r}: must be none or holm")
    elif rule.multiplicity == "holm" and rule.seeds is None:
        errors.append("decision.multiplicity = holm: adjusts a declared rule's verdicts; declare the rule too "
                      "(decision.seeds, decision.min_same_sign)")
    if rule.family_dirs and rule.multiplicity != "holm":
        errors.append(f"decision.family_dirs = {list(rule.family_dirs)}: a family is adjusted by "
                      "decision.multiplicity=holm; set it")
    errors += _endpoint_errors(cfg)
    if cfg.average not in ("unweighted", "weighted"):
        errors.append(f"average = {cfg.average!r}: must be unweighted or weighted")
    if cfg.log_to not in ("auto", "report", "parent", "none"):
        errors.append(f"log_to = {cfg.log_to!r}: must be auto, report, parent or none")
    if cfg.log_to == "parent" and not cfg.runs.parent_run_id:
        errors.append("log_to = parent needs runs.parent_run_id")
    if not 0 < cfg.stats.alpha < 1:
        errors.append(f"stats.alpha = {cfg.stats.alpha}: must be in (0, 1)")
    if cfg.stats.n_boot < 1 or cfg.stats.n_perm < 1:
        errors.append("stats.n_boot and stats.n_perm must be >= 1")
    for model, plan in (cfg.design or {}).items():
        if not isinstance(plan, DictConfig) or set(plan) - {"schemes", "seeds"}:
            errors.append(f"design.{model} = {plan}: must be a mapping with keys schemes and/or seeds")
            continue
        if plan.get("schemes") is not None and cfg.baseline not in plan.schemes:
            errors.append(f"design.{model}.schemes = {list(plan.schemes)}: must include the baseline "
                          f"{cfg.baseline!r} (every row is paired with it)")
        if cfg.models is not None and model not in cfg.models:
            errors.append(f"design.{model}: not one of models = {list(cfg.models)}")
    if cfg.runs.dir is not None and not Path(str(cfg.runs.dir)).expanduser().is_dir():
        errors.append(f"runs.dir = {str(cfg.runs.dir)!r}: no such directory (a study folder, grail_exp/analysis/study.py)")
    for key, v in dict(cfg.runs.tags).items():
        if "'" in str(v) or "`" in str(key):
            errors.append(f"runs.tags.{key}: quotes are not supported in tag filters")
    if errors:
        raise ConfigError("invalid report configuration:\n" + "\n".join(f"  - {e}" for e in errors))


# ----------------------------------------------------------------------------------------------- runs
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
    artifact: Optional[str] = None
    history: Any = None  # a study folder's training curves (DataFrame indexed by step); MLflow runs: fetched
    weights_dir: Optional[Path] = None  # a study folder's weight tables; MLflow runs: downloaded
    folder: Optional[Path] = None  # the study folder's arm this record was read from (nothing of it is in MLflow)
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


def _field(run, keys: list[str]) -> Optional[str]:
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


def _find_artifact(client, run_id: str, candidates: list[str]) -> Optional[str]:
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
    everywhere = lambda k: (any(fnmatch(k, p) for p in dc.same_everywhere)  # noqa: E731
                            and not within(k) and not in_scheme(k))
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
            recs = sorted(recs, key=lambda r: (r.scheme != cfg.baseline, _seed_key(r.seed), r.scheme))
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


# ----------------------------------------------------------------------------------------------- per-problem values
def parse_metric(spec: str) -> tuple[str, Optional[int]]:
    """``acc`` -> (acc, None); ``pass@3`` -> (pass, 3); ``pass@n`` -> (pass, None); ``maj`` -> (maj, None)."""
    m = _METRIC.match(spec)
    if not m:
        raise ConfigError(f"unknown metric {spec!r}")
    if m.group(1).startswith("pass"):
        return "pass", None if m.group(2) == "n" else int(m.group(2))
    return m.group(1), None


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


# ----------------------------------------------------------------------------------------------- the table
@dataclass
class Cell:
    value: Optional[float] = None  # arm mean over its seeds (fraction); None = missing
    n_seeds: int = 0
    delta: Optional[stats.PairedResult] = None  # vs the baseline (non-baseline rows)
    notes: list[str] = field(default_factory=list)


@dataclass
class Row:
    model: str
    scheme: str
    baseline: bool
    seeds: list[str]
    paired_seeds: list[str]
    notes: list[str]
    cells: dict[str, Cell]


@dataclass
class MetricTable:
    spec: str
    label: str
    columns: list[str]  # benchmarks (+ avg when there are several)
    rows: list[Row]
    notes: list[str] = field(default_factory=list)  # footnotes on the whole table


def _seed_key(s: str):
    try:
        return (0, float(s), s)
    except ValueError:
        return (1, 0.0, s)


def _ordered(found: list[str], wanted: Optional[list[str]], first: Optional[str] = None) -> list[str]:
    if wanted:
        return list(wanted)
    uniq = list(dict.fromkeys(found))
    rest = sorted(x for x in uniq if x != first)
    return ([first] if first in uniq else []) + rest


def build_tables(arms: dict, row_notes: dict, cfg: DictConfig, notes: Notes) -> list[MetricTable]:
    models = _ordered([m for m, _ in arms], cfg.models)
    schemes = _ordered([s for _, s in arms], cfg.schemes, cfg.baseline)
    if cfg.baseline not in schemes:
        schemes = [cfg.baseline] + schemes
    tables = []
    for spec in cfg.metrics:
        # per arm, per seed: {benchmark: (idx, values, n)}
        values = {arm: {seed: endpoint_values(rec, spec, cfg.endpoint.steps) for seed, rec in seeds.items()}
                  for arm, seeds in arms.items()}
        found = sorted({str(b) for seeds in arms.values() for rec in seeds.values() for b in rec.samples["benchmark"]},
                       key=lambda b: (PAPER_ORDER.index(b) if b in PAPER_ORDER else len(PAPER_ORDER), b))
        benches = list(cfg.benchmarks or found)
        ns = {v[b][2] for per_seed in values.values() for v in per_seed.values() for b in v if b in benches}
        label = metric_label(spec, ns)
        table_notes = []
        if len(ns) > 1:
            table_notes.append(notes.mark(f"{label}: runs sampled different numbers of answers per problem "
                                          f"({sorted(ns)})"))
        kind, k = parse_metric(spec)
        if kind == "pass" and k is not None and any(
                rec.samples.groupby(["benchmark", "problem_index"]).size().min() < k
                for seeds in arms.values() for rec in seeds.values()):
            table_notes.append(notes.mark(f"{label}: needs at least {k} samples per problem; benchmarks of runs "
                                          f"with fewer count as missing"))
        rows = [_row(model, scheme, arms, values, row_notes, benches, cfg, notes)
                for model in models for scheme in _planned(model, schemes, cfg)]
        for model in models:
            _baseline_over_paired_seeds([r for r in rows if r.model == model], values, benches, cfg, notes)
        # one benchmark: its column already is the average
        tables.append(MetricTable(spec, label, benches + ([AVG] if len(benches) > 1 else []), rows, table_notes))
    return tables


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


def _endpoint_text(steps, name: Optional[str]) -> str:
    what = "the final evaluation" if steps is None else \
        "the mean of the evaluations at steps " + ", ".join(str(int(x)) for x in steps)
    return f"endpoint {name} ({what})" if name else what


def _baseline_over_paired_seeds(rows: list, values: dict, benches: list, cfg, notes: Notes) -> None:
    """A study in progress: the baseline row shows its value over the seeds the other rows are paired on, so that
    baseline + Δ reads as the other row's value. One paired set shared by every other row: the baseline's cells over
    it, with a footnote giving the value over all its seeds; several sets: all seeds, with a footnote per row giving
    the baseline over that row's paired seeds."""
    base = next((r for r in rows if r.baseline), None)
    if base is None or not base.seeds:
        return
    sets = {r.scheme: tuple(r.paired_seeds) for r in rows if not r.baseline and r.paired_seeds}
    partial = {k: v for k, v in sets.items() if set(v) != set(base.seeds)}
    if not partial:
        return
    model, mine = base.model, values.get((base.model, cfg.baseline), {})

    def cells_over(seeds) -> dict:
        out = {b: _bench_cell(b, mine, {}, list(seeds), [], True, model, cfg.baseline, cfg, Notes()) for b in benches}
        if len(benches) > 1:
            out[AVG] = _avg_cell(benches, mine, {}, list(seeds), [], True, model, cfg.baseline, cfg, Notes())
        return out

    def listing(cells: dict) -> str:
        return ", ".join(f"{c} {_pct(cell.value)}" if len(cells) > 1 else _pct(cell.value)
                         for c, cell in cells.items())

    if len(set(sets.values())) == 1:
        paired = next(iter(sets.values()))
        everything = {c: base.cells[c] for c in base.cells}
        base.notes.append(notes.mark(
            f"{model} × {cfg.baseline}: over the seeds paired with the other rows ({', '.join(paired)}), so that "
            f"its value + Δ is theirs; over all its {len(base.seeds)} seeds: {listing(everything)}"))
        base.cells = {**cells_over(paired)}
        base.paired_seeds = list(paired)
        return
    for scheme, paired in partial.items():
        base.notes.append(notes.mark(
            f"{model} × {cfg.baseline} over the seeds paired with {scheme} ({', '.join(paired)}): "
            f"{listing(cells_over(paired))}"))


def _planned(model: str, schemes: list[str], cfg) -> list[str]:
    """A model's rows: its design's schemes (baseline first) or every scheme."""
    planned = (cfg.design or {}).get(model, {}).get("schemes")
    if planned is None:
        return schemes
    return [s for s in schemes if s in planned] + [str(s) for s in planned if s not in schemes]


def _expected_seeds(model: str, cfg) -> Optional[list]:
    planned = (cfg.design or {}).get(model, {}).get("seeds")
    return [str(s) for s in planned] if planned is not None else cfg.seeds


def _row(model, scheme, arms, values, row_notes, benches, cfg, notes) -> Row:
    arm, base = (model, scheme), (model, cfg.baseline)
    is_base = scheme == cfg.baseline
    mine = values.get(arm, {})
    seeds = sorted(mine, key=_seed_key)
    rnotes = list(dict.fromkeys(row_notes.get(arm, [])))
    if arm not in arms or not seeds:
        rnotes.append(notes.mark(f"{model} × {scheme}: no finished run with per-sample results"))
    expected = _expected_seeds(model, cfg)
    if expected:
        lacking = [str(s) for s in expected if str(s) not in mine]
        if lacking and seeds:
            rnotes.append(notes.mark(f"{model} × {scheme}: seed(s) {', '.join(lacking)} missing"))
    theirs = values.get(base, {}) if not is_base else {}
    paired = [s for s in seeds if s in theirs]
    if not is_base and seeds:
        unpartnered = [s for s in seeds if s not in theirs]
        if not paired:
            rnotes.append(notes.mark(f"{model} × {scheme}: unpaired, no seed in common with {cfg.baseline} "
                                     f"(Δ not computed)"))
        elif unpartnered:
            rnotes.append(notes.mark(f"{model} × {scheme}: seed(s) {', '.join(unpartnered)} have no "
                                     f"{cfg.baseline} partner; Δ uses seed(s) {', '.join(paired)}"))

    cells = {}
    for b in benches:
        cells[b] = _bench_cell(b, mine, theirs, seeds, paired, is_base, model, scheme, cfg, notes)
    if len(benches) > 1:
        cells[AVG] = _avg_cell(benches, mine, theirs, seeds, paired, is_base, model, scheme, cfg, notes)
    return Row(model, scheme, is_base, seeds, paired if not is_base else seeds, list(dict.fromkeys(rnotes)), cells)


def _bench_cell(b, mine, theirs, seeds, paired, is_base, model, scheme, cfg, notes) -> Cell:
    have = [s for s in seeds if b in mine[s]]
    cell = Cell()
    if not have:
        if seeds:
            cell.notes.append(notes.mark(f"{model} × {scheme}: no {b} results"))
        return cell
    if len(have) < len(seeds):
        cell.notes.append(notes.mark(f"{model} × {scheme}, {b}: only seed(s) {', '.join(have)} have results"))
    cell.value = float(np.mean([mine[s][b][1].mean() for s in have]))
    cell.n_seeds = len(have)
    if is_base:
        return cell
    both = [s for s in paired if b in mine[s] and b in theirs[s]]
    if not both:
        if paired:
            cell.notes.append(notes.mark(f"{model} × {scheme}, {b}: no paired seed has {b} in both arms"))
        return cell
    d = _diff_matrix(b, both, mine, theirs, model, scheme, cell, notes)
    if d is not None:
        cell.delta = stats.compare_paired({b: d}, **_stat_kwargs(cfg))
    return cell


def _avg_cell(benches, mine, theirs, seeds, paired, is_base, model, scheme, cfg, notes) -> Cell:
    cell = Cell()
    if not benches:
        return cell
    complete = [s for s in seeds if all(b in mine[s] for b in benches)]
    if not complete:
        if seeds:
            cell.notes.append(notes.mark(f"{model} × {scheme}: no seed has all of {', '.join(benches)}; "
                                         f"no average"))
        return cell
    if len(complete) < len(seeds):
        cell.notes.append(notes.mark(f"{model} × {scheme}, {AVG}: only seed(s) {', '.join(complete)} have every "
                                     f"benchmark"))
    w = stats.benchmark_weights([len(mine[complete[0]][b][1]) for b in benches], cfg.average)
    cell.value = float(np.mean([sum(wb * mine[s][b][1].mean() for wb, b in zip(w, benches)) for s in complete]))
    cell.n_seeds = len(complete)
    if is_base:
        return cell
    both = [s for s in paired if all(b in mine[s] and b in theirs[s] for b in benches)]
    if not both:
        return cell
    diffs = {}
    for b in benches:
        d = _diff_matrix(b, both, mine, theirs, model, scheme, cell, notes)
        if d is None:
            return cell
        diffs[b] = d
    cell.delta = stats.compare_paired(diffs, average=cfg.average, **_stat_kwargs(cfg))
    return cell


def _diff_matrix(b, seeds, mine, theirs, model, scheme, cell, notes) -> Optional[np.ndarray]:
    """(seeds, problems) differences on the problems every paired run of ``b`` has; footnoted if that is fewer
    than some run has; None if there are none."""
    sets = [set(mine[s][b][0].tolist()) for s in seeds] + [set(theirs[s][b][0].tolist()) for s in seeds]
    common = sorted(set.intersection(*sets))
    if not common:
        cell.notes.append(notes.mark(f"{model} × {scheme}, {b}: no problem in common with the baseline; unpaired"))
        return None
    if any(len(x) != len(common) for x in sets):
        cell.notes.append(notes.mark(f"{model} × {scheme}, {b}: paired on the {len(common)} problems both arms "
                                     f"have (runs have {sorted({len(x) for x in sets})})"))

    def on_common(idx, vals):
        pos = {int(i): j for j, i in enumerate(idx)}
        return vals[[pos[i] for i in common]]

    return np.stack([on_common(*mine[s][b][:2]) - on_common(*theirs[s][b][:2]) for s in seeds])


def _stat_kwargs(cfg) -> dict:
    s = cfg.stats
    return dict(n_boot=s.n_boot, alpha=s.alpha, seed=s.seed, n_perm=s.n_perm, exact_max=s.exact_max,
                resample_seeds=s.resample_seeds)


def _has_primary(cfg: DictConfig) -> bool:
    return cfg.primary_metric is not None and str(cfg.primary_metric) in [str(m) for m in cfg.metrics]


def _primary_column(table: MetricTable) -> str:
    return AVG if AVG in table.columns else table.columns[0]


def apply_primary_and_holm(tables: list[MetricTable], cfg: DictConfig) -> None:
    """Per row (model × scheme): mark the declared primary comparison (``primary_metric`` on the avg column, or the
    only benchmark), apply the declared decision rule to it (``decision``, when set), and Holm-adjust the seed-level
    p-values (t and sign-flip, separately) over every other comparison of the row that has them (two or more
    seeds), across metrics and benchmark columns."""
    rows: dict[tuple, list] = defaultdict(list)
    for t in tables:
        for r in t.rows:
            if r.baseline:
                continue
            for c in t.columns:
                d = r.cells[c].delta
                if d is None:
                    continue
                d.primary = cfg.primary_metric is not None and t.spec == str(cfg.primary_metric) \
                    and c == _primary_column(t)
                if d.primary and cfg.decision.seeds is not None:
                    d.decision = _decide(d, r, cfg)
                if not d.primary and d.seed_level():
                    rows[(r.model, r.scheme)].append(d)
    for family in rows.values():
        t_adj = stats.holm([d.seed_t_p for d in family])
        flip_adj = stats.holm([d.seed_flip_p for d in family])
        for d, tp, fp in zip(family, t_adj, flip_adj):
            d.seed_t_p_holm, d.seed_flip_p_holm = tp, fp


def _decide(d: stats.PairedResult, row: Row, cfg: DictConfig, holm_p: Optional[float] = None) -> dict:
    rule = cfg.decision
    if d.n_seeds > rule.seeds:
        raise ConfigError(f"decision.seeds = {rule.seeds}: {row.model} × {row.scheme} has {d.n_seeds} paired seeds "
                          f"({', '.join(map(str, row.paired_seeds))}); the rule was declared for {rule.seeds} "
                          "(select the declared ones with seeds=[...])")
    result = stats.declared_rule(d.seed_deltas, d.seed_t_lo, d.seed_t_hi, rule.seeds, rule.min_same_sign,
                                 holm_p=holm_p, alpha=cfg.stats.alpha)
    return {**result.__dict__, "text": result.text(row.scheme, cfg.baseline)}


# ----------------------------------------------------------------------------------------------- the primary comparison
# Each row's primary comparison (primary_metric on the avg column, or the only benchmark) per seed: under a second
# endpoint of the same arms (spread), and in other study folders (pooled, decision.family_dirs). Every one is built
# as the report builds its own tables, from a copy of the report's configuration with a few keys replaced.
def primary_comparisons(tables: list[MetricTable]) -> dict[tuple, tuple[Row, stats.PairedResult]]:
    """``{(model, scheme): (row, PairedResult)}`` of the rows' primary comparisons (after apply_primary_and_holm)."""
    out = {}
    for t in tables:
        for r in t.rows:
            for c in t.columns:
                d = None if r.baseline else r.cells[c].delta
                if d is not None and d.primary:
                    out[(r.model, r.scheme)] = (r, d)
    return out


def _variant(cfg: DictConfig, **keys) -> DictConfig:
    """A copy of ``cfg`` with ``keys`` (dotted, ``__`` for ``.``) replaced, reading only what the primary comparison
    needs: its metric, no rule, family, spread or pooled sections of its own, no plots."""
    import copy

    sub = copy.deepcopy(cfg)
    base = {"metrics": [str(cfg.primary_metric)], "decision.seeds": None, "decision.min_same_sign": None,
            "decision.multiplicity": "none", "decision.family_dirs": [], "spread.steps": None, "pooled.dirs": []}
    for k, v in {**base, **{k.replace("__", "."): v for k, v in keys.items()}}.items():
        OmegaConf.update(sub, k, v, merge=False)
    return sub


def folder_comparisons(cfg: DictConfig, arms: Optional[dict] = None) -> tuple[dict, dict]:
    """(comparisons, arms) of the study folder ``cfg.runs.dir`` (or of ``arms``) under ``cfg``: strict design check,
    tables, primary comparisons (with ``cfg``'s rule, when it declares one)."""
    notes = Notes()
    if arms is None:
        arms, _, _ = select_study_arms(cfg, notes)
        check_design(arms, cfg)
    tables = build_tables(arms, defaultdict(list), cfg, notes)
    apply_primary_and_holm(tables, cfg)
    return primary_comparisons(tables), arms


def apply_family(tables: list[MetricTable], cfg: DictConfig) -> list[dict]:
    """``decision.multiplicity=holm``: the rows' primary comparisons and those of ``decision.family_dirs`` (read with
    this report's settings, seeds and rule) are one family. Their seed-level t p-values are Holm-adjusted (a
    comparison the rule cannot apply to yet, fewer paired seeds than declared, counts as p = 1, the most
    conservative value it could take), and every decision is re-taken with its adjusted p: "beats" / "is worse" need
    it below stats.alpha. Returns the family's members (this report's rows first)."""
    if cfg.decision.multiplicity != "holm":
        return []
    members = [("", row, d) for row, d in primary_comparisons(tables).values() if d.decision is not None]
    for folder in cfg.decision.family_dirs:
        comps, _ = folder_comparisons(_variant(cfg, runs__dir=str(folder), decision__seeds=cfg.decision.seeds,
                                               decision__min_same_sign=cfg.decision.min_same_sign))
        members += [(portable_text(str(folder), cfg.paths.root_dir), row, d) for row, d in comps.values()
                    if d.decision is not None]
    counted = [1.0 if d.decision["verdict"] == "not applied" or d.seed_t_p is None else d.seed_t_p
               for _, row, d in members]
    out = []
    for (folder, row, d), p, adj in zip(members, counted, stats.holm(counted)):
        d.decision = _decide(d, row, cfg, holm_p=adj)
        out.append({"folder": folder or None, "model": row.model, "scheme": row.scheme, "n_seeds": d.n_seeds,
                    "seed_t_p": d.seed_t_p, "counted_p": p, "holm_p": adj, "verdict": d.decision["verdict"],
                    "text": d.decision["text"]})
    return out


def _points(x) -> np.ndarray:
    return 100 * np.asarray(x, dtype=np.float64)


def _needed(effects, sd: float, lo: float, hi: float, level: float, alpha: float) -> dict:
    return {str(e): [stats.seeds_needed(e, x, level, alpha) for x in (sd, lo, hi)] for e in effects}


def spread_section(arms: dict, main: dict, cfg: DictConfig) -> list[dict]:
    """``spread.steps``: per row, the per-seed primary Δ (points) under the report's endpoint (A) and under
    ``spread.steps`` (B) on the same paired seeds; sd_A, sd_B (ddof 1) with chi-square intervals, sd_B / sd_A with
    its seed-bootstrap percentile interval (grail_exp/analysis/stats.py ``sd_ratio_bootstrap``), the seeds each
    endpoint needs per ``power.effects`` at ``power.level`` (at the sd and at its interval's ends), and the declared
    rule ``spread.rule_ratio`` on the point estimates."""
    sp, alpha, level = cfg.spread, cfg.stats.alpha, cfg.power.level
    for seeds in arms.values():  # every arm has B's evaluations (refused naming spread.steps), read once here
        for rec in seeds.values():
            endpoint_samples(rec, sp.steps, "spread.steps")
    other, _ = folder_comparisons(_variant(cfg, endpoint__steps=[int(x) for x in sp.steps]), arms)
    out = []
    for key, (row, da) in main.items():
        if key not in other:
            continue
        db = other[key][1]
        a, b = _points(da.seed_deltas), _points(db.seed_deltas)
        entry = {"model": row.model, "scheme": row.scheme, "seeds": list(row.paired_seeds), "a": a.tolist(),
                 "b": b.tolist()}
        if a.size < 2:
            out.append({**entry, "note": f"{a.size} paired seed: no spread"})
            continue
        for name, x in (("a", a), ("b", b)):
            sd = float(x.std(ddof=1))
            lo, hi = stats.sd_interval(sd, x.size, alpha)
            entry[f"sd_{name}"], entry[f"sd_{name}_interval"] = sd, [lo, hi]
            entry[f"needed_{name}"] = _needed(cfg.power.effects, sd, lo, hi, level, alpha)
        if entry["sd_a"] > 0:
            r = stats.sd_ratio_bootstrap(a, b, n_boot=sp.n_boot, seed=sp.seed, alpha=alpha)
            entry["ratio"] = {"value": r.ratio, "lo": r.lo, "hi": r.hi, "kept": r.kept, "dropped": r.dropped}
        else:
            entry["ratio"] = None
        if sp.rule_ratio is not None:
            entry["rule"] = {"ratio": float(sp.rule_ratio), "holds": entry["sd_b"] <= sp.rule_ratio * entry["sd_a"]}
        out.append(entry)
    return out


POOLED_KEYS = ["start_weights.sha256", "optim.lr", "trainer.max_steps", "trainer.prompts_per_step"]


def pooled_section(arms: dict, main: dict, cfg: DictConfig) -> list[dict]:
    """``pooled.dirs``: per row, its per-seed primary Δ (points, the report's endpoint) followed by the same
    comparison's in each folder (read with this report's settings, every seed there); the pooled mean, sd with its
    chi-square interval, t interval (df = n − 1) and the effect detectable at ``power.level`` with n seeds (at the sd
    and at its interval's ends), and which of ``POOLED_KEYS`` and ``pairing_params`` differ between the folders.
    Descriptive: no verdict."""
    alpha, level = cfg.stats.alpha, cfg.power.level
    parts: dict[tuple, list] = {key: [(portable_text(str(cfg.runs.dir), cfg.paths.root_dir), row.paired_seeds,
                                       _points(d.seed_deltas))] for key, (row, d) in main.items()}
    params = [_folder_params(arms, cfg)]
    for folder in cfg.pooled.dirs:
        comps, their_arms = folder_comparisons(_variant(cfg, runs__dir=str(folder), seeds=None))
        params.append(_folder_params(their_arms, cfg))
        for key, (row, d) in comps.items():
            if key in parts:
                parts[key].append((portable_text(str(folder), cfg.paths.root_dir), row.paired_seeds,
                                   _points(d.seed_deltas)))
    differ = {k: sorted({p.get(k, "<absent>") for p in params}) for k in POOLED_KEYS + list(cfg.pairing_params)
              if len({p.get(k, "<absent>") for p in params}) > 1}
    out = []
    for (model, scheme), got in parts.items():
        d = np.concatenate([x for _, _, x in got])
        entry = {"model": model, "scheme": scheme, "n": int(d.size), "differ": differ,
                 "folders": [{"folder": f, "seeds": list(seeds), "deltas": x.tolist(),
                              "mean": float(x.mean()) if x.size else None} for f, seeds, x in got]}
        if d.size >= 2:
            t = stats.seed_t_test(d, alpha)
            sd = float(d.std(ddof=1))
            lo, hi = stats.sd_interval(sd, d.size, alpha)
            entry.update(mean=float(d.mean()), sd=sd, sd_interval=[lo, hi], t_lo=t.lo, t_hi=t.hi, df=t.df,
                         detectable=[stats.detectable_effect(x, d.size, level, alpha) for x in (sd, lo, hi)])
        out.append(entry)
    return out


def _folder_params(arms: dict, cfg: DictConfig) -> dict:
    """The baseline arms' values of the keys compared between pooled folders (the first arm that has each)."""
    out: dict = {}
    for (model, scheme), seeds in arms.items():
        if scheme != cfg.baseline:
            continue
        for rec in seeds.values():
            for k in POOLED_KEYS + list(cfg.pairing_params):
                if k in rec.params and k not in out:
                    out[k] = str(rec.params[k])
    return out


def generation_table(arms: dict, cfg: DictConfig) -> list[dict]:
    """Per arm and seed, what the final evaluation generated: samples, the share truncated at the token limit and
    the mean completion length in tokens. Truncation is the samples' ``truncated`` flag; samples recorded without
    it count as truncated when ``n_tokens`` reached the run's ``eval.max_tokens`` (``source`` says which)."""
    out = []
    for (model, scheme), seeds in sorted(arms.items(), key=lambda kv: (kv[0][0], kv[0][1] != cfg.baseline,
                                                                        kv[0][1])):
        for seed in sorted(seeds, key=_seed_key):
            df = seeds[seed].samples
            tokens = df["n_tokens"].astype(float) if "n_tokens" in df else None
            limit = seeds[seed].params.get("eval.max_tokens")
            if "truncated" in df:
                truncated, source = df["truncated"].astype(bool), "truncated flag"
            elif tokens is not None and limit not in (None, "None"):
                truncated, source = tokens >= float(limit), f"n_tokens >= eval.max_tokens ({limit})"
            else:
                truncated, source = None, "unknown"
            out.append({"model": model, "scheme": scheme, "seed": seed, "samples": int(len(df)),
                        "truncated_rate": float(truncated.mean()) if truncated is not None else None,
                        "mean_tokens": float(tokens.mean()) if tokens is not None else None, "source": source})
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


def first_step_rewards(rec: RunRecord, partner: RunRecord) -> Optional[tuple[float, float]]:
    """The step-1 mean training reward of two arms of a seed, when both recorded their curves. Step 1's rollouts come
    from the shared starting weights and the seed's stream, before any scheme acted: equal in every arm of a seed."""
    from grail_exp.analysis.study import step1_reward

    got = step1_reward(rec.history), step1_reward(partner.history)
    return None if None in got else got


# ----------------------------------------------------------------------------------------------- rendering
def _pct(x: Optional[float], signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _main_cell(cell: Cell, row: Row, alpha: float, mark) -> str:
    if cell.value is None:
        text = DASH
    else:
        text = _pct(cell.value)
        if not row.baseline:
            if cell.delta is None:
                text += f" (Δ {DASH})"
            else:
                star = "*" if cell.delta.significant(alpha) else ""
                one = f"; {ONE_SEED}" if cell.delta.n_seeds == 1 else ""  # a one-seed Δ says nothing of the scheme
                text += f" ({_pct(cell.delta.delta, True)}{star}{one})"
    return text + "".join(mark(n) for n in cell.notes)


def _seeds_text(row: Row) -> str:
    if not row.seeds:
        return "0"
    if len(row.paired_seeds) == len(row.seeds):
        return str(len(row.seeds))
    return f"{len(row.seeds)} ({len(row.paired_seeds)} paired)"


def _seed_tests_text(d: stats.PairedResult) -> tuple[str, str, str]:
    """The Δ table's seed-level cells: ``t (df), p [t interval]``, ``sign-flip p (min p)``, Holm-adjusted p's."""
    if not d.seed_level():
        return ONE_SEED if d.n_seeds == 1 else DASH, ONE_SEED if d.n_seeds == 1 else DASH, DASH
    t = f"{d.seed_t:+.2f}" if math.isfinite(d.seed_t) else ("+inf" if d.seed_t > 0 else "-inf")
    t_text = f"t({d.seed_df}) = {t}, p {_p(d.seed_t_p)} [{_pct(d.seed_t_lo, True)}, {_pct(d.seed_t_hi, True)}]"
    flip_text = f"{_p(d.seed_flip_p)} (min {_p(d.seed_flip_min_p)})"
    if d.primary:
        holm_text = "primary"
    elif d.seed_t_p_holm is None:
        holm_text = DASH
    else:
        holm_text = f"{_p(d.seed_t_p_holm)} / {_p(d.seed_flip_p_holm)}"
    return t_text, flip_text, holm_text


def render_markdown(tables: list[MetricTable], notes: Notes, cfg: DictConfig, header: str,
                    generation: Optional[list[dict]] = None, sections: Optional[list[str]] = None) -> str:
    alpha = cfg.stats.alpha
    mark = lambda n: f"<sup>{n}</sup>"  # noqa: E731
    out = [header, ""]
    for t in tables:
        at = "" if cfg.endpoint.steps is None else f", {_endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}"
        out += [f"### {t.label} (%){at}" + "".join(mark(n) for n in t.notes), ""]
        head = ["model", "scheme", "seeds"] + t.columns
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---", "---", "--:"] + ["--:"] * len(t.columns)) + "|")
        for r in t.rows:
            scheme = r.scheme + (" (baseline)" if r.baseline else "") + "".join(mark(n) for n in r.notes)
            cells = [_main_cell(r.cells[c], r, alpha, mark) for c in t.columns]
            out.append("| " + " | ".join([r.model, scheme, _seeds_text(r)] + cells) + " |")
        out += ["", f"Δ vs {cfg.baseline}, paired (percentage points):", ""]
        conf = int(round(100 * (1 - alpha)))
        out.append(f"| model | scheme | benchmark | Δ | {conf} % CI | per-seed Δ, mean ± sd | seed-level t, p "
                   f"[{conf} % t interval] | seed-level sign-flip p (min) | Holm p (t / sign-flip) | "
                   f"per-problem p (these trained models only) | seeds | problems |")
        out.append("|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        blank = " | " * 8
        for r in t.rows:
            if r.baseline:
                continue
            if not r.seeds:  # no runs at all: one line, not one per column
                out.append(f"| {r.model} | {r.scheme} | all | {DASH}{blank}|")
                continue
            for c in t.columns:
                d = r.cells[c].delta
                if d is None:
                    out.append(f"| {r.model} | {r.scheme} | {c} | {DASH}{blank}|")
                    continue
                sd = f" ± {100 * d.seed_sd:.1f}" if d.seed_sd is not None else " (1 seed)"
                t_text, flip_text, holm_text = _seed_tests_text(d)
                out.append(f"| {r.model} | {r.scheme} | {c} | {_pct(d.delta, True)} | "
                           f"[{_pct(d.lo, True)}, {_pct(d.hi, True)}] | {_pct(d.seed_mean, True)}{sd} | "
                           f"{t_text} | {flip_text} | {holm_text} | {_p(d.p_value)} | {d.n_seeds} | "
                           f"{d.n_problems} |")
        out.append("")
        out += _decision_markdown(t, cfg, conf)
    out += sections or []
    if generation:
        out += _generation_markdown(generation)
    out.append(_legend(cfg, tables))
    if notes.texts:
        out += ["", "Notes:", ""]
        out += [f"- <sup>{letter(i)}</sup> {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(out) + "\n"


def _decision_markdown(table: MetricTable, cfg: DictConfig, conf: int) -> list[str]:
    """The declared rule and its verdict per row, under the table that holds the primary comparison (else nothing)."""
    decided = [(r, d) for r in table.rows for c in table.columns
               if (d := r.cells[c].delta) is not None and d.decision is not None]
    if not decided:
        return []
    rule = cfg.decision
    family = (f" and its seed-level t p, Holm-adjusted over the declared family of primary comparisons "
              f"(decision.multiplicity = holm, below), is below {cfg.stats.alpha}" if rule.multiplicity == "holm" else "")
    out = [f"Declared rule on the primary comparison (decision.seeds, decision.min_same_sign): a scheme beats "
           f"{cfg.baseline} only if at least {rule.min_same_sign} of {rule.seeds} seeds have Δ > 0 and the seed-level "
           f"{conf} % t interval lies above 0{family} (is worse: the mirror rule); otherwise not settled.", ""]
    for r, d in decided:
        interval = (f"; t interval [{_pct(d.seed_t_lo, True)}, {_pct(d.seed_t_hi, True)}]"
                    if d.seed_t_lo is not None else "")
        out.append(f"- {r.model} × {r.scheme}: {d.decision['text']}{interval}")
    return out + [""]


def _family_markdown(family: list[dict], cfg: DictConfig) -> list[str]:
    if not family:
        return []
    out = [f"### Multiplicity: the declared family of primary comparisons (decision.multiplicity = holm)", "",
           f"The {len(family)} primary comparisons below are adjusted as one family by Holm's method over their "
           f"seed-level t p-values at familywise α {cfg.stats.alpha}; a comparison the rule cannot apply to yet (fewer "
           f"paired seeds than the {cfg.decision.seeds} declared) counts as p = 1, the most conservative value it "
           f"could take. A verdict other than \"not settled\" needs the rule's clauses and an adjusted p below "
           f"{cfg.stats.alpha}.", "",
           "| comparison | paired seeds | seed-level t p | counted as | Holm-adjusted p | the declared rule |",
           "|---|--:|--:|--:|--:|---|"]
    for m in family:
        where = f"{m['folder']}: " if m["folder"] else ""
        raw = DASH if m["seed_t_p"] is None else _p(m["seed_t_p"])
        out.append(f"| {where}{m['model']} × {m['scheme']} | {m['n_seeds']} | {raw} | {_p(m['counted_p'])} | "
                   f"{_p(m['holm_p'])} | {m['verdict']} |")
    return out + [""]


def _signed(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}"


def _range_text(values: list) -> str:
    point, lo, hi = values
    return f"{point} [{lo}, {hi}]"


def _spread_markdown(spread: list[dict], cfg: DictConfig, label: str) -> list[str]:
    if not spread:
        return []
    a_name, b_name = cfg.endpoint.name or "A", cfg.spread.name or "B"
    a_text = _endpoint_text(cfg.endpoint.steps, None)
    b_text = _endpoint_text(cfg.spread.steps, None)
    conf, level = int(round(100 * (1 - cfg.stats.alpha))), int(round(100 * cfg.power.level))
    out = [f"### Seed spread of the primary comparison: endpoint {b_name} against endpoint {a_name}", "",
           f"Per paired seed, Δ = {label} of the scheme − {cfg.baseline}, in points, under endpoint {a_name} "
           f"({a_text}) and endpoint {b_name} ({b_text}); an arm's last step is its final evaluation. sd: sample sd "
           f"(ddof 1) over the seeds with its {conf} % chi-square interval. Ratio sd_{b_name} / sd_{a_name}: "
           f"{conf} % seed-bootstrap percentile interval ({cfg.spread.n_boot} resamples of the seeds with "
           f"replacement, each seed's two Δ together, generator seed {cfg.spread.seed}; resamples with "
           f"sd_{a_name} = 0 dropped and counted). Seeds needed: the smallest n whose two-sided paired t test at "
           f"α {cfg.stats.alpha} has {level} % power (noncentral t), at the sd [at the ends of its interval].", ""]
    for e in spread:
        out += [f"{e['model']} × {e['scheme']}:", "", f"| seed | Δ, endpoint {a_name} | Δ, endpoint {b_name} |",
                "|--:|--:|--:|"]
        out += [f"| {seed} | {_signed(x)} | {_signed(y)} |" for seed, x, y in zip(e["seeds"], e["a"], e["b"])]
        out.append("")
        if "note" in e:
            out += [e["note"], ""]
            continue
        out += [f"| endpoint | mean Δ | sd [{conf} % χ²] | "
                + " | ".join(f"seeds for {_num(x)} points at {level} %" for x in cfg.power.effects) + " |",
                "|---|--:|--:|" + "--:|" * len(cfg.power.effects)]
        for key, name in (("a", a_name), ("b", b_name)):
            lo, hi = e[f"sd_{key}_interval"]
            needed = " | ".join(_range_text(e[f"needed_{key}"][str(x)]) for x in cfg.power.effects)
            mean = float(np.mean(e[key]))
            out.append(f"| {name} | {_signed(mean)} | {e[f'sd_{key}']:.2f} [{lo:.2f}, {hi:.2f}] | {needed} |")
        r = e["ratio"]
        out.append("")
        if r is None:
            out.append(f"sd_{b_name} / sd_{a_name}: undefined (sd_{a_name} = 0).")
        else:
            out.append(f"sd_{b_name} / sd_{a_name} = {r['value']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] ({r['kept']} "
                       f"resamples kept, {r['dropped']} dropped with sd_{a_name} = 0).")
        if e.get("rule") is not None:
            k = e["rule"]["ratio"]
            verdict = "holds" if e["rule"]["holds"] else "does not hold"
            sign = "≤" if e["rule"]["holds"] else ">"
            out.append(f"Declared rule (spread.rule_ratio = {_num(k)}: endpoint {b_name} when sd_{b_name} ≤ {_num(k)} "
                       f"× sd_{a_name}, on the point estimates): sd_{b_name} {e['sd_b']:.2f} {sign} {_num(k)} × "
                       f"{e['sd_a']:.2f} = {k * e['sd_a']:.2f}: **{verdict}**.")
        out.append("")
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def _pooled_markdown(pooled: list[dict], cfg: DictConfig, label: str) -> list[str]:
    if not pooled:
        return []
    conf, level = int(round(100 * (1 - cfg.stats.alpha))), int(round(100 * cfg.power.level))
    out = [f"### Pooled over study folders (descriptive, no verdict)", "",
           f"Per paired seed, Δ = {label} of the scheme − {cfg.baseline} in points, "
           f"{_endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}, from this folder and pooled.dirs, each read "
           f"with this report's settings. t interval: {conf} %, df = n − 1; sd with its {conf} % chi-square interval; "
           f"detectable: the smallest effect the two-sided paired t test over the n pooled seeds at α "
           f"{cfg.stats.alpha} detects with {level} % power, at the sd [at the ends of its interval].", ""]
    for e in pooled:
        out += [f"{e['model']} × {e['scheme']}:", "", "| folder | seeds | per-seed Δ | mean |", "|---|---|---|--:|"]
        for f in e["folders"]:
            deltas = ", ".join(_signed(x) for x in f["deltas"])
            mean = DASH if f["mean"] is None else _signed(f["mean"])
            out.append(f"| {f['folder']} | {', '.join(map(str, f['seeds']))} | {deltas} | {mean} |")
        out.append("")
        if "mean" in e:
            lo, hi = e["sd_interval"]
            det = e["detectable"]
            out.append(f"Pooled, n = {e['n']}: mean Δ {_signed(e['mean'])}, t interval [{_signed(e['t_lo'])}, "
                       f"{_signed(e['t_hi'])}] (df {e['df']}); sd {e['sd']:.2f} [{lo:.2f}, {hi:.2f}]; detectable at "
                       f"{level} % power with {e['n']} seeds: {det[0]:.1f} points [{det[1]:.1f}, {det[2]:.1f}].")
        if e["differ"]:
            out.append("The folders differ in: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in e["differ"].items())
                       + ".")
        out.append("")
    return out


def _generation_markdown(generation: list[dict]) -> list[str]:
    out = ["### What the arms generated (final evaluation)", "",
           "| model | scheme | seed | samples | truncated (%) | mean completion tokens | truncation from |",
           "|---|---|--:|--:|--:|--:|---|"]
    for g in generation:
        out.append(f"| {g['model']} | {g['scheme']} | {g['seed']} | {g['samples']} | {_pct(g['truncated_rate'])} | "
                   + (f"{g['mean_tokens']:.1f}" if g["mean_tokens"] is not None else DASH) + f" | {g['source']} |")
    return out + [""]


def _smallest_seed_counts(tables: list[MetricTable]) -> list[tuple[int, int]]:
    """(seeds, seeds with a non-zero Δ) of every Δ in the tables, distinct, sorted."""
    return sorted({(r.cells[c].delta.n_seeds, stats.nonzero_seeds(r.cells[c].delta.seed_deltas)) for t in tables
                   for r in t.rows for c in t.columns if r.cells[c].delta is not None})


def _legend(cfg: DictConfig, tables: Optional[list[MetricTable]] = None) -> str:
    s = cfg.stats
    counts = _smallest_seed_counts(tables or [])
    reach = "; ".join(f"{n} seeds: {_p(stats.seed_sign_flip_min_p(m))}" if m == n else
                      f"{n} seeds of which {n - m} {'has' if n - m == 1 else 'have'} Δ = 0: "
                      f"{_p(stats.seed_sign_flip_min_p(m))}"
                      for n, m in counts if n > 1)
    primary = (f"the declared primary comparison is {cfg.primary_metric} on the {AVG} column (or the only "
               f"benchmark), used as it is; every other comparison of a row is Holm-adjusted over the row's "
               f"comparisons across metrics and benchmarks (t and sign-flip separately)"
               if _has_primary(cfg) else f"every comparison of a row is Holm-adjusted over the row's "
               "comparisons across metrics and benchmarks (t and sign-flip separately); no primary comparison "
               + ("declared" if cfg.primary_metric is None
                  else f"(primary_metric = {cfg.primary_metric} is not one of the metrics)"))
    return (f"Cells: mean over seeds, in percent; non-baseline cells show (Δ vs {cfg.baseline}) in percentage "
            f"points. * = significant at {s.alpha} for the scheme: both seed-level p-values below {s.alpha} (Holm-"
            f"adjusted unless primary) and the CI excluding 0; never with one seed ({ONE_SEED}). {AVG} = "
            f"{cfg.average} mean over the benchmark columns. Δ pairs each run with the {cfg.baseline} run of the "
            f"same model and seed, problem by problem. CI: two-level paired bootstrap (seeds"
            f"{' and' if s.resample_seeds else ' fixed,'} problems resampled, stratified by benchmark; {s.n_boot} "
            f"replicates). Seed-level tests, on the per-seed Δ (the unit of replication of a training scheme): "
            f"paired t with df = seeds − 1 and its t interval, and the exact sign-flip over all 2^seeds sign "
            f"assignments, whose smallest attainable two-sided p is 2 / 2^m for m seeds with a non-zero Δ"
            + (f" ({reach})" if reach else "") + f"; {primary}. Per-problem p (these trained models only): "
            f"two-sided paired sign-flip test on the seed-averaged per-problem differences, stratified by "
            f"benchmark (exact up to {s.exact_max} non-zero problems, else {s.n_perm} random flips); it holds the "
            f"trained models fixed and says nothing about another training seed. per-seed Δ: mean ± sd over the "
            f"paired seeds (grail_exp/analysis/stats.py)." + _design_text(cfg))


def _design_text(cfg: DictConfig) -> str:
    plans = []
    for model, plan in (cfg.design or {}).items():
        schemes = ", ".join(map(str, plan.schemes)) if plan.get("schemes") is not None else "every scheme"
        seeds = ", ".join(map(str, _expected_seeds(model, cfg) or [])) or "the seeds found"
        plans.append(f"{model}: {schemes} × seeds {seeds}")
    return f" Planned cells (others not run by design): {'; '.join(plans)}." if plans else ""


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "—": "---",
                  "Δ": r"$\Delta$", "×": r"$\times$", "±": r"$\pm$", "≥": r"$\geq$", "→": r"$\to$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))


def _tex_pct(x: Optional[float], signed: bool = False) -> str:
    """Like _pct, with a typographic minus and --- for missing."""
    return _pct(x, signed).replace("-", "$-$").replace(DASH, "---")


def render_latex(tables: list[MetricTable], notes: Notes, cfg: DictConfig, title: str) -> str:
    """booktabs tables (``\\usepackage{booktabs}``): the main table per metric and its Δ table."""
    alpha = cfg.stats.alpha
    mark = lambda n: rf"\textsuperscript{{{n}}}"  # noqa: E731
    out = [f"% {latex_escape(title)} -- generated by python -m grail_exp.report; needs \\usepackage{{booktabs}}"]
    for t in tables:
        lab = latex_escape(t.label + ("" if cfg.endpoint.steps is None else
                                      f", {_endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}"))
        out += [r"\begin{table}[t]", r"\centering", r"\small",
                rf"\caption{{{lab}{''.join(mark(n) for n in t.notes)} (\%) per model and scheme; "
                rf"in parentheses $\Delta$ vs "
                rf"{latex_escape(cfg.baseline)} in points, * both seed-level $p<{alpha}$ and the CI excluding 0.}}",
                r"\begin{tabular}{ll" + "r" * (1 + len(t.columns)) + "}", r"\toprule",
                " & ".join(["Model", "Scheme", "Seeds"] + [latex_escape(c) for c in t.columns]) + r" \\",
                r"\midrule"]
        last_model = None
        for r in t.rows:
            cells = []
            for c in t.columns:
                cell = r.cells[c]
                if cell.value is None:
                    txt = "---"
                else:
                    txt = _tex_pct(cell.value)
                    if not r.baseline:
                        if cell.delta is None:
                            txt += r"\,{\scriptsize($\Delta$ ---)}"
                        else:
                            star = "*" if cell.delta.significant(alpha) else ""
                            one = f"; {ONE_SEED}" if cell.delta.n_seeds == 1 else ""
                            txt += rf"\,{{\scriptsize({_tex_pct(cell.delta.delta, True)}{star}{one})}}"
                cells.append(txt + "".join(mark(n) for n in cell.notes))
            model = latex_escape(r.model) if r.model != last_model else ""
            last_model = r.model
            scheme = latex_escape(r.scheme) + "".join(mark(n) for n in r.notes)
            out.append(" & ".join([model, scheme, latex_escape(_seeds_text(r))] + cells) + r" \\")
        out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
        # Δ table
        out += [r"\begin{table}[t]", r"\centering", r"\small",
                rf"\caption{{{lab}: $\Delta$ vs {latex_escape(cfg.baseline)} (points), paired "
                rf"{int(round(100 * (1 - alpha)))}\% bootstrap CI, per-seed mean $\pm$ sd, seed-level $t$ and "
                rf"sign-flip $p$ (min.\ attainable), Holm-adjusted $p$ ($t$ / sign-flip), per-problem sign-flip "
                rf"$p$ (these trained models only).}}",
                r"\begin{tabular}{lllrrrrrrrrr}", r"\toprule",
                r"Model & Scheme & Benchmark & $\Delta$ & CI & Per-seed $\Delta$ & Seed $t$, $p$ & Seed flip $p$ & "
                r"Holm $p$ & Problem $p$ & Seeds & Problems \\",
                r"\midrule"]
        for r in t.rows:
            if r.baseline:
                continue
            for c in (t.columns if r.seeds else ["all"]):
                d = r.cells[c].delta if r.seeds else None
                head = [latex_escape(r.model), latex_escape(r.scheme), latex_escape(c)]
                if d is None:
                    out.append(" & ".join(head + ["---"] + [""] * 8) + r" \\")
                    continue
                sd = rf" $\pm$ {100 * d.seed_sd:.1f}" if d.seed_sd is not None else ""
                ci = f"[{_tex_pct(d.lo, True)}, {_tex_pct(d.hi, True)}]"
                seed_cells = [re.sub(r"-(?=[\d.i])", "$-$", latex_escape(x)) for x in _seed_tests_text(d)]
                out.append(" & ".join(head + [_tex_pct(d.delta, True), ci, _tex_pct(d.seed_mean, True) + sd,
                                              *seed_cells, latex_escape(_p(d.p_value)), str(d.n_seeds),
                                              str(d.n_problems)]) + r" \\")
        out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    if notes.texts:
        out.append(r"% Notes:")
        out.append(r"\begin{itemize}\footnotesize")
        out += [rf"\item[\textsuperscript{{{letter(i)}}}] {latex_escape(t)}" for i, t in enumerate(notes.texts)]
        out.append(r"\end{itemize}")
    return "\n".join(out) + "\n"


def to_json(tables: list[MetricTable], notes: Notes, runs: dict, cfg: DictConfig) -> dict:
    def cell(c: Cell):
        return {"value": c.value, "n_seeds": c.n_seeds, "notes": c.notes,
                "delta": c.delta.to_dict() if c.delta else None}

    return {
        "baseline": cfg.baseline, "average": cfg.average,
        "stats": OmegaConf.to_container(cfg.stats, resolve=True),
        "tables": [{"metric": t.spec, "label": t.label, "columns": t.columns, "notes": t.notes,
                    "rows": [{"model": r.model, "scheme": r.scheme, "baseline": r.baseline, "seeds": r.seeds,
                              "paired_seeds": r.paired_seeds, "notes": r.notes,
                              "cells": {c: cell(r.cells[c]) for c in t.columns}} for r in t.rows]}
                   for t in tables],
        "notes": {letter(i): t for i, t in enumerate(notes.texts)},
        "runs": runs,
    }


# ----------------------------------------------------------------------------------------------- plots across runs
def report_plots(client, arms: dict, tables: list[MetricTable], cfg: DictConfig, out_dir: Path) -> list[Path]:
    """Per model: training curves by scheme, pass@k vs k by scheme (avg over benchmarks), and the token-weight
    profile and weight-vs-entropy by scheme (from the runs' weights/ tables, when they logged any)."""
    from grail_exp.analysis import plots as P

    made: list[Path] = []
    rows = tables[0].rows  # the table's order: models, then baseline first
    for model in dict.fromkeys(r.model for r in rows):
        schemes = {r.scheme: arms[(model, r.scheme)] for r in rows
                   if r.model == model and arms.get((model, r.scheme))}
        if not schemes:
            continue
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
        groups = {s: _histories(client, list(seeds.values()), list(cfg.plots.curves)) for s, seeds in schemes.items()}
        made.append(P.plot_training_curves(groups, out_dir / f"{tag}_training_curves.png", list(cfg.plots.curves),
                                           title=f"{model}: mean over seeds ± sd"))
        curves = {}
        for s, seeds in schemes.items():
            curve = _pass_at_k_curve(seeds, cfg)
            if curve:
                curves[s] = curve
        if curves:
            made.append(P.plot_pass_at_k(curves, out_dir / f"{tag}_pass_at_k.png",
                                         title=f"{model}: {cfg.average} mean over benchmarks and seeds"))
        if cfg.plots.weights:
            frames = {}
            with tempfile.TemporaryDirectory() as tmp:
                for s, seeds in schemes.items():
                    parts = []
                    for rec in seeds.values():
                        d = rec.weights_dir or (P.download_weight_tables(client, rec.run_id, Path(tmp) / rec.run_id,
                                                                         cfg.plots.weights_max_files)
                                                if client is not None else None)
                        f = P.load_weight_frames(d, cfg.plots.weights_max_files) if d is not None else None
                        if f is not None:  # offset rows so that (step, row) of different seeds stay apart
                            parts.append(f.assign(row=f["row"] + 1_000_000 * len(parts)))
                    if parts:
                        import pandas as pd

                        frames[s] = pd.concat(parts, ignore_index=True)
            if frames:
                made.append(P.plot_positional_profile(frames, out_dir / f"{tag}_weights_positional_profile.png",
                                                      title=f"{model}: mean token weight before the first box"))
                made.append(P.plot_weight_vs_entropy(frames, out_dir / f"{tag}_weights_vs_entropy.png",
                                                     title=f"{model}: token weight vs entropy"))
    return [p for p in made if p is not None]


def _histories(client, recs: list, keys: list[str]) -> list[dict]:
    """Per run ``{key: (steps, values)}``: a study folder's history.csv (an arm recorded without one has no curves),
    else the MLflow metric histories."""
    from grail_exp.analysis import plots as P

    out = []
    for rec in recs:
        if rec.history is not None:
            h = rec.history
            out.append({k: (h.index.to_numpy(), h[k].to_numpy(dtype=float)) for k in keys if k in h})
        elif rec.folder is not None:
            log.warning("study arm %s has no history.csv: no training curves for it", rec.folder.name)
        elif client is not None:
            out.extend(P.fetch_histories(client, [rec.run_id], keys).values())
    return out


def _pass_at_k_curve(seeds: dict, cfg: DictConfig):
    """(ks, values): pass@k for k = 1..n (n = the fewest samples of any problem), the benchmark average (over
    the benchmarks every seed has) and the mean over seeds; None without data."""
    recs = list(seeds.values())
    benches = sorted(set.intersection(*(set(r.samples["benchmark"].astype(str)) for r in recs)))
    if not benches:
        return None
    n = min(int(r.samples.groupby(["benchmark", "problem_index"]).size().min()) for r in recs)
    ks, out = list(range(1, n + 1)), []
    for k in ks:
        per_seed = []
        for rec in recs:
            v = per_problem_values(rec.samples, f"pass@{k}")
            w = stats.benchmark_weights([len(v[b][1]) for b in benches], cfg.average)
            per_seed.append(sum(wb * v[b][1].mean() for wb, b in zip(w, benches)))
        out.append(float(np.mean(per_seed)))
    return ks, out


# ----------------------------------------------------------------------------------------------- entry point
def build_report(cfg: DictConfig) -> dict:
    """Read the runs, build the tables, write Markdown / LaTeX / JSON (and plots), log them; return the paths and
    the JSON payload."""
    validate_report(cfg)  # before the slow imports: a bad override fails at once

    from mlflow.tracking import MlflowClient

    from grail_exp.tracking import build_tracker, tracking_uri_for, training_view_url

    uri = tracking_uri_for(cfg)
    client = MlflowClient(tracking_uri=uri)
    notes = Notes()
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.runs.dir:  # a study folder: the files stand in for MLflow
            arms, row_notes, ignored = select_study_arms(cfg, notes)
            raw, where = [r for seeds in arms.values() for r in seeds.values()], f"the study folder {cfg.runs.dir}"
        else:
            raw, where = search_runs(client, cfg), uri
            arms, row_notes, ignored = select_runs(client, raw, cfg, notes, Path(tmp))
        check_design(arms, cfg)
        for arm, letters in pairing_notes(arms, cfg, notes).items():
            row_notes[arm].extend(letters)
        if not any(arms.values()):
            raise ConfigError(f"no usable run among the {len(raw)} selected at {where} (filters: "
                              f"{OmegaConf.to_container(cfg.runs, resolve=True)}); notes: {notes.texts}")
        tables = build_tables(arms, row_notes, cfg, notes)
        apply_primary_and_holm(tables, cfg)
        family = apply_family(tables, cfg)
        main = primary_comparisons(tables)
        spread = spread_section(arms, main, cfg) if cfg.spread.steps is not None else []
        pooled = pooled_section(arms, main, cfg) if cfg.pooled.dirs else []
        generation = generation_table(arms, cfg)

        title = cfg.output.title or f"Paired comparison vs {cfg.baseline}"
        root = cfg.paths.root_dir  # the pages get committed: paths relative to the project (grail_exp/analysis/portable.py)
        used = {rec.run_id: {"model": rec.model, "scheme": rec.scheme, "seed": rec.seed,
                             "artifact": portable_text(rec.artifact, root) if rec.artifact else rec.artifact}
                for seeds in arms.values() for rec in seeds.values()}
        header = (f"## {title}\n\n{len(used)} runs from {portable_text(where, root)}"
                  + (f", children of run {cfg.runs.parent_run_id}" if cfg.runs.parent_run_id else "")
                  + (f", tags {dict(cfg.runs.tags)}" if cfg.runs.tags else "")
                  + (f" ({len(ignored)} other runs ignored: no model/scheme)" if ignored else "") + ".")
        if cfg.endpoint.steps is not None:
            header += (f"\n\nEvery per-problem value is {_endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)} "
                       f"(endpoint.steps; an arm's last step, trainer.max_steps, is its final evaluation). The table "
                       f"of what the arms generated is the final evaluation's.")
        label = next((f"{t.label} ({_primary_column(t)} column)" for t in tables if t.spec == str(cfg.primary_metric)),
                     str(cfg.primary_metric))
        sections = (_family_markdown(family, cfg) + _spread_markdown(spread, cfg, label)
                    + _pooled_markdown(pooled, cfg, label))
        md = render_markdown(tables, notes, cfg, header, generation, sections)
        tex = render_latex(tables, notes, cfg, title)
        payload = to_json(tables, notes, used, cfg)
        payload["generation"] = generation
        payload["ignored"] = ignored
        payload.update({k: v for k, v in (("endpoint", OmegaConf.to_container(cfg.endpoint, resolve=True)
                                            if cfg.endpoint.steps is not None else None),
                                           ("family", family), ("spread", spread), ("pooled", pooled)) if v})

        out = Path(cfg.output.dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / f"{cfg.output.name}.md", "latex": out / f"{cfg.output.name}.tex",
                 "json": out / f"{cfg.output.name}.json"}
        paths["markdown"].write_text(md)
        paths["latex"].write_text(tex)
        paths["json"].write_text(json.dumps(payload, indent=2, default=float))
        plot_paths: list[Path] = []
        if cfg.plots.enabled:
            try:
                plot_paths = report_plots(client, arms, tables, cfg, out / f"{cfg.output.name}_plots")
            except Exception as exc:  # a table without plots is still a table
                log.warning("report plots failed: %s: %s", type(exc).__name__, exc)

    run_id = _log_report(cfg, client, paths, plot_paths, tables, build_tracker)
    print(md)
    print(f"written: {', '.join(str(p) for p in paths.values())}"
          + (f" and {len(plot_paths)} plots in {out / (cfg.output.name + '_plots')}" if plot_paths else ""))
    if run_id:
        exp_id = client.get_run(run_id).info.experiment_id
        print(f"MLflow run {run_id}: {training_view_url(uri, exp_id, run_id)}"
              + ("" if uri.startswith("http") else f" (after: mlflow ui --backend-store-uri {uri})"))
    return {"paths": paths, "plots": plot_paths, "payload": payload, "markdown": md, "latex": tex,
            "mlflow_run_id": run_id}


def _log_report(cfg, client, paths, plot_paths, tables, build_tracker) -> Optional[str]:
    """Artifacts under ``report/`` of the parent run (log_to parent, or auto with a parent) or of a new run."""
    mode = cfg.log_to
    if mode == "auto":
        mode = "parent" if cfg.runs.parent_run_id else "report"
    if mode == "none" or cfg.logger.name == "none":
        return None
    if mode == "parent":
        run_id = cfg.runs.parent_run_id
        log_artifact = lambda p, d: client.log_artifact(run_id, str(p), d)  # noqa: E731
    else:
        tracker = build_tracker(cfg, f"report-{cfg.output.name}")
        tracker.set_tags({"job": "report", "baseline": cfg.baseline})
        tracker.log_params({"report.runs": json.dumps(OmegaConf.to_container(cfg.runs, resolve=True)),
                            "report.metrics": ",".join(cfg.metrics), "report.average": cfg.average})
        run_id = tracker.run_id
        log_artifact = tracker.log_artifact
        metrics = {}
        for t in tables:
            for r in t.rows:
                for c in t.columns:
                    d = r.cells[c].delta
                    if d is not None:
                        name = f"delta/{t.label.replace('@', '_at_')}/{r.model}/{r.scheme}/{c}"
                        key = re.sub(r"[^\w\-./ ]", "_", name)  # characters MLflow accepts in metric keys
                        metrics[key] = d.delta
        tracker.log_metrics(metrics, step=0)
    for p in paths.values():
        log_artifact(p, "report")
    for p in plot_paths:
        log_artifact(p, "report/plots")
    if mode == "report":
        tracker.end("FINISHED")
    return run_id


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="report")
def main(cfg: DictConfig) -> None:
    from grail_exp.errors import exit_on_user_error

    with exit_on_user_error():
        build_report(cfg)


if __name__ == "__main__":
    main()
