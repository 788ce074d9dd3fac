"""Scheme batches built in a test: tokenised rows of a few arithmetic problems, as the trainer or the weights CLI
hands them to a token-weight scheme or a loss term.

``rows_of`` / ``batch_of``: (question, completion text, advantage) items -> the weights CLI's rows -> a SchemeBatch.
``problem_batch`` of ``PROBLEM_ROWS``: rows that also carry the problem and its gold answer (what a privileged teacher
reads), prompts rendered with ``CHAT_MODEL_CFG`` (the chat template, thinking off).
``interleaved_training_batch``: a trainer batch whose groups share prompts, interleaved in the batch order.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

CHAT_MODEL_CFG = OmegaConf.create({"prompt_style": "chat", "system_prompt": None, "chat_template": None,
                                   "chat_template_kwargs": {"enable_thinking": False}, "name_or_path": "tiny"})
# (problem, gold answer, completion text, advantage); the last two completions end without the end-of-turn token
PROBLEM_ROWS = [("Compute 7+5-3.", "9", "7+5=12. 12-3=9. \\boxed{9}<|im_end|>", -0.5),
                ("Compute 2+2.", "4", "2+2=4. \\boxed{4}<|im_end|>", 0.5),
                ("Compute 13+8.", "21", "13+8=21. \\boxed{21}", 1.0),
                ("Compute 3+3.", "6", "3+3=7.", 0.0)]


def rows_of(tok, items):
    """items: (question, completion text, advantage) -> rows as the weights CLI reads them."""
    rows = []
    for q, completion, adv in items:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=False, enable_thinking=False)
        rows.append({"prompt_ids": tok(prompt, add_special_tokens=False)["input_ids"],
                     "completion_ids": tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                     "advantage": adv})
    return rows


def batch_of(tok, rows, seed=0):
    """The weights CLI's SchemeBatch of ``rows`` (``rows_of``), with the completions' texts."""
    from grail_exp.weights import scheme_batch

    b = scheme_batch(rows, tok.pad_token_id, "cpu", 1.0, torch.Generator().manual_seed(seed))
    b.completion_texts = tok.batch_decode([r["completion_ids"] for r in rows], skip_special_tokens=True)
    return b


def problem_batch(tok, rows, step=0):
    """A SchemeBatch like the trainer's from (problem, answer, completion text, advantage) rows."""
    from grail_exp.advantages import SchemeBatch
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.rollout import Completion, pad_completions

    prompts = encode_prompts([r[0] for r in rows], tok, CHAT_MODEL_CFG)
    comps = [tok(r[2], add_special_tokens=False)["input_ids"] for r in rows]
    rb = pad_completions([Completion(p, c, None, False) for p, c in zip(prompts, comps)], tok.pad_token_id)
    attn = torch.cat([rb.prompt_mask, rb.completion_mask], 1)
    return SchemeBatch(
        input_ids=torch.cat([rb.prompt_ids, rb.completion_ids], 1), attention_mask=attn,
        position_ids=position_ids_from_mask(attn), prompt_length=rb.prompt_ids.shape[1],
        completion_ids=rb.completion_ids, completion_mask=rb.completion_mask.float(),
        advantages=torch.tensor([r[3] for r in rows]), rewards=torch.tensor([float(r[3] > 0) for r in rows]),
        problems=[r[0] for r in rows], gold_answers=[r[1] for r in rows], step=step,
        row_index=torch.arange(len(rows)))


# (prompt index, completion, reward): three prompts (a batch whose rows share prompts), groups interleaved and of unequal size in the batch order.
INTERLEAVED_QUESTIONS = [("Compute 12+7-5.", "14"), ("Compute 3+4.", "7"), ("Compute 100-8+3-1.", "94")]
INTERLEAVED_ROWS = [
    (0, "12+7=19. 19-5=14. \\boxed{14}", 1.0),
    (1, "3+4=7. \\boxed{7}", 1.0),
    (0, "12+7=19. 19-5=13. \\boxed{13}", 0.0),
    (2, "100-8=92. 92+3=95. 95-1=94. \\boxed{94}", 1.0),
    (1, "3+4=8, so \\boxed{8} ok", 0.0),
    (0, "12+7=18. \\boxed{12}", 0.0),
    (2, "100-8=92. \\boxed{93}", 0.0),
    (0, "12+7=19. 19-5=14.", 0.0),
]


# A system turn every prompt starts with: with it the three prompts share a prefix of ~40 tokens (as a system prompt or
# few-shot turns give real runs), which the forwards compute once (trainer.share_prompt_prefix).
COMMON_SYSTEM = ("You are a careful arithmetic tutor. Work through the operations from left to right, one at a time, "
                 "and put the final number in \\boxed{}.")


def interleaved_training_batch(tok, system: str | None = None):
    """A TrainingBatch of ``INTERLEAVED_ROWS``: left-padded prompts of three lengths, groups interleaved and of
    unequal size, advantages = reward minus the group mean. ``system``: a system turn before each question."""
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.rollout import Completion, pad_completions
    from grail_exp.training.batch import TrainingBatch

    comps = []
    for q, text, _ in INTERLEAVED_ROWS:
        turns = [{"role": "system", "content": system}] if system else []
        prompt = tok.apply_chat_template([*turns, {"role": "user", "content": INTERLEAVED_QUESTIONS[q][0]}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        comps.append(Completion(p, tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], None, False))
    rb = pad_completions(comps, tok.pad_token_id)
    assert len(set(rb.prompt_mask.sum(1).tolist())) == 3  # three prompt lengths: left padding differs by row
    group = torch.tensor([q for q, _, _ in INTERLEAVED_ROWS])
    rewards = torch.tensor([r for *_, r in INTERLEAVED_ROWS])
    means = torch.stack([rewards[group == g].mean() for g in range(3)])
    attn = rb.attention_mask
    return TrainingBatch(rb.input_ids, attn, position_ids_from_mask(attn), rb.prompt_ids.shape[1], rb.completion_ids,
                         rb.completion_mask.float(), rewards - means[group], rewards, [t for _, t, _ in INTERLEAVED_ROWS],
                         group_ids=group, problems=[INTERLEAVED_QUESTIONS[q][0] for q, _, _ in INTERLEAVED_ROWS],
                         golds=[INTERLEAVED_QUESTIONS[q][1] for q, _, _ in INTERLEAVED_ROWS], order=torch.arange(len(INTERLEAVED_ROWS)))
