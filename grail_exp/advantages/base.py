"""Registry and the scheme contract shared by every advantage scheme."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

SCHEMES: dict[str, type["AdvantageScheme"]] = {}


@dataclass
class SchemeBatch:
    """One micro-batch as a scheme sees it. P = padded prompt width, C = padded completion width.

    Prompts are left-padded and completions right-padded, so ``input_ids[:, P:]`` is the completion
    window and ``input_ids[:, P-1:-1]`` are the input positions that *predict* the completion tokens.
    """

    input_ids: torch.Tensor  # (B, P+C) prompt ++ completion
    attention_mask: torch.Tensor  # (B, P+C) 1 on real prompt and generated completion tokens
    position_ids: torch.Tensor  # (B, P+C) cumsum(attention_mask) - 1: the positions generate() used
    prompt_length: int  # P
    completion_ids: torch.Tensor  # (B, C)
    completion_mask: torch.Tensor  # (B, C) loss mask: generated tokens up to EOS, 0 for masked truncations
    advantages: torch.Tensor  # (B,) sequence advantages A_i
    rewards: torch.Tensor  # (B,)
    completion_texts: list[str] | None = None  # decoded completions (special tokens skipped)
    sampling_temperature: float = 1.0  # the rollout temperature (GRAIL's probe divides its logits by it)
    generator: torch.Generator | None = None  # seeded RNG for stochastic schemes (OAR-G noise)


@dataclass
class SchemeOutput:
    weights: torch.Tensor  # (B, C), detached, > 0 on valid tokens
    metrics: dict[str, float] = field(default_factory=dict)  # logged as "<scheme>/<key>"


class AdvantageScheme:
    """Base class. Subclasses set ``name`` / ``config_class`` and implement ``weights``."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    # False for schemes that never look at the model (GRPO): the trainer can skip work for them.
    needs_model: ClassVar[bool] = True

    def __init__(self, cfg, tokenizer=None):
        self.cfg = cfg
        self.tokenizer = tokenizer

    @staticmethod
    def check_config(cfg) -> list[str]:
        """Problems with the scheme's config, each as ``"<key> = <value>: <why>"``; empty if valid."""
        return []

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        raise NotImplementedError

    def spans(self, batch: SchemeBatch):
        """The answer-span token masks of the batch, with this scheme's ``span_mapping`` and ``box`` switches."""
        from grail_exp.advantages.spans import answer_spans

        return answer_spans(batch.completion_ids, batch.completion_mask, self.tokenizer,
                            span_mapping=self.cfg.span_mapping, box=self.cfg.box, texts=batch.completion_texts)


def register_scheme(name: str, config_class: type) -> Callable[[type[AdvantageScheme]], type[AdvantageScheme]]:
    """Class decorator: ``@register_scheme("grail", GrailConfig)``."""

    def deco(cls: type[AdvantageScheme]) -> type[AdvantageScheme]:
        if name in SCHEMES:
            raise ValueError(f"advantage scheme {name!r} registered twice")
        cls.name, cls.config_class = name, config_class
        SCHEMES[name] = cls
        return cls

    return deco


def scheme_config_class(name: str) -> type:
    return SCHEMES[name].config_class


def build_scheme(cfg, tokenizer=None) -> AdvantageScheme:
    if cfg.name not in SCHEMES:
        raise KeyError(f"unknown advantage scheme {cfg.name!r}; valid: {', '.join(sorted(SCHEMES))}")
    return SCHEMES[cfg.name](cfg, tokenizer)
