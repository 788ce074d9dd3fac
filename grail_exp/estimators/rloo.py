"""RLOO: the leave-one-out baseline (Ahmadian et al., Back to Basics, arXiv 2402.14740; Kool et al. 2019).

    A_i = r_i − (1/(G−1)) Σ_{j≠i} r_j  =  G/(G−1) · (r_i − mean_g(r))

Unbiased (the baseline does not depend on the sample it corrects); no std scaling."""

from __future__ import annotations

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@register_estimator("rloo", EstimatorConfig)
def rloo(inp: EstimatorInput, cfg) -> EstimatorOutput:
    G = inp.num_generations
    r = inp.rewards.float().view(-1, G)
    adv = (G * r - r.sum(1, keepdim=True)) / (G - 1)
    return EstimatorOutput(adv.reshape(-1), group_zero_std(inp.rewards, G))
