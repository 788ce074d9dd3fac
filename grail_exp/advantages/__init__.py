"""Advantage schemes: how a sequence advantage A_i becomes token advantages  Â_{i,t} = sg(w_{i,t}) · A_i.

The contract (design.md): a scheme receives a micro-batch (``SchemeBatch``) **and the live model**,
and returns detached token weights ``w`` of shape (B, C) plus a dict of scalar diagnostics. GRPO
returns ones. Adding a scheme = one file here that registers itself with ``@register_scheme`` +
one YAML file in ``conf/advantage/`` + tests; nothing else changes.
"""

from __future__ import annotations

from grail_exp.advantages.base import (
    SCHEMES,
    AdvantageScheme,
    SchemeBatch,
    SchemeOutput,
    build_scheme,
    register_scheme,
    scheme_config_class,
)

# Importing the scheme modules registers them (spans also registers its checkpointable prepared state).
from grail_exp import spans as _spans  # noqa: E402,F401
from grail_exp.advantages import grail as _grail  # noqa: E402,F401
from grail_exp.advantages import grpo as _grpo  # noqa: E402,F401
from grail_exp.advantages import oar as _oar  # noqa: E402,F401
from grail_exp.advantages import rlsd as _rlsd  # noqa: E402,F401
from grail_exp.advantages import delta as _delta  # noqa: E402,F401
from grail_exp.advantages import shear as _shear  # noqa: E402,F401

__all__ = [
    "SCHEMES",
    "AdvantageScheme",
    "SchemeBatch",
    "SchemeOutput",
    "build_scheme",
    "register_scheme",
    "scheme_config_class",
]
