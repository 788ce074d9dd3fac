"""Probe points of a training run, for end-to-end tests that judge what every rank did, not what a log says.

``GRAIL_EXP_PROBE=package.module:Name`` (importable by the run, e.g. with ``PYTHONPATH=tests``) names a class; each
rank instantiates it once and calls its methods, when it has them, at these points:

    setup(module)                       the process group and the rollout engine exist (every rank)
    started(module)                     training starts: the weights are placed (and restored, when resuming)
    rollout(module, round_index)        a rollout batch was sampled, graded and scored
    synced(backend, engine)             the engine was given the policy's current weights (rollouts and evaluations)
    restored(module)                    a resumed run placed its checkpoint (weights, optimiser, RNG streams)
    step(module, step)                  an optimiser step was applied
    checkpointed(module, path)          every rank wrote its part of the checkpoint at ``path``
    evaluated(module, tag, result)      an evaluation finished (the gathered ``EvalResult``, same on every rank)
    closed(module)                      the closing (final checkpoint and evaluation) is done; the strategy's
                                        teardown comes next

A probe may run collectives (all ranks reach every point in the same order) and must leave the run's RNG streams as
it found them. Unset (every real run): ``emit`` returns at once.
"""

from __future__ import annotations

import importlib
import os

_probe = None
_spec = None


def emit(point: str, **kwargs) -> None:
    """Call the probe's method ``point`` with ``kwargs`` (nothing when ``GRAIL_EXP_PROBE`` is unset)."""
    global _probe, _spec
    spec = os.environ.get("GRAIL_EXP_PROBE")
    if not spec:
        return
    if _probe is None or spec != _spec:
        module_name, cls_name = spec.split(":", 1)
        _probe, _spec = getattr(importlib.import_module(module_name), cls_name)(), spec
    method = getattr(_probe, point, None)
    if callable(method):
        method(**kwargs)
