"""The whole training job behind ``python -m grail_exp.run``: validate → build the parts → train → evaluate → summary.

``train(cfg)`` reads as its steps: resume point, tracking, the parts (model, tokenizer, scheme, verifier, data, and
how to build the rollout engine), the Lightning fit of ``RLVRModule`` — which builds the engine once the process
group exists, evaluates before training, trains, then writes the final checkpoint and evaluates at the end, all
inside the fit, while the policy is on its device, through the job's ``TrainingHooks`` — then plots and summary.
``run(cfg)`` adds validation and returns ``optimized_metric`` (for sweeps and Optuna).

Data parallelism: every rank runs this function (Lightning re-launches the command, or torchrun / srun did). Every
rank samples its own prompts, holds its own engine (vLLM: one per rank, inside the job's process group) and evaluates
its share of the benchmark chunks; rank 0 gathers the evaluations, tracks and writes files (docs/recipes-card.md,
"the card's layout, rank by rank").
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from grail_exp.errors import Preempted, RunStopped, StoppedBySignal
from grail_exp.validate import validate

if TYPE_CHECKING:
    from grail_exp.training.module import Parts

log = logging.getLogger("grail_exp")


def run(cfg: DictConfig, on_eval=None) -> float | None:
    """Validate, train, evaluate; return ``cfg.optimized_metric`` (None if unset). ``on_eval``: see ``train``."""
    from grail_exp.distributed import export_local_rank

    export_local_rank()  # srun: before validate() plans against this rank's device (grail_exp/memory/nvml.py)
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


def train(cfg: DictConfig, on_eval: Callable | None = None) -> dict:
    """The whole job; returns the final metrics (flat dict) plus phase timings.

    ``on_eval(step, metrics)`` is called after each in-training evaluation (every ``trainer.eval_every`` steps)
    with its flat metrics; it may raise ``errors.RunStopped`` to end the run early (Optuna pruning).

    A stop signal before the first optimiser step raises ``errors.StoppedBySignal`` at once; during training, the
    ranks stop together after a step with its checkpoint (``errors.Preempted``): ``stop_signals``."""
    with stop_signals():
        return _train(cfg, on_eval)


@contextmanager
def stop_signals():
    """The job's stop signals from its first line to its last (grail_exp/preemption.py: what each signal does in each
    phase). A rank started by a parent grail_exp process (Lightning's launcher, the preflight) dies with it."""
    from grail_exp.preemption import StopSignals, follow_parent

    follow_parent()
    stops = StopSignals().install()
    try:
        yield stops
    except BaseException as exc:
        if stops.stopped_by and not isinstance(exc, StoppedBySignal):
            # The way out of a stop before training failed on the way (Lightning's teardown of a rank's empty
            # skeleton, a peer's store gone): it is still that stop, with its line and exit code.
            raise StoppedBySignal(stops.stopped_by, stops.stage) from exc
        raise
    finally:
        stops.uninstall()


def _train(cfg: DictConfig, on_eval: Callable | None) -> dict:
    from grail_exp.analysis import study
    from grail_exp.preemption import set_stage
    from grail_exp.training.module import RLVRModule

    _quiet_lightning()
    done = study.finished(cfg)  # a restarted study: this arm is already recorded with this configuration
    if done is not None:
        log.info("study: arm %s already finished (run %s); skipping it", study.arm_name(cfg), done.get("run_id"))
        return dict(done["metrics"])
    phases, t0 = {}, time.perf_counter()
    ckpt, state, tracker = _start(cfg)
    status, parts, module = "FAILED", None, None
    try:
        _log_start(cfg, tracker, state, ckpt)
        set_stage("loading the model")
        parts = build_parts(cfg, ckpt, state, tracker, phases, t0)
        saver = Saver(cfg, parts, state)
        hooks = TrainingHooks(cfg, Evaluator(cfg, parts, tracker, phases, on_eval), saver, phases, state)
        module = RLVRModule(cfg, parts, tracker, hooks, resume_state=state)
        saver.save_start(module)
        t = time.perf_counter()
        fit(cfg, module, state)
        # training proper: the fit less the engine's start, the evaluation before it and the closing (own phases)
        phases["train_s"] = (phases.pop("closing_started", time.perf_counter()) - t - phases.get("eval_before_s", 0.0)
                             - phases.get("engine_build_s", 0.0))
        finish(cfg, module, tracker, phases, t0, hooks.evaluator.tables, hooks.results, parts.start_sha256)
        status = "FINISHED"
        return hooks.results
    except (Preempted, RunStopped, StoppedBySignal):
        status = "KILLED"
        raise
    except BaseException:
        _log_traceback(tracker)
        raise
    finally:
        try:
            if parts is not None:
                parts.verifier.close()
            tracker.end(status)
        finally:
            teardown(module)


def _start(cfg: DictConfig):
    """Threads and seeds, the resume point, this rank's place, then tracking (an unreachable server fails before
    minutes of model building) and a study's record of this segment: (checkpoint, its state, tracker)."""
    import lightning as L
    import torch

    from grail_exp.analysis import study
    from grail_exp.distributed import export_local_rank, launch_rank
    from grail_exp.tracking import NullTracker, build_tracker

    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt, state = _resume_point(cfg)  # cheap, first: its state names the MLflow run to continue
    export_devices_per_node(cfg.trainer)  # before launch_rank reads it: node k's ranks start at k x devices
    export_local_rank()  # srun: before DeepSpeed or the engine read it
    rank = launch_rank()
    tracker = build_tracker(cfg, default_run_name(cfg), run_id=state.get("mlflow_run_id") if state else None) \
        if rank == 0 else NullTracker()
    if cfg.study.dir and rank == 0:  # this segment's code, recorded before it trains (analysis/study.py)
        study.record_segment(cfg, Path(cfg.paths.output_dir), int(state["step"]) if state else 0)
    return ckpt, state, tracker


def _log_traceback(tracker) -> None:
    """The traceback goes with the run: a failed sweep job is diagnosable from MLflow alone."""
    import traceback

    try:
        tracker.log_text(traceback.format_exc(), "error/traceback.txt")
    except Exception:
        pass


def teardown(module) -> None:
    """The job's last act on every rank, on every path (finished, stopped, failed): close the rollout engine (vLLM:
    its executor and memory; its in-process shutdown also tears down the distributed state it set up), then destroy
    the process group if one is left. A job that exits with a live NCCL communicator leaves its destruction to the
    interpreter's exit, where it can abort or hang — and SLURM then records a finished job as FAILED; Lightning does not
    destroy the group it created. A failure here is logged, never raised over the job's own outcome."""
    import torch.distributed as dist

    engine = getattr(getattr(module, "rollout", None), "engine", None)
    close = getattr(engine, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - the group still has to go
            log.warning("closing the rollout engine failed: %s: %s", type(exc).__name__, exc)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            log.warning("destroying the process group failed: %s: %s", type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------------- the steps
def default_run_name(cfg: DictConfig) -> str:
    return cfg.logger.get("run_name") or f"{cfg.model.name}-{cfg.advantage.name}-seed{cfg.seed}"


def export_devices_per_node(trainer_cfg) -> None:
    """The ranks per node, for ``distributed.launch_rank`` in the processes Lightning's launcher spawns (global rank
    = node rank x ranks per node + local rank): a count or a list of device ids (``world.devices_per_node``)."""
    from grail_exp.world import devices_per_node

    os.environ["GRAIL_EXP_DEVICES_PER_NODE"] = str(devices_per_node(trainer_cfg.devices))


def _quiet_lightning() -> None:
    """Lightning's INFO lines (GPU/TPU availability, tips) repeat through Hydra's root handler; keep warnings.
    Lightning is imported first: its import sets its loggers to INFO."""
    import lightning  # noqa: F401
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _resume_point(cfg: DictConfig):
    """(checkpoint directory, its shared training state) for ``resume=...``, or (None, None) for a fresh run. Refuses,
    before any model loads, a checkpoint this world size cannot resume."""
    from grail_exp.checkpoint import load_training_state, resolve_resume
    from grail_exp.training.state import check_resume_world

    ckpt = resolve_resume(cfg.get("resume"), Path(cfg.paths.output_dir) / "checkpoints")
    if ckpt is None:
        return None, None
    state = load_training_state(ckpt)
    state["checkpoint_dir"] = str(ckpt)  # where this rank's own part and the shards are read from
    check_resume_world(state, ckpt, cfg.trainer)
    return ckpt, state


def _log_start(cfg: DictConfig, tracker, state: dict | None, ckpt) -> None:
    """The run's parameters, resolved config and tags (a fresh run), or a resume marker."""
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


def build_parts(cfg: DictConfig, ckpt, state: dict | None, tracker, phases: dict, t0: float) -> Parts:
    """Model (built or downloaded: ``phases["model_build_s"]``), tokenizer, policy and reference, loss terms, scheme,
    rollout engine, verifier, data."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import share_prompts_of
    from grail_exp.data import build_source
    from grail_exp.distributed import launch_rank
    from grail_exp.grading.extraction import reward_rule
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.loss import build_terms, needs_reference
    from grail_exp.models.embedded import read_build_report
    from grail_exp.models.loading import count_parameters, load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.rollout import build_engine
    from grail_exp.training.backends import BACKENDS
    from grail_exp.training.module import Parts

    model_path = resolve_model_path(cfg)
    phases["model_build_s"] = time.perf_counter() - t0
    report = read_build_report(model_path)
    if report and report.get("warm_start") and state is None:
        ws = report["warm_start"]
        tracker.log_params({"warm_start.steps": ws["steps"], "warm_start.greedy_val_accuracy": ws["greedy_val_accuracy"],
                            "warm_start.seconds": round(ws["seconds"], 1), "model.path": model_path})
    start_sha256 = None
    if cfg.study.dir or cfg.trainer.eval_cache:
        from grail_exp.models.architectures import weights_sha256

        start_sha256 = weights_sha256(model_path)
        if state is None:
            tracker.log_params({"start_weights.sha256": start_sha256})
    from grail_exp.checkpoint import has_hf_weights
    from grail_exp.models import lora

    # The reference model always comes from the start; the policy too when the checkpoint keeps its weights only in
    # shards (FSDP without trainer.export_hf_weights), which the backend loads over it on resume, and under peft=lora,
    # whose checkpoints hold the adapter (loaded onto the start's frozen base).
    policy_path = str(ckpt) if ckpt and has_hf_weights(ckpt) and not lora.enabled(cfg) else model_path
    adapter_dir = str(ckpt) if ckpt and lora.enabled(cfg) else None
    tokenizer = load_tokenizer(policy_path, cfg)
    backend = BACKENDS[str(cfg.trainer.strategy)]
    policy_cfg = OmegaConf.merge(cfg, backend.policy_overrides(cfg))
    # Only rank 0 of a multi-rank run reads the weights; the others build meta skeletons and receive them once the
    # process group exists (the backend's configure_model): one host copy per node, not one per rank.
    weights = launch_rank() == 0 or not backend.weights_from_rank0(cfg)
    policy = load_causal_lm(policy_path, policy_cfg, trainable=True, weights=weights, adapter_dir=adapter_dir)
    terms = build_terms(cfg.loss.get("terms"), tokenizer, cfg.model)
    # Under peft=lora the reference is the policy with its adapters off (training/rollout.py): nothing more to load.
    ref_model = load_causal_lm(model_path, cfg, trainable=False, weights=weights) \
        if needs_reference(cfg, terms) and not lora.enabled(cfg) else None
    log.info("policy %s: %.2f M parameters", policy_path, count_parameters(policy) / 1e6)
    scheme = build_scheme(cfg.advantage, tokenizer, {"model": cfg.model, "seed": cfg.seed, "data": cfg.data,
                                                     "share_prompts": share_prompts_of(cfg)})

    def engine_factory():  # called by every rank in the module's setup, once the process group exists
        from grail_exp.preemption import set_stage

        set_stage("building the rollout engine")
        t = time.perf_counter()
        engine = build_engine(cfg.rollout.engine, policy, tokenizer, cfg.rollout.generation_batch_size, cfg=cfg,
                              model_path=policy_path, push_policy=False)  # synced before every rollout / evaluation
        phases["engine_build_s"] = time.perf_counter() - t
        return engine

    r = cfg.reward
    verifier = MathVerifier(num_workers=r.num_workers, hard_timeout_s=r.hard_timeout_s, parse_timeout=r.parse_timeout,
                            verify_timeout=r.verify_timeout,
                            extraction=reward_rule(r.extraction))  # evaluation passes benchmark.extraction
    source = build_source(cfg.data, seed=cfg.seed, prompts_per_step=cfg.trainer.prompts_per_step)
    return Parts(policy, tokenizer, scheme, source, verifier, ref_model, terms, engine_factory=engine_factory,
                 model_path=model_path, policy_path=policy_path, start_sha256=start_sha256)


class Evaluator:
    """Benchmark evaluations of the live policy (before, during and after training), logged and kept as tables.

    Runs on every rank (a collective): the engine gets the current weights from the update backend, each rank
    generates and grades its share of the benchmark chunks (``evaluate.evaluate_benchmarks``), every rank receives
    the gathered result, rank 0 logs it."""

    def __init__(self, cfg: DictConfig, parts: Parts, tracker, phases: dict, on_eval: Callable | None):
        self.cfg, self.parts, self.tracker, self.phases, self.on_eval = cfg, parts, tracker, phases, on_eval
        self.tables: dict[str, str] = {}

    def __call__(self, module, tag: str, step: int) -> dict[str, float]:
        """Evaluate ``module``'s policy (its engine, built in setup, and its update backend) at ``step``."""
        from grail_exp import world
        from grail_exp.evaluation import evaluate_benchmarks, log_eval_result
        from grail_exp.preemption import set_stage
        from grail_exp.rollout.base import release
        from grail_exp.training import probe_points

        set_stage(f"the evaluation ({tag})")  # named by a stop before training: the evaluation before it
        t = time.perf_counter()
        p, m = self.parts, module
        engine, backend = m.rollout.engine, m.backend
        backend.sync_engine(engine)  # vLLM holds its own copy (and may sleep): evaluate the weights trained so far
        with backend.generation(engine):
            res = evaluate_benchmarks(p.policy, p.tokenizer, engine, p.verifier, self.cfg, desc=f"eval ({tag})",
                                      **self._cache(tag, step))
        release(engine)  # sleep mode: the engine's memory goes back to training until the next sync
        probe_points.emit("evaluated", module=m, tag=tag, result=res)
        self.phases[f"eval_{tag}_s"] = self.phases.get(f"eval_{tag}_s", 0.0) + time.perf_counter() - t
        self.tables[tag] = res.table()
        if world.rank() == 0:
            log_eval_result(self.tracker, res, tag, step)
            self._write(res, tag)
            log.info("evaluation (%s, step %d):\n%s", tag, step, self.tables[tag])
        return res.flat_metrics()

    def _cache(self, tag: str, step: int) -> dict:
        """``trainer.eval_cache``: "before" is keyed by the starting weights (shared by every run starting from them),
        later evaluations by this run directory and step (a killed one continues after resume=auto)."""
        cfg = self.cfg
        if not cfg.trainer.eval_cache:
            return {}
        if tag == "before":
            m = cfg.model
            key = f"start-weights-sha256:{self.parts.start_sha256}|dtype:{m.dtype}|attn:{m.attn_implementation}"
            return {"cache_dir": Path(cfg.paths.cache_dir) / "evals", "model_key": key}
        key = f"run-dir:{Path(cfg.paths.output_dir).resolve()}|step:{step}|tag:{tag}"
        return {"cache_dir": Path(cfg.paths.output_dir) / "eval_cache", "model_key": key}

    def _write(self, res, tag: str) -> None:
        """``<run dir>/eval/<tag>/samples.parquet`` and ``summary.json``: a study records its arms from these."""
        import pandas as pd

        out = Path(self.cfg.paths.output_dir) / "eval" / tag
        out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(res.samples).to_parquet(out / "samples.parquet", index=False)
        (out / "summary.json").write_text(json.dumps(res.summary_json(), indent=2))
        (out / "metrics.json").write_text(json.dumps(res.flat_metrics(), indent=1))  # a resumed run's "before"

    def during_training(self, module, step: int) -> None:
        metrics = self(module, f"step{step}", step)
        if self.on_eval is not None:  # every rank has the same metrics: a stop request stops all of them
            self.on_eval(step, metrics)


class Saver:
    """Checkpoints (``<run dir>/checkpoints``, exact resume) and the weights-only trajectory (``<run dir>/trajectory``:
    θ_0, every ``trainer.save_weights_only_every`` steps and the last; RELEX's input). Every rank writes its own part
    of a checkpoint (``training/checkpoint_writer.py``); a sharded policy's full weights stream to rank 0 one tensor at a
    time. A step is written once."""

    def __init__(self, cfg: DictConfig, parts: Parts, state: dict | None):
        self.cfg, self.parts, self.fresh = cfg, parts, state is None
        self.ckpt_root = Path(cfg.paths.output_dir) / "checkpoints"
        self.traj_root = Path(cfg.paths.output_dir) / "trajectory"
        self.saved_at = {int(state["step"])} if state else set()
        self.traj_saved: set[int] = set()

    def save_start(self, module) -> None:
        """θ_0 of the trajectory (a fresh run with ``trainer.save_weights_only_every``), rank 0, before the fit: nothing
        is sharded and no process group exists yet."""
        from grail_exp.checkpoint import save_weights
        from grail_exp.distributed import launch_rank
        from grail_exp.models import lora

        if not (self.cfg.trainer.save_weights_only_every and self.fresh and launch_rank() == 0):
            return
        parts = self.parts
        self.traj_saved.add(0)
        if lora.is_lora(parts.policy):  # the merged model (here the base: B = 0), as every later step's
            from grail_exp.checkpoint import write_dir_atomically
            from grail_exp.training.checkpoint_writer import export_hf_weights

            write_dir_atomically(self.traj_root / "step-0", lambda tmp: (
                export_hf_weights(module, tmp), parts.tokenizer.save_pretrained(tmp)), what="trajectory")
        else:
            save_weights(self.traj_root, 0, parts.policy, parts.tokenizer)

    def checkpoint(self, module, position: dict, final: bool = False) -> None:
        """Every rank: the checkpoint at the module's step. ``final``: the run's last one, which always carries the
        full Hugging Face weights (what evaluation, vLLM and the study read)."""
        from grail_exp.training.checkpoint_writer import write_checkpoint

        m = module
        if m.step in self.saved_at:
            return
        self.saved_at.add(m.step)
        final = final or m.step >= self.cfg.trainer.max_steps  # a periodic checkpoint at the last step is the final one
        export = exports_hf_weights(self.cfg.trainer, final)
        path = write_checkpoint(self.ckpt_root, m, self.parts.tokenizer, position,
                                keep_last=self.cfg.trainer.keep_last_checkpoints, export_hf=export, final=final)
        if m.rank == 0:
            log.info("checkpoint: %s", path)

    def trajectory(self, module, step: int) -> None:
        from grail_exp.training.checkpoint_writer import write_trajectory

        if step in self.traj_saved:
            return
        self.traj_saved.add(step)
        write_trajectory(self.traj_root, module, self.parts.tokenizer, step)


def exports_hf_weights(trainer_cfg, final: bool) -> bool:
    """Whether a checkpoint carries the full Hugging Face weights where resume does not need them (FSDP: the model is
    in the shards): the final one always (what evaluation, vLLM and the study read), the others only with
    ``trainer.export_hf_weights=every``. Strategies whose checkpoint holds the weights as these files write them
    always (``training/checkpoint_writer.py``)."""
    return final or trainer_cfg.get("export_hf_weights", "final") == "every"


def fit(cfg: DictConfig, module, state: dict | None) -> None:
    """Lightning's fit over the remaining rounds (a round = one rollout batch = μ optimiser steps); a stop signal ends
    it after the current optimiser step with a checkpoint (``Preempted``)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from grail_exp.distributed import build_strategy
    from grail_exp.memory import dist_timeout

    rounds = -(-cfg.trainer.max_steps // module.update.steps_per_rollout)  # ceil
    start_round = int(state["round"]) if state else 0
    log_length(cfg, rounds, module.update.steps_per_rollout, start_round)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes,
        strategy=build_strategy(cfg, dist_timeout(cfg)), precision=cfg.trainer.precision, max_steps=-1, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
        deterministic=cfg.trainer.deterministic, default_root_dir=cfg.paths.output_dir,
        use_distributed_sampler=False,  # every rank walks the same rounds; the module splits the prompts
    )
    # A run stopped after its last optimiser step (in its final checkpoint or evaluation) has no round left; Lightning
    # would skip a fit over nothing, and with it the closing. It gets one round in which the module does nothing, so
    # the closing runs inside the fit as in any run (the final evaluation from the completion cache where it got to).
    to_run = range(start_round, max(rounds, start_round + 1))
    with stop_on_signal(trainer):
        trainer.fit(module, train_dataloaders=DataLoader(to_run, batch_size=None, shuffle=False))


def log_length(cfg: DictConfig, rounds: int, per_round: int, start_round: int) -> None:
    """The run's length in both units, once at the start: optimiser steps (trainer.max_steps, TRL's "steps") and
    rollout batches (verl's trainer steps, which the recipes ported from verl-based codebases state)."""
    t = cfg.trainer
    k, mu = t.get("mini_batches_per_rollout", 1), cfg.loss.num_iterations
    last = t.max_steps - (rounds - 1) * per_round
    partial = f"; the last one gives {last} of its {per_round} steps" if last != per_round else ""
    resumed = f", continuing at rollout batch {start_round + 1}" if start_round else ""
    if start_round >= rounds:
        resumed = ", all done: only the closing (final checkpoint and evaluation) is left"
    log.info("training length: %d optimiser steps = %s (x %s x %s%s)%s", t.max_steps, _count(rounds, "rollout batch"),
             _count(k, "mini-batch"), _count(mu, "epoch"), partial, resumed)


def _count(n: int, noun: str) -> str:
    """'1 epoch', '2 epochs', '3 rollout batches'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('h') else 's'}"


class TrainingHooks:
    """What the module calls between steps (the methods of ``training.module.StepHooks``), from the job's evaluator,
    saver and stop signals; the evaluations before and after training are collected in ``results``.

    The stop signals (``preemption.StopSignals``) switch from "starting" to "training" once the fit has started (the
    weights placed, the evaluation before training done): from the first optimiser step on, a signal only records a
    request here, which the ranks agree on at the end of each optimiser step (``RLVRModule._after_step``): when any
    rank got one, every rank checkpoints that step and stops. After the last step (the final checkpoint and
    evaluation) they are "closing"."""

    def __init__(self, cfg: DictConfig, evaluator: Evaluator, saver: Saver, phases: dict, state: dict | None):
        self.cfg, self.evaluator, self.saver, self.phases = cfg, evaluator, saver, phases
        self.eval_before = bool(cfg.trainer.eval_before_training) and state is None
        self.results: dict[str, float] = {}
        self.asked = 0  # the stop signal this rank received during training

    def start(self, module) -> None:
        from grail_exp.preemption import current

        if self.eval_before:
            before = self.evaluator(module, "before", 0)
            self.results.update({k.replace("eval/", "eval_before/", 1): v for k, v in before.items()})
        if current() is not None:
            current().training(self.request)

    def request(self, signum: int) -> None:
        # Record, never act: a handler runs wherever this rank's main thread happens to be, and the other ranks may
        # have got no signal at all, so anything that communicates must wait for the step's agreement point.
        self.asked = signum

    def evaluate(self, module, step: int) -> None:
        self.evaluator.during_training(module, step)

    def checkpoint(self, module, position: dict) -> None:
        self.saver.checkpoint(module, position)

    def trajectory(self, module, step: int) -> None:
        self.saver.trajectory(module, step)

    def stop_requested(self, module) -> int:
        return self.asked

    def end(self, module) -> None:
        """The end of training, still inside the fit on every rank (``RLVRModule.on_train_end``: the policy is on its
        device, the process group exists): final checkpoint and trajectory, then the final evaluation."""
        from grail_exp.preemption import current

        if current() is not None:
            current().closing()
        cfg = self.cfg
        self.phases["closing_started"] = time.perf_counter()
        if cfg.trainer.save_final_checkpoint:
            self.saver.checkpoint(module, module.position, final=True)
        if cfg.trainer.save_weights_only_every:
            self.saver.trajectory(module, module.step)
        if cfg.trainer.eval_at_end:
            self.results.update(self.evaluator(module, "final", module.step))


def finish(cfg: DictConfig, module, tracker, phases: dict, t0: float, tables: dict, results: dict,
           start_sha256: str | None = None) -> None:
    """After fit: the last training metrics and phase timings into ``results`` (which holds the evaluations), plots
    and the summary (rank 0)."""
    if module.last_metrics:
        results.update({f"train/{k}": v for k, v in module.last_metrics.items()})
    phases["total_s"] = time.perf_counter() - t0
    tracker.log_metrics({f"phase/{k}": v for k, v in phases.items()}, step=module.step)
    import torch

    if torch.cuda.is_available():  # the whole run's peak, the final evaluation included (steps log theirs)
        results["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
        tracker.log_metrics({"memory/run_peak_cuda_gb": results["memory/peak_cuda_gb"]}, step=module.step)
    results.update({f"phase/{k}": v for k, v in phases.items()})
    results["train/steps"] = module.step
    if module.rank == 0:
        from grail_exp.analysis.plots import log_training_plots

        # Training curves + weight plots (from <run dir>/weights) under plots/ of the run; never fatal.
        log_training_plots(tracker, Path(cfg.paths.output_dir), label=cfg.advantage.name)
        write_summary(cfg, results, tables, tracker)
        if cfg.study.dir:
            from grail_exp.analysis.study import write_arm

            write_arm(cfg, run_dir=Path(cfg.paths.output_dir), start_sha256=start_sha256, metrics=results,
                      tracker=tracker)


@contextmanager
def stop_on_signal(trainer):
    """During ``trainer``'s fit the stop is the job's (``TrainingHooks``): Lightning installs no signal handlers of its
    own. A fit outside ``train`` (tests) gets the job's stop signals for this fit only."""
    from grail_exp.preemption import StopSignals, current

    own = StopSignals().install() if current() is None else None
    # Lightning's handlers would each break the ranks' agreement on a stop: its SIGTERM handler broadcasts from inside
    # the handler (a collective on the signalled rank alone, wherever it happens to be: the ranks hang) and leaves a
    # flag that ends the fit with exit 0 and no checkpoint; under SLURM its USR1 handler saves and requeues a Lightning
    # checkpoint that this project never resumes from; Ctrl-C's KeyboardInterrupt ends its fit with exit 1.
    trainer._signal_connector.register_signal_handlers = lambda: None
    try:
        yield
    finally:
        if own is not None:
            own.uninstall()


def write_summary(cfg: DictConfig, results: dict, tables: dict, tracker) -> None:
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
