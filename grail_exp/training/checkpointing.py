"""Writing a checkpoint from every rank: each rank its own part, into one directory that appears atomically.

The layout is in ``grail_exp/checkpoint.py``. The order, on every rank (all of it a collective):

1. rank 0 names the temporary directory ``step-<N>.tmp-<pid>`` (removing any a crash left) and broadcasts it;
2. each rank writes ``rank-<r>.pt`` (its RNG streams, half-used rollout batch, its ZeRO partition); the backend writes
   the model and optimiser shards (FSDP: ``sharded/`` through torch.distributed.checkpoint);
3. the full Hugging Face weights: rank 0's ``save_pretrained`` where it holds them all (one process, DDP, ZeRO-1/2),
   else streamed into ``model.safetensors`` one gathered tensor at a time (FSDP; ``trainer.export_hf_weights``);
4. rank 0 writes the tokenizer and the shared ``training_state.pt``;
5. the ranks agree that every part was written (a failed write anywhere fails the checkpoint on every rank, with the
   previous one intact), rank 0 flushes, marks and renames the directory, and prunes old checkpoints.

Host memory per rank while writing: ``torch.save``'s copy of one storage at a time of its own part (RNG, buffer; ZeRO:
its flat fp32 partitions of 4 N / W bytes each), the shards' write buffers (torch.distributed.checkpoint copies one
tensor at a time), and under a streamed export one full tensor (the largest: the embedding). Nothing holds the full optimiser state, nor under FSDP the
full model. Several nodes need a shared filesystem: every rank writes into the same directory.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from grail_exp import faults
from grail_exp.checkpoint import (FORMAT, SHARDED_DIR, STATE_FILE, CheckpointError, prune, rank_file, save_torch,
                                  seal, write_error, write_safetensors_streaming)
from grail_exp.models import lora
from grail_exp.training import lora_checkpoint, probe
from grail_exp import world

log = logging.getLogger(__name__)


def write_checkpoint(root: Path, module, tokenizer, position: dict, keep_last: int | None, export_hf: bool,
                     final: bool = False) -> Path:
    """``root/step-<module.step>`` written by every rank (a collective), atomically; returns its path on every rank.
    ``export_hf``: write the full Hugging Face weights even where resume does not need them (FSDP). Under
    ``peft=lora`` the model part is the adapter instead, and ``final`` with ``peft.export_merged`` adds the merged
    model (``training/lora_checkpoint.py``)."""
    from grail_exp.training import state as run_state

    final = root / f"step-{module.step}"
    tmp = _temporary_dir(root, final)
    backend, optimizer, rank = module.backend, module.optimizers(), world.rank()
    own = {**run_state.rank_state(module, position), **backend.rank_checkpoint(optimizer)}
    failure = _attempt(save_torch, own, rank_file(tmp, rank))
    del own
    # Collectives from here on run on every rank whatever failed above, so a failed rank never hangs the others (a
    # failed export write still consumes the gathered tensors).
    backend.save_shards(optimizer, tmp / SHARDED_DIR)
    if lora.enabled(module.cfg):  # the adapter is the model part; the merged model on request
        failure = _attempt(lora_checkpoint.write_adapter, module, tmp if rank == 0 else None) or failure
        if final and module.cfg.peft.export_merged:
            merged = tmp / lora_checkpoint.MERGED_DIR if rank == 0 else None
            failure = _attempt(lora_checkpoint.write_merged, module, merged) or failure
    elif export_hf or not backend.model_in_shards:
        failure = _attempt(export_hf_weights, module, tmp if rank == 0 else None) or failure
    if rank == 0 and failure is None:
        failure = _attempt(_write_shared, module, tokenizer, position, tmp)
    if world.any_true(failure is not None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        exc = failure or OSError(f"another rank failed to write its part of {final}")
        raise write_error(exc, "checkpoint", final) from failure
    world.barrier()  # every rank's files are written and flushed
    sealed = None
    if rank == 0:
        sealed = _attempt(seal, tmp, final)
        if sealed is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            prune(root, keep_last)
    if world.any_true(sealed is not None):  # every rank leaves here, with the checkpoint in place or an error
        raise write_error(sealed or OSError(f"rank 0 could not put {final} in place"), "checkpoint", final) from sealed
    probe.emit("checkpointed", module=module, path=final)
    return final


def _attempt(fn, *args) -> OSError | None:
    """``fn(*args)``; the ``OSError`` it raised (a full disk, a lost mount) instead of raising it."""
    try:
        fn(*args)
    except OSError as exc:
        return exc
    return None


def _write_shared(module, tokenizer, position: dict, tmp: Path) -> None:
    """Rank 0: the tokenizer and ``training_state.pt``."""
    from grail_exp.training import state as run_state

    tokenizer.save_pretrained(tmp)
    shared = {**run_state.shared_state(module, position), **module.backend.shared_checkpoint(module.optimizers())}
    save_torch({**shared, "format": FORMAT}, tmp / STATE_FILE)
    faults.stall_checkpoint(module.step)  # test-only (GRAIL_EXP_FAULT)


def _temporary_dir(root: Path, final: Path) -> Path:
    """Rank 0's ``<final>.tmp-<pid>`` (created empty, stale ones removed), the same path on every rank."""
    tmp = None
    if world.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for left in root.glob("step-*.tmp-*"):  # left behind by a crash mid-write
            shutil.rmtree(left, ignore_errors=True)
        tmp = root / f"{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
    tmp = Path(world.broadcast_object(str(tmp) if tmp else None))
    if not tmp.is_dir():  # the ranks of several nodes do not share the run directory
        raise CheckpointError(f"rank {world.rank()} cannot see {tmp}, which rank 0 created: the checkpoint directory "
                              "must be on a filesystem every node shares (hydra.run.dir / paths.output_dir)")
    return tmp


def export_hf_weights(module, directory: Path | None) -> None:
    """The policy's full Hugging Face weights (config, generation config, ``model.safetensors``) into ``directory`` on
    rank 0 (None on the other ranks). Sharded: a collective streaming one gathered tensor at a time. Under
    ``peft=lora``: the merged model (``training/lora_checkpoint.py``)."""
    policy, backend = module.policy, module.backend
    if lora.is_lora(policy):
        lora_checkpoint.write_merged(module, directory)
        return
    if not backend.shards_parameters:
        if directory is not None:
            policy.save_pretrained(directory, safe_serialization=True)
        return
    if directory is not None:
        policy.config.save_pretrained(directory)
        if getattr(policy, "generation_config", None) is not None and policy.can_generate():
            policy.generation_config.save_pretrained(directory)
    names = _exported_names(policy)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in policy.state_dict().items() if name in names]
    tensors = ((name, t) for name, t in backend.full_tensors() if name in names)
    write_safetensors_streaming(directory / "model.safetensors" if directory is not None else None, specs, tensors)


def _exported_names(policy) -> set[str]:
    """State-dict names ``save_pretrained`` writes: a tied output layer is carried by the embedding."""
    names = set(policy.state_dict().keys())
    if getattr(policy.config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names
