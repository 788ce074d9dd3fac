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


def backend_name() -> str:
    """The process group's backend (gloo, nccl), or "none" on one process without a group."""
    return str(torch.distributed.get_backend()) if _initialized() else "none"


def devices_per_node(devices) -> int:
    """Ranks per node that ``trainer.devices`` asks for: a count, or a list of device ids."""
    n = len(devices) if isinstance(devices, (list, tuple)) or type(devices).__name__ == "ListConfig" else int(devices)
    return max(1, n)


def configured_world_size(trainer_cfg) -> int:
    """The data-parallel world a config asks for: ``trainer.devices`` per node x ``trainer.num_nodes``."""
    return devices_per_node(trainer_cfg.devices) * max(1, int(trainer_cfg.get("num_nodes", 1) or 1))


def check_world_size(trainer_cfg) -> None:
    """Every rank, once the process group exists: the world is the configured one. A component that created a
    one-rank group of its own before Lightning (an in-process vLLM engine built too early did) makes every rank train
    alone on all the prompts and still exit 0; this turns that into one error line."""
    from grail_exp.errors import LayoutError

    want, got = configured_world_size(trainer_cfg), world_size()
    if got != want:
        raise LayoutError(f"this rank runs in a world of {got} process(es) (rank {rank()}, backend {backend_name()}) "
                          f"but trainer.devices x trainer.num_nodes = {want}: something created another process "
                          "group before the trainer's")


def check_disjoint_prompts(indices: list[int]) -> None:
    """Every rank, after its first rollout: no prompt was drawn by two ranks (a collective)."""
    from grail_exp.errors import LayoutError

    seen: dict[int, int] = {}
    for r, mine in enumerate(gather_to_all(list(indices))):
        for i in mine:
            if i in seen and seen[i] != r:
                raise LayoutError(f"ranks {seen[i]} and {r} both sampled prompt {i} of the data: the ranks do not "
                                  "split the prompts (every rank would train on the same data)")
            seen[i] = r
