"""From a problem to the model's input tokens, per model family (recorded with every run and table).

- ``prompt_style: chat``: one user turn ``problem + instruction`` rendered with the tokenizer's chat
  template (``model.chat_template`` overrides it) and ``model.chat_template_kwargs`` — for Qwen3,
  ``enable_thinking: false`` (the GRAIL paper's non-thinking mode); no system turn unless configured.
- ``prompt_style: plain``: ``model.plain_template`` formatted with the problem — for base models
  without a chat template (OctoThinker *-Base).
"""

from __future__ import annotations

from grail_exp.errors import ConfigError

PAPER_INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."
# The reference code builds the instruction in a non-raw Python string, so "\b" became a backspace
# (method spec §11.13). experiment=paper/* configs use this to reproduce the prompt byte for byte.
PAPER_INSTRUCTION_REFERENCE_BYTES = " Please reason step by step, and put your final answer within \boxed{}."


def render_prompt(question: str, tokenizer, model_cfg, instruction: str = "") -> str:
    """The prompt text for one problem (special tokens included, ready to encode without adding more)."""
    content = question + instruction
    if model_cfg.prompt_style == "plain":
        return model_cfg.plain_template.format(problem=content)
    messages = []
    if model_cfg.system_prompt:
        messages.append({"role": "system", "content": model_cfg.system_prompt})
    messages.append({"role": "user", "content": content})
    kwargs = dict(model_cfg.chat_template_kwargs or {})
    if model_cfg.chat_template:
        kwargs["chat_template"] = model_cfg.chat_template
    if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in kwargs:
        raise ConfigError(
            f"the tokenizer of {model_cfg.name_or_path!r} has no chat template; set model.chat_template "
            "or use model.prompt_style=plain"
        )
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def encode_prompts(questions: list[str], tokenizer, model_cfg, instruction: str = "") -> list[list[int]]:
    texts = [render_prompt(q, tokenizer, model_cfg, instruction) for q in questions]
    # The rendered text already contains BOS / role tokens: adding special tokens again would double BOS.
    return tokenizer(texts, add_special_tokens=False)["input_ids"]
