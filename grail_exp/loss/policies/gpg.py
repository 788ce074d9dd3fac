"""GPG: the plain policy gradient, no ratio and no clip (Group Policy Gradient, arXiv 2504.02546; verl ``gpg``).

    ℓ_{i,t} = −Â_{i,t} · log π_θ(o_t)

Pair with ``estimator=gpg`` (α-rescaled group advantages) for the paper's method. Ignores old log-probs: with
μ > 1 it is not a trust-region method."""

from __future__ import annotations

from grail_exp.loss.policy import PolicyLossOutput, register_policy_loss


@register_policy_loss("gpg")
def gpg(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput:
    return PolicyLossOutput(-adv * logp)
