"""Pass@k training: only the best completion of each group is credited, by its margin over the runner-up (Chen et al.,
Pass@k Training for Adaptively Balancing Exploration and Exploitation, arXiv 2503.19595 as cited by verl
``grpo_passk``).

    i* = argmax_{i∈g} r_i,     A_{i*} = (r_{(1)} − r_{(2)}) / (std_g(r) + 1e-6) [if norm_by_std],     A_i = 0 otherwise

(r_{(1)} ≥ r_{(2)} the two largest rewards of the group; ties go to the first row.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@dataclass
class PassKEstimatorConfig(EstimatorConfig):
    name: str = "grpo_passk"
    norm_by_std: bool = True  # divide the margin by the group's std (verl norm_adv_by_std_in_grpo, default true)


@register_estimator("grpo_passk", PassKEstimatorConfig)
def grpo_passk(inp: EstimatorInput, cfg) -> EstimatorOutput:
    G = inp.num_generations
    r = inp.rewards.float().view(-1, G)
    top2 = torch.topk(r, 2, dim=1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    if cfg.norm_by_std:
        margin = margin / (r.std(1) + 1e-6)
    adv = torch.zeros_like(r)
    adv[torch.arange(r.shape[0]), r.argmax(1)] = margin
    return EstimatorOutput(adv.reshape(-1), group_zero_std(inp.rewards, G))
