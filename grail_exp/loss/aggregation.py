"""Aggregations (``loss.loss_type``): how the masked per-token losses of one micro-batch become a scalar.

With m the loss mask of a micro-batch of B rows, L_max = ``rollout.max_completion_length``, K = gradient-
accumulation steps per optimiser step and R = data-parallel world size (DDP averages gradients over ranks):

    grpo                Σ_i [Σ_t ℓ m / Σ_t m] / B / K          per-sequence mean, then mean (DeepSeekMath; verl seq-mean-token-mean)
    bnpo                Σ_{i,t} ℓ m / Σ_{i,t} m / K            token mean of the micro-batch (TRL)
    dr_grpo             Σ_{i,t} ℓ m / (B · L_max) / K          constant normaliser (Dr. GRPO arXiv 2503.20783; verl seq-mean-token-sum-norm)
    dapo                Σ_{i,t} ℓ m · R / N_tokens             token mean over the whole optimiser step, all ranks
                                                               (DAPO arXiv 2503.14476; verl token-mean)
    token_sum           Σ_{i,t} ℓ m · R                        plain token sum over the whole optimiser step (verl token-sum)
    seq_mean_token_sum  Σ_i Σ_t ℓ m / B / K                    per-sequence token sum, mean over sequences (verl seq-mean-token-sum)

Every normaliser except ``bnpo``'s is independent of how the rollout batch is split into micro-batches and ranks,
so gradient accumulation and DDP give the gradient of one process on the whole batch (tested). ``bnpo`` depends
on the split by definition (TRL's behaviour). Token counts are float32 sums (exact up to 2^24).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grail_exp.registry import Registry

AGGREGATIONS: Registry = Registry("aggregation (loss.loss_type)")


@dataclass
class AggregationContext:
    max_completion_length: int  # L_max (dr_grpo)
    accumulation_steps: int = 1  # K: micro-batches per optimiser step on this rank
    global_num_tokens: float | None = None  # dapo: loss tokens of the whole optimiser step, summed over ranks
    world_size: int = 1  # R: DDP averages gradients over ranks


def register_aggregation(name: str) -> Callable[[Callable], Callable]:
    return AGGREGATIONS.register(name)


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.float()
    return per_token.float() * m, m


@register_aggregation("grpo")
def seq_mean_token_mean(per_token, mask, ctx: AggregationContext):
    x, m = _masked(per_token, mask)
    return (x.sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / ctx.accumulation_steps


@register_aggregation("bnpo")
def micro_batch_token_mean(per_token, mask, ctx: AggregationContext):
    x, m = _masked(per_token, mask)
    return x.sum() / m.sum().clamp(min=1.0) / ctx.accumulation_steps


@register_aggregation("dr_grpo")
def seq_mean_token_sum_norm(per_token, mask, ctx: AggregationContext):
    x, _ = _masked(per_token, mask)
    return x.sum() / (x.shape[0] * ctx.max_completion_length) / ctx.accumulation_steps


@register_aggregation("dapo")
def global_token_mean(per_token, mask, ctx: AggregationContext):
    if ctx.global_num_tokens is None:
        raise ValueError("loss_type 'dapo' needs the token count of the whole optimiser step (global_num_tokens)")
    x, _ = _masked(per_token, mask)
    return x.sum() * ctx.world_size / max(float(ctx.global_num_tokens), 1.0)


@register_aggregation("token_sum")
def token_sum(per_token, mask, ctx: AggregationContext):
    x, _ = _masked(per_token, mask)
    return x.sum() * ctx.world_size


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(per_token, mask, ctx: AggregationContext):
    x, _ = _masked(per_token, mask)
    return x.sum(-1).mean() / ctx.accumulation_steps
