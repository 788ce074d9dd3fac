"""One optimiser step on a fixed batch reproduces the numbers pinned before the trainer refactor (tests/pinned_step.py)."""

from __future__ import annotations

import json

import pytest
import torch

from pinned_step import CASES, PINNED, build_model_and_tokenizer, rollout_batch, summarise


def _cfg(overrides):
    from conftest import compose
    from grail_exp.config import validate

    return validate(compose(["logger=none", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
                             "rollout.num_generations=4", "rollout.max_completion_length=32", "optim.max_grad_norm=null",
                             *overrides]))


def run_case_legacy(overrides):
    """The pre-refactor trainer API (commit 2d87701): used once to write the pinned file."""
    from grail_exp.advantages import build_scheme
    from grail_exp.estimators.group import group_advantages
    from grail_exp.forward import position_ids_from_mask
    from grail_exp.module import GRPOModule, TrainingBatch

    cfg = _cfg(overrides)
    torch.manual_seed(0)
    model, tok = build_model_and_tokenizer()
    rb, texts, rewards = rollout_batch(tok)
    adv, _ = group_advantages(rewards, 4, cfg.loss.scale_rewards)
    module = GRPOModule(cfg, model, tok, build_scheme(cfg.advantage, tok), None, None, None, None,
                        ref_model=build_model_and_tokenizer()[0].eval() if cfg.loss.beta > 0 else None)
    attn = rb.attention_mask
    batch = TrainingBatch(rb.input_ids, attn, position_ids_from_mask(attn), rb.prompt_ids.shape[1], rb.completion_ids,
                          rb.completion_mask.float(), adv, rewards, texts)
    if cfg.loss.num_iterations > 1:
        batch.old_logp = module.rollout.logps(model, batch) - 0.05 * torch.arange(batch.completion_ids.shape[1])
    if cfg.loss.beta > 0:
        batch.ref_logp = module.rollout.logps(module.ref_model, batch)
    module.manual_backward = lambda loss: loss.backward()
    captured = {}
    real = module.scheme.weights

    def spy(m, b):
        out = real(m, b)
        captured.setdefault("w", []).append(out.weights)
        return out

    module.scheme.weights = spy

    class Opt:
        def step(self):
            captured["g"] = torch.cat([p.grad.flatten() for p in model.parameters()])

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

    sched = type("S", (), {"step": lambda self: None, "get_last_lr": lambda self: [0.0]})()
    metrics = module.update.step(batch, Opt(), sched, batch.loss_mask.sum().item(), {}, epoch=0)
    return summarise(metrics["loss"], captured["g"], torch.cat(captured["w"]))


def run_case(overrides, extra=()):
    """Today's trainer on the pinned batch: prepare (spans, probe rows grouped first), then one optimiser step."""
    from grail_exp.advantages import build_scheme
    from grail_exp.estimators.group import group_advantages
    from grail_exp.forward import position_ids_from_mask
    from grail_exp.module import GRPOModule, TrainingBatch

    cfg = _cfg([*overrides, *extra])
    torch.manual_seed(0)
    model, tok = build_model_and_tokenizer()
    rb, texts, rewards = rollout_batch(tok)
    adv, _ = group_advantages(rewards, 4, cfg.loss.scale_rewards)
    module = GRPOModule(cfg, model, tok, build_scheme(cfg.advantage, tok), None, None, None, None,
                        ref_model=build_model_and_tokenizer()[0].eval() if cfg.loss.beta > 0 else None)
    attn = rb.attention_mask
    N = len(texts)
    batch = TrainingBatch(rb.input_ids, attn, position_ids_from_mask(attn), rb.prompt_ids.shape[1], rb.completion_ids,
                          rb.completion_mask.float(), adv, rewards, texts, order=torch.arange(N),
                          group_ids=torch.arange(N) // 4)
    module.rollout.prepare(batch, {})
    shift = 0.05 * torch.arange(batch.completion_ids.shape[1])  # makes ratios != 1 in the μ = 2 cases
    if cfg.loss.num_iterations > 1:
        batch.old_logp = module.rollout.logps(model, batch) - shift
    if cfg.loss.beta > 0:
        batch.ref_logp = module.rollout.logps(module.ref_model, batch)
    module.manual_backward = lambda loss: loss.backward()
    captured = {"w": torch.zeros(N, batch.completion_ids.shape[1])}
    real = module.update.weights

    def spy(b, s, e, iteration, fwd):
        w, m, fresh = real(b, s, e, iteration, fwd)
        captured["w"][b.order[s:e]] = w.float()
        return w, m, fresh

    module.update.weights = spy

    class Opt:
        def step(self):
            captured["g"] = torch.cat([p.grad.flatten() for p in model.parameters()])

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

    sched = type("S", (), {"step": lambda self: None, "get_last_lr": lambda self: [0.0]})()
    metrics = module.update.step(batch, Opt(), sched, batch.loss_mask.sum().item(), {}, epoch=0)
    return summarise(metrics["loss"], captured["g"], captured["w"])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("path", ["shared_forward", "separate_probe"])
def test_step_matches_pinned_numbers(name, path):
    """Both the fast path (probe gradient from the policy forward, chunked log-probs, probe rows grouped) and the
    reference's separate probe forward reproduce the pinned pre-refactor numbers."""
    if path == "separate_probe" and not name.startswith(("grail", "oar")):
        pytest.skip("no probe")
    want = json.loads(PINNED.read_text())[name]
    got = run_case(CASES[name], ["advantage.shared_forward=false"] if path == "separate_probe" else [])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert torch.allclose(torch.tensor(got["weights"]), torch.tensor(want["weights"]), atol=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert torch.allclose(torch.tensor(got["grad_proj"]), torch.tensor(want["grad_proj"]), rtol=1e-4, atol=1e-6)
