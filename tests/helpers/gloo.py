"""Ranks of a gloo process group in spawned processes (``torch.multiprocessing.spawn``), for tests that call the
package's collectives directly, without a training job: the group, the tiny model every rank builds alike, a module
stub with what the update backends read."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from helpers.models import TINY_BUILD

# A collective one rank never joins fails after this long instead of hanging the test. Generous: it also bounds how
# long a rank waits for a slower one (two interpreters importing torch, DeepSpeed or transformers on a loaded 2-core
# machine), which must never fail a correct run.
GLOO_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int) -> None:
    """This spawned process as rank ``rank`` of a ``world``-rank gloo group (one thread each)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT_S))


def tiny_model(seed: int = 0):
    """The tiny Qwen3 (``helpers.models.TINY_BUILD``) in fp32, the same on every rank for the same seed."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_model, build_tokenizer

    torch.manual_seed(seed)
    return build_model(dict(TINY_BUILD), build_tokenizer("qwen", ArithmeticTask()), seed=seed).float()


def tokenizer():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_tokenizer

    return build_tokenizer("qwen", ArithmeticTask())


class ModuleStub:
    """What an update backend and the checkpoint writer read from the LightningModule: the config, the policy, the
    backend, the optimiser; backward straight through autograd."""

    def __init__(self, cfg, policy):
        self.cfg, self.policy, self.backend, self.optimizer = cfg, policy, None, None

    def optimizers(self):
        return self.optimizer

    def manual_backward(self, loss):
        loss.backward()


def one_step(backend, policy, optimizer, seed: int = 0) -> None:
    """One optimiser step through ``backend`` on a fixed batch of token ids (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (2, 12), generator=g)
    mask, pos = torch.ones_like(ids), torch.arange(12).expand(2, 12)
    logp, _, _ = backend.forward(policy, ids, mask, pos, ids[:, 6:])
    backend.backward(-logp.float().mean())
    backend.step(optimizer, True)
    optimizer.zero_grad(set_to_none=True)
