"""What exact resume needs besides the weights: counters, every rank's RNG streams and half-used rollout batch, the
optimiser state (through the update backend), the scheduler, and the phases' own state.

The layout of ``training_state.pt`` (tensors and plain containers only, loaded with ``weights_only=True``):
``step``, ``round``, ``world_size``, ``ranks`` (per rank: ``rng``, ``scheme_generator``, ``buffer``),
``optimizer``, ``scheduler``, the rollout phase's ``prompt_cursor`` / ``kl_controller`` / ``logp_diff_history``, the
update phase's ``nonfinite_total`` / ``nonfinite_in_a_row``, ``terms``, ``mlflow_run_id``. States written before the
``ranks`` list (single process) kept ``rng`` / ``scheme_generator`` / ``buffer`` at the top level; they still load.
"""

from __future__ import annotations

from grail_exp.checkpoint import CheckpointError, rng_state, set_rng_state
from grail_exp import world
from grail_exp.training.batch import TrainingBatch


def rank_part(state: dict | None, rank: int) -> dict | None:
    """This rank's part of a training state."""
    if state is None:
        return None
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


def training_state(module, position: dict) -> dict:
    """The module's state for a checkpoint at ``position`` (a collective: every rank's RNG streams and buffer are
    gathered into rank 0's file; the backend gathers the optimiser state)."""
    mine = {"rng": rng_state(), "scheme_generator": module.scheme_generator.get_state(), "buffer": position["buffer"]}
    return {
        "step": module.progress.step,
        "round": position["round"],
        "world_size": world.world_size(),
        "ranks": world.gather_to_all(mine),
        "optimizer": module.backend.optimizer_state(module.optimizers()),
        "scheduler": module.lr_schedulers().state_dict(),
        **module.update.state_dict(),
        **module.rollout.state_dict(),
        "mlflow_run_id": getattr(module.tracker, "run_id", None),
        "terms": {t.name: t.state_dict() for t in module.terms},
    }


def restore(module, state: dict) -> None:
    """Load ``state`` into a module whose optimiser and (if any) process group exist (``on_train_start``)."""
    saved_world = int(state.get("world_size", 1))
    if saved_world != world.world_size():
        raise CheckpointError(f"the checkpoint was written by {saved_world} data-parallel ranks; resume with the "
                              f"same trainer.devices x trainer.num_nodes (now {world.world_size()})")
    module.backend.load_optimizer_state(module.optimizers(), state["optimizer"])
    module.lr_schedulers().load_state_dict(state["scheduler"])
    mine = rank_part(state, world.rank())
    set_rng_state(mine["rng"])
    module.scheme_generator.set_state(mine["scheme_generator"])
    module.update.load_state_dict(state)
    module.rollout.load_state_dict(state)
    for term in module.terms:
        if term.name in state.get("terms", {}):
            term.load_state_dict(state["terms"][term.name])
