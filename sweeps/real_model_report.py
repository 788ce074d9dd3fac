"""The numbers of results/real_model.md from a sweeps/real_model.sh run (and, when the run was stopped before its
final evaluation, the evaluation of its last checkpoint with the run's own protocol).

    python sweeps/real_model_report.py outputs/real_model --tag grpo_s1 [--evaluate <checkpoint dir>] \
        [--results results/real_model]

- the training curve (reward, length, step time and its phases per step) from the run's MLflow database;
- held-out accuracy before vs after, paired over problems: acc@n per problem (the run's evaluation: benchmark
  arithmetic = data.num_test fixed problems, eval.n samples at eval.temperature, the same sampling seed), the
  paired mean difference with its bootstrap interval and the exact / Monte-Carlo sign-flip p-value
  (grail_exp/analysis/stats.py compare_paired);
- the machine's 1-minute load average during the run (other jobs share the cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd


def _compose(out: Path, scheme: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.validate import validate

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment=real/smollm2_{scheme}", f"paths.root_dir={out}",
                                           f"paths.output_dir={out}/eval_after", *overrides])
    return validate(cfg)


def evaluate_checkpoint(out: Path, scheme: str, checkpoint: Path) -> pd.DataFrame:
    """The run's end-of-training evaluation (same function, config and sampling seed) on a saved checkpoint."""
    from grail_exp.evaluation import evaluate_benchmarks, write_run_files
    from grail_exp.grading.extraction import reward_rule
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.models.loading import load_causal_lm, load_tokenizer
    from grail_exp.rollout import build_engine

    cfg = _compose(out, scheme, [f"model.name_or_path={checkpoint}"])
    tok = load_tokenizer(str(checkpoint), cfg)
    policy = load_causal_lm(str(checkpoint), cfg, trainable=False)
    engine = build_engine("hf", policy, tok, cfg.rollout.generation_batch_size, cfg=cfg, model_path=str(checkpoint))
    r = cfg.reward
    with MathVerifier(num_workers=r.num_workers, hard_timeout_s=r.hard_timeout_s, parse_timeout=r.parse_timeout,
                      verify_timeout=r.verify_timeout, extraction=reward_rule(r.extraction)) as verifier:
        res = evaluate_benchmarks(policy, tok, engine, verifier, cfg, desc="eval (after)")
    write_run_files(res, out / "eval_after")
    print(res.table())
    return pd.DataFrame(res.samples)


def per_problem(samples: pd.DataFrame) -> pd.Series:
    return samples.groupby("problem_index")["correct"].mean().sort_index()


def markdown(df) -> str:
    """A DataFrame as a Markdown table (without pandas' optional tabulate dependency)."""
    cols = [df.index.name or ""] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for idx, row in df.iterrows():
        cells = [str(idx)] + [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tag", default="grpo_s1")
    ap.add_argument("--evaluate", type=Path, default=None, help="a checkpoint to evaluate as the 'after' model")
    ap.add_argument("--results", type=Path, default=Path("results/real_model"))
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient

    from grail_exp.analysis.stats import compare_paired

    scheme = args.tag.split("_s")[0]
    client = MlflowClient(f"sqlite:///{args.out}/results/mlflow.db")
    exp = client.get_experiment_by_name("grail_exp")
    run = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)[-1]
    rid = run.info.run_id
    args.results.mkdir(parents=True, exist_ok=True)

    # ---- curve and step time
    keys = ["reward/mean", "completions/mean_length", "completions/truncated_rate", "frac_reward_zero_std", "loss",
            "grad_norm", "entropy", "timing/rollout_s", "timing/scoring_s", "timing/old_logp_s",
            "timing/scheme_prepare_s", "timing/scheme_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s"]
    cols = {}
    for k in keys:
        h = client.get_metric_history(rid, k)
        if h:
            cols[k] = pd.Series({m.step: m.value for m in h})
    curve = pd.DataFrame(cols).sort_index()
    curve.index.name = "step"
    curve.to_csv(args.results / f"curve_{args.tag}.csv")

    # ---- before / after, paired over problems
    local = Path(client.download_artifacts(rid, "eval/before/samples.parquet", str(args.out)))
    before = per_problem(pd.read_parquet(local))
    final = [a.path for a in client.list_artifacts(rid, "eval/final")]
    if args.evaluate is not None:
        after = per_problem(evaluate_checkpoint(args.out, scheme, args.evaluate))
    elif "eval/final/samples.parquet" in final:
        path = client.download_artifacts(rid, "eval/final/samples.parquet", str(args.out))
        after = per_problem(pd.read_parquet(path))
    else:
        raise SystemExit("no final evaluation in the run: pass --evaluate <checkpoint dir>")
    assert list(before.index) == list(after.index), "before / after must be the same problems"
    diff = (after - before).to_numpy()[None, :]
    res = compare_paired({"arithmetic": diff}, n_boot=10_000, seed=0)
    table = {"problems": int(before.size), "acc_before": float(before.mean()), "acc_after": float(after.mean()),
             "delta": res.delta, "ci95": [res.lo, res.hi], "p_sign_flip": res.p_value, "p_method": res.p_method,
             "problems_up": int((diff > 0).sum()), "problems_down": int((diff < 0).sum())}

    # ---- load during the run
    load = np.loadtxt(args.out / f"load_{args.tag}.log", usecols=(1,))
    table["load_1min"] = {"mean": float(load.mean()), "min": float(load.min()), "max": float(load.max()),
                          "samples": int(load.size)}
    table["steps"] = int(curve.index.max()) if len(curve) else 0
    table["run_id"] = rid
    (args.results / f"summary_{args.tag}.json").write_text(json.dumps(table, indent=2))
    print(json.dumps(table, indent=2))
    print(markdown(curve))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(curve.index, curve["reward/mean"], marker="o", label="train reward (T 1.0)")
    ax[0].axhline(table["acc_before"], color="gray", ls="--", label="held-out acc before (T 0.6)")
    ax[0].axhline(table["acc_after"], color="C2", ls="--", label="held-out acc after")
    ax[0].set_xlabel("step"), ax[0].set_ylim(0, 1), ax[0].legend(fontsize=7)
    phases = [k for k in ("timing/rollout_s", "timing/scoring_s", "timing/scheme_s", "timing/update_s") if k in curve]
    curve[phases].plot.bar(stacked=True, ax=ax[1], width=0.8)
    ax[1].set_ylabel("seconds"), ax[1].legend([p.split("/")[1] for p in phases], fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, {scheme}, 2 shared CPU cores")
    fig.tight_layout()
    fig.savefig(args.results / f"curve_{args.tag}.png", dpi=110)


if __name__ == "__main__":
    main()
