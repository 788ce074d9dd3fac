#!/usr/bin/env bash
# The GRAIL paper's table: models x {grpo, grail, oar_g} x seeds, one MLflow parent run per multirun, then the
# table with paired statistics (python -m grail_exp.report). Every job is tagged study=$STUDY.
#
#   bash sweeps/paper_table.sh [hydra overrides]         # GPU cluster: experiment=paper/<model>_<scheme> as
#                                                        # SLURM jobs (hydra/launcher=submitit_slurm), seed 42
#   bash sweeps/paper_table.sh --cpu [hydra overrides]   # the CPU study on the embedded task (hours on 2 cores;
#                                                        # LANES=2 runs two (model, seed) groups at once)
#
# Knobs (environment): MODELS, SCHEMES, SEEDS (GPU); LANES (CPU); STUDY (tag and output name); PY (the interpreter).
# GPU example: bash sweeps/paper_table.sh hydra.launcher.partition=gpu hydra.launcher.account=myproj
# Preempted or timed-out jobs requeue themselves and continue with resume=auto (docs/reliability.md, Preemption).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
STAMP=$(date +%Y-%m-%d_%H-%M-%S)

if [[ $CPU == 1 ]]; then
    # Embedded task, same budget for every arm (the defaults: 150 steps of 16 prompts x 8), one warm start per
    # seed shared by the arms of that seed (model.build.seed=${seed}; built by the seed's first job, cached).
    # Work is queued as (model, seed) groups -- one warm start, then that seed's arms -- and LANES groups run at
    # once, each single-threaded (LANES=2 on a 2-core machine: the tiny model gains little from a second thread,
    # so two lanes do ~2x the work per hour). Tiny Qwen3 groups are queued first: stopping early keeps it whole.
    STUDY=${STUDY:-paper_table_cpu_$STAMP}
    LANES=${LANES:-1}
    threads=$([[ $LANES -gt 1 ]] && echo 1 || echo null)
    EXTRA=$([[ $# -gt 0 ]] && printf '%q ' "$@" || true)  # the command line's overrides, quoted for the lanes
    export PY STUDY threads EXTRA
    run_group() {  # $1 model, $2 schemes (csv), $3 seed; the command line's overrides come from $EXTRA
        local model=$1 schemes=$2 seed=$3
        eval "set -- $EXTRA"
        $PY -m grail_exp.run -m "model=$model" "advantage=$schemes" "seed=$seed" task_name=paper_table_cpu \
            "+logger.tags.study=$STUDY" 'model.build.seed=${seed}' "trainer.num_threads=$threads" \
            hydra.sweep.dir="outputs/paper_table_cpu/$STUDY/${model}_seed$seed" "$@" \
            > "outputs/paper_table_cpu/$STUDY/${model}_seed$seed.log" 2>&1 \
            && echo "done: $model seed $seed" || echo "FAILED: $model seed $seed (see its .log)"
    }
    export -f run_group
    mkdir -p "outputs/paper_table_cpu/$STUDY"
    echo "study $STUDY: logs under outputs/paper_table_cpu/$STUDY/, $LANES lane(s)"
    { for s in 1 2 3 4 5; do echo "tiny grpo,grail,oar_g $s"; done
      for s in 1 2 3; do echo "tiny_llama grpo,grail $s"; done; } |
        xargs -P "$LANES" -L 1 bash -c 'run_group "$@"' _
    $PY -m grail_exp.report "+runs.tags.study=$STUDY" "models=[tiny,tiny_llama]" "schemes=[grpo,grail,oar_g]" \
        "seeds=[1,2,3,4,5]" '+design.tiny_llama={schemes: [grpo, grail], seeds: [1, 2, 3]}' output.name="$STUDY"
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
