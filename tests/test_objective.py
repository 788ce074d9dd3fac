"""``loss/objective.py``'s composition against a brute-force loop written out here, token by token, from the equation

    ℓ_{i,t} = f_{i,t} · ρ^IS_{i,t} · s(ρ_{i,t}, Â_{i,t}) + β · k3_{i,t},     L = aggregate(ℓ, m)

with PPO's clipped surrogate s = −min(ρ·Â, clip(ρ, 1 − ε, 1 + ε_high)·Â), k3 = e^δ − δ − 1 (δ = log π_ref − log π), and
each aggregation's normaliser from its paper (aggregation.py's table), in Python floats. The context (L_max, K,
N_tokens, R) is the one handed in: nothing is rebuilt from loose numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from grail_exp.config import LossConfig
from grail_exp.loss import AggregationContext, compose_objective

LOGP = [[-1.0, -2.0, -0.5, -0.7], [-1.5, -0.2, -3.0, -0.9], [-0.4, -1.1, -2.2, -0.3]]
OLD = [[-1.1, -1.5, -0.5, -1.2], [-1.0, -0.2, -2.6, -0.9], [-0.4, -1.4, -2.0, -0.1]]
REF = [[-0.9, -1.8, -0.8, -0.7], [-1.6, -0.5, -2.9, -1.0], [-0.6, -1.0, -2.5, -0.4]]
ADV = [[1.0, 1.0, 1.0, 1.0], [-2.0, -2.0, -2.0, -2.0], [0.5, 0.7, 0.3, 0.5]]  # token advantages Â (B, T)
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
FAMILY = [[1, 0, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]]  # f
IS_W = [[1.0, 0.5, 2.0, 1.0], [1.5, 1.0, 0.0, 1.0], [0.8, 1.2, 1.0, 0.9]]  # ρ^IS
EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.04
L_MAX = 5


def brute_force(loss_type: str, normaliser: str, K: int, R: int, N: float) -> tuple[float, float]:
    """(L, the same aggregation of |ℓ|: the scale of its rounding error), by loops over rows and tokens."""
    B, T = len(LOGP), len(LOGP[0])
    ell = [[0.0] * T for _ in range(B)]
    m = [[float(MASK[i][t]) for t in range(T)] for i in range(B)]
    for i in range(B):
        for t in range(T):
            rho = math.exp(LOGP[i][t] - OLD[i][t])
            a = ADV[i][t]
            clipped = min(max(rho, 1 - EPS), 1 + EPS_HIGH)
            surrogate = -min(rho * a, clipped * a)
            delta = REF[i][t] - LOGP[i][t]
            kl = math.exp(delta) - delta - 1
            if normaliser == "kept":  # f joins the loss mask: the surrogate and the KL term both vanish where f = 0
                m[i][t] *= FAMILY[i][t]
                ell[i][t] = IS_W[i][t] * surrogate + BETA * kl
            else:  # f multiplies the surrogate only
                ell[i][t] = FAMILY[i][t] * IS_W[i][t] * surrogate + BETA * kl

    def aggregate(x):
        rows = [sum(x[i][t] * m[i][t] for t in range(T)) for i in range(B)]
        counts = [sum(m[i]) for i in range(B)]
        total, tokens = sum(rows), sum(counts)
        if loss_type == "grpo":
            return sum(r / max(c, 1.0) for r, c in zip(rows, counts)) / B / K
        if loss_type == "bnpo":
            return total / max(tokens, 1.0) / K
        if loss_type == "dr_grpo":
            return total / (B * L_MAX) / K
        if loss_type == "dapo":
            return total * R / N
        if loss_type == "token_sum":
            return total * R
        if loss_type == "seq_mean_token_sum":
            return sum(rows) / B / K
        raise AssertionError(loss_type)

    return aggregate(ell), aggregate([[abs(v) for v in row] for row in ell])


CASES = [(lt, norm, K, R, N) for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "token_sum", "seq_mean_token_sum")
         for norm in ("unmasked", "kept") for K, R, N in ((1, 1, 9.0), (4, 2, 23.0))]


@pytest.mark.parametrize("loss_type, normaliser, K, R, N", CASES)
def test_the_objective_is_the_token_loop(loss_type, normaliser, K, R, N):
    loss = LossConfig(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA, kl_estimator="k3",
                      policy_loss="ppo_clip", family_mask_normaliser=normaliser)
    ctx = AggregationContext(max_completion_length=L_MAX, accumulation_steps=K, global_num_tokens=N, world_size=R)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    out = compose_objective(loss, ctx, t(LOGP), t(OLD), t(ADV), t(MASK), ref_logp=t(REF), is_weight=t(IS_W),
                            policy_mask=t(FAMILY))
    expected, scale = brute_force(loss_type, normaliser, K, R, N)
    # float32: each ℓ_{i,t} takes ~10 roundings (exp, ratio, clip, products, k3) and the aggregation sums 12 of them,
    # so the error is below (10 + 12) · 2^-24 of the aggregated |ℓ| (cancellation cannot raise it above that).
    assert out.loss.item() == pytest.approx(expected, abs=22 * 2**-24 * scale)
    kept = [[MASK[i][t] * (FAMILY[i][t] if normaliser == "kept" else 1) for t in range(4)] for i in range(3)]
    assert out.metrics["loss_tokens"].item() == sum(map(sum, kept))


def test_the_context_is_used_as_given():
    """dapo's normaliser is the step's global token count and the world size from the context, not this micro-batch's
    own tokens (9) or one rank."""
    loss = LossConfig(loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH)
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    one = compose_objective(loss, AggregationContext(L_MAX, 1, 9.0, 1), t(LOGP), t(OLD), t(ADV), t(MASK)).loss
    two = compose_objective(loss, AggregationContext(L_MAX, 1, 36.0, 2), t(LOGP), t(OLD), t(ADV), t(MASK)).loss
    assert two.item() == pytest.approx(one.item() * 2 * 9 / 36, rel=1e-6)


def test_an_unknown_normaliser_and_a_missing_reference_are_named():
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    ctx = AggregationContext(L_MAX)
    with pytest.raises(ValueError, match="loss.family_mask_normaliser"):
        compose_objective(LossConfig(family_mask_normaliser="both"), ctx, t(LOGP), t(OLD), t(ADV), t(MASK),
                          policy_mask=t(FAMILY))
    with pytest.raises(ValueError, match="reference"):
        compose_objective(LossConfig(beta=0.1), ctx, t(LOGP), t(OLD), t(ADV), t(MASK))
