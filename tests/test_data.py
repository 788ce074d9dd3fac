"""The arithmetic task, prompt building and the embedded tokenizers."""

import pytest

from grail_exp.data.arithmetic import ArithmeticTask


def _evaluate_left_to_right(question: str) -> int:
    expr = question.removeprefix("Compute ").removesuffix(".")
    import re

    tokens = re.findall(r"\d+|[+\-*]", expr)
    value = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        value = {"+": value + int(num), "-": value - int(num), "*": value * int(num)}[op]
    return value


def test_solutions_are_correct_and_step_by_step():
    task = ArithmeticTask()
    for p in task.train_problems(0, 200):
        assert int(p.answer) == _evaluate_left_to_right(p.question)
        assert p.solution.endswith(f"\\boxed{{{p.answer}}}")
        steps = p.solution.split(" \\boxed")[0].split(". ")
        assert task.min_steps <= len(steps) <= task.max_steps
        assert int(p.answer) >= 0


def test_deterministic_and_disjoint_splits():
    a, b = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
    assert a.split("test") == b.split("test") and a.train_problems(0, 50) == b.train_problems(0, 50)
    assert ArithmeticTask(seed=8).split("test") != a.split("test")
    test_q = {p.question for p in a.split("test")}
    val_q = {p.question for p in a.split("validation")}
    assert len(test_q) == a.num_test and not (test_q & val_q)
    assert not any(p.question in test_q | val_q for p in a.train_problems(0, 3000))


def test_difficulty_knobs():
    t = ArithmeticTask(min_steps=4, max_steps=4, max_operand=9, operators="+*")
    for p in t.train_problems(0, 50):
        assert p.solution.count("=") == 4
        assert "-" not in p.question


def test_bad_knobs_name_the_key():
    with pytest.raises(ValueError, match="data.min_steps"):
        ArithmeticTask(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="data.operators"):
        ArithmeticTask(operators="/")


def test_qwen_tokenizer_is_deterministic_with_chat_template(tiny_tokenizer):
    from grail_exp.models.embedded import build_tokenizer

    again = build_tokenizer("qwen", ArithmeticTask())
    assert again.get_vocab() == tiny_tokenizer.get_vocab()
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "Compute 1+2."}], add_generation_prompt=True,
                                              tokenize=False, enable_thinking=False)
    assert text == "<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"
    ids = tiny_tokenizer("12345", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # digits are single tokens
    s = "héllo 日本 \\frac{1}{2} \\boxed{42}."
    assert tiny_tokenizer.decode(tiny_tokenizer(s, add_special_tokens=False)["input_ids"]) == s


def test_llama_tokenizer_byte_fallback_and_template():
    from grail_exp.models.embedded import build_tokenizer

    tok = build_tokenizer("llama", ArithmeticTask())
    s = "héllo 日本 \\frac{1}{2} \\boxed{42}."
    assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 1+2."}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.startswith("<s><|start_header_id|>user<|end_header_id|>") and tok.eos_token == "<|eot_id|>"


def test_prompt_styles(tiny_tokenizer):
    from omegaconf import OmegaConf

    from grail_exp.data.prompting import PAPER_INSTRUCTION, PAPER_INSTRUCTION_REFERENCE_BYTES, render_prompt

    chat = OmegaConf.create({"prompt_style": "chat", "chat_template": None, "chat_template_kwargs": {"enable_thinking": False},
                             "system_prompt": None, "plain_template": "Q: {problem}\nA:", "name_or_path": "x"})
    assert render_prompt("Compute 1+2.", tiny_tokenizer, chat, PAPER_INSTRUCTION).count("\\boxed{}") == 1
    plain = OmegaConf.merge(chat, {"prompt_style": "plain"})
    assert render_prompt("Compute 1+2.", tiny_tokenizer, plain) == "Q: Compute 1+2.\nA:"
    assert "\x08oxed" in PAPER_INSTRUCTION_REFERENCE_BYTES  # the reference's backspace quirk (spec §11.13)


def test_few_shot_examples_come_before_the_problem_in_both_styles(tiny_tokenizer, tmp_path):
    from omegaconf import OmegaConf

    from grail_exp.config import ConfigError
    from grail_exp.data.prompting import render_prompt
    from grail_exp.validate import validate
    from helpers.compose import compose

    shots = [{"question": "Compute 1+1.", "answer": "1+1=2. \\boxed{2}"}]
    chat = OmegaConf.create({"prompt_style": "chat", "chat_template": None, "chat_template_kwargs": {"enable_thinking": False},
                             "system_prompt": None, "plain_template": "Q: {problem}\nA:", "name_or_path": "x",
                             "few_shot": shots})
    text = render_prompt("Compute 3+4.", tiny_tokenizer, chat, " Go.")
    # the examples are earlier turns, the instruction appended to their questions as to the problem's
    assert text == tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 1+1. Go."}, {"role": "assistant", "content": "1+1=2. \\boxed{2}"},
         {"role": "user", "content": "Compute 3+4. Go."}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False)
    assert text.index("1+1=2. \\boxed{2}") < text.index("Compute 3+4. Go.")
    plain = OmegaConf.merge(chat, {"prompt_style": "plain"})
    assert render_prompt("Compute 3+4.", tiny_tokenizer, plain) == \
        "Q: Compute 1+1.\nA: 1+1=2. \\boxed{2}\n\nQ: Compute 3+4.\nA:"
    with pytest.raises(ConfigError, match=r"model.few_shot\[0\] = .*must be a mapping with 'question' and 'answer'"):
        validate(compose(["model.few_shot=[{question: a}]"], tmp_path))


def test_hub_source_from_local_jsonl(tmp_path):
    import json

    from omegaconf import OmegaConf

    from grail_exp.data import build_source

    f = tmp_path / "dm.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"What is {i}+1?"}], "solution": str(i + 1)} for i in range(5)]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = OmegaConf.create({"name": "deepmath", "path": str(f), "revision": None, "split": "train",
                            "problem_field": "prompt", "answer_field": "solution", "shuffle_seed": 42})
    src = build_source(cfg)
    seen = {src[i].question for i in range(5)}
    assert seen == {f"What is {i}+1?" for i in range(5)}
    assert src[0] == src[5]  # cycles deterministically
    bad = OmegaConf.merge(cfg, {"answer_field": "answer"})
    with pytest.raises(ValueError, match="answer"):
        build_source(bad)
