"""Update backends, one per parallel strategy, behind one interface (``base.UpdateBackend``); importing this package
registers them under their ``trainer.strategy`` names."""

from grail_exp.training.backends.base import BACKENDS, StepResult, UpdateBackend, register_backend
from grail_exp.training.backends import deepspeed as _deepspeed  # noqa: E402,F401  (registration)
from grail_exp.training.backends import fsdp as _fsdp  # noqa: E402,F401
from grail_exp.training.backends import local as _local  # noqa: E402,F401


def build_backend(cfg, module) -> UpdateBackend:
    """The backend serving ``trainer.strategy`` (``validate.py`` has checked the name)."""
    return BACKENDS[str(cfg.trainer.strategy)](cfg, module)


__all__ = ["BACKENDS", "StepResult", "UpdateBackend", "build_backend", "register_backend"]
