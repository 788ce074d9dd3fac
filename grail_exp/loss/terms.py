"""Auxiliary loss terms: extra objectives added to the policy loss (``loss.terms``), one file + config each.

    L = L_policy + Σ_k  term_k(micro-batch)

A term is a class registered with ``@register_loss_term("name", ConfigDataclass)``. The trainer builds the enabled
terms from ``loss.terms`` (a mapping ``name -> {its config}``; an empty mapping = none) and calls each one per
micro-batch with a ``TermContext``: the live policy, the micro-batch, the policy forward's hidden states at the
completion window (so a term can build logits chunk by chunk without a (B, T, V) copy), the output layer, the
token log-probs / entropies (differentiable), the rollout, old and reference log-probs, the token advantages and the
step counters (optimiser steps, rollout batches). A term returns its contribution to the loss (already normalised like the policy loss — use
``ctx.aggregate``) and detached diagnostics, logged as ``<term>/<key>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from grail_exp.registry import Registry

LOSS_TERMS: Registry = Registry("loss term")


@dataclass
class TermContext:
    model: torch.nn.Module  # the live policy
    batch: Any  # grail_exp.advantages.SchemeBatch of this micro-batch (ids, masks, positions, texts, golds, step)
    hidden: torch.Tensor | None  # (B, C, d) last hidden states predicting the completion tokens (differentiable)
    head_weight: torch.Tensor  # (V, d) output layer (live; detach it for teacher-style passes)
    head_bias: torch.Tensor | None
    logp: torch.Tensor  # (B, C) float32 log π_θ(o_t), differentiable
    entropy: torch.Tensor  # (B, C) float32 token entropy, differentiable
    mask: torch.Tensor  # (B, C) loss mask
    token_advantages: torch.Tensor  # (B, C) sg(w)·A
    old_logp: torch.Tensor  # (B, C)
    ref_logp: torch.Tensor | None  # (B, C) frozen reference (loss.beta > 0 or a term that asks for it)
    sampler_logp: torch.Tensor | None  # (B, C) the rollout engine's log-probs
    temperature: float  # the rollout temperature (the policy log-probs are of z / T)
    step: int  # optimiser steps done so far
    aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (per_token, mask) -> scalar, like the policy loss
    tokenizer: Any = None
    extras: dict = field(default_factory=dict)
    # 1-based index of the rollout batch being trained on (1 for the run's first; constant over the optimiser steps
    # of one rollout batch): the official SDPG / RLSD trainers' ``global_steps``. None = step + 1 (exact when every
    # rollout batch gives one optimiser step). Read it through ``rollout_index()``.
    rollout_step: int | None = None
    top_entropy_mask: torch.Tensor | None = None  # (B, C) family.family_token_masks' top-entropy mask (None = off)
    share_prompts: bool = False  # teacher-style forwards compute each distinct prompt once (trainer.share_prompts)

    def rollout_index(self) -> int:
        return self.rollout_step if self.rollout_step is not None else self.step + 1


class LossTerm:
    name: ClassVar[str]
    config_class: ClassVar[type]
    needs_reference: ClassVar[bool] = False  # the trainer then loads the frozen reference model and its log-probs
    # Run settings the term is defined with, {dotted key: value}; validate() refuses a run that changes one. None of
    # the shipped terms has any.
    requires: ClassVar[dict[str, Any]] = {}

    def __init__(self, cfg, tokenizer=None, model_cfg=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_cfg = model_cfg

    @staticmethod
    def check_config(cfg) -> list[str]:
        return []

    def __call__(self, ctx: TermContext) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    # Stateful terms (an adaptive coefficient) save and restore their state with checkpoints (module.py saves
    # ``{name: term.state_dict()}`` in the training state). Stateless terms keep these defaults.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def register_loss_term(name: str, config_class: type):
    def attach(cls) -> None:
        cls.name, cls.config_class = name, config_class

    return LOSS_TERMS.register(name, then=attach)


def typed_term_config(cls, node):
    """A term's config node merged into its typed schema, interpolations (``${data.instruction}``, ...) resolved
    against the root config first (the merged copy no longer has the root to resolve them)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    node = {k: v for k, v in (node or {}).items() if k != "enabled"}  # build_terms' on/off switch, not a term key
    return OmegaConf.merge(OmegaConf.structured(cls.config_class), node)


def needs_reference(cfg, terms=None) -> bool:
    """Whether a run needs the frozen reference model π_ref: the KL penalty (``loss.beta > 0``), the KL in the reward
    (``loss.kl_in_reward.enabled``) or a loss term that reads it (``needs_reference``). ``terms``: the built terms, or
    None to look their names up in ``loss.terms`` (the memory planner, before anything is built). The one place that
    decides it: loading the reference, its log-probs in the rollout phase, and the plan all ask here."""
    loss = cfg.loss
    if loss.beta > 0 or (loss.get("kl_in_reward") or {}).get("enabled", False):
        return True
    if terms is None:
        terms = [LOSS_TERMS[name] for name in (loss.get("terms") or {}) if name in LOSS_TERMS]
    return any(getattr(t, "needs_reference", False) for t in terms)


def build_terms(terms_cfg, tokenizer=None, model_cfg=None) -> list[LossTerm]:
    """The enabled terms of ``loss.terms`` (a mapping name -> config), in a stable order."""
    out = []
    for name in sorted((terms_cfg or {}).keys()):
        node = terms_cfg[name]
        if node is None or (hasattr(node, "get") and node.get("enabled", True) is False):
            continue
        cls = LOSS_TERMS[name]
        typed = typed_term_config(cls, node)
        out.append(cls(typed, tokenizer, model_cfg))
    return out
