"""`python -m grail_exp.report` on synthetic MLflow runs with known per-sample results."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from helpers.compose import compose
from helpers.tolerances import HANG_TIMEOUT_S

BENCH = {"math500": 4, "aime24": 3}  # problems per benchmark; 3 samples per problem
N = 3


def _correct(scheme: str, seed: int, bench: str) -> np.ndarray:
    """(problems, samples) booleans; grail answers more, oar_g fewer, than grpo on the same problems."""
    rng = np.random.default_rng([seed, len(bench)])
    p = {"grpo": 0.5, "grail": 0.75, "oar_g": 0.25}[scheme]
    base = rng.random((BENCH[bench], N))  # common random numbers: the same uniforms for every scheme
    return base < p


def _weight_table() -> pd.DataFrame:
    """Two rollouts (one wrong, one correct) in the weights/step_*.parquet format of the training module."""
    rows = []
    for row, (correct, adv) in enumerate(((False, -0.5), (True, 0.5))):
        regions = ["pre"] * 8 + ["answer"] * 2
        for t, region in enumerate(regions):
            w = (2.0 if t in (0, 7) else 0.7) if region == "pre" and not correct else 1.0
            rows.append({"step": 2, "row": row, "correct": correct, "advantage": adv, "position": t,
                         "length": len(regions), "region": region, "weight": w, "entropy": 0.1 * t})
    return pd.DataFrame(rows)


def _samples(scheme: str, seed: int, benches=BENCH) -> pd.DataFrame:
    rows = []
    for b in benches:
        c = _correct(scheme, seed, b)
        for i in range(c.shape[0]):
            for j in range(N):
                rows.append({"benchmark": b, "problem_index": i, "sample_index": j, "completion": "...",
                             "extracted": "1" if c[i, j] else "2", "gold": "1", "correct": bool(c[i, j])})
    return pd.DataFrame(rows)


def _make_run(client, exp_id, tmp_path, tags, samples=None, status="FINISHED", params=None):
    run = client.create_run(exp_id, tags=tags, run_name=f"{tags.get('model')}-{tags.get('advantage')}")
    rid = run.info.run_id
    for k, v in (params or {"eval.seed": "0", "eval.n": str(N)}).items():
        client.log_param(rid, k, v)
    if samples is not None:
        d = tmp_path / "staging" / rid / "eval" / "final"
        d.mkdir(parents=True)
        samples.to_parquet(d / "samples.parquet", index=False)
        client.log_artifact(rid, str(d / "samples.parquet"), "eval/final")
    client.set_terminated(rid, status=status)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module (creating a sqlite store and its runs takes seconds); tests only add report runs,
    which reports ignore."""
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("grail_exp", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, run_name="sweep").info.run_id  # a sweep parent: no model/scheme tags
    ids = {}
    child = {"mlflow.parentRunId": parent}

    def arm(model, scheme, seed, **kw):
        tags = {"model": model, "advantage": scheme, "seed": str(seed), **child}
        ids[(model, scheme, seed, kw.get("status", "FINISHED"))] = _make_run(
            client, exp, tmp_path, tags, kw.pop("samples", _samples(scheme, seed)), **kw)

    for seed in (1, 2):
        arm("tiny", "grpo", seed)
        arm("tiny", "grail", seed)
    arm("tiny", "grail", 3)  # no grpo partner
    arm("tiny", "oar_g", 1)
    arm("tiny", "oar_g", 2, status="RUNNING", samples=None)  # not finished
    arm("tiny_llama", "grpo", 1)
    # training curves and a weight table for the report's plots
    weights = _weight_table()
    for (_model, scheme, seed, _), rid in ids.items():
        for step in range(3):
            client.log_batch(rid, metrics=[Metric(k, v * (1 + step + seed), 0, step) for k, v in
                                           {"reward/mean": 0.1, "accuracy": 0.1, "entropy": 0.2}.items()])
        stage = tmp_path / "staging" / rid / "weights"
        stage.mkdir(parents=True)
        weights.assign(weight=weights.weight * (1.5 if scheme == "grail" else 1.0)).to_parquet(
            stage / "step_000002.parquet")
        client.log_artifact(rid, str(stage / "step_000002.parquet"), "weights")
    client.set_terminated(parent)
    return {"uri": uri, "client": client, "parent": parent, "ids": ids, "tmp": tmp_path}


def _cfg(store, *extra):
    tmp = store["tmp"]
    return compose([f"logger.tracking_uri={store['uri']}", f"output.dir={tmp}/results", "stats.n_boot=2000",
                    f"runs.parent_run_id={store['parent']}", "plots.enabled=false", *extra],
                   tmp, config_name="report")


def _row(table, model, scheme):
    return next(r for r in table["rows"] if r["model"] == model and r["scheme"] == scheme)


def test_report_values_deltas_and_missing_cells(store):
    from grail_exp.reporting.build import build_report

    out = build_report(_cfg(store, "schemes=[grpo,grail,oar_g]", "log_to=report"))
    payload = out["payload"]
    acc = next(t for t in payload["tables"] if t["metric"] == "acc")
    assert acc["label"] == "acc@3" and acc["columns"] == ["math500", "aime24", "avg"]

    # arm values: mean over seeds of the per-benchmark mean of c/n, computed here directly
    grpo = _row(acc, "tiny", "grpo")
    for b in BENCH:
        want = np.mean([_correct("grpo", s, b).mean() for s in (1, 2)])
        assert grpo["cells"][b]["value"] == pytest.approx(want)
    assert grpo["cells"]["avg"]["value"] == pytest.approx(
        np.mean([np.mean([_correct("grpo", s, b).mean() for b in BENCH]) for s in (1, 2)]))

    # grail: three seeds in its own value, Δ on the two paired seeds
    grail = _row(acc, "tiny", "grail")
    assert grail["seeds"] == ["1", "2", "3"] and grail["paired_seeds"] == ["1", "2"]
    for b in BENCH:
        assert grail["cells"][b]["value"] == pytest.approx(np.mean([_correct("grail", s, b).mean()
                                                                    for s in (1, 2, 3)]))
    per_seed = [np.mean([(_correct("grail", s, b).mean(1) - _correct("grpo", s, b).mean(1)).mean() for b in BENCH])
                for s in (1, 2)]
    d = grail["cells"]["avg"]["delta"]
    assert d["delta"] == pytest.approx(np.mean(per_seed)) and d["delta"] > 0
    assert d["seed_deltas"] == pytest.approx(per_seed)
    assert d["seed_sd"] == pytest.approx(np.std(per_seed, ddof=1))
    assert d["lo"] <= d["delta"] <= d["hi"] and 0 < d["p_value"] <= 1 and d["p_method"] == "exact"
    assert d["n_seeds"] == 2 and d["n_problems"] == sum(BENCH.values())

    # oar_g: worse (Δ < 0) on its one finished seed; the RUNNING run is footnoted, never used
    oar = _row(acc, "tiny", "oar_g")
    assert oar["seeds"] == ["1"] and oar["cells"]["avg"]["delta"]["delta"] < 0
    assert oar["cells"]["avg"]["delta"]["seed_sd"] is None
    notes = payload["notes"]
    running = [k for k, t in notes.items() if "RUNNING" in t and "oar_g" in t]
    assert running and running[0] in oar["notes"]
    assert any("seed(s) 3 have no grpo partner" in notes[k] for k in grail["notes"])

    # tiny_llama has only a grpo run: its grail and oar_g rows are present and missing
    llama = _row(acc, "tiny_llama", "grail")
    assert all(c["value"] is None and c["delta"] is None for c in llama["cells"].values())
    assert any("no finished run" in notes[k] for k in llama["notes"])
    assert payload["ignored"] == []  # parent runs are not children of themselves

    # pass@3 (= pass@n): per problem, at least one of 3 correct
    p3 = next(t for t in payload["tables"] if t["metric"] == "pass@n")
    assert p3["label"] == "pass@3"
    want = np.mean([_correct("grpo", s, "math500").any(1).mean() for s in (1, 2)])
    assert _row(p3, "tiny", "grpo")["cells"]["math500"]["value"] == pytest.approx(want)

    # logged to a report run in the same experiment, with the three files
    c = store["client"]
    run = c.get_run(out["mlflow_run_id"])
    assert run.data.tags["job"] == "report" and run.info.status == "FINISHED"
    assert {a.path for a in c.list_artifacts(run.info.run_id, "report")} >= {
        "report/report.md", "report/report.tex", "report/report.json"}
    assert any(k.startswith("delta/acc_at_3/tiny/grail/avg") for k in run.data.metrics)

    # a second report ignores the first report run (tagged job=report) instead of counting it as a run
    again = build_report(_cfg(store, "log_to=none", "runs.parent_run_id=null"))
    assert len(again["payload"]["runs"]) == len(payload["runs"])
    assert any("names no model/scheme" in t for t in again["payload"]["ignored"])  # the sweep parent itself


def _check_markdown(md: str):
    blocks, cur = [], []
    for line in md.splitlines():
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            blocks.append(cur)
            cur = []
    assert blocks
    for block in blocks:
        counts = {len(re.findall(r"(?<!\\)\|", line)) for line in block}
        assert len(counts) == 1, block  # every row of a table has as many cells as its header
        assert re.fullmatch(r"\|(\s*-+:?\s*\|)+", block[1].replace(" ", "")), block[1]


def _check_latex(tex: str):
    body = re.sub(r"\\[{}%&$#_]", "", tex)  # escaped characters do not count
    body = "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("%"))
    depth = 0
    for ch in body:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    envs = re.findall(r"\\(begin|end)\{(\w+)\}", body)
    stack = []
    for kind, name in envs:
        if kind == "begin":
            stack.append(name)
        else:
            assert stack.pop() == name
    assert not stack
    assert body.count("$") % 2 == 0
    for spec, rows in re.findall(r"\\begin\{tabular\}\{(\w+)\}(.*?)\\end\{tabular\}", body, re.S):
        for line in rows.splitlines():
            if line.endswith(r"\\"):
                assert line.count("&") == len(spec) - 1, line
    assert "_" not in re.sub(r"\\_", "", body.replace("\\textsuperscript", "")).replace("grail\\_exp", "")


@pytest.mark.e2e
def test_markdown_and_latex_are_well_formed(store):
    from grail_exp.reporting.build import build_report

    out = build_report(_cfg(store, "schemes=[grpo,grail,oar_g]", "log_to=parent", "metrics=[acc,pass@2,maj]"))
    _check_markdown(out["markdown"])
    _check_latex(out["latex"])
    assert "—" in out["markdown"] and "(2 paired)" in out["markdown"]
    assert out["paths"]["latex"].read_text() == out["latex"]
    assert "---" in out["latex"] and r"\toprule" in out["latex"]
    if shutil.which("pdflatex"):  # compile it where LaTeX is installed
        doc = out["paths"]["latex"].with_name("doc.tex")
        doc.write_text("\\documentclass{article}\\usepackage[utf8]{inputenc}\\usepackage{booktabs}\n"
                       f"\\begin{{document}}\\input{{{out['paths']['latex']}}}\\end{{document}}\n")
        done = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=doc.parent,
                              capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
        assert done.returncode == 0, done.stdout[-2000:]
    arts = {a.path for a in store["client"].list_artifacts(store["parent"], "report")}
    assert "report/report.md" in arts  # log_to=parent


def test_missing_benchmark_and_problem_mismatch_are_footnoted():
    """Built without MLflow: grail seed 2 lacks aime24 and evaluated only 3 of the 4 math500 problems."""
    from grail_exp.reporting.runs import Notes, RunRecord
    from grail_exp.reporting.tables import build_tables

    def rec(scheme, seed, samples):
        return RunRecord(f"{scheme}{seed}", "tiny", scheme, str(seed), "FINISHED", 0, {}, samples)

    short = _samples("grail", 2, {"math500": 4})
    short = short[short.problem_index < 3]
    arms = {("tiny", "grpo"): {"1": rec("grpo", 1, _samples("grpo", 1)), "2": rec("grpo", 2, _samples("grpo", 2))},
            ("tiny", "grail"): {"1": rec("grail", 1, _samples("grail", 1)), "2": rec("grail", 2, short)}}
    cfg = compose(["stats.n_boot=500"], None, config_name="report")
    notes = Notes()
    (table,) = build_tables(arms, {}, _with(cfg, metrics=["acc"]), notes)
    grail = next(r for r in table.rows if r.scheme == "grail")
    aime, avg, math = grail.cells["aime24"], grail.cells["avg"], grail.cells["math500"]
    assert aime.n_seeds == 1 and aime.delta.n_seeds == 1
    assert any("only seed(s) 1 have results" in notes.texts[_idx(n)] for n in aime.notes)
    assert avg.n_seeds == 1 and avg.delta.n_seeds == 1  # only seed 1 has every benchmark
    assert math.delta.n_problems == 3 and math.delta.n_seeds == 2
    assert any("paired on the 3 problems" in notes.texts[_idx(n)] for n in math.notes)
    d1 = _correct("grail", 1, "math500")[:3].mean(1) - _correct("grpo", 1, "math500")[:3].mean(1)
    d2 = _correct("grail", 2, "math500")[:3].mean(1) - _correct("grpo", 2, "math500")[:3].mean(1)
    assert math.delta.delta == pytest.approx(np.mean([d1.mean(), d2.mean()]))

    # pass@4 from 3 samples per problem is undefined: every cell is missing and the table says why
    (p4,) = build_tables(arms, {}, _with(cfg, metrics=["pass@4"]), notes)
    assert all(c.value is None for r in p4.rows for c in r.cells.values())
    assert p4.notes and "at least 4 samples" in notes.texts[_idx(p4.notes[0])]


def _with(cfg, **kw):
    from omegaconf import OmegaConf

    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    for k, v in kw.items():
        cfg[k] = v
    return cfg


def _idx(letter: str) -> int:
    return ord(letter) - ord("a")


@pytest.mark.e2e
def test_cli_runs(store, tmp_path):
    done = subprocess.run([sys.executable, "-m", "grail_exp.report", f"logger.tracking_uri={store['uri']}",
                           f"paths.root_dir={tmp_path}", f"output.dir={tmp_path}/cli", "output.name=table",
                           "stats.n_boot=200", "plots.enabled=false", "+runs.tags.model=tiny", "log_to=none",
                           f"hydra.run.dir={tmp_path}/hydra"], capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
                          cwd=tmp_path)  # from another directory: the entry point finds conf/report.yaml
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tiny | grail" in done.stdout
    assert json.loads((tmp_path / "cli" / "table.json").read_text())["baseline"] == "grpo"


def test_bad_config_names_every_key():
    from grail_exp.config import ConfigError
    from grail_exp.reporting.schema import validate_report

    cfg = compose(["metrics=[accuracy,pass@2]", "average=median", "log_to=parent"], None, config_name="report")
    with pytest.raises(ConfigError) as e:
        validate_report(cfg)
    msg = str(e.value)
    assert "metrics: 'accuracy'" in msg and "pass@2" not in msg.replace("pass@<k>", "")
    assert "average = 'median'" in msg and "log_to = parent needs runs.parent_run_id" in msg


def test_report_plots(store):
    from grail_exp.reporting.build import build_report

    out = build_report(_cfg(store, "plots.enabled=true", "log_to=parent", "output.name=plotted", "models=[tiny]",
                            "plots.curves=[accuracy,entropy]"))
    names = {p.name for p in out["plots"]}
    assert names == {f"tiny_{k}.png" for k in ("training_curves", "pass_at_k", "weights_positional_profile",
                                                "weights_vs_entropy")}
    for p in out["plots"]:
        assert p.read_bytes()[:4] == b"\x89PNG"
    arts = {a.path for a in store["client"].list_artifacts(store["parent"], "report/plots")}
    assert "report/plots/tiny_weights_positional_profile.png" in arts


def test_log_training_plots_and_experiment_kind(store):
    from grail_exp.analysis.plots import log_training_plots
    from grail_exp.tracking import EXPERIMENT_KIND_TAG, MlflowTracker

    c, tmp = store["client"], store["tmp"]
    # the store's experiment was made without a kind: a tracker using it marks it as a training experiment
    tracker = MlflowTracker(store["uri"], "grail_exp", "end-of-run", (tmp / "art").as_uri())
    assert c.get_experiment(tracker.experiment_id).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    # a kind chosen by hand is kept
    other = c.create_experiment("genai", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    MlflowTracker(store["uri"], "genai", "x", (tmp / "art").as_uri()).end()
    assert c.get_experiment(other).tags[EXPERIMENT_KIND_TAG] == "genai_development"

    for step in range(4):
        tracker.log_metrics({"reward/mean": 0.1 * step, "accuracy": 0.1 * step, "entropy": 1 - 0.1 * step}, step)
    stage = tmp / "stage-end" / "weights"
    stage.mkdir(parents=True)
    _weight_table().to_parquet(stage / "step_000002.parquet")
    tracker.log_artifact(str(stage / "step_000002.parquet"), "weights")
    logged = log_training_plots(tracker, label="grail")  # weights read back from the run's own artifacts
    assert set(logged) == {"plots/training_curves.png", "plots/weights_positional_profile.png",
                           "plots/weights_vs_entropy.png"}
    assert {a.path for a in c.list_artifacts(tracker.run_id, "plots")} == set(logged)
    # from a run directory instead, and with no weight tables at all: only what exists is plotted
    assert "plots/weights_vs_entropy.png" in log_training_plots(tracker, tmp / "stage-end")
    tracker.end()
    assert log_training_plots(type("T", (), {"run_id": None})()) == []


def test_training_view_url():
    from grail_exp.tracking import training_view_url

    assert training_view_url("sqlite:///x.db", "3") == (
        "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning")
    assert training_view_url("http://host:8080/", "3", "abc") == (
        "http://host:8080/#/experiments/3/runs/abc?workflowType=machine_learning")


def test_per_rollout_runs_are_their_own_arm():
    from grail_exp.reporting.runs import arm_scheme

    assert arm_scheme("grail", {"advantage.recompute": "per_rollout"}) == "grail+per_rollout"
    assert arm_scheme("grail", {"advantage.recompute": "per_update"}) == "grail"
    assert arm_scheme("grail", {}) == "grail"
    assert arm_scheme("delta", {"advantage.recompute": "per_rollout"}) == "delta"  # per rollout by design


def test_design_limits_a_models_rows_and_expected_seeds(store):
    """A planned subset (the CPU study: tiny Llama x grpo, grail x seeds 1-3): cells outside it are no rows and
    no "missing" notes; planned cells without runs still are missing; a plan without the baseline is refused."""
    from grail_exp.config import ConfigError
    from grail_exp.reporting.build import build_report
    from grail_exp.reporting.schema import validate_report

    plan = "+design.tiny_llama={schemes: [grpo, grail], seeds: [1, 2]}"
    out = build_report(_cfg(store, "schemes=[grpo,grail,oar_g]", "seeds=[1,2,3]", "log_to=none", plan))
    payload = out["payload"]
    acc = next(t for t in payload["tables"] if t["metric"] == "acc")
    assert [r["scheme"] for r in acc["rows"] if r["model"] == "tiny"] == ["grpo", "grail", "oar_g"]
    assert [r["scheme"] for r in acc["rows"] if r["model"] == "tiny_llama"] == ["grpo", "grail"]
    notes = payload["notes"]
    llama_grpo = [notes[k] for k in _row(acc, "tiny_llama", "grpo")["notes"]]
    assert llama_grpo == ["tiny_llama × grpo: seed(s) 2 missing"]  # its plan's seeds 1, 2, not the top-level 1-3
    assert any("no finished run" in notes[k] for k in _row(acc, "tiny_llama", "grail")["notes"])  # planned, absent
    assert not any("tiny_llama × oar_g" in t for t in notes.values())
    tiny_grpo = [notes[k] for k in _row(acc, "tiny", "grpo")["notes"]]
    # other models keep the top-level seeds; grail pairs seeds 1, 2 and oar_g seed 1 only: the baseline over oar_g's
    # paired seed is footnoted (seed 1's grpo, as tiny_llama's grpo seed 1 reads in docs/report.md: 50.0, 55.6)
    assert tiny_grpo == ["tiny × grpo: seed(s) 3 missing",
                         "tiny × grpo over the seeds paired with oar_g (1): math500 50.0, aime24 55.6, avg 52.8"]
    assert "Planned cells (others not run by design): tiny_llama: grpo, grail × seeds 1, 2." in out["markdown"]

    bad = compose(["+design={tiny_llama: {schemes: [grail]}}", "models=[tiny]"], None, config_name="report")
    with pytest.raises(ConfigError) as e:
        validate_report(bad)
    assert "design.tiny_llama.schemes = ['grail']: must include the baseline 'grpo'" in str(e.value)
    assert "design.tiny_llama: not one of models = ['tiny']" in str(e.value)
    with pytest.raises(ConfigError, match=r"design.tiny_llama = .*: must be a mapping with keys schemes and/or seeds"):
        validate_report(compose(["+design.tiny_llama={seed: [1]}"], None, config_name="report"))


# ------------------------------------------------------------------------------------------------ seed-level stars
def _study(root, seeds, grail_correct, benches=("b1", "b2"), problems=10, n=4, extra=None):
    """A study folder (grail_exp/analysis/study.py layout): grpo answers 2 of 4 samples of every problem, grail
    ``grail_correct`` of 4 (or ``grail_correct[seed]``), per seed; optional per-sample columns ``extra``
    (name -> value per (scheme, seed))."""
    import hashlib

    for seed in seeds:
        k_grail = grail_correct[seed] if isinstance(grail_correct, dict) else grail_correct
        for scheme, k in (("grpo", 2), ("grail", k_grail)):
            folder = root / f"m-{scheme}-s{seed}"
            folder.mkdir(parents=True)
            rows = [{"benchmark": b, "problem_index": i, "sample_index": j, "correct": j < k, "extracted": "1",
                     **{c: f(scheme, seed, j) for c, f in (extra or {}).items()}}
                    for b in benches for i in range(problems) for j in range(n)]
            pd.DataFrame(rows).to_parquet(folder / "samples_final.parquet", index=False)
            sha = hashlib.sha256((folder / "samples_final.parquet").read_bytes()).hexdigest()
            (folder / "arm.json").write_text(json.dumps({
                "arm": folder.name, "model": "m", "scheme": scheme, "seed": str(seed), "status": "FINISHED",
                "run_id": folder.name, "metrics": {}, "config": {"seed": seed, "eval.n": n, "eval.max_tokens": 8},
                "files": {"samples_final.parquet": sha}}))
    return root


def _study_report(study, tmp, seeds, *extra):
    from grail_exp.reporting.build import build_report

    return build_report(compose([f"runs.dir={study}", "design_check.strict=true", "schemes=[grpo,grail]",
                                 f"seeds=[{','.join(map(str, seeds))}]", "metrics=[acc,pass@n]", "stats.n_boot=200",
                                 "stats.n_perm=200", "plots.enabled=false", "log_to=none", f"output.dir={tmp}/out",
                                 f"paths.root_dir={tmp}", *extra], None, config_name="report"))


def _grail_row(out, metric):
    table = next(t for t in out["payload"]["tables"] if t["metric"] == metric)
    return next(r for r in table["rows"] if r["scheme"] == "grail")


def test_six_seeds_star_the_primary_and_holm_adjusts_the_rest(tmp_path):
    """grail answers 3 of 4 where grpo answers 2: +25 points on every problem of both benchmarks in all six seeds;
    pass@4 is 100 % for both (Δ 0). Seed-level, by hand: sd 0 so the t test gives p = 0; the sign flips give
    2/64 (only all-+ and all-− reach |Σ|). acc on avg is the declared primary: raw p, a star. The row's other
    comparisons are acc on b1, b2 and pass@4 on b1, b2, avg (five): Holm on the sign-flip p's (1/32, 1/32, 1, 1, 1)
    gives 5 × 1/32 = 0.15625 and 4 × 1/32 = 0.125 -> running max 0.15625 for both acc columns: no star there."""
    seeds = [1, 2, 3, 4, 5, 6]
    out = _study_report(_study(tmp_path / "study", seeds, 3), tmp_path, seeds)
    acc = _grail_row(out, "acc")["cells"]
    assert acc["avg"]["delta"]["primary"] and acc["avg"]["delta"]["seed_flip_p"] == 2 / 64
    assert acc["avg"]["delta"]["seed_flip_p_holm"] is None
    for b in ("b1", "b2"):
        d = acc[b]["delta"]
        assert not d["primary"] and d["seed_flip_p"] == 2 / 64 and d["seed_t_p"] == 0.0
        assert d["seed_flip_p_holm"] == pytest.approx(0.15625, abs=1e-15)
    row = next(line for line in out["markdown"].splitlines() if line.startswith("| m | grail | 6 |"))
    assert row == "| m | grail | 6 | 75.0 (+25.0) | 75.0 (+25.0) | 75.0 (+25.0*) |"
    assert "primary" in out["markdown"] and "6 seeds: 0.031" in out["markdown"]


def test_three_seeds_never_star_whatever_the_problems_say(tmp_path):
    """The same +25 points on every problem with three seeds: the per-problem sign-flip is tiny (these trained
    models differ), but the seed-level sign-flip cannot go below 2/2^3 = 0.25: no star, and the report says so."""
    seeds = [1, 2, 3]
    out = _study_report(_study(tmp_path / "study", seeds, 3), tmp_path, seeds)
    d = _grail_row(out, "acc")["cells"]["avg"]["delta"]
    assert d["p_value"] < 0.01 and d["seed_flip_p"] == 0.25 and d["seed_flip_min_p"] == 0.25
    assert "*" not in next(line for line in out["markdown"].splitlines() if line.startswith("| m | grail | 3 |"))
    assert "3 seeds: 0.250" in out["markdown"] and "these trained models only" in out["markdown"]



RULE = ("decision.seeds=6", "decision.min_same_sign=5")


def test_the_declared_rule_decides_the_primary_comparison_from_the_seeds(tmp_path):
    """grail answers 3 of 4 (+25 points vs grpo's 2 of 4) in seeds 1-5 and 1 of 4 (−25) in seed 6. By hand: mean
    16.6667, sd 20.4124 (sum of squared deviations 5 × 8.3333² + 41.6667² = 2083.33, over 5), se 8.3333,
    t_(0.975, 5) = 2.570582 -> half-width 21.4215, interval [−4.7548, +38.0882]: 5 of 6 positive, but the
    interval contains 0: not settled. Six seeds of +25: sd 0, interval
    [+25, +25]: beats; six of −25: worse. The pass@4 table carries no rule (secondary)."""
    seeds = [1, 2, 3, 4, 5, 6]
    mixed = _study_report(_study(tmp_path / "mixed", seeds, {1: 3, 2: 3, 3: 3, 4: 3, 5: 3, 6: 1}), tmp_path, seeds,
                          *RULE)
    d = _grail_row(mixed, "acc")["cells"]["avg"]["delta"]
    assert (d["seed_t_lo"], d["seed_t_hi"]) == (pytest.approx(-0.047548, abs=2e-6), pytest.approx(0.380882, abs=2e-6))
    assert d["decision"]["verdict"] == "not settled"
    assert (d["decision"]["positive"], d["decision"]["negative"]) == (5, 1)
    assert "- m × grail: 5 of 6 seeds positive, 1 negative -> not settled by 6 seeds; t interval [-4.8, +38.1]" \
        in mixed["markdown"]
    assert "at least 5 of 6 seeds have Δ > 0" in mixed["markdown"]
    assert all(c["delta"]["decision"] is None for c in _grail_row(mixed, "pass@n")["cells"].values())
    better = _study_report(_study(tmp_path / "better", seeds, 3), tmp_path, seeds, *RULE)
    assert "- m × grail: 6 of 6 seeds positive, 0 negative -> grail beats grpo" in better["markdown"]
    worse = _study_report(_study(tmp_path / "worse", seeds, 1), tmp_path, seeds, *RULE)
    assert _grail_row(worse, "acc")["cells"]["avg"]["delta"]["decision"]["verdict"] == "worse"
    assert "grail is worse than grpo" in worse["markdown"]
    plain = _study_report(_study(tmp_path / "plain", seeds, 3), tmp_path, seeds)  # no rule declared: no line
    assert "Declared rule" not in plain["markdown"]


def test_the_declared_rule_waits_for_its_seeds_and_refuses_a_bad_declaration(tmp_path):
    """Three of six declared seeds: the rule says so instead of deciding. Bad declarations are named."""
    study = _study(tmp_path / "study", [1, 2, 3], 3)
    out = _study_report(study, tmp_path, [1, 2, 3, 4, 5, 6], *RULE)
    assert "- m × grail: 3 of 3 seeds positive, 0 negative: not applied yet (3 of the 6 declared seeds paired)" \
        in out["markdown"]
    from grail_exp.config import ConfigError
    from grail_exp.reporting.schema import validate_report

    with pytest.raises(ConfigError, match="set both"):
        validate_report(compose(["decision.seeds=6"], None, config_name="report"))
    with pytest.raises(ConfigError, match=r"need seeds >= 2 and 1 <= min_same_sign <= seeds"):
        validate_report(compose(["decision.seeds=6", "decision.min_same_sign=7"], None, config_name="report"))
    with pytest.raises(ConfigError, match=r"decision.seeds = 6, but seeds lists 3"):
        validate_report(compose([*RULE, "seeds=[1,2,3]"], None, config_name="report"))
    with pytest.raises(ConfigError, match="primary_metric = null is not one of metrics"):
        validate_report(compose([*RULE, "primary_metric=null"], None, config_name="report"))
    with pytest.raises(ConfigError, match=r"has 3 paired seeds \(1, 2, 3\); the rule was declared for 2"):
        _study_report(study, tmp_path, [1, 2, 3], "decision.seeds=2", "decision.min_same_sign=2", "seeds=null")

def test_one_seed_reads_problems_only_and_never_stars(tmp_path):
    out = _study_report(_study(tmp_path / "study", [1], 3, benches=("arithmetic",)), tmp_path, [1])
    md = out["markdown"]
    assert "| m | grail | 1 | 75.0 (+25.0; 1 seed, problems only) |" in md
    assert "1 seed, problems only" in md.split("### pass@4")[0]


def test_truncation_and_length_per_arm_from_the_samples(tmp_path):
    """grpo seed 1's samples: 2 of 4 truncated, lengths 8, 8, 3, 5 -> 50 %, 6.0 tokens; every other arm: none
    truncated, length 4. Without a truncated column the rate is n_tokens >= eval.max_tokens (8): the same."""
    def tokens(scheme, seed, j):
        return [8, 8, 3, 5][j] if (scheme, seed) == ("grpo", 1) else 4

    extra = {"n_tokens": tokens, "truncated": lambda scheme, seed, j: tokens(scheme, seed, j) >= 8}
    out = _study_report(_study(tmp_path / "a", [1, 2], 3, extra=extra), tmp_path / "a", [1, 2])
    gen = {(g["scheme"], g["seed"]): g for g in out["payload"]["generation"]}
    assert (gen[("grpo", "1")]["truncated_rate"], gen[("grpo", "1")]["mean_tokens"]) == (0.5, 6.0)
    assert (gen[("grail", "2")]["truncated_rate"], gen[("grail", "2")]["mean_tokens"]) == (0.0, 4.0)
    assert "| m | grpo | 1 | 80 | 50.0 | 6.0 | truncated flag |" in out["markdown"]
    from types import SimpleNamespace

    from grail_exp.reporting.tables import generation_table

    samples = pd.DataFrame({"n_tokens": [tokens("grpo", 1, j) for j in range(4)]})  # no truncated column
    arms = {("m", "grpo"): {"1": SimpleNamespace(samples=samples, params={"eval.max_tokens": "8"})}}
    g = generation_table(arms, compose([], None, config_name="report"))[0]
    assert (g["truncated_rate"], g["mean_tokens"]) == (0.5, 6.0)
    assert g["source"] == "n_tokens >= eval.max_tokens (8)"
