"""The GRPO loss against hand-computed values (method spec §2)."""

import math

import pytest
import torch

from grail_exp.config import LossConfig
from grail_exp.loss import AggregationContext, compose_objective, entropy_from_logits, selective_log_softmax

# A 2 x 3 batch: row 0 has 3 valid tokens, row 1 has 2.
LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
OLD = torch.tensor([[-1.1, -1.5, -0.5], [-1.0, -0.2, -3.0]])
ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def hand_per_token(eps_lo=0.2, eps_hi=0.28):
    out = [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        for t in range(3):
            r = math.exp(LOGP[i, t].item() - OLD[i, t].item())
            a = ADV[i, t].item()
            c = min(max(r, 1 - eps_lo), 1 + eps_hi)
            out[i][t] = -min(r * a, c * a)
    return out


def objective(logp, old, adv, mask, *, max_completion_length, accumulation_steps=1, global_num_tokens=None,
              ref_logp=None, **loss_keys):
    """The objective with a ``loss`` node of these keys (the schema's defaults for the rest) in this context."""
    ctx = AggregationContext(max_completion_length, accumulation_steps, global_num_tokens)
    return compose_objective(LossConfig(**loss_keys), ctx, logp, old, adv, mask, ref_logp=ref_logp)


def run(loss_type, **kw):
    args = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, max_completion_length=4)
    args.update(kw)
    return objective(LOGP, OLD, ADV, MASK, **args)


def test_grpo_sequence_mean_then_mean():
    pt = hand_per_token()
    expected = ((pt[0][0] + pt[0][1] + pt[0][2]) / 3 + (pt[1][0] + pt[1][1]) / 2) / 2
    assert run("grpo").loss.item() == pytest.approx(expected, abs=1e-6)


def test_bnpo_token_mean():
    pt = hand_per_token()
    expected = (sum(pt[0]) + pt[1][0] + pt[1][1]) / 5
    assert run("bnpo").loss.item() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_constant_normaliser():
    pt = hand_per_token()
    expected = (sum(pt[0]) + pt[1][0] + pt[1][1]) / (2 * 4)  # B * max_completion_length
    assert run("dr_grpo").loss.item() == pytest.approx(expected, abs=1e-6)


def test_dapo_global_token_count_and_no_accumulation_division():
    pt = hand_per_token()
    expected = (sum(pt[0]) + pt[1][0] + pt[1][1]) / 10  # 10 tokens in the whole accumulated batch
    out = run("dapo", global_num_tokens=10, accumulation_steps=4)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_accumulation_divides(loss_type):
    assert run(loss_type, accumulation_steps=4).loss.item() == pytest.approx(run(loss_type).loss.item() / 4, rel=1e-6)


def test_clip_fractions_by_hand():
    out = run("bnpo")
    # ratios: row0 = [e^0.1, e^-0.5, 1], row1 = [e^-0.5, 1, (masked)]
    # low clip: ratio < 0.8 and A < 0 -> row1 t0 (e^-0.5 = 0.61); high: ratio > 1.28 and A > 0 -> none
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert out.metrics["clip_ratio/high_mean"].item() == 0.0
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(1 / 5)


def test_symmetric_clip_when_epsilon_high_is_null():
    a = objective(LOGP, OLD, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=None, max_completion_length=4)
    b = objective(LOGP, OLD, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.2, max_completion_length=4)
    assert a.loss.item() == b.loss.item()


def test_ratio_one_on_policy_means_no_clipping_and_loss_is_minus_mean_advantage():
    out = objective(LOGP, LOGP.clone(), ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                      max_completion_length=4)
    assert out.metrics["ratio_mean"].item() == 1.0
    assert out.metrics["clip_ratio/region_mean"].item() == 0.0
    assert out.loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5)


def test_gradient_is_minus_advantage_on_policy():
    logp = LOGP.clone().requires_grad_(True)
    objective(logp, logp.detach(), ADV, MASK, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                max_completion_length=4).loss.backward()
    # d/dlogp of -ratio*A at ratio=1 is -A, scaled by 1/(|o_i| * B)
    expected = -ADV * MASK / MASK.sum(1, keepdim=True) / 2
    assert torch.allclose(logp.grad, expected)


def test_k3_kl_zero_when_policy_equals_reference_and_positive_otherwise():
    zero = objective(LOGP, LOGP, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                       max_completion_length=4, ref_logp=LOGP.clone(), beta=0.04)
    assert zero.metrics["kl"].item() == 0.0
    other = objective(LOGP, LOGP, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                        max_completion_length=4, ref_logp=OLD, beta=0.04)
    d = OLD - LOGP
    k3 = (torch.exp(d) - d - 1) * MASK
    assert other.metrics["kl"].item() == pytest.approx((k3.sum() / MASK.sum()).item(), rel=1e-6)
    no_kl = objective(LOGP, LOGP, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28, max_completion_length=4)
    assert other.loss.item() == pytest.approx(no_kl.loss.item() + 0.04 * other.metrics["kl"].item(), rel=1e-6)


def test_beta_without_reference_is_an_error():
    with pytest.raises(ValueError, match="reference"):
        objective(LOGP, LOGP, ADV, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=None, max_completion_length=4,
                    beta=0.1)


def test_masked_tokens_carry_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    run_loss = objective(logp, OLD, ADV, MASK, loss_type="dr_grpo", epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=4).loss
    run_loss.backward()
    assert logp.grad[1, 2] == 0.0


def test_selective_log_softmax_matches_full_log_softmax():
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, ids), ref, atol=1e-6)
    half = selective_log_softmax(logits.bfloat16(), ids)
    assert torch.allclose(half.float(), ref, atol=5e-2)


def test_entropy_uniform():
    assert entropy_from_logits(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8), rel=1e-6)
