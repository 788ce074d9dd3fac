"""The real-model scheme study (docs/real-model-study.md): the chain task, the study folder (arms recorded, skipped and
refused on restart), the report's design check, and the driver end to end at toy scale with a deterministic kill."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers.compose import compose
from helpers.tolerances import HANG_TIMEOUT_S

ROOT = Path(__file__).parents[1]


# ------------------------------------------------------------------------------------------------ the chain task
def test_solution_styles_write_the_same_chain():
    from grail_exp.data.arithmetic import render_solution

    chain = [(7, "+", 5, 12), (12, "-", 3, 9), (9, "+", 8, 17)]
    assert render_solution(chain, "compact") == "7+5=12. 12-3=9. 9+8=17. \\boxed{17}"
    assert render_solution(chain, "steps") == ("Step 1: 7 + 5 = 12.\nStep 2: 12 - 3 = 9.\nStep 3: 9 + 8 = 17.\n"
                                               "The answer is \\boxed{17}.")
    assert render_solution(chain, "words") == ("We go from left to right. First, 7+5=12. Next, 12-3=9. Finally, "
                                               "9+8=17. So the answer is \\boxed{17}.")
    assert render_solution(chain[:2] + chain[2:] + [(17, "-", 1, 16)], "words").count("Then, 9+8=17.") == 1


def test_compact_default_is_the_stream_it_always_was():
    """The embedded model's warm start trains on these solutions: the default style must not change a byte. The
    expectation is the generator's output before the styles existed (git show 46dff6a:grail_exp/data/arithmetic.py)."""
    from grail_exp.data.arithmetic import ArithmeticTask

    p = ArithmeticTask().train_problem(0)
    assert (p.question, p.solution, p.answer) == ("Compute 85+85+91.", "85+85=170. 170+91=261. \\boxed{261}", "261")


def test_train_seed_reorders_training_only():
    from grail_exp.data.arithmetic import ArithmeticTask

    base, other = ArithmeticTask(min_steps=2, max_steps=3, max_operand=10), \
        ArithmeticTask(min_steps=2, max_steps=3, max_operand=10, train_seed=7)
    assert base.split("test") == other.split("test") and base.split("validation") == other.split("validation")
    assert base.train_problems(0, 20) != other.train_problems(0, 20)
    assert ArithmeticTask(train_seed=1234).train_problems(0, 5) == ArithmeticTask().train_problems(0, 5)  # = data.seed
    held_out = {p.question for s in ("validation", "test") for p in other.split(s)}
    assert not held_out & {p.question for p in other.train_problems(0, 200)}


def _left_to_right(question: str) -> list[tuple[int, str, int, int]]:
    """The chain of 'Compute a+b-c.', evaluated independently of the generator."""
    tokens = re.findall(r"\d+|[+\-*]", question.removeprefix("Compute ").rstrip("."))
    value, out = int(tokens[0]), []
    for op, b in zip(tokens[1::2], tokens[2::2]):
        new = value + int(b) if op == "+" else value - int(b) if op == "-" else value * int(b)
        out.append((value, op, int(b), new))
        value = new
    return out


def test_study_starts_from_the_screened_cold_start_zero_shot():
    """The study's starting weights are the candidate measured in results/real_model_study.md section 1
    (sft40_words_ops23_le10: 40 steps x 8 problems, lr 1e-4, 2-3 operations on operands <= 10, words), zero-shot."""
    cfg = compose(["experiment=real/chain_grpo"], None)
    cs = cfg.model.cold_start
    assert cs.enabled and (cs.steps, cs.batch_size, cs.lr) == (40, 8, 1e-4)
    assert list(cfg.model.few_shot) == []
    assert (cfg.data.min_steps, cfg.data.max_steps, cfg.data.max_operand, cfg.data.solution_style) == (2, 3, 10, "words")


def test_study_solutions_are_left_to_right_chains():
    """The cold start's completions (the generator's solutions) state every intermediate result, computed here
    independently of the generator."""
    from grail_exp.data.arithmetic import render_solution

    cfg = compose(["experiment=real/chain_grpo"], None)
    for q in ("Compute 6+3-5.", "Compute 8-2+7+1."):
        chain = _left_to_right(q)
        text = render_solution(chain, cfg.data.solution_style)
        assert all(f"{a}{op}{b}={c}" in text for a, op, b, c in chain) and text.endswith(f"\\boxed{{{chain[-1][3]}}}.")


def test_study_arms_differ_only_in_the_scheme():
    from grail_exp.analysis.study import differences, identity

    cfgs = {s: compose([f"experiment=real/chain_{s}", "seed=2", "paths.output_dir=/tmp/x"], None)
            for s in ("grpo", "grail", "oar_g")}
    for s in ("grail", "oar_g"):
        diff = differences(identity(cfgs["grpo"]), identity(cfgs[s]), limit=100)
        assert diff and all(d.startswith(("advantage.", "recipe.scheme")) for d in diff), diff
    grail, oar = cfgs["grail"].advantage, cfgs["oar_g"].advantage
    # the paper's settings (method spec §4.3 / §5.6, the reference's qwen3_grail.yaml and qwen3_oar_g.yaml)
    assert (grail.std, grail.mean, grail.w_min, grail.w_max, grail.symmetry) == (0.5, 1.0, 0.5, 5.0, "wrong")
    assert (oar.variant, oar.tau, oar.beta, oar.noise_std) == ("grail_repo", 0.4, 2.0, 1e-3)
    g = cfgs["grpo"]
    assert g.data.train_seed == 2 and g.trainer.max_steps >= 60 and g.data.num_test >= 200 and g.eval.n >= 4
    assert g.model.name_or_path == "pkg:smollm2"  # the packaged weights themselves: nothing to carry to a GPU


# ------------------------------------------------------------------------------------------------ the study folder
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _arm(root: Path, scheme: str, seed: int, correct: np.ndarray, config: dict, start: str = "w0",
         steps: dict | None = None) -> Path:
    """A study arm folder as grail_exp.analysis.study.write_arm lays it out, from a (problems, n) correctness grid of
    the final evaluation and, optionally, ``steps`` = {step: grid} of evaluations inside training
    (samples_step<N>.parquet)."""
    folder = root / f"m-{scheme}-s{seed}"
    folder.mkdir(parents=True)

    def write(grid, name):
        rows = [{"benchmark": "arithmetic", "problem_index": i, "sample_index": j, "correct": bool(grid[i, j]),
                 "extracted": str(int(grid[i, j]))} for i in range(grid.shape[0]) for j in range(grid.shape[1])]
        pd.DataFrame(rows).to_parquet(folder / name, index=False)
        return name

    names = [write(correct, "samples_final.parquet")] + [write(g, f"samples_step{k}.parquet")
                                                         for k, g in (steps or {}).items()]
    record = {"arm": folder.name, "model": "m", "scheme": scheme, "seed": str(seed), "status": "FINISHED",
              "run_id": f"run-{scheme}-{seed}", "start_weights_sha256": start, "metrics": {},
              "config": {"seed": seed, "eval.n": correct.shape[1], "optim.lr": 3e-5, "data.train_seed": seed,
                         **config},
              "files": {name: _sha(folder / name) for name in names}}
    (folder / "arm.json").write_text(json.dumps(record))
    return folder


def _grid(problems: int, n: int, k: int) -> np.ndarray:
    """(problems, n) correctness: the first k samples of every problem right (acc@n = k/n on every problem)."""
    return np.tile(np.arange(n) < k, (problems, 1))


def _stepped_arm(root: Path, scheme: str, seed: int, k40: int, k50: int, k60: int, **kw) -> Path:
    """An arm of 60 steps evaluated at steps 40, 50 and 60 (the final evaluation) on 4 problems x 4 samples, with
    k40, k50, k60 of the 4 samples of every problem right."""
    return _arm(root, scheme, seed, _grid(4, 4, k60), {"trainer.max_steps": 60},
                steps={40: _grid(4, 4, k40), 50: _grid(4, 4, k50)}, **kw)


def _report(study: Path, tmp: Path, *extra: str):
    from grail_exp.reporting.build import build_report

    cfg = compose([f"runs.dir={study}", "design_check.strict=true", "schemes=[grpo,grail]", "seeds=[1,2]",
                   "metrics=[acc]", "stats.n_boot=200", "stats.n_perm=200", "plots.enabled=false", "log_to=none",
                   f"output.dir={tmp}/out", f"paths.root_dir={tmp}", *extra], None, config_name="report")
    return build_report(cfg)


def test_report_reads_a_study_folder_paired(tmp_path):
    """grpo solves 2 of 4 samples of every problem, grail 3 of 4 on seed 1 and 2 of 4 on seed 2: Δ acc = +12.5 points
    (hand-computed: (+25 + 0) / 2), per-seed +25 and 0."""
    study = tmp_path / "study"
    half = np.tile([1, 1, 0, 0], (10, 1))
    three = np.tile([1, 1, 1, 0], (10, 1))
    for seed in (1, 2):
        _arm(study, "grpo", seed, half, {})
    _arm(study, "grail", 1, three, {})
    _arm(study, "grail", 2, half, {})
    out = _report(study, tmp_path)
    row = next(r for r in out["payload"]["tables"][0]["rows"] if r["scheme"] == "grail")
    delta = row["cells"]["arithmetic"]["delta"]
    assert delta["delta"] == pytest.approx(0.125) and delta["n_seeds"] == 2 and delta["n_problems"] == 10
    assert row["cells"]["arithmetic"]["value"] == pytest.approx(0.625)
    assert "study folder" in out["markdown"]


def test_the_committed_study_report_regenerates_byte_for_byte(tmp_path):
    """results/real_model_study/real_model_study/report.{md,tex,json}, rebuilt from the arms committed beside it with
    the command results/real_model_study.md records (its title and parent run as the header shows them; plots off,
    nothing logged): every byte the same. The expectation is the committed file, written by an earlier checkout."""
    from grail_exp.reporting.build import build_report

    study = ROOT / "results" / "real_model_study" / "real_model_study"
    cfg = compose([f"runs.dir={study}", "design_check.strict=true", "schemes=[grpo,grail,oar_g]", "seeds=[1,2,3]",
                   "metrics=[acc,pass@n]", "runs.parent_run_id=1a2a9fbff8164d48a4c7023a7a4c76f6",
                   "output.title='SmolLM2-135M-Instruct on arithmetic chains, study real_model_study'",
                   f"output.dir={tmp_path}/out", "output.name=report", "plots.enabled=false", "log_to=none",
                   f"paths.root_dir={ROOT}", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"],
                  None, config_name="report")
    build_report(cfg)
    for ext in ("md", "tex", "json"):
        assert (tmp_path / "out" / f"report.{ext}").read_bytes() == (study / f"report.{ext}").read_bytes(), ext


def test_a_checkpoint_averaged_endpoint_by_hand(tmp_path):
    """endpoint.steps=[40,50,60]: acc@4 per problem averaged over the evaluations at steps 40, 50 and 60 (step 60 =
    the final evaluation, samples_final.parquet). grpo: 1, 2, 2 of 4 right at steps 40, 50, 60 in both seeds ->
    (0.25 + 0.5 + 0.5) / 3 = 5/12. grail seed 1: 3, 2, 4 -> 3/4; seed 2: 2, 2, 2 -> 1/2. Per-seed Δ 1/3 and 1/12,
    Δ = 5/24 = +20.8 points; grail's cell (3/4 + 1/2) / 2 = 62.5. The final evaluation alone: Δ 1/2 and 0, +25.0."""
    study = tmp_path / "study"
    for seed in (1, 2):
        _stepped_arm(study, "grpo", seed, 1, 2, 2)
    _stepped_arm(study, "grail", 1, 3, 2, 4)
    _stepped_arm(study, "grail", 2, 2, 2, 2)
    out = _report(study, tmp_path, "endpoint.steps=[40,50,60]", "endpoint.name=B")
    row = next(r for r in out["payload"]["tables"][0]["rows"] if r["scheme"] == "grail")
    delta = row["cells"]["arithmetic"]["delta"]
    assert delta["delta"] == pytest.approx(5 / 24, abs=1e-12)
    assert delta["seed_deltas"] == [pytest.approx(1 / 3, abs=1e-12), pytest.approx(1 / 12, abs=1e-12)]
    assert row["cells"]["arithmetic"]["value"] == pytest.approx(0.625, abs=1e-12)
    md = out["markdown"]
    assert "### acc@4 (%), endpoint B (the mean of the evaluations at steps 40, 50, 60)" in md
    assert "| m | grail | 2 | 62.5 (+20.8) |" in md
    assert "an arm's last step, trainer.max_steps, is its final evaluation" in md
    assert out["payload"]["endpoint"] == {"steps": [40, 50, 60], "name": "B"}
    assert "acc@4, endpoint B (the mean of the evaluations at steps 40, 50, 60) (\\%)" in out["latex"]
    # the records it names are relative to the project (paths.root_dir = tmp_path)
    assert "runs from the study folder study." in md
    assert out["payload"]["runs"]["run-grpo-1"]["artifact"] == "study/m-grpo-s1/samples_final.parquet"
    final = _report(study, tmp_path, "output.name=final")
    d_final = next(r for r in final["payload"]["tables"][0]["rows"] if r["scheme"] == "grail")
    assert d_final["cells"]["arithmetic"]["delta"]["delta"] == pytest.approx(0.25, abs=1e-12)


def test_a_declared_step_an_arm_lacks_is_refused_naming_the_key_and_the_arm(tmp_path):
    from grail_exp.config import ConfigError
    from grail_exp.reporting.schema import validate_report

    study = tmp_path / "study"
    for scheme in ("grpo", "grail"):
        for seed in (1, 2):
            _stepped_arm(study, scheme, seed, 2, 2, 2)
    with pytest.raises(ConfigError, match=r"endpoint.steps = \[30, 60\]: m × (grail|grpo), seed 1 \(.*m-\1-s1\) has "
                                          r"no evaluation at step 30 \(it has: 40, 50, 60 \(final\)\)"):
        _report(study, tmp_path, "endpoint.steps=[30,60]")
    with pytest.raises(ConfigError, match=r"spread.steps = \[45\]: m × gr\w+, seed 1 .* no evaluation at step 45"):
        _report(study, tmp_path, "spread.steps=[45]")
    with pytest.raises(ConfigError, match=r"endpoint.steps: needs runs.dir \(a study folder\)"):
        validate_report(compose(["endpoint.steps=[40,50,60]"], None, config_name="report"))
    with pytest.raises(ConfigError, match=r"endpoint.steps = \[40, 40\]: a list of distinct optimiser steps"):
        validate_report(compose([f"runs.dir={study}", "endpoint.steps=[40,40]"], None, config_name="report"))


def _three_seed_spread_study(root: Path) -> Path:
    """grpo right on 2 of 4 samples at steps 40, 50, 60 in seeds 1-3; grail per seed (steps 40, 50, 60):
    seed 1: 2, 2, 4; seed 2: 3, 3, 1; seed 3: 2, 3, 2 (of 4)."""
    for seed, ks in zip((1, 2, 3), ((2, 2, 4), (3, 3, 1), (2, 3, 2))):
        _stepped_arm(root, "grpo", seed, 2, 2, 2)
        _stepped_arm(root, "grail", seed, *ks)
    return root


def test_the_seed_spread_of_two_endpoints_and_the_declared_rule_by_hand(tmp_path):
    """Endpoint A = the final evaluation: per-seed Δ (points) 50, −25, 0 = 25·(2, −1, 0): sd_A = 25·√(7/3) = 38.188.
    Endpoint B = steps 40, 50, 60: grail's means 2/3, 7/12, 7/12 against 1/2: Δ 50/3, 25/3, 25/3 = (25/3)·(2, 1, 1):
    sd_B = (25/3)·√(1/3) = 4.811. sd_B / sd_A = (1/3)/√7 = 0.12599. The rule 0.5: 4.81 <= 19.09, holds; the rule
    0.1: 4.81 > 3.82, does not. The bootstrap, the chi-square intervals and the seeds needed are stats.py's
    functions (tested there) on these hand-computed vectors."""
    from grail_exp.analysis import stats

    study = _three_seed_spread_study(tmp_path / "study")
    out = _report(study, tmp_path, "seeds=[1,2,3]", "spread.steps=[40,50,60]", "spread.rule_ratio=0.5",
                  "endpoint.name=A", "spread.name=B")
    (e,) = out["payload"]["spread"]
    a_hand, b_hand = [50.0, -25.0, 0.0], [50 / 3, 25 / 3, 25 / 3]
    assert e["seeds"] == ["1", "2", "3"]
    assert e["a"] == [pytest.approx(x, abs=1e-9) for x in a_hand]
    assert e["b"] == [pytest.approx(x, abs=1e-9) for x in b_hand]
    assert e["sd_a"] == pytest.approx(25 * np.sqrt(7 / 3), rel=1e-12)
    assert e["sd_b"] == pytest.approx(25 / 3 * np.sqrt(1 / 3), rel=1e-12)
    ratio = stats.sd_ratio_bootstrap(a_hand, b_hand, n_boot=10_000, seed=0)
    assert e["ratio"]["value"] == pytest.approx(1 / 3 / np.sqrt(7), rel=1e-12)
    assert (e["ratio"]["lo"], e["ratio"]["hi"], e["ratio"]["dropped"]) == (
        pytest.approx(ratio.lo, rel=1e-9), pytest.approx(ratio.hi, rel=1e-9), ratio.dropped)
    lo, hi = stats.sd_interval(e["sd_a"], 3)
    assert e["sd_a_interval"] == [pytest.approx(lo), pytest.approx(hi)]
    assert e["needed_a"]["3.0"] == [stats.seeds_needed(3.0, x) for x in (e["sd_a"], lo, hi)]
    assert e["rule"] == {"ratio": 0.5, "holds": True}
    md = out["markdown"]
    assert "### Seed spread of the primary comparison: endpoint B against endpoint A" in md
    assert "| 2 | -25.00 | +8.33 |" in md
    assert f"sd_B / sd_A = 0.13 [{ratio.lo:.2f}, {ratio.hi:.2f}] ({ratio.kept} resamples kept, {ratio.dropped} " \
           "dropped with sd_A = 0)." in md
    assert "sd_B 4.81 ≤ 0.5 × 38.19 = 19.09: **holds**." in md
    strict = _report(study, tmp_path, "seeds=[1,2,3]", "spread.steps=[40,50,60]", "spread.rule_ratio=0.1",
                     "output.name=strict")
    assert "sd_B 4.81 > 0.1 × 38.19 = 3.82: **does not hold**." in strict["markdown"]


def test_the_pooled_comparison_over_two_study_folders_by_hand(tmp_path):
    """This folder's per-seed Δ at the final evaluation, 50, −25, 0 (the study above), pooled with another folder's
    seeds 4 and 5 (+25, −25; other starting weights): d = (50, −25, 0, 25, −25), mean 5, squared deviations
    2025 + 900 + 25 + 400 + 900 = 4250, sd √(4250/4) = 32.596, t interval 5 ± 2.776445·32.596/√5 (the t table's
    t_{0.975,4}). The detectable effect at 80 % with five seeds: scipy's noncentral t solved by bisection."""
    from scipy.stats import nct
    from scipy.stats import t as student_t

    study = _three_seed_spread_study(tmp_path / "study")
    other = tmp_path / "round2"
    for seed, k in ((4, 3), (5, 1)):
        _arm(other, "grpo", seed, _grid(4, 4, 2), {"trainer.max_steps": 60}, start="w1")
        _arm(other, "grail", seed, _grid(4, 4, k), {"trainer.max_steps": 60}, start="w1")
    out = _report(study, tmp_path, "seeds=[1,2,3]", f"pooled.dirs=[{other}]")
    (e,) = out["payload"]["pooled"]
    assert [f["deltas"] for f in e["folders"]] == [[pytest.approx(50), pytest.approx(-25), pytest.approx(0)],
                                                   [pytest.approx(25), pytest.approx(-25)]]
    assert [f["folder"] for f in e["folders"]] == ["study", "round2"]
    sd = np.sqrt(4250 / 4)
    assert (e["n"], e["mean"], e["sd"]) == (5, pytest.approx(5.0), pytest.approx(sd, rel=1e-12))
    half = 2.776445 * sd / np.sqrt(5)
    assert (e["t_lo"], e["t_hi"]) == (pytest.approx(5 - half, abs=1e-4), pytest.approx(5 + half, abs=1e-4))
    c = student_t.ppf(0.975, 4)
    lo, hi = 0.0, 20.0  # ncp with power 0.8, by bisection on scipy's noncentral t
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if nct.sf(c, 4, mid) + nct.cdf(-c, 4, mid) < 0.8 else (lo, mid)
    assert e["detectable"][0] == pytest.approx(lo * sd / np.sqrt(5), rel=1e-6)
    assert e["differ"] == {"start_weights.sha256": ["w0", "w1"]}
    md = out["markdown"]
    assert "| round2 | 4, 5 | +25.00, -25.00 | +0.00 |" in md
    assert f"Pooled, n = 5: mean Δ +5.00, t interval [{5 - half:+.2f}, {5 + half:+.2f}] (df 4)" in md
    assert "The folders differ in: start_weights.sha256 (w0, w1)." in md


def _hundred(k: int) -> np.ndarray:
    """100 problems x 1 sample, the first k right: acc@1 = k %."""
    return (np.arange(100) < k)[:, None]


def test_holm_over_a_declared_family_of_primary_comparisons_by_hand(tmp_path):
    """grail − grpo per seed (points) 2, 3, 1, 4, −1, 3 over six seeds: 5 positive, t = 2.7386 (df 5), p = 0.0409
    (scipy), the t interval above 0: the declared rule (6, 5) says "beats". Declared as one family with a second
    folder whose comparison has only 3 of the 6 seeds (not decidable: counted as p = 1), Holm doubles the smaller p:
    0.0818 > 0.05, so the verdict becomes "not settled"; the partial one keeps "not applied"."""
    from scipy.stats import t as student_t

    study, partial = tmp_path / "study", tmp_path / "partial"
    for seed, d in zip(range(1, 7), (2, 3, 1, 4, -1, 3)):
        _arm(study, "grpo", seed, _hundred(50), {})
        _arm(study, "grail", seed, _hundred(50 + d), {})
    for seed in range(1, 7):
        _arm(partial, "grpo", seed, _hundred(50), {})
    for seed in (1, 2, 3):
        _arm(partial, "grail", seed, _hundred(60), {})
    seeds, rule = "seeds=[1,2,3,4,5,6]", ("decision.seeds=6", "decision.min_same_sign=5")
    alone = _report(study, tmp_path, seeds, *rule)
    assert "- m × grail: 5 of 6 seeds positive, 1 negative -> grail beats grpo" in alone["markdown"]
    out = _report(study, tmp_path, seeds, *rule, "decision.multiplicity=holm", f"decision.family_dirs=[{partial}]",
                  "output.name=family")
    p = 2 * student_t.sf(2 / (np.sqrt(16 / 5) / np.sqrt(6)), 5)
    mine, theirs = out["payload"]["family"]
    assert (mine["seed_t_p"], mine["counted_p"], mine["holm_p"]) == (
        pytest.approx(p, rel=1e-9), pytest.approx(p, rel=1e-9), pytest.approx(2 * p, rel=1e-9))
    assert (theirs["folder"], theirs["counted_p"], theirs["holm_p"], theirs["verdict"]) == (
        "partial", 1.0, 1.0, "not applied")
    assert mine["verdict"] == "not settled"
    md = out["markdown"]
    assert f"- m × grail: 5 of 6 seeds positive, 1 negative, Holm-adjusted p {2 * p:.3f} -> not settled by 6 seeds" \
        in md
    assert "### Multiplicity: the declared family of primary comparisons (decision.multiplicity = holm)" in md
    assert "| partial: m × grail | 3 | <0.001 | 1.000 | 1.000 | not applied |" in md
    assert "Holm-adjusted over the declared family of primary comparisons (decision.multiplicity = holm, below), " \
           "is below 0.05" in md
    from grail_exp.config import ConfigError
    from grail_exp.reporting.schema import validate_report

    with pytest.raises(ConfigError, match="decision.multiplicity = holm: adjusts a declared rule's verdicts"):
        validate_report(compose(["decision.multiplicity=holm"], None, config_name="report"))


def test_a_study_in_progress_shows_the_baseline_over_the_paired_seeds(tmp_path):
    """grpo seeds 1, 2, 3 right on 2, 2, 4 of 4 samples (all three: 66.7), grail seeds 1, 2 on 3 of 4: paired on
    seeds 1 and 2, where grpo reads 50.0, so the row reads 50.0 + 25.0 = 75.0; the footnote keeps 66.7."""
    study = tmp_path / "study"
    for seed, k in ((1, 2), (2, 2), (3, 4)):
        _arm(study, "grpo", seed, _grid(10, 4, k), {})
    for seed in (1, 2):
        _arm(study, "grail", seed, _grid(10, 4, 3), {})
    md = _report(study, tmp_path, "seeds=[1,2,3]")["markdown"]
    assert re.search(r"\| m \| grpo \(baseline\)<sup>(\w)</sup> \| 3 \(2 paired\) \| 50.0 \|", md), md
    letter = re.search(r"grpo \(baseline\)<sup>(\w)</sup>", md).group(1)
    assert f"- <sup>{letter}</sup> m × grpo: over the seeds paired with the other rows (1, 2), so that its value + Δ " \
           "is theirs; over all its 3 seeds: 66.7" in md
    assert "| m | grail<sup>" in md and "| 2 (2 paired) |" not in md and " 75.0 (+25.0) |" in md


def test_report_flags_a_seed_whose_arms_drew_different_step1_rollouts(tmp_path):
    """Step 1 samples from the shared starting weights with the seed's stream, before any scheme acts: a seed whose
    arms' step-1 rewards differ gets a footnote naming both rewards; a seed whose arms agree gets none."""
    study = tmp_path / "study"
    half = np.tile([1, 1, 0, 0], (10, 1))
    step1 = {("grpo", 1): 0.65625, ("grail", 1): 0.75, ("grpo", 2): 0.5, ("grail", 2): 0.5}
    for (scheme, seed), reward in step1.items():
        folder = _arm(study, scheme, seed, half, {})
        pd.DataFrame({"step": [1, 2], "reward/mean": [reward, 0.9]}).to_csv(folder / "history.csv", index=False)
    text = _report(study, tmp_path)["markdown"]
    assert "m × grail, seed 1: step-1 training reward 0.75 vs 0.6562 for grpo" in text
    assert "seed 2: step-1" not in text


def test_first_rollouts_table_marks_unequal_incomplete_and_equal_seeds(tmp_path, capsys):
    from grail_exp.analysis.study import first_rollouts

    study = tmp_path / "study"
    half = np.tile([1, 1, 0, 0], (10, 1))
    for (scheme, seed), reward in {("grpo", 1): 0.5, ("grail", 1): 0.75, ("grpo", 2): 0.25, ("grail", 2): 0.25,
                                   ("grpo", 3): 0.5}.items():
        folder = _arm(study, scheme, seed, half, {})
        pd.DataFrame({"step": [1], "reward/mean": [reward]}).to_csv(folder / "history.csv", index=False)
    got = first_rollouts(study, ["grpo", "grail"])
    assert got["complete"] == ["1", "2"] and got["equal"] is False
    assert [got["seeds"][s]["equal"] for s in ("1", "2", "3")] == [False, True, False]
    rows = capsys.readouterr().out.splitlines()
    assert rows[2:] == ["| 1 | 0.5000 | 0.7500 | yes | no |", "| 2 | 0.2500 | 0.2500 | yes | yes |",
                        "| 3 | 0.5000 | — | no | — |"]


def test_report_plots_a_study_folder_without_asking_mlflow(tmp_path, caplog):
    """A folder arm without history.csv (recorded by an older run) has no training curves; the report still draws the
    other plots and never looks the arm up in MLflow (where it is not)."""
    study = tmp_path / "study"
    half = np.tile([1, 1, 0, 0], (10, 1))
    for seed in (1, 2):
        _arm(study, "grpo", seed, half, {})
        _arm(study, "grail", seed, np.tile([1, 1, 1, 0], (10, 1)), {})
    (study / "m-grpo-s1" / "history.csv").write_text("step,loss,reward/mean\n1,0.5,0.25\n2,0.4,0.5\n")
    with caplog.at_level("WARNING"):
        out = _report(study, tmp_path, "plots.enabled=true")
    assert not [r for r in caplog.records if "plots failed" in r.getMessage()], caplog.text
    assert "m-grpo-s2 has no history.csv" in caplog.text
    assert sorted(p.name for p in out["plots"]) == ["m_pass_at_k.png", "m_training_curves.png"]


@pytest.mark.parametrize("break_it, names", [
    (lambda s: _arm(s, "grail", 2, np.ones((10, 4)), {}, start="w1"), ["start_weights.sha256", "w0", "w1"]),
    (lambda s: _arm(s, "grail", 2, np.ones((10, 2)), {}), ["eval.n", "4", "2"]),
    (lambda s: _arm(s, "grail", 3, np.ones((10, 4)), {}), ["seed 3", "no grpo run of seed 3"]),
    (lambda s: _arm(s, "grail", 2, np.ones((10, 4)), {"optim.lr": 1e-4}), ["optim.lr", "3e-05", "0.0001"]),
    (lambda s: _arm(s, "grail", 2, np.ones((10, 4)), {"data.train_seed": 1}), ["data.train_seed", "2", "1"]),
])
def test_report_refuses_arms_that_are_not_one_study(tmp_path, break_it, names):
    from grail_exp.config import ConfigError

    study = tmp_path / "study"
    for seed in (1, 2):
        _arm(study, "grpo", seed, np.ones((10, 4)), {})
    _arm(study, "grail", 1, np.ones((10, 4)), {})
    break_it(study)
    with pytest.raises(ConfigError, match="not comparable") as info:
        _report(study, tmp_path)
    for name in names:
        assert name in str(info.value)
    _report(study, tmp_path, "design_check.strict=false")  # without the check: footnotes, not an error


def test_a_changed_arm_file_is_named(tmp_path):
    from grail_exp.analysis.study import StudyError

    study = tmp_path / "study"
    folder = _arm(study, "grpo", 1, np.ones((10, 4)), {})
    pd.DataFrame({"benchmark": ["arithmetic"], "problem_index": [0], "sample_index": [0], "correct": [False]}) \
        .to_parquet(folder / "samples_final.parquet")
    with pytest.raises(StudyError, match="samples_final.parquet: missing or changed"):
        _report(study, tmp_path)


def test_a_finished_arm_is_skipped_and_a_different_one_refused(tmp_path):
    from grail_exp.analysis.study import StudyError, arm_dir, finished, identity

    overrides = ["experiment=real/chain_grpo", "seed=1", f"study.dir={tmp_path}/study", "paths.output_dir=/tmp/x"]
    cfg = compose(overrides, None)
    assert finished(cfg) is None
    folder = arm_dir(cfg)
    assert folder == tmp_path / "study" / "smollm2_135m-grpo-s1"
    folder.mkdir(parents=True)
    (folder / "arm.json").write_text(json.dumps({"config": identity(cfg), "metrics": {"eval/arithmetic/acc": 0.5}}))
    assert finished(cfg)["metrics"] == {"eval/arithmetic/acc": 0.5}
    # a restart may change threads, logging and paths ...
    assert finished(compose(overrides + ["trainer.num_threads=1", "paths.root_dir=/elsewhere"], None)) is not None
    # ... and which files stated the values: an arm recorded before the config tree's one recipe group
    # (conf/recipe_base/smollm2_chain.yaml, conf/recipe_scheme/...) is the same arm
    before = {**identity(cfg), "recipe.base": "conf/recipe_base/smollm2_chain.yaml", "recipe.name": "smollm2_chain",
              "recipe.scheme": "conf/recipe_scheme/smollm2_chain_grail.yaml"}
    (folder / "arm.json").write_text(json.dumps({"config": before, "metrics": {"eval/arithmetic/acc": 0.5}}))
    assert finished(cfg) is not None
    # ... but never what the arm computes
    with pytest.raises(StudyError, match=r"optim.lr: 3e-05 vs 0.0001"):
        finished(compose(overrides + ["optim.lr=1e-4"], None))


def test_an_arm_without_its_final_evaluation_is_refused_and_leaves_nothing_behind(tmp_path):
    """A run stopped before its final evaluation (its "before" evaluation written) cannot be recorded: one error naming
    the missing file, and no half-written arm folder in the study directory (the next attempt starts clean)."""
    from grail_exp.analysis.study import StudyError, write_arm

    cfg = compose(["experiment=real/chain_grpo", "seed=1", f"study.dir={tmp_path}/study", "paths.output_dir=/tmp/x"],
                  None)
    run_dir = tmp_path / "run"
    (run_dir / "eval" / "before").mkdir(parents=True)
    (run_dir / "eval" / "before" / "samples.parquet").write_bytes(b"PAR1")
    (tmp_path / "study").mkdir()
    with pytest.raises(StudyError, match=r"eval/final/samples.parquet: no final evaluation to record"):
        write_arm(cfg, run_dir=run_dir, start_sha256=None, metrics={}, tracker=None)
    assert list((tmp_path / "study").iterdir()) == []


def test_choose_lr_takes_the_best_validation_value_and_the_smaller_on_ties(tmp_path):
    from grail_exp.analysis.study import StudyError, choose_lr

    def arm(lr, acc):
        folder = tmp_path / "sweep" / f"grpo-lr{lr}"
        folder.mkdir(parents=True)
        (folder / "arm.json").write_text(json.dumps({"arm": folder.name, "metrics": {"eval/arithmetic_val/acc": acc},
                                                     "config": {"optim.lr": lr, "trainer.max_steps": 20}}))

    arm(1e-5, 0.40)
    arm(3e-5, 0.55)
    with pytest.raises(StudyError, match="optim.lr = 1e-4"):
        choose_lr(tmp_path / "sweep", tmp_path / "lr.json", ["1e-5", "3e-5", "1e-4"])
    arm(1e-4, 0.55)
    assert choose_lr(tmp_path / "sweep", tmp_path / "lr.json", ["1e-5", "3e-5", "1e-4"])["lr"] == 3e-5
    assert json.loads((tmp_path / "lr.json").read_text())["lr"] == 3e-5


# ------------------------------------------------------------------------------------------------ the driver
def _driver(tmp: Path, fault: str | None = None, extra: tuple[str, ...] = (), **env) -> subprocess.CompletedProcess:
    """sweeps/real_model_study.sh at toy scale: the shipped tiny model's weights in the study's configuration
    (2 steps of 2 prompts x 2, 8 test problems x 2 samples), everything under ``tmp``; ``extra``: more overrides."""
    e = {**os.environ, "PY": sys.executable, "STUDY": "toy", "RES": str(tmp / "res"), "OUT": str(tmp / "out"),
         "SEEDS": "1", "SCHEMES": "grpo grail", "LR": "1e-4", "PHASES": "lr study report",
         "GRAIL_EXP_CACHE": str(tmp / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
         "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    e.pop("GRAIL_EXP_FAULT", None)
    if fault:
        e["GRAIL_EXP_FAULT"] = fault
    return subprocess.run(["bash", str(ROOT / "sweeps" / "real_model_study.sh"), *_toy(tmp), *extra],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=e, cwd=ROOT)


def _toy(tmp: Path) -> list[str]:
    """The toy scale's overrides (every job of the driver gets them)."""
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    return [f"model.name_or_path={tiny}", "model.dtype=float32", "model.attn_implementation=eager", "model.few_shot=[]",
            "trainer.max_steps=2", "trainer.prompts_per_step=2", "rollout.num_generations=2",
            "trainer.micro_batch_size=4", "trainer.checkpoint_every=1", "trainer.weights_table_every=1",
            "rollout.max_completion_length=24", "eval.max_tokens=24", "eval.n=2", "data.num_test=8",
            "data.num_validation=8", f"paths.root_dir={tmp}"]


@pytest.mark.e2e
@pytest.mark.slow  # ~35-65 s (a killed toy study resumed); make test-all. The resume of one arm: test_checkpoint, e2e/test_stops
def test_driver_survives_a_kill_skips_the_finished_arm_and_resumes_the_running_one(tmp_path):
    from mlflow.tracking import MlflowClient

    first = _driver(tmp_path, fault="kill_after_step:1:grail")
    log1 = first.stdout + first.stderr
    assert first.returncode != 0 and "GRAIL_EXP_FAULT: kill_after_step at step 1 of grail" in log1, log1[-3000:]
    res = tmp_path / "res"
    assert (res / "smollm2_135m-grpo-s1" / "arm.json").is_file()  # recorded the moment it finished
    assert not (res / "smollm2_135m-grail-s1").exists()
    assert (tmp_path / "out" / "study" / "grail_s1" / "checkpoints" / "step-1" / "COMPLETE").is_file()

    second = _driver(tmp_path)
    log2 = second.stdout + second.stderr
    assert second.returncode == 0, log2[-3000:]
    assert "arm smollm2_135m-grpo-s1 already finished" in log2  # skipped: not trained again
    assert log2.count("starting fresh") == 0 and "resuming from" in log2 and "step-1 (step 1)" in log2
    grpo, grail = (json.loads((res / f"smollm2_135m-{s}-s1" / "arm.json").read_text()) for s in ("grpo", "grail"))
    assert grail["metrics"]["train/steps"] == 2 and "eval_before/arithmetic/acc" in grail["metrics"]
    assert grpo["start_weights_sha256"] == grail["start_weights_sha256"]
    # provenance per training segment: grpo trained in one, grail in two (killed after step 1, resumed from it),
    # each naming the code that ran it
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert [s["start_step"] for s in grpo["segments"]] == [0]
    assert [s["start_step"] for s in grail["segments"]] == [0, 1]
    for seg in grpo["segments"] + grail["segments"]:
        assert seg["git_commit"] == head and seg["git_dirty"] in ("true", "false")
        if seg["git_dirty"] == "true":  # a dirty tree's segment carries its diff, hashed with the arm's files
            assert seg["diff"] in grail["files"] or seg["diff"] in grpo["files"]
    # common random numbers: the same step-1 rollouts in both arms (GRPO's job built the cold start, GRAIL's read it)
    first_rows = (res / "first_rollouts.md").read_text().splitlines()
    assert first_rows[2].startswith("| 1 | ") and first_rows[2].endswith("| yes | yes |"), first_rows
    # and one "before" evaluation, sampled once, shared by both arms
    before = [pd.read_parquet(res / f"smollm2_135m-{s}-s1" / "samples_before.parquet") for s in ("grpo", "grail")]
    pd.testing.assert_frame_equal(before[0], before[1])
    (cache,) = list((tmp_path / "cache" / "evals").glob("arithmetic-*.jsonl"))
    assert len(cache.read_text().splitlines()) == 1  # one chunk of 8 problems, generated once
    # one MLflow parent run across the restart, with both arms (the resumed arm continues its own run)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = json.loads((tmp_path / "out" / "study" / "mlflow_parent_run.json").read_text())["run_id"]
    assert client.get_run(parent).data.tags["sweep.restarts"] == "1"
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(r.info.run_id for r in children) == sorted([grpo["run_id"], grail["run_id"]])
    assert all(r.info.status == "FINISHED" for r in children)
    # the report read the finished arms, paired
    report = json.loads((res / "report.json").read_text())
    assert {r["scheme"] for r in report["tables"][0]["rows"]} == {"grpo", "grail"}
    assert report["tables"][0]["rows"][1]["cells"]["arithmetic"]["delta"]["n_problems"] == 8
    assert (res / "weights" / "grail_weights_profile.md").is_file()
    assert "phase study: end (2 arms recorded)" in (res / "driver_log.txt").read_text()


@pytest.mark.e2e
def test_driver_checks_the_declared_starting_weights_before_the_first_arm(tmp_path):
    """START_SHA: the driver builds (or reads) the starting weights first and stops with exit 2, naming both sha256,
    before any arm trains when they are not the declared ones; the sha it names is the one the check accepts."""
    cheap = ("model.cold_start.steps=3",)
    refused = _driver(tmp_path, START_SHA="0000dead", PHASES="study", extra=cheap)
    log = refused.stdout + refused.stderr
    assert refused.returncode == 2, log[-3000:]
    assert "but the study declared 0000dead" in log, log[-3000:]
    assert not (tmp_path / "out" / "study").exists() and not list((tmp_path / "res").glob("*/arm.json"))
    assert "refused (starting weights are not 0000dead)" in (tmp_path / "res" / "driver_log.txt").read_text()
    actual = re.search(r"sha256 ([0-9a-f]{64}), but", log).group(1)
    env = {**os.environ, "GRAIL_EXP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    accepted = subprocess.run([sys.executable, "sweeps/check_start_weights.py", "--expect", actual[:8],
                               "experiment=real/chain_grpo", *_toy(tmp_path), *cheap],
                              capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env, cwd=ROOT)
    assert accepted.returncode == 0 and accepted.stdout.strip() == actual, accepted.stderr[-3000:]


@pytest.mark.e2e
@pytest.mark.slow  # ~50 s; the SIGKILL test above covers the resume, this one the clean stop
def test_sigterm_stops_the_whole_study_after_a_checkpoint_and_the_same_command_continues(tmp_path):
    """SIGTERM (delivered by the fault hook during grpo's step 1): that arm checkpoints step 1 and the multirun exits
    143 without starting the next arm; the same command resumes grpo at step 2 and then runs grail."""
    first = _driver(tmp_path, fault="term_at_step:1:grpo", PHASES="study")
    log1 = first.stdout + first.stderr
    assert first.returncode == 143, log1[-3000:]
    assert "SIGTERM received" in log1 and "the multirun stops after this job's checkpoint" in log1
    out = tmp_path / "out" / "study"
    assert (out / "grpo_s1" / "checkpoints" / "step-1" / "COMPLETE").is_file() and not (out / "grail_s1").exists()
    assert not list((tmp_path / "res").glob("*/arm.json"))
    second = _driver(tmp_path, PHASES="study")
    log2 = second.stdout + second.stderr
    assert second.returncode == 0, log2[-3000:]
    assert "resuming from" in log2 and "step-1 (step 1)" in log2
    assert sorted(p.parent.name for p in (tmp_path / "res").glob("*/arm.json")) == [
        "smollm2_135m-grail-s1", "smollm2_135m-grpo-s1"]


@pytest.mark.e2e
@pytest.mark.slow
def test_driver_chooses_the_learning_rate_once_on_the_validation_split(tmp_path):
    done = _driver(tmp_path, LR="", LRS="1e-4 3e-4", LR_STEPS="1", PHASES="lr")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    choice = json.loads((tmp_path / "res" / "lr.json").read_text())
    assert choice["metric"] == "eval/arithmetic_val/acc" and {c["lr"] for c in choice["candidates"]} == {1e-4, 3e-4}
    for c in choice["candidates"]:
        arm = json.loads((tmp_path / "res" / "lr_sweep" / c["arm"] / "arm.json").read_text())
        assert arm["config"]["benchmark.names"] == ["arithmetic_val"] and arm["scheme"] == "grpo"
    again = _driver(tmp_path, LR="", LRS="1e-4 3e-4", LR_STEPS="1", PHASES="lr")
    assert "phase lr: start" not in again.stdout  # chosen once


@pytest.mark.e2e
@pytest.mark.slow
def test_gpu_mode_study1gpu_runs_end_to_end_on_a_cpu(tmp_path):
    """sweeps/gpu_checks.sh study1gpu with trainer=cpu, the shipped tiny model as SMOLLM2_PATH and a toy budget: the
    mode's commands compose, run, record three arms and write the paired table (its GPU timing is not tested here)."""
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    extra = ("model.dtype=float32 model.attn_implementation=eager model.few_shot=[] trainer.prompts_per_step=2 "
             "trainer.micro_batch_size=16 rollout.max_completion_length=16 eval.max_tokens=16 data.num_test=8 "
             "eval.batch_size=64 rollout.generation_batch_size=64 logger=none")
    env = {**os.environ, "PY": sys.executable, "SMOLLM2_PATH": str(tiny), "TRAINER": "cpu", "STEPS": "1",
           "EXTRA": extra, "LR": "1e-4", "GRAIL_EXP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", str(ROOT / "sweeps" / "gpu_checks.sh"), "study1gpu", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    arms = sorted(p.parent.name for p in (tmp_path / "out" / "study1gpu").glob("*/arm.json"))
    assert arms == ["smollm2_135m-grail-s1", "smollm2_135m-grpo-s1", "smollm2_135m-oar_g-s1"]
    for arm in arms:  # logger=none (no MLflow there): the curves come from the metrics the run logged
        history = pd.read_csv(tmp_path / "out" / "study1gpu" / arm / "history.csv", index_col="step")
        assert list(history.index) == [1] and {"loss", "reward/mean", "timing/step_s"} <= set(history.columns)
    assert "| smollm2_135m | oar_g" in (tmp_path / "out" / "study1gpu.md").read_text()


@pytest.mark.e2e
@pytest.mark.slow
def test_gpu_mode_study6gpu_runs_its_workers_and_checks_the_first_rollouts_on_a_cpu(tmp_path):
    """sweeps/gpu_checks.sh study6gpu with trainer=cpu, the shipped tiny model and a toy budget: two seeds' GRPO and
    GRAIL arms as two concurrent workers (the first builds the cold start while the other waits on its lock), each
    recorded; both arms of each seed drew the same step-1 rollouts; the report covers the seeds and applies the
    DECISION rule. Run again, every arm is skipped."""
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    extra = ("model.dtype=float32 model.attn_implementation=eager model.few_shot=[] trainer.prompts_per_step=2 "
             "trainer.micro_batch_size=16 rollout.max_completion_length=16 eval.max_tokens=16 data.num_test=8 "
             "eval.batch_size=64 rollout.generation_batch_size=64 model.cold_start.steps=2")
    env = {**os.environ, "PY": sys.executable, "SMOLLM2_PATH": str(tiny), "TRAINER": "cpu", "STEPS": "1",
           "SEEDS": "1 2", "WORKERS": "2", "ARM_THREADS": "1", "EXTRA": extra, "LR": "1e-4", "DECISION": "2 2",
           "GRAIL_EXP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = tmp_path / "out"

    def run():
        done = subprocess.run(["bash", str(ROOT / "sweeps" / "gpu_checks.sh"), "study6gpu", str(out)],
                              capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env, cwd=ROOT)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return done.stdout

    log = run()
    arms = sorted(p.parent.name for p in (out / "study6gpu").glob("*/arm.json"))
    assert arms == ["smollm2_135m-grail-s1", "smollm2_135m-grail-s2", "smollm2_135m-grpo-s1", "smollm2_135m-grpo-s2"]
    assert all(json.loads((out / "study6gpu" / a / "arm.json").read_text())["config"]["trainer.deterministic"]
               for a in arms)
    table = (out / "study6gpu_first_rollouts.md").read_text()
    assert "every complete seed: yes" in table and "complete seeds [1,2]" in log, log[-2000:]
    builds = [f.name for f in (out / "study6gpu_logs").iterdir() if "this run first builds it" in f.read_text()]
    assert len(builds) == 1, builds
    report = (out / "study6gpu.md").read_text()
    assert "| smollm2_135m | grail" in report
    assert "at least 2 of 2 seeds have Δ > 0" in report and "- smollm2_135m × grail: " in report
    run()  # the same command again: every arm is recorded, so every worker skips it
    assert all("already finished" in f.read_text() for f in (out / "study6gpu_logs").iterdir())


# ------------------------------------------------------------------------------------------------ the cold start
def _cold_cfg(tmp: Path, *extra: str):
    from grail_exp.validate import validate

    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    return validate(compose(["experiment=real/chain_grpo", f"model.name_or_path={tiny}", "model.dtype=float32",
                             "model.attn_implementation=eager", "model.cold_start.enabled=true",
                             "model.cold_start.steps=3", "seed=1",
                             f"paths.cache_dir={tmp}/cache", f"paths.output_dir={tmp}/run", *extra], None))


def test_cold_start_trains_on_the_training_prompts_and_the_generators_solutions(tmp_path):
    """The SFT batch: each row is the prompt exactly as RL encodes it, then the solution + EOS; labels only there."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.models.cold_start import sft_batch
    from grail_exp.models.loading import load_tokenizer, resolve_model_path

    cfg = _cold_cfg(tmp_path, "model.cold_start.enabled=false")
    tok = load_tokenizer(resolve_model_path(cfg), cfg)
    d = cfg.data
    task = ArithmeticTask(min_steps=d.min_steps, max_steps=d.max_steps, max_operand=d.max_operand, seed=d.seed,
                          num_validation=d.num_validation, num_test=d.num_test, solution_style="words")
    problems = task.train_problems(20_000_000, 2)
    assert problems[0].solution.startswith("We go from left to right. First, ")
    ids, attn, labels = sft_batch(problems, tok, cfg)
    for i, p in enumerate(problems):
        prompt = encode_prompts([p.question], tok, cfg.model, d.instruction)[0]
        completion = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        row = ids[i][attn[i].bool()].tolist()
        assert row == prompt + completion
        assert labels[i][labels[i] != -100].tolist() == completion


def test_cold_start_is_built_once_cached_recorded_and_shared_by_every_seed(tmp_path):
    import hashlib as h

    from grail_exp.models.architectures import weights_sha256
    from grail_exp.models.cold_start import MANIFEST
    from grail_exp.models.loading import resolve_model_path

    path = Path(resolve_model_path(_cold_cfg(tmp_path)))
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["cold_start"]["steps"] == 3 and len(manifest["build"]["losses"]) == 3
    assert manifest["base_weights_sha256"] == weights_sha256(ROOT / "grail_exp" / "data" / "embedded" / "tiny")
    for name, sha in manifest["files"].items():
        assert h.sha256((path / name).read_bytes()).hexdigest() == sha
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert Path(resolve_model_path(_cold_cfg(tmp_path, "seed=2"))) == path  # data.train_seed follows the seed: same
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    assert Path(resolve_model_path(_cold_cfg(tmp_path, "model.cold_start.lr=2e-4"))) != path
    # the same build in another cache: the same bits (one machine, one thread count)
    again = Path(resolve_model_path(_cold_cfg(tmp_path / "other")))
    assert weights_sha256(again) == weights_sha256(path)


def test_cold_start_needs_the_arithmetic_task(tmp_path):
    from grail_exp.config import ConfigError

    with pytest.raises(ConfigError, match="model.cold_start.enabled"):
        _cold_cfg(tmp_path, "data=deepmath")


# "1+2=4. \\boxed{4}" in the shipped tiny model's tokens: 6 before the box, then " \\", "boxed", "{", "4", "}"
TINY_CHAIN = [21, 15, 22, 33, 24, 18, 269, 270, 95, 24, 97]


def _weight_rows(step: int, row: int, correct: bool, advantage: float, pre: list[float]) -> list[dict]:
    """One rollout's weight-table rows: TINY_CHAIN with the given 6 pre-box weights, the box at 1 but its content
    at w_max (the overrides; the table's answer region from the box's "boxed" on, as the reference maps it)."""
    weights = list(pre) + [1.0, 1.0, 1.0, 5.0, 1.0]
    n = len(TINY_CHAIN)
    return [{"step": step, "row": row, "correct": correct, "advantage": advantage, "position": p, "length": n,
             "region": "pre" if p < 7 else "answer", "weight": weights[p], "entropy": 0.1,
             "token_id": TINY_CHAIN[p]} for p in range(n)]


@pytest.mark.e2e
def test_the_weight_profile_of_a_study_arm_is_over_the_rollouts_grail_reweighted(tmp_path):
    """sweeps/real_model_weights.py on a study arm: the profile averages the wrong rollouts with A != 0 only — a
    zero-variance group's rollouts keep weight 1 by construction and would pull every bin toward it — and the text
    heatmap shows the last table that has such rollouts, not a last table of A = 0 groups. Numbers by hand: the one
    reweighted rollout's pre-box weights [1, 2, 3, 3, 3, 3] in two bins give 2 and 3 (one rollout: the band is the
    point); the mean weight with and without the w_max override tokens, over every rollout of the tables."""
    sys.path.insert(0, str(ROOT / "sweeps"))
    try:
        import real_model_weights
    finally:
        sys.path.remove(str(ROOT / "sweeps"))
    arm = tmp_path / "arm"
    (arm / "weights").mkdir(parents=True)
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"  # an arm folder: --wrong-only by default
    (arm / "arm.json").write_text(json.dumps({"config": {"model.name_or_path": str(tiny)}}))
    step1 = (_weight_rows(1, 0, False, -0.5, [1, 2, 3, 3, 3, 3]) + _weight_rows(1, 1, False, 0.0, [1.0] * 6)
             + _weight_rows(1, 2, True, 0.5, [1.0] * 6))
    step2 = _weight_rows(2, 0, False, 0.0, [1.0] * 6) + _weight_rows(2, 1, True, 0.0, [1.0] * 6)
    pd.DataFrame(step1).to_parquet(arm / "weights" / "step_000001.parquet")
    pd.DataFrame(step2).to_parquet(arm / "weights" / "step_000002.parquet")
    done = subprocess.run([sys.executable, str(ROOT / "sweeps" / "real_model_weights.py"), str(arm), "--out",
                           str(tmp_path / "out"), "--bins", "2", "--boot", "50"], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "out" / "grail_weights_profile.md").read_text()
    assert "| 0.25 | 2 | 2 | 2 | 3 | 1 |" in page and "| 0.75 | 3 | 3 | 3 | 3 | 1 |" in page, page
    # 5 rollouts of 11 tokens, each with one w_max override: mean (5·(10 + 5) + 15 - 6) / 55 with the reweighted
    # rollout's pre-box weights summing to 15 instead of 6; without the 5 override tokens: (5·10 + 9) / 50
    with_them, without = f"{(75 + 9) / 55:.4g}", f"{(50 + 9) / 50:.4g}"
    assert f"| every rollout in the length range | 5 | 55 | 5 | {with_them} | {without} |" in page, page

    class Digits:
        def decode(self, ids):
            return f"<{ids[0]}>"

    frames = pd.concat([pd.DataFrame(step1), pd.DataFrame(step2)])
    real_model_weights.text_heatmap(frames, Digits(), tmp_path / "heat.html")
    assert "step 1" in (tmp_path / "heat.html").read_text()


# ------------------------------------------------------------------------------- GRAIL's weights, by token class
@pytest.fixture(scope="module")
def wa():
    sys.path.insert(0, str(ROOT / "sweeps"))
    try:
        import weight_analysis
    finally:
        sys.path.remove(str(ROOT / "sweeps"))
    return weight_analysis


def _rollout(row, texts, weights, correct=False, advantage=-0.5, region=None, step=1, source="arm"):
    """Weight-table rows of one rollout given its token texts and weights (``region`` defaults to "pre")."""
    return [{"source": source, "step": step, "row": row, "correct": correct, "advantage": advantage, "position": p,
             "length": len(texts), "region": (region or ["pre"] * len(texts))[p], "weight": w, "text": t,
             "token_id": p} for p, (t, w) in enumerate(zip(texts, weights))]


BOX13 = [" \\", "box", "ed", "{", "1", "3", "}.", ""]  # SmolLM2's pieces of " \boxed{13}." and the end of turn


def test_token_classes_box_and_first_slip_of_a_chain_by_hand(wa):
    """A SmolLM2-tokenised wrong chain ("6+7=14", the box holding 13): classes, the 14 tokens before the box's
    ``\\`` and the slip at the written result's first wrong digit ("4" of 14 against 13: token 11, step 0, digit 1)."""
    texts = ["We", " go", ".", " First", ",", " ", "6", "+", "7", "=", "1", "4", "."] + [" So"] + BOX13
    a = wa.annotate_rollout(texts)
    assert a["cls"] == (["word", "word", "punctuation", "word", "punctuation", "space", "operand digit", "operator",
                         "operand digit", "=", "result digit", "result digit", "punctuation", "word",
                         "box marker \\boxed{", "box marker \\boxed{", "box marker \\boxed{", "box marker \\boxed{",
                         "answer digit, not the last", "answer digit, last", "closing brace }.", "end of turn"])
    assert a["n_pre"] == 14 and a["boxed"] and a["first_error"] == (11, 0, 1) and a["results"] == [[10, 11]]


@pytest.mark.parametrize("text, expected", [
    ("First, 8-2=6. Finally, 6+7=12. So", ("12", 1, 1)),  # 13 written 12: step 1, its digit 1 ("2")
    ("3+4=7. 7+5=1.", ("1", 1, 0)),  # 12 written 1: a prefix of the truth, so its last digit
    ("9-4=5. 5+10=105.", ("105", 1, 1)),  # 15 written 105: "1" agrees, "0" is the first wrong digit
    ("3+4=7. 7+5=12. 12-2=10.", None),  # every step adds up
])
def test_first_arithmetic_error_is_the_first_wrong_digit_of_the_first_wrong_result(wa, text, expected):
    got = wa.first_arithmetic_error(text)
    if expected is None:
        assert got is None
        return
    written, step, digit = expected
    start = text.index(f"={written}.") + 1  # the written result, found by hand
    assert got == (start + digit, step)


def test_bootstrap_means_resample_rollouts_and_weight_tokens(wa):
    """Rollout a: weights 1 and 3, rollout b: 5, one category. Token-weighted mean (1+3+5)/3 = 3. A resample is aa
    (mean 2), bb (5) or ab / ba (3), with chances 1/4, 1/4, 1/2: the 2.5 and 97.5 percentiles are 2 and 5."""
    t = pd.DataFrame(_rollout(0, ["x", "y"], [1.0, 3.0]) + _rollout(1, ["z"], [5.0])).assign(bin=0)
    out = wa.bootstrap_means(t, "bin", n_boot=4000)
    assert out.loc[0, "mean_w"] == 3.0 and (out.loc[0, "lo"], out.loc[0, "hi"]) == (2.0, 5.0)
    assert out.loc[0, "n_tokens"] == 3 and out.loc[0, "n_rollouts"] == 2


def test_override_effect_removes_the_w_max_tokens_of_the_answer_span(wa):
    """Pre-box weights 0.5 and 1.5, the recorded answer span 1, 5, 5 (its w_max override on two tokens): mean
    (0.5+1.5+1+5+5)/5 = 2.6 with them, (0.5+1.5+1)/3 = 1 without; the same rollout is the reweighted population."""
    rows = _rollout(0, ["a", "b", "{", "3", "}."], [0.5, 1.5, 1.0, 5.0, 5.0],
                    region=["pre", "pre", "answer", "answer", "answer"])
    tokens, rollouts = wa.annotate(pd.DataFrame(rows).assign(text=["a", "b", "\\boxed{", "3", "}."]))
    effect = wa.override_effect(tokens, rollouts, w_max=5.0)
    for name in effect.index:
        assert effect.loc[name, "override tokens"] == 2
        assert effect.loc[name, "mean w"] == pytest.approx(2.6)
        assert effect.loc[name, "mean w without them"] == pytest.approx(1.0)


def test_first_slip_weights_against_position_and_result_digit_controls(wa):
    """Four wrong rollouts; r1 (1+2=4, w 0.6 at position 4) and r3 (2+2=5, w 0.9) slip at position 4, r2 (1+1=2,
    w 1.2 there) and r4 (10+1=11: "=" at position 4 with w 0.5, its result's first digit at 5 with w 2.0) do not.
    Position control: the other rollouts' tokens at position 4 that are not slips, r2 and r4: (1.2+0.5)/2 = 0.85;
    differences -0.25 and +0.05, mean -0.1. Result-digit control (step 0, digit 0 of the others' right steps): r2's
    1.2 and r4's 2.0, 1.6; differences -1.0 and -0.7, mean -0.85."""
    def chain(row, texts, w_pos):
        ws = [1.0] * len(texts)
        for p, w in w_pos.items():
            ws[p] = w
        return _rollout(row, texts + ["."] + BOX13, ws + [1.0] * (1 + len(BOX13)))

    rows = (chain(1, ["1", "+", "2", "=", "4"], {4: 0.6}) + chain(2, ["1", "+", "1", "=", "2"], {4: 1.2})
            + chain(3, ["2", "+", "2", "=", "5"], {4: 0.9})
            + chain(4, ["1", "0", "+", "1", "=", "1", "1"], {4: 0.5, 5: 2.0}))
    tokens, rollouts = wa.annotate(pd.DataFrame(rows))
    assert rollouts.set_index("row")["first_error"].to_dict() == {1: (4, 0, 0), 2: None, 3: (4, 0, 0), 4: None}
    table, slips = wa.error_vs_control(tokens, rollouts, n_boot=200)
    assert slips["position control"].tolist() == pytest.approx([0.85, 0.85])
    assert slips["result-digit control"].tolist() == pytest.approx([1.6, 1.6])
    assert table.loc["position control", "slips"] == 2
    assert table.loc["position control", "difference"] == pytest.approx(-0.1)
    assert table.loc["result-digit control", "difference"] == pytest.approx(-0.85)
    assert table.loc["result-digit control", "slip mean w"] == pytest.approx(0.75)


def test_heatmap_columns_split_by_correctness_not_by_the_sign_of_the_advantage():
    """A correct rollout of an all-correct group has A = 0 and a wrong one of an all-wrong group too: each goes to
    its grade's column."""
    from grail_exp.analysis.viz import weights_html

    page = weights_html([{"tokens": ["right"], "weights": [1.0], "advantage": 0.0, "correct": True},
                         {"tokens": ["wrong"], "weights": [1.0], "advantage": 0.0, "correct": False}])
    correct_col, wrong_col = page.split("<h2>")[1:3]
    assert correct_col.startswith("correct rollouts (1)") and ">right<" in correct_col
    assert wrong_col.startswith("wrong rollouts (1)") and ">wrong<" in wrong_col

# ------------------------------------------------------------------------------------------------ the committed study
COMMITTED_STUDY = "results/real_model_study/real_model_study"
# The one commit that trained recorded arms and is not in this repository: seeds 1-3 of the CPU study ran at a
# worktree commit that never landed on main (results/real_model_study.md, section 6). Any other commit must be an
# ancestor of HEAD, or the segment it trained must store its diff.
KNOWN_UNREACHABLE = {"6111368daf4d01cf2cf840decb13b0a7712221be":
                     "seeds 1-3 of real_model_study were trained at a worktree commit that never landed"}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _committed_study(tmp: Path) -> Path:
    """The study folder as committed at HEAD (not the working tree, where a running study may be adding arms), with
    only the seeds whose three arms are all recorded (the skip path must not start training a missing one)."""
    if _git("rev-parse", "--verify", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", COMMITTED_STUDY], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    study = tmp / COMMITTED_STUDY
    arms = {p.parent.name: json.loads(p.read_text()) for p in study.glob("*/arm.json")}
    seeds: dict[str, set] = {}
    for arm in arms.values():
        seeds.setdefault(str(arm["seed"]), set()).add(arm["scheme"])
    for name, arm in arms.items():
        if seeds[str(arm["seed"])] != {"grpo", "grail", "oar_g"}:
            import shutil

            shutil.rmtree(study / name)
    return study


def _complete_seeds(study: Path) -> list[str]:
    return sorted({str(json.loads(p.read_text())["seed"]) for p in study.glob("*/arm.json")}, key=int)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_committed_arms_are_skipped_by_todays_configuration(tmp_path):
    """Every committed arm is the same arm under the configuration the driver composes today: keys added to the
    configuration since it was recorded (rollout.draw, model.cpu_explicit_attention_max_scores, GRAIL's
    probe_rows_only, OAR-G's skip_zero_advantage, ...) count as their schema default."""
    from grail_exp.analysis.study import finished

    study = _committed_study(tmp_path)
    lr = json.loads((study / "lr.json").read_text())["lr"]
    seeds = _complete_seeds(study)
    assert seeds, "no complete seed in the committed study"
    for seed in seeds:
        for scheme in ("grpo", "grail", "oar_g"):
            cfg = compose([f"experiment=real/chain_{scheme}", f"seed={seed}", f"optim.lr={lr}", "resume=auto",
                           f"study.dir={study}", "paths.output_dir=/tmp/x"], None)
            record = finished(cfg)
            assert record is not None and record["arm"] == f"smollm2_135m-{scheme}-s{seed}"


@pytest.mark.e2e
def test_an_added_key_set_away_from_its_default_is_still_a_different_arm(tmp_path):
    """The default stands in only for what the old arm lacks: a job that sets the new key to something else is
    refused, naming it."""
    from grail_exp.analysis.study import StudyError, finished

    study = _committed_study(tmp_path)
    lr = json.loads((study / "lr.json").read_text())["lr"]
    cfg = compose(["experiment=real/chain_grpo", f"seed={_complete_seeds(study)[0]}", f"optim.lr={lr}",
                   "rollout.draw=inverse_cdf", f"study.dir={study}", "paths.output_dir=/tmp/x"], None)
    with pytest.raises(StudyError, match=r"rollout.draw: 'multinomial' vs 'inverse_cdf'"):
        finished(cfg)


@pytest.mark.e2e
@pytest.mark.slow
def test_driver_skips_every_committed_arm_and_reports_them(tmp_path):
    """sweeps/real_model_study.sh over a copy of the committed study: the study phase trains nothing (every arm
    'already finished'), the report phase's strict design check accepts the arms (recorded by older code), and a
    DECISION rule reaches the report: round one's GRAIL seeds read +1.0, −7.6, −5.1 (results/real_model_study.md
    §5), so "all 3 of 3 positive" is not met: not settled."""
    study = _committed_study(tmp_path)
    seeds = " ".join(_complete_seeds(study))
    e = {**os.environ, "PY": sys.executable, "RES": str(study), "OUT": str(tmp_path / "out"), "SEEDS": seeds,
         "PHASES": "study report", "DECISION": "3 3", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
         "OMP_NUM_THREADS": "1",
         "PYTHONPATH": str(ROOT), "GRAIL_EXP_CACHE": str(tmp_path / "cache")}
    e.pop("GRAIL_EXP_FAULT", None)
    done = subprocess.run(["bash", str(ROOT / "sweeps" / "real_model_study.sh"), f"paths.root_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=e, cwd=ROOT)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert log.count("already finished") == 3 * len(seeds.split()), log[-3000:]
    assert "starting fresh" not in log and "resuming from" not in log
    assert "phase report: written" in (study / "driver_log.txt").read_text()
    assert "not comparable" not in log
    assert seeds == "1 2 3"  # round one, whole
    assert "× grail: 1 of 3 seeds positive, 2 negative -> not settled by 3 seeds" in (study / "report.md").read_text()


def _arm_commits() -> list[tuple[str, str, dict]]:
    """(arm.json path, commit, segment or {}) for every arm committed under results/ at HEAD."""
    files = _git("ls-files", "results/**/arm.json").stdout.split()
    out = []
    for f in files:
        arm = json.loads(_git("show", f"HEAD:{f}").stdout)
        commit = arm.get("code", {}).get("git.commit")
        if commit:
            out.append((f, commit, {}))
        out += [(f, seg["git_commit"], seg) for seg in arm.get("segments", [])]
    return out


def _unreachable(records: list[tuple[str, str, dict]]) -> dict[str, list[str]]:
    """{commit: arm files} of the training commits that are neither a known exception, nor an ancestor of HEAD, nor
    a dirty segment of a commit we have whose diff is stored at HEAD."""
    out: dict[str, list[str]] = {}
    for path, commit, seg in records:
        if commit in KNOWN_UNREACHABLE:
            assert _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0, \
                f"{commit} is in the repository now: drop it from KNOWN_UNREACHABLE"
            continue
        if _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0:
            continue
        diff = seg.get("diff") and f"HEAD:{Path(path).parent / seg['diff']}"
        if diff and _git("cat-file", "-e", diff).returncode == 0 and \
                _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0:
            continue  # a dirty segment on a commit we have: its diff rebuilds the tree
        out.setdefault(commit, []).append(path)
    return out


def _needs_history():
    if _git("rev-parse", "--verify", "HEAD").returncode != 0 or \
            _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("needs the repository's full history")


@pytest.mark.e2e
def test_every_commit_that_trained_a_recorded_arm_is_in_the_repository():
    """code.git.commit and each segment's git_commit of every committed arm: an ancestor of HEAD, or (a segment)
    its diff stored in the arm folder; the single known exception is named with its reason."""
    _needs_history()
    records = _arm_commits()
    assert records, "no committed arm found"
    unreachable = _unreachable(records)
    assert not unreachable, f"arms trained at commits that are not in the repository: {unreachable}"
    for path, commit, seg in records:  # a dirty segment always carries its diff
        if seg.get("git_dirty") == "true":
            assert seg.get("diff") and _git("cat-file", "-e", f"HEAD:{Path(path).parent / seg['diff']}") \
                .returncode == 0, f"{path}: a dirty segment at {commit} without its diff"


@pytest.mark.e2e
def test_the_commit_check_catches_a_commit_nobody_has():
    """The check has teeth: an arm trained at a commit absent from the repository is reported (by its arm file),
    one at HEAD's parent is not, and the known exception is not."""
    _needs_history()
    stranger, parent = "0123456789abcdef0123456789abcdef01234567", _git("rev-parse", "HEAD~1").stdout.strip()
    records = [("results/x/a/arm.json", stranger, {}), ("results/x/b/arm.json", parent, {}),
               ("results/x/c/arm.json", next(iter(KNOWN_UNREACHABLE)), {}),
               ("results/x/d/arm.json", stranger, {"git_dirty": "true", "diff": "segments/0.diff"})]
    assert _unreachable(records) == {stranger: ["results/x/a/arm.json", "results/x/d/arm.json"]}


@pytest.mark.slow
def test_the_design_check_fills_absent_keys_compares_the_scheme_within_itself_and_accepts_a_study_in_progress(
        tmp_path):
    """Strict design check: an arm lacking a key counts as its schema default (rollout.draw: multinomial); advantage.*
    differs between schemes by design but not within one; a declared seed whose baseline arm is not recorded yet
    (seed 3: grail only) is footnoted, not refused."""
    from grail_exp.config import ConfigError

    study = tmp_path / "study"
    ones = np.ones((10, 4))
    grpo = {"advantage.name": "grpo", "rollout.draw": "multinomial"}
    grail = {"advantage.name": "grail", "advantage.std": 0.5}  # recorded before rollout.draw existed
    for seed in (1, 2):
        _arm(study, "grpo", seed, ones, grpo)
        _arm(study, "grail", seed, ones, grail)
    _arm(study, "grail", 3, ones, grail)
    out = _report(study, tmp_path, "seeds=[1,2,3]")
    assert "seed(s) 3 have no grpo partner" in out["markdown"]
    import shutil

    shutil.rmtree(study / "m-grail-s2")
    _arm(study, "grail", 2, ones, {**grail, "advantage.std": 0.3})
    with pytest.raises(ConfigError, match="not comparable") as info:
        _report(study, tmp_path, "seeds=[1,2,3]")
    assert "advantage.std: 0.5" in str(info.value) and "advantage.name" not in str(info.value)
    shutil.rmtree(study / "m-grail-s2")
    _arm(study, "grail", 2, ones, {**grail, "rollout.draw": "inverse_cdf"})
    with pytest.raises(ConfigError, match=r"rollout.draw: multinomial in .* vs inverse_cdf"):
        _report(study, tmp_path, "seeds=[1,2,3]")


@pytest.mark.e2e  # git in a child process (a few tenths of a second)
def test_a_run_writing_its_results_leaves_the_code_clean(tmp_path):
    """A study's driver appends to a tracked log under results/ while it runs: the segment's code is still the commit
    (dirty only when a tracked file of the code differs from it)."""
    from grail_exp.tracking import code_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "grail_exp").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "grail_exp" / "x.py").write_text("a = 1\n")
    (tmp_path / "results" / "driver_log.txt").write_text("start\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    commit, dirty = code_state(tmp_path)
    assert len(commit) == 40 and dirty == "false"
    (tmp_path / "results" / "driver_log.txt").write_text("start\nmore\n")
    (tmp_path / "new_untracked.py").write_text("b = 2\n")
    assert code_state(tmp_path) == (commit, "false")
    (tmp_path / "grail_exp" / "x.py").write_text("a = 2\n")
    assert code_state(tmp_path) == (commit, "true")


def _one_step(tmp: Path, name: str) -> subprocess.CompletedProcess:
    """One study arm of one step on the shipped tiny model with a 3-step cold start, its cache in ``tmp/cache``."""
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    env = {**os.environ, "GRAIL_EXP_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = ["experiment=real/chain_grpo", f"model.name_or_path={tiny}", "model.dtype=float32",
            "model.attn_implementation=eager", "model.few_shot=[]", "model.cold_start.steps=3", "seed=3",
            "trainer.max_steps=1", "trainer.prompts_per_step=2", "rollout.num_generations=4",
            "trainer.micro_batch_size=8", "trainer.weights_table_every=1", "rollout.max_completion_length=24",
            "eval.max_tokens=24", "eval.n=2", "data.num_test=8", "data.num_validation=8", "logger=none",
            f"study.dir={tmp / name}", f"paths.root_dir={tmp / name}-run"]
    return subprocess.run([sys.executable, "-m", "grail_exp.run", *args], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S, env=env, cwd=ROOT)


@pytest.mark.e2e
def test_the_run_that_builds_the_cold_start_samples_what_a_run_loading_it_samples(tmp_path):
    """Building the cold start (and the shared "before" evaluation) in the job's own process leaves the job's random
    streams where they were: the first arm of a seed, which builds both, draws the same step-1 rollouts as the next
    arm, which reads both from the cache. (Before this held, the builder's SFT seed replaced the run's: step-1
    rewards of GRPO and GRAIL differed in the one seed whose GRPO arm built the cold start.)"""
    built = _one_step(tmp_path, "builds")
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    assert "this run first builds it" in built.stdout + built.stderr
    loaded = _one_step(tmp_path, "loads")
    assert loaded.returncode == 0, (loaded.stdout + loaded.stderr)[-3000:]
    assert "this run first builds it" not in loaded.stdout + loaded.stderr
    rollouts = []
    for name in ("builds", "loads"):
        (arm,) = (tmp_path / name).glob("*/arm.json")
        table = pd.read_parquet(arm.parent / "weights" / "step_000001.parquet")
        rollouts.append(table.groupby("row")["token_id"].apply(list).tolist())
    assert rollouts[0] and rollouts[0] == rollouts[1]


def _short_arm(tmp: Path, name: str, eval_every: int) -> subprocess.CompletedProcess:
    """A 4-step GRAIL study arm on the shipped tiny model, evaluating every ``eval_every`` steps (0: only at the end)."""
    tiny = ROOT / "grail_exp" / "data" / "embedded" / "tiny"
    env = {**os.environ, "GRAIL_EXP_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [f"model.name_or_path={tiny}", "advantage=grail", "seed=5", "trainer.max_steps=4",
            f"trainer.eval_every={eval_every}", "trainer.prompts_per_step=4", "rollout.num_generations=4",
            "trainer.micro_batch_size=8", "trainer.weights_table_every=1", "rollout.max_completion_length=64",
            "eval.max_tokens=64", "eval.n=2", "benchmark.limit=6", "logger=none",
            f"study.dir={tmp / name}", f"paths.root_dir={tmp / name}-run", f"hydra.run.dir={tmp / name}-run/run"]
    return subprocess.run([sys.executable, "-m", "grail_exp.run", *args], capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S, env=env, cwd=ROOT)


@pytest.mark.e2e
def test_an_evaluation_inside_training_leaves_the_training_trajectory_unchanged(tmp_path):
    """Evaluating at steps 1, 2 and 3 of a 4-step run (sampling with its own chunk seeds, on the live policy) changes
    nothing the training draws or computes: every step's rollouts and the final weights equal those of the same run
    evaluated only at the end, bit for bit. So arms that evaluate at intermediate checkpoints pair with arms that do
    not, and the evaluations are recorded in the arm (``samples_step<N>.parquet``)."""
    from safetensors.torch import load_file

    runs = {name: _short_arm(tmp_path, name, every) for name, every in (("every", 1), ("end", 0))}
    for name, done in runs.items():
        assert done.returncode == 0, (name, (done.stdout + done.stderr)[-3000:])
    arms = {name: next((tmp_path / name).glob("*/arm.json")).parent for name in runs}
    # the weight tables hold the steps with informative groups (a group of equal rewards has no weights to show)
    steps = [sorted(p.name for p in (arms[name] / "weights").glob("step_*.parquet")) for name in runs]
    assert steps[0] == steps[1] and steps[0], steps
    for step in steps[0]:
        tables = [pd.read_parquet(arms[name] / "weights" / step) for name in runs]
        assert tables[0]["token_id"].tolist() == tables[1]["token_id"].tolist(), step
        assert tables[0]["weight"].tolist() == tables[1]["weight"].tolist(), step
    curves = [pd.read_csv(arms[name] / "history.csv") for name in runs]
    assert (curves[0]["grad_norm"] > 0).sum() >= 2, curves[0]  # the policy moved: there was a trajectory to change
    for column in ("reward/mean", "loss", "grad_norm", "completions/mean_length"):
        assert curves[0][column].tolist() == curves[1][column].tolist(), column
    weights = [load_file(tmp_path / f"{name}-run" / "run" / "checkpoints" / "step-4" / "model.safetensors")
               for name in runs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch_equal(weights[0][k], weights[1][k]) for k in weights[0]), "final weights differ"
    recorded = sorted(p.name for p in arms["every"].glob("samples_*.parquet"))
    assert recorded == ["samples_before.parquet", "samples_final.parquet", "samples_step1.parquet",
                        "samples_step2.parquet", "samples_step3.parquet"], recorded
    assert sorted(p.name for p in arms["end"].glob("samples_*.parquet")) == ["samples_before.parquet",
                                                                             "samples_final.parquet"]
    record = json.loads((arms["every"] / "arm.json").read_text())
    assert not Path(record["run_dir"]).is_absolute(), record["run_dir"]


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))
