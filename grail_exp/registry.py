"""Name → object registries: how a config string (``advantage=grail``, ``loss.policy_loss=gspo``) finds its code.

Every pluggable kind (token-weight schemes, estimators, policy losses, aggregations, KL estimators, loss terms,
update backends, datasets, benchmarks) keeps one ``Registry``: a dict that refuses a name registered twice (naming
both modules) and, asked for a name it does not hold, names the ones it does. Its package calls ``import_modules``
once at import, so every module in the folder registers itself: a new method is one file there plus its YAML file in
``conf/``, with no import line to add anywhere (docs/add-a-method.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any


class UnknownNameError(KeyError):
    """A name no module registered (a ``KeyError``, so ``name in registry`` checks and old ``except KeyError`` work)."""

    def __str__(self) -> str:  # KeyError would print the message's repr
        return str(self.args[0])


class Registry(dict):
    """``name -> object`` for one kind of thing (``kind``: how errors name it, e.g. ``"advantage scheme"``)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, obj: Any) -> Any:
        """Register ``obj`` under ``name``; a name taken already is an error naming both places."""
        if name in self:
            raise ValueError(f"{self.kind} {name!r} registered twice: by {_where(self[name])} and by {_where(obj)} "
                             "(give one of them another name)")
        self[name] = obj
        return obj

    def register(self, *names: str, then: Callable[[Any], None] | None = None) -> Callable[[Any], Any]:
        """Decorator registering the decorated class or function under ``names``; ``then(obj)`` runs first (it sets
        what the kind's decorator attaches, e.g. a scheme's ``name`` and ``config_class``)."""

        def deco(obj):
            taken = [n for n in names if n in self]
            if taken:
                self.add(taken[0], obj)  # raises, naming both places
            if then is not None:
                then(obj)
            for n in names:
                self.add(n, obj)
            return obj

        return deco

    def __missing__(self, name: str):
        raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(map(str, self))) or 'none'}")


def _where(obj: Any) -> str:
    fn = getattr(obj, "fn", obj)  # an estimator's spec holds its function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def import_modules(package: str, path: Iterable[str], skip: Iterable[str] = ()) -> None:
    """Import every module of ``package`` (its ``__path__``) but those in ``skip``, so each registers itself.
    Sub-packages are left alone (a folder of data files, or a registry of its own that imports itself)."""
    skipped = set(skip)
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda i: i.name):
        if not info.ispkg and info.name not in skipped and not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")
