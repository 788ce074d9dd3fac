"""Writing a checkpoint from every rank: each rank its own part, into one directory that appears atomically.

The layout is in ``grail_exp/checkpoint.py``. The order, on every rank (all of it a collective):

1. rank 0 names the temporary directory ``step-<N>.tmp-<pid>`` (removing any a crash left) and broadcasts it;
2. each rank writes ``rank-<r>.pt`` (its RNG streams, half-used rollout batch, its ZeRO partition); the backend writes
   the model and optimiser shards (FSDP: ``sharded/`` through torch.distributed.checkpoint);
3. the full Hugging Face weights in ``model.dtype``: rank 0's ``save_pretrained`` where it holds them all (one process,
   DDP, ZeRO-1/2), else streamed into ``model.safetensors`` one gathered tensor at a time (FSDP: in the final
   checkpoint, or in every one with ``trainer.export_hf_weights=every``);
4. rank 0 writes the tokenizer and the shared ``training_state.pt``;
5. the ranks agree that every part was written (``agree``), rank 0 flushes, marks and renames the directory, and
   prunes old checkpoints.

A failure on any rank — any exception, a full disk or a bug alike — is caught where it happens; the rank still takes
part in every collective that follows (a failed export still consumes the gathered tensors), and at the agreement point
every rank learns every rank's failure and raises the same ``CheckpointError``, one line naming each failed rank and its
error, with the previous checkpoint intact. A rank that raised alone would leave the others waiting in their next
collective until the process group's timeout (``trainer.dist_timeout_s``: 44 minutes for an 8B model). The same holds
for the shared-filesystem check (a rank that cannot see rank 0's directory) and the weights-only trajectory.

Host memory per rank while writing: ``torch.save``'s copy of one storage at a time of its own part (RNG, buffer; ZeRO:
its flat fp32 partitions of 4 N / W bytes each), the shards' write buffers (torch.distributed.checkpoint copies one
tensor at a time), and under a streamed export one full tensor (the largest: the embedding). Nothing holds the full
optimiser state, nor under FSDP the
full model. Several nodes need a shared filesystem: every rank writes into the same directory.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import shutil
from pathlib import Path

from grail_exp import faults, world
from grail_exp.checkpoint import (
    FORMAT,
    SHARDED_DIR,
    STATE_FILE,
    CheckpointError,
    prune,
    rank_file,
    save_torch,
    seal,
    write_dir_atomically,
    write_safetensors_streaming,
)
from grail_exp.models import lora
from grail_exp.training import lora_checkpoint, probe_points

log = logging.getLogger(__name__)


def write_checkpoint(root: Path, module, tokenizer, position: dict, keep_last: int | None, export_hf: bool,
                     final: bool = False) -> Path:
    """``root/step-<module.step>`` written by every rank (a collective), atomically; returns its path on every rank.
    ``export_hf``: write the full Hugging Face weights even where resume does not need them (FSDP). Under
    ``peft=lora`` the model part is the adapter instead, and ``final`` (the run's last checkpoint) with
    ``peft.export_merged`` adds the merged model (``training/lora_checkpoint.py``)."""
    target = root / f"step-{module.step}"
    tmp = _temporary_dir(root, target)
    backend, optimizer, rank = module.backend, module.optimizers(), world.rank()
    failure = _attempt(_write_own_part, module, position, tmp)
    # Collectives from here on run on every rank whatever failed above, so a failed rank never hangs the others.
    failure = _attempt(backend.save_shards, optimizer, tmp / SHARDED_DIR) or failure
    if lora.enabled(module.cfg):  # the adapter is the model part; the merged model on request
        failure = _attempt(lora_checkpoint.write_adapter, module, tmp if rank == 0 else None) or failure
        if final and module.cfg.peft.export_merged:
            merged = tmp / lora_checkpoint.MERGED_DIR if rank == 0 else None
            failure = _attempt(lora_checkpoint.write_merged, module, merged) or failure
    elif export_hf or not backend.model_in_shards:
        failure = _attempt(export_hf_weights, module, tmp if rank == 0 else None) or failure
    if rank == 0 and failure is None:
        failure = _attempt(_write_shared, module, tokenizer, position, tmp)
    agree(failure, "checkpoint", target, cleanup=tmp)  # also the point where every rank's files are written
    sealed = None
    if rank == 0:
        sealed = _attempt(seal, tmp, target)
        if sealed is None:
            prune(root, keep_last)
    agree(sealed, "checkpoint", target, cleanup=tmp)  # every rank leaves here, with the checkpoint in place or an error
    probe_points.emit("checkpointed", module=module, path=target)
    return target


def write_trajectory(root: Path, module, tokenizer, step: int) -> Path:
    """``root/step-<step>``: the weights-only trajectory checkpoint (``trainer.save_weights_only_every``), written by
    rank 0 while the other ranks take part in the (streamed) gathers; a collective that every rank leaves together,
    with the directory in place or the same ``CheckpointError``."""
    final = root / f"step-{step}"

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        export_hf_weights(module, tmp)
        tokenizer.save_pretrained(tmp)

    if world.rank() == 0:
        failure = _attempt(write_dir_atomically, final, write, "trajectory checkpoint")
    else:
        failure = _attempt(export_hf_weights, module, None)
    agree(failure, "trajectory checkpoint", final)
    return final


def _attempt(fn, *args) -> Exception | None:
    """``fn(*args)``; the exception it raised instead of raising it — any exception: an ``OSError`` (a full disk, a
    lost mount) or a bug that struck one rank — so that this rank still reaches the point where the ranks agree. A
    failure that is not an ``OSError`` leaves its traceback in this rank's log."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported by agree(), on every rank
        if not isinstance(exc, (OSError, CheckpointError)):
            log.error("rank %d: %s failed while writing a checkpoint", world.rank(), getattr(fn, "__name__", fn),
                      exc_info=exc)
        return exc
    return None


def _describe(exc: BaseException) -> str:
    """One line for a rank's failure: a full disk names the fix; a user error its own message; else the type too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ("no space left on the device: free disk space, lower trainer.keep_last_checkpoints or "
                "trainer.save_weights_only_every, or point hydra.run.dir at a larger disk")
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def agree(failure: Exception | None, what: str, final: Path, cleanup: Path | None = None) -> None:
    """Every rank (a collective): when any rank passed a failure, rank 0 removes ``cleanup`` and every rank raises the
    same ``CheckpointError``, naming each failed rank and its error; the previous complete checkpoint is intact."""
    failed = world.failures(failure, _describe)
    if not failed:
        return
    if cleanup is not None and world.rank() == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    ranks = "; ".join(f"rank {r}: {line}" for r, line in failed.items())
    raise CheckpointError(f"{what} {final} was not written ({ranks}); the previous complete checkpoint is intact") \
        from failure


def _write_own_part(module, position: dict, tmp: Path) -> None:
    """This rank's ``rank-<r>.pt``: its RNG streams, half-used rollout batch and the backend's per-rank entries."""
    from grail_exp.training import state as run_state

    faults.raise_in_checkpoint(module.step, world.rank())  # test-only (GRAIL_EXP_FAULT)
    own = {**run_state.rank_state(module, position), **module.backend.rank_checkpoint(module.optimizers())}
    save_torch(own, rank_file(tmp, world.rank()))


def _write_shared(module, tokenizer, position: dict, tmp: Path) -> None:
    """Rank 0: the tokenizer and ``training_state.pt``."""
    from grail_exp.training import state as run_state

    tokenizer.save_pretrained(tmp)
    shared = {**run_state.shared_state(module, position), **module.backend.shared_checkpoint(module.optimizers())}
    save_torch({**shared, "format": FORMAT}, tmp / STATE_FILE)
    faults.stall_checkpoint(module.step)  # test-only (GRAIL_EXP_FAULT)


def _temporary_dir(root: Path, final: Path) -> Path:
    """Rank 0's ``<final>.tmp-<pid>`` (created empty, stale ones removed), the same path on every rank, which every
    rank must see (several nodes: a shared filesystem); a rank that cannot is an error on every rank."""
    tmp, failure = None, None
    if world.rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for left in root.glob("step-*.tmp-*"):  # left behind by a crash mid-write
                shutil.rmtree(left, ignore_errors=True)
            tmp = root / f"{final.name}.tmp-{os.getpid()}"
            tmp.mkdir()
        except OSError as exc:
            failure = exc
    agree(failure, "checkpoint", final)
    tmp = Path(world.broadcast_object(str(tmp) if tmp else None))
    unseen = None if tmp.is_dir() else CheckpointError(
        f"cannot see {tmp}, which rank 0 created: the checkpoint directory must be on a filesystem every node shares "
        "(hydra.run.dir / paths.output_dir)")
    agree(unseen, "checkpoint", final, cleanup=tmp)
    return tmp


def export_hf_weights(module, directory: Path | None) -> None:
    """The policy's full Hugging Face weights in ``model.dtype`` (config, generation config, ``model.safetensors``) into
    ``directory`` on rank 0 (None on the other ranks). Sharded: a collective streaming one gathered tensor at a time,
    each shard cast to ``model.dtype`` before its gather (FSDP's fp32 master shards are not what evaluation, vLLM or
    the study read: a bf16 8B export is 16 GB, not 33). Every rank consumes the whole stream even when rank 0's
    writing fails (the failure is raised once the stream is done), so the others never wait for a gather rank 0 left."""
    import torch

    policy, backend = module.policy, module.backend
    if lora.is_lora(policy):  # the merged model (training/lora_checkpoint.py)
        lora_checkpoint.write_merged(module, directory)
        return
    if not backend.shards_parameters:  # the policy itself is held in model.dtype (fp32 masters live in the optimiser)
        if directory is not None:
            policy.save_pretrained(directory, safe_serialization=True)
        return
    dtype = getattr(torch, str(module.cfg.model.dtype))  # float32 | bfloat16 | float16 (validated)
    failure = None
    if directory is not None:
        try:
            config = copy.deepcopy(policy.config)
            config.dtype = dtype  # the dtype the weights are written in, which loaders read as the model's
            config.save_pretrained(directory)
            if getattr(policy, "generation_config", None) is not None and policy.can_generate():
                policy.generation_config.save_pretrained(directory)
        except Exception as exc:  # noqa: BLE001 - raised once the other ranks' gathers are done
            failure, directory = exc, None
    names = _exported_names(policy)
    specs = [(name, dtype if t.is_floating_point() else t.dtype, tuple(t.shape))
             for name, t in policy.state_dict().items() if name in names]
    tensors = ((name, t) for name, t in backend.full_tensors(dtype) if name in names)
    write_safetensors_streaming(directory / "model.safetensors" if directory is not None else None, specs, tensors)
    if failure is not None:
        raise failure


def _exported_names(policy) -> set[str]:
    """State-dict names ``save_pretrained`` writes: a tied output layer is carried by the embedding."""
    names = set(policy.state_dict().keys())
    if getattr(policy.config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names
