#!/usr/bin/env bash
# The CPU learning run of docs/real-model.md: SmolLM2-135M-Instruct (pkg:smollm2, offline) trained by RL on
# one-operation arithmetic, with the machine's load recorded every 30 s (other jobs share the cores).
#   bash sweeps/real_model.sh                     # GRPO, seed 1, experiment=real/smollm2_grpo (results/real_model.md)
#   SCHEME=grail bash sweeps/real_model.sh trainer.max_steps=3 trainer.weights_table_every=1   # extra overrides
# Outputs under $OUT (default outputs/real_model): results/mlflow.db (metrics, eval samples before / after, weight
# tables, plots), run_<scheme>_s<seed>/ (Hydra dir), train_<scheme>_s<seed>.log, load_<scheme>_s<seed>.log.
# Then: python sweeps/real_model_report.py $OUT (the paired before / after test and the tables of results/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-outputs/real_model}
SCHEME=${SCHEME:-grpo}
SEED=${SEED:-1}
TAG=${SCHEME}_s${SEED}
mkdir -p "$OUT"
( while true; do echo "$(date +%s) $(cat /proc/loadavg)"; sleep 30; done ) > "$OUT/load_$TAG.log" &
loadpid=$!
trap 'kill $loadpid' EXIT
start=$(date +%s)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} $PY -m grail_exp.run experiment=real/smollm2_$SCHEME seed=$SEED \
    paths.root_dir="$OUT" hydra.run.dir="$OUT/run_$TAG" trainer.progress_log_every=1 "$@" 2>&1 | tee "$OUT/train_$TAG.log"
echo "wall: $(( $(date +%s) - start )) s" | tee -a "$OUT/train_$TAG.log"
