"""GRPO: every token of a rollout carries the sequence advantage (w = 1).

DeepSeekMath (Shao et al. 2024, arXiv 2402.03300, §4.1.2 "outcome supervision"): Â_{i,t} = A_i.
This is the baseline the GRAIL paper compares against (method spec §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.advantages.base import (
    AdvantageScheme,
    SchemeBatch,
    SchemeConfig,
    SchemeOutput,
    check_common,
    register_scheme,
)


@dataclass
class GRPOConfig(SchemeConfig):
    name: str = "grpo"


@register_scheme("grpo", GRPOConfig)
class GRPOScheme(AdvantageScheme):
    needs_model = False

    @staticmethod
    def check_config(cfg) -> list[str]:
        return check_common(cfg)

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        return SchemeOutput(torch.ones_like(batch.completion_mask, dtype=torch.float32))
