"""Advantage estimators: rewards of a rollout batch -> advantages A (the ``estimator=`` config group).

An estimator returns sequence advantages A_i (N,) — or token advantages A_{i,t} (N, C) — that the token-weight
scheme then reshapes: Â = sg(w)·A (broadcast over tokens for sequence advantages). Adding one = a function in this
package registered with ``@register_estimator("name", ConfigDataclass)`` (its equation and paper in the docstring),
a YAML file in ``conf/estimator/``, tests; importing the package imports every module in it (docs/add-a-method.md).
Inputs come as an ``EstimatorInput``: rewards grouped by prompt
(groups contiguous, G rollouts each), the completion mask and anything an estimator asks the trainer for
(``needs``: e.g. greedy-baseline rewards, per-token Σπ²).

Two optional hooks for estimators that change what is sampled (SCRL, ``estimators/scrl.py``):
- ``prompt_variants(cfg, problems, G, data_cfg)``: per problem, a list of ``PromptVariant``s whose counts sum to G;
  the trainer samples ``n`` rollouts of each, rows in that order (so a group stays contiguous).
- ``check_run(cfg.estimator, cfg)``: key-named errors for combinations with the rest of the run (``validate``).
The trainer fills ``extras`` with what ``needs`` names, from: ``completion_texts`` (decoded, special tokens
skipped), ``completion_token_ids`` (unpadded lists), ``tokenizer``, ``verifier`` (the run's ``MathVerifier``),
``rollout_variants`` (per row: the ``PromptVariant.info`` of the prompt it answered; None without variants).
An estimator may return ``rewards`` (N,) to replace the verifier's scalar rewards (stored with the batch, logged).
"""

from __future__ import annotations

from grail_exp.estimators.base import (  # noqa: F401  (the package's public names)
    ESTIMATORS,
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    EstimatorSpec,
    PromptVariant,
    estimate,
    group_zero_std,
    register_estimator,
)
from grail_exp.registry import import_modules

import_modules(__name__, __path__)  # every estimator module here registers itself

__all__ = ["ESTIMATORS", "EstimatorConfig", "EstimatorInput", "EstimatorOutput", "EstimatorSpec", "PromptVariant",
           "estimate", "group_zero_std", "register_estimator"]
