"""What the report decides: each row's declared primary comparison, the declared rule and the Holm adjustment over a
row's other comparisons or over a family of study folders, and the spread and pooled sections built from the same
comparison under a second endpoint or in other folders."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from omegaconf import DictConfig, OmegaConf

from grail_exp.analysis import stats
from grail_exp.analysis.portable import portable_text
from grail_exp.config import ConfigError
from grail_exp.reporting.runs import Notes, check_design, endpoint_samples, select_study_arms
from grail_exp.reporting.tables import AVG, MetricTable, Row, build_tables


def primary_column(table: MetricTable) -> str:
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
                    and c == primary_column(t)
                if d.primary and cfg.decision.seeds is not None:
                    d.decision = _decide(d, r, cfg)
                if not d.primary and d.seed_level():
                    rows[(r.model, r.scheme)].append(d)
    for family in rows.values():
        t_adj = stats.holm([d.seed_t_p for d in family])
        flip_adj = stats.holm([d.seed_flip_p for d in family])
        for d, tp, fp in zip(family, t_adj, flip_adj):
            d.seed_t_p_holm, d.seed_flip_p_holm = tp, fp


def _decide(d: stats.PairedResult, row: Row, cfg: DictConfig, holm_p: float | None = None) -> dict:
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


def folder_comparisons(cfg: DictConfig, arms: dict | None = None) -> tuple[dict, dict]:
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
    for (_model, scheme), seeds in arms.items():
        if scheme != cfg.baseline:
            continue
        for rec in seeds.values():
            for k in POOLED_KEYS + list(cfg.pairing_params):
                if k in rec.params and k not in out:
                    out[k] = str(rec.params[k])
    return out
