"""GRPO's group-relative advantage (DeepSeekMath arXiv 2402.03300 §4.1.2; Dr. GRPO arXiv 2503.20783).

    A_i = r_i − mean_g(r)                                  loss.scale_rewards = none   (Dr. GRPO; the GRAIL paper)
    A_i = (r_i − mean_g(r)) / (std_g(r) + 1e-4)            loss.scale_rewards = group  (DeepSeekMath)
    A_i = (r_i − mean_g(r)) / (std_batch(r) + 1e-4)        loss.scale_rewards = batch  (PPO-Lite arXiv 2508.08221)

std is the unbiased (Bessel) estimate and 1e-4 guards zero-variance groups, as in TRL's GRPOTrainer. The group
mean includes truncated completions (spec §2.2).
"""

from __future__ import annotations

from grail_exp.estimators.base import EstimatorConfig, EstimatorInput, EstimatorOutput, register_estimator
from grail_exp.estimators.group import group_advantages


@register_estimator("grpo", EstimatorConfig)
def grpo(inp: EstimatorInput, cfg) -> EstimatorOutput:
    adv, zero_std = group_advantages(inp.rewards, inp.num_generations, inp.scale_rewards)
    return EstimatorOutput(adv, zero_std)
