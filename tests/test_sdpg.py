"""SDPG's loss terms: KL modes by hand, L_OPD vs brute-force full logits (values, gradients, clamp), chunk bounds,
the gate, β = α = 0 → the plain loss exactly, config composition and checks."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from grail_exp.loss import LOSS_TERMS, TermContext, build_terms
from grail_exp.loss.sdpg import (
    SdpgOpdConfig,
    SdpgOpdTerm,
    SdpgRefKlConfig,
    SdpgRefKlTerm,
    opd_kl,
    ref_kl_surrogate,
    sdpg_beta,
)
from helpers.batches import CHAT_MODEL_CFG, PROBLEM_ROWS, problem_batch


def test_ref_kl_modes_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    lw = math.log(2.0)  # row 0: π_θ/π_ref = 2 ; row 1: 1
    assert ref_kl_surrogate(logp, ref, "urkl").tolist() == pytest.approx([0.5 * lw ** 2, 0.0])
    assert ref_kl_surrogate(logp, ref, "ufkl").tolist() == pytest.approx([0.5 + lw, 1.0])
    assert ref_kl_surrogate(logp, ref, "fkl").tolist() == pytest.approx([0.5, 1.0])
    assert ref_kl_surrogate(logp, ref, "rkl").tolist() == pytest.approx([0.5 * (lw + 1) ** 2, 0.5])
    # gradients w.r.t. log π_θ: urkl log w ; ufkl 1 − e^{−log w} ; fkl −e^{−log w} ; rkl log w + 1
    for mode, g in (("urkl", lw), ("ufkl", 0.5), ("fkl", -0.5), ("rkl", lw + 1)):
        x = logp.clone().requires_grad_(True)
        ref_kl_surrogate(x, ref, mode)[0].backward()
        assert x.grad[0].item() == pytest.approx(g), mode


def _official_beta(beta, current_step, total_steps, warmup_steps, decay_steps):
    """lauyikfung/SDPG core_algos._compute_effective_beta's arithmetic (written independently here); the trainer
    passes current_step = global_steps (1 for the first rollout batch) and total_steps = total_training_steps."""
    eff = beta
    if warmup_steps > 0 and current_step < warmup_steps:
        eff = beta * (current_step / warmup_steps)
    if decay_steps > 0 and total_steps > 0 and current_step >= total_steps - decay_steps:
        eff = eff * (max(total_steps - current_step, 0) / decay_steps)
    return eff


def test_beta_schedule_by_hand():
    c = OmegaConf.structured(SdpgOpdConfig(beta=1.0, warmup_steps=10, decay_steps=20, total_steps=100))
    assert [sdpg_beta(c, k) for k in (1, 5, 10, 50, 80, 90, 100, 120)] == pytest.approx([.1, .5, 1, 1, 1, .5, 0, 0])
    assert sdpg_beta(OmegaConf.structured(SdpgOpdConfig(beta=0.3)), 999) == 0.3  # scripts' default: constant
    for warm, decay in ((10, 20), (0, 30), (7, 0), (60, 60)):
        c = OmegaConf.structured(SdpgOpdConfig(beta=0.2, warmup_steps=warm, decay_steps=decay, total_steps=100))
        for k in range(1, 110):
            assert sdpg_beta(c, k) == pytest.approx(_official_beta(0.2, k, 100, warm, decay), abs=1e-12), (warm, decay, k)


def test_beta_counts_rollout_batches_from_one(tiny_tokenizer):
    """The term's β uses the 1-based rollout-batch index, constant over the optimiser steps of a rollout batch."""
    term = SdpgOpdTerm(OmegaConf.structured(SdpgOpdConfig(beta=1.0, warmup_steps=10)), tiny_tokenizer, CHAT_MODEL_CFG)
    b = problem_batch(tiny_tokenizer, PROBLEM_ROWS)
    none = torch.zeros_like(b.completion_mask)  # no position to distil: the term returns its β without a forward
    for step, rollout_step in ((0, 1), (3, 1), (4, 2), (36, 10)):  # μ = 4
        ctx = _ctx(None, tiny_tokenizer, b, mask=none, step=step)
        ctx.rollout_step = rollout_step
        assert term(ctx)[1]["beta"] == pytest.approx(_official_beta(1.0, rollout_step, 0, 10, 0)), (step, rollout_step)
    ctx = _ctx(None, tiny_tokenizer, b, mask=none, step=4)  # no rollout counter: rollout batch = step + 1
    assert term(ctx)[1]["beta"] == pytest.approx(0.5)


def _brute_kl(h, W, b, hq, T, clamp):
    z = (h @ W.T + (b if b is not None else 0)) / T
    zq = ((hq @ W.T + (b if b is not None else 0)) / T).detach()
    p, logp, logq = torch.softmax(z, -1), torch.log_softmax(z, -1), torch.log_softmax(zq, -1)
    return (p * (logp - logq)).sum(-1).clamp(max=clamp)


@pytest.mark.parametrize("chunk,bias,clamp", [(3, False, 20.0), (100, True, 20.0), (4, True, 0.5)])
def test_opd_kl_values_and_gradients_match_brute_force(chunk, bias, clamp):
    torch.manual_seed(0)
    N, d, V = 11, 6, 17
    h = (torch.randn(N, d, dtype=torch.float64) * 2).requires_grad_(True)
    W = torch.randn(V, d, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(V, dtype=torch.float64).requires_grad_(True) if bias else None
    hq = torch.randn(N, d, dtype=torch.float64) * 2
    hq[1::2] = h.detach()[1::2] + 0.05 * torch.randn(N // 2, d, dtype=torch.float64)  # small KL on odd rows
    g = torch.randn(N, dtype=torch.float64)
    ref = _brute_kl(h, W, b, hq, 0.7, clamp)
    grads_ref = torch.autograd.grad((ref * g).sum(), [h, W] + ([b] if bias else []))
    out = opd_kl(h, W, b, hq, 0.7, clamp, chunk)
    # float32 softmax inside: compare at float32 precision
    assert torch.allclose(out.double(), ref, atol=1e-5)
    grads = torch.autograd.grad((out * g).sum(), [h, W] + ([b] if bias else []))
    for a, r in zip(grads, grads_ref):
        assert torch.allclose(a.double(), r, atol=1e-4)
    if clamp < 1:  # the clamp bites on some positions and zeroes their gradient
        hit = ref.detach() >= clamp
        assert hit.any() and (~hit).any()
        assert torch.equal(grads[0][hit], torch.zeros_like(grads[0][hit]))


def test_chunking_bounds_the_live_logits(monkeypatch):
    """With chunk_tokens = n the term never builds more than (n, V) logits (counted with a spy on the logits)."""
    import grail_exp.loss.sdpg as sd

    sizes = []
    real = sd._logits

    def spy(h, W, b, inv_t):
        sizes.append(h.shape[0])
        return real(h, W, b, inv_t)

    monkeypatch.setattr(sd, "_logits", spy)
    h = torch.randn(10, 4, requires_grad=True)
    W = torch.randn(9, 4, requires_grad=True)
    opd_kl(h, W, None, torch.randn(10, 4), 1.0, 20.0, 3).sum().backward()
    assert max(sizes) == 3
    # forward: student + teacher per chunk (4 chunks); backward recomputes both: 16 logits builds in all
    assert sorted(sizes) == sorted([3, 3, 3, 1] * 4)


def _ctx(model, tok, batch, *, hidden=None, W=None, logp=None, mask=None, ref_logp=None, step=0, temperature=1.0):
    """A TermContext over a SchemeBatch with a token-mean aggregate."""
    B, C = batch.completion_ids.shape
    mask = batch.completion_mask if mask is None else mask
    return TermContext(model=model, batch=batch, hidden=hidden, head_weight=W, head_bias=None,
                       logp=logp if logp is not None else torch.zeros(B, C), entropy=torch.zeros(B, C), mask=mask,
                       token_advantages=torch.zeros(B, C), old_logp=torch.zeros(B, C), ref_logp=ref_logp,
                       sampler_logp=None, temperature=temperature, step=step,
                       aggregate=lambda x, m: (x * m).sum() / m.sum().clamp(min=1), tokenizer=tok)


def _forward(model, batch):
    from grail_exp.advantages.gradient_probe import predicting_window
    from grail_exp.compute.forward import policy_forward

    logp, ent, fwd = policy_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                    batch.completion_ids, 1.0, chunk_tokens=7)
    return logp, predicting_window(fwd.hidden, batch.prompt_length, batch.completion_ids.shape[1]), fwd.head_weight


def _unpadded_logits(model, tok, problem, answer, completion):
    """Brute force: full logits of the unpadded student and teacher sequences at the completion's positions."""
    from grail_exp.data.prompting import render_prompt
    from grail_exp.teacher import TEMPLATES

    c = tok(completion, add_special_tokens=False)["input_ids"]
    s_ids = tok(render_prompt(problem, tok, CHAT_MODEL_CFG), add_special_tokens=False)["input_ids"]
    t_ids = tok(render_prompt(TEMPLATES["sdpg"].format(problem=problem, answer=answer, instruction=""), tok,
                              CHAT_MODEL_CFG), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        zs = model(input_ids=torch.tensor([s_ids + c])).logits[0, len(s_ids) - 1:-1].float()
        zt = model(input_ids=torch.tensor([t_ids + c])).logits[0, len(t_ids) - 1:-1].float()
    return zs, zt


def test_opd_term_matches_brute_force_teacher_and_gate(tiny_model, tiny_tokenizer):
    tok, model = tiny_tokenizer, tiny_model
    b = problem_batch(tok, PROBLEM_ROWS)
    for positive_only in (False, True):
        term = SdpgOpdTerm(OmegaConf.structured(SdpgOpdConfig(beta=0.5, positive_only=positive_only,
                                                              chunk_tokens=5)), tok, CHAT_MODEL_CFG)
        logp, hidden, W = _forward(model, b)
        value, metrics = term(_ctx(model, tok, b, hidden=hidden, W=W, logp=logp))
        # brute force: full logits of unpadded student and teacher sequences, one row at a time
        total, n_tok = 0.0, b.completion_mask.sum()
        for q, a, comp, A in PROBLEM_ROWS:
            if positive_only and A <= 0:
                continue
            zs, zt = _unpadded_logits(model, tok, q, a, comp)
            ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
            total += (ls.exp() * (ls - lt)).sum(-1).clamp(max=20).sum().item()
        assert value.item() == pytest.approx(0.5 * total / n_tok.item(), rel=1e-4), positive_only
        assert value.item() > 0
        value.backward()  # differentiable through the student's full softmax
        assert model.model.embed_tokens.weight.grad.abs().sum() > 0
        model.zero_grad()


@pytest.mark.parametrize("mode", ["raw", "sampling"])
def test_opd_teacher_temperature(tiny_model, tiny_tokenizer, mode):
    """At T = 0.7 the official SDPG divides only the student's logits by T (teacher_temperature: raw); the brute
    force below builds both distributions from full logits with its own choice of divisor."""
    tok, model, T = tiny_tokenizer, tiny_model, 0.7
    b = problem_batch(tok, PROBLEM_ROWS)
    term = SdpgOpdTerm(OmegaConf.structured(SdpgOpdConfig(beta=1.0, teacher_temperature=mode)), tok, CHAT_MODEL_CFG)
    logp, hidden, W = _forward(model, b)
    value, _ = term(_ctx(model, tok, b, hidden=hidden, W=W, logp=logp, temperature=T))
    total = {"raw": 0.0, "sampling": 0.0}
    for q, a, comp, _A in PROBLEM_ROWS:
        zs, zt = _unpadded_logits(model, tok, q, a, comp)
        ls = torch.log_softmax(zs / T, -1)
        for how, lt in (("raw", torch.log_softmax(zt, -1)), ("sampling", torch.log_softmax(zt / T, -1))):
            total[how] += (ls.exp() * (ls - lt)).sum(-1).clamp(max=20).sum().item()
    n_tok = b.completion_mask.sum().item()
    # float32 softmaxes over V = 320 and a sum of ~60 positions: relative 1e-4 as the T = 1 test above
    assert value.item() == pytest.approx(total[mode] / n_tok, rel=1e-4)
    other = "sampling" if mode == "raw" else "raw"
    assert abs(total[mode] - total[other]) / n_tok > 1e-3 * value.item()  # the choice matters at T = 0.7


def test_beta_alpha_zero_give_the_plain_loss_gradient_exactly(tiny_model, tiny_tokenizer):
    tok, model = tiny_tokenizer, tiny_model
    b = problem_batch(tok, PROBLEM_ROWS)
    terms = [SdpgOpdTerm(OmegaConf.structured(SdpgOpdConfig(beta=0.0)), tok, CHAT_MODEL_CFG),
             SdpgRefKlTerm(OmegaConf.structured(SdpgRefKlConfig(alpha=0.0)), tok, CHAT_MODEL_CFG)]
    grads = []
    for with_terms in (False, True):
        model.zero_grad()
        logp, hidden, W = _forward(model, b)
        loss = -(logp * b.completion_mask).sum() / b.completion_mask.sum()  # a stand-in policy loss
        if with_terms:
            ctx = _ctx(model, tok, b, hidden=hidden, W=W, logp=logp, ref_logp=logp.detach() - 0.3)
            for t in terms:
                loss = loss + t(ctx)[0]
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.equal(x, y) for x, y in zip(*grads))
    # and α > 0 does change the gradient
    model.zero_grad()
    logp, hidden, W = _forward(model, b)
    ctx = _ctx(model, tok, b, hidden=hidden, W=W, logp=logp, ref_logp=logp.detach() - 0.3)
    SdpgRefKlTerm(OmegaConf.structured(SdpgRefKlConfig(alpha=1.0)), tok, CHAT_MODEL_CFG)(ctx)[0].backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_ref_kl_term_value_and_missing_reference():
    logp = torch.tensor([[math.log(0.5), 0.0], [math.log(0.2), 0.0]])
    ref = torch.tensor([[math.log(0.25), 0.0], [math.log(0.4), 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    b = type("B", (), {"completion_ids": torch.zeros(2, 2, dtype=torch.long), "completion_mask": mask})()
    term = SdpgRefKlTerm(OmegaConf.structured(SdpgRefKlConfig(alpha=0.1, mode="urkl")))
    value, m = term(_ctx(None, None, b, logp=logp, ref_logp=ref))
    assert value.item() == pytest.approx(0.1 * 0.5 * (math.log(2) ** 2 + math.log(0.5) ** 2) / 2)
    assert m["log_ratio_mean"] == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="reference"):
        term(_ctx(None, None, b, logp=logp, ref_logp=None))
    assert SdpgRefKlTerm.needs_reference and not SdpgOpdTerm.needs_reference


def test_loss_term_group_composes_and_validates(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    cfg = compose_cfg(["+loss_term=[sdpg_opd,sdpg_ref_kl]", "data.instruction=' Box it.'", "trainer.max_steps=7"])
    cfg = validate(cfg)
    terms = build_terms(cfg.loss.terms)
    assert [t.name for t in terms] == ["sdpg_opd", "sdpg_ref_kl"]
    assert terms[0].cfg.instruction == " Box it." and terms[0].cfg.total_steps == 7  # interpolations resolved
    assert terms[0].cfg.beta == 1e-3 and terms[1].cfg.mode == "urkl"
    one = validate(compose_cfg(["+loss_term=sdpg_ref_kl"]))
    assert list(one.loss.terms) == ["sdpg_ref_kl"]
    with pytest.raises(ConfigError) as exc:
        validate(compose_cfg(["+loss_term=[sdpg_opd,sdpg_ref_kl]", "loss.terms.sdpg_ref_kl.mode=xkl",
                              "loss.terms.sdpg_opd.decay_steps=5", "loss.terms.sdpg_opd.total_steps=null"]))
    text = str(exc.value)
    assert "loss.terms.sdpg_ref_kl.mode = 'xkl'" in text and "loss.terms.sdpg_opd.total_steps = None" in text
    with pytest.raises(ConfigError, match="loss.terms.sdpg_opd"):
        validate(compose_cfg(["+loss_term=sdpg_opd", "+loss.terms.sdpg_opd.nonsense=1"]))
    assert set(LOSS_TERMS) >= {"sdpg_opd", "sdpg_ref_kl"}


@pytest.mark.parametrize("overrides, expected", [
    ([], False), (["loss.beta=0.04"], True), (["loss.kl_in_reward.enabled=true"], True),
    (["+loss_term=sdpg_ref_kl"], True), (["+loss_term=sdpg_opd", "data.instruction=' Box it.'"], False)])
def test_one_answer_to_whether_a_run_needs_the_reference_model(tmp_path, overrides, expected):
    """Loading π_ref, its log-probs in the rollout phase and the memory plan ask one function: from the config alone
    (the planner) and from the built terms (the job) it gives the same answer."""
    from grail_exp.loss import build_terms, needs_reference
    from grail_exp.memory import plan
    from helpers.compose import compose

    cfg = compose(overrides, tmp_path)
    assert needs_reference(cfg) is expected
    assert needs_reference(cfg, build_terms(cfg.loss.get("terms"), None, cfg.model)) is expected
    assert any(line.what == "reference model" for line in plan(cfg).lines) is expected
