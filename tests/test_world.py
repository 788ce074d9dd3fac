"""The collectives module (grail_exp/world.py) on a group that has no CPU backend — NCCL, every GPU run's
default group — emulated on the CPU: a CPU tensor handed to such a group fails ("No backend type associated with
device type cpu"), which gloo, the group of every CPU run, never shows."""

from __future__ import annotations

import socket

import pytest
import torch

from grail_exp import world

NCCL_REFUSAL = "No backend type associated with device type cpu"


class OnGroupDevice(torch.Tensor):
    """A tensor that stands for one on the emulated group's CUDA device (its data stays on the host)."""


class NcclLikeGroup:
    """torch.distributed as two ranks of an NCCL group would present it to rank 0, where the other rank holds the same
    values: tensor collectives take only tensors on the group's device, object collectives return both ranks' objects."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def _take(self, op: str, t: torch.Tensor) -> None:
        if not isinstance(t, OnGroupDevice):
            raise RuntimeError(NCCL_REFUSAL)
        self.calls.append((op, "cuda"))

    def all_reduce(self, t, op=None, group=None):
        self._take("all_reduce", t)
        if op == torch.distributed.ReduceOp.MAX:
            return
        t.mul_(2)  # the other rank contributes the same values

    def broadcast(self, t, src=0, group=None):
        self._take("broadcast", t)

    def barrier(self, group=None):
        self.calls.append(("barrier", "cuda"))

    def all_gather_object(self, out, obj, group=None):
        self.calls.append(("all_gather_object", "cuda"))
        out[0] = out[1] = obj

    def gather_object(self, obj, out=None, dst=0, group=None):
        self.calls.append(("gather_object", "cuda"))
        out[0] = out[1] = obj

    def broadcast_object_list(self, box, src=0, group=None, device=None):
        assert device is not None and device.type == "cuda", "pickled objects must travel on the group's device"
        self.calls.append(("broadcast_object_list", "cuda"))


@pytest.fixture()
def nccl_like(monkeypatch):
    g = NcclLikeGroup()
    d = torch.distributed
    for name, value in {"is_available": lambda: True, "is_initialized": lambda: True, "get_world_size": lambda: 2,
                        "get_rank": lambda: 0, "get_backend": lambda group=None: "nccl"}.items():
        monkeypatch.setattr(d, name, value)
    for name in ("all_reduce", "broadcast", "barrier", "all_gather_object", "gather_object", "broadcast_object_list"):
        monkeypatch.setattr(d, name, getattr(g, name))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def to_device(x, dev):  # the emulated host-to-device copy
        return x.clone().as_subclass(OnGroupDevice) if dev.type == "cuda" else x

    monkeypatch.setattr(world, "_to_device", to_device)
    return g


def test_every_collective_helper_hands_a_cpu_tensor_to_the_group_on_its_device(nccl_like):
    x = torch.tensor([1.0, 2.5], dtype=torch.float64)
    out = world.all_reduce_sum(x)
    assert out is x and x.tolist() == [2.0, 5.0] and type(x) is torch.Tensor  # in place, on the caller's device
    assert world.all_reduce_max(torch.tensor([3])).tolist() == [3]
    assert world.any_true(False) is False and world.any_true(True) is True
    b = torch.tensor([7.0])
    assert world.broadcast(b) is b and b.tolist() == [7.0]
    assert world.broadcast_object({"a": 1}) == {"a": 1}
    assert world.gather_object_to({"r": 0}) == [{"r": 0}, {"r": 0}]
    assert world.gather_to_all(3) == [3, 3]
    assert world.average_metrics({"loss": 1.5}) == {"loss": 1.5}
    world.barrier()
    ops = [op for op, dev in nccl_like.calls]
    assert ops == ["all_reduce", "all_reduce", "all_reduce", "all_reduce", "broadcast", "broadcast_object_list",
                   "gather_object", "all_gather_object", "all_gather_object", "barrier"]
    assert {dev for _, dev in nccl_like.calls} == {"cuda"}


def test_the_training_phases_statistics_reduce_through_an_nccl_like_group(nccl_like):
    from grail_exp.training.rollout import RolloutPhase

    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    log_mass = torch.tensor([[-0.5, -0.25, -9.0], [-1.0, -1.0, -1.0]])
    stats = RolloutPhase.log_mass_stats(mask, log_mass)
    # both ranks hold this batch: sums (-0.75 over 1 sequence, 2 tokens) doubled, ratios unchanged
    assert stats == {"sampling/seq_log_kept_mass": -0.75, "sampling/token_log_kept_mass": -0.375}


@pytest.mark.parametrize("backend, device", [("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                             ("cuda:nccl", "cuda"), ("mpi", "cpu")])
def test_the_group_device_follows_the_backend_string(monkeypatch, backend, device):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    got = world.collective_device(backend)
    assert got.type == device and (device == "cpu" or got.index == 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def one_rank_group(monkeypatch, request):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    torch.distributed.init_process_group(request.param, rank=0, world_size=1)
    yield request.param
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("one_rank_group", ["gloo"], indirect=True)
def test_a_one_rank_group_still_runs_every_collective(one_rank_group):
    """A 1-GPU DDP / FSDP run must send its collectives through the group (NCCL there), not skip them."""
    before = dict(world.collective_devices())
    x = torch.tensor([2.0])
    world.all_reduce_sum(x)
    world.barrier()
    assert world.gather_to_all("a") == ["a"] and x.tolist() == [2.0]
    after = world.collective_devices()
    for op in ("all_reduce_sum@cpu", "barrier@cpu", "all_gather_object@cpu"):
        assert after.get(op, 0) == before.get(op, 0) + 1, (op, before, after)


@pytest.mark.parametrize("one_rank_group", ["cuda:gloo"], indirect=True)
def test_a_real_group_without_a_cpu_backend_refuses_cpu_tensors(one_rank_group, monkeypatch):
    """The fault the emulation above stands for, real on the CPU: a group registered for CUDA tensors only refuses a
    CPU tensor exactly as NCCL does — so a collective issued outside the world module fails here too."""
    with pytest.raises(RuntimeError, match=NCCL_REFUSAL):
        torch.distributed.all_reduce(torch.ones(1))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert world.collective_device(one_rank_group).type == "cuda"
