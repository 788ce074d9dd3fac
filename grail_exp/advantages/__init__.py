"""Advantage schemes: how a sequence advantage A_i becomes token advantages  Â_{i,t} = sg(w_{i,t}) · A_i.

The contract (design.md): a scheme receives a micro-batch (``SchemeBatch``) **and the live model**,
and returns detached token weights ``w`` of shape (B, C) plus a dict of scalar diagnostics. GRPO
returns ones. Adding a scheme = one file here that registers itself with ``@register_scheme`` +
one YAML file in ``conf/advantage/`` (+ its tests); nothing else changes: importing this package imports every module
in it (docs/add-a-method.md).
"""

from __future__ import annotations

from grail_exp import spans as _spans  # noqa: E402,F401  (registers its checkpointable prepared state)
from grail_exp.advantages.base import (
    SCHEMES,
    AdvantageScheme,
    SchemeBatch,
    SchemeOutput,
    build_scheme,
    register_scheme,
    scheme_config_class,
)
from grail_exp.registry import import_modules

import_modules(__name__, __path__)  # every scheme module here registers itself

__all__ = [
    "SCHEMES",
    "AdvantageScheme",
    "SchemeBatch",
    "SchemeOutput",
    "build_scheme",
    "register_scheme",
    "scheme_config_class",
]
