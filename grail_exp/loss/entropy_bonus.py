"""Entropy bonus, optionally with Skywork-OR1's adaptive coefficient (``loss.terms.entropy_bonus``).

    term = −c · aggregate(H_{i,t})          H = the token entropy the chunked log-prob pass returns (differentiable)

Adaptive (He et al., Skywork Open Reasoner 1, arXiv 2505.22312 §3.2.3; TRL use_adaptive_entropy): after every
optimiser step with mean token entropy H̄,

    c ← clip(c + δ, c_min, c_max) if H̄ < H_target else clip(c − δ, c_min, c_max)

and the bonus is applied only while the last step's H̄ ≤ H_target (no push once entropy is above target). The
coefficient and the running entropy survive checkpoints (``state_dict``).

With the top-entropy mask on (``loss.top_entropy_quantile`` < 1) the bonus and H̄ cover the kept tokens only
(mask × top-entropy mask, as TRL: "the same effective mask ... so it acts on the same tokens"); the off-policy
sequence mask does not restrict it (TRL neither). The normaliser is the policy loss's aggregation (verl's
``agg_loss(entropy, loss_agg_mode)``); TRL uses a token mean for every loss type (docs/deviations.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.loss.terms import LossTerm, TermContext, register_loss_term


@dataclass
class EntropyBonusConfig:
    enabled: bool = True
    coef: float = 0.001  # c, the initial (or fixed) coefficient (TRL entropy_coef; verl entropy_coeff)
    adaptive: bool = False  # Skywork-OR1 controller (TRL use_adaptive_entropy)
    target: float = 0.2  # H_target in nats (TRL entropy_target 0.2)
    delta: float = 0.005  # δ per optimiser step (TRL entropy_coef_delta 0.005)
    coef_min: float = 0.0  # lower bound of c (TRL entropy_coef_min 0)
    coef_max: float = 1.0  # upper bound of c (TRL entropy_coef_max 1)


@register_loss_term("entropy_bonus", EntropyBonusConfig)
class EntropyBonus(LossTerm):
    def __init__(self, cfg, tokenizer=None, model_cfg=None):
        super().__init__(cfg, tokenizer, model_cfg)
        self.coef = float(cfg.coef)
        self.step = None  # the optimiser step whose entropy is being accumulated
        self.sum, self.count = 0.0, 0.0
        self.last_entropy = None  # H̄ of the previous step

    @staticmethod
    def check_config(cfg) -> list[str]:
        e = []
        if cfg.coef < 0:
            e.append(f"coef = {cfg.coef!r}: must be >= 0")
        if not 0 <= cfg.coef_min <= cfg.coef_max:
            e.append(f"coef_min/coef_max = {cfg.coef_min!r}/{cfg.coef_max!r}: need 0 <= coef_min <= coef_max")
        if cfg.delta < 0:
            e.append(f"delta = {cfg.delta!r}: must be >= 0")
        return e

    def _advance(self, step: int) -> None:
        """A new optimiser step: close the previous one's entropy mean and update c (adaptive)."""
        if self.step is not None and step != self.step and self.count > 0:
            self.last_entropy = self.sum / self.count
            if self.cfg.adaptive:
                d = self.cfg.delta if self.last_entropy < self.cfg.target else -self.cfg.delta
                self.coef = min(self.cfg.coef_max, max(self.cfg.coef_min, self.coef + d))
            self.sum, self.count = 0.0, 0.0
        self.step = step

    def __call__(self, ctx: TermContext) -> tuple[torch.Tensor, dict[str, float]]:
        self._advance(ctx.step)
        top = getattr(ctx, "top_entropy_mask", None)
        mask = ctx.mask if top is None else ctx.mask * top.to(ctx.mask.dtype)
        m = mask.float()
        self.sum += float((ctx.entropy.detach() * m).sum())
        self.count += float(m.sum())
        active = not self.cfg.adaptive or self.last_entropy is None or self.last_entropy <= self.cfg.target
        c = self.coef if active else 0.0
        value = -c * ctx.aggregate(ctx.entropy, mask)
        return value, {"coef": c}

    def state_dict(self) -> dict:
        return {"coef": self.coef, "step": self.step, "sum": self.sum, "count": self.count,
                "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.step = float(state["coef"]), state["step"]
        self.sum, self.count, self.last_entropy = state["sum"], state["count"], state["last_entropy"]
