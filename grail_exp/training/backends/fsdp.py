"""``trainer.strategy: fsdp`` (``trainer=fsdp``, ``trainer=fsdp_zero2``) — the policy sharded with FSDP2.

``torch.distributed.fsdp.fully_shard``: each decoder layer is a shard unit and the whole policy forward of a
micro-batch — embeddings, decoder, chunked output-layer log-probs — is one call of the root unit (``PolicyCore``), so
FSDP's hooks gather and free parameters around everything the trainer and the schemes touch. fp32 sharded parameters
are the master weights (the policy is loaded in fp32, ``policy_overrides``); compute runs in ``model.dtype``
(``MixedPrecisionPolicy``), gradients are reduce-scattered in fp32 in FSDP's backward hooks. Generation, scheme
``prepare`` passes and checkpoints see the full parameters (``full_parameters``; full state dicts on rank 0); an
engine with its own copy of the weights (vLLM) is streamed them one gathered tensor at a time (``weight_chunks``).

``sharding_strategy``: FULL_SHARD (ZeRO-3-like: a layer's parameters are freed after its forward and gathered again
for backward) or SHARD_GRAD_OP (ZeRO-2-like, the paper's layout: kept gathered from forward to backward); gradients
and optimiser state stay sharded either way.

Lightning's own FSDPStrategy (FSDP1) refuses CPU and wraps ``training_step`` in one root forward, which does not fit a
step with several forwards and backwards; FSDP2 runs on CPU (gloo), so it is tested here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from grail_exp.compute.forward import policy_forward
from grail_exp.models import lora
from grail_exp.optim import build_optimizer, grad_params
from grail_exp.training.backends.base import PlanItem, UpdateBackend, cast, more_ranks, raw_optimizer, register_backend

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


class PolicyCore(torch.nn.Module):
    """The policy forward of a micro-batch as one module call (the FSDP root unit): ``grail_exp.compute.forward.policy_forward``."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, position_ids, completion_ids, temperature: float, chunk_tokens: int,
                hidden_states: bool, logprob_dtype: str = "float32", share_prompts: bool = False):
        logp, entropy, fwd = policy_forward(self.policy, input_ids, attention_mask, position_ids, completion_ids,
                                            temperature, chunk_tokens=chunk_tokens, hidden_states=hidden_states,
                                            logprob_dtype=logprob_dtype, share_prompts=share_prompts,
                                            anchor_prefix=True)  # FSDP's backward hooks: forward.body_forward
        return logp.clone(), entropy.clone(), fwd  # not views: FSDP hooks the outputs for its backward


def shard_policy(policy: torch.nn.Module, cfg) -> PolicyCore:
    """FSDP2-shard the policy in place: one unit per decoder layer, the rest in the root ``PolicyCore`` (kept gathered
    between its forward and backward so the schemes can read the output layer and the embeddings)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from grail_exp.models.loading import DTYPES, decoder_layer_classes

    compute = DTYPES[cfg.model.dtype]
    # peft=lora: the frozen base is held in model.dtype already (the cast leaves it as it is) and the fp32 adapters are
    # the master weights, cast for compute like full fine-tuning's; peft.adapter_dtype=float32 computes them in fp32
    # (nothing cast). The trainable tensors, all fp32, reduce in fp32 (one dtype per unit).
    cast = compute != torch.float32 and not (lora.enabled(cfg) and cfg.peft.get("adapter_dtype") == "float32")
    mp = MixedPrecisionPolicy(param_dtype=compute if cast else None, reduce_dtype=torch.float32)
    layer_types = tuple(decoder_layer_classes(cfg))
    reshard = (cfg.trainer.get("sharding_strategy") or "FULL_SHARD") == "FULL_SHARD"
    for module in policy.modules():
        if isinstance(module, layer_types):
            fully_shard(module, mp_policy=mp, reshard_after_forward=reshard)
    core = PolicyCore(policy)
    fully_shard(core, mp_policy=mp, reshard_after_forward=False)
    return core


def receive_shards(core: PolicyCore, full: dict, device: torch.device) -> None:
    """Every rank's shards of the sharded policy, on ``device``, from rank 0's full state dict ``full`` (empty on
    the other ranks, whose parameters are meta): each rank allocates its shards, rank 0 broadcasts one full tensor at a
    time and each rank keeps its slice (``set_model_state_dict`` with ``broadcast_from_rank0``, as verl loads FSDP2
    models), so no rank but 0 ever holds more than its shards and one tensor in flight. The buffers, which the state
    dict leaves out when non-persistent (RoPE tables), are then broadcast as they are (``broadcast_buffers``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from grail_exp import world
    from grail_exp.training.backends.base import broadcast_buffers, tensor_specs

    # On the FSDP root, not the policy inside it: each unit's _apply re-registers its sharded parameters, the root's
    # (embeddings, output layer) included; otherwise the optimiser would step tensors the root unit no longer gathers.
    # Rank 0 moves what it holds (its buffers keep their values: it broadcasts them below); the others allocate.
    if world.rank() == 0:
        core.to(device)
    else:
        core.to_empty(device=device)
    # Rank 0's loaded tensors and the others' skeletons, compared once before any tensor travels (global shapes).
    world.check_same_tensors(tensor_specs([*core.policy.state_dict().items(), *core.policy.named_buffers()]),
                             f"the ranks' {type(core.policy).__name__} differ")
    set_model_state_dict(core.policy, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full.clear()
    broadcast_buffers(core.policy)


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
def full_parameters(core: torch.nn.Module, reshard_after_forward: bool):
    """Every sharded parameter gathered (no-grad work outside the root forward: generation, scheme ``prepare``).

    Kept gathered until the context ends: with FULL_SHARD a layer's forward would otherwise free its parameters
    again, and the next call of that layer (every generated token) would all-gather them anew — a collective inside
    generation, which hangs as soon as two ranks generate a different number of tokens or calls (their own prompts,
    their share of an evaluation)."""
    initialize_root(core)
    units = fsdp_units(core)
    for u in units:
        u.unshard()
    hold(core)
    try:
        yield
    finally:
        release(core, reshard_after_forward)
        for u in units:
            u.reshard()


def hold(core: torch.nn.Module) -> None:
    """Keep every gathered unit gathered through forwards and backwards (no reshard, hence no re-gather: no collective)
    until ``release``. FSDP otherwise frees a layer after its forward (FULL_SHARD) or after any backward through it —
    a scheme's probe gradient with respect to the embeddings included — and the next use all-gathers it again."""
    core.set_reshard_after_forward(False)
    core.set_reshard_after_backward(False)


def release(core: torch.nn.Module, reshard_after_forward: bool) -> None:
    """Back to the configured behaviour: layers reshard after forward under FULL_SHARD (the root unit never) and every
    unit after its backward."""
    for u in fsdp_units(core):
        u.set_reshard_after_forward(reshard_after_forward and u is not core, recurse=False)
    core.set_reshard_after_backward(True)


def gathered_tensors(policy: torch.nn.Module, dtype: torch.dtype | None = None, keep=None):
    """``(name, full tensor)`` of the policy's state dict, each gathered from the ranks' shards when it is asked for
    (one all-gather per tensor, a collective: every rank walks the same names). The state dict's own pre-hook puts
    any gathered unit back to its shards first, so every value is a DTensor here (or a plain, replicated tensor).
    ``dtype``: each shard is cast before its gather (elementwise, so the same values as casting the gathered fp32
    tensor), halving what travels and what is held for a bf16 engine or export. ``keep``: only the names it accepts
    are gathered."""
    from torch.distributed.tensor import DTensor

    for name, t in policy.state_dict().items():
        if keep is None or keep(name):
            t = cast(t.detach(), dtype)
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t)


@register_backend("fsdp")
class FSDPBackend(UpdateBackend):
    broadcast_initial_weights = False  # every rank built the same weights and shards them itself
    owns_master_weights = True  # fp32 sharded parameters
    shards_parameters = True

    def __init__(self, cfg, module):
        super().__init__(cfg, module)
        self.core: PolicyCore | None = None

    @classmethod
    def policy_overrides(cls, cfg) -> dict:
        # fp32 sharded parameters are the master weights; under peft=lora only the adapters train: they are made
        # fp32 (the masters), and the frozen base stays in model.dtype
        return {"peft": {"adapter_dtype": "float32"}} if lora.enabled(cfg) else {"model": {"dtype": "float32"}}

    @classmethod
    def check_config(cls, cfg) -> list[str]:
        s = cfg.trainer.get("sharding_strategy")
        if s is not None and s not in SHARDING_STRATEGIES:
            return [f"trainer.sharding_strategy = {s!r}: must be FULL_SHARD or SHARD_GRAD_OP (trainer=fsdp)"]
        if cfg.optim.get("grad_accum_dtype") is not None:
            return [f"optim.grad_accum_dtype = {cfg.optim.grad_accum_dtype!r}: FSDP accumulates in its fp32 sharded "
                    "gradients (reduce_dtype fp32); leave it null"]
        return []

    # ---- the memory planner's questions: fp32 shards of everything; b-byte layers gathered around their use
    @staticmethod
    def _keeps_gathered(cfg) -> bool:
        """SHARD_GRAD_OP: each layer stays gathered from its forward to its backward."""
        return (cfg.trainer.get("sharding_strategy") or "FULL_SHARD") == "SHARD_GRAD_OP"

    @classmethod
    def memory_layout(cls, cfg, world):
        return "fsdp_grad_op" if cls._keeps_gathered(cfg) else "fsdp_full"

    @classmethod
    def planned_state(cls, cfg, n, b, world):
        return [PlanItem("fp32 parameter shards (the masters)", 4 * n / world, f"4 B x N / W {world}"),
                PlanItem("Adam moments", 8 * n / world, "8 B x N / W")]

    @classmethod
    def planned_gradients(cls, cfg, n, b, world):
        return [PlanItem("gradients", 4 * n / world, "fp32 shards 4 B x N / W (reduce-scattered in backward)")]

    @classmethod
    def planned_gathered(cls, cfg, shape, b, held):
        n = shape.params
        if cls._keeps_gathered(cfg):
            return PlanItem("gathered parameters", n * b,
                            "every layer's b-byte copy, kept from forward to backward (SHARD_GRAD_OP)")
        if held:  # hold(): FULL_SHARD keeps every layer gathered until the micro-batch's backward
            return PlanItem("gathered parameters", n * b, "every layer's b-byte copy: the scheme or a loss term calls "
                            "the model between forward and backward, so FULL_SHARD keeps the layers gathered until the "
                            "backward")
        root = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
        per_layer = (n - root) / shape.layers
        return PlanItem("gathered parameters", (root + 2 * per_layer) * b,
                        "the root unit (embeddings, output layer) + two layers (one prefetched), b bytes (FULL_SHARD)")

    @classmethod
    def planned_checkpoint_shard(cls, cfg, n, b, world, rank, tensor):
        # torch.distributed.checkpoint copies one shard tensor to the host at a time; rank 0's export of the full
        # weights is counted by the planner (one gathered fp32 tensor)
        return PlanItem("checkpoint part", 4 * tensor / world, "one fp32 shard tensor at a time, the largest the "
                        "embedding's 4 B x V x h / W")

    @classmethod
    def shard_options(cls, cfg, world):
        if cls._keeps_gathered(cfg):  # FULL_SHARD frees each layer after its forward
            return [[["trainer=fsdp", f"trainer.devices={cfg.trainer.devices}"]], more_ranks(cfg)]
        return [more_ranks(cfg)]

    def configure_model(self, policy):
        """Shard the policy; under ``weights_from_rank0`` fill every rank's shards from rank 0's loaded copy."""
        from grail_exp import world

        if self.core is not None:
            return
        if not self.weights_from_rank0(self.cfg) or world.world_size() == 1:
            self.core = shard_policy(policy, self.cfg)
            return
        # Rank 0's loaded fp32 tensors, referenced only here once sharding has replaced the parameters: dropped at the
        # end of this function, so rank 0's host copy lives no longer than the broadcast.
        full = dict(policy.state_dict()) if world.rank() == 0 else {}
        self.core = shard_policy(policy, self.cfg)
        receive_shards(self.core, full, self.compute_device())

    def build_optimizer(self, policy):
        return build_optimizer(policy, self.cfg.optim, master_weights=False)

    def forward(self, model, input_ids, attention_mask, position_ids, completion_ids, *, hidden_states=False,
                hold_gathered=False):
        if self.core is None or model is not self.core.policy:  # the reference model or a teacher: not sharded
            return super().forward(model, input_ids, attention_mask, position_ids, completion_ids,
                                   hidden_states=hidden_states)
        if hold_gathered and torch.is_grad_enabled():
            # Probe rows differ between ranks: a probe's backward (or forward) through resharded layers would
            # all-gather on some ranks only and hang the others. Gathered until this micro-batch's backward.
            hold(self.core)
            self._held = True
        return self.core(input_ids, attention_mask, position_ids, completion_ids, self.cfg.rollout.temperature,
                         self.cfg.trainer.logprob_chunk_tokens, hidden_states,
                         self.cfg.trainer.get("logprob_dtype", "float32"), self.share_prompts)

    def full_parameters(self):
        if self.core is None:
            return super().full_parameters()
        return full_parameters(self.core, self._reshard_after_forward())

    def full_tensors(self, dtype=None, keep=None):
        if self.core is None:
            return super().full_tensors(dtype, keep)
        return gathered_tensors(self.core.policy, dtype, keep)

    def backward(self, loss):
        # A held micro-batch's loss backward keeps every unit gathered too, and the units are resharded after it. A
        # scheme's probe backward ran on some ranks only and used up FSDP's record of the forward order there, so the
        # ranks no longer agree on which unit to prefetch; any re-gather inside this backward (a unit resharded after
        # one of its calls while another call of it, a shared prompt's prefix pass, still needs it) would then be an
        # all-gather on one rank against a reduce-scatter on the other: a hang. Nothing re-gathered, nothing to pair.
        self.module.manual_backward(loss)
        if getattr(self, "_held", False):
            for unit in fsdp_units(self.core):
                unit.reshard()
            release(self.core, self._reshard_after_forward())
            self._held = False

    def _reshard_after_forward(self) -> bool:
        return (self.cfg.trainer.get("sharding_strategy") or "FULL_SHARD") == "FULL_SHARD"

    def step(self, optimizer, loss_finite):
        params = grad_params(optimizer, self.core.policy)  # gradients were reduce-scattered in backward
        total = torch.nn.utils.clip_grad_norm_(params, float("inf"))  # the global norm of the DTensor gradients
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        return self.clip_and_step(optimizer, params, norm, loss_finite)

    def load_optimizer_state(self, optimizer, state):
        # The older layout: the full optimiser state in rank 0's file (its weights come from the HF files).
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.core.policy, raw_optimizer(optimizer), optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))

    # ---- checkpoints: model and optimiser shards through torch.distributed.checkpoint (each rank its own files,
    # reshardable to another world size), the full Hugging Face weights an optional export
    model_in_shards = True
    reshardable = True

    def save_shards(self, optimizer, directory):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(optimizer), checkpoint_id=str(directory))

    def load_checkpoint(self, optimizer, directory, shared, own):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from grail_exp.checkpoint import SHARDED_DIR

        state = self._sharded_state(optimizer)  # this rank's live shards: DCP reads into them, resharding as needed
        dcp.load(state, checkpoint_id=str(directory / SHARDED_DIR))
        # peft=lora: the state holds the trainable tensors only (``_sharded_state``), so the frozen base is not
        # "missing" from it; the keys DCP filled are exactly the live state's
        frozen_left_out = lora.enabled(self.cfg)
        set_state_dict(self.core.policy, raw_optimizer(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(ignore_frozen_params=frozen_left_out, strict=not frozen_left_out))

    def _sharded_state(self, optimizer) -> dict:
        """This rank's shards of the policy and its optimiser state (DTensors: DCP knows where each piece belongs)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # peft=lora: the frozen base is not part of the state (it is the start's), only the adapter and its optimiser
        options = StateDictOptions(ignore_frozen_params=lora.enabled(self.cfg))
        model, optim = get_state_dict(self.core.policy, raw_optimizer(optimizer), options=options)
        return {"model": model, "optimizer": optim}
