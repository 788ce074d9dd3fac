"""``python -m grail_exp.run``: validate → build → train → evaluate → return the objective.

    python -m grail_exp.run                                   # embedded default, a few minutes on a CPU
    python -m grail_exp.run advantage=grpo trainer.max_steps=2
    python -m grail_exp.run model=qwen3_8b trainer=gpu        # a hub model on a GPU node

The return value is ``optimized_metric`` of the final evaluation (e.g. ``eval/arithmetic/acc``), so
Hydra sweepers and Optuna can optimise it.
"""

from __future__ import annotations

import json
import logging
import os
import math
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import ConfigError, register_configs, validate

log = logging.getLogger("grail_exp")
register_configs()
# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; harmless, and noise in every run's output.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def _quiet_lightning() -> None:
    """Lightning's INFO lines (GPU/TPU availability, tips) repeat through Hydra's root handler; keep warnings.
    Call after importing lightning: its import sets its loggers to INFO."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)


def default_run_name(cfg: DictConfig) -> str:
    return cfg.logger.get("run_name") or f"{cfg.model.name}-{cfg.advantage.name}-seed{cfg.seed}"


def train(cfg: DictConfig, on_eval=None) -> dict:
    """The whole job; returns the final metrics (flat dict) plus phase timings.

    ``on_eval(step, metrics)`` is called after each in-training evaluation (every ``trainer.eval_every`` steps)
    with its flat metrics; it may raise ``errors.RunStopped`` to end the run early (Optuna pruning)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from grail_exp.advantages import build_scheme
    from grail_exp.data import build_source
    from grail_exp.embedded import read_build_report
    from grail_exp.evaluate import evaluate_benchmarks, log_eval_result
    from grail_exp.extraction import reward_rule
    from grail_exp.loss import build_terms
    from grail_exp.models import count_parameters, load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.module import GRPOModule, Preempted
    from grail_exp.rewards import MathVerifier
    from grail_exp.rollout import build_engine
    from grail_exp.distributed import build_strategy, launch_rank
    from grail_exp.tracking import NullTracker, build_tracker

    from grail_exp.checkpoint import load_training_state, resolve_resume, save_checkpoint, save_weights
    from grail_exp.errors import RunStopped

    _quiet_lightning()

    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    # Resume first (cheap): its state names the MLflow run to continue.
    ckpt_root = Path(cfg.paths.output_dir) / "checkpoints"
    ckpt = resolve_resume(cfg.get("resume"), ckpt_root)
    state = load_training_state(ckpt) if ckpt else None
    # Data parallelism: every rank runs this function (Lightning re-launches the command, or torchrun / srun did);
    # only rank 0 tracks, evaluates and writes files. Children of Lightning's launcher learn their rank from it.
    rank = launch_rank()
    os.environ["GRAIL_EXP_DEVICES_PER_NODE"] = str(cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1)
    # Tracking next: an unreachable server fails before minutes of model building.
    tracker = build_tracker(cfg, default_run_name(cfg), run_id=state.get("mlflow_run_id") if state else None) \
        if rank == 0 else NullTracker()
    status = "FAILED"
    verifier = None
    try:
        if state is None:
            resolved = OmegaConf.to_container(cfg, resolve=True)
            tracker.log_params({k: v for k, v in resolved.items() if k not in ("paths",)})
            tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config/resolved.yaml")
            tracker.set_tags({"model": cfg.model.name, "advantage": cfg.advantage.name, "seed": cfg.seed,
                              "task_name": cfg.task_name, "output_dir": cfg.paths.output_dir})
        else:
            log.info("resuming from %s (step %d)", ckpt, state["step"])
            tracker.set_tags({f"resumed_at_step_{state['step']}": str(ckpt)})
            tracker.log_text(OmegaConf.to_yaml(cfg, resolve=True), f"config/resolved_resume_step{state['step']}.yaml")

        model_path = resolve_model_path(cfg)
        phases["model_build_s"] = time.perf_counter() - t0
        report = read_build_report(model_path)
        if report and report.get("warm_start") and state is None:
            ws = report["warm_start"]
            tracker.log_params({"warm_start.steps": ws["steps"], "warm_start.greedy_val_accuracy": ws["greedy_val_accuracy"],
                                "warm_start.seconds": round(ws["seconds"], 1), "model.path": model_path})
        policy_path = str(ckpt) if ckpt else model_path  # the reference model always comes from the start
        tokenizer = load_tokenizer(policy_path, cfg)
        # trainer=fsdp keeps fp32 sharded parameters (the master weights) and computes in model.dtype.
        policy_cfg = OmegaConf.merge(cfg, {"model": {"dtype": "float32"}}) if cfg.trainer.strategy == "fsdp" else cfg
        policy = load_causal_lm(policy_path, policy_cfg, trainable=True)
        terms = build_terms(cfg.loss.get("terms"), tokenizer, cfg.model)
        needs_ref = cfg.loss.beta > 0 or any(t.needs_reference for t in terms) \
            or cfg.loss.kl_in_reward.enabled  # GRPO family (issue 15): KL-in-reward needs the reference too
        ref_model = load_causal_lm(model_path, cfg, trainable=False) if needs_ref else None
        log.info("policy %s: %.2f M parameters", policy_path, count_parameters(policy) / 1e6)

        scheme = build_scheme(cfg.advantage, tokenizer, {"model": cfg.model, "seed": cfg.seed, "data": cfg.data})
        engine = build_engine(cfg.rollout.engine, policy, tokenizer, cfg.rollout.generation_batch_size,
                              cfg=cfg, model_path=policy_path)
        r = cfg.reward
        verifier = MathVerifier(num_workers=r.num_workers, hard_timeout_s=r.hard_timeout_s,
                                parse_timeout=r.parse_timeout, verify_timeout=r.verify_timeout,
                                extraction=reward_rule(r.extraction))  # evaluation passes benchmark.extraction
        source = build_source(cfg.data, seed=cfg.seed, prompts_per_step=cfg.trainer.prompts_per_step)

        results: dict[str, float] = {}
        eval_tables: dict[str, str] = {}

        def run_eval(tag: str, step: int) -> dict[str, float]:
            t = time.perf_counter()
            if cfg.rollout.engine == "vllm":
                engine.sync_weights(policy)  # vLLM holds its own copy: evaluate the weights trained so far
            res = evaluate_benchmarks(policy, tokenizer, engine, verifier, cfg, desc=f"eval ({tag})")
            log_eval_result(tracker, res, tag, step)
            phases[f"eval_{tag}_s"] = phases.get(f"eval_{tag}_s", 0.0) + time.perf_counter() - t
            eval_tables[tag] = res.table()
            log.info("evaluation (%s, step %d):\n%s", tag, step, eval_tables[tag])
            return res.flat_metrics()

        if cfg.trainer.eval_before_training and state is None and rank == 0:
            before = run_eval("before", 0)
            results.update({k.replace("eval/", "eval_before/", 1): v for k, v in before.items()})

        def eval_during_training(step: int) -> None:
            metrics = run_eval(f"step{step}", step)
            if on_eval is not None:
                on_eval(step, metrics)

        module = GRPOModule(cfg, policy, tokenizer, scheme, engine, source, verifier, tracker, ref_model,
                            evaluate_fn=eval_during_training, resume_state=state, terms=terms)
        saved_at = {int(state["step"])} if state else set()

        def checkpoint(position: dict) -> None:
            if module.step in saved_at:
                return
            state_now = module.state_for_checkpoint(position)  # every rank: gathers the ranks' RNG / buffers
            weights = module.model_state_for_checkpoint()  # trainer=fsdp: the full state dict (collective)
            saved_at.add(module.step)
            if module.rank == 0:
                path = save_checkpoint(ckpt_root, module.step, policy, tokenizer, state_now,
                                       keep_last=cfg.trainer.keep_last_checkpoints, state_dict=weights)
                log.info("checkpoint: %s", path)
            module.barrier()

        module.checkpoint_fn = checkpoint

        # Weights-only trajectory (RELEX's input): θ_0 now, every k steps (module), and the last step.
        traj_root = Path(cfg.paths.output_dir) / "trajectory"
        traj_saved: set[int] = set()

        def save_trajectory(step: int) -> None:
            if step in traj_saved:
                return
            weights = module.model_state_for_checkpoint()  # trainer=fsdp: the full state dict (collective)
            traj_saved.add(step)
            if module.rank == 0:
                save_weights(traj_root, step, policy, tokenizer, state_dict=weights)
            module.barrier()

        if cfg.trainer.save_weights_only_every:
            module.weights_fn = save_trajectory
            if state is None and rank == 0:  # before fit: nothing is sharded and no process group exists yet
                traj_saved.add(0)
                save_weights(traj_root, 0, policy, tokenizer)
        rounds = -(-cfg.trainer.max_steps // cfg.loss.num_iterations)  # ceil: μ optimiser steps per rollout
        start_round = int(state["round"]) if state else 0
        trainer = L.Trainer(
            accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
            strategy=build_strategy(cfg), precision=cfg.trainer.precision, max_steps=-1, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
            deterministic=cfg.trainer.deterministic, default_root_dir=cfg.paths.output_dir,
            use_distributed_sampler=False,  # every rank walks the same rounds; the module splits the prompts
        )
        t = time.perf_counter()
        with _stop_on_sigterm(module):
            trainer.fit(module, train_dataloaders=DataLoader(range(start_round, rounds), batch_size=None, shuffle=False))
        phases["train_s"] = time.perf_counter() - t
        if module.last_metrics:
            results.update({f"train/{k}": v for k, v in module.last_metrics.items()})
        if cfg.trainer.save_final_checkpoint:
            checkpoint(module.position)
        if cfg.trainer.save_weights_only_every:
            save_trajectory(module.step)

        rank = module.rank  # the process group exists now
        if cfg.trainer.eval_at_end and rank == 0:
            results.update(run_eval("final", module.step))
        phases["total_s"] = time.perf_counter() - t0
        tracker.log_metrics({f"phase/{k}": v for k, v in phases.items()}, step=module.step)
        results.update({f"phase/{k}": v for k, v in phases.items()})
        results["train/steps"] = module.step
        if rank == 0:
            from grail_exp.plots import log_training_plots

            # Training curves + weight plots (from <run dir>/weights) under plots/ of the run; never fatal.
            log_training_plots(tracker, Path(cfg.paths.output_dir), label=cfg.advantage.name)
            _write_summary(cfg, results, eval_tables, tracker)
        status = "FINISHED"
        return results
    except (Preempted, RunStopped):
        status = "KILLED"
        raise
    except BaseException:
        import traceback

        try:  # the traceback goes with the run: a failed sweep job is diagnosable from MLflow alone
            tracker.log_text(traceback.format_exc(), "error/traceback.txt")
        except Exception:
            pass
        raise
    finally:
        if verifier is not None:
            verifier.close()
        tracker.end(status)


@contextmanager
def _stop_on_sigterm(module):
    """SIGTERM (what SLURM sends before preemption), and submitit's USR2 in its jobs, finish the current step,
    checkpoint and stop (grail_exp/preemption.py)."""
    from grail_exp.preemption import stop_signals

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        log.warning("%s received: finishing the current optimiser step, then checkpointing",
                    signal.Signals(signum).name)
        module.stop_requested = True

    previous = {sig: signal.signal(sig, handler) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def _write_summary(cfg: DictConfig, results: dict, tables: dict, tracker) -> None:
    """``<run dir>/metrics.json`` and a readable before/after report on the console."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"run_id": getattr(tracker, "run_id", None), "metrics": results, "tables": tables}
    (out / "metrics.json").write_text(json.dumps(payload, indent=2, default=float))
    lines = [f"run directory: {out}"]
    if getattr(tracker, "run_id", None):
        lines.append(f"MLflow run: {tracker.run_id} ({cfg.logger.experiment_name})")
        experiment_id = getattr(tracker, "experiment_id", None)
        if experiment_id is not None:
            from grail_exp.tracking import training_view_url

            lines.append(f"MLflow view: {training_view_url(tracker.tracking_uri, experiment_id, tracker.run_id)}")
    metric = cfg.optimized_metric
    if metric and metric in results:
        before = results.get(metric.replace("eval/", "eval_before/", 1))
        msg = f"{metric}: {results[metric]:.3f}"
        if before is not None:
            msg += f" (before training: {before:.3f}, change {results[metric] - before:+.3f})"
        lines.append(msg)
    timing = ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in results.items() if k.startswith("phase/") and k.endswith("_s"))
    lines.append(f"phases: {timing.replace('phase/', '')}")
    print("\n".join(lines), flush=True)


def run(cfg: DictConfig, on_eval=None) -> float | None:
    """Validate, train, evaluate; return ``cfg.optimized_metric`` (None if unset). ``on_eval``: see ``train``."""
    validate(cfg)
    results = train(cfg, on_eval=on_eval)
    metric = cfg.get("optimized_metric")
    if not metric:
        return None
    if metric not in results:
        log.warning("optimized_metric %s was not produced (trainer.eval_at_end=%s): returning None",
                    metric, cfg.trainer.eval_at_end)
        return None
    return float(results[metric])


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    from grail_exp.errors import exit_on_user_error
    from grail_exp.module import Preempted

    if _is_multirun():
        # Task wrapper: in a sweep one failed job is recorded (MLflow status FAILED + traceback artifact,
        # logged by train()) and the sweep goes on; the objective of a failed job is NaN.
        try:
            return run(cfg)
        except Preempted:
            from grail_exp.preemption import hand_back_to_submitit

            hand_back_to_submitit()  # in a submitit job: requeued with resume=auto; this process exits here
            log.error("job preempted after its checkpoint; rerun it with resume=auto in %s", cfg.paths.output_dir)
            return math.nan
        except Exception as exc:
            log.error("job failed (the sweep continues): %s: %s", type(exc).__name__, exc)
            return math.nan
    try:
        with exit_on_user_error():
            return run(cfg)
    except Preempted as exc:
        print(f"preempted: {exc}. Resume with: python -m grail_exp.run <same overrides> "
              f"hydra.run.dir={cfg.paths.output_dir} resume=auto", file=sys.stderr, flush=True)
        sys.exit(143)


if __name__ == "__main__":
    main()
