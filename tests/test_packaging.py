"""The config tree lives at the top-level ``conf/`` and still works from any directory and from a wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from helpers.tolerances import HANG_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "grail_exp").rglob("__init__.py")}
    assert found - listed == set(), "add these packages to [tool.setuptools] packages in pyproject.toml"
    assert "grail_exp.conf" in listed


def test_config_tree_is_the_top_level_conf():
    from grail_exp.conf_path import CONFIG_DIR

    assert Path(CONFIG_DIR) == ROOT / "conf"
    assert not (ROOT / "grail_exp" / "conf").exists(), "the config tree moved to <repo>/conf"


def _job_config(cwd: Path, env: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "grail_exp.run", "--cfg", "job", "advantage=grpo"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.e2e
def test_run_composes_from_another_directory(tmp_path):
    text = _job_config(tmp_path, dict(os.environ))
    assert "name: grpo" in text


@pytest.mark.e2e
def test_run_composes_from_an_installed_wheel(tmp_path):
    """Build the wheel, unpack it, and compose `python -m grail_exp.run` from it (not from the checkout)."""
    # From a copy of the sources: setuptools reuses a checkout's build/lib, where files from an earlier build would
    # hide a package-data glob that no longer matches.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".tmp-*")
    for name in ("grail_exp", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheel_dir), str(src)], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheel_dir.glob("grail_exp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "grail_exp/conf/config.yaml" in names and "grail_exp/conf/experiment/paper/qwen3_4b_grail.yaml" in names
    assert any(n.startswith("grail_exp/data/benchmark_files/") and n.endswith(".jsonl") for n in names)
    assert "grail_exp/data/architectures/qwen3_8b.json" in names  # model.random_init needs them in a wheel
    shipped = sorted(p.name for p in (ROOT / "grail_exp" / "data" / "embedded" / "tiny").iterdir())
    assert "model.safetensors" in shipped and "grail_exp_manifest.json" in shipped
    assert {f"grail_exp/data/embedded/tiny/{n}" for n in shipped} <= set(names)  # the warm-started default
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import grail_exp.conf_path as c; print(c.CONFIG_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert where.stdout.strip() == str(site / "grail_exp" / "conf"), where.stderr
    assert "name: grpo" in _job_config(tmp_path, env)
    # A read-only install: the default run loads the shipped model in place, builds nothing, writes nothing there.
    pkg = site / "grail_exp"
    for p in [pkg, *pkg.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        loaded = subprocess.run([sys.executable, "-c", _LOAD_SHIPPED, str(tmp_path / "cache")], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=180)
    finally:
        for p in [pkg, *pkg.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == [str(pkg / "data" / "embedded" / "tiny"), "loaded"]
    assert not (tmp_path / "cache" / "embedded").exists() or not any((tmp_path / "cache" / "embedded").iterdir())


_LOAD_SHIPPED = """
import sys
from hydra import compose, initialize_config_dir
import grail_exp.models.embedded as embedded
from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import register_configs
from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

embedded.build_model = embedded.warm_start = None  # a build would fail at once instead of running for minutes
register_configs()
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose(config_name="config", overrides=[f"paths.cache_dir={sys.argv[1]}"])
path = resolve_model_path(cfg)
load_tokenizer(path, cfg), load_causal_lm(path, cfg, trainable=True)
print(path, "loaded")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("entry", ["grail_exp.evaluate", "grail_exp.weights"])
def test_other_entry_points_find_the_tree(tmp_path, entry):
    out = subprocess.run([sys.executable, "-m", entry, "--cfg", "job"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-2000:]
