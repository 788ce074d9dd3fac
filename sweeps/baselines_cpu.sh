#!/usr/bin/env bash
# GRPO-family baselines on the embedded default (CPU): presets x seeds, paired against GRPO on the same seeds;
# the warm start is shared (model.build.seed fixed), only the run seed varies. Writes a table to stdout / $OUT.
#   bash sweeps/baselines_cpu.sh [presets] [seeds]      e.g.  bash sweeps/baselines_cpu.sh grpo,dapo,cispo 1,2
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PRESETS=${1:-grpo,dapo,cispo}
SEEDS=${2:-1,2}
DIR=outputs/baselines_cpu/$(date +%Y-%m-%d_%H-%M-%S)
EXPS=$(echo "$PRESETS" | sed 's/\([^,]*\)/baselines\/\1_cpu/g')
$PY -m grail_exp.run -m "experiment=$EXPS" "seed=$SEEDS" logger=none hydra.sweep.dir="$DIR"
$PY sweeps/baselines_table.py "$DIR" "${OUT:-/dev/stdout}" > /dev/null
