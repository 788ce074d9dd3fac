#!/usr/bin/env bash
# RELEX on the embedded default (docs/notes/relex.md): train the default GRAIL run keeping every step's weights, observe
# its first 10-50 % of steps, extrapolate each cut to the last step (rank 1, linear fit: the paper's setting),
# and evaluate every model with one evaluation config (eval=quick, the 256 held-out arithmetic problems).
# Prints the table of results/relex.md and writes it to <EV>/table.md.
#   bash sweeps/relex_demo.sh [extra training overrides]
#   RUN=<run dir> bash sweeps/relex_demo.sh        reuses a run whose trajectory/step-$STEPS exists
# Knobs (env): STEPS (150, the default run), CUTS ("15 30 45 75"), RECON (45), EV (<run>/../relex), PY (.venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RUN=${RUN:-outputs/relex_demo/run}
STEPS=${STEPS:-150}
CUTS=${CUTS:-"15 30 45 75"}
RECON=${RECON:-45}   # the cut whose rank-1 directions the real final delta is projected on
EV=${EV:-$(dirname "$RUN")/relex}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$EV"
TIMES=$EV/times.tsv
timed() {  # timed <name> <command...>: run it and append "<name> <seconds>" to $TIMES
  local name=$1 t=$SECONDS
  shift
  "$@"
  echo "$name $((SECONDS - t))" >> "$TIMES"
}

if [ ! -e "$RUN/trajectory/step-$STEPS/COMPLETE" ]; then
  timed train $PY -m grail_exp.run trainer.max_steps="$STEPS" trainer.save_weights_only_every=1 logger=none \
      hydra.run.dir="$RUN" "$@"
fi

MODELS="step-0=$RUN/trajectory/step-0 step-$STEPS=$RUN/trajectory/step-$STEPS"
for c in $CUTS; do
  timed "relex-$c" $PY -m grail_exp.extrapolate trajectory="$RUN/trajectory" observe.max_step="$c" \
      target_step="$STEPS" output="$EV/relex-$c" overwrite=true progress=false hydra.run.dir="$EV/logs/relex-$c"
  MODELS="$MODELS step-$c=$RUN/trajectory/step-$c relex-$c=$EV/relex-$c"
done
# Finding 1 of the paper, on this run: the real final delta projected on the rank-1 directions of steps 1..RECON
timed "reconstruct" $PY -m grail_exp.extrapolate trajectory="$RUN/trajectory" mode=reconstruct observe.max_step="$RECON" \
    target_step="$STEPS" output="$EV/reconstruct" overwrite=true progress=false hydra.run.dir="$EV/logs/reconstruct"
MODELS="$MODELS reconstruct=$EV/reconstruct"

for m in $MODELS; do
  name=${m%%=*} dir=${m#*=}
  timed "eval-$name" $PY -m grail_exp.evaluate model.name_or_path="$dir" logger=none hydra.run.dir="$EV/eval/$name"
done

$PY - "$EV" "$STEPS" "$CUTS" "$RECON" <<'EOF'
import json, sys
from pathlib import Path

ev, steps, cuts, recon = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]
times = dict(line.split() for line in (ev / "times.tsv").read_text().splitlines())


def acc(name):
    s = json.loads((ev / "eval" / name / "summary.json").read_text())["arithmetic"]
    a, p = s["acc"], s["pass_at_k"][str(max(int(k) for k in s["pass_at_k"]))]
    return f"{100 * a['value']:.1f} [{100 * a['lo']:.1f}, {100 * a['hi']:.1f}]", f"{100 * p['value']:.1f}"


def relex(name):
    return json.loads((ev / name / "relex.json").read_text())


rows = [("step-0 (θ_0, warm start)", "step-0", "", "1", "")]
for c in cuts:
    r = relex(f"relex-{c}")
    va, e = r["vs_actual"], r["explained_variance"]
    rows.append((f"step-{c} (last observed, {100 * int(c) / steps:.0f} %)", f"step-{c}", "",
                 f"{va['last_observed_relative_error']:.3f}", ""))
    rows.append((f"RELEX from steps 1-{c} -> {steps}", f"relex-{c}", f"{e['param_weighted']:.3f}",
                 f"{va['relative_error']:.3f}", times.get(f"relex-{c}", "")))
r = relex("reconstruct")
rows.append((f"step-{steps} projected on the rank-1 directions of steps 1-{recon}", "reconstruct",
             f"{r['explained_variance']['param_weighted']:.3f}", f"{r['vs_actual']['relative_error']:.3f}",
             times.get("reconstruct", "")))
rows.append((f"step-{steps} (the real end of the run)", f"step-{steps}", "", "0", ""))
lines = ["| model | acc@4 [95 % CI] | pass@4 | rank-1 explained variance (param-weighted) | "
         f"‖θ − θ_{steps}‖ / ‖θ_{steps} − θ_0‖ | extrapolate (s) | eval (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
for label, name, ev_, err, t in rows:
    a, p = acc(name)
    lines.append(f"| {label} | {a} | {p} | {ev_} | {err} | {t} | {times.get('eval-' + name, '')} |")
table = "\n".join(lines) + "\n"
(ev / "table.md").write_text(table)
print(table)
print(f"training: {times.get('train', 'reused')} s; table also in {ev / 'table.md'}")
EOF
