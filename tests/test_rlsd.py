"""RLSD (advantage=rlsd) and the privileged-teacher helper: hand values, a brute-force teacher, GRPO limit, CLI parity."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from grail_exp.advantages import SchemeBatch, build_scheme
from grail_exp.advantages.rlsd import RlsdConfig, RlsdScheme, rlsd_lambda, rlsd_weights
from grail_exp.teacher import TEMPLATES, build_teacher_batch, teacher_logprobs, teacher_prompt_texts
from helpers.batches import CHAT_MODEL_CFG, PROBLEM_ROWS, problem_batch
from helpers.fakes import AlternatingVerifier
from helpers.module import small_config, train_step


def _cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(RlsdConfig), kw)


def _official_lambda(global_step, lam=0.5, warmup=0, decay=60):
    """iie-ycx/RLSD opsd_trainer: ``global_step`` is incremented before each rollout batch (1 for the first), then
    a piecewise rule (written here from the official code's arithmetic, independently of rlsd_lambda)."""
    if warmup > 0 and global_step < warmup:
        return lam * (global_step / warmup)
    if decay > 0 and global_step >= warmup:
        return lam * max(1.0 - (global_step - warmup) / decay, 0.0)
    return lam


def _lambda_seen(scheme, step, rollout_step):
    """λ the scheme uses for a batch at optimiser step ``step`` of rollout batch ``rollout_step`` (A = 0 rows: no
    teacher forward is needed, the metric still reports λ)."""
    b = SchemeBatch(input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3),
                    position_ids=torch.arange(3)[None], prompt_length=1, completion_ids=torch.zeros(1, 2, dtype=torch.long),
                    completion_mask=torch.ones(1, 2), advantages=torch.zeros(1), rewards=torch.zeros(1), step=step,
                    rollout_step=rollout_step)
    return scheme.weights(None, b).metrics["lambda"]


def test_lambda_schedule_by_hand():
    c = _cfg()  # official: 0.5 decayed linearly to 0 over 60 rollout batches, counted from 1
    assert [rlsd_lambda(c, k) for k in (1, 30, 45, 59, 60, 100)] == \
        pytest.approx([0.5 * 59 / 60, 0.25, 0.125, 0.5 / 60, 0.0, 0.0])
    c = _cfg(lambda_warmup_steps=10, lambda_decay_steps=20)
    assert [rlsd_lambda(c, k) for k in (1, 5, 10, 20, 30, 40)] == pytest.approx([0.05, 0.25, 0.5, 0.25, 0, 0])
    assert rlsd_lambda(_cfg(lambda_decay_steps=0), 1000) == 0.5  # both off: constant
    for warm, decay in ((0, 60), (10, 20), (7, 0), (0, 0), (3, 5)):
        cfg = _cfg(lambda_warmup_steps=warm, lambda_decay_steps=decay)
        for k in range(1, 80):
            assert rlsd_lambda(cfg, k) == pytest.approx(_official_lambda(k, 0.5, warm, decay), abs=1e-12), (warm, decay, k)


def test_lambda_counts_rollout_batches_from_one():
    """The issue's measurement: at rollout batches 1 / 59 / 60 the official λ is 0.4917 / 0.0083 / 0 (ours used to be
    0.5 / 0.0167 / 0.0083: optimiser steps, counted from 0). With μ = 4 optimiser steps per rollout batch, λ stays
    constant within a rollout batch and reaches 0 at the 60th, not after 15."""
    scheme = RlsdScheme(_cfg(), None, {"model": CHAT_MODEL_CFG})
    for g in (1, 59, 60):
        for j in range(4):  # μ = 4: optimiser steps 4(g−1) … 4(g−1)+3
            assert _lambda_seen(scheme, 4 * (g - 1) + j, g) == pytest.approx(_official_lambda(g), abs=1e-12)
    assert _lambda_seen(scheme, 0, 1) == pytest.approx(0.4916667, abs=1e-7)
    assert _lambda_seen(scheme, 232, 59) == pytest.approx(0.0083333, abs=1e-7)
    assert _lambda_seen(scheme, 236, 60) == 0.0
    # without a rollout counter (the weights CLI, old callers): rollout batch = optimiser step + 1
    assert _lambda_seen(scheme, 0, None) == pytest.approx(_official_lambda(1), abs=1e-12)
    assert _lambda_seen(scheme, 58, None) == pytest.approx(_official_lambda(59), abs=1e-12)


def test_weights_formula_by_hand():
    # rows: A > 0, A > 0, A < 0, A < 0, A = 0 ; Δ = log 1.1, log 2, log 2, −log 1.1, log 3
    d = torch.tensor([[math.log(1.1)], [math.log(2.0)], [math.log(2.0)], [-math.log(1.1)], [math.log(3.0)]])
    A = torch.tensor([1.0, 0.5, -0.5, -1.0, 0.0])
    w, e = rlsd_weights(d, torch.zeros_like(d), A, lam=0.5, clip=0.2)
    # e: 1.1 ; 2 → clip 1.2 ; 1/2 → clip 0.8 ; 1.1 ; exp(0) = 1
    assert e.squeeze(1).tolist() == pytest.approx([1.1, 1.2, 0.8, 1.1, 1.0])
    assert w.squeeze(1).tolist() == pytest.approx([1.05, 1.1, 0.9, 1.05, 1.0])
    w0, _ = rlsd_weights(d, torch.zeros_like(d), A, lam=0.0, clip=0.2)
    assert torch.equal(w0, torch.ones_like(w0))


def _brute_logp(model, tok, prompt_text, completion_ids):
    """log softmax of the full logits of one unpadded sequence, at the completion tokens."""
    p = tok(prompt_text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[len(p) - 1:-1], -1)
    return lp.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)


def test_teacher_prompt_goes_through_the_chat_template(tiny_tokenizer):
    b = problem_batch(tiny_tokenizer, PROBLEM_ROWS[:2])
    tb = build_teacher_batch(b, tiny_tokenizer, CHAT_MODEL_CFG, "rlsd", " Box it.")
    text = tiny_tokenizer.decode(tb.input_ids[0, :tb.prompt_length][tb.attention_mask[0, :tb.prompt_length].bool()])
    assert text.startswith("<|im_start|>user\nCompute 7+5-3.\n\nHere is a reference solution:\n9\n\nAfter understanding")
    assert "own approach below. Box it.<|im_end|>\n<|im_start|>assistant\n" in text  # then the think block
    assert torch.equal(tb.input_ids[:, tb.prompt_length:], b.completion_ids)  # the student's tokens, appended
    # positions continue from the teacher's own prompt length
    n0 = int(tb.attention_mask[0, :tb.prompt_length].sum())
    assert tb.position_ids[0, tb.prompt_length].item() == n0
    sdpg = teacher_prompt_texts(["Compute 2+2."], ["4"], tiny_tokenizer, CHAT_MODEL_CFG, "sdpg", " Box it.")[0]
    # SDPG: the README's two lines, after the student's question and instruction in the same user message
    assert ("<|im_start|>user\nCompute 2+2. Box it.\n\nThe correct answer to this problem is: 4\nUse this to verify "
            "your reasoning, but show your full solution process.<|im_end|>") in sdpg
    assert "{answer}" in TEMPLATES["rlsd"] and "{answer}" in TEMPLATES["sdpg"]


@pytest.mark.parametrize("teacher", ["live", "frozen"])
def test_weights_match_a_brute_force_teacher(tiny_model, tiny_tokenizer, teacher):
    tok = tiny_tokenizer
    scheme = RlsdScheme(_cfg(teacher=teacher, lambda_decay_steps=0, clip=0.5), tok, {"model": CHAT_MODEL_CFG})
    b = problem_batch(tok, PROBLEM_ROWS, step=0)
    b.prepared = scheme.prepare(tiny_model, b)
    w = scheme.weights(tiny_model, b).weights
    from grail_exp.data.prompting import render_prompt

    for i, (q, a, comp, A) in enumerate(PROBLEM_ROWS):
        c = tok(comp, add_special_tokens=False)["input_ids"]
        n = len(c)
        if A == 0:  # no teacher: w = 1 on valid tokens
            assert torch.equal(w[i, :n], torch.ones(n))
            continue
        t_text = render_prompt(TEMPLATES["rlsd"].format(problem=q, answer=a, instruction=""), tok, CHAT_MODEL_CFG)
        lt = _brute_logp(tiny_model, tok, t_text, c)
        ls = _brute_logp(tiny_model, tok, render_prompt(q, tok, CHAT_MODEL_CFG), c)
        e = torch.exp(math.copysign(1.0, A) * (lt - ls)).clamp(0.5, 1.5)
        assert torch.allclose(w[i, :n], 0.5 + 0.5 * e, atol=1e-5), i
        assert (w[i, n:] == 0).all()  # padding
        assert not torch.allclose(e, torch.ones(n))  # the teacher does change something


def test_shared_forward_batching_and_negative_only(tiny_model, tiny_tokenizer):
    from grail_exp.compute.forward import policy_forward

    tok = tiny_tokenizer
    scheme = RlsdScheme(_cfg(teacher="live"), tok, {"model": CHAT_MODEL_CFG})
    b = problem_batch(tok, PROBLEM_ROWS, step=10)
    w = scheme.weights(tiny_model, b).weights
    _, _, fwd = policy_forward(tiny_model, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids, 1.0)
    assert torch.allclose(scheme.weights_from_forward(tiny_model, b, fwd).weights, w, atol=1e-6)
    for i in range(len(PROBLEM_ROWS)):  # one row per micro-batch: different teacher padding, same weights
        sub = b.rows(torch.tensor([i]))
        assert torch.allclose(scheme.weights(tiny_model, sub).weights[0], w[i], atol=1e-5)
    neg = RlsdScheme(_cfg(teacher="live", negative_only=True), tok, {"model": CHAT_MODEL_CFG}).weights(tiny_model, b)
    m = b.completion_mask
    assert torch.equal(neg.weights[1:], m[1:])  # A >= 0 rows: w = 1
    assert torch.allclose(neg.weights[0], w[0])


def test_student_logp_rollout_is_computed_once_with_the_rollout_parameters(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    b = problem_batch(tok, PROBLEM_ROWS[:2])
    live = RlsdScheme(_cfg(teacher="live"), tok, {"model": CHAT_MODEL_CFG})
    roll = RlsdScheme(_cfg(teacher="live", student_logp="rollout"), tok, {"model": CHAT_MODEL_CFG})
    b.prepared = roll.prepare(tiny_model, b)
    assert torch.allclose(roll.weights(tiny_model, b).weights, live.weights(tiny_model, b).weights, atol=1e-6)
    with torch.no_grad():  # the parameters move: live P_S and live teacher follow, the rollout P_S does not
        tiny_model.lm_head.weight.mul_(1.5)
    t = teacher_logprobs(tiny_model, build_teacher_batch(b, tok, CHAT_MODEL_CFG, "rlsd"))
    expected, _ = rlsd_weights(t, b.prepared["student_logp"], b.advantages, _official_lambda(1), 0.2)
    assert torch.allclose(roll.weights(tiny_model, b).weights, expected * b.completion_mask, atol=1e-6)
    assert not torch.allclose(roll.weights(tiny_model, b).weights, live.weights(tiny_model, b).weights, atol=1e-4)


def test_frozen_teacher_syncs_every_n_rollout_batches(tiny_model, tiny_tokenizer):
    """Official dp_opsd_actor: after the update of rollout batch g, sync when g % 20 == 0; so batches 1-20 see the
    initial actor and batch 21 the actor after batch 20, whatever the number of optimiser steps per batch."""
    tok = tiny_tokenizer
    scheme = RlsdScheme(_cfg(teacher="frozen", teacher_sync_every=20), tok, {"model": CHAT_MODEL_CFG})
    b = problem_batch(tok, PROBLEM_ROWS[:2], step=0)
    b.rollout_step = 1
    scheme.prepare(tiny_model, b)
    initial = scheme.frozen.lm_head.weight.clone()
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(0.1)
    b.step, b.rollout_step = 20, 6  # μ = 4: optimiser step 20 is rollout batch 6 (the old code synced here)
    scheme.prepare(tiny_model, b)
    assert torch.equal(scheme.frozen.lm_head.weight, initial)
    b.step, b.rollout_step = 79, 20
    scheme.prepare(tiny_model, b)
    assert torch.equal(scheme.frozen.lm_head.weight, initial)  # not yet: batch 20 still uses the initial actor
    b.step, b.rollout_step = 80, 21
    scheme.prepare(tiny_model, b)
    assert torch.equal(scheme.frozen.lm_head.weight, tiny_model.lm_head.weight)  # synced: the actor after batch 20
    with torch.no_grad():
        tiny_model.lm_head.weight.add_(0.1)
    b.rollout_step = 40
    scheme.prepare(tiny_model, b)
    assert not torch.equal(scheme.frozen.lm_head.weight, tiny_model.lm_head.weight)  # batches 21-40: one copy
    assert not scheme.frozen.lm_head.weight.requires_grad


def test_config_checks():
    p = RlsdScheme.check_config(_cfg(lam=1.5, clip=1.0, teacher="x", template="no field", lambda_decay_steps=-1))
    text = " | ".join(p)
    for key in ("lam = 1.5", "clip = 1.0", "teacher = 'x'", "template = 'no field'", "lambda_decay_steps = -1"):
        assert key in text, key


def _module(cfg, model_dir):
    """helpers.module.build_module with the scheme context the run passes (model config, data)."""
    from grail_exp.data import build_source
    from grail_exp.models.loading import load_causal_lm, load_tokenizer
    from grail_exp.rollout import build_engine
    from grail_exp.tracking import NullTracker
    from grail_exp.training.module import Parts, RLVRModule

    tok = load_tokenizer(str(model_dir), cfg)
    policy = load_causal_lm(str(model_dir), cfg, trainable=True)
    scheme = build_scheme(cfg.advantage, tok, {"model": cfg.model, "seed": cfg.seed, "data": cfg.data})
    return RLVRModule(cfg, Parts(policy, tok, scheme, build_source(cfg.data), AlternatingVerifier(),
                                 engine=build_engine("hf", policy, tok)), NullTracker())


def test_lambda_zero_is_grpo_exactly(compose_cfg, tiny_model_dir):
    """advantage=rlsd with lam = 0 takes the same optimiser step as advantage=grpo (parameters equal)."""
    params = []
    for extra in (["advantage=grpo"], ["advantage=rlsd", "advantage.lam=0.0", "advantage.teacher=live"]):
        module = _module(small_config(compose_cfg, tiny_model_dir, extra), tiny_model_dir)
        train_step(module)
        params.append([p.detach().clone() for p in module.policy.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))
    # and lam > 0 does change the step (the test can fail)
    module = _module(small_config(compose_cfg, tiny_model_dir, ["advantage=rlsd", "advantage.clip=0.9"]),
                     tiny_model_dir)
    train_step(module)
    assert not all(torch.equal(a, p) for a, p in zip(params[0], module.policy.parameters()))


def test_weights_cli_matches_training_path(compose_cfg, tiny_model_dir, tmp_path):
    """The weights of the trainer's first micro-batch == ``grail_exp.weights`` on rows with problem / answer fields."""
    from grail_exp.weights import compute
    from helpers.compose import compose_weights

    extra = ["advantage=rlsd", "advantage.clip=0.9"]
    module = _module(small_config(compose_cfg, tiny_model_dir, extra), tiny_model_dir)
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    module.rollout.prepare(batch, {})
    captured = []
    real = module.scheme.weights_from_forward

    def spy(model, b, fwd):
        out = real(model, b, fwd)
        captured.append((b, out.weights.clone()))
        return out

    module.scheme.weights_from_forward = spy
    module.manual_backward = lambda loss: loss.backward()
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)

    class Opt:
        def step(self):
            opt.step()

        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none=set_to_none)

    module.update.step(batch, Opt(), torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       batch.loss_mask.sum().item(), {}, 0)
    b, w_train = captured[0]
    assert (b.advantages != 0).any()
    P = b.prompt_length
    rows = []
    for i in range(b.input_ids.shape[0]):
        pm, cm = b.attention_mask[i, :P].bool(), b.completion_mask[i].bool()
        rows.append({"prompt_ids": b.input_ids[i, :P][pm].tolist(), "completion_ids": b.completion_ids[i][cm].tolist(),
                     "advantage": float(b.advantages[i]), "problem": b.problems[i], "answer": b.gold_answers[i]})
    inp = tmp_path / "rows.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = compose_weights(tmp_path, [f"model.name_or_path={tiny_model_dir}", f"input={inp}", f"output={tmp_path}/o.json",
                                     *extra])
    result = compute(cfg)
    changed = 0
    for i, r in enumerate(result):
        n = len(rows[i]["completion_ids"])
        assert torch.allclose(torch.tensor(r["weights"]), w_train[i][:n].float(), atol=1e-5), i
        changed += int(not torch.allclose(w_train[i][:n], torch.ones(n)))
    assert changed > 0
