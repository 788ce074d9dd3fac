"""``python -m grail_exp.evaluate``: a model or checkpoint on the paper's benchmarks, resumable, Pass@k with intervals.

    python -m grail_exp.evaluate model=qwen3_8b benchmark=paper eval=paper
    python -m grail_exp.evaluate model.name_or_path=outputs/train/runs/<run>/checkpoints/step-200 benchmark=paper

The evaluation itself (chunks, seeds, the completion cache, grading, tables) is grail_exp/evaluation.py, which the
training job runs on every rank too; this entry point loads the model, builds the engine and the verifier, and logs.
"""

from __future__ import annotations

import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.evaluation import (
    EvalResult,
    evaluate_benchmarks,
    evaluation_params,
    log_eval_result,
    model_fingerprint,
    write_run_files,
)


def evaluate_job(cfg: DictConfig) -> EvalResult:
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.rollout import build_engine
    from grail_exp.tracking import build_tracker
    from grail_exp.validate import validate_eval

    validate_eval(cfg)
    run_name = cfg.logger.get("run_name") or f"eval-{cfg.model.name}-{cfg.benchmark.name}-{cfg.eval.name}"
    tracker = build_tracker(cfg, run_name)
    status, verifier = "FAILED", None
    try:
        path = resolve_model_path(cfg)
        tokenizer = load_tokenizer(path, cfg)
        model = load_causal_lm(path, cfg, trainable=False)
        if cfg.get("device"):
            model = model.to(cfg.device)
        tracker.log_params({**evaluation_params(cfg, tokenizer), "model.name_or_path": path,
                            "model.revision": cfg.model.revision, "benchmark.limit": cfg.benchmark.limit})
        tracker.set_tags({"job": "evaluate", "model": cfg.model.name, "benchmark": cfg.benchmark.name})
        engine = build_engine(cfg.rollout.engine, model, tokenizer, cfg.eval.batch_size, cfg=cfg, model_path=path)
        r = cfg.reward
        verifier = MathVerifier(num_workers=r.num_workers, hard_timeout_s=r.hard_timeout_s,
                                parse_timeout=r.parse_timeout, verify_timeout=r.verify_timeout)
        t = time.perf_counter()
        result = evaluate_benchmarks(model, tokenizer, engine, verifier, cfg, desc="eval",
                                     cache_dir=Path(cfg.paths.cache_dir) / "evals",
                                     model_key=model_fingerprint(path, cfg.model.revision))
        write_run_files(result, cfg.paths.output_dir)
        log_eval_result(tracker, result, "eval", 0)
        tracker.log_metrics({"eval/seconds": time.perf_counter() - t, "eval/generated": result.generated}, step=0)
        print(result.table())
        print(f"run directory: {cfg.paths.output_dir} (samples.jsonl, summary.json)"
              + (f"; MLflow run {tracker.run_id}" if getattr(tracker, "run_id", None) else ""))
        status = "FINISHED"
        return result
    finally:
        if verifier is not None:
            verifier.close()
        tracker.end(status)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="evaluate")
def main(cfg: DictConfig) -> float | None:
    from grail_exp.errors import exit_on_user_error

    with exit_on_user_error():
        result = evaluate_job(cfg)
        metric = cfg.get("optimized_metric")
        return result.flat_metrics().get(metric) if metric else None


if __name__ == "__main__":
    main()
