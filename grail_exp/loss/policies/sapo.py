"""SAPO: a soft, sign-dependent sigmoid gate instead of the hard clip (Soft Adaptive Policy Optimization,
arXiv 2511.20347).

    ℓ_{i,t} = −(4/τ) · σ(τ·(ρ_{i,t} − 1)) · Â_{i,t},     τ = τ_pos if Â_{i,t} > 0 else τ_neg

At ρ = 1 the gate's derivative is (4/τ)·τ/4 = 1, so the gradient is −Â·∇log π (the plain policy gradient); far from
1 it decays smoothly. ``loss.sapo_tau_pos`` (1.0), ``loss.sapo_tau_neg`` (1.05); forces the ``grpo`` aggregation
(TRL and verl do)."""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


@register_policy_loss("sapo")
def sapo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    ratio = torch.exp(logp - old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
    per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    with torch.no_grad():
        metrics = {"ratio_mean": masked_mean(ratio, mask)}
    return PolicyLossOutput(per_token, metrics, aggregation="grpo")
