"""Rollout correction (truncated importance sampling) against hand-computed values, and the sampler check."""

import math

import pytest
import torch

from grail_exp.loss import is_weights

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -0.9, -3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# token ratios exp(old - sampler): row 0 = [e^0.5, e^-1, 1], row 1 = [e^0.2, e^-0.1, (masked)]
R = [[math.exp(0.5), math.exp(-1.0), 1.0], [math.exp(0.2), math.exp(-0.1), 1.0]]


def test_token_truncate_caps_each_token():
    w, m = is_weights(OLD, SAMPLER, MASK, "token_truncate", None, 1.5)
    want = [[min(r, 1.5) for r in row] for row in R]
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    assert m["is/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6) and m["is/masked_frac"] == 0.0


def test_token_truncate_with_lower_bound():
    w, _ = is_weights(OLD, SAMPLER, MASK, "token_truncate", 0.5, 1.5)
    assert w[0, 1].item() == pytest.approx(0.5)  # e^-1 = 0.37 raised to C_min


def test_token_mask_zeros_tokens_outside_the_band():
    w, m = is_weights(OLD, SAMPLER, MASK, "token_mask", 0.5, 1.5)
    want = [[0.0, 0.0, 1.0], [math.exp(0.2), math.exp(-0.1), 1.0]]  # e^0.5 > 1.5 and e^-1 < 0.5 dropped
    assert torch.allclose(w, torch.tensor(want), atol=1e-6)
    assert m["is/masked_frac"] == pytest.approx(2 / 5)


def test_sequence_modes_use_the_product_over_valid_tokens():
    seq = [math.exp(0.5 - 1.0 + 0.0), math.exp(0.2 - 0.1)]  # masked token excluded from the product
    w, _ = is_weights(OLD, SAMPLER, MASK, "sequence_truncate", None, 1.05)
    assert torch.allclose(w[:, 0], torch.tensor([seq[0], min(seq[1], 1.05)]), atol=1e-6)
    assert torch.equal(w[0], w[0, :1].expand(3))  # the same weight on every token of a sequence
    w, m = is_weights(OLD, SAMPLER, MASK, "sequence_mask", 0.7, 1.05)
    assert torch.allclose(w[:, 0], torch.tensor([0.0, 0.0]))  # 0.61 < 0.7 and 1.105 > 1.05: both dropped
    assert m["is/masked_frac"] == 1.0


def test_none_is_ones_and_weights_enter_the_loss_detached():
    w, m = is_weights(OLD, SAMPLER, MASK, "none", None, 2.0)
    assert torch.equal(w, torch.ones_like(w)) and m == {}
    from grail_exp.loss import policy_loss

    logp = OLD.clone().requires_grad_(True)
    isw, _ = is_weights(OLD, SAMPLER, MASK, "token_truncate", None, 1.5)
    adv = torch.ones(2, 3)
    out = policy_loss(logp, OLD, adv, MASK, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                      max_completion_length=3, is_weight=isw)
    out.loss.backward()
    # on-policy ratio 1: d loss / d logp = -A * w_IS / n_tokens
    assert torch.allclose(logp.grad, -(isw * MASK) / 5, atol=1e-6)


def test_sampler_check_fails_loudly_on_a_stale_engine(compose_cfg, tiny_model_dir):
    """A jump of the sampler/trainer log-prob gap (e.g. an engine that reloaded its initial weights) aborts the run."""
    from test_module import _build_module, _small

    from grail_exp.module import SamplerMismatchError

    cfg = _small(compose_cfg, tiny_model_dir, ["loss.num_iterations=2"])
    module = _build_module(cfg, tiny_model_dir)
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    batch.old_logp = module.rollout.logps(module.policy, batch)
    ok = module.rollout.check_sampler(batch)["sampling/logp_abs_diff_mean"]
    assert ok < 1e-4  # rollout=hf samples from the policy itself
    module.rollout.logp_diff_history = [0.03, 0.03, 0.03]
    batch.sampler_logp = batch.sampler_logp - 0.5 * batch.loss_mask  # a 0.5-nat jump
    with pytest.raises(SamplerMismatchError, match="jumped"):
        module.rollout.check_sampler(batch)
    module.rollout.logp_diff_history = []
    batch.sampler_logp = batch.sampler_logp - 2.0 * batch.loss_mask
    with pytest.raises(SamplerMismatchError, match="max_abs_diff"):
        module.rollout.check_sampler(batch)
