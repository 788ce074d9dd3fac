"""The optimal token baseline (OTB): a per-token, variance-minimising baseline (R. Li, "The Optimal Token Baseline",
richardli.xyz/optimal-token-baseline; verl ``optimal_token_baseline``). The one per-token estimator among the
anchors, and the natural baseline to compare GRAIL / OAR against.

With G_{i,t} = r_i (outcome reward, γ = 1: the return-to-go), π_{i,t} the rollout policy's probability of the sampled
token and Σπ²_{i,t} = Σ_v π(v | prefix)² its collision probability:

    w_{i,t} = 1 − 2 π_{i,t} + Σπ²_{i,t}                        (= ‖∇_z log π(o_t)‖², the score's squared norm)
    W_{i,t} = Σ_{s ≤ t} w_{i,s}                                 (cumulative "path variance")
    B_t     = Σ_{i∈g} G_{i,t} W_{i,t} m_{i,t} / (Σ_{i∈g} W_{i,t} m_{i,t} + 1e-8)      (over the group's rows alive at t)
    A_{i,t} = (G_{i,t} − B_t) · m_{i,t}

Zero tail (``estimator.handle_zero_tail``, verl's default ``handle_zero_tail=True``): when a group's longest
completion is unique, B_t = 0 on its positions t ≥ the second-longest length (lengths = loss-mask token counts), so
those tail tokens get A = r. Without it (``false``) the group there is that one row and B_t = r·W/(W + 1e-8) gives
A ≈ 0: the lone row's own return is its baseline. A group of one rollout has no baseline (A = r), as verl.

Needs ``sum_pi_squared`` and ``logp`` (N, C) from the policy at rollout time: the trainer computes both in one chunked
pass (``sum_pi_squared_from_hidden``: logits chunk by chunk, never a (N, C, V) float32 copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.estimators.base import (
    EstimatorConfig,
    EstimatorInput,
    EstimatorOutput,
    group_zero_std,
    register_estimator,
)


@dataclass
class OTBConfig(EstimatorConfig):
    name: str = "optimal_token_baseline"
    handle_zero_tail: bool = True  # B_t = 0 on the unique longest completion's tail (verl default true); false = A ≈ 0 there


@register_estimator("optimal_token_baseline", OTBConfig, needs=("sum_pi_squared",))
def optimal_token_baseline(inp: EstimatorInput, cfg) -> EstimatorOutput:
    for k in ("sum_pi_squared", "logp"):
        if k not in inp.extras:
            raise ValueError(f"estimator=optimal_token_baseline needs extras[{k!r}] (N, C) from the rollout policy")
    G = inp.num_generations
    m = inp.completion_mask.float()
    N, C = m.shape
    w = 1.0 - 2.0 * torch.exp(inp.extras["logp"].float()) + inp.extras["sum_pi_squared"].float()
    W = torch.cumsum(w.to(m.device) * m, dim=-1) * m  # (N, C)
    ret = inp.rewards.float().to(m.device).unsqueeze(1) * m  # G_{i,t}
    Wg, Rg = W.view(-1, G, C), ret.view(-1, G, C)
    mg = m.view(-1, G, C)
    baseline = ((Rg * Wg).sum(1, keepdim=True) / (Wg.sum(1, keepdim=True) + 1e-8)).expand(-1, G, -1).clone()
    tail_tokens = 0
    if G == 1:
        baseline.zero_()
    elif getattr(cfg, "handle_zero_tail", True):
        lengths = mg.sum(-1)  # (P, G)
        longest, second = torch.topk(lengths, 2, dim=1).values.unbind(1)  # (P,) each
        unique = (lengths == longest.unsqueeze(1)).sum(1) == 1
        pos = torch.arange(C, device=m.device)
        tail = unique.unsqueeze(1) & (pos.unsqueeze(0) >= second.unsqueeze(1))  # (P, C)
        rows = torch.arange(lengths.shape[0], device=m.device)
        owner = lengths.argmax(1)
        baseline[rows, owner] = torch.where(tail, torch.zeros_like(tail, dtype=baseline.dtype), baseline[rows, owner])
        tail_tokens = int((tail.float() * mg[rows, owner]).sum())
    adv = ((Rg - baseline) * mg).view(N, C)
    return EstimatorOutput(adv, group_zero_std(inp.rewards, G), {"otb/baseline_mean": float(baseline.mean()),
                                                                   "otb/zero_tail_tokens": float(tail_tokens)})


def sum_pi_squared_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               temperature: float, chunk_tokens: int = 4096) -> torch.Tensor:
    """(B, C) Σ_v softmax(z/T)_v² from the hidden states (B, C, d) and the output layer, ``chunk_tokens`` rows of
    logits at a time: Σπ² = exp(logsumexp(2z') − 2·logsumexp(z')) with z' = z/T (stable, float32)."""
    B, C, d = hidden.shape
    flat = hidden.reshape(-1, d)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, flat.shape[0], chunk_tokens):
        z = torch.nn.functional.linear(flat[s:s + chunk_tokens], weight, bias).float() / temperature
        out[s:s + chunk_tokens] = torch.exp(torch.logsumexp(2.0 * z, -1) - 2.0 * torch.logsumexp(z, -1))
    return out.view(B, C)
