"""The report's configuration: its schema (conf/report.yaml), stored as ``report_schema`` when this module is imported
(tests/helpers/compose.py imports it for config_name="report"), the metric specs and ``validate_report``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from grail_exp.config import ConfigError, LoggerConfig, PathsConfig, register_configs

_METRIC = re.compile(r"^(acc|maj|pass@(\d+|n))$")  # acc | maj | pass@<k> | pass@n


@dataclass
class RunSelection:
    """Which MLflow runs the report reads (all filters are ANDed)."""

    experiment_names: list[str] | None = None  # experiments searched; null = [logger.experiment_name]
    run_ids: list[str] = field(default_factory=list)  # explicit runs; when given, the filters below are ignored
    parent_run_id: str | None = None  # children of this run (tag mlflow.parentRunId): one sweep or study
    tags: dict = field(default_factory=dict)  # tag filters, e.g. {task_name: paper_table}
    filter: str | None = None  # an extra MLflow search filter, e.g. "params.loss.beta = '0.0'"
    # A study folder instead of MLflow (grail_exp/analysis/study.py: one <arm>/arm.json + samples per finished arm); when
    # set, the filters above are not used
    dir: str | None = None


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
    title: str | None = None  # heading; null = "Paired comparison vs <baseline>"


@dataclass
class PlotsConfig:
    enabled: bool = True  # training curves, pass@k vs k and token-weight plots per model (grail_exp/analysis/plots.py)
    curves: list[str] = field(default_factory=lambda: ["reward/mean", "accuracy", "completions/mean_length",
                                                       "entropy", "kl", "clip_ratio/region_mean"])
    weights: bool = True  # positional profile and weight-vs-entropy from the runs' weights/step_*.parquet
    weights_max_files: int = 10  # weight tables read per run, evenly spread over training


@dataclass
class DesignCheck:
    """What makes a set of runs one study (grail_exp/reporting/runs.py ``check_design``); flat config keys, fnmatch
    patterns."""

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

    seeds: int | None = None  # the number of seeds the rule was declared for
    min_same_sign: int | None = None  # seeds whose Δ must share the claimed sign
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

    steps: list[int] | None = None  # e.g. [40, 50, 60]
    name: str | None = None  # its name in the report, e.g. B; null: "the final evaluation" / "steps 40, 50, 60"


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

    steps: list[int] | None = None  # endpoint B's evaluations, e.g. [40, 50, 60] (the endpoint.steps convention)
    name: str | None = None  # e.g. B
    rule_ratio: float | None = None  # a rule declared beforehand: "B when sd_B <= rule_ratio · sd_A" (e.g. 0.5)
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
    models: list[str] | None = None  # row order / rows that must appear (missing ones read "—"); null = found
    schemes: list[str] | None = None  # likewise for schemes; null = found, baseline first
    seeds: list[str] | None = None  # the seeds every arm should have; missing ones are footnoted
    # The cells a study planned per model where they differ from schemes / seeds (keys: schemes, seeds; an absent
    # key = the top-level one), e.g. the CPU study's +design.tiny_llama="{schemes: [grpo, grail], seeds: [1, 2, 3]}"
    # beside tiny Qwen3 x three schemes x seeds 1-5: a cell outside its model's plan is no row and not "missing";
    # a planned cell without a finished run still is. (Untyped: OmegaConf cannot add typed values with +key=.)
    design: dict[str, Any] = field(default_factory=dict)
    benchmarks: list[str] | None = None  # columns; null = every benchmark found (paper order first)
    metrics: list[str] = field(default_factory=lambda: ["acc", "pass@n"])  # acc | pass@<k> | pass@n | maj
    # The declared primary comparison: this metric on the avg column (or the only benchmark); its seed-level p-values
    # are used as they are, every other comparison of a row is Holm-adjusted. null, or a metric not in metrics: all
    primary_metric: str | None = "acc"
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
        if folders[key] and not has_primary(cfg):
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
        if not has_primary(cfg):
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


def parse_metric(spec: str) -> tuple[str, int | None]:
    """``acc`` -> (acc, None); ``pass@3`` -> (pass, 3); ``pass@n`` -> (pass, None); ``maj`` -> (maj, None)."""
    m = _METRIC.match(spec)
    if not m:
        raise ConfigError(f"unknown metric {spec!r}")
    if m.group(1).startswith("pass"):
        return "pass", None if m.group(2) == "n" else int(m.group(2))
    return m.group(1), None


def has_primary(cfg: DictConfig) -> bool:
    return cfg.primary_metric is not None and str(cfg.primary_metric) in [str(m) for m in cfg.metrics]
