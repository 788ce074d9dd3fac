"""Generation engines behind one protocol (``RolloutEngine``)."""

from __future__ import annotations

from grail_exp.rollout.base import Completion, RolloutBatch, RolloutEngine, SamplingParams, pad_completions

ENGINES = ("hf", "vllm")


def build_engine(name: str, model, tokenizer, batch_size: int = 256) -> RolloutEngine:
    """Instantiate the engine named by ``rollout.engine``."""
    if name == "hf":
        from grail_exp.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tokenizer, batch_size=batch_size)
    if name == "vllm":
        raise NotImplementedError(
            "rollout=vllm is not available in this version: the vLLM engine lands with the scale-out issue. "
            "Use rollout=hf (transformers generate), which runs on CPU and GPU."
        )
    if ":" in name:  # a plug-in engine: "package.module:ClassName" with the same constructor
        import importlib

        module_name, cls_name = name.split(":", 1)
        return getattr(importlib.import_module(module_name), cls_name)(model, tokenizer, batch_size=batch_size)
    raise ValueError(f"rollout.engine must be one of {ENGINES} or 'package.module:ClassName', got {name!r}")


__all__ = ["Completion", "RolloutBatch", "RolloutEngine", "SamplingParams", "build_engine", "pad_completions"]
