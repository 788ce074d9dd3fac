"""Trainer-side controls of the GRPO family (issue 15), called from grail_exp/training/module.py at marked hooks.

    overlong_penalty     DAPO soft overlong punishment, a reward transform (arXiv 2503.14476 §3.4)
    KLInRewardController r_i ← r_i − β·Σ_t KL_t with a fixed or adaptive β (Ziegler et al. arXiv 1909.08593 §2.2)
    informative_groups   DAPO dynamic sampling's filter: groups whose rewards are not all equal (§3.2)
    family_token_masks   top-entropy token mask (Wang et al. "Beyond the 80/20 rule", arXiv 2506.01939) and
                         off-policy sequence masking (OPSM, DeepSeek-V3.2 arXiv 2512.02556): the policy term's mask
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NORMALISERS = ("unmasked", "kept")  # loss.family_mask_normaliser
POPULATIONS = ("all", "off_policy_kept")  # loss.top_entropy_population


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """(N,) DAPO's length penalty, added to the reward:

        R_len(L) = 0                                  L ≤ L_max − L_cache
                 = −(L − (L_max − L_cache)) / L_cache · factor      L_max − L_cache < L ≤ L_max

    (a truncated completion has L = L_max and gets −factor)."""
    exceed = lengths.float() - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


class KLInRewardController:
    """β for KL-in-reward; ``adaptive`` follows Ziegler et al. (1909.08593 §2.2, verl's AdaptiveKLController):

        e = clip((KL − target) / target, −0.2, 0.2),    β ← β · (1 + e · n / horizon)

    with KL the mean per-token KL of the batch and n its number of sequences. The state survives checkpoints."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.coef = float(cfg.coef)

    def penalise(self, rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """rewards (N,), per-token kl (N, C), mask (N, C) -> penalised rewards and metrics; then updates β."""
        m = mask.float()
        seq_kl = (kl.float() * m).sum(-1)
        out = rewards.float() - self.coef * seq_kl.to(rewards.device)
        token_kl = float(((kl.float() * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean())
        metrics = {"kl_in_reward/coef": self.coef, "kl_in_reward/kl": token_kl,
                   "kl_in_reward/penalty_mean": float((self.coef * seq_kl).mean())}
        if self.cfg.controller == "adaptive":
            err = max(-0.2, min(0.2, (token_kl - self.cfg.target) / self.cfg.target))
            self.coef *= 1.0 + err * rewards.numel() / self.cfg.horizon
        return out, metrics

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, st: dict) -> None:
        self.coef = float(st["coef"])


def informative_groups(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(P,) bool: the group's rewards are not all equal (DAPO keeps 0 < #correct < G)."""
    r = rewards.view(-1, G)
    return (r.max(1).values - r.min(1).values) > 1e-6


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
        ``loss.family_mask_normaliser: kept`` (before issue 23), so terms and policy loss share a normaliser."""
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

    ``loss.top_entropy_population: off_policy_kept`` takes the quantile over the tokens O keeps instead (the order
    before issue 23). ``entropy`` (B, C) the token entropies, ``logp`` (B, C) the live log-probs (detached inside),
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
