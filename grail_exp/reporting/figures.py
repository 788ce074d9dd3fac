"""The report's plots across runs, per model: training curves, pass@k vs k and the token-weight plots
(grail_exp/analysis/plots.py draws them)."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from grail_exp.analysis import stats
from grail_exp.reporting.runs import per_problem_values
from grail_exp.reporting.tables import MetricTable

log = logging.getLogger("grail_exp.report")


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
