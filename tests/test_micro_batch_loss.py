"""The update phase's micro-batch loss (grail_exp/training/update.py ``micro_batch_loss``) on a hand-made micro-batch,
without a model or a backend: every number below is worked out by hand from PPO's clipped surrogate, the truncated
IS weight and Dr. GRPO's normaliser as written in their papers (and in the comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from helpers.compose import compose

# Two rows, three completion tokens; row 1's last token is padding (its numbers must not count anywhere).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
W = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 7.0]])  # the scheme's weights w
A = torch.tensor([[0.5], [-1.0]])  # sequence advantages, (B, 1)
RATIO = torch.tensor([[1.5, 1.0, 0.9], [0.5, 1.1, 2.0]])  # ρ = π_θ / π_old per token
IS_RATIO = torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.0, 5.0]])  # π_old / π_sampler per token
EPS_F32 = torch.finfo(torch.float32).eps
# Each value below passes at most ~10 float32 roundings (log then exp of ρ, the clip, three products, a sum of five)
# on terms of magnitude <= 3.3, so it moves by at most ~10 · 3.3 · eps from the exact number: 64 eps covers it.
TOL = 64 * EPS_F32


def _cfg():
    # ε = 0.2, ε_high = 0.28 (clip-higher), Dr. GRPO's aggregation over L_max = 3, β = 0, TIS at C_max = 2.
    return compose(["advantage=grpo", "loss.policy_loss=ppo_clip", "loss.epsilon=0.2", "loss.epsilon_high=0.28",
                    "loss.loss_type=dr_grpo", "loss.beta=0.0", "rollout.max_completion_length=3",
                    "rollout.is_correction.mode=token_truncate", "rollout.is_correction.clip_max=2.0"])


class HalfAdvantageSum:
    """A made-up auxiliary term: 0.1 · Σ_t m Â over the micro-batch, with one diagnostic."""

    name = "half_sum"

    def __init__(self):
        self.seen = None

    def __call__(self, ctx):
        self.seen = ctx.token_advantages
        value = 0.1 * (ctx.token_advantages * ctx.mask).sum()
        return value, {"calls": 1.0}


def _run(family=None, terms=()):
    from grail_exp.loss import AggregationContext
    from grail_exp.training.update import micro_batch_loss

    old = torch.zeros(2, 3)
    logp = torch.log(RATIO).requires_grad_(True)  # log π_θ with log π_old = 0: ρ = RATIO
    sampler = -torch.log(IS_RATIO)  # ρ^IS = exp(log π_old − log π_sampler) = IS_RATIO
    ctx = AggregationContext(max_completion_length=3, accumulation_steps=1, global_num_tokens=5.0, world_size=1)
    out = micro_batch_loss(_cfg(), ctx, W, A, logp, old, MASK, sampler_logp=sampler, family=family, terms=terms,
                           term_context=lambda token_adv: SimpleNamespace(token_advantages=token_adv, mask=MASK))
    out.loss.backward()
    return out, logp.grad


def test_the_micro_batch_loss_by_hand():
    out, grad = _run()
    # Â = w·A: row 0 (A = 0.5) [1, 0.5, 0.25]; row 1 (A = −1) [−1, −3, −7] (the padding token's too: it is masked later).
    assert torch.equal(out.token_advantages, torch.tensor([[1.0, 0.5, 0.25], [-1.0, -3.0, -7.0]]))
    # ℓ = −min(ρÂ, clip(ρ, 0.8, 1.28)·Â) per token:
    #   row 0: ρ 1.5 → −1.28 (clipped, Â > 0); ρ 1 → −0.5; ρ 0.9 → −0.225
    #   row 1: ρ 0.5 → +0.8 (clipped at 0.8, Â < 0); ρ 1.1 → +3.3
    # × ρ^IS truncated at 2: [1, 2, 0.5] and [1, 1]: −1.28 − 1.0 − 0.1125 + 0.8 + 3.3 = 1.7075
    # Dr. GRPO: Σ / (B · L_max) = 1.7075 / 6
    want = 1.7075 / 6
    assert math.isclose(out.loss.item(), want, abs_tol=TOL), (out.loss.item(), want)
    # ∂L/∂logp = −ρ·Â·ρ^IS / 6 on the unclipped tokens, 0 on the clipped ones and on padding:
    want_grad = torch.tensor([[0.0, -0.5 * 2.0 / 6, -0.9 * 0.25 * 0.5 / 6], [0.0, 1.1 * 3.0 / 6, 0.0]])
    torch.testing.assert_close(grad, want_grad, rtol=0.0, atol=TOL)
    m = out.metrics
    assert m["loss_tokens"] == 5.0
    assert math.isclose(m["ratio_mean"], (1.5 + 1.0 + 0.9 + 0.5 + 1.1) / 5, abs_tol=TOL)
    assert math.isclose(m["clip_ratio/high_mean"], 1 / 5, abs_tol=TOL)  # row 0, ρ 1.5 with Â > 0
    assert math.isclose(m["clip_ratio/low_mean"], 1 / 5, abs_tol=TOL)  # row 1, ρ 0.5 with Â < 0
    # The IS diagnostics over the five loss tokens: ratios 1, 3, 0.5, 1, 1; weights 1, 2, 0.5, 1, 1.
    assert (m["is/ratio_min"], m["is/ratio_max"]) == (0.5, 3.0)
    assert math.isclose(m["is/ratio_mean"], 6.5 / 5, abs_tol=TOL)
    assert math.isclose(m["is/weight_mean"], 5.5 / 5, abs_tol=TOL)


def test_the_family_mask_multiplies_the_surrogate_and_the_terms_add_up():
    """f zeroes row 0's second token in the surrogate only (the normaliser keeps B · L_max); the term sees Â and adds
    0.1 · (1 + 0.5 + 0.25 − 1 − 3) = −0.225 (the padding token's −7 is masked)."""
    term = HalfAdvantageSum()
    family = SimpleNamespace(policy=torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]), metrics={"family/kept": 0.8})
    out, grad = _run(family=family, terms=[term])
    want = (1.7075 + 1.0) / 6 - 0.225  # the masked token's −1.0 (−0.5 × ρ^IS 2) no longer counts
    assert math.isclose(out.loss.item(), want, abs_tol=TOL), (out.loss.item(), want)
    assert term.seen is out.token_advantages
    assert grad[0, 1] == 0.0  # f = 0 there
    assert math.isclose(out.metrics["half_sum/loss"], -0.225, abs_tol=TOL)
    assert out.metrics["half_sum/calls"] == 1.0 and out.metrics["family/kept"] == 0.8
    # the order the step logs them in: the objective's, the IS correction's, the family's, the terms'
    keys = list(out.metrics)
    assert keys.index("loss_tokens") < keys.index("is/ratio_mean") < keys.index("family/kept") < keys.index("half_sum/loss")
