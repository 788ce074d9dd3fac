"""The LightningModule: one training step = one rollout batch and the optimiser steps it gives (design.md data flow).

    rollout phase  (grail_exp/training/rollout.py)   prompts → completions → rewards → advantages → TrainingBatch
    update phase   (grail_exp/training/update.py)    TrainingBatch → micro-batches → weights → loss → optimiser steps
    update backend (grail_exp/training/backends/)    single process / DDP, FSDP, DeepSpeed ZeRO

This class is the glue: Lightning calls ``training_step`` once per round (a "batch" of the data loader is a round
index), the module runs the rollout phase, then each optimiser step of the update phase, and between steps logs and
calls what it was given at construction (``StepHooks``: evaluate, checkpoint, trajectory, the stop request; the job's
evaluation before training and its closing at the fit's start and end). Manual optimisation (``automatic_optimization =
False``) because one round yields μ optimiser steps, each over several micro-batches, exactly as TRL's GRPOTrainer with
``steps_per_generation == gradient_accumulation_steps``. ``progress.step`` counts optimiser steps (it survives resume,
unlike Lightning's loop counters).

Data parallelism: every rank draws its own slice of the round's prompts (all G rollouts of a prompt stay on one rank,
so group statistics are exact), the backend reduces gradients, metrics are averaged over ranks, and only rank 0 logs
and writes checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

from grail_exp import faults, world
from grail_exp.compute.host import peak_resident_bytes
from grail_exp.distributed import check_launch_rank, launch_rank
from grail_exp.errors import Preempted
from grail_exp.training import probe_points
from grail_exp.training import state as run_state
from grail_exp.training.backends import build_backend
from grail_exp.training.batch import Progress, SchemeContext, TrainingBatch  # noqa: F401  (TrainingBatch: public)
from grail_exp.training.records import StepRecords
from grail_exp.training.rollout import RolloutPhase, SamplerMismatchError  # noqa: F401  (public error)
from grail_exp.training.update import NonFiniteLossError, UpdatePhase  # noqa: F401  (public error)


@dataclass
class Parts:
    """What a run trains and scores with, built before any process group exists (``job.build_parts``)."""

    policy: Any
    tokenizer: Any
    scheme: Any  # the token-weight scheme (advantages/)
    source: Any = None  # the training prompts (data/)
    verifier: Any = None  # the reward (grading/)
    ref_model: Any = None  # the frozen reference model, when a loss term needs one
    terms: list = field(default_factory=list)  # the loss's auxiliary terms (loss/)
    engine: Any = None  # the rollout engine, or None: ``engine_factory`` builds it in ``setup``
    # () -> engine, called in setup(): an engine with its own process-group membership (vLLM) must be built once
    # Lightning's process group exists, on every rank.
    engine_factory: Callable[[], Any] | None = None
    model_path: str | None = None  # the starting weights (the reference model comes from here)
    policy_path: str | None = None  # the weights the policy starts from now (a checkpoint when resuming)
    start_sha256: str | None = None  # the starting weights' identity (study.dir or trainer.eval_cache set)


class StepHooks:
    """What the module calls around and between optimiser steps, each with the module first (as Lightning's callbacks
    take theirs): the job's evaluator, saver and stop signals (``job.TrainingHooks``). This base does nothing and
    requests no stop: a module driven without a job (tests, the bench) trains and only trains."""

    def start(self, module) -> None:
        """The fit has started (weights placed, resume state restored): the evaluation before training."""

    def evaluate(self, module, step: int) -> None:
        """Every ``trainer.eval_every`` optimiser steps but the last; may raise ``errors.RunStopped`` (Optuna)."""

    def checkpoint(self, module, position: dict) -> None:
        """Every ``trainer.checkpoint_every`` optimiser steps and on an agreed stop; ``position``: where the data
        continues (the round and, mid-round, its rollout batch)."""

    def trajectory(self, module, step: int) -> None:
        """Every ``trainer.save_weights_only_every`` optimiser steps: the weights alone."""

    def stop_requested(self, module) -> int:
        """The stop signal this rank received during training (0: none), read once at the end of every step."""
        return 0

    def end(self, module) -> None:
        """After the last step, still inside the fit: the final checkpoint, trajectory and evaluation."""


class RLVRModule(L.LightningModule):
    """Trains the policy with any token-weight scheme (GRPO, GRAIL, OAR-G/P, ...) from verifiable rewards."""

    def __init__(self, cfg, parts: Parts, tracker=None, hooks: StepHooks | None = None,
                 resume_state: dict | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.cfg, self.policy, self.ref_model, self.tokenizer = cfg, parts.policy, parts.ref_model, parts.tokenizer
        self.tracker, self.terms = tracker, parts.terms or []
        self.hooks = hooks or StepHooks()
        self.engine_factory = parts.engine_factory
        self._prompts_checked = False
        self.progress = Progress(step=int(resume_state["step"]) if resume_state else 0)
        # Stochastic schemes (OAR-G's noise) draw from their own seeded stream: reproducible, and independent of the
        # sampling RNG. Saved and restored with checkpoints.
        self.scheme_generator = torch.Generator(device="cpu").manual_seed(int(cfg.seed) + 7919)
        self.scheme_ctx = SchemeContext(cfg.rollout.temperature, cfg.rollout.num_generations, self.scheme_generator,
                                        self.progress)
        self.backend = build_backend(cfg, self)
        self.rollout = RolloutPhase(cfg, parts.policy, parts.tokenizer, parts.scheme, parts.engine, parts.source,
                                    parts.verifier, self.backend, self.scheme_ctx, ref_model=parts.ref_model,
                                    terms=self.terms)
        self.update = UpdatePhase(cfg, parts.policy, parts.tokenizer, parts.scheme, self.backend, self.scheme_ctx,
                                  terms=self.terms)
        self.records = StepRecords(cfg, parts.tokenizer, tracker)
        self.update.on_weights = lambda batch, s, e, w, ent: self.records.collect_weights(
            self.progress.step + 1, batch, s, e, w, ent)
        # Resume: the checkpoint's state (loaded in on_train_start) and this rank's half-used rollout batch (μ > 1).
        # The process group does not exist yet (Lightning creates it later): the launcher's rank picks the buffer.
        self.resume_state = resume_state
        self.resume_part = run_state.rank_part(resume_state, launch_rank())  # this rank's own part, until restored
        self.resume_buffer = self.resume_part.get("buffer") if self.resume_part else None
        self.position = {"round": int(resume_state["round"]) if resume_state else 0, "buffer": self.resume_buffer}
        self.last_metrics: dict[str, float] = {}

    @property
    def scheme(self):
        """The advantage scheme both phases use (assigning one gives it to both)."""
        return self.update.scheme

    @scheme.setter
    def scheme(self, scheme) -> None:
        self.rollout.scheme = self.update.scheme = scheme

    @property
    def step(self) -> int:
        """Optimiser steps done."""
        return self.progress.step

    @property
    def rank(self) -> int:
        return world.rank()

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        # The process group exists now (Lightning created it): check it is the configured world, then build the
        # engine inside it, then give each rank its own sampling streams.
        world.check_world_size(self.cfg.trainer)
        check_launch_rank(launch_rank(), world.rank())  # who read the weights and opened the MLflow run at launch
        if self.cfg.get("resume"):
            run_state.check_same_resume_point(self.resume_state)
        self.records.rank = world.rank()
        if self.rollout.engine is None and self.engine_factory is not None:
            self.rollout.engine = self.engine_factory()
        if world.rank() == 0 and self.tracker is not None:
            where = {"world_size": world.world_size(), "dist_backend": world.backend_name()}
            if self.resume_state is None:
                self.tracker.log_params(where)
            else:  # params are immutable in MLflow: a resumed run records its world as tags
                self.tracker.set_tags({f"resumed_{k}": v for k, v in where.items()})
        probe_points.emit("setup", module=self)
        if world.world_size() > 1:
            # Different sampling / noise streams per rank (rank 0 keeps the single-process streams).
            self.scheme_generator.manual_seed(int(self.cfg.seed) + 7919 + 1000 * world.rank())
            if world.rank():
                L.seed_everything(int(self.cfg.seed) + 1000 * world.rank(), verbose=False)

    def configure_model(self) -> None:
        # Every rank, in the process group, before Lightning moves the module to its device: the policy sharded or
        # placed (with rank 0's weights on a multi-rank run), then the frozen reference model likewise.
        self.backend.configure_model(self.policy)
        if self.ref_model is not None:
            self.backend.place_replica(self.ref_model)

    def configure_optimizers(self):
        opt = self.backend.build_optimizer(self.policy)
        warmup = self.cfg.optim.warmup_steps

        # transformers' get_constant_schedule_with_warmup and verl's (the same factor); ``step`` counts the schedule's
        # own steps: optimiser steps or rollout batches (``optim.schedule_unit``, UpdatePhase.schedules_after). Its
        # state (that count) is checkpointed with the run, so a resumed run continues the schedule exactly.
        def constant_with_warmup(step: int) -> float:
            return step / max(1, warmup) if step < warmup else 1.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, constant_with_warmup)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def on_train_start(self) -> None:
        self.backend.placed()  # the policy is on its device, sharded or wrapped: hooks on its parameters hold now
        if self.resume_state is not None:
            run_state.restore(self, self.resume_state, self.resume_part)
            self.resume_part = None  # placed: release this rank's loaded part
            probe_points.emit("restored", module=self)
        probe_points.emit("started", module=self)
        self.hooks.start(self)

    def on_train_end(self) -> None:
        # Still inside fit: the policy is on its device and the process group exists, so the final checkpoint and
        # evaluation run here, on every rank. The strategy's teardown comes next: it frees the optimiser state and
        # copies nothing to the host (grail_exp/device_teardown.py).
        self.hooks.end(self)
        probe_points.emit("closed", module=self)

    # ------------------------------------------------------------------ the step
    def training_step(self, round_index, batch_idx):
        cfg = self.cfg
        timings: dict[str, float] = {}
        t_step, c_step = time.perf_counter(), time.process_time()
        round_index = int(round_index)
        if self.progress.step >= cfg.trainer.max_steps:  # resumed after the last step: only the closing is left
            return None
        self.progress.rollouts = round_index + 1
        start = 0
        if self.resume_buffer is not None and self.resume_buffer["round"] == round_index:
            # Resumed mid-round: continue the saved rollout batch instead of sampling a new one.
            batch, stats, start = run_state.unpack_buffer(self.resume_buffer, self.policy.device)
            self.resume_buffer = None
        else:
            batch, stats = self.rollout.collect(round_index, timings)
            if not self._prompts_checked:  # the first rollout of this process: ranks drew disjoint prompts
                world.check_disjoint_prompts(self.rollout.last_prompt_indices)
                self._prompts_checked = True
            probe_points.emit("rollout", module=self, round_index=round_index)

        left = cfg.trainer.max_steps - self.progress.step
        steps = self.update.optimizer_steps(batch, self.optimizers(), self.lr_schedulers(), start, timings, limit=left)
        for index, metrics in steps:
            self.progress.step += 1
            step = self.progress.step
            metrics.update(stats)
            metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
            metrics["timing/step_s"] = time.perf_counter() - t_step
            # CPU seconds of this process (all its threads): the step's cost when other jobs share the machine
            metrics["timing/step_cpu_s"] = time.process_time() - c_step
            self._after_step(step, metrics, batch, stats, round_index, index)
            timings.clear()
            t_step, c_step = time.perf_counter(), time.process_time()

    def _after_step(self, step: int, metrics: dict, batch: TrainingBatch, stats: dict, round_index: int,
                    index: int) -> None:
        """Between optimiser steps: metrics, tables, evaluation, checkpoint, stop request."""
        cfg = self.cfg
        metrics["memory/peak_rss_gb"] = peak_resident_bytes() / 1e9
        if torch.cuda.is_available():
            metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
        metrics["grading/timeouts_total"] = float(self.rollout.verifier.counters.get("timeout", 0))
        metrics = world.average_metrics(metrics)
        self.last_metrics = metrics
        probe_points.emit("step", module=self, step=step)
        if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
            self.tracker.log_metrics(metrics, step=step)
        self.records.progress_line(step, metrics)
        self.log_dict({"reward": stats["reward/mean"], "loss": metrics["loss"]},
                      prog_bar=True, logger=False, on_step=True, batch_size=1)
        self.records.log_sample_table(step, self.rollout.samples)
        self.records.log_weight_table(step)
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < cfg.trainer.max_steps:
            self.hooks.evaluate(self, step)
        # The data position after this step: the same round (with its buffer) until its last optimiser step.
        done_round = index == self.update.steps_per_rollout - 1
        self.position = {"round": round_index + 1 if done_round else round_index,
                         "buffer": None if done_round else run_state.pack_buffer(batch, stats, round_index, index + 1)}
        faults.term_at_step(step, cfg.advantage.name, self.rank)  # test-only (GRAIL_EXP_FAULT)
        faults.int_at_step(step, cfg.advantage.name, self.rank)
        # The one point where a stop request counts, the same on every rank: a signal may reach one rank only, or the
        # ranks at different moments, and ranks that decided apart would run different collectives and hang. All stop
        # when any asked (with the largest signal number asked: SIGTERM over SIGINT, one exit code for every rank); a
        # signal landing after this point is acted on at the next step's.
        asked = self.hooks.stop_requested(self)
        stop = world.max_over_ranks(asked)
        every = cfg.trainer.checkpoint_every
        if stop or (every and step % every == 0):
            self.hooks.checkpoint(self, self.position)
        faults.kill_after_step(step, cfg.advantage.name, self.rank)
        every = cfg.trainer.save_weights_only_every
        if every and step % every == 0:
            self.hooks.trajectory(self, step)
        if stop:
            where = "" if asked else " on another rank"
            raise Preempted(f"stopped by signal{where} after step {step}; checkpoint written", signum=stop, step=step,
                            here=bool(asked))

    # ------------------------------------------------------------------ checkpoints
    def barrier(self) -> None:
        world.barrier()
