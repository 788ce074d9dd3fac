"""The update-backend interface: how one optimiser step's gradients become an update under a parallel strategy.

Lightning launches the processes and creates the process group (``grail_exp.distributed.build_strategy``); the
training step is the project's own (several forwards and backwards per optimiser step: micro-batches, and GRAIL's
probe gradient inside the policy forward), so the operations that differ between strategies sit behind this class:

- ``configure_model`` / ``build_optimizer``: shard the policy (FSDP), wrap it (DeepSpeed), pick the optimiser and
  where the fp32 master weights live.
- ``forward``: the policy forward of a micro-batch (through FSDP's root unit when sharded); ``full_parameters``: every
  parameter gathered for work outside that forward (generation, a scheme's ``prepare``).
- ``weight_chunks``: the policy's full parameters as an iterator of bounded chunks in a given dtype, gathered one
  chunk at a time when sharded (collective): what an engine with its own copy of the weights (vLLM) consumes.
  ``sync_engine`` / ``generation`` use it and ``full_parameters`` to give any engine the current weights.
- ``backward``: one micro-batch's backward; ``step``: gradient sync, global norm, clipping, the optimiser step (or its
  skip when the loss or the norm is not finite).
- ``shared_checkpoint`` / ``rank_checkpoint`` / ``save_shards`` / ``load_checkpoint``: what a checkpoint stores and
  restores, each rank its own part (``grail_exp/training/checkpoint_writer.py``); ``load_optimizer_state``
  reads the older layout, where rank 0 held every rank's optimiser state.
- ``placed`` and the ``after_*`` hooks: memory hygiene at the phases' boundaries (after a probe backward, a backward,
  an optimiser step, a generation), no-ops here; the local backend hands freed host heap back to the OS when the
  policy is on the CPU (``grail_exp/compute/host.py``). ``placed`` runs once the policy sits on its device, sharded or wrapped,
  so hooks on its parameters are set on the parameters that train.
- ``planned_*``, ``memory_layout``, ``shards_parameters``, ``shard_options``: the memory planner's questions
  (``grail_exp/memory/``), answered by the class from the config alone, before any model exists: the model state
  per rank, the gradients and gathered parameters of the update, the gradient sync, and which strategy changes put
  less on each device.

Nothing outside ``grail_exp/training/backends/`` asks which strategy it runs under. Adding a strategy = one file here
with a class registered under the ``trainer.strategy`` names it serves (``@register_backend("name")``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from grail_exp.compute.chunks import chunked
from grail_exp.compute.forward import policy_forward, share_prompts_of
from grail_exp.models import lora
from grail_exp.registry import Registry
from grail_exp.training import probe_points

BACKENDS: Registry = Registry("update backend for trainer.strategy")


def register_backend(*names: str) -> Callable[[type[UpdateBackend]], type[UpdateBackend]]:
    """Class decorator: the ``trainer.strategy`` values this backend serves."""
    return BACKENDS.register(*names)


def raw_optimizer(optimizer):
    """The torch optimiser inside Lightning's ``LightningOptimizer`` wrapper (or the optimiser itself)."""
    return getattr(optimizer, "optimizer", optimizer)


class PlanItem(NamedTuple):
    """One line of the memory plan a backend contributes (the planner adds the phase)."""

    what: str
    bytes: float
    how: str  # the formula with its numbers


def more_ranks(cfg) -> list[list[str]]:
    """``trainer.devices`` doubled up to 8 while the step's prompts still split evenly over the ranks, mildest first:
    more ranks shard more state and each samples fewer rows (the planner's suggestion on a multi-rank layout)."""
    t = cfg.trainer
    d, nodes, options = (t.devices if isinstance(t.devices, int) else 1), int(t.get("num_nodes", 1) or 1), []
    while d < 8 and t.prompts_per_step % (2 * d * nodes) == 0:
        d *= 2
        options.append([f"trainer.devices={d}"])
    return options


def tensor_specs(pairs) -> list[tuple[str, tuple, str]]:
    """``(name, shape, dtype)`` of ``(name, tensor)`` pairs: what a broadcast from rank 0 into the other ranks' tensors
    must agree on (a DTensor's shape is its global one)."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in pairs]


def broadcast_module(model: torch.nn.Module) -> None:
    """Every parameter (tied ones once) and buffer of ``model`` from rank 0, in place, one tensor per collective: the
    largest tensor is the most any rank holds in flight. Re-ties the weights first: ``to_empty`` gives each module its
    own tensor, so a tied output layer would otherwise be a copy that no longer follows the embedding. The ranks first
    compare what they are about to exchange (``world.check_same_tensors``)."""
    from grail_exp import world

    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    world.check_same_tensors(tensor_specs([*model.named_parameters(), *model.named_buffers()]),
                             f"the ranks' {type(model).__name__} differ")
    with torch.no_grad():
        for t in model.parameters():
            world.broadcast(t.data, src=0)
        for t in model.buffers():
            world.broadcast(t.data, src=0)


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` when it is a floating tensor and ``dtype`` is given (integer buffers keep theirs)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def fresh_storage(model: torch.nn.Module) -> None:
    """Every parameter and buffer of ``model`` copied into a storage of its own, one tensor at a time (on CPU, where
    ``to(device)`` keeps the loaded tensors: the weights file's memory, aligned as the file lays it out). The other ranks
    allocate theirs afresh, and CPU kernels pick their vector paths by alignment: with the same storage on every rank
    the ranks compute bit-identical results from identical weights, as they did when each loaded the file."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            fresh = torch.empty_like(t)
            fresh.copy_(t)
            t.data = fresh


def broadcast_buffers(model: torch.nn.Module) -> None:
    """Every buffer of ``model`` from rank 0, in place (collective)."""
    from grail_exp import world

    with torch.no_grad():
        for t in model.buffers():
            world.broadcast(t.data, src=0)


@dataclass
class StepResult:
    grad_norm: float  # global gradient norm before clipping (inf / NaN when not finite)
    applied: bool  # False: the update was skipped (non-finite loss or gradient)


class UpdateBackend:
    """One strategy's update mechanics. ``module`` is the LightningModule (its ``manual_backward`` routes through
    Lightning's strategy and precision plugin)."""

    # False where the strategy's own initialisation already gives every rank the same weights (FSDP shards them).
    broadcast_initial_weights: ClassVar[bool] = True
    # True where the strategy keeps fp32 master weights itself (FSDP's fp32 shards, ZeRO's master partition), so a
    # bf16 model needs no ``optim.master_weights``.
    owns_master_weights: ClassVar[bool] = False
    # True where the parameters live in shards: ``full_parameters`` (generation, evaluation) and a weight sync to an
    # engine hold gathered b-byte copies, which the memory planner counts.
    shards_parameters: ClassVar[bool] = False

    def __init__(self, cfg, module):
        self.cfg = cfg
        self.module = module

    @classmethod
    def policy_overrides(cls, cfg) -> dict:
        """Config overrides for loading the trainable policy (FSDP loads fp32 parameters: its master weights)."""
        return {}

    @classmethod
    def check_config(cls, cfg) -> list[str]:
        """Key-named problems of ``cfg`` for this strategy (``validate.py`` calls it)."""
        return []

    @classmethod
    def weights_from_rank0(cls, cfg) -> bool:
        """Whether only rank 0 reads the weights from disk and every other rank builds its models on the meta device and
        receives them in ``configure_model`` / ``place_replica``: every multi-rank layout. A node's host then holds one
        copy of the weights, not one per rank (4 x 33 GB of fp32 for an 8B policy under FSDP). One process loads as
        it always did."""
        from grail_exp.world import configured_world_size

        return configured_world_size(cfg.trainer) > 1

    # ---- the memory planner's questions (grail_exp/memory/), per rank: n parameters, b bytes per model-dtype
    # element, ``world`` ranks. Class-level: the plan is made before any model or process group exists.
    @classmethod
    def memory_layout(cls, cfg, world: int) -> str:
        """The layout's name in the plan's header (``single``, ``ddp``, ``fsdp_full``, ``zero2``, ...)."""
        raise NotImplementedError

    @classmethod
    def planned_state(cls, cfg, n: int, b: int, world: int) -> list[PlanItem]:
        """What the strategy holds through every phase: parameters, master weights, optimiser moments."""
        raise NotImplementedError

    @classmethod
    def planned_gradients(cls, cfg, n: int, b: int, world: int) -> list[PlanItem]:
        """What the update adds: the gradients (or their shards) and the strategy's communication buffers."""
        raise NotImplementedError

    @classmethod
    def planned_gathered(cls, cfg, shape, b: int, held: bool) -> PlanItem | None:
        """Parameters gathered for the update's forward and backward (and the no-grad log-prob pass); None where every
        rank holds them all anyway. ``shape``: ``memory.Shape``; ``held``: the scheme or a loss term calls the model
        between a micro-batch's forward and backward (``forward``'s ``hold_gathered``)."""
        return None

    @classmethod
    def planned_gradient_sync(cls, cfg, n: int, b: int, world: int) -> list[PlanItem]:
        """What the optimiser step's gradient synchronisation holds on top of the gradients (none by default)."""
        return []

    @classmethod
    def planned_checkpoint_shard(cls, cfg, n: int, b: int, world: int, rank: int, tensor: int) -> PlanItem:
        """The host bytes rank ``rank`` holds at once while writing (and reading back) its part of a checkpoint
        (``grail_exp/training/checkpoint_writer.py``): the host planner's checkpoint and resume rows
        (``memory.host_node_lines``). ``tensor``: elements of the largest tensor (V x h). A replicated layout: rank 0
        writes the weights with ``save_pretrained`` (one safetensors shard of up to 50 GB, so the b-byte weights at
        once) and the optimiser with ``torch.save``, which copies one storage at a time; the other ranks nothing."""
        if rank:
            return PlanItem("checkpoint part", 0.0, "a replica: rank 0 writes it")
        return PlanItem("checkpoint part", n * b + 4 * tensor, "rank 0: the b-byte weights through save_pretrained, "
                        "N x b, + the optimiser one storage at a time, the largest 4 B x V x h")

    @classmethod
    def checkpoint_holds_weights(cls, cfg) -> bool:
        """Whether each rank's checkpoint part carries its share of the weights (resume then reads no full copy);
        False where rank 0 reads the policy's weights whole and broadcasts them, as at the start (``model_in_shards``)."""
        return cls.model_in_shards

    @classmethod
    def shard_options(cls, cfg, world: int) -> list[list[list[str]]]:
        """Override sets that put less of this strategy's state on each device, grouped in families, each family's
        sets mildest first (the planner tries them when a plan does not fit)."""
        return []

    # ---- the model
    def configure_model(self, policy: torch.nn.Module) -> None:
        """Called on every rank once the process group exists, before Lightning moves the module to its device: here
        (a replicated layout) the policy is placed on its device with rank 0's weights (``place_replica``)."""
        self.place_replica(policy)

    def compute_device(self) -> torch.device:
        """The rank's device: the Lightning strategy's root device (CPU without a trainer: tools, tests)."""
        trainer = getattr(self.module, "_trainer", None)
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def place_replica(self, model: torch.nn.Module) -> None:
        """A model every rank holds whole (the DDP / ZeRO-2 policy, the frozen reference model), on this rank's device
        with rank 0's values (collective), when ``weights_from_rank0``: rank 0 moves its loaded copy to the device (its
        host copy is released as each tensor moves), the others allocate their meta skeleton there, and every parameter
        and buffer (the non-persistent RoPE tables included) is broadcast from rank 0, one tensor at a time, on the
        process group's device. Broadcasting rather than every rank reading the files in the model's dtype: the node
        holds one host copy (b x N) instead of one per rank, and the ranks cannot start from different weights."""
        from grail_exp import world

        if not self.weights_from_rank0(self.cfg) or world.world_size() == 1:
            return
        dev = self.compute_device()
        if world.rank() == 0:
            model.to(dev)
            if dev.type == "cpu":
                fresh_storage(model)
        else:
            model.to_empty(device=dev)
        broadcast_module(model)
        self.broadcast_initial_weights = False  # every rank holds rank 0's weights already

    def build_optimizer(self, policy: torch.nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def forward(self, model, input_ids, attention_mask, position_ids, completion_ids, *, hidden_states: bool = False,
                hold_gathered: bool = False):
        """``grail_exp.compute.forward.policy_forward`` of ``model`` on a micro-batch: (logp, entropy, PolicyForward).
        ``hold_gathered``: work between this forward and the micro-batch's ``backward`` calls the model again on some
        ranks only (a scheme's probe gradient or extra forward on the rows that need it): a sharded backend keeps the
        parameters gathered until then, so that work runs no collective of its own."""
        return policy_forward(model, input_ids, attention_mask, position_ids, completion_ids,
                              self.cfg.rollout.temperature, chunk_tokens=self.cfg.trainer.logprob_chunk_tokens,
                              hidden_states=hidden_states,
                              logprob_dtype=self.cfg.trainer.get("logprob_dtype", "float32"),
                              share_prompts=self.share_prompts)

    @property
    def share_prompts(self) -> bool:
        """``trainer.share_prompts`` resolved: each distinct prompt of a micro-batch computed once
        (``grail_exp.compute.forward.body_forward``)."""
        return share_prompts_of(self.cfg)

    def full_parameters(self):
        """Context in which every parameter of the policy is present on this rank (a collective when sharded)."""
        return nullcontext()

    # ---- the rollout engine's weights
    def full_tensors(self, dtype: torch.dtype | None = None, keep: Callable[[str], bool] | None = None):
        """``(name, tensor)`` of the policy's full state dict, tied output layer included (``state_dict`` and not
        ``named_parameters``: a tied ``lm_head.weight`` is missing from the latter), each floating tensor in ``dtype``
        (None: as held). Here the live tensors themselves: every rank holds all of them (one process, DDP, ZeRO-1/2);
        sharded backends gather each one (a collective). ``keep``: only the names it accepts (the others are not
        gathered)."""
        for name, t in self.module.policy.state_dict().items():
            if keep is None or keep(name):
                yield name, cast(t, dtype)

    def weight_chunks(self, dtype: torch.dtype, max_bytes: int):
        """The policy's full parameters in ``dtype`` as lists of ``(name, tensor)`` of at most ``max_bytes`` (a larger
        tensor travels alone), produced lazily: at most one chunk and one tensor exist at a time beyond the model.
        A collective when sharded: every rank iterates it to the end, in the same order."""
        return chunked(((name, t.detach()) for name, t in self.full_tensors(dtype)), max_bytes)

    def sync_engine(self, engine) -> None:
        """Make ``engine`` sample from the policy's current weights. An engine with its own copy (``load_weights``:
        vLLM) is streamed the full parameters chunk by chunk; one that samples from the policy object (HF, plug-ins)
        is handed the policy, with every parameter present. A collective when sharded: every rank calls it."""
        if callable(getattr(engine, "load_weights", None)):
            if lora.enabled(self.cfg):
                self.sync_lora(engine)
            else:
                engine.load_weights(self.weight_chunks(engine.dtype, engine.sync_chunk_bytes))
        else:
            with self.full_parameters():
                engine.sync_weights(self.module.policy)
        probe_points.emit("synced", backend=self, engine=engine)

    def sync_lora(self, engine) -> None:
        """``peft=lora``, an engine with its own weights (grail_exp/models/lora.py, docs/lora.md). ``peft.sync=adapter``:
        the frozen base once (Hugging Face names, chunk by chunk), then at every sync the adapter alone
        (``engine.load_adapter``, a new version each time). ``peft.sync=merged``: W + (alpha/r) B A of every targeted
        layer computed in fp32 from the unchanged base into new tensors, cast to the engine's dtype and streamed in
        chunks like full weights; the trainer's own weights are only read. A collective when sharded."""
        p, dtype, chunk = self.cfg.peft, engine.dtype, engine.sync_chunk_bytes
        if p.sync == "merged":
            merged = lora.merged_tensors(self.full_tensors(), lora.scaling(p))
            engine.load_weights(chunked(((n, t.to(dtype)) for n, t in merged), chunk))
            return
        if not getattr(self, "base_pushed", False):
            base = lora.base_tensors(self.full_tensors(keep=lambda n: ".lora_" not in n))
            engine.load_weights(chunked(((n, t.detach().to(dtype)) for n, t in base), chunk))
            self.base_pushed = True
        adapter = lora.adapter_tensors(self.full_tensors(keep=lambda n: ".lora_" in n))
        engine.load_adapter({k: v.detach() for k, v in adapter.items()},  # as held; the engine casts to its own
                            lora.adapter_config(self.module.policy, getattr(self.cfg.model, "name_or_path", None)))

    @contextmanager
    def generation(self, engine):
        """The context ``engine.generate`` runs in: the full parameters for an engine that samples from the (possibly
        sharded) policy itself; nothing for one with its own copy of the weights, whose generation needs no gathered
        policy. A collective when sharded and the engine samples from the policy."""
        if callable(getattr(engine, "load_weights", None)):
            yield
        else:
            with self.full_parameters():
                yield

    # ---- one optimiser step
    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, optimizer, loss_finite: bool) -> StepResult:
        """Sync, measure, clip and apply the accumulated gradients — or skip the update when ``loss_finite`` is False or
        the gradient norm is not finite. The caller then steps the scheduler and zeroes the gradients."""
        raise NotImplementedError

    def clip_and_step(self, optimizer, params: list, norm: float, loss_finite: bool) -> StepResult:
        """The torch-optimiser half of ``step`` for backends whose optimiser is a plain (or master-weight) AdamW:
        clip ``params``' gradients to ``optim.max_grad_norm`` and step, or skip a non-finite update."""
        if loss_finite and math.isfinite(norm):
            if self.cfg.optim.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.optim.max_grad_norm)
            optimizer.step()
            return StepResult(norm, True)
        # With every grad None, AdamW leaves parameters and state untouched; the call still advances Lightning's
        # optimiser-step counter, so the skipped step is counted like any other.
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        return StepResult(norm, False)

    # ---- memory hygiene between the phases (the training phases call these; no-ops unless a backend needs them)
    def placed(self) -> None:
        """The policy is on its device and sharded / wrapped (``RLVRModule.on_train_start``, before any training)."""

    def after_probe_backward(self) -> None:
        """A scheme's probe backward (an input gradient inside the policy forward) has finished."""

    def after_backward(self) -> None:
        """A micro-batch's backward has finished (its activations are free)."""

    def after_step(self) -> None:
        """An optimiser step has finished (the step's activations and gradients are free)."""

    def after_generation(self) -> None:
        """Every generation of a round has finished (the engine's caches are free)."""

    # ---- checkpoints: each rank writes and reads its own part (grail_exp/training/checkpoint_writer.py)
    # True where the model's weights are in the checkpoint's shards (FSDP): the full Hugging Face weights are then an
    # export (``trainer.export_hf_weights``), not what resume reads.
    model_in_shards: ClassVar[bool] = False
    # True where a checkpoint of W ranks resumes on another number of ranks (torch.distributed.checkpoint reshards).
    reshardable: ClassVar[bool] = False

    def shared_checkpoint(self, optimizer) -> dict:
        """Entries of the shared ``training_state.pt`` (rank 0 alone calls it: no collective): the optimiser state where
        every rank holds the same, whole one."""
        return {}

    def rank_checkpoint(self, optimizer) -> dict:
        """Entries of this rank's ``rank-<r>.pt``, on the host (every rank calls it, no collective): its optimiser
        partition where the state is partitioned by rank."""
        return {}

    def save_shards(self, optimizer, directory) -> None:
        """Write the sharded model and optimiser state under ``directory`` (a collective: every rank writes its own
        shards); nothing where the other parts hold everything."""

    def load_checkpoint(self, optimizer, directory, shared: dict, own: dict | None) -> None:
        """Restore the optimiser (and the weights, where they are in the shards) from a checkpoint of the per-rank
        layout: ``shared`` its ``training_state.pt``, ``own`` this rank's ``rank-<r>.pt`` (None: this rank did not
        exist when it was written), ``directory`` the checkpoint. A collective where the state is sharded."""
        raise NotImplementedError

    def load_optimizer_state(self, optimizer, state) -> None:
        """Restore the optimiser from a checkpoint of the older layout (rank 0's file held every rank's state)."""
        raise NotImplementedError
