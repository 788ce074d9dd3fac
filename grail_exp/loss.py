"""The GRPO clipped surrogate with its aggregation choices side by side (method spec §2–§3).

    ρ_{i,t}  = exp(logp_{i,t} − logp^old_{i,t})
    Â_{i,t}  = sg(w_{i,t}) · A_i                                        (w from the advantage scheme)
    ℓ_{i,t}  = −min(ρ·Â, clip(ρ, 1−ε, 1+ε_high)·Â) + β · KL_{i,t}
    KL_{i,t} = exp(ref − logp) − (ref − logp) − 1                       (k3, Schulman; DeepSeekMath eq. 4)

Aggregation over the masked tokens m_{i,t} of a micro-batch of B rows:

    grpo     Σ_i [Σ_t ℓ m / Σ_t m] / B          per-sequence mean, then mean (DeepSeekMath)
    bnpo     Σ_{i,t} ℓ m / Σ_{i,t} m             token mean over the micro-batch
    dr_grpo  Σ_{i,t} ℓ m / (B · L_max)           constant normaliser (Dr. GRPO, arXiv 2503.20783)
    dapo     Σ_{i,t} ℓ m / N_tokens(global)      token mean over the whole accumulated batch (DAPO)

grpo / bnpo / dr_grpo are then divided by the number of accumulation steps, so the accumulated gradient
is the mean over micro-batches; dapo's normaliser already spans the whole batch. This mirrors TRL's
``GRPOTrainer._compute_loss``, which the GRAIL reference forks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided for gradient accumulation)
    metrics: dict[str, torch.Tensor]  # detached scalars: masked means over this micro-batch's tokens


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logp: torch.Tensor,  # (B, C) log π_θ of the sampled tokens
    old_logp: torch.Tensor,  # (B, C) log π_old (== logp.detach() when num_iterations == 1)
    token_advantages: torch.Tensor,  # (B, C) sg(w) · A, detached
    mask: torch.Tensor,  # (B, C) 1 on tokens that carry loss
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    max_completion_length: int,
    accumulation_steps: int = 1,
    global_num_tokens: float | None = None,  # dapo only: masked tokens in the whole accumulated batch
    ref_logp: torch.Tensor | None = None,  # (B, C) frozen reference, needed when beta > 0
    beta: float = 0.0,
) -> LossOutput:
    mask = mask.to(logp.dtype)
    eps_hi = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old_logp)  # (B, C)
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_hi)
    per_token = -torch.min(ratio * token_advantages, clipped * token_advantages)  # (B, C)

    kl = None
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("loss.beta > 0 needs reference log-probs")
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1.0  # (B, C), k3 >= 0
        per_token = per_token + beta * kl

    B = logp.shape[0]
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (B * max_completion_length)
    elif loss_type == "dapo":
        if global_num_tokens is None:
            raise ValueError("loss_type 'dapo' needs global_num_tokens")
        loss = (per_token * mask).sum() / max(float(global_num_tokens), 1.0)
    else:
        raise ValueError(f"unknown loss.loss_type {loss_type!r}")
    if loss_type != "dapo":
        loss = loss / accumulation_steps

    with torch.no_grad():
        # Clip fractions as TRL logs them: a token is "clipped" when the clipped branch is active.
        low = (ratio < 1.0 - epsilon) & (token_advantages < 0)
        high = (ratio > 1.0 + eps_hi) & (token_advantages > 0)
        metrics = {
            "clip_ratio/low_mean": masked_mean(low.to(mask.dtype), mask),
            "clip_ratio/high_mean": masked_mean(high.to(mask.dtype), mask),
            "clip_ratio/region_mean": masked_mean((low | high).to(mask.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "loss_tokens": mask.sum(),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl, mask)
    return LossOutput(loss, metrics)


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without keeping a (B, T, V) log-prob tensor alive: (B, T, V), (B, T) -> (B, T)."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # Half precision: logsumexp loses too much; do it row by row in the logits' dtype (as TRL does).
    return torch.stack([torch.log_softmax(l, -1).gather(-1, i.unsqueeze(-1)).squeeze(-1) for l, i in zip(logits, ids)])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Token entropy H = −Σ_v p log p: (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
