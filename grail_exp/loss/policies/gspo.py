"""GSPO: the sequence-level importance ratio (Zheng et al., Group Sequence Policy Optimization, arXiv 2507.18071).

    s_i      = exp( (1/|o_i|) Σ_t (log π_θ − log π_old) )                        (length-normalised)
    gspo        ℓ_{i,t} = −min(s_i·Â_{i,t}, clip(s_i, 1 − ε, 1 + ε_high)·Â_{i,t})
    gspo_token  s_{i,t} = sg(s_i) · π_θ(o_t) / sg(π_θ(o_t))   (same value, gradient per token: GSPO §4.3)
    luspo       gspo's per-token loss, summed over tokens (per-sequence loss × |o_i|), mean over sequences
                (LUSPO arXiv 2602.05261: removes GSPO's length bias; TRL ``loss_type="luspo"``)

gspo / gspo_token force the ``grpo`` aggregation (mean over a sequence's tokens, then over sequences: the paper's
sequence objective; verl forces seq-mean-token-mean too); luspo forces ``seq_mean_token_sum``. The paper's clip
range is tiny because s_i is a geometric mean: ε = 3e-4, ε_high = 4e-4 (conf/algo/gspo.yaml).
With token advantages (GRAIL / OAR) prefer ``gspo_token``: its gradient weights each token by its own Â_{i,t}.
"""

from __future__ import annotations

import torch

from grail_exp.loss.policy import PolicyLossOutput, masked_mean, register_policy_loss


def _clipped(ratio, adv, mask, cfg) -> PolicyLossOutput:
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon, 1.0 + eps_hi)
    per_token = -torch.min(ratio * adv, clipped * adv)
    with torch.no_grad():
        r = ratio.expand_as(adv)
        hit = ((r < 1.0 - cfg.epsilon) & (adv < 0)) | ((r > 1.0 + eps_hi) & (adv > 0))
        metrics = {"clip_ratio/region_mean": masked_mean(hit, mask), "ratio_mean": masked_mean(r, mask)}
    return PolicyLossOutput(per_token, metrics)


def _seq_log_ratio(logp, old_logp, mask):
    """(B, 1) length-normalised sequence log-ratio (1/|o_i|) Σ_t (logp − old_logp) (GSPO's s_i in log space)."""
    m = mask.float()
    return ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


@register_policy_loss("gspo")
def gspo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    out = _clipped(torch.exp(_seq_log_ratio(logp, old_logp, mask)), adv, mask, cfg)
    out.aggregation = "grpo"
    return out


@register_policy_loss("gspo_token")
def gspo_token(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    log_s = _seq_log_ratio(logp, old_logp, mask).detach() + logp - logp.detach()
    out = _clipped(torch.exp(log_s), adv, mask, cfg)
    out.aggregation = "grpo"
    return out


@register_policy_loss("luspo")
def luspo(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    out = _clipped(torch.exp(_seq_log_ratio(logp, old_logp, mask)), adv, mask, cfg)
    out.aggregation = "seq_mean_token_sum"
    return out
