"""`python -m grail_exp.evaluate`: the paper suite on the tiny model, MLflow table, files, resume after a kill."""

import json
import os
import signal
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from helpers.tolerances import HANG_TIMEOUT_S

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)


def _args(tmp_path, model_dir, run_dir, extra=()):
    return [sys.executable, "-m", "grail_exp.evaluate", f"model.name_or_path={model_dir}", "benchmark=paper",
            "eval=quick", "benchmark.limit=2", "eval.n=2", "eval.max_tokens=24", "eval.batch_size=2",
            f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", f"hydra.run.dir={run_dir}", *extra]


def _runs(tmp_path):
    c = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    return c, c.search_runs([c.get_experiment_by_name("grail_exp").experiment_id], order_by=["start_time ASC"])


def test_evaluate_paper_suite_logs_table_and_resumes_after_kill(tmp_path, tiny_model_dir):
    # 1. killed (SIGKILL, injected right after the 3rd cached chunk; each chunk = 1 problem x 2 samples)
    killed = subprocess.run(_args(tmp_path, tiny_model_dir, tmp_path / "killed"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=HANG_TIMEOUT_S,
                            env={**os.environ, "GRAIL_EXP_FAULT": "kill_eval_after_chunks:3"})
    assert killed.returncode == -signal.SIGKILL
    cache = tmp_path / "cache" / "evals"
    cached_before = sum(len(f.read_text().splitlines()) for f in cache.glob("*.jsonl"))
    assert cached_before == 3

    # 2. the rerun continues: only the missing chunks are generated
    done = subprocess.run(_args(tmp_path, tiny_model_dir, tmp_path / "resumed"), capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    c, runs = _runs(tmp_path)
    resumed = runs[-1]
    assert resumed.info.status == "FINISHED"
    generated = resumed.data.metrics["eval/generated"]
    assert generated == 2 * (12 - cached_before), (generated, cached_before)

    # 3. a repeated evaluation is free and gives identical results
    again = subprocess.run(_args(tmp_path, tiny_model_dir, tmp_path / "again"), capture_output=True, text=True,
                           timeout=HANG_TIMEOUT_S)
    assert again.returncode == 0
    c, runs = _runs(tmp_path)
    assert runs[-1].data.metrics["eval/generated"] == 0
    s1 = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert s1 == s2

    # files and MLflow contents
    assert set(s1) >= {"math500", "aime24", "amc23", "minerva_math", "college_math_200", "olympiadbench_200",
                       "average_unweighted", "average_weighted"}
    m = s1["math500"]
    assert m["n_problems"] == 2 and m["n_samples"] == 2 and set(m["pass_at_k"]) == {"1", "2"}
    assert {"value", "lo", "hi"} <= set(m["acc"])
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 * 2 * 2
    assert set(rows[0]) == {"benchmark", "problem_index", "sample_index", "completion", "extracted", "gold", "correct"}
    arts = {a.path for a in c.list_artifacts(resumed.info.run_id, "eval/eval")}
    assert {"eval/eval/pass_at_k.json", "eval/eval/pass_at_k.md", "eval/eval/samples.parquet",
            "eval/eval/pass_at_k.png", "eval/eval/summary.json"} <= arts
    params = resumed.data.params
    assert "Please reason step by step" in params["eval.prompt_template"] and params["eval.olympiad_gold"] == "first"
    assert "enable_thinking" in params["eval.chat_template_kwargs"]
    assert "eval/avg/acc" in resumed.data.metrics and "eval/math500/pass_at_2" in resumed.data.metrics
