"""``trainer.strategy: deepspeed`` (``trainer=deepspeed_zero2``): DeepSpeed ZeRO stage 2 — the GRAIL paper's setup — under this trainer's own step.

One optimiser step here runs several forwards and backwards (micro-batches, and the GRAIL / OAR probes' input
gradients inside the policy forward) before a single update, with a step size the trainer decides. DeepSpeed's default
*managed* gradient accumulation counts ``backward`` calls against a fixed ``gradient_accumulation_steps`` to find the
boundary, and Lightning's ``DeepSpeedStrategy`` owns that count (on an H100 it refused this trainer's configuration;
results/gpu.md). DeepSpeed's *unmanaged* mode (``managed_gradient_accumulation: false``, DeepSpeed >= 0.18) is the
contract this trainer needs, so the engine is built here (``DeepSpeedBackend``), under Lightning's DDP launcher
(``GradSyncDDPStrategy``):

- **backward** — ``engine.backward(loss, scale_wrt_gas=False)``: ZeRO-2 reduce-scatters each micro-batch's gradients
  into this rank's partition; the loss normalisers already count micro-batches and ranks, so no extra scaling.
- **step** — ``engine.step()`` is the boundary: finalise the reduction, the global gradient norm, clipping
  (``gradient_clipping`` = ``optim.max_grad_norm``), AdamW on the rank's fp32 master partition, all-gather of the
  updated (bf16) parameters. With ``bf16.check_grad_overflow`` a step whose gradient norm is inf / NaN is skipped by
  DeepSpeed; the trainer counts it as a skipped step, as on every other strategy.
- **forward** — the policy module itself (``engine.module``), never the engine: DeepSpeed hooks the *engine's* outputs
  so that any backward through them runs its reduction epilogue, including the probe's ``torch.autograd.grad`` with
  respect to an input leaf, which has no parameter gradients to reduce (it fails). Parameter hooks fire only when a
  parameter gradient is accumulated, which ``autograd.grad(J, leaf)`` never does. (The GRAIL reference likewise hands
  the unwrapped model to its probe.)
- **precision** — bf16 parameters and compute, fp32 master partition and fp32 Adam state (ZeRO's bf16 path): the
  paper's layout. ``model.dtype=float32`` runs ZeRO-2 in fp32.
- **schedule** — the trainer's ``LambdaLR`` on the client AdamW, whose param groups ZeRO steps.
- **checkpoints** — rank 0 saves the bf16 parameters (``save_pretrained``) and every rank's ZeRO state (fp32 master
  partition + Adam moments) inside the resume state; resume restores the masters from it
  (``load_from_fp32_weights``). As with DeepSpeed's own checkpoints, resume needs the same world size.

Tested on CPU (gloo, DeepSpeed's CPU accelerator) against the plain trainer: tests/test_deepspeed.py.
"""

from __future__ import annotations

import math
import os

import torch

from grail_exp import world
from grail_exp.models import lora
from grail_exp.optim import build_optimizer
from grail_exp.training.backends.base import PlanItem, StepResult, UpdateBackend, more_ranks, register_backend


def deepspeed_config(cfg) -> dict:
    """DeepSpeed's JSON config for ``cfg``: unmanaged accumulation, ZeRO from ``trainer.deepspeed``, bf16 when the model
    is bf16, clipping from ``optim.max_grad_norm``. ``trainer.deepspeed`` is merged last (any DeepSpeed key)."""
    from omegaconf import OmegaConf

    # peft=lora: ZeRO's master partition and Adam state cover the adapters only; with peft.adapter_dtype=float32 the
    # adapters compute in fp32 (fp32 ZeRO; the frozen base keeps model.dtype and is never cast)
    bf16 = cfg.model.dtype == "bfloat16" and not (lora.enabled(cfg) and cfg.peft.get("adapter_dtype") == "float32")
    ds = {
        # Placeholders DeepSpeed requires; unmanaged mode ignores them for the boundary (the trainer calls step()).
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "gradient_clipping": float(cfg.optim.max_grad_norm or 0.0),
        "steps_per_print": 2**31 - 1,  # the trainer logs; DeepSpeed's own progress lines would interleave
        "wall_clock_breakdown": False,
    }
    user = OmegaConf.to_container(cfg.trainer.deepspeed, resolve=True) if cfg.trainer.get("deepspeed") else {}
    return _merge(ds, user)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def initialize(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg):
    """Wrap ``policy`` and its AdamW in a ZeRO engine (collective: every rank calls it). Joins the process group that
    Lightning's launcher created; a single process without one (tests, tools) gets a one-rank group (gloo on CPU),
    with the run's ``trainer.dist_timeout_s`` (NCCL's own default would be 10 minutes)."""
    import torch.distributed as dist

    from grail_exp.timeouts import dist_timeout

    if not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce for inference (~1 min, once); training
        # reduces through gloo and never uses it.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import deepspeed

    if not dist.is_initialized():
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
                     "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(k, v)
        params = sum(p.numel() for p in policy.parameters())  # the planner's N: the same rule as Lightning's group
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=dist_timeout(cfg.trainer.get("dist_timeout_s"), params))
    engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=deepspeed_config(cfg),
                                           dist_init_required=False)
    return engine


def step(engine) -> float:
    """The optimiser step (the accumulation boundary); returns the global gradient norm before clipping (inf / NaN
    when DeepSpeed skipped the update)."""
    engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def load_optimizer_state(engine, states: list[dict]) -> None:
    """Restore this rank's partition (ZeRO picks it from the list by rank), fp32 masters included. The older layout's
    list holds every rank's partition."""
    live = engine.optimizer.state_dict()
    full = [{**live, **saved} for saved in states]
    engine.optimizer.load_state_dict(full, load_optimizer_states=True, load_from_fp32_weights=True)


def rank_optimizer_state(engine) -> dict:
    """This rank's ZeRO partition (fp32 master partition, Adam moments) as plain data, for its own checkpoint file: no
    rank sees another's partition. Left on its device: ``torch.save`` copies one storage at a time to the host as it
    writes (the largest, a flat fp32 partition: 4 N / W bytes), where copying it all first would hold 12 N / W."""
    return _plain(engine.optimizer.state_dict())


def load_rank_optimizer_state(engine, mine: dict, world_size: int, rank: int) -> None:
    """Restore this rank's partition from its own file. ZeRO's (rigid) loader reads only the list entry at this rank's
    index, so the other entries stay empty."""
    states: list[dict] = [{} for _ in range(world_size)]
    states[rank] = mine
    load_optimizer_state(engine, states)


def _plain(state: dict) -> dict:
    """The entries of a ZeRO state dict that are plain data throughout (the others are rebuilt from the live engine)."""
    return {k: v for k, v in state.items() if _is_plain(v)}


def _is_plain(obj) -> bool:
    if isinstance(obj, dict):
        return all(_is_plain(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_is_plain(v) for v in obj)
    return obj is None or isinstance(obj, torch.Tensor) or type(obj) in (bool, int, float, str)  # not IntEnum


@register_backend("deepspeed")
class DeepSpeedBackend(UpdateBackend):
    owns_master_weights = True  # ZeRO's fp32 master partition

    def __init__(self, cfg, module):
        super().__init__(cfg, module)
        self.engine = None

    @classmethod
    def check_config(cls, cfg) -> list[str]:
        import importlib.util

        e = []
        if importlib.util.find_spec("deepspeed") is None:
            e.append(f"trainer.strategy = {cfg.trainer.strategy!r}: needs DeepSpeed: pip install -e '.[deepspeed]' "
                     "(pinned deepspeed==0.19.8)")
        ds = cfg.trainer.get("deepspeed") or {}
        stage = (ds.get("zero_optimization") or {}).get("stage", 2)
        if stage not in (1, 2):
            e.append(f"trainer.deepspeed.zero_optimization.stage = {stage!r}: must be 1 or 2 (ZeRO-3 partitions the "
                     "parameters themselves; trainer=fsdp shards them the way this trainer needs)")
        if cfg.optim.get("grad_accum_dtype") is not None:
            e.append(f"optim.grad_accum_dtype = {cfg.optim.grad_accum_dtype!r}: under ZeRO, DeepSpeed accumulates "
                     "(default: in the model's dtype); set trainer.deepspeed.data_types.grad_accum_dtype instead and "
                     "leave optim.grad_accum_dtype null")
        return e

    # ---- the memory planner's questions: bf16 parameters replicated, fp32 masters and Adam state partitioned
    @staticmethod
    def _zero(cfg) -> dict:
        """``trainer.deepspeed.zero_optimization`` (stage 2 when unset, as ``check_config`` reads it)."""
        return (cfg.trainer.get("deepspeed") or {}).get("zero_optimization") or {}

    @classmethod
    def memory_layout(cls, cfg, world):
        return "zero1" if cls._zero(cfg).get("stage", 2) == 1 else "zero2"

    @classmethod
    def planned_state(cls, cfg, n, b, world):
        return [PlanItem("parameters", n * b, f"N {n:,} x {b} B, replicated"),
                PlanItem("fp32 master partition", 4 * n / world, "4 B x N / W"),
                PlanItem("Adam moments", 8 * n / world, "8 B x N / W")]

    @classmethod
    def planned_gradients(cls, cfg, n, b, world):
        zero = cls._zero(cfg)
        stage1 = zero.get("stage", 2) == 1  # ZeRO-1 keeps full b-byte gradients; ZeRO-2 reduce-scatters them
        bucket = float(zero.get("reduce_bucket_size", 5e8)) + float(zero.get("allgather_bucket_size", 5e8))
        return [PlanItem("gradients", (b * n if stage1 else b * n / world) + 4 * n / world,
                         ("b x N" if stage1 else "b x N / W") + " partition + fp32 4 B x N / W"),
                PlanItem("DeepSpeed buckets", bucket * b, "(reduce_bucket_size + allgather_bucket_size) x b")]

    @classmethod
    def planned_checkpoint_shard(cls, cfg, n, b, world, rank, tensor):
        # Each rank's file: its ZeRO partition saved from the device, torch.save copying one storage at a time (the
        # largest a flat fp32 partition); rank 0 also writes the replicated b-byte weights with save_pretrained.
        part = 4 * n / world
        if rank:
            return PlanItem("checkpoint part", part, "one flat fp32 partition at a time, 4 B x N / W")
        return PlanItem("checkpoint part", part + n * b, "one flat fp32 partition at a time, 4 B x N / W, + rank 0's "
                        "b-byte weights through save_pretrained, N x b")

    @classmethod
    def shard_options(cls, cfg, world):
        return [[["trainer=fsdp", f"trainer.devices={cfg.trainer.devices}"]], more_ranks(cfg)]

    def build_optimizer(self, policy):
        # ZeRO keeps the fp32 master partition and Adam state; the client AdamW it steps is plain.
        opt = build_optimizer(policy, self.cfg.optim, master_weights=False)
        self.engine = initialize(policy, opt, self.cfg)
        return opt

    def backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)  # reduce-scatter into this rank's ZeRO partition

    def step(self, optimizer, loss_finite):
        # DeepSpeed's step: norm, clipping, the fp32 master update; it skips the update itself when the norm is inf /
        # NaN, which the trainer counts like any other skipped step.
        norm = step(self.engine)
        return StepResult(norm, loss_finite and math.isfinite(norm))

    def load_optimizer_state(self, optimizer, state):
        load_optimizer_state(self.engine, state)

    def rank_checkpoint(self, optimizer):
        # The parameters are replicated under ZeRO-1/2: rank 0's Hugging Face weights are the model part.
        return {"optimizer": rank_optimizer_state(self.engine)}

    def load_checkpoint(self, optimizer, directory, shared, own):
        load_rank_optimizer_state(self.engine, own["optimizer"], world.world_size(), world.rank())
