"""GMPO: the geometric mean of clipped token ratios (Geometric-Mean Policy Optimization, arXiv 2507.20673).

    Ā_i          = (1/|o_i|) Σ_t Â_{i,t}                   (the sequence's advantage; = A_i for sequence estimators)
    l_{i,t}      = sgn(Ā_i) · min( sgn(Ā_i)·log ρ_{i,t}, sgn(Ā_i)·clip(log ρ_{i,t}, −ε, ε_high) )
    K_i          = the tokens of row i in the geometric mean: its loss tokens × the family masks f (if any)
    s_i          = exp( (1/|K_i|) Σ_{t∈K_i} l_{i,t} )
    c_i          = exp( (1/|K_i|) Σ_{t∈K_i} log ρ^IS_{i,t} )      rollout IS weights, geometric mean (verl)
    ℓ_i          = −Ā_i · s_i · c_i · 1[|K_i| > 0]

The clip acts in log space (the paper: ε = ε_high = 0.4, i.e. ratios in [e^−0.4, e^0.4]). The per-sequence loss is
written on every loss token with the ``grpo`` aggregation forced, so the batch loss is the mean of ℓ_i (verl
``geo_mean``, TRL's GMPOTrainer).

Token weights are folded into the per-sequence means (``folds_token_weights``), not multiplied per token afterwards:
- the family masks f (top-entropy, off-policy) restrict K_i, as TRL's GMPOTrainer drops low-entropy tokens from the
  geometric mean (a row with no kept token adds nothing);
- the rollout IS weights enter as their geometric mean over K_i, as verl ``geo_mean`` does
  (``loss.gmpo_is_mean: geometric``). ``arithmetic`` uses their arithmetic mean over K_i instead — what multiplying
  each token's loss by its weight under the per-sequence mean gives.
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss

IS_MEANS = ("geometric", "arithmetic")


@register_policy_loss("gmpo", folds_token_weights=True)
def gmpo(logp, old_logp, adv, mask, cfg, policy_mask=None, is_weight=None) -> PolicyLossOutput:
    m = mask.float()
    seq_adv = (adv * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    sign = torch.sign(seq_adv)
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    log_ratio = logp - old_logp
    clipped = torch.clamp(log_ratio, -cfg.epsilon, eps_hi)
    lr = sign * torch.min(sign * log_ratio, sign * clipped)
    k = m if policy_mask is None else m * policy_mask.float()  # the tokens in the geometric mean
    n_k = k.sum(-1, keepdim=True)
    seq_ratio = torch.exp((lr * k).sum(-1, keepdim=True) / n_k.clamp(min=1.0))  # (B, 1)
    seq_loss = -seq_adv * seq_ratio * (n_k > 0).float()
    metrics = {}
    if is_weight is not None:
        how = getattr(cfg, "gmpo_is_mean", "geometric")
        w = is_weight.detach().float()
        if how == "geometric":
            c = torch.exp((torch.log(w + 1e-10) * k).sum(-1, keepdim=True) / n_k.clamp(min=1.0))
        elif how == "arithmetic":
            c = (w * k).sum(-1, keepdim=True) / n_k.clamp(min=1.0)
        else:
            raise ValueError(f"loss.gmpo_is_mean = {how!r}: must be one of {', '.join(IS_MEANS)}")
        seq_loss = seq_loss * c
        metrics["gmpo/is_weight_mean"] = masked_mean(c.expand_as(logp).detach(), mask)
    per_token = seq_loss.expand_as(logp)
    with torch.no_grad():
        metrics.update({"gmpo/clip_frac": masked_mean(clipped != log_ratio, mask),
                        "ratio_mean": masked_mean(seq_ratio.expand_as(logp), mask)})
    return PolicyLossOutput(per_token, metrics, aggregation="grpo")
