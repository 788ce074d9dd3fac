"""The objective: per-token policy losses, KL estimators, aggregations, rollout correction, auxiliary terms.

    ρ_{i,t}  = exp(logp_{i,t} − logp^old_{i,t})
    Â_{i,t}  = sg(w_{i,t}) · A_i              (w from the advantage scheme; A_{i,t} for token-level estimators)
    ℓ_{i,t}  = f_{i,t} · ρ^IS_{i,t} · policy_loss(ρ, Â) + β · KL_{i,t}
    L        = aggregate(ℓ, mask) + Σ_k term_k

f is the product of the GRPO family's token masks (top-entropy, off-policy sequence mask: ``grail_exp/family.py``
``family_token_masks``; 1 when they are off). As in TRL's GRPOTrainer (and the DeepSeek-V3.2 formula) it masks the
policy term only: the aggregation's normaliser counts the unmasked loss mask and the β·KL term stays on every loss
token (``loss.family_mask_normaliser: unmasked``, the default). ``kept`` restores the behaviour before issue 23:
mask ← mask · f everywhere, so ``grpo`` / ``bnpo`` (and the losses that force a per-sequence mean) divide by the kept
tokens and the KL term is dropped on masked tokens. GMPO folds f and ρ^IS into its geometric mean instead
(``folds_token_weights``; TRL's GMPOTrainer, verl ``geo_mean``).

Each piece is a registry (``loss.policy_loss``, ``loss.kl_estimator``, ``loss.loss_type``,
``rollout.is_correction.mode``, ``loss.terms``) so a new objective is one function plus its config keys.
The defaults are the GRAIL paper's GRPO (method spec §2.2): ``ppo_clip`` with ε 0.2 / 0.28, ``dr_grpo``, β = 0.
``policy_loss`` below composes them for one micro-batch (the trainer and the tests call it).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from grail_exp.loss.aggregation import AGGREGATIONS, AggregationContext, register_aggregation
from grail_exp.loss.correction import is_weights
from grail_exp.loss.kl import KL_ESTIMATORS, register_kl
from grail_exp.logprobs import entropy_from_logits, linear_logprob, selective_log_softmax
from grail_exp.loss.policy import POLICY_LOSSES, PolicyLossOutput, masked_mean, register_policy_loss
from grail_exp.loss.terms import LOSS_TERMS, LossTerm, TermContext, build_terms, register_loss_term
from grail_exp.loss import policies as _family  # noqa: E402,F401  (registers the GRPO family's losses, issue 15)
from grail_exp.loss import entropy_bonus as _entropy_bonus  # noqa: E402,F401  (loss.terms.entropy_bonus)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided for gradient accumulation)
    metrics: dict[str, torch.Tensor]  # detached scalars: masked means over this micro-batch's tokens
    per_token: torch.Tensor | None = None  # (B, T) ℓ before aggregation (diagnostics, terms)


def policy_loss(
    logp: torch.Tensor,  # (B, T) log π_θ of the sampled tokens
    old_logp: torch.Tensor,  # (B, T) log π_old (== logp.detach() when num_iterations == 1)
    token_advantages: torch.Tensor,  # (B, T) sg(w) · A, detached
    mask: torch.Tensor,  # (B, T) 1 on tokens that carry loss
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    max_completion_length: int,
    accumulation_steps: int = 1,
    global_num_tokens: float | None = None,  # dapo only: masked tokens in the whole optimiser step (all ranks)
    ref_logp: torch.Tensor | None = None,  # (B, T) frozen reference, needed when beta > 0
    beta: float = 0.0,
    kl_estimator: str = "k3",
    name: str = "ppo_clip",
    loss_cfg=None,  # the full `loss` config node (knobs of losses beyond ppo_clip); built from the args when None
    is_weight: torch.Tensor | None = None,  # (B, T) detached rollout-correction weights
    world_size: int = 1,
    policy_mask: torch.Tensor | None = None,  # (B, T) family masks f (policy term only); None = no family mask
) -> LossOutput:
    cfg = loss_cfg if loss_cfg is not None else SimpleNamespace(epsilon=epsilon, epsilon_high=epsilon_high)
    if policy_mask is not None:
        normaliser = getattr(cfg, "family_mask_normaliser", "unmasked")
        if normaliser == "kept":  # before issue 23: the masks shrink the loss mask itself (normaliser and KL term)
            mask, policy_mask = mask * policy_mask.to(mask.dtype), None
        elif normaliser != "unmasked":
            raise ValueError(f"loss.family_mask_normaliser = {normaliser!r}: must be unmasked or kept")
    fn = POLICY_LOSSES[name]
    adv = token_advantages.float()
    if fn.folds_token_weights:
        out: PolicyLossOutput = fn(logp, old_logp, adv, mask, cfg, policy_mask=policy_mask, is_weight=is_weight)
        per_token = out.per_token
    else:
        out = fn(logp, old_logp, adv, mask, cfg)
        per_token = out.per_token
        if policy_mask is not None:
            per_token = per_token * policy_mask
        if is_weight is not None:
            per_token = per_token * is_weight
    metrics = dict(out.metrics)
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("loss.beta > 0 needs reference log-probs")
        kl = KL_ESTIMATORS[kl_estimator](logp, ref_logp)
        if getattr(cfg, "kl_bias_correction", False):
            # TRL use_bias_correction_kl: the samples come from π_old, so weight the estimator by ρ = π_θ/π_old.
            kl = kl * torch.exp(logp - old_logp)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    ctx = AggregationContext(max_completion_length, accumulation_steps, global_num_tokens, world_size)
    loss = AGGREGATIONS[out.aggregation or loss_type](per_token, mask, ctx)
    metrics["loss_tokens"] = mask.float().sum()
    return LossOutput(loss, metrics, per_token)


__all__ = [
    "AGGREGATIONS", "AggregationContext", "KL_ESTIMATORS", "LOSS_TERMS", "LossOutput", "LossTerm", "POLICY_LOSSES",
    "PolicyLossOutput", "TermContext", "build_terms", "entropy_from_logits", "is_weights", "linear_logprob",
    "masked_mean", "policy_loss", "register_aggregation", "register_kl", "register_loss_term", "register_policy_loss",
    "selective_log_softmax",
]

# Importing the term modules registers them (after the names above exist: they import this package's pieces).
from grail_exp.loss import sdpg as _sdpg  # noqa: E402,F401
