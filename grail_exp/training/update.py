"""The update phase: ``TrainingBatch`` → mini-batches → micro-batches → token weights → loss → gradients → step.

    for each epoch over the rollout batch (μ = loss.num_iterations):
      for each of its k mini-batches (trainer.mini_batches_per_rollout: 1/k of the prompts, whole groups, in order):
        for each micro-batch (gradient accumulation):
            policy forward (through the update backend) → logp (B, C), entropy       (no (B, C, V) float32 copy)
            GRPO-family token masks (top-entropy, off-policy)
            scheme → w (B, C)                  (GRPO: ones; GRAIL / OAR: from that same forward, with the live model)
            Â = sg(w)·A → the objective (loss/objective.py: f·ρ^IS·surrogate + β·KL, aggregated)
                       (+ auxiliary loss terms) → backend.backward
        backend.step: gradient sync, global norm, clipping, optimiser step (skipped when not finite) → scheduler step

k = 1 is TRL's layout (the whole rollout batch per optimiser step, μ steps); k > 1 is verl's (``ppo_mini_batch_size``
= prompts / k, ``ppo_epochs`` = μ; its actor splits the batch in row order, no shuffle): each mini-batch is normalised
as a rollout batch of its own size would be, so k steps on the k mini-batches equal k separate optimiser steps.

In: a prepared ``TrainingBatch`` (rollout phase), the optimiser and scheduler. Out: one metrics dict per optimiser step.
``optimizer_steps`` is a generator so the caller (the LightningModule) logs, evaluates and checkpoints between steps.
State kept across steps (and checkpointed): the count of non-finite steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from grail_exp import world
from grail_exp.compute.forward import PolicyForward
from grail_exp.errors import UserError
from grail_exp.loss import AggregationContext, TermContext, aggregator, compose_objective, is_weights
from grail_exp.training.batch import SchemeContext, TrainingBatch, micro_batch_rows, mini_batch_rows

log = logging.getLogger(__name__)


class NonFiniteLossError(UserError, RuntimeError):
    """The loss went non-finite too often in a row: a config problem (lr, dtype); one line on the CLI."""


class UpdatePhase:
    def __init__(self, cfg, policy, tokenizer, scheme, backend, scheme_ctx: SchemeContext, terms=()):
        self.cfg, self.policy, self.tokenizer, self.scheme = cfg, policy, tokenizer, scheme
        self.backend, self.scheme_ctx, self.terms = backend, scheme_ctx, list(terms)
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.early_metrics: dict[tuple[int, int], dict] = {}  # per_rollout: scheme diagnostics of rows weighed early
        # Called with (batch, s, e, weights, entropy) for every micro-batch of the first epoch (the weight tables).
        self.on_weights: Callable | None = None

    @property
    def mini_batches(self) -> int:
        """k: optimiser steps per epoch over the rollout batch."""
        return self.cfg.trainer.get("mini_batches_per_rollout", 1)

    @property
    def steps_per_rollout(self) -> int:
        """Optimiser steps one rollout batch gives: k mini-batches × μ epochs."""
        return self.mini_batches * self.cfg.loss.num_iterations

    @property
    def accumulation_steps(self) -> int:
        return mini_batch_rows(self.cfg) // micro_batch_rows(self.cfg)

    def mini_batch_range(self, index: int) -> tuple[int, int]:
        """Rows (start, end) of the ``index``-th optimiser step's mini-batch (index within the rollout batch)."""
        size = mini_batch_rows(self.cfg)
        first = (index % self.mini_batches) * size
        return first, first + size

    def optimizer_steps(self, batch: TrainingBatch, optimizer, scheduler, start: int, timings: dict,
                        limit: int | None = None) -> Iterator[tuple[int, dict[str, float]]]:
        """(index within the rollout batch, metrics) for each optimiser step from index ``start`` on, at most ``limit``
        of them (``trainer.max_steps``); ``timings`` collects the phase times of the step being run (the caller clears
        it after reading). Index i trains mini-batch i mod k in epoch i div k."""
        stop = self.steps_per_rollout if limit is None else min(self.steps_per_rollout, start + max(0, limit))
        for index in range(start, stop):
            rows = self.mini_batch_range(index)
            if index == 0:
                self.weigh_later_mini_batches(batch, timings)
            tokens = batch.loss_mask[rows[0]:rows[1]].sum()
            global_tokens = float(world.all_reduce_sum(torch.tensor(float(tokens), dtype=torch.float64)))
            yield index, self.step(batch, optimizer, scheduler, global_tokens, timings,
                                   epoch=index // self.mini_batches, rows=rows, schedule=self.schedules_after(index))

    def schedules_after(self, index: int) -> bool:
        """Whether the lr schedule advances after the index-th optimiser step of a rollout batch: after every one
        (``optim.schedule_unit: optimizer_step``, TRL) or after the last (``rollout_batch``: verl steps its scheduler
        once per ``update_actor``, so the k × μ steps of a rollout batch share one rate)."""
        per_batch = self.cfg.optim.get("schedule_unit", "optimizer_step") == "rollout_batch"
        return not per_batch or index == self.steps_per_rollout - 1

    def step(self, batch: TrainingBatch, optimizer, scheduler, global_tokens: float, timings: dict,
             epoch: int, rows: tuple[int, int] | None = None, schedule: bool = True) -> dict[str, float]:
        """One optimiser step over every micro-batch of ``rows`` of ``batch`` (default: all of it). Per micro-batch: the
        policy forward (through the backend), the GRPO family's token masks, the scheme's weights w, the loss
        (``micro_batch_loss``: Â = sg(w)·A, the IS weights, the objective, the terms), its backward and the weight hooks;
        then ``close_step``: the optimiser step (or its non-finite skip), the lr schedule, the averaged metrics.
        ``global_tokens``: the loss tokens of those rows over all ranks (the dapo normaliser); ``schedule``: advance the
        lr schedule after it."""
        cfg, tally = self.cfg, StepTally(time.perf_counter())
        need_states = "hidden_states" in getattr(self.scheme, "forward_outputs", ())
        # The scheme (probe rows) and loss terms may call the model between forward and backward on some ranks only.
        hold = bool(self.scheme.needs_model or self.terms)
        agg_ctx = AggregationContext(cfg.rollout.max_completion_length, self.accumulation_steps, global_tokens,
                                     world.world_size())
        for s, e in batch.micro_batches(micro_batch_rows(cfg), rows):
            mask = batch.loss_mask[s:e]
            logp, entropy, fwd = self.backend.forward(
                self.policy, batch.input_ids[s:e], batch.attention_mask[s:e], batch.position_ids[s:e],
                batch.completion_ids[s:e], hidden_states=need_states, hold_gathered=hold)
            tally.computed, tally.real = tally.computed + fwd.positions, tally.real + real_tokens(batch, s, e)
            # GRPO family: top-entropy / off-policy masks multiply the policy term only (TRL); the normaliser, the KL
            # term and the metrics keep the loss mask (``loss.family_mask_normaliser: kept`` masks them too).
            fam = self.family_masks(batch, s, e, mask, logp, entropy)
            term_mask = fam.term_mask(mask, cfg.loss)
            ts = time.perf_counter()
            w, scheme_metrics, computed_now = self.weights(batch, s, e, epoch, fwd)
            if computed_now and self.scheme.needs_model:
                self.backend.after_probe_backward()  # before this micro-batch's backward: their peaks must not add up
            tally.scheme_s += time.perf_counter() - ts
            adv = batch.token_advantages[s:e] if batch.token_advantages is not None \
                else batch.advantages[s:e].unsqueeze(1)
            old = batch.old_logp[s:e] if batch.old_logp is not None else logp.detach()
            out = micro_batch_loss(
                cfg, agg_ctx, w, adv, logp, old, mask, sampler_logp=rows_of(batch.sampler_logp, s, e),
                ref_logp=rows_of(batch.ref_logp, s, e), family=fam, terms=self.terms,
                term_context=partial(self.term_context, batch, s, e, logp, entropy, fwd, term_mask,
                                     old=old, agg_ctx=agg_ctx, top_entropy=fam.top_entropy))
            self.backend.backward(out.loss)
            self.backend.after_backward()  # this micro-batch's activations, before the next one's forward
            tally.loss += out.loss.item()
            out.metrics.update(self.weight_metrics(term_mask, w, adv, out.token_advantages, entropy, scheme_metrics))
            if epoch == 0 and self.on_weights is not None:
                self.on_weights(batch, s, e, w, entropy)
            tally.add(out.metrics, float(term_mask.sum()))
        return self.close_step(optimizer, scheduler, tally, timings, epoch, rows, schedule)

    def close_step(self, optimizer, scheduler, tally: StepTally, timings: dict, epoch: int,
                   rows: tuple[int, int] | None, schedule: bool) -> dict[str, float]:
        """The step's closing: the optimiser step through the backend (skipped when the loss or the gradient norm is not
        finite: counted, and an error after ``trainer.max_nonfinite_in_a_row`` such steps in a row), the lr schedule,
        the phase times, and the step's metrics: the micro-batches' token-weighted averages and the step's own."""
        cfg = self.cfg
        avg = tally.averages()
        lr = scheduler.get_last_lr()[0]  # the rate this update uses (logged as such, as verl does)
        result = self.backend.step(optimizer, math.isfinite(tally.loss))
        if result.applied:
            self.nonfinite_in_a_row = 0
        else:
            # A NaN/inf update would poison the weights: the backend skipped it; count it, abort after too many in a row.
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning("non-finite loss/gradient at step %d (loss=%s, grad_norm=%s): update skipped",
                        self.scheme_ctx.progress.step + 1, tally.loss, result.grad_norm)
            limit = cfg.trainer.get("max_nonfinite_in_a_row", 3)
            if self.nonfinite_in_a_row >= limit:
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} non-finite losses/gradients in a row (trainer.max_nonfinite_in_a_row"
                    f"={limit}); aborting. Lower optim.lr, check model.dtype, or inspect the last sample table.")
        if schedule:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.backend.after_step()
        timings["scheme"] = timings.get("scheme", 0.0) + tally.scheme_s
        timings["update"] = timings.get("update", 0.0) + (time.perf_counter() - tally.start - tally.scheme_s)
        avg.update({"loss": tally.loss, "grad_norm": result.grad_norm, "lr": lr,
                    "iteration": float(epoch), "mini_batch": float((rows or (0, 0))[0] // max(1, mini_batch_rows(cfg))),
                    "nonfinite_steps_total": float(self.nonfinite_total),
                    "tokens/computed_positions": float(tally.computed), "tokens/real": float(tally.real),
                    "tokens/efficiency": tally.real / max(tally.computed, 1),
                    "scheme/recompute_per_rollout": float(self.per_rollout)})
        return avg

    @torch.no_grad()
    def weight_metrics(self, mask, w, adv, token_adv, entropy, scheme_metrics: dict) -> dict[str, float]:
        """A micro-batch's token-weight statistics over the tokens that carry loss: the mean weight, how much the
        weights scale |A| (``weights/advantage_scale_ratio``), the entropy, and the scheme's own diagnostics."""
        m = mask.float()
        denom = m.sum().clamp(min=1)
        out = {"weights/mean": ((w.float() * m).sum() / denom).item()}
        a_abs = adv.float().abs()
        if a_abs.mean() > 0:
            out["weights/advantage_scale_ratio"] = \
                ((token_adv.abs() * m).sum() / denom / (a_abs * m).sum().div(denom)).item()
        out["entropy"] = ((entropy * m).sum() / denom).item()
        out.update({f"{self.scheme.name}/{k}": float(v) for k, v in scheme_metrics.items()})
        return out

    @property
    def per_rollout(self) -> bool:
        """``advantage.recompute: per_rollout``: each row's weights once per rollout batch, at the rollout parameters."""
        return self.scheme.cfg.get("recompute", "per_update") == "per_rollout"

    def weigh_later_mini_batches(self, batch: TrainingBatch, timings: dict) -> None:
        """per_rollout with k > 1 mini-batches: before the rollout batch's first optimiser step moves the parameters,
        the weights of mini-batches 2..k (the scheme's own forward per micro-batch; mini-batch 1's come from its training
        forward, also before that step). Every later step reuses them, so all k × μ steps see the weights of the
        parameters that sampled the batch. Their diagnostics are logged with the step that trains those rows."""
        self.early_metrics.clear()  # a new rollout batch: nothing of the last one's is still to be logged
        if not self.per_rollout or self.mini_batches == 1:
            return
        t = time.perf_counter()
        # The scheme calls the policy outside its training forward, on the rows each rank needs: every parameter
        # gathered first (a collective all ranks join here), so nothing inside re-gathers on some ranks only.
        with self.backend.full_parameters():
            for s, e in batch.micro_batches(micro_batch_rows(self.cfg), (self.mini_batch_range(1)[0], batch.num_rows)):
                if batch.weights_ready is None or not bool(batch.weights_ready[s:e].all()):
                    out = self.scheme.weights(self.policy, batch.scheme_view(self.scheme_ctx, s, e))
                    self.cache(batch, s, e, out.weights.detach())
                    self.early_metrics[(s, e)] = out.metrics
        timings["scheme"] = timings.get("scheme", 0.0) + time.perf_counter() - t

    def weights(self, batch: TrainingBatch, s: int, e: int, epoch: int, fwd: PolicyForward):
        """The scheme's weights of rows s:e (per_rollout: computed the first time the rows are met, then reused; every
        row is first met before the rollout batch's first optimiser step); returns (weights, scheme metrics, whether
        they were computed now). ``epoch`` is the pass over the rollout batch (for callers that record it)."""
        if self.per_rollout and batch.weights_ready is not None and bool(batch.weights_ready[s:e].all()):
            return batch.cached_weights[s:e], self.early_metrics.pop((s, e), {}), False
        sb = batch.scheme_view(self.scheme_ctx, s, e)
        out = None
        if self.scheme.needs_model:
            out = self.scheme.weights_from_forward(self.policy, sb, fwd)
        if out is None:
            out = self.scheme.weights(self.policy, sb)
        w = out.weights.detach()
        if self.per_rollout:
            self.cache(batch, s, e, w)
        return w, out.metrics, True

    @staticmethod
    def cache(batch: TrainingBatch, s: int, e: int, w: torch.Tensor) -> None:
        if batch.cached_weights is None:
            batch.cached_weights = torch.zeros_like(batch.loss_mask)
            batch.weights_ready = torch.zeros(batch.num_rows, dtype=torch.bool, device=batch.loss_mask.device)
        batch.cached_weights[s:e] = w.to(batch.cached_weights.dtype)
        batch.weights_ready[s:e] = True

    def family_masks(self, batch, s, e, mask, logp, entropy):
        """GRPO family: the top-entropy token mask (``loss.top_entropy_quantile``) and OPSM
        (``loss.off_policy_mask_threshold``) of rows s:e, as ``family.FamilyMasks`` (``policy`` is None when off)."""
        from grail_exp.loss.masks import family_token_masks

        behaviour = batch.sampler_logp[s:e] if batch.sampler_logp is not None else (
            batch.old_logp[s:e] if batch.old_logp is not None else logp.detach())
        return family_token_masks(entropy, logp, behaviour, batch.advantages[s:e], mask, self.cfg.loss)

    def term_context(self, batch, s, e, logp, entropy, fwd, mask, token_adv, old, agg_ctx,
                     top_entropy=None) -> TermContext:
        """What the auxiliary loss terms (``loss.terms``: entropy bonus, SDPG's distillation, ...) see of rows s:e:
        the live policy, the micro-batch, the forward's hidden states and output layer, and an aggregator like the
        policy loss's."""
        cfg = self.cfg
        return TermContext(
            model=self.policy, batch=batch.scheme_view(self.scheme_ctx, s, e), hidden=fwd.predicting(fwd.hidden),
            head_weight=fwd.head_weight, head_bias=fwd.head_bias, logp=logp, entropy=entropy, mask=mask,
            token_advantages=token_adv, old_logp=old, ref_logp=rows_of(batch.ref_logp, s, e),
            sampler_logp=rows_of(batch.sampler_logp, s, e), temperature=cfg.rollout.temperature,
            step=self.scheme_ctx.progress.step, aggregate=aggregator(cfg.loss, agg_ctx),
            tokenizer=self.tokenizer, rollout_step=self.scheme_ctx.progress.rollouts or None,
            top_entropy_mask=top_entropy, share_prompts=self.backend.share_prompts)

    def state_dict(self) -> dict:
        return {"nonfinite_total": self.nonfinite_total, "nonfinite_in_a_row": self.nonfinite_in_a_row}

    def load_state_dict(self, st: dict) -> None:
        self.nonfinite_total, self.nonfinite_in_a_row = st["nonfinite_total"], st["nonfinite_in_a_row"]


@dataclass
class MicroBatchLoss:
    loss: torch.Tensor  # the scalar to backpropagate (already divided for gradient accumulation)
    token_advantages: torch.Tensor  # (B, C) Â = sg(w)·A in float32
    metrics: dict[str, float]  # the objective's, the IS correction's, the family masks' and the terms' diagnostics


def micro_batch_loss(cfg, agg_ctx: AggregationContext, w: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor,
                     old_logp: torch.Tensor, mask: torch.Tensor, *, sampler_logp: torch.Tensor | None = None,
                     ref_logp: torch.Tensor | None = None, family=None, terms: Sequence = (),
                     term_context: Callable[[torch.Tensor], TermContext] | None = None) -> MicroBatchLoss:
    """The loss of one micro-batch, from tensors alone (no model, no backend):

        Â_{i,t} = sg(w_{i,t}) · A_i        (float32; A_{i,t} under a token-level estimator)
        ρ^IS     = rollout.is_correction's weights of π_old against the sampler (none without its log-probs)
        L        = compose_objective(loss; ρ, Â, ρ^IS, f, KL)  +  Σ_k term_k(term_context(Â))

    ``w`` (B, C) the scheme's weights; ``advantages`` (B, 1) or (B, C); ``logp`` / ``old_logp`` / ``sampler_logp`` /
    ``ref_logp`` / ``mask`` (B, C); ``family``: the GRPO family's ``FamilyMasks`` (its policy mask f and metrics), or
    None; ``terms``: the built auxiliary terms, called with ``term_context(Â)`` (``grail_exp/loss/objective.py``)."""
    token_adv = w.float() * advantages.float()  # Â = sg(w)·A in float32, (B, C)
    isw, is_metrics = None, {}
    ic = cfg.rollout.is_correction
    if ic.mode != "none" and sampler_logp is not None:
        isw, is_metrics = is_weights(old_logp, sampler_logp, mask, ic.mode, ic.clip_min, ic.clip_max)
    out = compose_objective(cfg.loss, agg_ctx, logp, old_logp, token_adv, mask, ref_logp=ref_logp, is_weight=isw,
                            policy_mask=family.policy if family is not None else None)
    loss = out.loss
    metrics = {k: v.item() for k, v in out.metrics.items()}
    metrics.update(is_metrics)
    metrics.update(family.metrics if family is not None else {})
    if terms:
        ctx = term_context(token_adv)
        for term in terms:
            value, m = term(ctx)
            loss = loss + value
            metrics[f"{term.name}/loss"] = float(value.detach())
            metrics.update({f"{term.name}/{k}": float(v) for k, v in m.items()})
    return MicroBatchLoss(loss, token_adv, metrics)


@dataclass
class StepTally:
    """What one optimiser step adds up over its micro-batches."""

    start: float  # time.perf_counter() when the step began
    loss: float = 0.0  # Σ of the micro-batches' losses
    scheme_s: float = 0.0  # seconds in the scheme's weights
    computed: int = 0  # decoder positions run
    real: int = 0  # real tokens (each distinct prompt once per micro-batch)
    sums: dict[str, float] = field(default_factory=dict)  # token-weighted sums of per-micro-batch masked means
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            if math.isfinite(v):  # e.g. a scheme statistic over no rows is NaN in that micro-batch
                self.sums[k] = self.sums.get(k, 0.0) + v * tokens
                self.counts[k] = self.counts.get(k, 0.0) + tokens

    def averages(self) -> dict[str, float]:
        avg = {k: v / self.counts[k] for k, v in self.sums.items() if self.counts[k] > 0}
        avg.pop("loss_tokens", None)
        return avg


def rows_of(t: torch.Tensor | None, s: int, e: int) -> torch.Tensor | None:
    return t[s:e] if t is not None else None


def real_tokens(batch: TrainingBatch, s: int, e: int) -> int:
    """The tokens rows s:e need computed: each distinct prompt's real tokens once, and every completion's."""
    P = batch.prompt_length
    ids, attn = batch.input_ids[s:e], batch.attention_mask[s:e]
    prompts = torch.unique(torch.where(attn[:, :P].bool(), ids[:, :P], -1), dim=0)
    return int((prompts >= 0).sum()) + int(attn[:, P:].sum())
