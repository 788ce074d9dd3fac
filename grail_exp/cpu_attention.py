"""Attention written as two products and a float32 softmax, for short sequences on a CPU.

    S = scale · Q Kᵀ (masked)      P = softmax(S) = exp(S − lse)      O = P V

with grouped-query heads (the G query heads of a key/value head share it; no copy of K, V per query head). The
backward recomputes P from the saved log-sum-exp instead of keeping it, as flash attention does, so autograd holds
what PyTorch's fused kernel holds (Q, K, V in their own dtype, one float per query row):

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ⊙ (dP − rowsum(P ⊙ dP))      dQ = scale · dS K      dK = scale · dSᵀ Q

(summed over the G query heads of each key/value head by the products themselves).

Why: at the real-model study's lengths (~40–160 key positions) PyTorch's fused CPU attention kernel spends most of its
time outside arithmetic; its backward was ~23 % of the update's backward. These few batched matrix products measured
35-40 % cheaper per layer forward + backward at SmolLM2's heads (``python -m grail_exp.bench bench.mode=attention``;
numbers in docs/performance.md). Longer sequences keep the fused kernel (``model.cpu_explicit_attention_max_scores``), as do
forward passes without gradients, where the fused kernel is the faster one. Computed in float32 for bfloat16 / float16
inputs (as the fused kernel accumulates), in the inputs' own dtype otherwise. A query row with no key to attend to
(a left-padding position) gets a zero output and zero gradients, as from the fused kernel.
"""

from __future__ import annotations

import torch

# The default of model.cpu_explicit_attention_max_scores (query x key positions per head): where the explicit path
# stops being the faster one on a 2-core x86 machine (bench.mode=attention, explicit / fused at 2 threads: 0.87 at
# 128 x 128, 0.93 at 160 x 160, 1.61 at 192 x 192; at 1 thread 0.91 at 130 x 130, 1.05 at 160 x 160), so that it
# covers the prefix pass of SmolLM2's 131-token few-shot prompts (130 x 130) as well as the study's short prompts.
DEFAULT_MAX_SCORES = 20_000


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _grouped(q: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, L, D) -> (B, kv_heads, G·L, D): the G query heads of each key/value head stacked along the rows."""
    b, h, length, d = q.shape
    return q.to(dtype).reshape(b, kv_heads, (h // kv_heads) * length, d)


def _scores(qg: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, groups: int) -> torch.Tensor:
    """scale · Q Kᵀ with masked entries at −inf: (B, kv_heads, G·Lq, Lk)."""
    s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)
    b, hk, rows, lk = s.shape
    s5 = s.view(b, hk, groups, rows // groups, lk)
    if mask.dtype == torch.bool:
        s5.masked_fill_(~mask.unsqueeze(2), float("-inf"))
    else:
        s5.add_(mask.unsqueeze(2).to(s.dtype))
    return s


class ExplicitAttention(torch.autograd.Function):
    """O = softmax(scale · Q Kᵀ + mask) V with grouped-query heads; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        b, h, lq, d = q.shape
        hk = k.shape[1]
        groups = h // hk
        dt = _compute_dtype(q.dtype)
        qg, kf, vf = _grouped(q, hk, dt), k.to(dt), v.to(dt)
        s = _scores(qg, kf, mask, scale, groups)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp_(s.sub_(m))
        total = p.sum(-1, keepdim=True)
        p.div_(total.clamp_min(torch.finfo(dt).tiny))  # a row with no key: all zeros, not 0/0
        out = torch.matmul(p, vf)  # (B, kv_heads, G·Lq, D)
        # lse = +inf for a row with no key, so the backward's exp(S − lse) is 0 there too.
        lse = torch.where(total > 0, m + total.log(), torch.full_like(total, float("inf")))
        ctx.save_for_backward(q, k, v, mask, lse)
        ctx.scale, ctx.groups = scale, groups
        return out.reshape(b, h, lq, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, lse = ctx.saved_tensors
        scale, groups = ctx.scale, ctx.groups
        hk = k.shape[1]
        dt = _compute_dtype(q.dtype)
        qg, kf, vf = _grouped(q, hk, dt), k.to(dt), v.to(dt)
        p = torch.exp_(_scores(qg, kf, mask, scale, groups).sub_(lse))
        dog = _grouped(grad_out, hk, dt)
        dv = torch.matmul(p.transpose(-1, -2), dog)
        dp = torch.matmul(dog, vf.transpose(-1, -2))
        ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(scale)
        dq = torch.matmul(ds, kf).reshape(q.shape)
        dk = torch.matmul(ds.transpose(-1, -2), qg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """query (B, H, Lq, D), key / value (B, kv_heads, Lk, D), mask (B | 1, 1, Lq, Lk) boolean (True: attend) or
    additive -> (B, H, Lq, D)."""
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected a (batch, 1, queries, keys) mask, got shape {tuple(mask.shape)}")
    return ExplicitAttention.apply(query, key, value, mask, float(scale))
