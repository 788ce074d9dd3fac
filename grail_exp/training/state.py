"""What exact resume needs besides the weights: counters, every rank's RNG streams and half-used rollout batch, the
optimiser state (through the update backend), the scheduler, and the phases' own state.

The per-rank layout (``format`` 2; tensors and plain containers only, loaded with ``weights_only=True``):

- ``training_state.pt`` (rank 0, read by every rank): ``format``, ``step``, ``round``, ``world_size``, ``strategy``,
  ``mid_round`` (a half-used rollout batch is in the rank files), ``scheduler``, the rollout phase's
  ``prompt_cursor`` / ``kl_controller`` / ``logp_diff_history``, the update phase's ``nonfinite_total`` /
  ``nonfinite_in_a_row``, ``terms``, ``mlflow_run_id``, and the backend's shared entries (``optimizer`` where every rank
  holds all of it);
- ``rank-<r>.pt`` (rank r alone): ``rng``, ``scheme_generator``, ``buffer``, and the backend's per-rank entries (the
  ZeRO partition);
- the backend's shards (FSDP: ``sharded/``).

The older layout kept everything in ``training_state.pt``: ``ranks`` (per rank: ``rng``, ``scheme_generator``,
``buffer``) and the whole ``optimizer``; states older still (single process) kept ``rng`` / ``scheme_generator`` /
``buffer`` at the top level. Both still resume, on the world size that wrote them.

``checkpoint_dir`` is added to a loaded state (never saved): the directory it came from.
"""

from __future__ import annotations

import logging
from pathlib import Path

from grail_exp import world
from grail_exp.checkpoint import CheckpointError, load_torch, rank_file, rng_state, set_rng_state
from grail_exp.training.batch import TrainingBatch

log = logging.getLogger(__name__)


def per_rank(state: dict) -> bool:
    """The state is of the per-rank layout (each rank's part in its own file)."""
    return int(state.get("format", 1)) >= 2


def rank_part(state: dict | None, rank: int) -> dict | None:
    """This rank's part of a training state (per-rank layout: read from its own file; None when the checkpoint was
    written by fewer ranks)."""
    if state is None:
        return None
    if per_rank(state):
        path = rank_file(Path(state["checkpoint_dir"]), rank)
        return load_torch(path) if rank < int(state["world_size"]) else None
    if "ranks" in state:
        return state["ranks"][rank]
    return {"rng": state["rng"], "scheme_generator": state["scheme_generator"], "buffer": state.get("buffer")}


def pack_buffer(batch: TrainingBatch, stats: dict, round_index: int, next_index: int) -> dict:
    """A rollout batch with optimiser steps left (μ > 1), kept in the checkpoint so resume continues it."""
    return {"round": round_index, "next_iteration": next_index, "stats": dict(stats), "batch": batch.to_state(),
            "prepared": batch.prepared}


def unpack_buffer(buf: dict, device) -> tuple[TrainingBatch, dict, int]:
    batch = TrainingBatch.from_state(buf["batch"], device, prepared=buf.get("prepared"))
    return batch, buf["stats"], buf["next_iteration"]


def rank_state(module, position: dict) -> dict:
    """This rank's own part of a checkpoint at ``position`` (no collective): its RNG streams and half-used batch."""
    return {"rng": rng_state(), "scheme_generator": module.scheme_generator.get_state(), "buffer": position["buffer"]}


def shared_state(module, position: dict) -> dict:
    """What every rank shares at ``position`` (rank 0 writes it; no collective)."""
    return {
        "step": module.progress.step,
        "round": position["round"],
        "world_size": world.world_size(),
        "strategy": str(module.cfg.trainer.strategy),
        "mid_round": position["buffer"] is not None,
        "scheduler": module.lr_schedulers().state_dict(),
        **module.update.state_dict(),
        **module.rollout.state_dict(),
        "mlflow_run_id": getattr(module.tracker, "run_id", None),
        "terms": {t.name: t.state_dict() for t in module.terms},
    }


def restore(module, state: dict, mine: dict | None = None) -> None:
    """Load ``state`` (and ``mine``, this rank's part, read from its file when not given) into a module whose
    optimiser and (if any) process group exist (``on_train_start``). Releases the optimiser state it placed."""
    saved_world = int(state.get("world_size", 1))
    if saved_world != world.world_size() and not (per_rank(state) and module.backend.reshardable):
        raise CheckpointError(f"the checkpoint was written by {saved_world} data-parallel ranks; resume with the "
                              f"same trainer.devices x trainer.num_nodes (now {world.world_size()})")
    mine = mine if mine is not None else rank_part(state, world.rank())
    if per_rank(state):
        module.backend.load_checkpoint(module.optimizers(), Path(state["checkpoint_dir"]), state, mine)
    else:
        module.backend.load_optimizer_state(module.optimizers(), state["optimizer"])
    state.pop("optimizer", None)  # placed: the job keeps the state (its step and round) for the whole run
    module.lr_schedulers().load_state_dict(state["scheduler"])
    if mine is not None:
        mine.pop("optimizer", None)
        set_rng_state(mine["rng"])
        module.scheme_generator.set_state(mine["scheme_generator"])
    else:  # a rank the checkpoint's smaller world did not have: its streams stay the ones seeded for it in setup
        log.warning("rank %d: the checkpoint was written by %d ranks; this rank keeps its freshly seeded sampling "
                    "streams (the run continues correctly but not bit-identically)", world.rank(), saved_world)
    module.update.load_state_dict(state)
    module.rollout.load_state_dict(state)
    for term in module.terms:
        if term.name in state.get("terms", {}):
            term.load_state_dict(state["terms"][term.name])


def check_resume_world(state: dict, ckpt, trainer_cfg) -> None:
    """Before any model loads: a checkpoint resumes on the world size that wrote it, or on another one only when its
    shards reshard (FSDP, per-rank layout) and no rank holds a half-used rollout batch; and (per-rank layout) under
    the update backend that wrote it. One line naming the key to change."""
    from grail_exp.training.backends import BACKENDS

    saved, want = int(state.get("world_size", 1)), world.configured_world_size(trainer_cfg)
    strategy = str(trainer_cfg.strategy)
    writer = BACKENDS.get(str(state.get("strategy"))) if per_rank(state) else None
    if saved != want:
        reshards = writer is BACKENDS[strategy] and writer.reshardable and not state.get("mid_round")
        if not reshards:
            why = ("it stopped inside a rollout batch, whose rows belong to its ranks" if writer is not None
                   and writer.reshardable else "only a trainer=fsdp checkpoint resumes on another number of ranks")
            raise CheckpointError(f"{ckpt} was written by {saved} data-parallel rank(s) and cannot resume on {want}: "
                                  f"set trainer.devices x trainer.num_nodes = {saved} ({why})")
        log.warning("resuming %s, written by %d ranks, on %d: torch.distributed.checkpoint reshards the model and "
                    "optimiser", ckpt, saved, want)
    if writer is not None and writer is not BACKENDS[strategy]:
        raise CheckpointError(f"{ckpt} was written with trainer.strategy={state['strategy']}; resume it with the same "
                              f"trainer.strategy (now {strategy})")


def check_same_resume_point(state: dict | None) -> None:
    """Every rank, once the process group exists: all ranks resume from the same step (``resume=auto`` resolves the
    checkpoint on each node's own view of the run directory). A collective; refuses naming each rank's path."""
    mine = (int(state["step"]), state.get("checkpoint_dir")) if state is not None else (None, None)
    views = world.gather_to_all(mine)
    if len({step for step, _ in views}) > 1:
        listed = "; ".join(f"rank {r}: {path or 'no checkpoint (fresh start)'}" for r, (_, path) in enumerate(views))
        raise CheckpointError(f"the ranks resolved different resume points ({listed}): the run directory must be on a "
                              "filesystem every node shares, or pass resume=<checkpoint dir> explicitly")
