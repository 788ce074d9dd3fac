"""Update backends, one per parallel strategy, behind one interface (``base.UpdateBackend``); importing this package
imports every module in it, which registers each backend under its ``trainer.strategy`` names."""

from grail_exp.registry import import_modules
from grail_exp.training.backends.base import BACKENDS, StepResult, UpdateBackend, register_backend

import_modules(__name__, __path__)


def build_backend(cfg, module) -> UpdateBackend:
    """The backend serving ``trainer.strategy`` (``validate.py`` has checked the name)."""
    return BACKENDS[str(cfg.trainer.strategy)](cfg, module)


__all__ = ["BACKENDS", "StepResult", "UpdateBackend", "build_backend", "register_backend"]
