#!/usr/bin/env bash
# Optuna study of GRAIL's saliency temperature (conf/hparams_search/saliency_temperature.yaml), selected on the
# validation split with pruning; best values in results/tune/saliency_temperature/best.yaml and in MLflow.
#
#   bash sweeps/tune_saliency_temperature.sh --cpu [overrides]   # embedded task, one worker in this process
#   bash sweeps/tune_saliency_temperature.sh [overrides]         # WORKERS SLURM jobs on one study; needs a
#                                                                # server DB: STORAGE=postgresql://user@host/db
# Run the same command again to resume a killed study (finished trials stay; a dead worker's trial is re-run).
# Knobs (environment): N_TRIALS (default 20), WORKERS (default 4), STORAGE.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
N_TRIALS=${N_TRIALS:-20}

if [[ $CPU == 1 ]]; then
    $PY -m grail_exp.tune hparams_search=saliency_temperature "tune.n_trials=$N_TRIALS" "$@"
else
    : "${STORAGE:?set STORAGE to an RDB URL all workers reach (sqlite is unsafe on a shared file system)}"
    WORKERS=${WORKERS:-4}
    # One Hydra job per worker, each with its own sampler seed, all on the same study.
    $PY -m grail_exp.tune -m hparams_search=saliency_temperature "tune.n_trials=$N_TRIALS" "tune.storage=$STORAGE" \
        "tune.sampler.seed=$(seq -s, 0 $((WORKERS - 1)))" hydra/launcher=submitit_slurm trainer=gpu "$@"
fi
cat results/tune/saliency_temperature/best.yaml 2>/dev/null || true
