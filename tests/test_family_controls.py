"""Sampling-side controls of the GRPO family (issue 15): overlong punishment, KL-in-reward controller, dynamic
sampling's filter and exact resume, top-entropy mask, OPSM, the entropy bonus and its adaptive controller."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grail_exp.loss.masks import off_policy_sequence_mask, top_entropy_mask
from grail_exp.training.reward_shaping import KLInRewardController, overlong_penalty
from grail_exp.training.rollout import informative_groups


def test_overlong_penalty_by_hand():
    # L_max 20, buffer 8: no penalty up to 12, then linear to -factor at 20
    got = overlong_penalty(torch.tensor([5, 12, 16, 20]), 20, 8, 0.5)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])


def test_kl_in_reward_fixed_and_adaptive():
    kl = torch.tensor([[0.1, 0.3, 9.0], [0.2, 0.2, 0.2]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    fixed = KLInRewardController(SimpleNamespace(coef=0.5, controller="fixed", target=0.1, horizon=10))
    r, metrics = fixed.penalise(torch.tensor([1.0, 0.0]), kl, m)
    assert r.tolist() == pytest.approx([1 - 0.5 * 0.4, -0.5 * 0.6])
    assert fixed.coef == 0.5
    ada = KLInRewardController(SimpleNamespace(coef=0.5, controller="adaptive", target=0.1, horizon=10))
    ada.penalise(torch.tensor([1.0, 0.0]), kl, m)
    # mean per-token KL = (0.2 + 0.2)/2 = 0.2 -> error clipped to 0.2 -> β · (1 + 0.2 · 2/10)
    assert ada.coef == pytest.approx(0.5 * 1.04)
    fresh = KLInRewardController(ada.cfg)
    fresh.load_state_dict(ada.state_dict())
    assert fresh.coef == ada.coef


def test_informative_groups():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert informative_groups(r, 2).tolist() == [True, False, False, False]


def test_top_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    ent = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.8, 0.2, 0.4]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # 7.0 is padding: never counted
    got = top_entropy_mask(ent, m, 0.3)  # 7 valid tokens; 70% quantile of them = 0.56 -> keeps 0.9, 0.8
    assert got.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert torch.equal(top_entropy_mask(ent, m, 1.0), m)


def test_opsm_drops_only_negative_far_off_policy_rows():
    logp = torch.zeros(3, 2)
    behaviour = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.01, 0.01]])  # mean KL 0.5, 0.5, 0.01
    adv = torch.tensor([1.0, -1.0, -1.0])
    got = off_policy_sequence_mask(adv, logp, behaviour, torch.ones(3, 2), 0.1)
    assert got.tolist() == [[1, 1], [0, 0], [1, 1]]


def _ctx(entropy, step):
    from grail_exp.loss import AGGREGATIONS, AggregationContext

    m = torch.ones_like(entropy)
    return SimpleNamespace(entropy=entropy, mask=m, step=step,
                           aggregate=lambda pt, mm: AGGREGATIONS["bnpo"](pt, mm, AggregationContext(4)))


def test_entropy_bonus_value_and_adaptive_controller_state():
    from grail_exp.loss import LOSS_TERMS, build_terms

    (term,) = build_terms({"entropy_bonus": {"coef": 0.1, "adaptive": True, "target": 0.5, "delta": 0.05}})
    ent = torch.tensor([[0.2, 0.4]], requires_grad=True)
    value, m = term(_ctx(ent, 0))
    assert value.item() == pytest.approx(-0.1 * 0.3)  # -c · token mean
    (g,) = torch.autograd.grad(value, ent)
    assert g[0].tolist() == pytest.approx([-0.05, -0.05])
    term(_ctx(torch.tensor([[0.2, 0.4]]), 1))  # step 0's mean 0.3 < 0.5 -> c = 0.15, bonus active
    assert term.coef == pytest.approx(0.15)
    value, m = term(_ctx(torch.tensor([[0.9, 0.9]]), 2))  # step 1 mean 0.3 -> 0.2
    assert term.coef == pytest.approx(0.2) and m["coef"] == pytest.approx(0.2)
    value, m = term(_ctx(torch.tensor([[0.9, 0.9]]), 3))  # step 2 mean 0.9 > target: c shrinks, bonus off
    assert term.coef == pytest.approx(0.15) and value.item() == 0.0
    clone = LOSS_TERMS["entropy_bonus"](term.cfg)
    clone.load_state_dict(term.state_dict())
    assert clone.state_dict() == term.state_dict()


def test_family_keys_are_validated(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["logger=none", "loss.clip_ratio_c=0.5", "loss.top_entropy_quantile=0",
                              "reward.overlong_buffer.enabled=true", "reward.overlong_buffer.length=0",
                              "loss.kl_in_reward.enabled=true", "loss.kl_in_reward.controller=pid",
                              "+loss.terms.entropy_bonus.coef=-1", "rollout.dynamic_sampling.enabled=true",
                              "rollout.dynamic_sampling.max_extra_rounds=-1"]))
    msg = str(err.value)
    for key in ("loss.clip_ratio_c", "loss.top_entropy_quantile", "reward.overlong_buffer.length",
                "loss.kl_in_reward.controller", "loss.terms.entropy_bonus.coef",
                "rollout.dynamic_sampling.max_extra_rounds"):
        assert key in msg


def test_dynamic_sampling_refuses_an_estimator_that_plans_its_prompts(compose_cfg):
    """SCRL samples curricula and replaces the verifier's rewards, which dynamic sampling filters groups on."""
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    assert validate(compose_cfg(["logger=none", "estimator=scrl"])).estimator.name == "scrl"
    validate(compose_cfg(["logger=none", "rollout.dynamic_sampling.enabled=true"]))
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_sampling\.enabled = true: not with estimator=scrl"):
        validate(compose_cfg(["logger=none", "estimator=scrl", "rollout.dynamic_sampling.enabled=true"]))


class TextParityVerifier:
    """Deterministic in the completion text (so exact resume sees the same rewards): correct when the text's
    character codes sum to 0 mod 3 — many groups of 4 come out all-wrong, which dynamic sampling drops."""

    def __init__(self, *args, **kwargs):
        self.counters = {"timeout": 0}

    def score(self, completions, golds):
        from grail_exp.grading.rewards import GradeResult

        return [GradeResult(sum(map(ord, c)) % 3 == 0, "x", "ok") for c in completions]

    def close(self):
        pass


@pytest.mark.slow
def test_dynamic_sampling_and_controllers_four_steps_equal_two_plus_resume_plus_two(tmp_path, formatted_model_dir, monkeypatch):
    from safetensors.torch import load_file

    import grail_exp.grading.rewards
    from grail_exp.checkpoint import load_training_state
    from grail_exp.run import run
    from helpers.compose import compose

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", TextParityVerifier)

    def cfg(run_dir: Path, steps, extra=()):
        return compose([f"model.name_or_path={formatted_model_dir}", f"paths.output_dir={run_dir}",
                        "trainer.prompts_per_step=2", "trainer.micro_batch_size=8", "rollout.num_generations=4",
                        "rollout.max_completion_length=24", "trainer.eval_at_end=false",
                        "trainer.eval_before_training=false", "trainer.sample_table_every=0", "logger=none",
                        "rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_extra_rounds=3",
                        "reward.overlong_buffer.enabled=true", "reward.overlong_buffer.length=8",
                        # stateful controls ride along: resume must restore β and the entropy coefficient too
                        "loss.kl_in_reward.enabled=true", "loss.kl_in_reward.controller=adaptive",
                        "loss.kl_in_reward.coef=0.05", "loss.kl_in_reward.horizon=20",
                        "+loss.terms.entropy_bonus.adaptive=true", "+loss.terms.entropy_bonus.target=5.0",
                        "loss.top_entropy_quantile=0.5", "loss.mask_truncated_completions=false",
                        f"trainer.max_steps={steps}", *extra], run_dir.parent)

    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    run(cfg(straight, 4))
    run(cfg(split, 2))
    mid = load_training_state(split / "checkpoints" / "step-2")
    run(cfg(split, 4, ["resume=auto"]))
    a, b = straight / "checkpoints" / "step-4", split / "checkpoints" / "step-4"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = load_training_state(a), load_training_state(b)
    assert sa["prompt_cursor"] == sb["prompt_cursor"]
    assert sa["kl_controller"] == sb["kl_controller"] and sa["kl_controller"]["coef"] != 0.05  # β adapted
    assert sa["terms"] == sb["terms"] and sa["terms"]["entropy_bonus"]["coef"] > 0.001  # c grew (H < target)
    assert mid["prompt_cursor"] >= 2 * 2 and sa["prompt_cursor"] > mid["prompt_cursor"]


# Every CPU preset, and the GPU recipes of the three with the most keys (all GPU files share one template).
PRESETS = sorted(p.stem for p in (Path(__file__).parent.parent / "conf" / "experiment" / "baselines").glob("*_cpu.yaml"))
PRESETS += ["dapo", "cispo", "otb"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_baseline_preset_composes_and_validates(compose_cfg, preset):
    from grail_exp.validate import validate

    cfg = validate(compose_cfg([f"experiment=baselines/{preset}", "logger=none"]))
    assert cfg.task_name.startswith("baseline_")
    assert cfg.advantage.name == "grpo"
