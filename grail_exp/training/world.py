"""The data-parallel world as the training phases see it: rank, size, and the few collectives they use.

Every helper is the identity on one process (no process group), so the phases read the same either way. Gradients are
not reduced here: that is the update backend's business (``grail_exp.training.backends``).
"""

from __future__ import annotations

import torch


def _initialized() -> bool:
    d = torch.distributed
    return d.is_available() and d.is_initialized()


def world_size() -> int:
    return torch.distributed.get_world_size() if _initialized() else 1


def rank() -> int:
    return torch.distributed.get_rank() if _initialized() else 0


def barrier() -> None:
    if world_size() > 1:
        torch.distributed.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over ranks, in place."""
    if world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


def average_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric averaged over the ranks that report it (rank 0 logs them)."""
    n = world_size()
    if n == 1:
        return metrics
    gathered: list = [None] * n
    torch.distributed.all_gather_object(gathered, metrics)
    keys = set().union(*(g.keys() for g in gathered))
    return {k: sum(g[k] for g in gathered if k in g) / sum(k in g for g in gathered) for k in keys}


def gather_to_all(obj) -> list:
    """Every rank's ``obj``, on every rank (a list of world-size entries)."""
    n = world_size()
    if n == 1:
        return [obj]
    out: list = [None] * n
    torch.distributed.all_gather_object(out, obj)
    return out
