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
    from grail_exp.config import LossConfig
    from grail_exp.loss import AggregationContext, compose_objective

    logp = OLD.clone().requires_grad_(True)
    isw, _ = is_weights(OLD, SAMPLER, MASK, "token_truncate", None, 1.5)
    adv = torch.ones(2, 3)
    out = compose_objective(LossConfig(loss_type="bnpo", epsilon=0.2, epsilon_high=0.28), AggregationContext(3),
                            logp, OLD, adv, MASK, is_weight=isw)
    out.loss.backward()
    # on-policy ratio 1: d loss / d logp = -A * w_IS / n_tokens
    assert torch.allclose(logp.grad, -(isw * MASK) / 5, atol=1e-6)


def test_sampler_check_fails_loudly_on_a_stale_engine(compose_cfg, tiny_model_dir):
    """A jump of the sampler/trainer log-prob gap (e.g. an engine that reloaded its initial weights) aborts the run."""
    from grail_exp.training.module import SamplerMismatchError
    from helpers.module import build_module, small_config

    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.num_iterations=2"])
    module = build_module(cfg, tiny_model_dir)
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


def test_sequence_mask_at_3_is_trls_rule():
    """TRL's sequence_mask (rollout=vllm_paper): ratio = exp(Σ_t (old − sampler)) per sequence, masked_fill(ratio > 3, 0),
    the same weight on every token; a ratio of exactly 3 is kept, none is clipped from below."""
    old = torch.zeros(4, 3)
    logs = [math.log(3.0), math.log(3.0) + 1e-4, math.log(0.01), 0.2]  # per-sequence log-ratios
    sampler = torch.tensor([[-v / 2, -v / 2, 0.0] for v in logs])  # spread over two tokens, third token padding
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    sampler[:, 2] = 5.0  # a padding token's value never enters
    w, m = is_weights(old, sampler, mask, "sequence_mask", None, 3.0)
    want = [3.0, 0.0, 0.01, math.exp(0.2)]
    for i, v in enumerate(want):
        assert torch.allclose(w[i], torch.full((3,), v), rtol=1e-5), (i, w[i])
    assert m["is/masked_frac"] == pytest.approx(2 / 8)


def test_vllm_paper_composes_the_reference_settings(compose_cfg):
    from grail_exp.validate import validate

    cfg = validate(compose_cfg(["rollout=vllm_paper"]))
    r = cfg.rollout
    assert r.engine == "vllm" and r.vllm.logprobs_mode == "processed_logprobs"
    assert (r.is_correction.mode, r.is_correction.clip_min, r.is_correction.clip_max) == ("sequence_mask", None, 3.0)
    assert r.vllm.gpu_memory_utilization == 0.2
    base = validate(compose_cfg(["rollout=vllm"])).rollout  # everything else is rollout=vllm's
    for k in ("num_generations", "max_completion_length", "temperature", "top_k", "sampler_check"):
        assert r[k] == base[k]
    assert r.vllm.enable_prefix_caching == base.vllm.enable_prefix_caching


def test_kept_mass_stats_and_sampler_check_on_processed_logprobs(compose_cfg, tiny_model_dir):
    """With processed sampler log-probs (sampler = raw − log M_t), the old-log-prob forward measures log M_t, the step
    logs Σ_t log M_t per sequence, and the sampler check adds it back: no false alarm from the renormalisation."""
    from helpers.module import build_module, small_config

    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.num_iterations=2", "rollout.top_k=3"])
    module = build_module(cfg, tiny_model_dir)
    module.rollout.engine.logprobs_mode = "processed_logprobs"  # the HF engine as if it reported processed ones
    assert module.rollout.sampler_filter() == (3, 1.0)
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    module.rollout.old_logps(batch)
    raw = batch.old_logp
    log_mass = batch.sampler_log_mass
    assert log_mass.shape == raw.shape and (log_mass <= 1e-6).all() and (log_mass < -1e-3).any()
    # the same quantity from an independent forward: the model's own logits, the 3 largest per position
    from grail_exp.compute.forward import completion_logits

    with torch.no_grad():
        z = completion_logits(module.policy, batch.input_ids, batch.attention_mask, batch.position_ids,
                              batch.completion_ids.shape[1], cfg.rollout.temperature).float()
    want = torch.logsumexp(z.topk(3, -1).values, -1) - torch.logsumexp(z, -1)
    m = batch.loss_mask.bool()
    assert (log_mass - want).abs()[m].max().item() < 1e-5  # fp32 logsumexp over V = 320 logits
    batch.sampler_logp = raw - log_mass  # what a processed-mode sampler in sync reports
    stats = module.rollout.check_sampler(batch)
    assert stats["sampling/logp_abs_diff_mean"] < 1e-6
    ms = module.rollout.log_mass_stats(batch.loss_mask, log_mass)
    per_seq = [(log_mass[i] * batch.loss_mask[i]).sum().item() for i in range(batch.num_rows) if batch.loss_mask[i].any()]
    assert ms["sampling/seq_log_kept_mass"] == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-6)
    assert ms["sampling/token_log_kept_mass"] == pytest.approx(sum(per_seq) / batch.loss_mask.sum().item(), rel=1e-6)
    module.rollout.engine.logprobs_mode = "raw_logprobs"
    assert module.rollout.sampler_filter() is None
