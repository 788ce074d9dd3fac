"""DPPO: a trust region on the probability of the sampled token instead of on the ratio (arXiv 2602.04879; verl
``dppo_tv`` / ``dppo_kl``).

    ℓ_{i,t} = −Â_{i,t} · sg(min(ρ_{i,t}, C)) · log π_θ(o_t) · 1[token inside the trust region]

A token leaves the region only in the direction its advantage pushes it (sign-aware), with p = π_θ(o_t),
q = π_old(o_t):
    dppo_tv   Â > 0 and p − q > ε_high,   or   Â < 0 and q − p > ε                  (total variation of the token)
    dppo_kl   D = q·log(q/p) + (1−q)·log((1−q)/(1−p)) (binary KL), and D > ε_high with p > q for Â > 0,
              D > ε with p < q for Â < 0
``loss.epsilon`` / ``loss.epsilon_high`` are the thresholds (set them in the preset), ``loss.clip_ratio_c`` is C
(null = no cap; verl recommends 20). At μ = 1 (p = q) nothing is masked and the gradient is −Â·∇log π.
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


def _dppo(logp, old_logp, adv, mask, cfg, divergence: str) -> PolicyLossOutput:
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    with torch.no_grad():
        p, q = torch.exp(logp.detach().float()), torch.exp(old_logp.float())
        if divergence == "tv":
            up, down = p - q > eps_hi, q - p > cfg.epsilon
        else:
            p_, q_ = p.clamp(1e-12, 1 - 1e-7), q.clamp(1e-12, 1 - 1e-7)
            d = q_ * torch.log(q_ / p_) + (1 - q_) * torch.log((1 - q_) / (1 - p_))
            up, down = (d > eps_hi) & (p > q), (d > cfg.epsilon) & (p < q)
        outside = ((adv > 0) & up) | ((adv < 0) & down)
        ratio = torch.exp(logp.detach() - old_logp)
        weight = ratio if getattr(cfg, "clip_ratio_c", None) is None else ratio.clamp(max=cfg.clip_ratio_c)
    per_token = -adv * weight * logp * (~outside).float()
    metrics = {"dppo/masked_frac": masked_mean(outside, mask), "ratio_mean": masked_mean(ratio, mask)}
    return PolicyLossOutput(per_token, metrics)


@register_policy_loss("dppo_tv")
def dppo_tv(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    return _dppo(logp, old_logp, adv, mask, cfg, "tv")


@register_policy_loss("dppo_kl")
def dppo_kl(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    return _dppo(logp, old_logp, adv, mask, cfg, "kl")
