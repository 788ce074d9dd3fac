"""Trainer-side controls of the GRPO family (issue 15), called from grail_exp/module.py at marked hooks.

    overlong_penalty     DAPO soft overlong punishment, a reward transform (arXiv 2503.14476 §3.4)
    KLInRewardController r_i ← r_i − β·Σ_t KL_t with a fixed or adaptive β (Ziegler et al. arXiv 1909.08593 §2.2)
    informative_groups   DAPO dynamic sampling's filter: groups whose rewards are not all equal (§3.2)
    token_loss_mask      top-entropy token mask (Wang et al. "Beyond the 80/20 rule", arXiv 2506.01939) and
                         off-policy sequence masking (OPSM, DeepSeek-V3.2 arXiv 2512.02556)
"""

from __future__ import annotations

import torch


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
