"""Clip-Cov and KL-Cov: entropy-preserving updates that act on the few tokens with the largest covariance between
advantage and log-probability (Cui et al., The Entropy Mechanism of RL for Reasoning LMs, arXiv 2505.22617 §4).

    Cov_{i,t} = (Â_{i,t} − mean Â) · (log π_θ(o_t) − mean log π)       (detached; means over the valid tokens)

    clip_cov  PPO-clip (``loss.epsilon`` / ``epsilon_high``), but a random ``loss.clip_cov_ratio`` fraction of the
              tokens with clip_cov_lb ≤ Cov ≤ clip_cov_ub is dropped from the loss (no gradient).
    kl_cov    ℓ = −Â·ρ + 1[t ∈ top-k Cov] · ``loss.kl_cov_coef`` · |log ρ|, k = ``loss.kl_cov_ratio`` · #tokens.

Both select tokens within the micro-batch (verl does it within its micro-batch too): the selection, not the
normaliser, depends on the split. clip_cov draws from torch's global generator (seeded by the run seed).
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import POLICY_LOSSES, PolicyLossOutput, masked_mean, register_policy_loss


def token_covariance(logp, adv, mask) -> torch.Tensor:
    """(B, T) centred product over the valid tokens, −inf on padding (so it never ranks)."""
    with torch.no_grad():
        m = mask.bool()
        a, lp = adv.float(), logp.detach().float()
        cov = (a - a[m].mean()) * (lp - lp[m].mean())
        return cov.masked_fill(~m, float("-inf"))


@register_policy_loss("clip_cov")
def clip_cov(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    out = POLICY_LOSSES["ppo_clip"](logp, old_logp, adv, mask, cfg)
    cov = token_covariance(logp, adv, mask)
    n_valid = int(mask.bool().sum())
    candidates = ((cov >= cfg.clip_cov_lb) & (cov <= cfg.clip_cov_ub)).nonzero(as_tuple=False)
    keep = torch.ones_like(out.per_token)
    n_drop = min(max(1, int(cfg.clip_cov_ratio * n_valid)), candidates.shape[0]) if n_valid else 0
    if n_drop:
        pick = candidates[torch.randperm(candidates.shape[0])[:n_drop].to(candidates.device)]
        keep[pick[:, 0], pick[:, 1]] = 0.0
    out.per_token = out.per_token * keep
    out.metrics["clip_cov/dropped_frac"] = masked_mean(keep == 0, mask)
    return out


@register_policy_loss("kl_cov")
def kl_cov(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    log_ratio = logp - old_logp
    per_token = -adv * torch.exp(log_ratio)
    cov = token_covariance(logp, adv, mask)
    n_valid = int(mask.bool().sum())
    k = min(max(1, int(cfg.kl_cov_ratio * n_valid)), n_valid) if n_valid else 0
    selected = torch.zeros_like(per_token, dtype=torch.bool)
    if k:
        top = torch.topk(cov.reshape(-1), k).indices
        selected.view(-1)[top] = True
    per_token = per_token + selected.float() * cfg.kl_cov_coef * log_ratio.abs()
    with torch.no_grad():
        metrics = {"kl_cov/selected_frac": masked_mean(selected, mask),
                   "ratio_mean": masked_mean(torch.exp(log_ratio), mask)}
    return PolicyLossOutput(per_token, metrics)
