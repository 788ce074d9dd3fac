"""Policy-loss registry: the per-token surrogate ℓ_{i,t} of each objective (verl ``core_algos`` style).

Every loss receives the token log-probs under the current policy ``logp`` (B, T), the rollout policy's
``old_logp`` (B, T) (== ``logp.detach()`` when μ = 1), the detached token advantages ``adv`` (B, T) = sg(w)·A
(the scheme's weights already applied), the loss ``mask`` (B, T) and the ``loss`` config node, and returns a
``PolicyLossOutput``: the per-token loss (aggregated afterwards by ``loss.loss_type``, see aggregation.py) and
detached diagnostics. Adding a loss = one function here with ``@register_policy_loss("name")``, its equation and
paper in the docstring, plus its knobs in ``LossConfig``.

The GRPO family's token masks (top-entropy, off-policy sequence mask; ``grail_exp/loss/masks.py``) and the rollout
importance-sampling weights multiply a loss's per-token output afterwards (``grail_exp.loss.policy_loss``). A loss
whose per-sequence weight is a geometric mean over tokens (GMPO) registers with ``folds_token_weights=True`` instead:
it is then called with the keyword arguments ``policy_mask`` and ``is_weight`` and folds them into that mean itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grail_exp.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


@dataclass
class PolicyLossOutput:
    per_token: torch.Tensor  # (B, T) loss per token (masked and aggregated by the caller)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # detached masked means
    # Some objectives only make sense with one aggregation (GSPO, SAPO: per-sequence means); None = loss.loss_type.
    aggregation: str | None = None


def register_policy_loss(name: str, folds_token_weights: bool = False) -> Callable[[Callable], Callable]:
    def attach(fn) -> None:
        fn.folds_token_weights = folds_token_weights  # takes policy_mask= / is_weight= itself (see the docstring)

    return POLICY_LOSSES.register(name, then=attach)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x·m / Σ m in float32 (token counts stay exact: a bf16 mask sum rounds 4,095 to 4,096)."""
    m = mask.float()
    return (x.float() * m).sum() / m.sum().clamp(min=1.0)


@register_policy_loss("ppo_clip")
def ppo_clip(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    """PPO's clipped surrogate with asymmetric clipping (PPO arXiv 1707.06347; clip-higher, DAPO arXiv 2503.14476).

        ρ = exp(logp − logp_old)
        ℓ = −min(ρ·Â, clip(ρ, 1 − ε, 1 + ε_high)·Â)

    ``loss.epsilon`` (ε, 0.2), ``loss.epsilon_high`` (ε_high; null = ε). This is what TRL's GRPOTrainer and the
    GRAIL reference compute (method spec §2.2, §3).

    Optional bounds for Â < 0 (both off by default, so the default objective is unchanged):
    ``loss.clip_ratio_c`` c > 1, dual-clip (Ye et al. arXiv 1912.09729; verl):  ℓ = min(ℓ, −c·Â) where Â < 0;
    ``loss.delta`` δ > 1, two-sided clipping (INTELLECT-2 arXiv 2505.07291; TRL): ρ in the unclipped branch is
    min(ρ, δ) — the same bound as dual-clip with c = δ."""
    eps_lo = cfg.epsilon
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    ratio = torch.exp(logp - old_logp)  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - eps_lo, 1.0 + eps_hi)
    delta = getattr(cfg, "delta", None)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # TRL two-sided clipping
    per_token = -torch.min(unclipped * adv, clipped * adv)
    c = getattr(cfg, "clip_ratio_c", None)
    if c is not None:  # dual-clip: for Â < 0 the loss is at most −c·Â (verl vanilla's clip_ratio_c)
        per_token = torch.where(adv < 0, torch.min(per_token, -c * adv), per_token)
    with torch.no_grad():
        # A token is "clipped" when the clipped branch is active (TRL's clip_ratio metrics).
        low = (ratio < 1.0 - eps_lo) & (adv < 0)
        high = (ratio > 1.0 + eps_hi) & (adv > 0)
        metrics = {"clip_ratio/low_mean": masked_mean(low, mask), "clip_ratio/high_mean": masked_mean(high, mask),
                   "clip_ratio/region_mean": masked_mean(low | high, mask), "ratio_mean": masked_mean(ratio, mask)}
    return PolicyLossOutput(per_token, metrics)
