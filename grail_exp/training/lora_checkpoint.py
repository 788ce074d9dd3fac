"""The model part of a ``peft=lora`` run's checkpoints and exports (grail_exp/models/lora.py, docs/lora.md).

A LoRA checkpoint holds the adapter, not the weights: ``<checkpoint>/adapter_config.json`` and
``adapter_model.safetensors`` (a PEFT adapter folder: ``peft.PeftModel.from_pretrained(base, <checkpoint>)`` loads it,
and resume loads it onto the start's frozen base), beside the training state, the optimiser state of the adapter
only, and the tokenizer. ``peft.export_merged=true`` adds the merged model to the final checkpoint as a Hugging Face
folder, ``<checkpoint>/merged/`` (what ``grail_exp.evaluate`` or a vLLM server reads without PEFT); the weights-only
trajectory (RELEX) is always the merged model. The merged weights are W + (alpha/r) B A computed in fp32 from the
unchanged base (``lora.merged_tensors``), written in the model's dtype one tensor at a time.

Both writers are collectives where the policy is sharded (every rank calls them; rank 0 passes the directory, the
others None), as ``checkpoint_writer.export_hf_weights`` is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grail_exp.checkpoint import write_safetensors_streaming
from grail_exp.models import lora

MERGED_DIR = "merged"  # <checkpoint>/merged/: the merged model as a Hugging Face folder (peft.export_merged)


def write_adapter(module, directory: Path | None) -> None:
    """The policy's adapter as a PEFT adapter folder in ``directory`` (rank 0; None on the others: they only take
    part in the gathers), in the dtype the adapters are held in; their fp32 master weights, where the optimiser keeps
    them, are in its state (resume is exact either way)."""
    tensors = lora.adapter_tensors(module.backend.full_tensors(keep=lambda n: ".lora_" in n))
    if directory is None:
        return
    cfg = module.cfg
    lora.write_adapter(directory, {k: v.detach() for k, v in tensors.items()},
                       lora.adapter_config(module.policy, cfg.model.get("name_or_path")))


def write_merged(module, directory: Path | None) -> None:
    """The merged model (config, generation config, ``model.safetensors`` in the model's dtype) in ``directory``,
    streamed one merged tensor at a time; a tied output layer is carried by the embedding, as ``save_pretrained``
    writes it."""
    policy = module.policy
    base = policy.get_base_model()
    tied = bool(getattr(base.config, "tie_word_embeddings", False))

    def exported(name: str) -> bool:
        return not (tied and name == "lm_head.weight")

    # the header in the order the merge yields its tensors (a layer's weight when its B arrives): the same merge run
    # on meta tensors of the state dict's shapes, each merged tensor keeping its base tensor's dtype
    state = policy.state_dict()
    meta = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in state.items())
    base_dtype = {lora.base_state_name(n): t.dtype for n, t in state.items() if ".lora_" not in n}
    specs = [(n, base_dtype[n], tuple(t.shape)) for n, t in lora.merged_tensors(meta, 1.0) if exported(n)]
    merged = lora.merged_tensors(module.backend.full_tensors(), lora.scaling(module.cfg.peft))
    dtypes = {n: d for n, d, _ in specs}
    tensors = ((n, t.to(dtypes[n])) for n, t in merged if n in dtypes)
    if directory is not None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None and base.can_generate():
            base.generation_config.save_pretrained(directory)
    write_safetensors_streaming(directory / "model.safetensors" if directory is not None else None, specs, tensors)
