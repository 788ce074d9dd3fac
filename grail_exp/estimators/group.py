"""Group-relative sequence advantages (method spec §2)."""

from __future__ import annotations

import torch

from grail_exp.errors import ConfigError


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i from the rewards of consecutive groups of G rollouts of the same prompt.

        A_i = r_i - mean_g(r)                                  scale_rewards = "none"  (Dr. GRPO; the paper)
        A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-4)            scale_rewards = "group" (DeepSeekMath GRPO)
        A_i = (r_i - mean_g(r)) / (std_batch(r) + 1e-4)        scale_rewards = "batch"

    std is the unbiased (Bessel) estimate and 1e-4 guards zero-variance groups, as in TRL's
    GRPOTrainer. The group mean includes truncated completions (spec §2.2).

    Args:
        rewards: (N,) with N = num_prompts * G, groups contiguous.
    Returns:
        advantages (N,) and a bool mask (N,) of rows whose group has zero reward variance.
    """
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    advantages = grouped - mean
    if scale_rewards == "group":
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    elif scale_rewards != "none":
        raise ConfigError(f"loss.scale_rewards must be group, batch or none, got {scale_rewards!r}")
    zero_std = (std < 1e-6).expand_as(grouped)
    return advantages.reshape(-1), zero_std.reshape(-1)
