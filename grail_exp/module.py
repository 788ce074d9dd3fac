"""The LightningModule: one training step = one rollout batch and μ optimiser steps (design.md data flow).

    prompts ──rollout──▶ G completions each (+ sampling log-probs, truncation flags)
            ──reward───▶ r_i ∈ {0,1} (last \\boxed{} → math-verify)
            ──group────▶ A_i (group-relative)
    for each of μ inner iterations:                       (loss.num_iterations)
        for each micro-batch:                             (gradient accumulation)
            policy forward → logp (B, C)
            scheme(model, micro-batch) → w (B, C)         (GRPO: ones; GRAIL/OAR: saliency, live model)
            Â = sg(w)·A → clipped surrogate (+ β·KL) → backward
        clip grad norm → optimiser step → scheduler step → log one row of metrics

Manual optimisation (``automatic_optimization = False``) because one Lightning "batch" (a rollout
batch) yields μ optimiser steps, each over several micro-batches, exactly as TRL's GRPOTrainer with
``steps_per_generation == gradient_accumulation_steps``. ``self.step`` counts optimiser steps (it survives
resume, unlike Lightning's loop counters).
"""

from __future__ import annotations

import logging
import math
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass

import lightning as L
import torch

from grail_exp.advantages import SchemeBatch, group_advantages
from grail_exp.data.prompting import encode_prompts
from grail_exp.loss import entropy_from_logits, policy_loss, selective_log_softmax
from grail_exp.rewards import strip_think
from grail_exp.rollout import SamplingParams, pad_completions

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Preempted(RuntimeError):
    """Raised after SIGTERM once the current optimiser step is done and a checkpoint is written."""


@dataclass
class TrainingBatch:
    """A scored rollout batch, ready for the update (all tensors on the policy's device)."""

    input_ids: torch.Tensor  # (N, P+C)
    attention_mask: torch.Tensor  # (N, P+C)
    position_ids: torch.Tensor  # (N, P+C)
    prompt_length: int
    completion_ids: torch.Tensor  # (N, C)
    loss_mask: torch.Tensor  # (N, C) float
    advantages: torch.Tensor  # (N,)
    rewards: torch.Tensor  # (N,)
    texts: list[str]
    old_logp: torch.Tensor | None = None  # (N, C) when num_iterations > 1
    ref_logp: torch.Tensor | None = None  # (N, C) when beta > 0

    def micro_batches(self, size: int):
        n = self.input_ids.shape[0]
        for s in range(0, n, size):
            yield s, min(s + size, n)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` used for a left-padded batch (cumsum − 1), so ratios are exact."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(model, input_ids, attention_mask, position_ids, completion_len: int, temperature: float):
    """Logits at the C positions that predict the completion tokens: (B, C, V), divided by the temperature.

    ``logits_to_keep = C + 1`` keeps only the completion window, never the prompt's (B, P, V) logits.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :]
    return logits / temperature if temperature != 1.0 else logits


class GRPOModule(L.LightningModule):
    def __init__(self, cfg, policy, tokenizer, scheme, engine, source, verifier, tracker, ref_model=None,
                 evaluate_fn=None, resume_state: dict | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.policy = policy
        self.ref_model = ref_model
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.engine = engine
        self.source = source
        self.verifier = verifier
        self.tracker = tracker
        self.evaluate_fn = evaluate_fn  # called every trainer.eval_every optimiser steps
        self.checkpoint_fn = None  # position -> None; set by run.py
        self.weights_fn = None  # step -> None: weights-only trajectory save; set by run.py
        self.stop_requested = False  # set by the SIGTERM handler
        # Resume: optimiser steps done so far, the checkpoint's state (loaded in on_train_start) and any
        # half-used rollout batch (num_iterations > 1).
        self.resume_state = resume_state
        self.step = int(resume_state["step"]) if resume_state else 0
        self.resume_buffer = resume_state.get("buffer") if resume_state else None
        self.position = {"round": int(resume_state["round"]) if resume_state else 0, "buffer": self.resume_buffer}
        G = cfg.rollout.num_generations
        self.completions_per_step = cfg.trainer.prompts_per_step * G
        self.micro_batch_size = min(cfg.trainer.micro_batch_size, self.completions_per_step)
        self.accumulation_steps = self.completions_per_step // self.micro_batch_size
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.last_metrics: dict[str, float] = {}
        # Stochastic schemes (OAR-G's noise) draw from their own seeded stream: reproducible, and
        # independent of the sampling RNG. Saved and restored with checkpoints.
        self.scheme_generator = torch.Generator(device="cpu").manual_seed(int(cfg.seed) + 7919)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        o = self.cfg.optim
        opt = torch.optim.AdamW(self.policy.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                weight_decay=o.weight_decay)
        warmup = o.warmup_steps

        def constant_with_warmup(step: int) -> float:  # transformers' get_constant_schedule_with_warmup
            return step / max(1, warmup) if step < warmup else 1.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, constant_with_warmup)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    # ------------------------------------------------------------------ rollout + scoring
    @torch.no_grad()
    def make_batch(self, round_index: int, timings: dict) -> tuple[TrainingBatch, dict]:
        cfg, r = self.cfg, self.cfg.rollout
        P = cfg.trainer.prompts_per_step
        problems = [self.source[i] for i in range(round_index * P, (round_index + 1) * P)]
        prompts = encode_prompts([p.question for p in problems], self.tokenizer, cfg.model, cfg.data.instruction)

        with _timer(timings, "rollout"):
            self.engine.sync_weights(self.policy)
            completions = self.engine.generate(prompts, SamplingParams(
                n=r.num_generations, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                max_new_tokens=r.max_completion_length, repetition_penalty=r.repetition_penalty, logprobs=True))
        rb = pad_completions(completions, self.tokenizer.pad_token_id)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)

        with _timer(timings, "scoring"):
            golds = [p.answer for p in problems for _ in range(r.num_generations)]
            graded = self.verifier.score([strip_think(t) if cfg.model.strip_think else t for t in texts], golds)
            rewards = torch.tensor([float(g.correct) for g in graded])
        advantages, zero_std = group_advantages(rewards, r.num_generations, cfg.loss.scale_rewards)

        loss_mask = rb.completion_mask.float()
        if cfg.loss.mask_truncated_completions:
            loss_mask = loss_mask * (~rb.is_truncated).float().unsqueeze(1)
        attn = rb.attention_mask
        dev = self.policy.device
        batch = TrainingBatch(
            input_ids=rb.input_ids.to(dev), attention_mask=attn.to(dev),
            position_ids=position_ids_from_mask(attn).to(dev), prompt_length=rb.prompt_ids.shape[1],
            completion_ids=rb.completion_ids.to(dev), loss_mask=loss_mask.to(dev),
            advantages=advantages.to(dev), rewards=rewards.to(dev), texts=texts,
        )
        lengths = rb.completion_mask.sum(1).float()
        term = lengths[~rb.is_truncated]
        stats = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "accuracy": sum(g.correct for g in graded) / len(graded),
            "frac_reward_zero_std": zero_std.float().mean().item(),
            "reward/no_answer_rate": sum(g.status == "no_answer" for g in graded) / len(graded),
            "reward/timeouts": float(sum(g.status == "timeout" for g in graded)),
            "reward/errors": float(sum(g.status == "error" for g in graded)),
            "advantage/abs_mean": advantages.abs().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/mean_terminated_length": term.mean().item() if term.numel() else 0.0,
            "completions/truncated_rate": rb.is_truncated.float().mean().item(),
        }
        if rb.sampling_logprobs is not None:
            self._sampling_logprobs = rb.sampling_logprobs.to(dev)
        self._samples = [(problems[i // r.num_generations], texts[i], graded[i], rewards[i].item(),
                          advantages[i].item()) for i in range(len(texts))]
        return batch, stats

    @torch.no_grad()
    def _logps_no_grad(self, model, batch: TrainingBatch) -> torch.Tensor:
        out = []
        C = batch.completion_ids.shape[1]
        for s, e in batch.micro_batches(self.micro_batch_size):
            logits = completion_logits(model, batch.input_ids[s:e], batch.attention_mask[s:e],
                                       batch.position_ids[s:e], C, self.cfg.rollout.temperature)
            out.append(selective_log_softmax(logits, batch.completion_ids[s:e]))
        return torch.cat(out)

    # ------------------------------------------------------------------ the step
    def training_step(self, round_index, batch_idx):
        cfg = self.cfg
        timings: dict[str, float] = {}
        t_step = time.perf_counter()
        round_index = int(round_index)
        first_iteration = 0
        if self.resume_buffer is not None and self.resume_buffer["round"] == round_index:
            # Resumed mid-round: continue the saved rollout batch instead of sampling a new one.
            batch, stats, first_iteration = self._unpack_buffer(self.resume_buffer)
            self.resume_buffer = None
        else:
            batch, stats = self.make_batch(round_index, timings)
            with _timer(timings, "old_logp"):
                if cfg.loss.num_iterations > 1:
                    batch.old_logp = self._logps_no_grad(self.policy, batch)
                if cfg.loss.beta > 0:
                    batch.ref_logp = self._logps_no_grad(self.ref_model, batch)
            if getattr(self, "_sampling_logprobs", None) is not None and batch.old_logp is not None:
                # Sampler-vs-trainer agreement: ~0 for the HF engine; the IS-correction signal for vLLM.
                diff = (batch.old_logp - self._sampling_logprobs).abs()
                stats["sampling/logp_abs_diff_mean"] = ((diff * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)).item()
        global_tokens = batch.loss_mask.sum().item()
        opt = self.optimizers()
        sched = self.lr_schedulers()

        for iteration in range(first_iteration, cfg.loss.num_iterations):
            if self.step >= cfg.trainer.max_steps:
                break
            step_metrics = self._optimizer_step(batch, opt, sched, global_tokens, timings, iteration)
            self.step += 1
            step = self.step
            step_metrics.update(stats)
            step_metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
            step_metrics["timing/step_s"] = time.perf_counter() - t_step
            step_metrics["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            if torch.cuda.is_available():
                step_metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
            step_metrics["grading/timeouts_total"] = float(self.verifier.counters.get("timeout", 0))
            self.last_metrics = step_metrics
            if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
                self.tracker.log_metrics(step_metrics, step=step)
            self.log_dict({"reward": stats["reward/mean"], "loss": step_metrics["loss"]},
                          prog_bar=True, logger=False, on_step=True, batch_size=1)
            if cfg.trainer.sample_table_every and getattr(self, "_samples", None) \
                    and (step == 1 or step % cfg.trainer.sample_table_every == 0):
                self._log_sample_table(step)
            if self.evaluate_fn and cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 \
                    and step < cfg.trainer.max_steps:
                self.evaluate_fn(step)
            # The data position after this step: the same round (with its buffer) until its last iteration.
            done_round = iteration == cfg.loss.num_iterations - 1
            position = {"round": round_index + 1 if done_round else round_index,
                        "buffer": None if done_round else self._pack_buffer(batch, stats, round_index, iteration + 1)}
            self.position = position
            every = cfg.trainer.checkpoint_every
            if self.checkpoint_fn and (self.stop_requested or (every and step % every == 0)):
                self.checkpoint_fn(position)
            every = cfg.trainer.save_weights_only_every
            if self.weights_fn and every and step % every == 0:
                self.weights_fn(step)
            if self.stop_requested:
                raise Preempted(f"stopped by signal after step {step}; checkpoint written")
            timings = {}
            t_step = time.perf_counter()

    # ------------------------------------------------------------------ checkpoint state
    def _pack_buffer(self, batch: TrainingBatch, stats: dict, round_index: int, next_iteration: int) -> dict:
        tensors = {k: getattr(batch, k) for k in ("input_ids", "attention_mask", "position_ids", "completion_ids",
                                                  "loss_mask", "advantages", "rewards", "old_logp", "ref_logp")}
        return {"round": round_index, "next_iteration": next_iteration, "prompt_length": batch.prompt_length,
                "texts": list(batch.texts), "stats": dict(stats),
                "tensors": {k: v.detach().cpu() for k, v in tensors.items() if v is not None}}

    def _unpack_buffer(self, buf: dict):
        dev = self.policy.device
        t = {k: v.to(dev) for k, v in buf["tensors"].items()}
        batch = TrainingBatch(t["input_ids"], t["attention_mask"], t["position_ids"], buf["prompt_length"],
                              t["completion_ids"], t["loss_mask"], t["advantages"], t["rewards"], buf["texts"],
                              t.get("old_logp"), t.get("ref_logp"))
        return batch, buf["stats"], buf["next_iteration"]

    def state_for_checkpoint(self, position: dict) -> dict:
        """Everything exact resume needs besides the weights (tensors and plain containers only)."""
        from grail_exp.checkpoint import rng_state

        return {
            "step": self.step,
            "round": position["round"],
            "buffer": position["buffer"],
            "optimizer": self.optimizers().optimizer.state_dict(),
            "scheduler": self.lr_schedulers().state_dict(),
            "rng": rng_state(),
            "scheme_generator": self.scheme_generator.get_state(),
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "mlflow_run_id": getattr(self.tracker, "run_id", None),
        }

    def on_train_start(self) -> None:
        if self.resume_state is None:
            return
        from grail_exp.checkpoint import set_rng_state

        st = self.resume_state
        self.optimizers().optimizer.load_state_dict(st["optimizer"])
        self.lr_schedulers().load_state_dict(st["scheduler"])
        set_rng_state(st["rng"])
        self.scheme_generator.set_state(st["scheme_generator"])
        self.nonfinite_total, self.nonfinite_in_a_row = st["nonfinite_total"], st["nonfinite_in_a_row"]

    def _optimizer_step(self, batch: TrainingBatch, opt, sched, global_tokens: float, timings: dict,
                        iteration: int) -> dict[str, float]:
        cfg = self.cfg
        C = batch.completion_ids.shape[1]
        sums: dict[str, float] = {}  # token-weighted sums of per-micro-batch masked means
        tokens_seen = 0.0
        t_scheme = 0.0
        t0 = time.perf_counter()
        loss_total = 0.0
        for s, e in batch.micro_batches(self.micro_batch_size):
            logits = completion_logits(self.policy, batch.input_ids[s:e], batch.attention_mask[s:e],
                                       batch.position_ids[s:e], C, cfg.rollout.temperature)
            logp = selective_log_softmax(logits, batch.completion_ids[s:e])  # (B, C)
            mask = batch.loss_mask[s:e]

            ts = time.perf_counter()
            scheme_out = self.scheme.weights(self.policy, SchemeBatch(
                input_ids=batch.input_ids[s:e], attention_mask=batch.attention_mask[s:e],
                position_ids=batch.position_ids[s:e], prompt_length=batch.prompt_length,
                completion_ids=batch.completion_ids[s:e], completion_mask=mask,
                advantages=batch.advantages[s:e], rewards=batch.rewards[s:e], completion_texts=batch.texts[s:e],
                sampling_temperature=cfg.rollout.temperature, generator=self.scheme_generator))
            t_scheme += time.perf_counter() - ts
            w = scheme_out.weights.detach().to(logp.dtype)
            token_adv = w * batch.advantages[s:e].unsqueeze(1)  # Â = sg(w)·A, (B, C)

            out = policy_loss(
                logp, batch.old_logp[s:e] if batch.old_logp is not None else logp.detach(), token_adv, mask,
                loss_type=cfg.loss.loss_type, epsilon=cfg.loss.epsilon, epsilon_high=cfg.loss.epsilon_high,
                max_completion_length=cfg.rollout.max_completion_length, accumulation_steps=self.accumulation_steps,
                global_num_tokens=global_tokens,
                ref_logp=batch.ref_logp[s:e] if batch.ref_logp is not None else None, beta=cfg.loss.beta,
            )
            self.manual_backward(out.loss)
            loss_total += out.loss.item()
            metrics = {k: v.item() for k, v in out.metrics.items()}
            with torch.no_grad():
                denom = mask.sum().clamp(min=1)
                metrics["weights/mean"] = ((w * mask).sum() / denom).item()
                a_abs = batch.advantages[s:e].abs()
                if a_abs.mean() > 0:
                    metrics["weights/advantage_scale_ratio"] = ((token_adv.abs() * mask).sum() / denom / a_abs.mean()).item()
                if cfg.trainer.log_entropy:
                    metrics["entropy"] = ((entropy_from_logits(logits.detach()) * mask).sum() / denom).item()
            for k, v in scheme_out.metrics.items():
                metrics[f"{self.scheme.name}/{k}"] = float(v)
            n_tok = float(mask.sum())
            tokens_seen += n_tok
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * n_tok
        avg = {k: v / tokens_seen for k, v in sums.items()} if tokens_seen else {}
        avg.pop("loss_tokens", None)

        grad_norm = self._grad_norm()
        finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_in_a_row = 0
            if cfg.optim.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.optim.max_grad_norm)
            opt.step()
        else:
            # A NaN/inf update would poison the weights: skip it, count it, abort after too many in a row.
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning("non-finite loss/gradient at step %d (loss=%s, grad_norm=%s): update skipped",
                        self.step + 1, loss_total, grad_norm)
            limit = cfg.trainer.get("max_nonfinite_in_a_row", 3)
            if self.nonfinite_in_a_row >= limit:
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} non-finite losses/gradients in a row (trainer.max_nonfinite_in_a_row"
                    f"={limit}); aborting. Lower optim.lr, check model.dtype, or inspect the last sample table.")
            # With every grad None, AdamW leaves parameters and state untouched; the call still advances
            # Lightning's optimiser-step counter, so the skipped step is counted like any other.
            opt.zero_grad(set_to_none=True)
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        timings["scheme"] = timings.get("scheme", 0.0) + t_scheme
        timings["update"] = timings.get("update", 0.0) + (time.perf_counter() - t0 - t_scheme)
        avg.update({"loss": loss_total, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
                    "iteration": float(iteration), "nonfinite_steps_total": float(self.nonfinite_total)})
        return avg

    def _grad_norm(self) -> float:
        norms = [p.grad.detach().norm(2) for p in self.policy.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0

    # ------------------------------------------------------------------ logging helpers
    def _log_sample_table(self, step: int) -> None:
        import pandas as pd

        k = self.cfg.trainer.num_logged_samples
        rows = [{"step": step, "question": p.question, "gold": p.answer, "completion": text, "extracted": g.extracted,
                 "reward": rew, "advantage": adv} for p, text, g, rew, adv in self._samples[:k]]
        self.tracker.log_table(pd.DataFrame(rows), artifact_file=f"samples/step_{step:06d}.json")


@contextmanager
def _timer(timings: dict, key: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
