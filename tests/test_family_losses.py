"""The GRPO family's policy losses and KL forms (issue 15): hand-computed values, gradient checks, and the μ = 1 limit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grail_exp.loss import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, AggregationContext, compose_objective
from grail_exp.loss.policies import check_family_config


def cfg(**kw):
    base = dict(epsilon=0.2, epsilon_high=0.28, clip_ratio_c=None, delta=None, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, clip_cov_ratio=2e-4,
                clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=2e-4, kl_cov_coef=0.1, kl_bias_correction=False)
    base.update(kw)
    return SimpleNamespace(**base)


def one(name, logp, old, adv, mask=None, **kw):
    logp, old, adv = (torch.tensor([x], dtype=torch.float64) for x in (logp, old, adv))
    mask = torch.ones_like(logp) if mask is None else torch.tensor([mask], dtype=torch.float64)
    return POLICY_LOSSES[name](logp, old, adv, mask, cfg(**kw)).per_token[0]


# ------------------------------------------------------------------------------------------- hand-computed values
def test_dual_clip_and_delta_bound_negative_advantages():
    lr = math.log(5.0)  # ratio 5, A = -1: PPO's loss is 5 (unbounded in the ratio)
    assert one("ppo_clip", [lr], [0.0], [-1.0])[0].item() == pytest.approx(5.0)
    assert one("ppo_clip", [lr], [0.0], [-1.0], clip_ratio_c=3.0)[0].item() == pytest.approx(3.0)
    assert one("ppo_clip", [lr], [0.0], [-1.0], delta=3.0)[0].item() == pytest.approx(3.0)
    # A > 0 is untouched by both: -clip(5)·1 = -1.28
    assert one("ppo_clip", [lr], [0.0], [1.0], clip_ratio_c=3.0, delta=3.0)[0].item() == pytest.approx(-1.28)


def test_gspo_sequence_ratio_and_clip():
    # log ratios 0.5, -0.1 -> mean 0.2 -> s = e^0.2 (inside [0.8, 1.28]); with ε_high 0.1 it clips to 1.1
    pt = one("gspo", [0.5 - 1, -0.1 - 2], [-1.0, -2.0], [1.0, 1.0])
    assert pt.tolist() == pytest.approx([-math.exp(0.2)] * 2)
    assert one("gspo", [0.5 - 1, -0.1 - 2], [-1.0, -2.0], [1.0, 1.0], epsilon_high=0.1).tolist() == \
        pytest.approx([-1.1, -1.1])
    assert one("gspo_token", [0.5 - 1, -0.1 - 2], [-1.0, -2.0], [1.0, 1.0]).tolist() == pytest.approx(
        [-math.exp(0.2)] * 2)


def test_cispo_clipped_weight_times_logp():
    # ratio 2 -> weight 1.28 (ε_high 0.28); ℓ = -1.28 · A · log π, A = 1, log π = log 0.5
    assert one("cispo", [math.log(0.5)], [math.log(0.25)], [1.0])[0].item() == pytest.approx(-1.28 * math.log(0.5))


def test_sapo_soft_gate():
    lr = math.log(1.5)
    assert one("sapo", [lr], [0.0], [1.0])[0].item() == pytest.approx(-4 / 1.0 / (1 + math.exp(-0.5)))
    tau = 1.05
    assert one("sapo", [lr], [0.0], [-1.0])[0].item() == pytest.approx(4 / tau / (1 + math.exp(-tau * 0.5)))


def test_gmpo_sign_aware_log_clip():
    # log ratios 0.5, -0.1; ε = 0.4: A > 0 clips 0.5 to 0.4 -> exp(0.15); A < 0 keeps 0.5, and -0.1 -> exp(0.2)
    assert one("gmpo", [0.5, -0.1], [0.0, 0.0], [1.0, 1.0], epsilon=0.4, epsilon_high=0.4).tolist() == \
        pytest.approx([-math.exp(0.15)] * 2)
    assert one("gmpo", [0.5, -0.1], [0.0, 0.0], [-1.0, -1.0], epsilon=0.4, epsilon_high=0.4).tolist() == \
        pytest.approx([math.exp(0.2)] * 2)


def test_vespo_gamma_weight():
    logp = [math.log(0.5), math.log(0.4)]
    old = [logp[0] - 0.5, logp[1] + 0.1]  # sequence log ratio 0.4
    w = math.exp(0.4)
    phi = math.exp(3 + 2 * 0.4 - 3 * w)  # k = 2, λ = 3 for A >= 0
    assert one("vespo", logp, old, [1.0, 1.0]).tolist() == pytest.approx([-phi * x for x in logp])
    phi_neg = math.exp(2 + 3 * 0.4 - 2 * w)  # k = 3, λ = 2 for A < 0
    assert one("vespo", logp, old, [-1.0, -1.0]).tolist() == pytest.approx([phi_neg * x for x in logp])


def test_dppo_masks_only_in_the_pushed_direction():
    p, q = math.log(0.6), math.log(0.3)  # the token's probability went up by 0.3
    assert one("dppo_tv", [p], [q], [1.0])[0].item() == 0.0  # A > 0 pushes it further up: outside (0.3 > 0.28)
    assert one("dppo_tv", [p], [q], [-1.0])[0].item() == pytest.approx(2.0 * p)  # -(-1)·2·log 0.6
    assert one("dppo_tv", [p], [q], [-1.0], clip_ratio_c=1.5)[0].item() == pytest.approx(1.5 * p)
    d = 0.3 * math.log(0.3 / 0.6) + 0.7 * math.log(0.7 / 0.4)  # binary KL = 0.1838
    assert one("dppo_kl", [p], [q], [1.0], epsilon_high=d - 0.01)[0].item() == 0.0
    assert one("dppo_kl", [p], [q], [1.0], epsilon_high=d + 0.01)[0].item() == pytest.approx(-2.0 * p)


def test_kl_cov_penalises_the_top_covariance_token():
    logp = torch.tensor([[-0.1, -3.0, -1.0, -2.0]], dtype=torch.float64)
    old = logp - torch.tensor([[0.2, 0.1, -0.1, 0.3]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0]], dtype=torch.float64)
    m = torch.ones_like(logp)
    out = POLICY_LOSSES["kl_cov"](logp, old, adv, m, cfg(kl_cov_ratio=0.25, kl_cov_coef=0.1)).per_token
    # cov = (A - 0.125)(logp + 1.525): 1.247, 1.659, 0.196, 0.059 -> token 1 gets 0.1 · |log ρ| = 0.1 · 0.1
    expected = (-adv * torch.exp(logp - old)).clone()
    expected[0, 1] += 0.1 * 0.1
    assert out[0].tolist() == pytest.approx(expected[0].tolist())


def test_clip_cov_drops_only_eligible_tokens():
    torch.manual_seed(0)
    logp = torch.linspace(-3, -0.1, 50, dtype=torch.float64).view(1, 50)
    adv = torch.linspace(-2, 2, 50, dtype=torch.float64).view(1, 50)
    m = torch.ones_like(logp)
    c = cfg(clip_cov_ratio=0.1, clip_cov_lb=0.5, clip_cov_ub=5.0)
    base = POLICY_LOSSES["ppo_clip"](logp, logp, adv, m, c).per_token
    out = POLICY_LOSSES["clip_cov"](logp, logp, adv, m, c).per_token
    dropped = (out != base)
    assert int(dropped.sum()) == 5
    cov = (adv - adv.mean()) * (logp - logp.mean())
    assert bool(((cov >= 0.5) & (cov <= 5.0))[dropped].all())


def test_kl_straight_through_abs_and_bias_correction():
    logp = torch.tensor([[-1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.3, -0.2]], dtype=torch.float64)
    for name, value in (("k1+", KL_ESTIMATORS["k1"]), ("k3+", KL_ESTIMATORS["k3"])):
        out = KL_ESTIMATORS[name](logp, ref)
        assert torch.allclose(out, value(logp, ref))
        (g,) = torch.autograd.grad(out.sum(), logp)
        assert torch.allclose(g, (logp - ref).detach())  # k2's gradient
    assert KL_ESTIMATORS["abs"](logp, ref)[0].tolist() == pytest.approx([0.3, 0.3])
    old = logp.detach() - 0.2
    kw = dict(loss_type="token_sum", policy_loss="ppo_clip", beta=1.0, kl_estimator="k3")
    zero = torch.zeros_like(ref)
    m = torch.ones_like(ref)
    ctx = AggregationContext(max_completion_length=2)
    plain = compose_objective(cfg(**kw), ctx, logp, old, zero, m, ref_logp=ref).loss
    corrected = compose_objective(cfg(kl_bias_correction=True, **kw), ctx, logp, old, zero, m, ref_logp=ref).loss
    assert corrected.item() == pytest.approx(plain.item() * math.exp(0.2))


# ------------------------------------------------------------------------------------------- gradient checks
@pytest.mark.parametrize("name", ["sapo", "gmpo", "gspo", "luspo"])
def test_gradcheck_smooth_losses(name):
    """Non-surrogate losses: autograd against finite differences (float64, away from clip kinks)."""
    torch.manual_seed(1)
    old = torch.randn(2, 3, dtype=torch.float64) - 1
    logp = (old + 0.03 * torch.randn(2, 3, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 0.5, 2.0], [-1.0, -0.3, -2.0]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    c = cfg(epsilon=0.5, epsilon_high=0.5)

    def f(lp):  # the forced aggregations, in float64 (the registry's sums are float32)
        out = POLICY_LOSSES[name](lp, old, adv, m, c)
        if out.aggregation == "seq_mean_token_sum":
            return (out.per_token * m).sum(-1).mean()
        return ((out.per_token * m).sum(-1) / m.sum(-1)).mean()

    assert torch.autograd.gradcheck(f, (logp,))


def test_gspo_token_equals_gspo_for_sequence_advantages_and_weights_tokens_otherwise():
    """GSPO §4.3: with Â_{i,t} = Â_i the two gradients coincide; per token the weight is sg(s_i)·Â_{i,t}."""
    torch.manual_seed(3)
    old = torch.randn(2, 3, dtype=torch.float64) - 1
    logp = (old + 0.05 * torch.randn(2, 3, dtype=torch.float64)).requires_grad_()
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    c = cfg(epsilon=0.5, epsilon_high=0.5)
    agg = lambda pt: ((pt * m).sum(-1) / m.sum(-1)).mean()  # noqa: E731
    seq_adv = torch.tensor([[1.0], [-2.0]], dtype=torch.float64).expand(2, 3)
    grads = [torch.autograd.grad(agg(POLICY_LOSSES[n](logp, old, seq_adv, m, c).per_token), logp)[0]
             for n in ("gspo", "gspo_token")]
    assert torch.allclose(grads[0], grads[1])
    tok_adv = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 3.0, 0.0]], dtype=torch.float64)
    (g,) = torch.autograd.grad(POLICY_LOSSES["gspo_token"](logp, old, tok_adv, m, c).per_token.sum(), logp)
    s_i = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1)).detach().unsqueeze(1)
    assert torch.allclose(g, -s_i * tok_adv)


@pytest.mark.parametrize("name", ["cispo", "vespo", "dppo_tv", "gpg"])
def test_reinforce_style_gradient_is_weight_times_advantage(name):
    """Losses of the form −sg(weight)·Â·log π: ∂ℓ/∂log π = −weight·Â with the hand-computed weight."""
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.2)]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 2.0]], dtype=torch.float64)
    out = POLICY_LOSSES[name](logp, old, adv, torch.ones_like(adv), cfg(clip_ratio_c=1.5))
    (g,) = torch.autograd.grad(out.per_token.sum(), logp)
    weight = {"cispo": [1.28, 1.0], "gpg": [1.0, 1.0], "dppo_tv": [1.5, 1.0],
              "vespo": [math.exp(2 + 3 * math.log(2) - 2 * 2)] * 2}[name]
    if name == "vespo":  # sequence ratio 2: token 0 has A < 0 (k 3, λ 2), token 1 A > 0 (k 2, λ 3)
        weight = [math.exp(2 + 3 * math.log(2) - 2 * 2), math.exp(3 + 2 * math.log(2) - 3 * 2)]
    assert g[0].tolist() == pytest.approx([-w * a for w, a in zip(weight, adv[0].tolist())])


# ------------------------------------------------------------------------------------------- the μ = 1 limit
ALL = ["ppo_clip", "gspo", "gspo_token", "luspo", "cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov", "dppo_tv",
       "dppo_kl", "vespo"]


@pytest.mark.parametrize("name", ALL)
def test_ratio_one_gives_the_policy_gradient(name):
    """With old = sg(logp) (μ = 1) every loss's gradient is that of −Â·log π under the same aggregation."""
    torch.manual_seed(2)
    logp = (torch.randn(3, 4, dtype=torch.float64) - 1).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64).unsqueeze(1).expand(3, 4)  # sequence advantages
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    c = cfg(clip_ratio_c=3.0, clip_cov_lb=1e9, clip_cov_ub=2e9)  # clip_cov: no eligible token
    out = POLICY_LOSSES[name](logp, logp.detach(), adv, m, c)
    agg = AGGREGATIONS[out.aggregation or "dr_grpo"]
    ctx = AggregationContext(4)
    (g,) = torch.autograd.grad(agg(out.per_token, m, ctx), logp)
    (g_ref,) = torch.autograd.grad(agg(-adv * logp, m, ctx), logp)
    assert torch.allclose(g, g_ref, atol=1e-10)


def test_every_family_loss_is_registered_and_validated():
    assert set(ALL) <= set(POLICY_LOSSES)
    bad = SimpleNamespace(loss=_Node(clip_ratio_c=0.5, delta=1.0, sapo_tau_pos=0.0, top_entropy_quantile=0.0,
                                     off_policy_mask_threshold=-1.0, policy_loss="ppo_clip", epsilon=0.2))
    errors = "\n".join(check_family_config(bad))
    for key in ("loss.clip_ratio_c", "loss.delta", "loss.sapo_tau_pos", "loss.top_entropy_quantile",
                "loss.off_policy_mask_threshold"):
        assert key in errors


class _Node(dict):
    def __getattr__(self, k):
        return self[k]
