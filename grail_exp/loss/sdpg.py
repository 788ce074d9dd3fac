"""SDPG's auxiliary terms (Liu et al., "Self-Distilled Policy Gradient", arXiv 2606.04036; code lauyikfung/SDPG
``core_algos.compute_sdpg_loss`` / ``_compute_effective_beta``, ``dp_actor._compute_kl_distill_micro_batch``;
other-methods.md §5):

    L_SDPG = L_out + β(k)·L_OPD + α·L_K          L_out: the configured policy loss (``loss.*``)

``sdpg_opd`` — on-policy self-distillation, full vocabulary, per response position t of row i:

    p_t = softmax(z_t / T)                          the student (live policy), gradient flows through all of z_t
    q_t = sg softmax(z^T_t)                         the same live model, prompted with the answer (teacher.py)
    ℓ_t = min( Σ_a p_t(a)·(log p_t(a) − log q_t(a)), 20 )          KL(student ‖ teacher), clamped per token
    L_OPD = aggregate( m_i · ℓ, mask )              m_i = 1[A_i > 0] with ``positive_only`` (the paper's L_OPD⁺), else 1
    β(k) = β_base · min(1, k / T_warm) · clamp((T − k) / T_decay, 0, 1)     (a factor is 1 when its length is 0)

T is the rollout temperature. The official ``_compute_kl_distill_micro_batch`` divides only the actor's logits by it
("applied to actor logits only"); the teacher's are used as they are (``teacher_temperature: raw``, the default).
``teacher_temperature: sampling`` divides them by T too (a teacher sampled like the student). The two agree at T = 1,
which every shipped recipe uses. k is the 1-based rollout-batch index (``TermContext.rollout_index()``: the official
trainer's ``global_steps``, constant over the optimiser steps of a rollout batch) and T (``total_steps``) counts
rollout batches (the official ``total_training_steps``); the official piecewise rule (warmup while k < T_warm, decay
once k ≥ T − T_decay) equals the product above. The official computes the distillation KL in bf16 (the actor's and
the teacher's log-softmax are kept in the model's bf16 dtype to save memory); here it is float32.

Memory: the student logits are rebuilt per chunk of ``chunk_tokens`` positions from the policy forward's hidden
states under ``torch.utils.checkpoint`` (the forward keeps only each chunk's (n,) KL; the backward recomputes one
chunk's (n, V) student and teacher logits at a time), so no (B, C, V) tensor is ever alive. Cost: one no-grad teacher
forward over (teacher prompt ⊕ completion) plus, per chunk, the (n, V) logits of student and teacher twice (forward
and recompute). Gated-out rows and padding are never projected.

``sdpg_ref_kl`` — per-sampled-token surrogate against the frozen reference π_ref (``needs_reference``), log w = log
π_θ(o_t) − log π_ref(o_t):

    urkl  ½ (log w)²          ufkl  π_ref/π_θ + log w = e^{−log w} + log w
    fkl   π_ref/π_θ           rkl   ½ (log w + 1)²
    L_K = aggregate(·, mask)

Both are normalised like the policy loss (``ctx.aggregate``, i.e. ``loss.loss_type``; SDPG uses token-mean).
Defaults: the scripts' β = α = 1e-3, urkl, no gate, no β schedule (the project page's gate and schedule are off in
every released script: which the paper's runs used is UNVERIFIED), the teacher's logits at temperature 1 (official).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from grail_exp.loss.terms import LossTerm, TermContext, register_loss_term

KL_MODES = ("urkl", "ufkl", "fkl", "rkl")


@dataclass
class SdpgOpdConfig:
    beta: float = 1.0e-3  # β_base (SDPG scripts: 1e-3); 0 = the term is off (exactly the plain loss)
    warmup_steps: int = 0  # T_warm: linear warmup of β (scripts: 0 = off; the paper's value UNVERIFIED)
    decay_steps: int = 0  # T_decay: linear decay of β to 0 at total_steps (scripts: 0 = off; the paper's value UNVERIFIED)
    # T: the run's length in rollout batches (official total_training_steps); needed by decay. conf/loss_term/sdpg_opd.yaml
    # derives it from trainer.max_steps.
    total_steps: int | None = None
    positive_only: bool = False  # the A > 0 gate L_OPD⁺ (project page; beta_distill_positive_advantage_only, scripts: off)
    clamp: float = 20.0  # per-token KL clamp (SDPG code: 20)
    template: str = "sdpg"  # teacher prompt: a name in teacher.py TEMPLATES or a literal with {answer}
    instruction: str = ""  # the {instruction} field (conf/loss_term/sdpg_opd.yaml sets ${data.instruction}, the student's)
    chunk_tokens: int = 1024  # positions per chunk: (chunk, V) float32 student and teacher logits alive at once
    # raw: the teacher's logits are not divided by the rollout temperature (official SDPG) | sampling: they are, like the actor's
    teacher_temperature: str = "raw"


@dataclass
class SdpgRefKlConfig:
    alpha: float = 1.0e-3  # α (SDPG scripts: 1e-3); 0 = the term is off
    mode: str = "urkl"  # urkl (default) | ufkl | fkl | rkl (see the module docstring)


TEACHER_TEMPERATURES = ("raw", "sampling")


def sdpg_beta(cfg, step: int) -> float:
    """β(k) = β_base · min(1, k/T_warm) · clamp((T − k)/T_decay, 0, 1) for the 1-based rollout-batch index k; each
    factor is 1 when its length is 0."""
    beta = float(cfg.beta)
    if cfg.warmup_steps > 0:
        beta *= min(1.0, step / cfg.warmup_steps)
    if cfg.decay_steps > 0:
        beta *= min(1.0, max(0.0, (cfg.total_steps - step) / cfg.decay_steps))
    return beta


def ref_kl_surrogate(logp: torch.Tensor, ref_logp: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token L_K of the given mode; log w = logp − ref_logp."""
    lw = logp - ref_logp
    if mode == "urkl":
        return 0.5 * lw ** 2
    if mode == "ufkl":
        return torch.exp(-lw) + lw
    if mode == "fkl":
        return torch.exp(-lw)
    if mode == "rkl":
        return 0.5 * (lw + 1.0) ** 2
    raise ValueError(f"kl mode {mode!r}: must be one of {', '.join(KL_MODES)}")


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    z = h @ weight.T
    if bias is not None:
        z = z + bias
    return z.float() * inv_t


def chunk_kl(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h_teacher: torch.Tensor,
             inv_t: float, clamp: float, inv_t_teacher: float | None = None) -> torch.Tensor:
    """(n,) min(KL(softmax(h·Wᵀ/T) ‖ sg softmax(h_T·Wᵀ/T')), clamp) for one chunk of positions; 1/T' =
    ``inv_t_teacher`` (None = 1/T)."""
    logp = torch.log_softmax(_logits(h, weight, bias, inv_t), -1)
    with torch.no_grad():
        logq = torch.log_softmax(_logits(h_teacher, weight.detach(), bias.detach() if bias is not None else None,
                                         inv_t if inv_t_teacher is None else inv_t_teacher), -1)
    return (logp.exp() * (logp - logq)).sum(-1).clamp(max=clamp)


def opd_kl(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher_hidden: torch.Tensor,
           temperature: float, clamp: float, chunk_tokens: int, teacher_temperature: float | None = None) -> torch.Tensor:
    """(N,) clamped full-vocabulary KL per position of hidden (N, d) against teacher_hidden (N, d), chunk by chunk,
    differentiable w.r.t. hidden, weight and bias, with one chunk's (n, V) logits alive at a time. The student's
    logits are divided by ``temperature``, the teacher's by ``teacher_temperature`` (None = ``temperature``)."""
    inv_t = 1.0 / temperature
    inv_tt = None if teacher_temperature is None else 1.0 / teacher_temperature
    out = []
    for s in range(0, hidden.shape[0], chunk_tokens):
        e = min(s + chunk_tokens, hidden.shape[0])
        if torch.is_grad_enabled():
            out.append(checkpoint(chunk_kl, hidden[s:e], weight, bias, teacher_hidden[s:e], inv_t, clamp, inv_tt,
                                  use_reentrant=False))
        else:
            out.append(chunk_kl(hidden[s:e], weight, bias, teacher_hidden[s:e], inv_t, clamp, inv_tt))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


@register_loss_term("sdpg_opd", SdpgOpdConfig)
class SdpgOpdTerm(LossTerm):
    @staticmethod
    def check_config(cfg) -> list[str]:
        from grail_exp.teacher import check_template

        e = []
        if cfg.beta < 0:
            e.append(f"beta = {cfg.beta}: must be >= 0")
        for key in ("warmup_steps", "decay_steps"):
            if cfg[key] < 0:
                e.append(f"{key} = {cfg[key]}: must be >= 0 (0 = off)")
        if cfg.decay_steps > 0 and (cfg.total_steps is None or cfg.total_steps < 1):
            e.append(f"total_steps = {cfg.total_steps}: must be set (>= 1) when decay_steps > 0")
        if cfg.clamp <= 0:
            e.append(f"clamp = {cfg.clamp}: must be > 0")
        if cfg.chunk_tokens < 1:
            e.append(f"chunk_tokens = {cfg.chunk_tokens}: must be >= 1")
        if cfg.teacher_temperature not in TEACHER_TEMPERATURES:
            e.append(f"teacher_temperature = {cfg.teacher_temperature!r}: must be one of {', '.join(TEACHER_TEMPERATURES)}")
        e.extend(check_template("template", cfg.template))
        return e

    def __call__(self, ctx: TermContext):
        from grail_exp.teacher import build_teacher_batch, teacher_hidden

        cfg = self.cfg
        beta = sdpg_beta(cfg, ctx.rollout_index() if hasattr(ctx, "rollout_index") else ctx.step + 1)
        mask = ctx.mask.bool()
        if cfg.positive_only:
            mask = mask & (ctx.batch.advantages > 0).unsqueeze(1)
        zero = ctx.logp.new_zeros(())
        if beta == 0.0 or not mask.any():
            return zero, {"beta": beta, "kl_mean": 0.0, "clamp_frac": 0.0}
        rows = mask.any(1).nonzero().squeeze(1)
        sub = ctx.batch.rows(rows)
        tb = build_teacher_batch(sub, self.tokenizer, self.model_cfg, cfg.template, cfg.instruction)
        h_t = teacher_hidden(ctx.model, tb, share_prompts=ctx.share_prompts)  # (b, C, d) no grad
        sel = mask[rows]  # (b, C) the positions to distil
        kl = opd_kl(ctx.hidden[rows][sel], ctx.head_weight, ctx.head_bias, h_t[sel], ctx.temperature, cfg.clamp,
                    cfg.chunk_tokens, teacher_temperature=1.0 if cfg.teacher_temperature == "raw" else None)
        per_token = ctx.logp.new_zeros(ctx.logp.shape)
        r, c = sel.nonzero(as_tuple=True)
        per_token = per_token.index_put((rows[r], c), kl)
        value = beta * ctx.aggregate(per_token, ctx.mask)
        k = kl.detach()
        return value, {"beta": beta, "kl_mean": float(k.mean()), "clamp_frac": float((k >= cfg.clamp).float().mean())}


@register_loss_term("sdpg_ref_kl", SdpgRefKlConfig)
class SdpgRefKlTerm(LossTerm):
    needs_reference = True

    @staticmethod
    def check_config(cfg) -> list[str]:
        e = []
        if cfg.alpha < 0:
            e.append(f"alpha = {cfg.alpha}: must be >= 0")
        if cfg.mode not in KL_MODES:
            e.append(f"mode = {cfg.mode!r}: must be one of {', '.join(KL_MODES)}")
        return e

    def __call__(self, ctx: TermContext):
        if ctx.ref_logp is None:
            raise ValueError("loss.terms.sdpg_ref_kl needs the reference log-probs (the trainer loads the reference "
                             "model for terms with needs_reference)")
        per_token = ref_kl_surrogate(ctx.logp, ctx.ref_logp.to(ctx.logp.dtype), self.cfg.mode)
        m = ctx.mask.float()
        lw_mean = float(((ctx.logp - ctx.ref_logp).detach() * m).sum() / m.sum().clamp(min=1))
        if self.cfg.alpha == 0.0:
            return ctx.logp.new_zeros(()), {"log_ratio_mean": lw_mean}
        return self.cfg.alpha * ctx.aggregate(per_token, ctx.mask), {"log_ratio_mean": lw_mean}
