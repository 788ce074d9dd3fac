"""SCRL (grail_exp/estimators/scrl.py, grail_exp/data/curriculum.py): rewards, normalisation and span placement
against hand-computed values, curricula against the generator's own solutions, loader errors, an end-to-end run."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from grail_exp.data.arithmetic import ArithmeticTask
from grail_exp.data.curriculum import (
    SAMPLE_FILE,
    Curriculum,
    CurriculumError,
    arithmetic_curriculum,
    arithmetic_curriculum_solution,
    load_curriculum_jsonl,
    render_curriculum,
)
from grail_exp.estimators import EstimatorInput, estimate
from grail_exp.estimators.scrl import SCRLConfig, parse_spans, position_advantages, progress_rewards, token_positions


# ---------------------------------------------------------------------------------------------- rewards
def test_progress_correction_keeps_only_the_solved_prefix():
    r = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert progress_rewards(r).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert progress_rewards(r, correction=False).tolist() == r.float().tolist()


def test_position_normalisation_by_hand():
    R = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    A = position_advantages(R)
    # column 0: mean 3/4, unbiased std sqrt(((1/4)^2*3 + (3/4)^2)/3) = 0.5
    assert A[:, 0].tolist() == pytest.approx([0.25 / 0.5001, 0.25 / 0.5001, -0.75 / 0.5001, 0.25 / 0.5001], rel=1e-6)
    # column 1: mean 1/4, std 0.5
    assert A[:, 1].tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001], rel=1e-6)
    assert position_advantages(torch.ones(3, 2)).abs().max() == 0  # everyone solved it: no signal
    assert position_advantages(R, normalize_std=False)[:, 1].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_parse_spans_accepts_only_the_ordered_tags():
    t = "a <p1>3</p1> b <p2>x</p2>"
    assert parse_spans(t, 2) == [(2, 6, 7, 12), (15, 19, 20, 25)]
    assert t[6:7] == "3" and t[19:20] == "x"
    for bad in ["<p1>3</p1>", "<p2>3</p2><p1>1</p1>", "<p1>3<p2>4</p2></p1>", "<p1>3</p1><p2>4</p2><p2>4</p2>",
                "<p1>3</p1><p2>4"]:
        assert parse_spans(bad, 2) is None, bad


def test_token_positions_cover_exactly_the_span(tiny_tokenizer):
    text = "15+75=90. <p1>90</p1> 90-48=42. <p2>42</p2>"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = parse_spans(text, 2)
    tagged = token_positions(tiny_tokenizer, ids, text, [(s[0], s[3]) for s in spans], len(ids))
    toks = [tiny_tokenizer.decode([i]) for i in ids]
    # brute force: a token belongs to a span iff its decoded characters overlap the span's characters
    pos, start = [], 0
    for t in toks:
        pos.append((start, start + len(t)))
        start += len(t)
    assert "".join(toks) == text
    for (s, e), got in zip([(spans[0][0], spans[0][3]), (spans[1][0], spans[1][3])], tagged):
        assert got == [i for i, (a, b) in enumerate(pos) if a < e and b > s]
    (cont,) = token_positions(tiny_tokenizer, ids, text, [(spans[0][1], spans[0][2])], len(ids))
    assert "".join(toks[i] for i in cont) == "90"


# ---------------------------------------------------------------------------------------------- the estimator
class _Tok:
    """Character-level tokenizer: token i = char i, so token positions equal char offsets."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _estimate(texts, variants, rewards, G, **cfg):
    C = max(len(t) for t in texts) + 2
    mask = torch.zeros(len(texts), C)
    for i, t in enumerate(texts):
        mask[i, :len(t) + 1] = 1  # + the EOS
    extras = {"completion_texts": texts, "completion_token_ids": [[ord(c) for c in t] for t in texts],
              "tokenizer": _Tok(), "verifier": None, "rollout_variants": variants}
    est = SCRLConfig(verify="exact", **cfg)
    return estimate(est, EstimatorInput(torch.tensor(rewards, dtype=torch.float), G, mask, "none", extras)), mask


def test_estimator_places_each_position_advantage_on_its_span_and_zero_elsewhere():
    c = Curriculum(("q1", "q2"), ("3", "7"))
    texts = ["<p1>3</p1><p2>7</p2>",  # [1, 1]
             "<p1>3</p1><p2>5</p2>",  # [1, 0]
             "<p1>4</p1><p2>7</p2>",  # [0, 1] -> corrected [0, 0]
             "<p1>3</p1> no second tag",  # bad format: R = 0, all tokens 0
             "\\boxed{7}", "\\boxed{2}", "\\boxed{7}", "\\boxed{7}"]
    out, mask = _estimate(texts, [c] * 4 + [None] * 4, [0, 0, 0, 0, 1, 0, 1, 1], G=8)
    R = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    A = (R - R.mean(0)) / (R.std(0) + 1e-4)
    adv = out.advantages
    for i in range(3):
        sp = parse_spans(texts[i], 2)
        expect = torch.zeros(adv.shape[1])
        for j, (s, _, _, e) in enumerate(sp):
            expect[s:e] = A[i, j]
        assert torch.allclose(adv[i], expect), i
    assert adv[3].abs().sum() == 0
    # original rows: r - mean over the 4 original rows (scale_rewards=none), on every completion token
    for i, r in zip(range(4, 8), [1, 0, 1, 1]):
        assert torch.allclose(adv[i], (r - 0.75) * mask[i])
    assert out.rewards.tolist() == [1, 0, 0, 0, 1, 0, 1, 1]
    assert out.metrics["curriculum/format_ok"] == 0.75 and out.metrics["curriculum/progress"] == pytest.approx(3 / 8)
    assert out.metrics["original/accuracy"] == 0.75


def test_without_correction_and_content_only_spans():
    c = Curriculum(("q1", "q2"), ("3", "7"))
    texts = ["<p1>4</p1><p2>7</p2>", "<p1>3</p1><p2>5</p2>"]
    out, _ = _estimate(texts, [c, c], [0, 0], G=2, progress_correction=False, span_tokens="content")
    # per position over two rows with r = [0, 1]: (±0.5) / (std 0.7071 + 1e-4)
    assert out.advantages[0, 4].item() == pytest.approx(-0.5 / (0.5 ** 0.5 + 1e-4))  # "4": wrong, raw r = 0
    assert out.advantages[0, 14].item() == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-4))  # "7": right (no correction)
    assert out.advantages[0, :4].abs().sum() == 0 and out.advantages[0, 5:14].abs().sum() == 0  # tags: 0


# ---------------------------------------------------------------------------------------------- curricula
def test_arithmetic_curriculum_answers_are_the_true_intermediate_values():
    task = ArithmeticTask(min_steps=1, max_steps=4, operators="+-*")
    for p in task.train_problems(0, 200):
        c = arithmetic_curriculum(p.question)
        # independent source: the generator's own reference solution "a+b=c. c-d=e. \boxed{e}"
        steps = [s.split("=")[1] for s in p.solution.split("\\boxed")[0].strip().rstrip(".").split(". ")]
        assert list(c.answers) == steps and c.answers[-1] == p.answer
        assert c.questions[-1] == p.question and c.K == len(steps)
        for q, a in zip(c.questions, c.answers):
            expr = q[len("Compute "):-1]
            value, tokens = None, expr.replace("-", " - ").replace("+", " + ").replace("*", " * ").split()
            value = int(tokens[0])
            for op, x in zip(tokens[1::2], tokens[2::2]):
                value = {"+": value + int(x), "-": value - int(x), "*": value * int(x)}[op]
            assert str(value) == a
        sol = arithmetic_curriculum_solution(p.question)
        assert parse_spans(sol, c.K) is not None
        assert [sol[s[1]:s[2]] for s in parse_spans(sol, c.K)] == list(c.answers)


def test_render_curriculum():
    c = Curriculum(("Compute 1+2.", "Compute 1+2+3."), ("3", "6"))
    assert render_curriculum(c, "K={K}:\n{subproblems}", "{j}) {question}") == "K=2:\n1) Compute 1+2.\n2) Compute 1+2+3."


def test_shipped_sample_loads_with_paper_k():
    rows = load_curriculum_jsonl(SAMPLE_FILE, 4)
    assert len(rows) >= 3 and all(r.meta["curriculum"].K == 4 for r in rows)
    assert all(r.meta["curriculum"].answers[-1] == r.answer for r in rows)


@pytest.mark.parametrize("row, message", [
    ("not json", ":1: not valid JSON"),
    ({"answer": "1", "subproblems": [{"question": "q", "answer": "1"}]}, ":1: 'problem' must be a non-empty string"),
    ({"problem": "p", "answer": "1", "subproblems": []}, ":1: 'subproblems' must be a non-empty list"),
    ({"problem": "p", "answer": "1", "subproblems": [{"question": "q"}]}, ":1: subproblems[0].'answer' must be"),
    ({"problem": "p", "answer": "1", "subproblems": ["q"]}, ":1: subproblems[0] must be an object"),
    ({"problem": "p", "answer": "1", "subproblems": [{"question": "q", "answer": "2"}]},
     ":1: subproblems[0].answer '2' must equal 'answer' '1'"),
])
def test_loader_errors_name_file_line_and_key(tmp_path, row, message):
    f = tmp_path / "c.jsonl"
    f.write_text((row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(CurriculumError) as exc:
        load_curriculum_jsonl(f)
    assert f"{f}{message}" in str(exc.value)


def test_loader_checks_k(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"problem": "p", "answer": "1", "subproblems": [{"question": "q", "answer": "1"}]}) + "\n")
    with pytest.raises(CurriculumError, match=r"c.jsonl:1: 'subproblems' has 1 entries; data.num_subproblems=4"):
        load_curriculum_jsonl(f, 4)


# ---------------------------------------------------------------------------------------------- config
def test_validate_rejects_nonsense_combinations(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError) as exc:
        validate(compose_cfg(["estimator=scrl", "data=deepmath", "rollout.num_generations=4",
                              "estimator.curriculum_rollouts=3", "estimator.span_tokens=all"]))
    msg = str(exc.value)
    assert "data.name = 'deepmath'" in msg and "estimator.curriculum_rollouts = 3" in msg
    assert "estimator.span_tokens = 'all'" in msg
    cfg = validate(compose_cfg(["estimator=scrl"]))
    assert cfg.model.warm_start.curriculum_fraction == 0.5


@pytest.mark.parametrize("recipe", [["model=qwen3_4b"], ["experiment=paper/qwen3_4b_grpo"],
                                    ["model=qwen3_8b", "advantage=grail"], ["model=smollm2_135m"], []])
def test_scrl_loss_settings_survive_every_recipe_family(compose_cfg, recipe):
    """The paper family's recipe sets loss.scale_rewards: none and loss.loss_type: dr_grpo; composed before it
    (conf/config.yaml), estimator=scrl silently got them back on every paper model. Now the method composes after the
    family: SCRL's objective on the paper, SmolLM2 and demo families alike."""
    from grail_exp.validate import validate

    cfg = validate(compose_cfg([*recipe, "estimator=scrl", "data=scrl_jsonl", "logger=none"]))
    assert (cfg.loss.scale_rewards, cfg.loss.loss_type) == ("group", "dapo")


@pytest.mark.parametrize("overrides, keys", [
    (["loss.scale_rewards=none"], ["loss.scale_rewards = 'none'"]),
    (["loss.loss_type=bnpo"], ["loss.loss_type = 'bnpo'"]),
    (["experiment=baselines/dr_grpo_cpu"], ["loss.scale_rewards = 'none'", "loss.loss_type = 'dr_grpo'"]),
    (["experiment=paper/qwen3_4b_grpo", "data=scrl_jsonl", "loss.loss_type=dr_grpo"], ["loss.loss_type = 'dr_grpo'"])])
def test_a_run_that_changes_scrls_required_settings_is_refused_naming_the_keys(compose_cfg, overrides, keys):
    """An experiment file or override composed after the method can still change its settings: refused, one line
    per key (SCRL's `requires`), instead of training another objective under SCRL's name."""
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError) as exc:
        validate(compose_cfg([*overrides, "estimator=scrl", "logger=none"]))
    msg = str(exc.value)
    for key in keys:
        assert f"{key}: estimator=scrl requires" in msg, msg


def test_estimator_scrl_composes_the_papers_loss_and_both_halves_share_a_scale(compose_cfg):
    """estimator=scrl sets scale_rewards: group and a token-mean loss (paper Eq. 5). On rewards [1, 0, 1, 0] in both
    halves the original rows and the curriculum spans then get the same ±0.5/(std + 1e-4), std = sqrt(1/3) (with
    scale_rewards: none the originals got ±0.5: 1.73x less)."""
    from grail_exp.validate import validate

    cfg = validate(compose_cfg(["estimator=scrl"]))
    assert cfg.loss.scale_rewards == "group" and cfg.loss.loss_type == "dapo"
    c = Curriculum(("q1",), ("3",))
    texts = ["<p1>3</p1>", "<p1>4</p1>", "<p1>3</p1>", "<p1>5</p1>", "\\boxed{3}", "a", "\\boxed{3}", "b"]
    C = max(len(t) for t in texts) + 2
    mask = torch.zeros(8, C)
    for i, t in enumerate(texts):
        mask[i, :len(t) + 1] = 1
    extras = {"completion_texts": texts, "completion_token_ids": [[ord(ch) for ch in t] for t in texts],
              "tokenizer": _Tok(), "verifier": None, "rollout_variants": [c] * 4 + [None] * 4}
    est = SCRLConfig(verify="exact")
    out = estimate(est, EstimatorInput(torch.tensor([0, 0, 0, 0, 1, 0, 1, 0.0]), 8, mask, cfg.loss.scale_rewards,
                                       extras))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.8658
    assert out.advantages[0, 0].item() == pytest.approx(a, rel=1e-6)  # curriculum: span tokens of a solved row
    assert out.advantages[1, 0].item() == pytest.approx(-a, rel=1e-6)
    assert out.advantages[4, 0].item() == pytest.approx(a, rel=1e-6)  # original rows: the same scale
    assert out.advantages[5, 0].item() == pytest.approx(-a, rel=1e-6)


def test_prompt_variants_mix_half_and_half():
    from omegaconf import OmegaConf

    from grail_exp.data.sources import Problem
    from grail_exp.estimators.scrl import prompt_variants

    data = OmegaConf.create({"name": "arithmetic"})
    (plan,) = prompt_variants(SCRLConfig(), [Problem("Compute 1+2-3.", "0")], 8, data)
    assert [v.n for v in plan] == [4, 4] and plan[1].info is None and plan[1].question == "Compute 1+2-3."
    assert plan[0].info.answers == ("3", "0") and "1. Compute 1+2.\n2. Compute 1+2-3." in plan[0].question


def test_sample_variants_keeps_plan_order():
    from grail_exp.estimators import PromptVariant
    from grail_exp.rollout.base import Completion
    from grail_exp.rollout.variants import sample_variants

    class Engine:
        def generate(self, prompts, params):
            return [Completion(p, [k], None, False) for p in prompts for k in range(params.n)]

    class Tok:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[len(t)] for t in texts]}

    from omegaconf import OmegaConf

    from grail_exp.rollout import SamplingParams

    model = OmegaConf.create({"prompt_style": "plain", "plain_template": "{problem}"})
    plan = [[PromptVariant("aa", 3, info="c0"), PromptVariant("b", 1)], [PromptVariant("cccc", 3, info="c1"),
                                                                       PromptVariant("d", 1)]]
    comps, infos = sample_variants(Engine(), Tok(), model, "", plan, SamplingParams())
    assert [(c.prompt_ids[0], c.token_ids[0]) for c in comps] == [(2, 0), (2, 1), (2, 2), (1, 0), (4, 0), (4, 1),
                                                                   (4, 2), (1, 0)]
    assert infos == ["c0"] * 3 + [None] + ["c1"] * 3 + [None]


# ---------------------------------------------------------------------------------------------- trainer wiring
class _ScriptedEngine:
    """Answers curriculum prompts with the exact curriculum solution, wrong from position k = row index % (K + 1)
    on (so progress k), and original prompts with the reference ``\\boxed{}`` answer."""

    def __init__(self, tok):
        self.tok = tok

    def sync_weights(self, model):
        pass

    def generate(self, prompts, params):
        from grail_exp.rollout.base import Completion

        out = []
        for p in prompts:
            text = self.tok.decode(p, skip_special_tokens=True)
            question = re.findall(r"Compute [\d+\-*]+\.", text)[-1]
            lines = [line for line in text.splitlines() if line[:1].isdigit() and ". Compute" in line]
            for k in range(params.n):
                if lines:
                    c = arithmetic_curriculum(lines[-1].split(". ", 1)[1])
                    body = " ".join(f"<p{j + 1}>{a if j < k % (c.K + 1) else '999'}</p{j + 1}>"
                                    for j, a in enumerate(c.answers))
                else:
                    body = f"\\boxed{{{arithmetic_curriculum(question).answers[-1]}}}"
                ids = self.tok(body, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                out.append(Completion(list(p), ids, [-1.0] * len(ids), False))
        return out


def test_trainer_samples_both_formats_and_feeds_span_advantages_to_the_loss(tiny_model, tiny_tokenizer):
    from grail_exp.advantages import build_scheme
    from grail_exp.data import build_source
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.optim import build_optimizer
    from grail_exp.training.module import Parts, RLVRModule
    from grail_exp.validate import validate
    from helpers.compose import compose

    cfg = validate(compose(["estimator=scrl", "advantage=grpo", "logger=none", "trainer.prompts_per_step=2",
                            "trainer.micro_batch_size=8", "rollout.num_generations=8",
                            "rollout.max_completion_length=48"]))
    verifier = MathVerifier(num_workers=0)
    module = RLVRModule(cfg, Parts(tiny_model, tiny_tokenizer, build_scheme(cfg.advantage, tiny_tokenizer),
                                   build_source(cfg.data), verifier, engine=_ScriptedEngine(tiny_tokenizer)))
    module.manual_backward = lambda loss: loss.backward()
    batch, stats = module.rollout.make_batch(0, {})
    G, N = 8, 16
    assert batch.token_advantages.shape[0] == N
    for g in range(2):
        curr, orig = range(g * G, g * G + 4), range(g * G + 4, (g + 1) * G)
        assert all("<p1>" in batch.texts[i] for i in curr) and all("boxed" in batch.texts[i] for i in orig)
        assert batch.rewards[list(orig)].tolist() == [1.0] * 4  # reference answers
        assert batch.token_advantages[list(orig)].abs().sum() == 0  # all correct: no outcome signal
        K = arithmetic_curriculum(batch.problems[g * G]).K
        progress = [k % (K + 1) for k in range(4)]
        assert batch.rewards[list(curr)].tolist() == [float(p == K) for p in progress]
        # row i's tokens carry exactly the values A_i^(j) of its spans (hand: R from the scripted progress)
        R = torch.tensor([[float(j < p) for j in range(K)] for p in progress])
        A = (R - R.mean(0)) / (R.std(0) + 1e-4)
        for i, a_row in zip(curr, A):
            got = sorted({round(v, 4) for v in batch.token_advantages[i].tolist() if v != 0})
            assert got == sorted({round(v, 4) for v in a_row.tolist() if v != 0}), (i, got, a_row)
    assert stats["estimator/curriculum/format_ok"] == 1.0
    opt = build_optimizer(module.policy, cfg.optim, master_weights=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    m = module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, epoch=0)
    assert m["grad_norm"] > 0
    verifier.close()


# ---------------------------------------------------------------------------------------------- end to end
def test_scrl_run_end_to_end_on_arithmetic(compose_cfg, tmp_path):
    """`python -m grail_exp.run data=arithmetic estimator=scrl`: 2 steps on a shortened warm start."""
    from grail_exp.run import train
    from grail_exp.validate import validate

    cfg = validate(compose_cfg(["estimator=scrl", "advantage=grpo", "trainer.max_steps=2", "trainer.prompts_per_step=2",
                                "trainer.micro_batch_size=16", "model.warm_start.max_steps=20",
                                "model.warm_start.eval_every=10", "benchmark.limit=4", "eval.n=1",
                                "trainer.eval_before_training=false", "logger=none", "reward.num_workers=0"]))
    res = train(cfg)
    assert res["train/steps"] == 2
    for k in ("train/estimator/curriculum/format_ok", "train/estimator/curriculum/progress", "train/loss"):
        assert k in res, sorted(res)
