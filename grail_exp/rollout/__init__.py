"""Generation engines behind one protocol (``RolloutEngine``)."""

from __future__ import annotations

from grail_exp.errors import ConfigError
from grail_exp.rollout.base import Completion, RolloutBatch, RolloutEngine, SamplingParams, pad_completions

ENGINES = ("hf", "vllm")


def build_engine(name: str, model, tokenizer, batch_size: int = 256, *, cfg=None,
                 model_path: str | None = None, push_policy: bool = True) -> RolloutEngine:
    """Instantiate the engine named by ``rollout.engine``.

    ``rollout=hf`` samples from ``model`` itself; under ``peft=lora peft.sync=merged`` from a merged copy of its adapted
    layers (``HFMergedLoraEngine``), filled from ``model`` when ``push_policy``.
    ``rollout=vllm`` keeps its own copy of the weights: it is built from ``model_path``'s config (the directory or hub
    id the policy was loaded from; a checkpoint on resume) with the knobs of ``cfg.rollout.vllm`` and dummy weights —
    it reads no weights file — then gets ``model``'s weights pushed (``push_policy``; the training job skips it: it
    syncs before every rollout and evaluation, from a policy that may be sharded by then; the engine refuses to
    generate before the first). Built inside a process group, it joins it (one engine per rank).
    """
    if name == "hf":
        from grail_exp.rollout.hf import HFRolloutEngine

        draw = cfg.rollout.get("draw", "multinomial") if cfg is not None else "multinomial"
        common = (cfg.get("trainer") or {}).get("share_prompt_prefix", "auto") if cfg is not None else "auto"
        if cfg is not None and merged_lora(cfg):
            from grail_exp.rollout.hf import HFMergedLoraEngine

            engine = HFMergedLoraEngine(model, tokenizer, batch_size=batch_size, draw=draw, common_prefix=common)
            if push_policy:
                engine.sync_weights(model)
            return engine
        return HFRolloutEngine(model, tokenizer, batch_size=batch_size, draw=draw, common_prefix=common)
    if name == "vllm":
        if cfg is None or model_path is None:
            raise ValueError("build_engine('vllm', ...) needs cfg= (for rollout.vllm) and model_path= (where to start)")
        from grail_exp.rollout.vllm import build_vllm_engine  # imports vllm lazily: a clear error when missing

        engine = build_vllm_engine(model_path, tokenizer, cfg, batch_size=batch_size)
        if push_policy:
            engine.sync_weights(model)  # the live policy, not the directory, is what samples
        return engine
    if ":" in name:  # a plug-in engine: "package.module:ClassName" with the same constructor
        import importlib

        module_name, cls_name = name.split(":", 1)
        return getattr(importlib.import_module(module_name), cls_name)(model, tokenizer, batch_size=batch_size)
    raise ConfigError(f"rollout.engine must be one of {ENGINES} or 'package.module:ClassName', got {name!r}")


def merged_lora(cfg) -> bool:
    """``peft=lora`` with ``peft.sync=merged``: the HF engine samples from a merged copy of the adapted layers."""
    from grail_exp.models import lora

    return lora.enabled(cfg) and str(cfg.peft.get("sync", "adapter")) == "merged"


__all__ = ["Completion", "RolloutBatch", "RolloutEngine", "SamplingParams", "build_engine", "pad_completions"]
