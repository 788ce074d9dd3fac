"""``trainer.strategy: auto | ddp`` — one process, or data parallelism with the gradients all-reduced by this backend.

One process: AdamW on the parameters, or on fp32 master copies when the model is half precision
(``optim.master_weights``, ``grail_exp.optim.MasterWeightAdamW``: gradients accumulate into the fp32 masters after each
backward, the bf16 buffers are freed). Under DDP (``trainer=ddp``) every rank runs the same step on its slice of the
prompts and the gradients are summed across ranks by **one flat all-reduce per optimiser step** — what
``DistributedDataParallel`` with ``no_sync`` on every micro-batch but the last computes, without DDP's reducer, which
does not expect several backwards (micro-batches, GRAIL's probe gradient) inside one ``training_step``. The loss
normalisers count every rank's rows (``world_size`` in the aggregation), so after the mean over ranks the gradient is
that of one process on the whole batch.

On the CPU this backend also hands freed heap back to the OS at the phases' boundaries and, inside each backward, at
``trainer.backward_heap_returns`` points down the decoder (``grail_exp/compute/host.py``): a CPU run's tensors live in the
process heap, which glibc otherwise keeps at the last phase's high-water mark (docs/performance.md).
"""

from __future__ import annotations

import torch

from grail_exp import world
from grail_exp.compute.host import return_freed_memory, return_freed_memory_after_gradients
from grail_exp.models.loading import decoder_layers
from grail_exp.optim import GRAD_ACCUM_DTYPES, build_optimizer, grad_params
from grail_exp.training.backends.base import PlanItem, UpdateBackend, more_ranks, raw_optimizer, register_backend


@register_backend("auto", "ddp")
class LocalBackend(UpdateBackend):
    @classmethod
    def check_config(cls, cfg) -> list[str]:
        acc = cfg.optim.get("grad_accum_dtype")
        if acc is not None and acc not in GRAD_ACCUM_DTYPES:
            return [f"optim.grad_accum_dtype = {acc!r}: must be null, fp32 or bf16"]
        if acc is not None and str(cfg.trainer.strategy) != "auto":
            return [f"optim.grad_accum_dtype = {acc!r}: only one process (trainer.strategy=auto) implements a choice; "
                    "under trainer=ddp gradients accumulate in the parameters' .grad: set it to null"]
        return []

    # ---- the memory planner's questions: every rank holds the whole model state
    @classmethod
    def memory_layout(cls, cfg, world):
        return "ddp" if world > 1 else "single"

    @staticmethod
    def _masters(cfg, b: int) -> bool:
        """fp32 master weights: ``optim.master_weights``, or null = on for a half-precision model (build_optimizer)."""
        master = cfg.optim.get("master_weights")
        return b == 2 if master is None else bool(master)

    @classmethod
    def planned_state(cls, cfg, n, b, world):
        master = cls._masters(cfg, b)
        items = [PlanItem("parameters", n * b, f"N {n:,} x {b} B")]
        if master:
            items.append(PlanItem("fp32 master weights", 4 * n, "4 B x N"))
        items.append(PlanItem("Adam moments", 8 * n, "2 x 4 B x N (fp32)" if master or b == 4 else "2 x b x N"))
        return items

    @classmethod
    def planned_gradients(cls, cfg, n, b, world):
        master = cls._masters(cfg, b)
        if world == 1:  # accumulated into the fp32 masters after each backward (grail_exp/optim.py)
            return [PlanItem("gradients", 4 * n if master or b == 4 else b * n,
                             "fp32, accumulated over micro-batches (the bf16 ones are freed as they arrive)"
                             if master else "b x N")]
        masters = " + fp32 masters' 4 B x N" if master else ""
        return [PlanItem("gradients", b * n + (4 * n if master else 0), "b x N on the parameters between all-reduces"
                         + masters)]

    @classmethod
    def planned_gradient_sync(cls, cfg, n, b, world):
        if world == 1:
            return []
        master = cls._masters(cfg, b)
        return [PlanItem("gradient all-reduce", 4 * n + (4 * n if master else 0) + b * n, "flat fp32 buffer 4N + the "
                         "masters' 4N + the parameters' copies bN (training/backends/local.py)")]

    @classmethod
    def shard_options(cls, cfg, world):
        t = cfg.trainer
        if world > 1:  # shard the state across the same ranks, or use more of them
            return [[["trainer=fsdp", f"trainer.devices={t.devices}"]], more_ranks(cfg)]
        if str(t.accelerator) == "cpu":
            return []
        # one device: shard the state over several (the paper's ZeRO-2 layout)
        return [[["trainer=fsdp_zero2", f"trainer.devices={d}"] for d in (2, 4, 8) if t.prompts_per_step % d == 0]]

    def build_optimizer(self, policy):
        o = self.cfg.optim
        # what trains decides (under peft=lora the fp32 adapters on a bf16 base need no masters)
        half = any(p.dtype in (torch.bfloat16, torch.float16) for p in policy.parameters() if p.requires_grad)
        master = o.master_weights if o.master_weights is not None else half
        # fp32 accumulation hooks move gradients off the parameters during backward: fine on one process; under data
        # parallelism the all-reduce needs them on the parameters first. optim.grad_accum_dtype=bf16 leaves them there:
        # autograd sums each micro-batch's gradient into the bf16 .grad (one rounding per add, as ZeRO's bf16 default),
        # converted to fp32 once at the step.
        fp32 = (o.get("grad_accum_dtype") or "fp32") == "fp32"
        return build_optimizer(policy, o, master_weights=bool(master), accumulate_fp32=world.world_size() == 1 and fp32)

    def backward(self, loss):
        self.module.manual_backward(loss)

    # ---- the host heap (CPU policies only)
    def _on_cpu(self) -> bool:
        return next(self.module.policy.parameters()).device.type == "cpu"

    def placed(self) -> None:
        """On the CPU: ``trainer.backward_heap_returns`` points in each backward where freed heap goes back, after
        layers L·(n-1)/n, ..., L/n, 0 of the policy's L decoder layers (the hooks' handles: ``heap_hooks``)."""
        n = int(self.cfg.trainer.get("backward_heap_returns", 1))
        layers = decoder_layers(self.module.policy, self.cfg)
        if getattr(self, "heap_hooks", None) or n <= 0 or not layers or not self._on_cpu():
            return
        points = sorted({len(layers) * k // n for k in range(n)})
        self.heap_hooks = [h for i in points for h in return_freed_memory_after_gradients(layers[i].parameters())]

    def _return_heap(self) -> None:
        if self._on_cpu():
            return_freed_memory()

    after_probe_backward = after_backward = after_step = after_generation = _return_heap

    def gradients(self, optimizer) -> list[torch.Tensor]:
        """The step's gradient tensors (fp32 masters or parameters), summed across ranks first under DDP."""
        params = grad_params(optimizer, self.module.policy)
        n = world.world_size()
        if n > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            world.all_reduce_sum(flat)
            flat /= n  # DDP's convention: the mean over ranks (the normalisers include R)
            offset = 0
            for p, g in zip(params, grads):
                size = g.numel()
                p.grad = flat[offset:offset + size].view_as(g).to(g.dtype)
                offset += size
        return params

    def grad_norm(self, params: list[torch.Tensor]) -> float:
        norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0

    def step(self, optimizer, loss_finite):
        params = self.gradients(optimizer)
        return self.clip_and_step(optimizer, params, self.grad_norm(params), loss_finite)

    def shared_checkpoint(self, optimizer):
        # Every rank holds the same, whole optimiser state (one process or DDP): rank 0 writes it once.
        return {"optimizer": raw_optimizer(optimizer).state_dict()}

    def load_checkpoint(self, optimizer, directory, shared, own):
        raw_optimizer(optimizer).load_state_dict(shared["optimizer"])

    def load_optimizer_state(self, optimizer, state):
        raw_optimizer(optimizer).load_state_dict(state)
