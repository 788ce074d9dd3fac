"""Launching data-parallel training: the Lightning strategy behind ``trainer.strategy`` and the launch-time rank.

Lightning launches the ranks (its subprocess launcher, torchrun, SLURM) and creates the process group; what happens to
the gradients is the update backend's business (``grail_exp/training/backends``), one per strategy.

``trainer=ddp`` uses ``GradSyncDDPStrategy``: Lightning's DDP process launching and process group (gloo on CPU,
NCCL on GPU; multi-node through the same cluster environments, SLURM included), **without** wrapping the model in
``DistributedDataParallel``. One training step runs several forwards and backwards per optimiser step (micro-batches,
and GRAIL's probe gradient inside the policy forward), which DDP's reducer does not expect inside a single
``training_step``; the local backend instead sums the gradients across ranks with one flat all-reduce per optimiser
step (``training/backends/local.py``) — what DDP with ``no_sync`` on every micro-batch but the last computes.

``trainer=fsdp`` shards the policy with FSDP2 under the same launcher (``training/backends/fsdp.py``).

``trainer=deepspeed_zero2`` is the paper's own setup, DeepSpeed ZeRO-2, launched the same way: the backend builds the
engine itself in DeepSpeed's unmanaged accumulation mode (``training/backends/deepspeed.py``), because Lightning's
DeepSpeedStrategy owns backward, accumulation and the step in a way this trainer's multi-backward step does not fit
(on an H100 it rejected the configuration before training; results/gpu.md). ``trainer=fsdp_zero2`` (FSDP2 with
``reshard_after_forward=False``) is the same memory layout without DeepSpeed.
"""

from __future__ import annotations

import os
from datetime import timedelta

from lightning.pytorch.strategies import DDPStrategy


def launch_rank() -> int:
    """The global rank of this process as the launcher set it, before any process group exists: torchrun / SLURM
    environment variables, or what Lightning's own launcher gives: its global rank is node rank x ranks per node + local
    rank (``LightningEnvironment``), where the node rank is ``NODE_RANK`` (or ``GROUP_RANK``), the ranks per node
    ``GRAIL_EXP_DEVICES_PER_NODE`` (``job.export_devices_per_node``, from ``trainer.devices``) and the local rank
    ``LOCAL_RANK`` — unset in the process that launches a node's ranks, which is its node's local rank 0 (rank 0 only
    on node 0: on node k it is rank k x ranks per node, and must not read the weights, open an MLflow run or write the
    files rank 0 writes). ``check_launch_rank`` compares it with the process group's rank once that exists."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            if var == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
                continue  # a single SLURM task launches its ranks itself
            return int(os.environ[var])
    devices = int(os.environ.get("GRAIL_EXP_DEVICES_PER_NODE", "1"))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return node * devices + int(os.environ.get("LOCAL_RANK", "0") or 0)


def check_launch_rank(launched: int, rank: int) -> None:
    """Every rank once the process group exists: the rank it took itself for at launch (``launch_rank``, which decided
    who read the weights and who opened the MLflow run) is its rank in the group; else one ``LayoutError`` line."""
    from grail_exp.errors import LayoutError

    if launched == rank:
        return
    env = ", ".join(f"{k}={os.environ[k]}" for k in ("RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK",
                                                      "GRAIL_EXP_DEVICES_PER_NODE") if k in os.environ)
    raise LayoutError(f"this process took itself for rank {launched} when it started ({env or 'no launcher variables'})"
                      f" but is rank {rank} of the process group: the launcher's variables disagree with trainer.devices "
                      "(ranks per node) and trainer.num_nodes; set NODE_RANK on each node and trainer.devices to the "
                      "node's ranks")


def export_local_rank() -> None:
    """Set ``LOCAL_RANK`` from the launcher's environment where none is set, once, before anything reads it.

    torchrun and Lightning's own subprocess launcher set it; ``srun`` with one task per device sets only
    ``SLURM_LOCALID``, while DeepSpeed (its device and ``init_distributed``) and vLLM's external launcher read
    ``LOCAL_RANK``. A single SLURM task launches its ranks itself (Lightning would take a ``LOCAL_RANK`` in its own
    environment to mean the processes were created outside it), so it is left alone, as ``launch_rank`` does."""
    if os.environ.get("LOCAL_RANK"):
        return
    local = os.environ.get("SLURM_LOCALID")
    if local and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ["LOCAL_RANK"] = local


class GradSyncDDPStrategy(DDPStrategy):
    """DDP's launching, process group and device placement; the update backend reduces the gradients itself."""

    strategy_name = "grail_ddp"

    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: start every rank from rank 0's parameters instead (unless the backend's
        # own initialisation gives every rank the same weights: FSDP shards what each rank built).
        from lightning.pytorch.strategies.ddp import _sync_module_states

        backend = getattr(self.model, "backend", None)
        if backend is None or backend.broadcast_initial_weights:
            _sync_module_states(self.model)


def dist_timeout(cfg) -> timedelta:
    """The timeout of every process group the run creates: ``trainer.dist_timeout_s``, or (null) what the planned
    checkpoint write needs (``memory.needed_dist_timeout``, the rule of grail_exp/timeouts.py)."""
    seconds = cfg.trainer.get("dist_timeout_s")
    if seconds is None:
        from grail_exp.memory import needed_dist_timeout

        seconds, _ = needed_dist_timeout(cfg)
    return timedelta(seconds=int(seconds))


def build_strategy(cfg):
    """The Lightning strategy for ``trainer.strategy``: ``auto`` (one process) as Lightning's own; every other
    update backend's name launches its ranks as DDP does (the backend then shards, wraps or reduces by itself), its
    process group created with ``dist_timeout``."""
    t = cfg.trainer
    name = str(t.strategy)
    if name == "auto":
        return name
    return GradSyncDDPStrategy(process_group_backend=t.get("process_group_backend"), timeout=dist_timeout(cfg))
