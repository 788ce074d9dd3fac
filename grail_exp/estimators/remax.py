"""ReMax: the reward of the greedy completion as the baseline (Li et al., arXiv 2310.10505; verl ``remax``).

    A_i = r_i − r(greedy completion of prompt(i))

The trainer generates one greedy completion per prompt at rollout time and grades it (``needs=("greedy_rewards",)``,
grail_exp/training/rollout.py ``_estimator_extras``): one extra generation per prompt. Rows whose group has no reward
variance still get a signal when the greedy answer differs from the samples."""

from __future__ import annotations

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@register_estimator("remax", EstimatorConfig, needs=("greedy_rewards",))
def remax(inp: EstimatorInput, cfg) -> EstimatorOutput:
    if "greedy_rewards" not in inp.extras:
        raise ValueError("estimator=remax needs extras['greedy_rewards'] (one greedy reward per prompt)")
    baseline = inp.extras["greedy_rewards"].float().repeat_interleave(inp.num_generations)
    adv = inp.rewards.float() - baseline.to(inp.rewards.device)
    return EstimatorOutput(adv, group_zero_std(inp.rewards, inp.num_generations),
                           {"greedy_reward_mean": float(baseline.mean())})
