"""The weights an engine with its own copy (vLLM) receives, from every update backend: ``UpdateBackend.weight_chunks``
on 2 gloo ranks under trainer=fsdp (FULL_SHARD), fsdp_zero2 (SHARD_GRAD_OP), ddp and deepspeed_zero2.

Expected, independently of the backends: the full, unsharded state dict of the model every rank built (same seed),
tied ``lm_head.weight`` included, each tensor cast to the engine's dtype — bf16 here, exactly (casting is elementwise,
so casting shards then gathering equals casting the gathered tensor) — in chunks of at most ``max_bytes`` unless a
single tensor is larger, and produced lazily: the first chunk is ready before the later tensors are gathered.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from conftest import TINY_BUILD, compose

MAX_BYTES = 40_000  # bf16: the tiny model's 2 x 64 x 128 projections are 16 kB each; its 320 x 64 embedding is 41 kB
STRATEGIES = ("fsdp", "fsdp_zero2", "ddp", "deepspeed_zero2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.embedded import build_model, build_tokenizer

    torch.manual_seed(0)
    return build_model(dict(TINY_BUILD), build_tokenizer("qwen", ArithmeticTask()), seed=0).float()


class _Module:  # what a backend reads from the LightningModule
    def __init__(self, cfg, policy):
        self.cfg, self.policy = cfg, policy


def _chunks_of(strategy: str, tmp: str) -> dict:
    """Every chunk this rank receives for ``strategy`` (names, tensors), the reference state dict, and how many
    tensors had been gathered when the first chunk was ready."""
    from torch.distributed.tensor import DTensor

    from grail_exp.training.backends import BACKENDS

    overrides = [f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2"]
    if strategy == "deepspeed_zero2":
        overrides.append("model.dtype=bfloat16")
    cfg = compose(overrides)
    policy = _model()
    reference = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    backend = BACKENDS[str(cfg.trainer.strategy)](cfg, _Module(cfg, policy))
    backend.configure_model(policy)
    if strategy == "deepspeed_zero2":  # ZeRO-2 wraps the policy, whose (replicated) parameters become bf16
        backend.build_optimizer(policy)
    gathered = [0]
    full_tensor = DTensor.full_tensor

    def counting(self, *a, **k):
        gathered[0] += 1
        return full_tensor(self, *a, **k)

    DTensor.full_tensor = counting
    try:
        it = iter(backend.weight_chunks(torch.bfloat16, MAX_BYTES))
        chunks = [next(it)]
        after_first = gathered[0]
        chunks += list(it)
    finally:
        DTensor.full_tensor = full_tensor
    return {"chunks": [[(n, t.clone()) for n, t in c] for c in chunks], "reference": reference,
            "after_first": after_first, "gathered": gathered[0]}


def _worker(rank: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {s: _chunks_of(s, tmp) for s in STRATEGIES}
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    import torch.multiprocessing as mp

    tmp = str(tmp_path_factory.mktemp("weight_sync"))
    mp.spawn(_worker, args=(_free_port(), tmp), nprocs=2, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_backend_streams_the_full_weights_in_bounded_chunks(received, strategy):
    for rank in (0, 1):
        got = received[rank][strategy]
        ref = got["reference"]
        names = [n for c in got["chunks"] for n, _ in c]
        assert names == list(ref), "every tensor of the state dict once, in its order"
        assert "lm_head.weight" in names  # tied: named_parameters() would miss it and vLLM keep a stale output layer
        for chunk in got["chunks"]:
            size = sum(t.numel() * t.element_size() for _, t in chunk)
            assert size <= MAX_BYTES or len(chunk) == 1, (len(chunk), size)
            for name, t in chunk:
                assert t.dtype == torch.bfloat16 and not hasattr(t, "placements"), name  # plain, full tensors
                assert torch.equal(t, ref[name].to(torch.bfloat16)), name
        assert len(got["chunks"]) > 2
        if strategy.startswith("fsdp"):  # gathered tensor by tensor, lazily
            assert 0 < got["after_first"] < got["gathered"] and got["gathered"] >= len(ref) - 1
        else:
            assert got["gathered"] == 0  # replicated: the live tensors themselves


def test_the_ranks_receive_the_same_weights(received):
    for strategy in STRATEGIES:
        a, b = (received[r][strategy]["chunks"] for r in (0, 1))
        assert [[n for n, _ in c] for c in a] == [[n for n, _ in c] for c in b]
        assert all(torch.equal(x, y) for ca, cb in zip(a, b) for (_, x), (_, y) in zip(ca, cb))
