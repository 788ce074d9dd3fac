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
- ``optimizer_state`` / ``load_optimizer_state`` / ``full_state_dict``: what a checkpoint stores and restores
  (collectives on every rank).

Nothing outside ``grail_exp/training/backends/`` asks which strategy it runs under. Adding a strategy = one file here
with a class registered under the ``trainer.strategy`` names it serves (``@register_backend("name")``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from grail_exp.forward import policy_forward, share_prompts_of
from grail_exp.rollout.base import chunked
from grail_exp.training import probe

BACKENDS: dict[str, type["UpdateBackend"]] = {}


def register_backend(*names: str) -> Callable[[type["UpdateBackend"]], type["UpdateBackend"]]:
    """Class decorator: the ``trainer.strategy`` values this backend serves."""

    def deco(cls):
        for name in names:
            if name in BACKENDS:
                raise ValueError(f"update backend for trainer.strategy={name!r} registered twice")
            BACKENDS[name] = cls
        return cls

    return deco


def raw_optimizer(optimizer):
    """The torch optimiser inside Lightning's ``LightningOptimizer`` wrapper (or the optimiser itself)."""
    return getattr(optimizer, "optimizer", optimizer)


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

    def __init__(self, cfg, module):
        self.cfg = cfg
        self.module = module

    @classmethod
    def policy_overrides(cls, cfg) -> dict:
        """Config overrides for loading the trainable policy (FSDP loads fp32 parameters: its master weights)."""
        return {}

    @classmethod
    def check_config(cls, cfg) -> list[str]:
        """Key-named problems of ``cfg`` for this strategy (``config.validate`` calls it)."""
        return []

    # ---- the model
    def configure_model(self, policy: torch.nn.Module) -> None:
        pass

    def build_optimizer(self, policy: torch.nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def forward(self, model, input_ids, attention_mask, position_ids, completion_ids, *, hidden_states: bool = False,
                hold_gathered: bool = False):
        """``grail_exp.forward.policy_forward`` of ``model`` on a micro-batch: (logp, entropy, PolicyForward).
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
        (``grail_exp.forward.body_forward``)."""
        return share_prompts_of(self.cfg)

    def full_parameters(self):
        """Context in which every parameter of the policy is present on this rank (a collective when sharded)."""
        return nullcontext()

    # ---- the rollout engine's weights
    def full_tensors(self):
        """``(name, tensor)`` of the policy's full state dict, tied output layer included (``state_dict`` and not
        ``named_parameters``: a tied ``lm_head.weight`` is missing from the latter). Here the live tensors themselves:
        every rank holds all of them (one process, DDP, ZeRO-1/2); sharded backends gather each one."""
        yield from self.module.policy.state_dict().items()

    def weight_chunks(self, dtype: torch.dtype, max_bytes: int):
        """The policy's full parameters in ``dtype`` as lists of ``(name, tensor)`` of at most ``max_bytes`` (a larger
        tensor travels alone), produced lazily: at most one chunk and one tensor exist at a time beyond the model.
        A collective when sharded: every rank iterates it to the end, in the same order."""
        pairs = ((name, t.detach().to(dtype)) for name, t in self.full_tensors())
        return chunked(pairs, max_bytes)

    def sync_engine(self, engine) -> None:
        """Make ``engine`` sample from the policy's current weights. An engine with its own copy (``load_weights``:
        vLLM) is streamed the full parameters chunk by chunk; one that samples from the policy object (HF, plug-ins)
        is handed the policy, with every parameter present. A collective when sharded: every rank calls it."""
        if callable(getattr(engine, "load_weights", None)):
            engine.load_weights(self.weight_chunks(engine.dtype, engine.sync_chunk_bytes))
        else:
            with self.full_parameters():
                engine.sync_weights(self.module.policy)
        probe.emit("synced", backend=self, engine=engine)

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

    # ---- checkpoints (collectives: every rank calls them)
    def optimizer_state(self, optimizer):
        raise NotImplementedError

    def load_optimizer_state(self, optimizer, state) -> None:
        raise NotImplementedError

    def full_state_dict(self) -> dict | None:
        """The policy's full state dict for rank 0's checkpoint, or None when ``save_pretrained`` can read the live
        model."""
        return None
