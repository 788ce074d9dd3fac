"""KL estimators between the policy and a frozen reference, per sampled token (Schulman, "Approximating KL").

With δ = logp_ref − logp (the sample comes from π_θ):

    k1 = −δ                       unbiased, can be negative
    k2 = δ² / 2                   low variance, biased
    k3 = exp(δ) − δ − 1           unbiased and ≥ 0 (DeepSeekMath eq. 4; TRL's and the GRAIL reference's estimator)

``loss.kl_estimator`` picks one; ``loss.beta`` scales it in the loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grail_exp.registry import Registry

# name -> fn(logp, ref_logp) -> (B, T) per-token KL
KL_ESTIMATORS: Registry = Registry("KL estimator")


def register_kl(name: str) -> Callable[[Callable], Callable]:
    return KL_ESTIMATORS.register(name)


@register_kl("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@register_kl("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (ref_logp - logp) ** 2


@register_kl("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


# --- the GRPO family's estimators (verl's kl_penalty names) ----------------------------------------------------------
@register_kl("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|log π − log π_ref| (verl ``abs``)."""
    return (logp - ref_logp).abs()


def _straight_through(value_fn):
    """Forward value of ``value_fn``, gradient of k2 (verl's ``k1+`` / ``k3+``): k2 + sg(value − k2). k2's gradient
    (log π − log π_ref)·∇log π is the unbiased gradient of KL(π‖π_ref) in expectation, whichever value is logged."""

    def fn(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        low_var = k2(logp, ref_logp)
        return low_var + (value_fn(logp, ref_logp) - low_var).detach()

    return fn


register_kl("k1+")(_straight_through(k1))
register_kl("k3+")(_straight_through(k3))
