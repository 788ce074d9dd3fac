#!/usr/bin/env bash
# The embedded-default demo over 3 seeds: each seed builds its own warm start (model.build.seed) and
# runs RL with the same run seed; writes results/demo_seeds.md from the jobs' metrics.json.
#   bash sweeps/demo_seeds.sh [extra hydra overrides]      (OUT=results/x.md to choose the table file)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STAMP=$(date +%Y-%m-%d_%H-%M-%S)
DIR=outputs/demo_seeds/$STAMP
$PY -m grail_exp.run -m seed=1,2,3 'model.build.seed=${seed}' task_name=demo_seeds \
    hydra.sweep.dir="$DIR" "$@"
$PY sweeps/demo_table.py "$DIR" "${OUT:-results/demo_seeds.md}"
