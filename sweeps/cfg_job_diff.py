"""Compare the composed configs (`python -m grail_exp.run <args> --cfg job`) of two checkouts, key by key.

    python sweeps/cfg_job_diff.py /work/wt/integ /work/wt/configtree [raw] [resolved] [validated]

A change that only moves where a value is stated (the config tree) or how it is checked (validate) must leave every
composed value as it was, in three views: ``--cfg job`` as printed (raw: an interpolation is its text), resolved, and
what validate() returns (or the error it raises, which must be the same text). The ``recipe.*`` keys only record
which files composed the run, so they are listed apart and not counted. Exit status 1 when anything differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

# (arguments on the old checkout, arguments on the new one): the new tree's `algo=dapo` is the old
# `experiment=baselines/dapo_cpu` under the file's run name.
COMMANDS = [
    ([], []),
    (["model=qwen3_8b", "advantage=grail"],) * 2,
    (["experiment=real/chain_grpo"],) * 2,
    (["experiment=real/chain_grail"],) * 2,
    (["experiment=real/chain_oar_g"],) * 2,
    (["experiment=real/smollm2_grpo"],) * 2,
    (["experiment=real/smollm2_grail"],) * 2,
    (["model=qwen3_4b", "estimator=scrl"],) * 2,
    (["trainer=fsdp_zero2", "rollout=vllm_paper"],) * 2,
    (["experiment=baselines/dapo_cpu"], ["algo=dapo", "task_name=baseline_dapo_cpu"]),
    (["experiment=baselines/dapo_cpu"],) * 2,
]
BOOKKEEPING = "recipe."  # which files composed the run: deliberately renamed by the one recipe group


def flatten(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: node}


VALIDATE = """
import json, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import register_configs
from grail_exp.validate import validate
register_configs()
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[1:])
try:
    out = {"config": OmegaConf.to_container(validate(cfg), resolve=True)}
except Exception as exc:
    out = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out, default=str))
"""
NOWHERE = ["paths.root_dir=/nonexistent/root", "paths.output_dir=/nonexistent/run", "paths.cache_dir=/nonexistent/cache"]


def _run(checkout: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], cwd=checkout, env=env, capture_output=True, text=True)


def compose(checkout: str, args: list[str], mode: str):
    """{key: value} of the composed config, or the failure's last stderr line. mode: raw (``--cfg job`` as printed,
    interpolations unresolved), resolved (``--cfg job --resolve``, paths pinned), validated (the config validate()
    returns, resolved; or the ConfigError it raises)."""
    if mode == "validated":
        proc = _run(checkout, ["-c", VALIDATE, *NOWHERE, *args])
        if proc.returncode:
            return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['<no stderr>'])[-1]}"
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        return out["error"] if "error" in out else flatten(out["config"])
    extra = ["--cfg", "job"] if mode == "raw" else [*NOWHERE, "--cfg", "job", "--resolve"]
    proc = _run(checkout, ["-m", "grail_exp.run", *args, *extra])
    if proc.returncode:
        return f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['<no stderr>'])[-1]}"
    return flatten(yaml.safe_load(proc.stdout))


def compare(old: str, new: str, old_args: list[str], new_args: list[str], mode: str) -> bool:
    a, b = compose(old, old_args, mode), compose(new, new_args, mode)
    title = f"[{mode}] {' '.join(old_args) or '(demo)'}" + (f"  vs  {' '.join(new_args)}" if new_args != old_args else "")
    if isinstance(a, str) or isinstance(b, str):
        same = a == b
        print(f"{'SAME' if same else 'DIFF'}  {title}\n      old: {a if isinstance(a, str) else 'composes'}"
              f"\n      new: {b if isinstance(b, str) else 'composes'}")
        return same
    keys = sorted(a.keys() | b.keys())
    missing = object()
    differ = [k for k in keys if a.get(k, missing) != b.get(k, missing)]
    values = [k for k in differ if not k.startswith(BOOKKEEPING)]
    print(f"{'SAME' if not values else 'DIFF'}  {title}  ({len(keys)} keys; "
          f"{len(differ) - len(values)} recipe.* bookkeeping keys differ)")
    for k in differ:
        mark = "  (bookkeeping)" if k.startswith(BOOKKEEPING) else ""
        print(f"      {k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}{mark}")
    return not values


def main() -> int:
    old, new = sys.argv[1:3]
    modes = sys.argv[3:] or ["raw", "resolved", "validated"]
    results = {m: [compare(old, new, list(o), list(n), m) for o, n in COMMANDS] for m in modes}
    for m, r in results.items():
        print(f"[{m}] {sum(r)}/{len(r)} identical but for recipe.* bookkeeping")
    return 0 if all(all(r) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
