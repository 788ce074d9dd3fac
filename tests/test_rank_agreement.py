"""What the ranks must agree on, on real gloo ranks (spawned processes calling the package's collectives directly):

1. Broadcasts into skeletons: before rank 0's tensors are broadcast, the ranks compare their lists of (name, shape,
   dtype); a tensor of another dtype on rank 1 is one ``LayoutError`` on both ranks, naming it.
2. Checkpoints: a rank that cannot see rank 0's checkpoint directory, or a trajectory write that fails on rank 0 before
   its streamed export, fails on every rank with the same ``CheckpointError`` instead of one rank raising and the other
   waiting in a collective until the group's timeout.
3. The HF export of FSDP's fp32 shards is in ``model.dtype`` (bf16 here): the values of the fp32 weights rounded to
   bf16, which is what the checkpoint's ``config.json`` says.
4. The rank-0 load (the cheap variant of tests/test_host_memory.py): the job's ``build_parts`` gives rank 1 a skeleton on
   the meta device — no weights read, no host copy — and the backend places rank 0's weights on every rank (FSDP
   and DDP).
5. ZeRO-2 resume on 2 ranks (the cheap variant of e2e/test_ddp.py's 2-rank resume): each rank's partition written to
   its own file and read back into a fresh engine is the partition it wrote (and not the other rank's), and the next
   step then gives the same weights as the engine that never stopped.
6. FSDP shards resharded to another world size: written by 1 rank and read by 2, written by 2 and read by 1, the full
   model and optimiser state (torch's full state dicts, by name) equal those written.

The group's timeout (``helpers.gloo.GLOO_TIMEOUT_S``) bounds what a rank that waits for a collective the other never
joins would do before the fixes; no test asserts on time.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from helpers.compose import compose
from helpers.gloo import ModuleStub, free_port, init_rank, one_step, tiny_model, tokenizer

# the tensor rank 1 changes to bf16 in scenario 1 (a decoder layer's MLP projection)
CHANGED = "model.layers.0.mlp.up_proj.weight"


def _cfg(strategy: str, world: int, *extra: str):
    return compose([f"trainer={strategy}", "trainer.accelerator=cpu", f"trainer.devices={world}", *extra])


def _backend(cfg, policy):
    from grail_exp.training.backends import BACKENDS

    module = ModuleStub(cfg, policy)
    module.backend = BACKENDS[str(cfg.trainer.strategy)](cfg, module)
    module.backend.configure_model(policy)
    module.optimizer = module.backend.build_optimizer(policy)
    return module


def _error(fn, *args) -> dict:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


# ---------------------------------------------------------------------------------------------- the scenarios
def broadcast_into_skeletons(rank: int, tmp: Path, model_dir: str) -> dict:
    from grail_exp.training.backends.base import broadcast_module

    sha = {}
    same = tiny_model(seed=rank)  # rank 1 starts from other values: the broadcast must give it rank 0's
    broadcast_module(same)
    sha["after"] = _sha(same.state_dict().items())
    sha["rank0_seed"] = _sha(tiny_model(seed=0).state_dict().items())
    changed = tiny_model(seed=0)
    if rank == 1:
        w = dict(changed.named_parameters())[CHANGED]
        w.data = w.data.to(torch.bfloat16)
    return {**sha, "mismatch": _error(broadcast_module, changed)}


def unseen_checkpoint_dir(rank: int, tmp: Path, model_dir: str) -> dict:
    from grail_exp.training.checkpoint_writer import _temporary_dir

    root = tmp / "unseen" / "checkpoints"
    real = Path.is_dir
    if rank == 1:  # this rank's view of the filesystem lacks rank 0's directory (no shared filesystem)
        Path.is_dir = lambda p: False if ".tmp-" in p.name else real(p)
    try:
        err = _error(_temporary_dir, root, root / "step-3")
    finally:
        Path.is_dir = real
    left = sorted(p.name for p in root.glob("*")) if rank == 0 else None
    return {"error": err, "left": left}


def fsdp_export_and_trajectory(rank: int, tmp: Path, model_dir: str) -> dict:
    from safetensors.torch import load_file

    from grail_exp.training.checkpoint_writer import export_hf_weights, write_trajectory

    cfg = _cfg("fsdp", 2, "model.dtype=bfloat16")
    module = _backend(cfg, tiny_model(seed=0))  # fp32 master shards (FSDP's policy_overrides)
    out = {"held": str(next(module.policy.parameters()).dtype)}
    export = tmp / "export"
    if rank == 0:
        export.mkdir()
    export_hf_weights(module, export if rank == 0 else None)
    if rank == 0:
        got = load_file(export / "model.safetensors")
        ref = tiny_model(seed=0).state_dict()
        out["dtypes"] = sorted({str(t.dtype) for t in got.values()})
        out["equal_rounded"] = all(torch.equal(got[k], ref[k].to(torch.bfloat16)) for k in got)
        out["names"] = sorted(got)
        out["config_dtype"] = json.loads((export / "config.json").read_text()).get("dtype")
    tok, root = tokenizer(), tmp / "trajectory"
    out["written"] = _error(write_trajectory, root, module, tok, 1)
    config_cls = type(module.policy.config)
    real = config_cls.save_pretrained
    if rank == 0:  # rank 0's write fails before the streamed export that rank 1 is already gathering
        def broken(*a, **k):
            raise RuntimeError("the config could not be written")
        config_cls.save_pretrained = broken
    try:
        out["failed"] = _error(write_trajectory, root, module, tok, 2)
    finally:
        config_cls.save_pretrained = real
    out["trajectory"] = sorted(p.name for p in root.iterdir()) if rank == 0 else None
    return out


def rank0_load(rank: int, tmp: Path, model_dir: str) -> dict:
    import time

    from grail_exp import job
    from grail_exp.tracking import NullTracker

    out = {}
    for strategy in ("fsdp", "ddp"):
        cfg = _cfg(strategy, 2, f"model.name_or_path={model_dir}", "reward.num_workers=0", f"paths.root_dir={tmp}",
                   f"paths.cache_dir={tmp}/cache")
        parts = job.build_parts(cfg, None, None, NullTracker(), {}, time.perf_counter())
        policy = parts.policy
        held = sorted({t.device.type for t in [*policy.parameters(), *policy.buffers()]})
        module = ModuleStub(cfg, policy)
        from grail_exp.training.backends import BACKENDS

        module.backend = BACKENDS[str(cfg.trainer.strategy)](cfg, module)
        module.backend.configure_model(policy)
        out[strategy] = {"held_before_placement": held, "placed": _sha(sorted(module.backend.full_tensors()), tied=True),
                         "buffers": _sha(policy.named_buffers())}
        parts.verifier.close()
    from safetensors.torch import load_file

    out["file"] = _sha(sorted(load_file(Path(model_dir) / "model.safetensors").items()), tied=True)
    return out


def zero_resume(rank: int, tmp: Path, model_dir: str) -> dict:
    from grail_exp.checkpoint import load_torch, save_torch
    from grail_exp.training.backends.deepspeed import rank_optimizer_state

    cfg = _cfg("deepspeed_zero2", 2, "trainer.micro_batch_size=4")
    a = _backend(cfg, tiny_model(seed=0))
    one_step(a.backend, a.policy, a.optimizer, seed=1)
    path = tmp / f"zero-rank{rank}.pt"
    save_torch(a.backend.rank_checkpoint(a.optimizer), path)
    written = _tensors(rank_optimizer_state(a.backend.engine))
    b = _backend(cfg, tiny_model(seed=5))  # a fresh engine: its weights from the first's (resume reads them from HF)
    with torch.no_grad():
        for p, q in zip(b.policy.parameters(), a.policy.parameters()):
            p.copy_(q)
    b.backend.load_checkpoint(b.optimizer, tmp, {}, load_torch(path))
    restored = _tensors(rank_optimizer_state(b.backend.engine))
    one_step(a.backend, a.policy, a.optimizer, seed=2)
    one_step(b.backend, b.policy, b.optimizer, seed=2)
    return {"partition": _sha(enumerate(written)), "restored_equal": _all_equal(written, restored),
            "next_step_equal": all(torch.equal(p, q) for p, q in zip(a.policy.parameters(), b.policy.parameters())),
            "moved": any(not torch.equal(p, q) for p, q in zip(a.policy.parameters(),
                                                                tiny_model(seed=0).parameters()))}


def fsdp_write(rank: int, world: int, directory: Path) -> dict:
    """The shards of a trained FSDP policy and optimiser of ``world`` ranks into ``directory``; their digest."""
    from helpers.checkpoint_probe import _digest

    module = _backend(_cfg("fsdp", world), tiny_model(seed=0))
    one_step(module.backend, module.policy, module.optimizer, seed=3)
    digest = _digest(module)
    module.backend.save_shards(module.optimizer, directory / "sharded")
    return digest


def fsdp_read(rank: int, world: int, directory: Path) -> dict:
    """A fresh FSDP policy and optimiser of ``world`` ranks restored from ``directory``'s shards; their digest."""
    from helpers.checkpoint_probe import _digest

    module = _backend(_cfg("fsdp", world), tiny_model(seed=7))
    module.backend.load_checkpoint(module.optimizer, directory, {}, None)
    return _digest(module)


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _all_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _sha(pairs, tied: bool = False) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in pairs:
        if tied and name == "lm_head.weight":
            continue
        h.update(str(name).encode() + t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- the spawned ranks
TWO_RANK_SCENARIOS = (broadcast_into_skeletons, unseen_checkpoint_dir, fsdp_export_and_trajectory, rank0_load,
                      zero_resume)


def _ranks(rank: int, world: int, port: int, tmp: str, model_dir: str, read: str | None, write: str | None) -> None:
    """One rank: the two-rank scenarios (world 2), then FSDP shards read from ``read`` and written to ``write``."""
    import torch.distributed as dist

    init_rank(rank, world, port)
    tmp_path, out = Path(tmp), {}
    for scenario in TWO_RANK_SCENARIOS if world == 2 else ():
        try:
            out[scenario.__name__] = scenario(rank, tmp_path, model_dir)
        except Exception:  # noqa: BLE001 - the test reports it
            out[scenario.__name__] = {"crashed": traceback.format_exc()}
    if read:
        out["fsdp_read"] = fsdp_read(rank, world, Path(read))
    if write:
        Path(write).mkdir(parents=True, exist_ok=True)
        out["fsdp_write"] = fsdp_write(rank, world, Path(write))
    torch.save(out, os.path.join(tmp, f"world{world}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_model_dir):
    """World 1 writes FSDP shards; world 2 runs the scenarios, reads them and writes its own; world 1 reads those."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("ranks")
    one, two = str(tmp / "fsdp-world1"), str(tmp / "fsdp-world2")
    for world, read, write in ((1, None, one), (2, one, two), (1, two, None)):
        run = tmp / f"world{world}{'-read' if read else ''}"
        run.mkdir()
        mp.spawn(_ranks, args=(world, free_port(), str(run), str(tiny_model_dir), read, write), nprocs=world,
                 join=True)
    load = lambda run, world, r: torch.load(tmp / run / f"world{world}-rank{r}.pt", weights_only=False)  # noqa: E731
    return {"two": [load("world2-read", 2, r) for r in (0, 1)], "one_writes": load("world1", 1, 0),
            "one_reads": load("world1-read", 1, 0)}


def _scenario(ranks, name: str) -> list[dict]:
    got = [ranks["two"][r][name] for r in (0, 1)]
    for r, g in enumerate(got):
        assert "crashed" not in g, f"rank {r}:\n{g['crashed']}"
    return got


# ---------------------------------------------------------------------------------------------- the tests
def test_a_dtype_that_differs_on_one_rank_is_one_error_naming_the_tensor_on_every_rank(ranks):
    shape = tuple(dict(tiny_model().named_parameters())[CHANGED].shape)
    want = (f"the ranks' Qwen3ForCausalLM differ: {CHANGED} is {shape} torch.float32 on rank 0 but {shape} "
            "torch.bfloat16 on rank 1, before rank 0 broadcast its tensors")
    got = _scenario(ranks, "broadcast_into_skeletons")
    for r in (0, 1):
        assert got[r]["mismatch"]["type"] == "LayoutError", got[r]
        assert got[r]["mismatch"]["message"].startswith(want), got[r]["mismatch"]["message"]
        # the check lets a matching layout through: rank 1's other values became rank 0's
        assert got[r]["after"] == got[r]["rank0_seed"]


def test_a_rank_that_cannot_see_the_checkpoint_directory_fails_every_rank(ranks):
    got = _scenario(ranks, "unseen_checkpoint_dir")
    for r in (0, 1):
        assert got[r]["error"]["type"] == "CheckpointError", got[r]
        assert "(rank 1: cannot see " in got[r]["error"]["message"] and "shares" in got[r]["error"]["message"]
    assert got[0]["left"] == []  # rank 0 removed the directory it had created


def test_the_fsdp_export_is_in_the_models_dtype(ranks):
    got = _scenario(ranks, "fsdp_export_and_trajectory")
    assert got[0]["held"] == got[1]["held"] == "torch.float32"  # what FSDP trains: fp32 master shards
    assert got[0]["dtypes"] == ["torch.bfloat16"] and got[0]["config_dtype"] == "bfloat16"
    assert got[0]["equal_rounded"] and "model.embed_tokens.weight" in got[0]["names"]


def test_a_trajectory_write_that_fails_on_rank_0_fails_every_rank(ranks):
    got = _scenario(ranks, "fsdp_export_and_trajectory")
    for r in (0, 1):
        assert got[r]["written"]["type"] is None, got[r]  # the same write without the fault goes through
        assert got[r]["failed"]["type"] == "CheckpointError", got[r]
        assert "trajectory/step-2 was not written (rank 0: RuntimeError: the config could not be written)" in \
            got[r]["failed"]["message"], got[r]["failed"]["message"]
    assert got[0]["trajectory"] == ["step-1"]  # no step-2, no temporary directory left


def test_rank_1_receives_the_weights_rank_0_read_instead_of_reading_them(ranks):
    got = _scenario(ranks, "rank0_load")
    assert got[0]["fsdp"]["held_before_placement"] == ["cpu"]  # rank 0 read the file
    for strategy in ("fsdp", "ddp"):
        assert got[1][strategy]["held_before_placement"] == ["meta"], strategy  # rank 1: no weights, no host copy
        assert got[0][strategy]["placed"] == got[1][strategy]["placed"] == got[0]["file"], strategy
        assert got[0][strategy]["buffers"] == got[1][strategy]["buffers"], strategy  # RoPE tables included


def test_zero2_partitions_resume_on_their_own_ranks(ranks):
    got = _scenario(ranks, "zero_resume")
    assert got[0]["partition"] != got[1]["partition"]  # each rank holds its own part of the state
    for r in (0, 1):
        assert got[r]["restored_equal"] and got[r]["moved"], got[r]
        assert got[r]["next_step_equal"], got[r]  # the resumed engine continues exactly


def test_fsdp_shards_reshard_from_one_rank_to_two_and_back(ranks):
    one_written, one_read = ranks["one_writes"]["fsdp_write"], ranks["one_reads"]["fsdp_read"]
    for r in (0, 1):
        assert ranks["two"][r]["fsdp_read"] == one_written, r  # 1 -> 2
    assert one_read == ranks["two"][0]["fsdp_write"] == ranks["two"][1]["fsdp_write"]  # 2 -> 1
    assert one_written != ranks["two"][0]["fsdp_write"]  # another step on two ranks: a digest tells them apart
