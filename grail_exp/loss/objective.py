"""The objective of one micro-batch: the pieces of ``grail_exp/loss/`` composed into the scalar to backpropagate.

    ρ_{i,t}   = exp(logp_{i,t} − logp^old_{i,t})
    Â_{i,t}   = sg(w_{i,t}) · A_i                      (w: the advantage scheme's weights; A_{i,t} for token estimators)
    ℓ_{i,t}   = f_{i,t} · ρ^IS_{i,t} · s(ρ_{i,t}, Â_{i,t}) + β · KL_{i,t}
    L         = aggregate(ℓ, m; L_max, K, N_tokens, R)   (+ Σ_k term_k, added by the update phase)

- s: the per-token surrogate ``loss.policy_loss`` (``policy.py`` and ``policies/``; PPO's clipped surrogate by
  default, arXiv 1707.06347, with DAPO's clip-higher, arXiv 2503.14476).
- ρ^IS: the detached rollout-correction weights (``correction.py``; TIS / IcePop / TRL's sequence mask).
- f: the product of the GRPO family's token masks (top-entropy arXiv 2506.01939, the off-policy sequence mask of
  DeepSeek-V3.2 arXiv 2512.02556; ``grail_exp/loss/masks.py``), 1 when they are off. As in TRL's GRPOTrainer it masks the
  surrogate only: the normaliser counts the unmasked loss mask m and β·KL stays on every loss token
  (``loss.family_mask_normaliser: unmasked``). ``kept`` folds f into m instead, so the normaliser counts the kept
  tokens and the KL term is dropped on masked ones.
- A loss that needs f and ρ^IS inside a per-sequence geometric mean (GMPO, arXiv 2507.20673; verl ``geo_mean``)
  registers with ``folds_token_weights`` and receives them instead of being multiplied by them.
- KL: ``loss.kl_estimator`` (``kl.py``; k3 = DeepSeekMath eq. 4) against the frozen reference, weighted by β =
  ``loss.beta``; ``loss.kl_bias_correction`` multiplies it by π_θ/π_old (TRL's ``use_bias_correction_kl``: the samples
  come from π_old).
- aggregate: ``loss.loss_type`` (``aggregation.py``), or the one a surrogate forces (GSPO, SAPO: per-sequence means),
  over the ``AggregationContext`` the update phase builds once per optimiser step: L_max, K accumulation steps, the
  step's loss tokens over all ranks, the world size R.

The method spec's §2 is this composition with the GRAIL paper's defaults (ppo_clip, ε 0.2 / 0.28, dr_grpo, β = 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grail_exp.loss.aggregation import AGGREGATIONS, AggregationContext
from grail_exp.loss.kl import KL_ESTIMATORS
from grail_exp.loss.policy import POLICY_LOSSES, PolicyLossOutput, masked_mean

FAMILY_MASK_NORMALISERS = ("unmasked", "kept")


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate (already divided for gradient accumulation)
    metrics: dict[str, torch.Tensor]  # detached scalars: masked means over this micro-batch's tokens
    per_token: torch.Tensor | None = None  # (B, T) ℓ before aggregation (diagnostics, terms)


def compose_objective(
    loss,  # the `loss` config node: policy_loss, loss_type, beta, kl_estimator and the surrogates' knobs
    ctx: AggregationContext,  # L_max, K, the step's global token count, R: built once per optimiser step
    logp: torch.Tensor,  # (B, T) log π_θ of the sampled tokens
    old_logp: torch.Tensor,  # (B, T) log π_old (== logp.detach() when k × μ == 1)
    token_advantages: torch.Tensor,  # (B, T) Â = sg(w) · A, detached
    mask: torch.Tensor,  # (B, T) m: 1 on tokens that carry loss
    *,
    ref_logp: torch.Tensor | None = None,  # (B, T) frozen reference; needed when loss.beta > 0
    is_weight: torch.Tensor | None = None,  # (B, T) ρ^IS, detached; None = 1
    policy_mask: torch.Tensor | None = None,  # (B, T) f, the family masks; None = off
) -> LossOutput:
    """L of one micro-batch (the module docstring's equation) and its detached diagnostics."""
    mask, policy_mask = family_mask_split(loss, mask, policy_mask)
    out, per_token = weighted_surrogate(loss, logp, old_logp, token_advantages.float(), mask, policy_mask, is_weight)
    metrics = dict(out.metrics)
    if loss.beta > 0.0:
        kl = kl_penalty(loss, logp, old_logp, ref_logp)
        per_token = per_token + loss.beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    value = AGGREGATIONS[out.aggregation or loss.loss_type](per_token, mask, ctx)
    metrics["loss_tokens"] = mask.float().sum()
    return LossOutput(value, metrics, per_token)


def family_mask_split(loss, mask: torch.Tensor, policy_mask: torch.Tensor | None):
    """(loss mask m, surrogate mask f) under ``loss.family_mask_normaliser``: ``unmasked`` keeps them apart (TRL);
    ``kept`` folds f into m, so the normaliser and the KL term see only the kept tokens."""
    if policy_mask is None:
        return mask, None
    normaliser = loss.family_mask_normaliser
    if normaliser == "kept":
        return mask * policy_mask.to(mask.dtype), None
    if normaliser != "unmasked":
        raise ValueError(f"loss.family_mask_normaliser = {normaliser!r}: must be one of {FAMILY_MASK_NORMALISERS}")
    return mask, policy_mask


def weighted_surrogate(loss, logp, old_logp, adv, mask, policy_mask,
                       is_weight) -> tuple[PolicyLossOutput, torch.Tensor]:
    """(the surrogate's output, f · ρ^IS · s per token). A surrogate registered with ``folds_token_weights`` takes f
    and ρ^IS itself (they enter its per-sequence geometric mean, not a product after it)."""
    fn = POLICY_LOSSES[loss.policy_loss]
    if fn.folds_token_weights:
        out = fn(logp, old_logp, adv, mask, loss, policy_mask=policy_mask, is_weight=is_weight)
        return out, out.per_token
    out = fn(logp, old_logp, adv, mask, loss)
    per_token = out.per_token
    if policy_mask is not None:
        per_token = per_token * policy_mask
    if is_weight is not None:
        per_token = per_token * is_weight
    return out, per_token


def kl_penalty(loss, logp, old_logp, ref_logp) -> torch.Tensor:
    """KL_{i,t} of ``loss.kl_estimator`` against the reference (× π_θ/π_old with ``loss.kl_bias_correction``)."""
    if ref_logp is None:
        raise ValueError("loss.beta > 0 needs reference log-probs")
    kl = KL_ESTIMATORS[loss.kl_estimator](logp, ref_logp)
    if loss.kl_bias_correction:
        kl = kl * torch.exp(logp - old_logp)
    return kl


def aggregator(loss, ctx: AggregationContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(per_token, mask) → scalar with ``loss.loss_type`` over ``ctx``: how auxiliary terms normalise themselves like
    the policy objective."""
    fn = AGGREGATIONS[loss.loss_type]
    return lambda per_token, mask: fn(per_token, mask, ctx)
