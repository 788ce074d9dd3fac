"""AdamW with fp32 master weights for half-precision models (``optim.master_weights``).

At the paper's lr 1e-6 an Adam step (~1e-6) is far below the bf16 spacing of a typical weight (~1e-4 at
|w| ≈ 0.02): updating bf16 parameters in place leaves almost every weight unchanged. The paper's setup (DeepSpeed
ZeRO-2, bf16) keeps fp32 master weights and fp32 Adam state and runs bf16 compute; this optimiser does the same on
one device:

    model parameters θ_bf16 (forward / backward / rollouts)      master copy θ_32 + Adam state (fp32)
    after each backward:  g_32 += g_bf16  (fp32 accumulation over micro-batches; the bf16 buffer is freed)
    step:                 clip ‖g_32‖, AdamW on θ_32, θ_bf16 ← round(θ_32)

Under the multi-GPU strategies the strategy owns the same split instead: FSDP keeps fp32 sharded parameters with a
bf16 ``MixedPrecision`` policy (trainer=fsdp, trainer=fsdp_zero2); under DDP this class is used with bf16 gradients
reduced by DDP and accumulated in the
parameters' ``.grad`` (fp32 accumulation hooks would run before DDP's reduction).
Memory per parameter: 2 (bf16 weights) + 4 (master) + 8 (Adam) + 4 (fp32 gradient) = 18 bytes. The first
micro-batch's gradient is held as it came, in bf16 (its fp32 widening is exact, so nothing is lost), and widened when
the second arrives, parameter by parameter: through the second micro-batch's forward and the start of its backward it
takes 2 bytes per parameter instead of 4, with the same bits as widening at once (the step's peak RSS, at the end of
that backward when every fp32 gradient exists, is unchanged; docs/performance.md).

``optim.grad_accum_dtype: bf16`` (one process) skips the accumulation hooks: autograd then sums each micro-batch's
bf16 gradient into the parameter's bf16 ``.grad`` (rounded after every add, as DeepSpeed ZeRO's bf16 default, which
the GRAIL reference ran), moved into the fp32 master once, at the step.
"""

from __future__ import annotations

import torch

GRAD_ACCUM_DTYPES = ("fp32", "bf16")  # optim.grad_accum_dtype (null = the strategy's own)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over fp32 copies of (half-precision) model parameters; the model keeps its dtype."""

    def __init__(self, params, *, accumulate_fp32: bool = True, **adamw_kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        masters = [p.detach().float().clone() for p in self.model_params]
        for m in masters:
            m.requires_grad_(True)
        super().__init__(masters, **adamw_kwargs)
        self.masters = masters
        self._hooks = []
        self._first: list[torch.Tensor | None] = [None] * len(masters)  # micro-batch 1's gradient, not yet widened
        if accumulate_fp32:
            for i, p in enumerate(self.model_params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_into(i)))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters (before another optimiser takes them over)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _accumulate_into(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self.masters[i].grad is None and self._first[i] is None:
                self._first[i] = p.grad  # held in its own dtype: widened exactly when needed
            else:
                self._widen_first(i)
                self._add(i, p.grad)
            p.grad = None  # autograd starts the next micro-batch's gradient afresh

        return hook

    def _add(self, i: int, grad: torch.Tensor) -> None:
        """Master ``i``'s gradient += ``grad``: its exact fp32 copy first, then fp32 += bf16 in place (no copy made)."""
        m = self.masters[i]
        if m.grad is None:
            m.grad = grad.float()
        else:
            m.grad.add_(grad)

    def _widen_first(self, i: int) -> None:
        if self._first[i] is not None:
            self._add(i, self._first[i])
            self._first[i] = None

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Move any gradient still on the model parameters (no hooks, or DDP) into the fp32 masters."""
        for i, p in enumerate(self.model_params):
            self._widen_first(i)
            if p.grad is not None:
                self._add(i, p.grad)
                p.grad = None

    def grad_params(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the step uses (for norms and clipping)."""
        self.prepare_grads()
        return self.masters

    @torch.no_grad()
    def step(self, closure=None):
        self.prepare_grads()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)  # round the fp32 master to the model's dtype
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._first = [None] * len(self.masters)
        for p in self.model_params:
            p.grad = None

    def state_dict(self):
        sd = super().state_dict()
        sd["master_weights"] = [m.detach().clone() for m in self.masters]  # resume keeps the fp32 precision
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            with torch.no_grad():
                for p, m, saved in zip(self.model_params, self.masters, masters):
                    m.copy_(saved)
                    p.copy_(saved)


def grad_params(optimizer, model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors holding the step's gradients: the fp32 masters, or the model's parameters."""
    inner = getattr(optimizer, "optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
    if isinstance(inner, MasterWeightAdamW):
        return inner.grad_params()
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(model: torch.nn.Module, o, *, master_weights: bool, accumulate_fp32: bool = True):
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused AdamW: one pass over each tensor instead of ~8 (on CPU the unfused default loops tensor by tensor;
    # docs/performance.md). The same update up to rounding (measured: <= 1 ulp).
    # Not for sharded parameters (FSDP's DTensors): they keep torch's default implementation.
    fused = master_weights or all(_fusable(p) for p in params)
    if master_weights:
        return MasterWeightAdamW(params, accumulate_fp32=accumulate_fp32, fused=True, **kwargs)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def _fusable(p: torch.Tensor) -> bool:
    """A plain fp32 / bf16 / fp16 tensor on a device with a fused AdamW kernel."""
    from torch.distributed.tensor import DTensor

    return (not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
            and p.dtype in (torch.float32, torch.bfloat16, torch.float16))
