"""The GRPO family's token masks: which tokens of a micro-batch the policy term learns from (f in the policy
objective, ``grail_exp/loss/``), built by the update phase (``grail_exp/training/update.py``) per micro-batch.

    top_entropy_mask          the top-ρ entropy quantile of the valid tokens (Wang et al. "Beyond the 80/20 rule",
                              arXiv 2506.01939; ``loss.top_entropy_quantile``)
    off_policy_sequence_mask  OPSM: rows with A < 0 that drifted too far off-policy (DeepSeek-V3.2 arXiv 2512.02556;
                              ``loss.off_policy_mask_threshold``)
    family_token_masks        f = E · O, as TRL's GRPOTrainer builds it, and the mask the auxiliary terms use

The family's other controls live where they act: the reward transforms in ``grail_exp/training/reward_shaping.py``, dynamic
sampling's filter in ``grail_exp/training/rollout.py``, the losses in ``grail_exp/loss/policies/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NORMALISERS = ("unmasked", "kept")  # loss.family_mask_normaliser
POPULATIONS = ("all", "off_policy_kept")  # loss.top_entropy_population


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """(B, C) 1 on the valid tokens whose entropy is in the top-ρ quantile of this micro-batch's valid tokens
    (arXiv 2506.01939: ρ = 0.2 keeps the "forking" tokens). Uses the entropies the chunked log-prob pass returns."""
    m = mask.bool()
    if rho >= 1.0 or not m.any():
        return mask
    threshold = torch.quantile(entropy.detach().float()[m], 1.0 - rho)
    return mask * (entropy.detach() >= threshold).to(mask.dtype)


def off_policy_sequence_mask(seq_adv: torch.Tensor, logp: torch.Tensor, behaviour_logp: torch.Tensor,
                             mask: torch.Tensor, delta: float) -> torch.Tensor:
    """(B, C) OPSM: zero the rows with A < 0 whose mean KL(π_behaviour ‖ π_θ) ≈ mean_t (log π_b − log π_θ) exceeds δ
    (DeepSeek-V3.2 §3.1; TRL off_policy_mask_threshold). Negative samples far off-policy are the ones that destabilise."""
    m = mask.float()
    seq_kl = ((behaviour_logp.float() - logp.detach().float()) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    keep = (seq_adv >= 0) | (seq_kl <= delta)
    return mask * keep.unsqueeze(1).to(mask.dtype)


@dataclass
class FamilyMasks:
    """The family masks of one micro-batch (``family_token_masks``)."""

    policy: torch.Tensor | None  # (B, C) f: multiplies the policy term only (policy_loss(policy_mask=...)); None = off
    top_entropy: torch.Tensor | None  # (B, C) the top-entropy mask alone (TRL's entropy bonus sums H over mask × it)
    metrics: dict[str, float] = field(default_factory=dict)

    def term_mask(self, mask: torch.Tensor, loss_cfg) -> torch.Tensor:
        """The loss mask the auxiliary terms aggregate with: the unmasked one (TRL), or mask · f under
        ``loss.family_mask_normaliser: kept`` (the masks shrink the loss mask itself; docs/deviations.md), so terms
        and policy loss share a normaliser."""
        if self.policy is None or _get(loss_cfg, "family_mask_normaliser", "unmasked") != "kept":
            return mask
        return mask * self.policy.to(mask.dtype)


def _get(cfg, key, default):
    return cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)


def family_token_masks(entropy: torch.Tensor, logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, loss_cfg) -> FamilyMasks:
    """The policy term's mask f (B, C) of a micro-batch from ``loss.top_entropy_quantile`` (ρ) and
    ``loss.off_policy_mask_threshold`` (δ), as TRL's GRPOTrainer builds it:

        E   = top_entropy_mask(H, mask, ρ)          the quantile over every loss token of the micro-batch
        O   = off_policy_sequence_mask(A, logp, logp_behaviour, mask, δ)
        f   = E · O

    ``loss.top_entropy_population: off_policy_kept`` takes the quantile over the tokens O keeps instead (the mask
    after OPSM; docs/deviations.md). ``entropy`` (B, C) the token entropies, ``logp`` (B, C) the live log-probs (detached inside),
    ``behaviour_logp`` (B, C) the log-probs of the policy that sampled (the rollout engine's, else the old ones),
    ``advantages`` (B,) the sequence advantages, ``mask`` (B, C) the loss mask. Returns ``policy = None`` when both
    masks are off. Metrics are fractions of the micro-batch's loss tokens."""
    rho = float(_get(loss_cfg, "top_entropy_quantile", 1.0))
    delta = _get(loss_cfg, "off_policy_mask_threshold", None)
    if rho >= 1.0 and delta is None:
        return FamilyMasks(None, None, {})
    population = _get(loss_cfg, "top_entropy_population", "all")
    if population not in POPULATIONS:
        raise ValueError(f"loss.top_entropy_population = {population!r}: must be one of {', '.join(POPULATIONS)}")
    n0 = mask.float().sum().clamp(min=1.0)
    metrics: dict[str, float] = {}
    off_policy = None
    if delta is not None:
        off_policy = off_policy_sequence_mask(advantages, logp, behaviour_logp, mask, float(delta))
        metrics["opsm/masked_token_frac"] = 1.0 - float(off_policy.float().sum() / n0)
    entropy_mask = None
    if rho < 1.0:
        over = off_policy if (off_policy is not None and population == "off_policy_kept") else mask
        entropy_mask = top_entropy_mask(entropy, over, rho)
        metrics["top_entropy/kept_token_frac"] = float(entropy_mask.float().sum() / n0)
    if entropy_mask is None:
        policy = off_policy
    elif off_policy is None:
        policy = entropy_mask
    else:
        policy = entropy_mask * off_policy
    metrics["family/policy_token_frac"] = float(policy.float().sum() / n0)
    return FamilyMasks(policy, entropy_mask, metrics)
