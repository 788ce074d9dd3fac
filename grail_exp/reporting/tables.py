"""The report's tables: per metric, rows model × scheme, columns the benchmarks and their average; every non-baseline
cell carries its paired Δ against the baseline (grail_exp/analysis/stats.py ``compare_paired``), footnoted where
runs, seeds or problems are missing; and the table of what each arm generated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from omegaconf import DictConfig

from grail_exp.analysis import stats
from grail_exp.reporting.runs import Notes, endpoint_values, metric_label, seed_key
from grail_exp.reporting.schema import parse_metric

AVG = "avg"
# The paper's benchmark order; other benchmarks follow alphabetically.
PAPER_ORDER = ["math500", "aime24", "amc23", "minerva_math", "college_math_200", "olympiadbench_200"]
DASH = "—"
ONE_SEED = "1 seed, problems only"  # a Δ of one trained pair: its tests resample problems only


@dataclass
class Cell:
    value: float | None = None  # arm mean over its seeds (fraction); None = missing
    n_seeds: int = 0
    delta: stats.PairedResult | None = None  # vs the baseline (non-baseline rows)
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


def _ordered(found: list[str], wanted: list[str] | None, first: str | None = None) -> list[str]:
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
        return ", ".join(f"{c} {pct(cell.value)}" if len(cells) > 1 else pct(cell.value)
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


def expected_seeds(model: str, cfg) -> list | None:
    planned = (cfg.design or {}).get(model, {}).get("seeds")
    return [str(s) for s in planned] if planned is not None else cfg.seeds


def _row(model, scheme, arms, values, row_notes, benches, cfg, notes) -> Row:
    arm, base = (model, scheme), (model, cfg.baseline)
    is_base = scheme == cfg.baseline
    mine = values.get(arm, {})
    seeds = sorted(mine, key=seed_key)
    rnotes = list(dict.fromkeys(row_notes.get(arm, [])))
    if arm not in arms or not seeds:
        rnotes.append(notes.mark(f"{model} × {scheme}: no finished run with per-sample results"))
    expected = expected_seeds(model, cfg)
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


def _diff_matrix(b, seeds, mine, theirs, model, scheme, cell, notes) -> np.ndarray | None:
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


def generation_table(arms: dict, cfg: DictConfig) -> list[dict]:
    """Per arm and seed, what the final evaluation generated: samples, the share truncated at the token limit and
    the mean completion length in tokens. Truncation is the samples' ``truncated`` flag; samples recorded without
    it count as truncated when ``n_tokens`` reached the run's ``eval.max_tokens`` (``source`` says which)."""
    out = []
    for (model, scheme), seeds in sorted(arms.items(), key=lambda kv: (kv[0][0], kv[0][1] != cfg.baseline,
                                                                        kv[0][1])):
        for seed in sorted(seeds, key=seed_key):
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


def pct(x: float | None, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return DASH
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"
