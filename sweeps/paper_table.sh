#!/usr/bin/env bash
# The GRAIL paper's table: models x {grpo, grail, oar_g} x seeds, one MLflow parent run per multirun, then the
# table with paired statistics (python -m grail_exp.report). Every job is tagged study=$STUDY.
#
#   bash sweeps/paper_table.sh [hydra overrides]         # GPU cluster: experiment=paper/<model>_<scheme> as
#                                                        # SLURM jobs (hydra/launcher=submitit_slurm), seed 42
#   bash sweeps/paper_table.sh --cpu [hydra overrides]   # the CPU study on the embedded task (hours on 2 cores)
#
# Knobs (environment): MODELS, SCHEMES, SEEDS (GPU); STUDY (tag and output name); PY (the interpreter).
# GPU example: bash sweeps/paper_table.sh hydra.launcher.partition=gpu hydra.launcher.account=myproj
# Preempted or timed-out jobs requeue themselves and continue with resume=auto (README: Running at scale).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
STAMP=$(date +%Y-%m-%d_%H-%M-%S)

if [[ $CPU == 1 ]]; then
    # Embedded task, same budget for every arm (the defaults: 150 steps of 16 prompts x 8), one warm start per
    # seed shared by the arms of that seed (model.build.seed=${seed}; built once, cached).
    STUDY=${STUDY:-paper_table_cpu_$STAMP}
    common=(task_name=paper_table_cpu "+logger.tags.study=$STUDY" 'model.build.seed=${seed}')
    $PY -m grail_exp.run -m model=tiny advantage=grpo,grail,oar_g seed=1,2,3,4,5 "${common[@]}" \
        hydra.sweep.dir="outputs/paper_table_cpu/$STUDY/tiny" "$@"
    $PY -m grail_exp.run -m model=tiny_llama advantage=grpo,grail seed=1,2,3 "${common[@]}" \
        hydra.sweep.dir="outputs/paper_table_cpu/$STUDY/tiny_llama" "$@"
    $PY -m grail_exp.report "+runs.tags.study=$STUDY" "models=[tiny,tiny_llama]" "schemes=[grpo,grail,oar_g]" \
        "seeds=[1,2,3,4,5]" output.name="$STUDY"
    exit 0
fi

STUDY=${STUDY:-paper_table_$STAMP}
MODELS=${MODELS:-qwen3_4b qwen3_8b r1_distill_llama_8b octothinker_3b octothinker_8b}
SCHEMES=${SCHEMES:-grpo grail oar_g}
SEEDS=${SEEDS:-42}
experiments=$(for m in $MODELS; do for s in $SCHEMES; do printf 'paper/%s_%s,' "$m" "$s"; done; done)
csv() { echo "$*" | tr ' ' ','; }
$PY -m grail_exp.run -m "experiment=${experiments%,}" "seed=$(csv $SEEDS)" hydra/launcher=submitit_slurm \
    task_name=paper_table "+logger.tags.study=$STUDY" hydra.sweep.dir="outputs/paper_table/$STUDY" "$@"
$PY -m grail_exp.report "+runs.tags.study=$STUDY" "models=[$(csv $MODELS)]" "schemes=[$(csv $SCHEMES)]" \
    "seeds=[$(csv $SEEDS)]" output.name="$STUDY"
