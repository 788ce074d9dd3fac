#!/usr/bin/env bash
# How much do results move with the seed? GRPO vs GRAIL over many seeds, then the paired table.
#
#   bash sweeps/seed_study.sh [hydra overrides]         # GPU cluster: experiment=paper/qwen3_4b_{grpo,grail},
#                                                       # SEEDS (default 1 2 3) as SLURM jobs
#   bash sweeps/seed_study.sh --cpu [hydra overrides]   # embedded task, SEEDS default 1..10
#
# CPU: one warm start shared by all runs (model.build.seed=0), so the spread is the RL seed's alone;
# WARM_PER_SEED=1 gives every seed its own warm start (model.build.seed=${seed}), the spread of the whole pipeline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
STUDY=${STUDY:-seed_study_$(date +%Y-%m-%d_%H-%M-%S)}
csv() { echo "$*" | tr ' ' ','; }

if [[ $CPU == 1 ]]; then
    SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10}
    build='model.build.seed=0'
    [[ "${WARM_PER_SEED:-0}" == 1 ]] && build='model.build.seed=${seed}'
    $PY -m grail_exp.run -m advantage=grpo,grail "seed=$(csv $SEEDS)" "$build" task_name=seed_study \
        "+logger.tags.study=$STUDY" hydra.sweep.dir="outputs/seed_study/$STUDY" "$@"
else
    SEEDS=${SEEDS:-1 2 3}
    $PY -m grail_exp.run -m experiment=paper/qwen3_4b_grpo,paper/qwen3_4b_grail "seed=$(csv $SEEDS)" \
        hydra/launcher=submitit_slurm task_name=seed_study "+logger.tags.study=$STUDY" \
        hydra.sweep.dir="outputs/seed_study/$STUDY" "$@"
fi
$PY -m grail_exp.report "+runs.tags.study=$STUDY" "schemes=[grpo,grail]" "seeds=[$(csv $SEEDS)]" output.name="$STUDY"
