"""The estimator registry and its data types (``EstimatorInput`` in, ``EstimatorOutput`` out); see the package
docstring for the contract. The estimators import this file, never the package, so the registry sits below them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grail_exp.registry import Registry

ESTIMATORS: Registry = Registry("estimator")


@dataclass
class EstimatorInput:
    rewards: torch.Tensor  # (N,) scalar reward per rollout, groups of G contiguous
    num_generations: int  # G
    completion_mask: torch.Tensor  # (N, C) loss mask
    scale_rewards: str = "none"  # loss.scale_rewards (the grpo estimator's normalisation)
    extras: dict[str, Any] = field(default_factory=dict)  # what the estimator's ``needs`` asked for


@dataclass
class EstimatorOutput:
    advantages: torch.Tensor  # (N,) or (N, C)
    zero_std: torch.Tensor  # (N,) bool: the row's group has no reward variance (no signal)
    metrics: dict[str, float] = field(default_factory=dict)
    rewards: torch.Tensor | None = None  # (N,) scalar rewards replacing the verifier's (None = keep them)

    @property
    def sequence_advantages(self) -> torch.Tensor:
        """(N,) per-row advantage the schemes see (polarity filters): token advantages summarised by their mean."""
        a = self.advantages
        return a if a.dim() == 1 else a.sum(-1) / a.ne(0).sum(-1).clamp(min=1)


@dataclass(frozen=True)
class PromptVariant:
    """One prompt of a problem and how many of its G rollouts use it."""

    question: str  # the problem text shown to the model (before data.instruction)
    n: int  # rollouts of this prompt
    instruction: bool = True  # append data.instruction
    info: Any = None  # handed back to the estimator per row (``extras['rollout_variants']``)


@dataclass
class EstimatorSpec:
    fn: Callable[[EstimatorInput, Any], EstimatorOutput]
    config_class: type
    needs: tuple[str, ...] = ()  # extra inputs: "greedy_rewards" (ReMax), "sum_pi_squared" (OTB), ...
    check: Callable[[Any], list[str]] | None = None
    prompt_variants: Callable[..., list[list[PromptVariant]]] | None = None  # None = G rollouts of the problem
    check_run: Callable[[Any, Any], list[str]] | None = None  # (estimator cfg, run cfg) -> key-named errors
    # Run settings the method is defined with, {dotted key: value} (SCRL: the paper's loss): its conf/estimator file
    # sets them, and validate() refuses a run where a recipe, experiment file or override changed one.
    requires: dict[str, Any] = field(default_factory=dict)


@dataclass
class EstimatorConfig:
    name: str = "grpo"


def register_estimator(name: str, config_class: type = EstimatorConfig, needs: tuple[str, ...] = (),
                       check: Callable[[Any], list[str]] | None = None, prompt_variants=None, check_run=None,
                       requires: dict[str, Any] | None = None):
    def deco(fn):
        ESTIMATORS.add(name, EstimatorSpec(fn, config_class, needs, check, prompt_variants, check_run,
                                           dict(requires or {})))
        return fn

    return deco


def estimate(cfg, inp: EstimatorInput) -> EstimatorOutput:
    """Run the estimator named by ``cfg.name`` (the ``estimator`` config node)."""
    return ESTIMATORS[cfg.name].fn(inp, cfg)


def group_zero_std(rewards: torch.Tensor, G: int) -> torch.Tensor:
    grouped = rewards.view(-1, G)
    return (grouped.std(dim=1, keepdim=True) < 1e-6).expand_as(grouped).reshape(-1)
