"""Policy / reference / tokenizer loading.

``model.name_or_path`` is a hub id (loaded with its pinned ``revision``) or a local Hugging Face
directory; null builds (once, then cached) the embedded model of ``model.build``. Loading is safe by
default: safetensors only, ``trust_remote_code=false`` unless the config says otherwise.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says what to fix."""


def _looks_local(name: str) -> bool:
    """A filesystem path (existing, or written like one) rather than a hub id such as ``Qwen/Qwen3-4B``."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def resolve_model_path(cfg) -> str:
    """The directory or hub id to load; builds the embedded model when ``model.name_or_path`` is null."""
    m = cfg.model
    if m.name_or_path is None:
        from omegaconf import OmegaConf

        from grail_exp.data import arithmetic_task
        from grail_exp.data.sources import DataConfigLike
        from grail_exp.embedded import ensure_embedded_model

        # The warm start trains on the same task distribution the run trains on.
        task = arithmetic_task(cfg.data if cfg.data.name == "arithmetic" else DataConfigLike())
        path = ensure_embedded_model(
            build=OmegaConf.to_container(m.build, resolve=True),
            warm=OmegaConf.to_container(m.warm_start, resolve=True) if m.warm_start else {"enabled": False},
            task=task,
            chat_template_kwargs=OmegaConf.to_container(m.chat_template_kwargs, resolve=True) or {},
            instruction=cfg.data.instruction if cfg.data.name == "arithmetic" else "",
            cache_dir=cfg.paths.cache_dir,
        )
        return str(path)
    name = str(m.name_or_path)
    if _looks_local(name):
        p = Path(name).expanduser()
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"model.name_or_path={name!r}: no Hugging Face model there (expected {p / 'config.json'}). "
                "Point it at a directory written by save_pretrained (e.g. a run's checkpoints/step-N/)."
            )
        return str(p)
    return name


def _hub_error(name: str, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"cannot load {name!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
        "If this is a hub id, this machine may be offline: download it where the hub is reachable "
        "(huggingface-cli download ...) and set model.name_or_path=<local dir>, or set HF_HUB_OFFLINE=1 "
        "to use the local cache."
    )


def load_tokenizer(path: str, cfg):
    from transformers import AutoTokenizer

    m = cfg.model
    try:
        tok = AutoTokenizer.from_pretrained(path, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _hub_error(path, exc) from exc
    if tok.pad_token is None:  # Llama-3 tokenizers ship without one; pad with EOS (masked everywhere)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if m.chat_template:
        tok.chat_template = m.chat_template
    return tok


def load_causal_lm(path: str, cfg, *, trainable: bool):
    """The policy (``trainable=True``) or a frozen copy (reference model)."""
    from transformers import AutoModelForCausalLM

    m = cfg.model
    kwargs = dict(revision=m.revision, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code,
                  use_safetensors=True)
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise _hub_error(path, exc) from exc
    # Dropout makes log-prob ratios noisy and is off in the paper's recipe.
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    if trainable:
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # from_pretrained returns eval mode
    else:
        model.eval().requires_grad_(False)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
