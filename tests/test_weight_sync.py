"""A sharded policy's collectives outside its plain forward and backward, on 2 gloo ranks (spawned processes):

1. The weights an engine with its own copy (vLLM) receives, from every update backend: ``UpdateBackend.weight_chunks``
   under trainer=fsdp (FULL_SHARD), fsdp_zero2 (SHARD_GRAD_OP), ddp and deepspeed_zero2. Expected, independently of the
   backends: the full, unsharded state dict of the model every rank built (same seed), tied ``lm_head.weight``
   included, each tensor cast to the engine's dtype — bf16 here, exactly (casting is elementwise, so casting shards
   then gathering equals casting the gathered tensor) — in chunks of at most ``max_bytes`` unless a single tensor is
   larger, and produced lazily: the first chunk is ready before the later tensors are gathered.
2. Work that one rank does and the other does not, which must run no collective: a probe gradient between a
   micro-batch's forward and backward on rank 0 only (GRAIL's probe rows differ between ranks), and HF generation
   with a different number of calls per rank (shares of an evaluation), under FULL_SHARD and SHARD_GRAD_OP. The
   process group's timeout is short, so a collective that one rank never joins fails the test in seconds instead of
   hanging it.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from helpers.compose import compose
from helpers.models import TINY_BUILD

MAX_BYTES = 40_000  # bf16: the tiny model's 2 x 64 x 128 projections are 16 kB each; its 320 x 64 embedding is 41 kB
STRATEGIES = ("fsdp", "fsdp_zero2", "ddp", "deepspeed_zero2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_model, build_tokenizer

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


# ---------------------------------------------------------------------------------------------- rank-dependent work
class _LightningLike(_Module):
    def manual_backward(self, loss):
        loss.backward()


def _uneven_work(strategy: str) -> dict:
    """Rank 0 probes (autograd.grad w.r.t. the embeddings) between forward and backward and generates twice; rank 1
    does neither probe nor the second generation. Returns this rank's gradient norm and generated token count."""
    import torch.distributed as dist

    from grail_exp.rollout.base import SamplingParams
    from grail_exp.rollout.hf import HFRolloutEngine
    from grail_exp.training.backends import BACKENDS

    cfg = compose([f"trainer={strategy}", "trainer.accelerator=cpu", "trainer.devices=2"])
    policy = _model().train()
    module = _LightningLike(cfg, policy)
    backend = BACKENDS[str(cfg.trainer.strategy)](cfg, module)
    backend.configure_model(policy)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 12), generator=g)
    mask, pos = torch.ones_like(ids), torch.arange(12).expand(2, 12)
    for _ in range(2):  # two micro-batches, each probed on rank 0 only
        logp, _, fwd = backend.forward(policy, ids, mask, pos, ids[:, 6:], hold_gathered=True)
        if rank == 0:
            (probe,) = torch.autograd.grad(-logp.sum(), fwd.embeds, retain_graph=True)
            assert torch.isfinite(probe).all()
        backend.backward(-logp.mean())
    grad_norm = float(sum(float(p.grad.full_tensor().norm()) ** 2 for p in policy.parameters()
                          if p.grad is not None) ** 0.5)
    engine = HFRolloutEngine(policy, _tokenizer())
    prompts = [[5, 6, 7, 8]] * (2 if rank == 0 else 1)
    with torch.no_grad(), backend.generation(engine):
        made = 0
        for p in prompts:  # rank 0: two generate() calls, rank 1: one; lengths differ too
            out = engine.generate([p], SamplingParams(n=1, temperature=1.0, max_new_tokens=6 + 4 * rank))
            made += sum(len(c.token_ids) for c in out)
    return {"grad_norm": grad_norm, "generated": made}


def _tokenizer():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_tokenizer

    return build_tokenizer("qwen", ArithmeticTask())


def _uneven_worker(rank: int, port: int, tmp: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    # a collective one rank never joins fails after 60 s instead of hanging (generous: two spawned interpreters
    # importing torch on a loaded 2-core machine reach the first collective within seconds)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    out = {s: _uneven_work(s) for s in ("fsdp", "fsdp_zero2")}
    torch.save(out, os.path.join(tmp, f"uneven{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_work_on_one_rank_only_runs_no_collective(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_uneven_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"uneven{r}.pt", weights_only=False) for r in (0, 1)]
    for strategy in ("fsdp", "fsdp_zero2"):
        assert got[0][strategy]["grad_norm"] == got[1][strategy]["grad_norm"] > 0  # reduce-scattered, then gathered
        assert got[0][strategy]["generated"] > 0 and got[1][strategy]["generated"] > 0
