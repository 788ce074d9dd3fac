"""The data-parallel world as the training phases see it: rank, size, and every collective the project issues.

Every collective of the package goes through this module (a layout test refuses ``torch.distributed`` collectives
anywhere else, the update backends' library internals and the rollout engine's own groups excepted), for two reasons:

- **The process group's device.** NCCL, the default group on GPUs, has no backend for CPU tensors ("No backend type
  associated with device type cpu"), while gloo takes them: a CPU run never shows the difference. Each helper here
  moves its tensor to the device the group communicates on (``collective_device``) and the result back to where the
  caller's tensor lives, so a caller may hand over a CPU scalar on any backend.
- **No shortcut at world size 1.** When a process group exists the helpers always call it, so a 1-GPU DDP / FSDP run
  sends every collective through NCCL, as the full layout will; only without any group (one plain process) is each
  helper the identity. Each call is counted by (operation, device type) in ``collective_devices()``, which the
  preflight prints.

Gradients are not reduced here: that is the update backend's business (``grail_exp.training.backends``); the local
backend's flat gradient all-reduce still goes through ``all_reduce_sum``.
"""

from __future__ import annotations

from collections import Counter

import torch

_CALLS: Counter = Counter()  # (operation, device type) -> calls made through a process group


def _initialized() -> bool:
    d = torch.distributed
    return d.is_available() and d.is_initialized()


def world_size() -> int:
    return torch.distributed.get_world_size() if _initialized() else 1


def rank() -> int:
    return torch.distributed.get_rank() if _initialized() else 0


def collective_device(backend: str | None = None) -> torch.device:
    """The device the default process group communicates tensors on: CPU when the group has a CPU backend (gloo, mpi,
    or a device map naming ``cpu:``, e.g. ``cpu:gloo,cuda:nccl``), else the current CUDA device (NCCL alone).
    ``backend``: the group's backend string (default: the live group's)."""
    backend = (backend if backend is not None else backend_name()).lower()
    entries = [e.strip() for e in backend.split(",") if e.strip()]
    mapped = {e.split(":", 1)[0]: e.split(":", 1)[1] for e in entries if ":" in e}
    plain = [e for e in entries if ":" not in e]
    if "cpu" in mapped or any(b in ("gloo", "mpi", "none") for b in plain):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def collective_devices() -> dict[str, int]:
    """``"<operation>@<device type>"`` -> how many times this process issued it through the process group."""
    return {f"{op}@{dev}": n for (op, dev), n in sorted(_CALLS.items())}


def _record(op: str, device: torch.device) -> None:
    _CALLS[(op, device.type)] += 1


def _on_group_device(op: str, x: torch.Tensor) -> torch.Tensor:
    dev = collective_device()
    _record(op, dev)
    return _to_device(x, dev)


def _to_device(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``x`` on ``dev`` (itself when already there): what a collective is handed."""
    return x if x.device == dev else x.to(dev)


def barrier() -> None:
    if _initialized():
        _record("barrier", collective_device())
        torch.distributed.barrier()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over ranks, in place (on any device: it travels on the group's device and is copied back)."""
    return _all_reduce(x, torch.distributed.ReduceOp.SUM, "all_reduce_sum") if _initialized() else x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """``x`` maximised elementwise over ranks, in place."""
    return _all_reduce(x, torch.distributed.ReduceOp.MAX, "all_reduce_max") if _initialized() else x


def _all_reduce(x: torch.Tensor, op, name: str) -> torch.Tensor:
    y = _on_group_device(name, x)
    torch.distributed.all_reduce(y, op=op)
    if y is not x:
        x.copy_(y)
    return x


def any_true(flag: bool) -> bool:
    """True on every rank when any rank passes True (a MAX all-reduce of a 0/1 tensor on the group's device); the
    identity without a process group. Every rank must call it at the same point."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return bool(all_reduce_max(t).item())


def max_over_ranks(value: int) -> int:
    """The largest of every rank's integer ``value`` (a MAX all-reduce of one int64 on the group's device); ``value``
    itself without a process group. Every rank must call it at the same point."""
    t = torch.tensor([int(value)], dtype=torch.int64)
    return int(all_reduce_max(t).item())


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``x`` from rank ``src`` on every rank, in place (travelling on the group's device)."""
    if not _initialized():
        return x
    y = _on_group_device("broadcast", x)
    torch.distributed.broadcast(y, src=src)
    if y is not x:
        x.copy_(y)
    return x


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not _initialized():
        return obj
    _record("broadcast_object", collective_device())
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, device=_object_device())
    return box[0]


def gather_object_to(obj, dst: int = 0) -> list | None:
    """Every rank's picklable ``obj`` in a list on rank ``dst`` (None elsewhere). Objects travel pickled: move tensors
    to the host first (a gathered CUDA tensor would be rebuilt on ``dst``'s GPU)."""
    if not _initialized():
        return [obj]
    _record("gather_object", collective_device())
    out: list | None = [None] * world_size() if rank() == dst else None
    torch.distributed.gather_object(obj, out, dst=dst)
    return out


def _object_device() -> torch.device | None:
    """Where pickled objects travel: the group's device (NCCL needs CUDA buffers; gloo CPU)."""
    dev = collective_device()
    return dev if dev.type == "cuda" else None


def failures(failure: BaseException | None, describe=None) -> dict[int, str]:
    """Every rank's failure at this point of the run, on every rank: ``{rank: one line}`` for each rank that passed an
    exception (``describe(exc)``, default ``"<type>: <message>"``), ``{}`` when none did. A collective: every rank calls
    it at the same point, so a rank that failed still meets the others here and they all learn it at once, instead of
    the others waiting for it in their next collective until the process group's timeout."""
    describe = describe or (lambda exc: f"{type(exc).__name__}: {exc}")
    mine = None if failure is None else describe(failure)
    reports = gather_to_all(mine) if _initialized() else [mine]
    return {r: line for r, line in enumerate(reports) if line is not None}


def check_same_tensors(specs: list[tuple[str, tuple, str]], what: str) -> None:
    """Every rank, before rank 0's tensors are broadcast into the others' (a collective): this rank's list of
    ``(name, shape, dtype)`` equals rank 0's, compared once, in order. A broadcast trusts both sides: a tensor of
    another dtype or shape on one rank would make the receiving side read the wrong number of bytes, hang or silently
    cast. On a difference every rank raises the same ``LayoutError``, naming the first tensor that differs and the
    ranks. The identity without a process group."""
    from grail_exp.errors import LayoutError

    if not _initialized():
        return
    specs = [(str(n), tuple(int(d) for d in shape), str(dtype)) for n, shape, dtype in specs]
    reference = broadcast_object(specs if rank() == 0 else None)
    mine = None if rank() == 0 else _first_difference(reference, specs)
    reports = {r: d for r, d in enumerate(gather_to_all(mine)) if d is not None}
    if reports:
        r, diff = min(reports.items())
        more = f" (and on rank(s) {', '.join(map(str, sorted(set(reports) - {r})))})" if len(reports) > 1 else ""
        raise LayoutError(f"{what}: {diff.format(rank=r)}{more}, before rank 0 broadcast its tensors: every rank must "
                          "build the same model (the same model.* values, dtype included, and trainer.strategy)")


def _first_difference(reference: list[tuple], mine: list[tuple]) -> str | None:
    """Where ``mine`` first departs from rank 0's ``reference``, as a template with ``{rank}``; None when equal."""
    for i, ((name0, shape0, dtype0), (name, shape, dtype)) in enumerate(zip(reference, mine)):
        if name != name0:
            return f"tensor {i} is {name} on rank {{rank}} but {name0} on rank 0"
        if (shape, dtype) != (shape0, dtype0):
            return f"{name} is {shape0} {dtype0} on rank 0 but {shape} {dtype} on rank {{rank}}"
    if len(mine) != len(reference):
        longer, who = (reference, "rank 0") if len(reference) > len(mine) else (mine, "rank {rank}")
        return (f"rank 0 holds {len(reference)} tensors and rank {{rank}} {len(mine)} (the first that only {who} "
                f"holds: {longer[min(len(reference), len(mine))][0]})")
    return None


def average_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Every metric averaged over the ranks that report it (rank 0 logs them)."""
    if not _initialized():
        return metrics
    gathered = gather_to_all(metrics)
    keys = set().union(*(g.keys() for g in gathered))
    return {k: sum(g[k] for g in gathered if k in g) / sum(k in g for g in gathered) for k in keys}


def gather_to_all(obj) -> list:
    """Every rank's ``obj``, on every rank (a list of world-size entries)."""
    if not _initialized():
        return [obj]
    _record("all_gather_object", collective_device())
    out: list = [None] * world_size()
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
