"""CISPO: clip the importance weight, never the gradient (MiniMax-M1, arXiv 2506.13585 §3.1).

    ℓ_{i,t} = −sg( clip(ρ_{i,t}, 1 − ε, 1 + ε_high) ) · Â_{i,t} · log π_θ(o_t)

Every token keeps a gradient (PPO's clip drops it); the weight only rescales it. ``loss.epsilon`` /
``loss.epsilon_high`` bound the weight as in verl; TRL caps it at ``epsilon_high`` itself (no lower bound): set
ε = 1 (lower bound 0) and ε_high = 4 for TRL's / ScaleRL's cap of 5 (conf/algo/cispo.yaml).
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


@register_policy_loss("cispo")
def cispo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    ratio = torch.exp(logp - old_logp).detach()
    weight = torch.clamp(ratio, 1.0 - cfg.epsilon, 1.0 + eps_hi)
    per_token = -weight * adv * logp
    with torch.no_grad():
        metrics = {"cispo/clip_frac": masked_mean(weight != ratio, mask), "ratio_mean": masked_mean(ratio, mask)}
    return PolicyLossOutput(per_token, metrics)
