"""``build_report``: read the runs, build the tables and decisions, write the pages and plots, log them to MLflow."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grail_exp.analysis.portable import portable_text
from grail_exp.config import ConfigError
from grail_exp.reporting.decisions import (
    apply_family,
    apply_primary_and_holm,
    pooled_section,
    primary_column,
    primary_comparisons,
    spread_section,
)
from grail_exp.reporting.figures import report_plots
from grail_exp.reporting.render import (
    endpoint_text,
    family_markdown,
    pooled_markdown,
    render_latex,
    render_markdown,
    spread_markdown,
    to_json,
)
from grail_exp.reporting.runs import Notes, check_design, pairing_notes, search_runs, select_runs, select_study_arms
from grail_exp.reporting.schema import validate_report
from grail_exp.reporting.tables import build_tables, generation_table

log = logging.getLogger("grail_exp.report")


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
        arms, row_notes, ignored, raw, where = _select(cfg, client, uri, notes, Path(tmp))
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
        used = _used_runs(arms, root)
        header = _header(cfg, title, len(used), portable_text(where, root), ignored)
        label = next((f"{t.label} ({primary_column(t)} column)" for t in tables if t.spec == str(cfg.primary_metric)),
                     str(cfg.primary_metric))  # the primary metric as the sections name it
        sections = (family_markdown(family, cfg) + spread_markdown(spread, cfg, label)
                    + pooled_markdown(pooled, cfg, label))
        md = render_markdown(tables, notes, cfg, header, generation, sections)
        tex = render_latex(tables, notes, cfg, title)
        payload = _payload(cfg, to_json(tables, notes, used, cfg), generation, ignored,
                           {"family": family, "spread": spread, "pooled": pooled})

        out = Path(cfg.output.dir).expanduser()
        paths = _write_pages(out, cfg.output.name, md, tex, payload)
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
        print(_mlflow_line(client, uri, run_id, training_view_url))
    return {"paths": paths, "plots": plot_paths, "payload": payload, "markdown": md, "latex": tex,
            "mlflow_run_id": run_id}


def _select(cfg: DictConfig, client, uri: str, notes: Notes, tmp: Path):
    """(arms, row notes, ignored runs, the runs read, where from): a study folder's files (``runs.dir``, standing in
    for MLflow), else the MLflow runs the filters select."""
    if cfg.runs.dir:
        arms, row_notes, ignored = select_study_arms(cfg, notes)
        return (arms, row_notes, ignored, [r for seeds in arms.values() for r in seeds.values()],
                f"the study folder {cfg.runs.dir}")
    raw = search_runs(client, cfg)
    return (*select_runs(client, raw, cfg, notes, tmp), raw, uri)


def _used_runs(arms: dict, root) -> dict[str, dict]:
    """run id -> model, scheme, seed and artifact (relative to the project) of every run a table uses."""
    return {rec.run_id: {"model": rec.model, "scheme": rec.scheme, "seed": rec.seed,
                         "artifact": portable_text(rec.artifact, root) if rec.artifact else rec.artifact}
            for seeds in arms.values() for rec in seeds.values()}


def _mlflow_line(client, uri: str, run_id: str, training_view_url) -> str:
    """Where the report's MLflow run is shown (and how to open the UI on a local store)."""
    exp_id = client.get_run(run_id).info.experiment_id
    return (f"MLflow run {run_id}: {training_view_url(uri, exp_id, run_id)}"
            + ("" if uri.startswith("http") else f" (after: mlflow ui --backend-store-uri {uri})"))


def _payload(cfg: DictConfig, payload: dict, generation, ignored: list, sections: dict) -> dict:
    """The JSON page: the tables' JSON with what the arms generated, the ignored runs, the declared endpoint and the
    sections that have content (family, spread, pooled)."""
    payload["generation"] = generation
    payload["ignored"] = ignored
    endpoint = OmegaConf.to_container(cfg.endpoint, resolve=True) if cfg.endpoint.steps is not None else None
    payload.update({k: v for k, v in (("endpoint", endpoint), *sections.items()) if v})
    return payload


def _header(cfg: DictConfig, title: str, runs: int, where: str, ignored: list) -> str:
    """The page's opening: its title, how many runs from where (and by which filters), the endpoint when declared."""
    header = (f"## {title}\n\n{runs} runs from {where}"
              + (f", children of run {cfg.runs.parent_run_id}" if cfg.runs.parent_run_id else "")
              + (f", tags {dict(cfg.runs.tags)}" if cfg.runs.tags else "")
              + (f" ({len(ignored)} other runs ignored: no model/scheme)" if ignored else "") + ".")
    if cfg.endpoint.steps is not None:
        header += (f"\n\nEvery per-problem value is {endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)} "
                   f"(endpoint.steps; an arm's last step, trainer.max_steps, is its final evaluation). The table "
                   f"of what the arms generated is the final evaluation's.")
    return header


def _write_pages(out: Path, name: str, md: str, tex: str, payload: dict) -> dict[str, Path]:
    """``<name>.md``, ``.tex`` and ``.json`` under ``out``; their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / f"{name}.md", "latex": out / f"{name}.tex", "json": out / f"{name}.json"}
    paths["markdown"].write_text(md)
    paths["latex"].write_text(tex)
    paths["json"].write_text(json.dumps(payload, indent=2, default=float))
    return paths


def _log_report(cfg, client, paths, plot_paths, tables, build_tracker) -> str | None:
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
