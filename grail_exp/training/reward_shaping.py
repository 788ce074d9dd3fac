"""Reward shaping: what the rollout phase adds to the graded rewards r_i ∈ {0, 1} before the estimator sees them.

    overlong_penalty      r_i ← r_i + R_len(L_i)          DAPO soft overlong punishment (arXiv 2503.14476 §3.4),
                                                           ``reward.overlong_buffer``
    KLInRewardController  r_i ← r_i − β · Σ_t KL_{i,t}    KL folded into the reward with a fixed or adaptive β
                                                           (Ziegler et al. arXiv 1909.08593 §2.2), ``loss.kl_in_reward``

Both are off by default; ``grail_exp/training/rollout.py`` applies them (the KL per token from the loss's KL
estimators, ``grail_exp.loss.KL_ESTIMATORS``, between the rollout policy and the reference). Grading itself is
``grail_exp/grading/rewards.py``, which stays free of torch for its worker processes; these transforms are tensor work.
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
