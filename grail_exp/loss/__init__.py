"""The objective's pieces, one registry each, and their composition — this file only re-exports them.

- ``objective.py``: ``compose_objective``, the composition of one micro-batch's objective (its equation is there);
- ``policy.py`` and ``policies/``: the per-token surrogates (``loss.policy_loss``);
- ``aggregation.py``: how per-token losses become a scalar (``loss.loss_type``);
- ``kl.py``: KL estimators against the reference (``loss.kl_estimator``);
- ``correction.py``: the rollout importance-sampling weights (``rollout.is_correction.mode``);
- ``terms.py``, ``entropy_bonus.py``, ``sdpg.py``: auxiliary terms (``loss.terms``).

A new objective is one registered function plus its config keys; a new term is one file here (importing this package
imports every module in it and in ``policies/``, so each registers itself). The defaults are the GRAIL paper's GRPO (method
spec §2.2): ``ppo_clip`` with ε 0.2 / 0.28, ``dr_grpo``, β = 0.
"""

from __future__ import annotations

from grail_exp.compute.logprobs import entropy_from_logits, linear_logprob, selective_log_softmax
from grail_exp.loss import policies as _policies  # noqa: E402,F401  (registers the GRPO family's surrogates)
from grail_exp.loss.aggregation import AGGREGATIONS, AggregationContext, register_aggregation
from grail_exp.loss.correction import is_weights, needs_old_logprobs
from grail_exp.loss.kl import KL_ESTIMATORS, register_kl
from grail_exp.loss.objective import LossOutput, aggregator, compose_objective
from grail_exp.loss.policy import POLICY_LOSSES, PolicyLossOutput, masked_mean, register_policy_loss
from grail_exp.loss.terms import LOSS_TERMS, LossTerm, TermContext, build_terms, needs_reference, register_loss_term
from grail_exp.registry import import_modules

__all__ = [
    "AGGREGATIONS", "AggregationContext", "KL_ESTIMATORS", "LOSS_TERMS", "LossOutput", "LossTerm", "POLICY_LOSSES",
    "PolicyLossOutput", "TermContext", "aggregator", "build_terms", "compose_objective", "entropy_from_logits",
    "is_weights", "linear_logprob", "masked_mean", "needs_old_logprobs", "needs_reference", "register_aggregation",
    "register_kl", "register_loss_term", "register_policy_loss", "selective_log_softmax",
]

# Every module here registers what it defines (the terms: after the names above exist, they import this package's pieces).
import_modules(__name__, __path__)
