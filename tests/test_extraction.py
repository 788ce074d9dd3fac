"""reward.extraction / benchmark.extraction: paper | last_balanced | math_verify on crafted completions."""

from __future__ import annotations

import random

import pytest

from grail_exp.grading.boxed import extract_last_boxed
from grail_exp.grading.extraction import RULES, benchmark_rule, eval_reference, reward_reference, reward_rule
from grail_exp.grading.rewards import MathVerifier

# text -> (last_balanced, paper reward, paper evaluation), worked out by hand
CASES = [
    (r"\boxed{1} and \boxed{2}", "2", "2", "2"),
    (r"\boxed{1} \boxed{2 \boxed{3}", "3", "3", "1"),  # the evaluation stops at the unterminated box
    (r"\boxed{\boxed{4}}", "4", r"\boxed{4}", r"\boxed{4}"),  # only last_balanced lets the nested box win
    (r"so \boxed{ 5 }.", " 5 ", "5", " 5 "),  # only the reward strips
    (r"\boxed{}", "", "", ""),
    ("no box at all", None, None, None),
    (r"\boxed{a} then \boxed{", "a", "a", "a"),
    (r"\boxed{x^{2}} vs \boxed{\frac{1}{2}}", r"\frac{1}{2}", r"\frac{1}{2}", r"\frac{1}{2}"),
    (r"\boxed{1 \boxed{2}", "2", "2", None),  # nothing read before the unterminated box
]


@pytest.mark.parametrize("text, last, reward, evaluation", CASES)
def test_box_rules_on_crafted_completions(text, last, reward, evaluation):
    assert extract_last_boxed(text) == last
    assert reward_reference(text) == reward
    assert eval_reference(text) == evaluation


def _reference_eval_oracle(s: str):
    """The reference evaluation's rule, written independently: boxes left to right, stop at an unterminated one."""
    found, rest = [], s
    while r"\boxed{" in rest:
        body = rest[rest.index(r"\boxed{") + 7:]
        depth = 1
        for end, ch in enumerate(body):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0:
                found.append(body[:end])
                rest = body[end + 1:]
                break
        else:  # the box never closes
            break
    return found[-1] if found else None


def test_paper_rules_match_the_reference_on_random_strings():
    regex = pytest.importorskip("regex")
    pattern = regex.compile(r"\\boxed\{((?:[^{}]+|\{(?1)\})*)\}")  # the reference reward's pattern (spec §11)
    rng = random.Random(0)
    atoms = [r"\boxed{", "{", "}", "a", " ", "1", r"\frac", "x"]
    for _ in range(3000):
        s = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        matches = list(pattern.finditer(s))
        assert reward_reference(s) == (matches[-1].group(1).strip() if matches else None), s
        assert eval_reference(s) == _reference_eval_oracle(s), s


def test_modes_map_to_rules_and_reject_unknown_names():
    assert reward_rule("paper") == "paper_reward" and benchmark_rule("paper") == "paper_eval"
    assert reward_rule("last_balanced") == benchmark_rule("last_balanced") == "last_balanced"
    assert reward_rule("math_verify") == "math_verify" and RULES["math_verify"] is None
    with pytest.raises(ValueError, match="reward.extraction"):
        reward_rule("lighteval")
    with pytest.raises(ValueError, match="unknown extraction rule"):
        MathVerifier(num_workers=0, extraction="paper")  # a mode, not a concrete rule


def test_config_validates_the_extraction_keys(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError) as err:  # validate() reports every bad key at once
        validate(compose_cfg(["reward.extraction=boxed", "benchmark.extraction=lighteval"]))
    assert "reward.extraction" in str(err.value) and "benchmark.extraction" in str(err.value)
    cfg = validate(compose_cfg([]))
    assert cfg.reward.extraction == "last_balanced" and cfg.benchmark.extraction == "last_balanced"  # unchanged


GRADED = [  # completion, gold -> correct under (last_balanced, paper_reward, paper_eval, math_verify)
    (r"So the answer is \boxed{5}.", "5", (True, True, True, True)),
    (r"So the answer is $\boxed {5}$.", "5", (False, False, False, True)),
    (r"So the answer is $\fbox{5}$.", "5", (False, False, False, True)),
    (r"The roots are \boxed{2}, \boxed{3}.", "2, 3", (False, False, False, True)),  # one box per element
    (r"Therefore the answer is $5$.", "5", (False, False, False, True)),
    (r"Hence \boxed {5}.", "5", (False, False, False, False)),  # bare text: math-verify does not read it either
    (r"We try $\boxed{\frac{1}{2}$. The answer is $\boxed{5}$.", "5", (True, True, False, True)),
]


def test_grading_under_each_rule_on_crafted_completions():
    mv = MathVerifier(num_workers=0, parse_timeout=5, verify_timeout=5)
    texts, golds = [t for t, _, _ in GRADED], [g for _, g, _ in GRADED]
    for k, rule in enumerate(("last_balanced", "paper_reward", "paper_eval", "math_verify")):
        got = [r.correct for r in mv.score(texts, golds, extraction=rule)]
        assert got == [e[k] for _, _, e in GRADED], rule
    res = mv.score([r"The roots are \boxed{2}, \boxed{3}.", "nothing here"], ["2, 3", "1"], extraction="math_verify")
    assert res[0].extracted and res[0].status == "ok"
    assert (res[1].correct, res[1].extracted, res[1].status) == (False, None, "no_answer")


# Hard-timeout tests: 5 s of wall time per answer leaves a real answer (milliseconds of CPU) room on a loaded machine;
# the debug hook's sleep of SLEEP_S never ends during a test, and "timeout" is only ever set by the pool's kill (a
# finished sleep reports "ok"): a "timeout" result proves the kill, with no wall-clock assertion.
POOL_HARD_S, SLEEP_S = 5.0, 600


@pytest.mark.slow  # four kills, each followed by a worker re-start (importing sympy): ~1 min on a busy machine
def test_hard_timeout_holds_in_every_mode():
    # The debug hook sleeps in the worker on answers starting with "__sleep__:"; with math_verify the whole
    # completion goes to the worker, with the box rules the extracted answer does.
    with MathVerifier(num_workers=2, hard_timeout_s=POOL_HARD_S, parse_timeout=1, verify_timeout=1,
                      _allow_debug=True) as mv:
        assert all(r.correct for r in mv.grade(["1", "2"], ["1", "2"]))  # start the workers
        for rule in RULES:
            text = f"__sleep__:{SLEEP_S}" if rule == "math_verify" else rf"\boxed{{__sleep__:{SLEEP_S}}}"
            (res,) = mv.score([text], ["1"], extraction=rule)
            assert (res.correct, res.status) == (False, "timeout"), rule
        assert mv.counters["timeout"] == len(RULES)
        assert mv.score([r"\boxed{7}"], ["7"], extraction="paper_eval")[0].correct  # the pool still grades


def test_hard_timeout_holds_for_boxed_and_whole_completion_grading():
    # The two messages a worker can get: an extracted answer (last_balanced, paper_reward and paper_eval) and a
    # whole completion (math_verify). Two warm workers: each kill leaves the other one ready, so no re-start wait.
    with MathVerifier(num_workers=2, hard_timeout_s=POOL_HARD_S, parse_timeout=1, verify_timeout=1,
                      _allow_debug=True) as mv:
        assert all(r.correct for r in mv.grade(["1", "2"], ["1", "2"]))
        for rule, text in [("paper_eval", rf"\boxed{{__sleep__:{SLEEP_S}}}"), ("math_verify", f"__sleep__:{SLEEP_S}")]:
            (res,) = mv.score([text], ["1"], extraction=rule)
            assert (res.correct, res.status) == (False, "timeout"), rule


# ---------------------------------------------------------------------------------------------- paper protocol


class _Tok:
    """Prompt i encodes as [i]; a completion's first token names its scripted text."""

    def __init__(self, texts):
        self.texts = texts

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[i] for i in range(len(texts))]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[t[0]] for t in ids]


class _Engine:
    """Problem i, sample j -> text script[i][j] with script_tokens[i][j] tokens."""

    def __init__(self, lengths):
        self.lengths = lengths

    def generate(self, prompts, params):
        from grail_exp.rollout.base import Completion

        return [Completion(p, [p[0] * params.n + j] * self.lengths[p[0]][j], None, False)
                for p in prompts for j in range(params.n)]


def test_paper_protocol_drops_empty_samples_and_averages_tokens_over_extracted(compose_cfg):
    from grail_exp.data.benchmarks import load_benchmark
    from grail_exp.evaluation import evaluate_benchmarks

    def run(extraction):
        cfg = compose_cfg(["model=octothinker_3b", "benchmark=paper", "benchmark.names=[math500]",
                           "benchmark.limit=3", "eval.n=3", "eval.n_boot=10", f"benchmark.extraction={extraction}"])
        g = [p.answer for p in load_benchmark("math500", cfg)]
        script = [  # (text, tokens) per sample of the three problems
            [(f"\\boxed{{{g[0]}}}", 10), ("", 1), ("no box", 30)],  # one empty sample: dropped by paper
            [("", 2), ("", 4), ("", 6)],                             # every sample empty: scores 0, no tokens
            [("\\boxed{wrong} \\boxed{", 20), (f"\\boxed{{1}} \\boxed{{ \\boxed{{{g[2]}}}", 40),
             (f"\\boxed{{{g[2]}}}", 50)],
        ]
        tok = _Tok([t for row in script for t, _ in row])
        with MathVerifier(num_workers=0) as mv:
            return evaluate_benchmarks(None, tok, _Engine([[n for _, n in row] for row in script]), mv, cfg)

    paper = run("paper").summaries["math500"]
    # problem 0: 2 samples counted (1 correct); problem 1: none -> 0; problem 2: 3 samples, paper_eval reads
    # "wrong", "1", g[2] -> 1 correct
    assert paper["acc"].value == pytest.approx((1 / 2 + 0 + 1 / 3) / 3)
    assert paper["pass_at_k"][3].value == pytest.approx(2 / 3)  # any correct among the remaining samples
    assert paper["mean_tokens"] == pytest.approx((10 + 20 + 40 + 50) / 4)  # extracted samples only
    assert paper["protocol"] == "paper"
    standard = run("last_balanced").summaries["math500"]
    # every sample counts; last_balanced reads g[2] in sample 2 of problem 2 too (the box after the unterminated one)
    assert standard["acc"].value == pytest.approx((1 / 3 + 0 + 2 / 3) / 3)
    assert standard["mean_tokens"] == pytest.approx((10 + 1 + 30 + 2 + 4 + 6 + 20 + 40 + 50) / 9)
