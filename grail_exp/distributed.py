"""Data-parallel training: the Lightning strategies behind ``trainer.strategy`` and the launch-time rank.

``trainer=ddp`` uses ``GradSyncDDPStrategy``: Lightning's DDP process launching and process group (gloo on CPU,
NCCL on GPU; multi-node through the same cluster environments, SLURM included), **without** wrapping the model in
``DistributedDataParallel``. One training step runs several forwards and backwards per optimiser step (micro-batches,
and GRAIL's probe gradient inside the policy forward), which DDP's reducer does not expect inside a single
``training_step``; the module instead sums the gradients across ranks with one flat all-reduce per optimiser step
(``GRPOModule._sync_gradients``) — what DDP with ``no_sync`` on every micro-batch but the last computes.

``trainer=fsdp`` shards the policy with FSDP2 (``torch.distributed.fsdp.fully_shard``) under the same launcher:
each decoder layer is a shard unit and the whole policy forward of a micro-batch — embeddings, decoder, chunked
output-layer log-probs — is one call of the root unit (``PolicyCore``), so FSDP's hooks gather and free parameters
around everything the trainer and the schemes touch. fp32 sharded parameters are the master weights; compute runs
in ``model.dtype`` (``MixedPrecisionPolicy``), gradients are reduce-scattered in fp32. Generation, scheme
``prepare`` passes and checkpointing see the full parameters (``full_parameters``; full state dicts on rank 0).
Lightning's own FSDPStrategy (FSDP1) refuses CPU and wraps ``training_step`` in one root forward, which does not fit
a step with several forwards and backwards; FSDP2 runs on CPU (gloo), so it is tested here.

``trainer=deepspeed_zero2`` is the paper's own setup, DeepSpeed ZeRO-2, launched the same way: the module builds the
engine itself in DeepSpeed's unmanaged accumulation mode (``grail_exp.deepspeed_zero``), because Lightning's
DeepSpeedStrategy owns backward, accumulation and the step in a way this trainer's multi-backward step does not fit
(on an H100 it rejected the configuration before training; results/gpu.md). ``trainer=fsdp_zero2`` (FSDP2 with
``reshard_after_forward=False``) is the same memory layout without DeepSpeed.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
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
        # No DistributedDataParallel wrapper: start every rank from rank 0's parameters instead (a sharded policy,
        # trainer=fsdp, was built from the same weights on every rank and is not broadcast).
        from lightning.pytorch.strategies.ddp import _sync_module_states

        if getattr(self.model, "core", None) is None:
            _sync_module_states(self.model)


def build_strategy(cfg):
    """The Lightning strategy object for ``trainer.strategy`` (a name Lightning knows is passed through)."""
    t = cfg.trainer
    name = str(t.strategy)
    if name == "ddp":
        return GradSyncDDPStrategy(process_group_backend=t.get("process_group_backend"))
    if name in ("fsdp", "deepspeed"):  # launching as DDP; the module shards the policy (shard_policy) or builds the
        return GradSyncDDPStrategy(process_group_backend=t.get("process_group_backend"))  # ZeRO engine itself
    return name


# ---------------------------------------------------------------------------------------------- FSDP2
class PolicyCore(torch.nn.Module):
    """The policy forward of a micro-batch as one module call (the FSDP root unit): see ``grail_exp.module.policy_forward``."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, position_ids, completion_ids, temperature: float, chunk_tokens: int,
                hidden_states: bool):
        from grail_exp.module import policy_forward

        logp, entropy, fwd = policy_forward(self.policy, input_ids, attention_mask, position_ids, completion_ids,
                                            temperature, chunk_tokens=chunk_tokens, hidden_states=hidden_states)
        return logp.clone(), entropy.clone(), fwd  # not views: FSDP hooks the outputs for its backward


def shard_policy(policy: torch.nn.Module, cfg) -> PolicyCore:
    """FSDP2-shard the policy in place: one unit per decoder layer, the rest in the root ``PolicyCore`` (kept gathered
    between its forward and backward so the schemes can read the output layer and the embeddings)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from grail_exp.models import DTYPES, decoder_layer_classes

    compute = DTYPES[cfg.model.dtype]
    mp = MixedPrecisionPolicy(param_dtype=compute if compute != torch.float32 else None, reduce_dtype=torch.float32)
    layer_types = tuple(decoder_layer_classes(cfg))
    # FULL_SHARD (ZeRO-3-like): a layer's parameters are freed after its forward and gathered again for backward.
    # SHARD_GRAD_OP (ZeRO-2-like, the paper's layout): kept gathered from forward to backward; gradients and optimiser
    # state stay sharded either way.
    reshard = (cfg.trainer.get("sharding_strategy") or "FULL_SHARD") == "FULL_SHARD"
    for module in policy.modules():
        if isinstance(module, layer_types):
            fully_shard(module, mp_policy=mp, reshard_after_forward=reshard)
    core = PolicyCore(policy)
    fully_shard(core, mp_policy=mp, reshard_after_forward=False)
    return core


def fsdp_units(module: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def initialize_root(core: torch.nn.Module) -> None:
    """Run the root unit once (a 2-token no-grad forward) so FSDP initialises its state as one tree. Otherwise the first
    work outside the root forward — generation calling the decoder layers directly — initialises each layer as a
    root of its own, and the real root forward then fails ("FSDP state has already been lazily initialized"). A
    collective: every rank calls it (at the first ``full_parameters``)."""
    if getattr(core, "_root_initialized", False):
        return
    dev = next(core.parameters()).device
    ids = torch.ones(1, 2, dtype=torch.long, device=dev)
    with torch.no_grad():
        core(ids, torch.ones_like(ids), torch.arange(2, device=dev)[None], ids[:, 1:], 1.0, 4096, False)
    core._root_initialized = True


@contextmanager
def full_parameters(core: torch.nn.Module | None):
    """Every sharded parameter gathered (no-grad work outside the root forward: generation, scheme ``prepare``)."""
    if core is not None:
        initialize_root(core)
    units = fsdp_units(core) if core is not None else []
    for u in units:
        u.unshard()
    try:
        yield
    finally:
        for u in units:
            u.reshard()


def full_state_dict(core: torch.nn.Module) -> dict:
    """The policy's full (unsharded) state dict on CPU, for rank 0's checkpoint (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(core.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if getattr(core.policy.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied: the embedding carries it, as save_pretrained writes it unsharded
    return sd


def full_optimizer_state(core: torch.nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(core.policy, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(core: torch.nn.Module, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(core.policy, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
