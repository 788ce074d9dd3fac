"""GMPO: the geometric mean of clipped token ratios (Geometric-Mean Policy Optimization, arXiv 2507.20673).

    Ā_i          = (1/|o_i|) Σ_t Â_{i,t}                   (the sequence's advantage; = A_i for sequence estimators)
    l_{i,t}      = sgn(Ā_i) · min( sgn(Ā_i)·log ρ_{i,t}, sgn(Ā_i)·clip(log ρ_{i,t}, −ε, ε_high) )
    ℓ_i          = −Ā_i · exp( (1/|o_i|) Σ_t l_{i,t} )

The clip acts in log space (the paper: ε = ε_high = 0.4, i.e. ratios in [e^−0.4, e^0.4]). The per-sequence loss is
written on every valid token with the ``grpo`` aggregation forced, so the batch loss is the mean of ℓ_i (verl
``geo_mean``).
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


@register_policy_loss("gmpo")
def gmpo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    m = mask.float()
    n = m.sum(-1, keepdim=True).clamp(min=1.0)
    seq_adv = (adv * m).sum(-1, keepdim=True) / n  # (B, 1)
    sign = torch.sign(seq_adv)
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    log_ratio = logp - old_logp
    clipped = torch.clamp(log_ratio, -cfg.epsilon, eps_hi)
    lr = sign * torch.min(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp((lr * m).sum(-1, keepdim=True) / n)  # (B, 1)
    per_token = (-seq_adv * seq_ratio).expand_as(logp)
    with torch.no_grad():
        metrics = {"gmpo/clip_frac": masked_mean(clipped != log_ratio, mask),
                   "ratio_mean": masked_mean(seq_ratio.expand_as(logp), mask)}
    return PolicyLossOutput(per_token, metrics, aggregation="grpo")
