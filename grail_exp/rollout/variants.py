"""Sampling a group from several prompts of one problem (``PromptVariant``s, e.g. SCRL's curriculum + original).

The engine protocol samples the same ``n`` for every prompt, so variants are sampled in one ``generate`` call per
distinct ``n`` and put back in plan order: problem by problem, variant by variant (each group stays contiguous).
"""

from __future__ import annotations

from dataclasses import replace

from grail_exp.data.prompting import encode_prompts
from grail_exp.rollout.base import Completion, SamplingParams


def sample_variants(engine, tokenizer, model_cfg, instruction: str, plan, params: SamplingParams,
                    ) -> tuple[list[Completion], list]:
    """Completions in plan order and, per completion, the ``info`` of the variant it answered."""
    flat = [v for problem in plan for v in problem]
    prompts = [encode_prompts([v.question], tokenizer, model_cfg, instruction if v.instruction else "")[0]
               for v in flat]
    by_n: dict[int, list[int]] = {}
    for k, v in enumerate(flat):
        by_n.setdefault(v.n, []).append(k)
    sampled: dict[int, list[Completion]] = {}
    for n, ks in by_n.items():
        out = engine.generate([prompts[k] for k in ks], replace(params, n=n))
        for j, k in enumerate(ks):
            sampled[k] = out[j * n:(j + 1) * n]
    completions, infos = [], []
    for k, v in enumerate(flat):
        completions += sampled[k]
        infos += [v.info] * v.n
    return completions, infos
