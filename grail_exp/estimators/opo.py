"""OPO: the length-weighted group baseline, the variance-optimal one for on-policy sequence losses (Hao et al.,
On-Policy RL with Optimal Reward Baseline, arXiv 2505.23585; verl ``opo``).

    b_g = Σ_{j∈g} n_j r_j / Σ_{j∈g} n_j,      A_i = r_i − b_{g(i)}           (n_j = tokens of completion j)

No std scaling. A group whose completions carry no loss token falls back to the plain mean."""

from __future__ import annotations

import torch

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@register_estimator("opo", EstimatorConfig)
def opo(inp: EstimatorInput, cfg) -> EstimatorOutput:
    G = inp.num_generations
    r = inp.rewards.float().view(-1, G)
    n = inp.completion_mask.float().sum(-1).view(-1, G).to(r.device)
    total = n.sum(1, keepdim=True)
    b = torch.where(total > 0, (n * r).sum(1, keepdim=True) / total.clamp(min=1.0), r.mean(1, keepdim=True))
    return EstimatorOutput((r - b).reshape(-1), group_zero_std(inp.rewards, G))
