"""(Re)build the shipped warm-started embedded model into the package (grail_exp/data/embedded/<name>/).

    PYTHONPATH=. OMP_NUM_THREADS=1 python sweeps/build_shipped_model.py [hydra overrides, default: model=tiny]

Builds from scratch with the project's own builder (``grail_exp.models.embedded.ensure_embedded_model``, shipped weights
off, an empty temporary cache), so the result is exactly what a run with the same config would build on this
machine. Then it copies the model directory into the package next to a manifest (``grail_exp_manifest.json``) that
records the build's cache key and spec, the sha256 of every file, the git commit and ``BUILD_VERSION`` of the code
that built it, the warm start's greedy validation accuracy and steps, and the machine and library versions. Commit
the code first (the manifest records HEAD and whether the tree was dirty), then run this, then commit the artifact.
It takes the warm start's time (2-6 min on a 2-core CPU). docs/embedded-model.md says when a rebuild is needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(overrides: list[str], dest_root: Path, allow_dirty: bool = False) -> Path:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grail_exp.models.embedded import (
        BUILD_VERSION,
        MANIFEST,
        cache_key,
        embedded_spec,
        ensure_embedded_model,
        file_sha256,
        greedy_accuracy,
        read_build_report,
    )
    from grail_exp.models.loading import embedded_build_args

    cfg = compose(overrides)
    if cfg.model.name_or_path is not None:
        raise SystemExit(f"{overrides}: model.name_or_path is set; only an embedded model (null) can be shipped")
    name = cfg.model.name
    # The code that builds the artifact; the artifact's own directory does not count as a change of it.
    inside = dest_root.is_relative_to(ROOT)
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                 *([f":(exclude){dest_root.relative_to(ROOT)}"] if inside else []))
    if dirty and not allow_dirty:
        raise SystemExit(f"uncommitted changes; commit the code that builds the artifact first (or --allow-dirty):\n{dirty}")
    args = embedded_build_args(cfg)
    spec = embedded_spec(**args)
    key = cache_key(spec)
    with tempfile.TemporaryDirectory(prefix="grail_exp_shipped_") as cache:
        built = ensure_embedded_model(**args, cache_dir=cache, use_shipped=False)
        report = read_build_report(built)
        ws = report["warm_start"]
        if not ws.get("reached_target"):
            raise SystemExit(f"the warm start stopped at max_steps={spec['warm_start']['max_steps']} with greedy "
                             f"accuracy {ws['greedy_val_accuracy']:.3f} < target; not shipping it")
        # Reload from disk and grade again: what ships must score what the warm start measured in memory.
        tok = AutoTokenizer.from_pretrained(built)
        model = AutoModelForCausalLM.from_pretrained(built, attn_implementation="eager", dtype=torch.float32)
        val = list(args["task"].split("validation"))[: spec["warm_start"]["eval_problems"]]
        reloaded = greedy_accuracy(model, tok, val, args["chat_template_kwargs"], args["instruction"])
        if reloaded != ws["greedy_val_accuracy"]:
            raise SystemExit(f"reloaded weights score {reloaded} != {ws['greedy_val_accuracy']} measured in the build")
        dest = dest_root / name
        tmp = dest_root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(built, tmp)
    files = {f.name: file_sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
    manifest = {
        "name": name,
        "cache_key": key,
        "cache_directory": built.name,  # where a local build of the same spec lands under <cache_dir>/embedded/
        "build_version": BUILD_VERSION,
        "spec": spec,
        "weights_sha256": files["model.safetensors"],
        "files": files,
        "parameters": report["parameters"],
        "warm_start": {"steps": ws["steps"], "greedy_val_accuracy": ws["greedy_val_accuracy"],
                       "target_accuracy": spec["warm_start"]["target_accuracy"],
                       "eval_problems": spec["warm_start"]["eval_problems"], "seconds": round(ws["seconds"], 1)},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty),
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "built_by": "python sweeps/build_shipped_model.py " + " ".join(overrides),
        "machine": {"cpu": _cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"shipped {name}: {dest} (key {key}, {ws['steps']} warm-start steps, greedy validation accuracy "
          f"{100 * ws['greedy_val_accuracy']:.1f} %, {ws['seconds']:.0f} s)")
    return dest


def main(argv: list[str] | None = None) -> None:
    from grail_exp.models.embedded import SHIPPED_DIR

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", default=["model=tiny"], help="Hydra overrides selecting the build")
    p.add_argument("--dest", type=Path, default=SHIPPED_DIR, help="package directory of shipped models")
    p.add_argument("--allow-dirty", action="store_true", help="build from a tree with uncommitted changes")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    build(a.overrides, a.dest.resolve(), a.allow_dirty)


if __name__ == "__main__":
    sys.exit(main())
