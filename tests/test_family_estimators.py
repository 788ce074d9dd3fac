"""The GRPO family's advantage estimators (issue 15) against hand-computed values and a brute-force OTB."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grail_exp.estimators import ESTIMATORS, EstimatorInput
from grail_exp.estimators.otb import sum_pi_squared_from_hidden

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # two groups of G = 4; the second has no variance
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0],
                     [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)


def run(name, extras=None, **cfg):
    inp = EstimatorInput(R, 4, MASK, extras=extras or {})
    return ESTIMATORS[name].fn(inp, SimpleNamespace(name=name, **cfg))


def test_rloo_leave_one_out():
    adv = run("rloo").advantages
    # row 0: 1 - (0 + 0 + 1)/3 = 2/3; row 1: 0 - 2/3
    assert adv[:4].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert adv[4:].tolist() == pytest.approx([0.0] * 4)
    assert run("rloo").zero_std.tolist() == [False] * 4 + [True] * 4


def test_reinforce_plus_plus_token_whitening():
    adv = run("reinforce_plus_plus").advantages
    n = MASK.sum(1)  # 3 2 4 1 4 2 1 3 -> 20 tokens; rewarded tokens: 3 + 1 = 4
    mean = 4 / 20
    var = (4 * (1 - mean) ** 2 + 16 * mean ** 2) / 19
    assert adv[0].item() == pytest.approx((1 - mean) / math.sqrt(var + 1e-8), rel=1e-5)
    assert adv[1].item() == pytest.approx(-mean / math.sqrt(var + 1e-8), rel=1e-5)
    assert float((adv * n).sum()) == pytest.approx(0.0, abs=1e-5)  # token-weighted mean 0


def test_reinforce_plus_plus_baseline_centres_groups_first():
    adv = run("reinforce_plus_plus_baseline").advantages
    c = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    n = MASK.sum(1)
    mean = float((c * n).sum() / n.sum())  # (1.5 - 1 - 2 + 0.5)/20 = -0.05
    var = float((n * (c - mean) ** 2).sum() / (n.sum() - 1))
    assert adv.tolist() == pytest.approx(((c - mean) / math.sqrt(var + 1e-8)).tolist(), rel=1e-5)


def test_remax_greedy_baseline():
    adv = run("remax", {"greedy_rewards": torch.tensor([1.0, 0.0])}).advantages
    assert adv.tolist() == [0.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="greedy_rewards"):
        run("remax")


def test_opo_length_weighted_baseline():
    adv = run("opo").advantages
    b = (3 * 1 + 1 * 1) / (3 + 2 + 4 + 1)  # lengths 3, 2, 4, 1; rewards 1, 0, 0, 1
    assert adv[:4].tolist() == pytest.approx([1 - b, -b, -b, 1 - b])


def test_gpg_alpha():
    adv = run("gpg", f_norm=2.0).advantages
    alpha = 8 / 2  # two non-zero rewards
    assert adv[:4].tolist() == pytest.approx([alpha * 0.5 / 2, -alpha * 0.5 / 2, -alpha * 0.5 / 2, alpha * 0.5 / 2])


def test_grpo_passk_credits_only_the_best():
    r = torch.tensor([0.2, 0.9, 0.5, 0.1])
    inp = EstimatorInput(r, 4, MASK[:4])
    adv = ESTIMATORS["grpo_passk"].fn(inp, SimpleNamespace(norm_by_std=False)).advantages
    assert adv.tolist() == pytest.approx([0.0, 0.4, 0.0, 0.0])
    adv = ESTIMATORS["grpo_passk"].fn(inp, SimpleNamespace(norm_by_std=True)).advantages
    assert adv[1].item() == pytest.approx(0.4 / (float(r.std()) + 1e-6))


def test_optimal_token_baseline_matches_brute_force():
    torch.manual_seed(0)
    logp = -torch.rand(8, 4) * 2
    spp = torch.rand(8, 4) * 0.5
    out = run("optimal_token_baseline", {"logp": logp, "sum_pi_squared": spp})
    adv = out.advantages
    assert adv.shape == (8, 4)
    for i in range(8):
        g = i // 4
        for t in range(4):
            if not MASK[i, t]:
                assert adv[i, t] == 0
                continue
            num = den = 0.0
            for j in range(4 * g, 4 * g + 4):
                if MASK[j, t]:
                    W = sum(1 - 2 * math.exp(logp[j, s].item()) + spp[j, s].item() for s in range(t + 1))
                    num += R[j].item() * W
                    den += W
            assert adv[i, t].item() == pytest.approx(R[i].item() - num / (den + 1e-8), rel=1e-4, abs=1e-5)


def _otb(rewards, mask, G, **cfg):
    # π = 0.5 and Σπ² = 0.5 on every token: w = 1 − 2·0.5 + 0.5 = 0.5, so W_t = 0.5·(t + 1) along a row
    shape = mask.shape
    extras = {"logp": torch.full(shape, math.log(0.5)), "sum_pi_squared": torch.full(shape, 0.5)}
    inp = EstimatorInput(torch.tensor(rewards), G, mask, extras=extras)
    return ESTIMATORS["optimal_token_baseline"].fn(inp, SimpleNamespace(name="optimal_token_baseline", **cfg))


@pytest.mark.filterwarnings("ignore:std.*degrees of freedom")  # the G = 1 case's zero-std flag (one sample)
def test_optimal_token_baseline_zero_tail_as_verl():
    """verl handle_zero_tail: the unique longest completion's positions ≥ the second-longest length get B = 0."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)  # lengths 4, 2, 1
    # B_0 = (1·0.5 + 0·0.5 + 1·0.5)/1.5 = 2/3 ; B_1 = (1·1 + 0·1)/2 = 1/2 ; t ≥ 2: row 0 alone, verl sets B = 0
    out = _otb([1.0, 0.0, 1.0], mask, 3)
    expected = torch.tensor([[1 / 3, 0.5, 1.0, 1.0], [-2 / 3, -0.5, 0, 0], [1 / 3, 0, 0, 0]])
    # fp32: B_t = Σ/ (Σ + 1e-8) — relative error ~1e-7 of values ≤ 1
    assert torch.allclose(out.advantages, expected, atol=1e-6), out.advantages
    assert out.metrics["otb/zero_tail_tokens"] == 2.0
    # before issue 23 (handle_zero_tail: false): B = r·W/(W + 1e-8) on the tail, A ≈ 0 (1e-8/1.5 relative)
    old = _otb([1.0, 0.0, 1.0], mask, 3, handle_zero_tail=False).advantages
    assert torch.allclose(old[0, 2:], torch.zeros(2), atol=1e-6) and torch.allclose(old[:, :2], expected[:, :2], atol=1e-6)
    # a tie for the longest: no zero tail (verl requires a unique longest)
    tie = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    out = _otb([1.0, 0.0, 1.0], tie, 3)
    assert out.metrics["otb/zero_tail_tokens"] == 0.0
    # t = 2: rows 0 and 1 alive, W = 1.5 each: B = 0.5, A = ±0.5
    assert out.advantages[0, 2].item() == pytest.approx(0.5, abs=1e-6)
    # a group of one rollout has no baseline: A = r on every token
    single = _otb([1.0], torch.tensor([[1.0, 1.0, 0.0]]), 1).advantages
    assert single.tolist() == [[1.0, 1.0, 0.0]]


def test_sum_pi_squared_chunked_equals_full_softmax():
    torch.manual_seed(0)
    h, w, b = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randn(11)
    got = sum_pi_squared_from_hidden(h, w, b, temperature=0.7, chunk_tokens=3)
    p = torch.softmax((h @ w.T + b) / 0.7, -1)
    assert torch.allclose(got, (p ** 2).sum(-1), atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
                                  "grpo_passk", "optimal_token_baseline"])
def test_estimator_composes_from_the_command_line(compose_cfg, name):
    from grail_exp.validate import validate

    cfg = validate(compose_cfg(["logger=none", f"estimator={name}"]))
    assert cfg.estimator.name == name
