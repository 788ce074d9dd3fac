"""Rollout correction: truncated importance sampling for the sampler/trainer mismatch (vLLM vs the trainer).

The rollout engine samples from π_sampler (vLLM kernels, bf16, its own copy of the weights) while the loss
assumes the samples came from π_old (the trainer's forward at the same parameters). Their per-token ratio

    ρ^IS_{i,t} = exp(logp_old − logp_sampler)            (both = log softmax(z/T)[o_t], untruncated)

multiplies the per-token loss (detached). The definition and the modes are TRL's (``vllm_importance_sampling_*``)
and verl's (``rollout_correction``) ("Your efficient RL framework secretly brings you off-policy RL training",
Yao et al. 2025, fengyao.notion.site/off-policy-rl; IcePop arXiv 2510.18855); the defaults are not (below).
Modes (``rollout.is_correction.mode``):

    none               ρ^IS = 1
    token_truncate     w_t = min(ρ_t, C_max) (and ≥ C_min when set)                          TIS
    token_mask         w_t = ρ_t if C_min ≤ ρ_t ≤ C_max else 0                                  IcePop / MIS
    sequence_truncate  w_i = min(Π_t ρ_t, C_max) on every token of the sequence
    sequence_mask      w_i = Π_t ρ_t if C_min ≤ Π_t ρ_t ≤ C_max else 0

(C_min null = no lower bound: 0 for masks, none for truncation.) ``sequence_mask`` with C_min null is TRL's rule
exactly: ``ratio.masked_fill(ratio > C_max, 0)`` on exp(Σ_t (old − sampler)), every token of the sequence, every one
of the μ iterations (the weights come from the fixed old and sampler log-probs).

Defaults: off for ``rollout=hf`` (the sampler *is* the policy: ρ^IS = 1 up to rounding); ``token_truncate`` at
C_max = 2 on the trainer's full-vocabulary log-probs for ``rollout=vllm`` (the TIS blog's choice, not TRL's default);
TRL's default — ``sequence_mask`` at C_max = 3, on vLLM's processed (top-k-renormalised) log-probs, as the GRAIL
reference ran — is ``rollout=vllm_paper``. verl's default is off.
"""

from __future__ import annotations

import torch

from grail_exp.errors import ConfigError

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
               clip_min: float | None, clip_max: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) detached weights and diagnostics (ratio mean/min/max over valid tokens, masked fraction)."""
    m = mask.bool()
    log_ratio = (old_logp.detach().float() - sampler_logp.float()) * mask.float()  # (B, T), 0 on padding
    if mode == "none":
        return torch.ones_like(log_ratio), {}
    lo = clip_min if clip_min is not None else 0.0
    if mode.startswith("token"):
        ratio = torch.exp(log_ratio)
    elif mode.startswith("sequence"):
        ratio = torch.exp(log_ratio.sum(-1, keepdim=True)).expand_as(log_ratio)  # Π_t ρ_t, on every token
    else:
        raise ConfigError(f"rollout.is_correction.mode must be one of {MODES}, got {mode!r}")
    if mode.endswith("truncate"):
        w = ratio.clamp(max=clip_max)
        if clip_min is not None:
            w = w.clamp(min=clip_min)
        dropped = torch.zeros_like(m)
    else:
        keep = (ratio >= lo) & (ratio <= clip_max)
        w = torch.where(keep, ratio, torch.zeros_like(ratio))
        dropped = ~keep & m
    n = m.sum().clamp(min=1)
    valid_ratio = ratio[m] if m.any() else torch.ones(1)
    metrics = {"is/ratio_mean": valid_ratio.mean().item(), "is/ratio_min": valid_ratio.min().item(),
               "is/ratio_max": valid_ratio.max().item(), "is/masked_frac": (dropped.sum() / n).item(),
               "is/weight_mean": (w[m].mean().item() if m.any() else 1.0)}
    return w.detach(), metrics


def needs_old_logprobs(cfg) -> bool:
    """Whether the update needs the rollout-time log-probs π_old (a no-grad forward at the rollout parameters) instead
    of sg(log π_θ) of the live forward. verl's rule (``dp_actor.update_policy``: on-policy only with one mini-batch and
    one epoch) and TRL's (``_generate_and_score_completions``: old log-probs whenever a generation batch feeds more than
    one optimiser step): with k mini-batches × μ epochs > 1 every step after the first sees moved parameters, so the
    PPO ratio, its clip and the off-policy mask need π_old. An IS correction needs them too (π_old vs the sampler)."""
    steps = cfg.loss.num_iterations * cfg.trainer.get("mini_batches_per_rollout", 1)
    return steps > 1 or cfg.rollout.is_correction.mode != "none"
