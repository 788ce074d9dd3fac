"""docs/add-a-method.md does what it says: its files, written into a copy of the repository and nothing else edited,
give a new scheme and a new estimator that a 2-step run trains with."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "add-a-method.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
# Cheap settings of the embedded default (the page's command is run as written, with these appended).
TINY = ["trainer.max_steps=2", "trainer.prompts_per_step=2", "rollout.num_generations=4",
        "trainer.eval_before_training=false", "trainer.eval_at_end=false", "logger=none", "reward.num_workers=0"]


def page_blocks() -> tuple[dict[str, str], list[str]]:
    """({repository path: content} of every python / yaml block, which opens with a ``# <path>`` line; the bash
    blocks' lines)."""
    files, commands = {}, []
    for lang, body in FENCE.findall(PAGE.read_text(encoding="utf-8")):
        if lang in ("python", "yaml"):
            header = body.splitlines()[0]
            assert header.startswith("# ") and "/" in header, f"a {lang} block without its '# <path>' line: {header}"
            files[header[2:].strip()] = body
        elif lang == "bash":
            commands += [line for line in body.splitlines() if line.strip()]
    return files, commands


def test_the_page_adds_one_file_and_one_config_per_method():
    """Exactly four files: per method one module in a registry folder and its config group file of the same name."""
    files, commands = page_blocks()
    assert sorted(files) == ["conf/advantage/ramp.yaml", "conf/estimator/sign.yaml",
                             "grail_exp/advantages/ramp.py", "grail_exp/estimators/sign.py"]
    assert not any((ROOT / path).exists() for path in files), "the page's example names exist in the repository"
    assert commands == ["python -m grail_exp.run advantage=ramp estimator=sign"]


@pytest.mark.e2e
def test_the_pages_method_trains_in_a_copy_of_the_repository(tmp_path):
    files, (command,) = page_blocks()
    repo = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for top in ("grail_exp", "conf"):
        shutil.copytree(ROOT / top, repo / top, ignore=ignore)
    for path, content in files.items():
        assert not (repo / path).exists(), path  # a new file, not an edit
        (repo / path).write_text(content, encoding="utf-8")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "grail_exp.run"]
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv[1:], *TINY, f"paths.root_dir={run}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics_file,) = run.glob("outputs/train/runs/*/metrics.json")
    metrics = json.loads(metrics_file.read_text())["metrics"]
    # Each method's own diagnostic was logged: the run used them, from the copy (a weight > 1 is the ramp's end).
    assert metrics["train/ramp/max_weight"] > 1.0, metrics
    assert 0.0 <= metrics["train/estimator/positive_frac"] <= 1.0, metrics
    # A wrong value of the new key is refused before anything loads, naming it (the page's claim).
    bad = subprocess.run([sys.executable, *argv[1:], "advantage.alpha=1.5", *TINY, f"paths.root_dir={run}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "advantage.alpha = 1.5: must be in [0, 1)" in bad.stdout + bad.stderr
