"""GPG's advantage: group-centred rewards rescaled by the share of rows that carry a reward (Chu et al., GPG: A Simple
and Strong Reinforcement Learning Baseline, arXiv 2504.02546; verl ``gpg``).

    α = N / max(1, #{i : r_i ≠ 0}),      A_i = α · (r_i − mean_g(r)) / F_norm

α compensates the gradient shrinkage from rows with no signal; ``estimator.f_norm`` is F_norm (1, as verl).
Pair with ``loss.policy_loss=gpg``."""

from __future__ import annotations

from dataclasses import dataclass

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@dataclass
class GPGEstimatorConfig(EstimatorConfig):
    name: str = "gpg"
    f_norm: float = 1.0  # F_norm: constant divisor of the advantage (verl default 1.0)


@register_estimator("gpg", GPGEstimatorConfig,
                    check=lambda c: [] if c.f_norm > 0 else [f"f_norm = {c.f_norm!r}: must be > 0"])
def gpg(inp: EstimatorInput, cfg) -> EstimatorOutput:
    G = inp.num_generations
    r = inp.rewards.float()
    alpha = r.numel() / max(1, int(r.ne(0).sum()))
    grouped = r.view(-1, G)
    adv = alpha * (grouped - grouped.mean(1, keepdim=True)).reshape(-1) / cfg.f_norm
    return EstimatorOutput(adv, group_zero_std(inp.rewards, G), {"gpg_alpha": float(alpha)})
