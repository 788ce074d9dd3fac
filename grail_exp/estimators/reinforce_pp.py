"""REINFORCE++ and REINFORCE++-baseline (Hu, arXiv 2501.03262; verl / OpenRLHF ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``).

With an outcome reward and γ = 1 the return-to-go of every token of completion i is r_i; the advantages are then
whitened over all valid tokens of the batch (token-weighted, unbiased variance, as verl's ``masked_whiten``):

    reinforce_plus_plus           A_i = (r_i − μ_tok) / sqrt(σ²_tok + 1e-8)
    reinforce_plus_plus_baseline  r'_i = r_i − mean_g(r);   A_i = (r'_i − μ'_tok) / sqrt(σ'²_tok + 1e-8)

with μ_tok = Σ_i n_i x_i / Σ_i n_i and σ²_tok the unbiased variance over the Σ n_i tokens (n_i = the row's loss tokens).
Batch whitening replaces GRPO's per-group std (the paper's argument: group std is a biased, prompt-level rescaling).
"""

from __future__ import annotations

import torch

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


def token_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) per-row values whitened over the valid tokens (row i counted n_i times)."""
    n = mask.float().sum(-1)
    total = n.sum().clamp(min=2.0)
    mean = (n * x).sum() / total
    var = (n * (x - mean) ** 2).sum() / (total - 1.0)
    return (x - mean) * torch.rsqrt(var + 1e-8)


@register_estimator("reinforce_plus_plus", EstimatorConfig)
def reinforce_plus_plus(inp: EstimatorInput, cfg) -> EstimatorOutput:
    adv = token_whiten(inp.rewards.float(), inp.completion_mask)
    return EstimatorOutput(adv, group_zero_std(inp.rewards, inp.num_generations))


@register_estimator("reinforce_plus_plus_baseline", EstimatorConfig)
def reinforce_plus_plus_baseline(inp: EstimatorInput, cfg) -> EstimatorOutput:
    r = inp.rewards.float().view(-1, inp.num_generations)
    centred = (r - r.mean(1, keepdim=True)).reshape(-1)
    return EstimatorOutput(token_whiten(centred, inp.completion_mask), group_zero_std(inp.rewards, inp.num_generations))
