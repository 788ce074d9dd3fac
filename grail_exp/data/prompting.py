"""From a problem to the model's input tokens, per model family (recorded with every run and table).

- ``prompt_style: chat``: one user turn ``problem + instruction`` rendered with the tokenizer's chat
  template (``model.chat_template`` overrides it) and ``model.chat_template_kwargs`` — for Qwen3,
  ``enable_thinking: false`` (the GRAIL paper's non-thinking mode); no system turn unless configured.
- ``prompt_style: plain``: ``model.plain_template`` formatted with the problem — for base models
  without a chat template (OctoThinker *-Base).
- ``model.few_shot`` (default: none, zero-shot as in the GRAIL paper): worked examples shown before the problem,
  each ``{question, answer}``; with ``chat`` as earlier user / assistant turns (the instruction is appended to each
  example's question as to the problem's), with ``plain`` as filled-in templates separated by blank lines. Small
  instruct models (SmolLM2-135M, ``experiment=real/smollm2_*``) need them to write a ``\boxed{}`` answer at all.

BOS: the rendered text is encoded without adding special tokens (a chat template writes its own), then the
tokenizer's BOS goes in front where the tokenizer would add one to any text it encodes and the text does not already
start with it: Llama 3's ``<|begin_of_text|>`` (128000) for OctoThinker's plain prompts, as vLLM's and
``tokenizer(text)``'s own encoding give it; nothing for Qwen3 (no BOS) and nothing more for templates that write it
(R1-Distill-Llama, the embedded tokenizers). Evaluation tables record it (``eval.prompt_bos``).
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
    shots = [(str(ex["question"]) + instruction, str(ex["answer"])) for ex in (model_cfg.get("few_shot") or [])]
    if model_cfg.prompt_style == "plain":
        examples = "".join(model_cfg.plain_template.format(problem=q) + " " + a + "\n\n" for q, a in shots)
        return examples + model_cfg.plain_template.format(problem=content)
    messages = []
    if model_cfg.system_prompt:
        messages.append({"role": "system", "content": model_cfg.system_prompt})
    for q, a in shots:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
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


def bos_prefix(tokenizer) -> list[int]:
    """``[bos_token_id]`` when the tokenizer puts BOS in front of any text it encodes (Llama 3), else ``[]`` (Qwen3
    has no BOS; a tokenizer whose BOS only its chat template writes, or whose "BOS" is GPT-2's EOS, adds none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    return [bos] if tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [bos] else []


def encode_prompt_texts(texts: list[str], tokenizer) -> list[list[int]]:
    """Rendered prompts -> token ids: the text's own special tokens (a chat template's BOS / role tokens), plus BOS in
    front where the tokenizer adds one (``bos_prefix``) and the text does not already start with it — never twice."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    prefix = bos_prefix(tokenizer)
    return [prefix + x if prefix and x[:1] != prefix else x for x in ids]


def encode_prompts(questions: list[str], tokenizer, model_cfg, instruction: str = "") -> list[list[int]]:
    return encode_prompt_texts([render_prompt(q, tokenizer, model_cfg, instruction) for q in questions], tokenizer)


def prompt_bos(tokenizer, model_cfg, instruction: str = "") -> str:
    """How a prompt starts, for the evaluation protocol: ``<bos> (id N, added)``, ``<bos> (id N, in the template)`` or
    ``none`` (``unknown`` without a tokenizer)."""
    if tokenizer is None:
        return "unknown (no tokenizer)"
    text = render_prompt("{problem}", tokenizer, model_cfg, instruction)
    ids = encode_prompt_texts([text], tokenizer)[0]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or ids[:1] != [bos]:
        return "none"
    written = tokenizer(text, add_special_tokens=False)["input_ids"][:1] == [bos]
    return f"{tokenizer.bos_token} (id {bos}, {'in the template' if written else 'added'})"
