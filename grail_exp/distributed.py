"""Data-parallel training: the Lightning strategies behind ``trainer.strategy`` and the launch-time rank.

``trainer=ddp`` uses ``GradSyncDDPStrategy``: Lightning's DDP process launching and process group (gloo on CPU,
NCCL on GPU; multi-node through the same cluster environments, SLURM included), **without** wrapping the model in
``DistributedDataParallel``. One training step runs several forwards and backwards per optimiser step (micro-batches,
and GRAIL's probe gradient inside the policy forward), which DDP's reducer does not expect inside a single
``training_step``; the module instead sums the gradients across ranks with one flat all-reduce per optimiser step
(``GRPOModule._sync_gradients``) — what DDP with ``no_sync`` on every micro-batch but the last computes.

``trainer=fsdp`` / ``trainer=deepspeed_zero2`` map to Lightning's FSDP and DeepSpeed strategies (see
``build_strategy``); both keep fp32 master weights themselves.
"""

from __future__ import annotations

import os

from lightning.pytorch.strategies import DDPStrategy


def launch_rank() -> int:
    """The global rank of this process as the launcher set it, before any process group exists: torchrun / SLURM
    environment variables, or the variables Lightning's subprocess launcher gives the ranks it spawns (the process
    that launches them is rank 0)."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            if var == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
                continue  # a single SLURM task launches its ranks itself
            return int(os.environ[var])
    if os.environ.get("LOCAL_RANK"):
        devices = int(os.environ.get("GRAIL_EXP_DEVICES_PER_NODE", "1"))
        return int(os.environ.get("NODE_RANK", "0")) * devices + int(os.environ["LOCAL_RANK"])
    return 0


class GradSyncDDPStrategy(DDPStrategy):
    """DDP's launching, process group and device placement; gradients are all-reduced by the module itself."""

    strategy_name = "grail_ddp"

    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: start every rank from rank 0's parameters instead.
        from lightning.pytorch.strategies.ddp import _sync_module_states

        _sync_module_states(self.model)


def build_strategy(cfg):
    """The Lightning strategy object for ``trainer.strategy`` (a name Lightning knows is passed through)."""
    t = cfg.trainer
    name = str(t.strategy)
    if name == "ddp":
        return GradSyncDDPStrategy(process_group_backend=t.get("process_group_backend"))
    if name == "fsdp":
        import torch
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp import MixedPrecision

        from grail_exp.models import decoder_layer_classes

        # fp32 sharded parameters (the master weights) with bf16 compute and fp32 gradient reduction.
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16) \
            if cfg.model.dtype == "bfloat16" else None
        return FSDPStrategy(auto_wrap_policy=decoder_layer_classes(cfg), mixed_precision=mp, use_orig_params=True,
                            sharding_strategy=t.get("sharding_strategy") or "FULL_SHARD",
                            process_group_backend=t.get("process_group_backend"))
    if name.startswith("deepspeed"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=_deepspeed_config(cfg))
    return name


def _deepspeed_config(cfg) -> dict:
    """ZeRO-2 with bf16 (the paper's accelerate config): fp32 master weights and Adam state partitioned across ranks,
    bf16 module weights; gradient accumulation is the module's (one ``step`` per optimiser step)."""
    t = cfg.trainer
    return {
        "zero_optimization": {"stage": int(t.get("zero_stage") or 2), "overlap_comm": True,
                              "contiguous_gradients": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                              **({"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                                 if t.get("offload_optimizer") else {})},
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "gradient_clipping": 0.0,  # the module clips (optim.max_grad_norm)
        "train_micro_batch_size_per_gpu": int(t.micro_batch_size),
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
    }
