"""The HF rollout engine: shapes, stop tokens, truncation flags, sampling log-probs."""

import torch

from grail_exp.loss import selective_log_softmax
from grail_exp.module import completion_logits, position_ids_from_mask
from grail_exp.rollout import SamplingParams, build_engine, pad_completions


def _prompts(tok, n=3):
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Compute {i}+{i * 7}."}], add_generation_prompt=True,
                                     tokenize=False, enable_thinking=False) for i in range(n)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def test_generate_layout_and_truncation(tiny_model, tiny_tokenizer):
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer)
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12))
    assert len(out) == 12
    stops = {tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id}
    for i, c in enumerate(out):
        assert c.prompt_ids == prompts[i // 4]  # prompt-major order
        assert len(c.logprobs) == len(c.token_ids) <= 12
        if c.truncated:
            assert len(c.token_ids) == 12 and not (set(c.token_ids) & stops)
        else:
            assert c.token_ids[-1] in stops and not (set(c.token_ids[:-1]) & stops)
    assert tiny_model.training  # engine restores the mode


def test_sampling_logprobs_match_trainer_forward(tiny_model, tiny_tokenizer):
    """Sampler-vs-trainer log-probs agree (same positions, temperature-scaled logits)."""
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    torch.manual_seed(1)
    out = engine.generate(_prompts(tiny_tokenizer), SamplingParams(n=2, temperature=0.7, max_new_tokens=10))
    rb = pad_completions(out, tiny_tokenizer.pad_token_id)
    attn = rb.attention_mask
    with torch.no_grad():
        logits = completion_logits(tiny_model.eval(), rb.input_ids, attn, position_ids_from_mask(attn),
                                   rb.completion_ids.shape[1], 0.7)
    logp = selective_log_softmax(logits, rb.completion_ids)
    m = rb.completion_mask.bool()
    assert torch.allclose(logp[m], rb.sampling_logprobs[m], atol=1e-4)


def test_greedy_is_deterministic(tiny_model, tiny_tokenizer):
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    p = _prompts(tiny_tokenizer, 2)
    a = engine.generate(p, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    b = engine.generate(p, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_pad_completions_layout():
    from grail_exp.rollout import Completion

    rb = pad_completions([Completion([5, 6], [1, 2, 3], [-.1, -.2, -.3], False),
                          Completion([7], [4], [-.4], True)], pad_id=0)
    assert rb.prompt_ids.tolist() == [[5, 6], [0, 7]] and rb.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert rb.completion_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert rb.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert rb.is_truncated.tolist() == [False, True]
    assert rb.input_ids.shape == (2, 5)


def test_vllm_engine_is_a_clear_error(tiny_model, tiny_tokenizer):
    import pytest

    with pytest.raises(NotImplementedError, match="rollout=hf"):
        build_engine("vllm", tiny_model, tiny_tokenizer)
