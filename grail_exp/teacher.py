"""The privileged teacher: the same model conditioned on the reference answer, scoring the student's completion.

Used by RLSD (``advantage=rlsd``, arXiv 2604.03128: the teacher's log-probs of the sampled tokens) and SDPG
(``loss.terms.sdpg_opd``, arXiv 2606.04036: the teacher's full-vocabulary distributions, chunk by chunk).

    teacher prompt  = render( template.format(problem=q, answer=a, instruction=data.instruction) )
    teacher input   = teacher prompt ⊕ the student's completion tokens o_1 … o_C
    log P_T(o_t)    = log softmax( h^T_t · Wᵀ / T )[o_t]         h^T_t: teacher hidden state predicting o_t

The teacher prompt goes through the model's chat template (or ``model.plain_template``) exactly like the student
prompt (``grail_exp/data/prompting.py``), so the only difference between the two contexts is the template text.
Teacher prompts are left-padded to their own width P', the completion is appended right-padded with the student's
completion mask, and positions come from the attention mask as in ``generate``: the teacher sees the same
completion tokens at the same offsets from its own prompt.

Templates (``TEMPLATES``; a config may also give a literal string with ``{problem}`` / ``{answer}`` /
``{instruction}`` fields):
- ``rlsd``: the official ``teacher_hint_self_distill.jinja`` text (question, "Here is a reference solution:", the
  answer, "After understanding the reference solution, please try to solve this problem using your own approach
  below."). Its format sentence (``<thought>`` / ``<answer>`` tags, a multimodal-benchmark format) is replaced by
  the run's own ``data.instruction``, so teacher and student are asked for the same answer format (CHOSEN).
- ``sdpg``: SDPG's privileged context, as its README gives it: "The correct answer to this problem is: {answer}",
  a newline, "Use this to verify your reasoning, but show your full solution process." The official data loader
  (``rl_dataset._split_teacher_context``) gives the teacher the actor's user message (problem and answer-format
  instruction) with the context appended in the same message; the separator between the two is inside the
  (unreleased) dataset file, and here it is a blank line (CHOSEN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.compute.forward import body_forward, output_layer
from grail_exp.errors import ConfigError

TEMPLATES = {
    "rlsd": ("{problem}\n\nHere is a reference solution:\n{answer}\n\nAfter understanding the reference solution, "
             "please try to solve this problem using your own approach below.{instruction}"),
    "sdpg": ("{problem}{instruction}\n\nThe correct answer to this problem is: {answer}\nUse this to verify your "
             "reasoning, but show your full solution process."),
}


def template_text(template: str) -> str:
    """A named template (``TEMPLATES``) or a literal one (must contain ``{answer}``)."""
    if template in TEMPLATES:
        return TEMPLATES[template]
    if "{answer}" not in template:
        raise ConfigError(f"teacher template {template!r}: not one of {', '.join(TEMPLATES)} and has no {{answer}} field")
    return template


def check_template(key: str, template: str) -> list[str]:
    """Config-check helper: problems with a template value, as ``"<key> = <value>: <why>"``."""
    try:
        text = template_text(template)
        text.format(problem="q", answer="a", instruction="i")
    except (ValueError, KeyError, IndexError) as exc:
        return [f"{key} = {template!r}: {exc}"]
    return []


def teacher_prompt_texts(problems: list[str], answers: list[str], tokenizer, model_cfg, template: str,
                         instruction: str = "") -> list[str]:
    """The rendered teacher prompts (special tokens included, like ``render_prompt``'s student prompts)."""
    from grail_exp.data.prompting import render_prompt

    text = template_text(template)
    out = []
    for q, a in zip(problems, answers):
        content = text.format(problem=str(q).strip(), answer=str(a).strip(), instruction=instruction or "")
        out.append(render_prompt(content, tokenizer, model_cfg, instruction=""))
    return out


@dataclass
class TeacherBatch:
    input_ids: torch.Tensor  # (B, P'+C) teacher prompt ⊕ the student's completion
    attention_mask: torch.Tensor  # (B, P'+C)
    position_ids: torch.Tensor  # (B, P'+C)
    prompt_length: int  # P'
    completion_ids: torch.Tensor  # (B, C) the student's tokens (same as the student batch)


def build_teacher_batch(batch, tokenizer, model_cfg, template: str, instruction: str = "") -> TeacherBatch:
    """The teacher's inputs for a ``SchemeBatch`` (which must carry ``problems`` and ``gold_answers``)."""
    if batch.problems is None or batch.gold_answers is None:
        raise ValueError("the privileged teacher needs the problem text and gold answer of every row "
                         "(SchemeBatch.problems / gold_answers; weights CLI: 'problem' and 'answer' fields)")
    from grail_exp.data.prompting import encode_prompt_texts

    texts = teacher_prompt_texts(batch.problems, batch.gold_answers, tokenizer, model_cfg, template, instruction)
    ids = encode_prompt_texts(texts, tokenizer)  # BOS as the student's prompts
    B, C = batch.completion_ids.shape
    P = max(len(x) for x in ids)
    device = batch.completion_ids.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt = torch.full((B, P), pad, dtype=torch.long, device=device)
    pmask = torch.zeros((B, P), dtype=batch.attention_mask.dtype, device=device)
    for i, x in enumerate(ids):
        prompt[i, P - len(x):] = torch.tensor(x, dtype=torch.long, device=device)
        pmask[i, P - len(x):] = 1
    cmask = batch.attention_mask[:, batch.prompt_length:]  # the student's generated tokens
    attn = torch.cat([pmask, cmask], dim=1)
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    return TeacherBatch(torch.cat([prompt, batch.completion_ids], dim=1), attn, pos, P, batch.completion_ids)


@torch.no_grad()
def teacher_hidden(model, tb: TeacherBatch, share_prompts: bool = False) -> torch.Tensor:
    """(B, C, d) the teacher's last hidden states at the positions predicting the completion tokens (no grad); the
    rows of one problem share their teacher prompt, computed once with ``share_prompts``.
    Logits are never built here: RLSD picks the sampled tokens' log-probs, SDPG projects chunk by chunk."""
    fwd = body_forward(model, tb.input_ids, tb.attention_mask, tb.position_ids, tb.prompt_length,
                       share_prompts=share_prompts)
    return fwd.predicting(fwd.hidden)


@torch.no_grad()
def teacher_logprobs(model, tb: TeacherBatch, temperature: float = 1.0, chunk_tokens: int = 4096,
                     share_prompts: bool = False) -> torch.Tensor:
    """(B, C) float32 log P_T(o_t) of the sampled tokens, with (chunk, V) logits alive at a time."""
    from grail_exp.compute.logprobs import linear_logprob

    weight, bias = output_layer(model)
    logp, _ = linear_logprob(teacher_hidden(model, tb, share_prompts), weight, bias, tb.completion_ids, temperature,
                             chunk_tokens)
    return logp
