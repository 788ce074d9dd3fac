#!/usr/bin/env bash
# The real-model scheme study (docs/real-model-study.md): SmolLM2-135M-Instruct on arithmetic chains,
# {grpo, grail, oar_g} x seeds, one multirun (one MLflow parent run), then the paired table from the study folder.
# Safe to stop at any point and to run again: every phase skips what is done, and a stopped arm resumes.
#
#   bash sweeps/real_model_study.sh                         # the whole study (background it: nohup ... &)
#   bash sweeps/real_model_study.sh                         # after a stop: the same command continues it
#   SEEDS="1 2" bash sweeps/real_model_study.sh trainer.max_steps=60     # knobs; overrides go to every job
#
# Phases:
#  1. the learning rate, once: GRPO only, seed 0, optim.lr in $LRS, $LR_STEPS steps each, selected on the 64
#     validation problems x 4 (never the test split): the best validation acc (ties: the smaller lr) goes to
#     $RES/lr.json and is used by every arm from then on. LR=<value> skips the sweep (recorded as given).
#  2. the study: seed=$SEEDS (outer) x experiment=real/chain_{grpo,grail,oar_g}, resume=auto, study.dir=$RES:
#     each arm is recorded in $RES/<arm>/ (arm.json, samples, curves, weight tables) the moment it finishes;
#     a restart skips recorded arms and continues the stopped one from its last checkpoint (every 10 steps).
#  3. the report: python -m grail_exp.report runs.dir=$RES design_check.strict=true -> $RES/report.{md,tex,json}
#     and plots; GRAIL's weight profile and heatmaps -> $RES/weights/; each seed's step-1 rewards -> $RES/first_rollouts.md.
#
# Knobs (environment): STUDY (name; default real_model_study), RES (results folder, committed; default
# results/real_model_study/$STUDY), OUT (run dirs and checkpoints; default outputs/real_model_study/$STUDY), SEEDS,
# SCHEMES, LRS, LR_STEPS, LR, THREADS (torch threads; default: torch's), PY (the interpreter), PHASES (default
# "lr study report"), DECISION ("<seeds> <min_same_sign>": the study's declared rule, applied by the report),
# START_SHA (the declared starting weights' sha256 or its prefix: checked before the first arm trains; a mismatch
# stops the driver with exit 2 before anything is recorded), REPORT_ARGS (further report overrides, word-split, e.g.
# "endpoint.name=A spread.steps=[40,50,60] spread.rule_ratio=0.5 pooled.dirs=[results/real_model_study/six_seeds]").
# Each phase's start and end go to $RES/driver_log.txt (the wall times of the study).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STUDY=${STUDY:-real_model_study}
RES=${RES:-results/real_model_study/$STUDY}
OUT=${OUT:-outputs/real_model_study/$STUDY}
SEEDS=${SEEDS:-1 2 3}
SCHEMES=${SCHEMES:-grpo grail oar_g}
LRS=${LRS:-1e-5 3e-5 1e-4}
LR_STEPS=${LR_STEPS:-20}
PHASES=${PHASES:-lr study report}
csv() { echo "$*" | tr ' ' ','; }
note() { echo "$(date -u +%FT%TZ) $*" | tee -a "$RES/driver_log.txt"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }
mkdir -p "$RES" "$OUT"
threads=()
if [[ -n "${THREADS:-}" ]]; then threads=("trainer.num_threads=$THREADS"); fi

# ---- 1. the learning rate (GRPO only, validation split), chosen once
if [[ -n "${LR:-}" && ! -f "$RES/lr.json" ]]; then
    echo "{\"lr\": $LR, \"rule\": \"given (LR=$LR)\"}" > "$RES/lr.json"
fi
if has lr && [[ ! -f "$RES/lr.json" ]]; then
    note "phase lr: start (lr in $LRS, $LR_STEPS steps, GRPO, seed 0, validation split)"
    $PY -m grail_exp.run -m experiment=real/chain_grpo seed=0 "optim.lr=$(csv $LRS)" resume=auto \
        benchmark=arithmetic_val trainer.max_steps="$LR_STEPS" trainer.eval_before_training=false \
        optimized_metric=eval/arithmetic_val/acc "study.dir=$RES/lr_sweep" 'study.arm=grpo-lr${optim.lr}' \
        hydra.sweep.dir="$OUT/lr_sweep" 'hydra.sweep.subdir=lr${optim.lr}' "+logger.tags.study=${STUDY}_lr" \
        "${threads[@]}" "$@"
    $PY -c "import sys; from grail_exp.analysis.study import choose_lr; choose_lr(sys.argv[1], sys.argv[2], sys.argv[3].split())" \
        "$RES/lr_sweep" "$RES/lr.json" "$LRS"
    note "phase lr: end (lr $($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['lr'])" "$RES/lr.json"))"
fi

# ---- 2. the study: every arm of every seed from the same weights, one multirun, resumable
if has study; then
    [[ -f "$RES/lr.json" ]] || { echo "no $RES/lr.json: run the lr phase first, or set LR=<value>" >&2; exit 2; }
    lr=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['lr'])" "$RES/lr.json")
    experiments=$(for s in $SCHEMES; do printf 'real/chain_%s,' "$s"; done)
    if [[ -n "${START_SHA:-}" ]]; then
        first=${SCHEMES%% *}
        sha=$($PY sweeps/check_start_weights.py --expect "$START_SHA" "experiment=real/chain_$first" "$@") \
            || { note "phase study: refused (starting weights are not $START_SHA)"; exit 2; }
        note "phase study: starting weights sha256 $sha (declared $START_SHA)"
    fi
    note "phase study: start (seeds $SEEDS, schemes $SCHEMES, lr $lr)"
    $PY -m grail_exp.run -m "seed=$(csv $SEEDS)" "experiment=${experiments%,}" "optim.lr=$lr" resume=auto \
        "study.dir=$RES" hydra.sweep.dir="$OUT/study" 'hydra.sweep.subdir=${advantage.name}_s${seed}' \
        "+logger.tags.study=$STUDY" "${threads[@]}" "$@"
    note "phase study: end ($(ls -d "$RES"/*/arm.json 2>/dev/null | wc -l) arms recorded)"
fi

# ---- 3. the report from the study folder (refused if the arms are not one study), GRAIL's weights
if has report; then
    parent=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['run_id'])" \
        "$OUT/study/mlflow_parent_run.json" 2>/dev/null || true)
    log_to=$([[ -n "$parent" ]] && echo "log_to=parent runs.parent_run_id=$parent" || echo "log_to=none")
    rule=()
    if [[ -n "${DECISION:-}" ]]; then
        read -r rule_seeds rule_min <<< "$DECISION"
        rule=("decision.seeds=$rule_seeds" "decision.min_same_sign=$rule_min")
    fi
    # shellcheck disable=SC2086
    $PY -m grail_exp.report "runs.dir=$RES" design_check.strict=true "schemes=[$(csv $SCHEMES)]" \
        "seeds=[$(csv $SEEDS)]" 'metrics=[acc,pass@n]' "output.dir=$RES" output.name=report \
        "output.title='SmolLM2-135M-Instruct on arithmetic chains, study $STUDY'" $log_to "${rule[@]}" ${REPORT_ARGS:-}
    if compgen -G "$RES/*-grail-s*/weights" > /dev/null; then
        $PY sweeps/real_model_weights.py "$RES"/*-grail-s* --out "$RES/weights" --min-length 40 --max-length 150
    fi
    # Each seed's step-1 training reward per arm: equal within a seed (the arms' first rollouts are common random numbers)
    $PY -c "import sys; from grail_exp.analysis.study import first_rollouts; first_rollouts(sys.argv[1], sys.argv[2].split())" \
        "$RES" "$SCHEMES" > "$RES/first_rollouts.md"
    note "phase report: written to $RES/report.md (and first_rollouts.md)"
fi
