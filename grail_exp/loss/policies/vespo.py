"""VESPO: a Gamma-shaped weight of the sequence importance ratio on a REINFORCE gradient (arXiv 2602.10693; TRL
``loss_type="vespo"``).

    w_i      = exp( clamp( Σ_t log ρ_{i,t}, log 1e−8, 20 ) )           (the sequence ratio, not length-normalised)
    φ(w)     = e^λ · w^k · e^{−λ·w}                                   (φ(1) = 1; peaks at w = k/λ)
    ℓ_{i,t}  = −sg(φ(w_i)) · Â_{i,t} · log π_θ(o_t),   (k, λ) = (k_pos, λ_pos) if Â ≥ 0 else (k_neg, λ_neg)

``loss.vespo_{k,lambda}_{pos,neg}`` (2, 3, 3, 2 as TRL). The rollout IS correction (``rollout.is_correction``)
multiplies the loss afterwards, as for every loss.
"""

from __future__ import annotations

import math

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


@register_policy_loss("vespo")
def vespo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    with torch.no_grad():
        log_r = torch.clamp(logp.detach().float() - old_logp.float(), -20.0, 20.0)
        log_w = torch.clamp((log_r * mask.float()).sum(-1, keepdim=True), math.log(1e-8), 20.0)  # (B, 1)
        pos = adv >= 0
        k = torch.where(pos, torch.full_like(adv, cfg.vespo_k_pos), torch.full_like(adv, cfg.vespo_k_neg))
        lam = torch.where(pos, torch.full_like(adv, cfg.vespo_lambda_pos), torch.full_like(adv, cfg.vespo_lambda_neg))
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    per_token = -phi * adv * logp
    return PolicyLossOutput(per_token, {"vespo/phi_mean": masked_mean(phi, mask)})
