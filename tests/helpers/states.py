"""Exact equality of nested training states (what resume must restore bit for bit)."""

from __future__ import annotations

import torch


def states_equal(a, b) -> bool:
    """``a`` and ``b`` equal to the bit: tensors of the same dtype and values, dicts with the same keys, sequences of
    the same length, element by element; anything else by ``==``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return a == b
