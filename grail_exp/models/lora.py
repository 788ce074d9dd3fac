"""LoRA adapters on a frozen base (``peft=lora``, docs/lora.md): the card's model on one GPU.

    W x  →  W x + (α / r) · B A x        W frozen (model.dtype), A (r, in) and B (out, r) trained
                                         (Hu et al. 2021, arXiv 2106.09685; PEFT's ``LoraConfig``)

The adapters train as full fine-tuning trains weights: held and computed in model.dtype, with fp32 master weights
kept by the optimiser (one process, DDP: ``optim.MasterWeightAdamW``; FSDP: its fp32 shards, cast for compute;
DeepSpeed: its fp32 master partition), ``peft.adapter_dtype: null``. A bf16 adapter stores B itself, not W + B A, so
its rounding is relative to B's own (small) values: nothing of an early update is lost, unlike a merged bf16 weight.
``peft.adapter_dtype=float32`` keeps PEFT's own default instead (fp32 adapters, their branch computed in fp32 on a
cast copy of every layer's input: slower on the CPU, measured in docs/lora.md).

The policy is a PEFT model (``peft.get_peft_model``) whose targeted linear layers of attention and MLP carry an
adapter; B starts at zero, so the first policy is the base exactly (x + 0 is x in every dtype). Everything the
trainer does with a LoRA policy that differs from full fine-tuning lives here, as functions of the policy or of its
``(name, tensor)`` state-dict pairs, so each parallel layout (training/backends/) streams them the way it streams
full weights:

- **the reference for free**: π_ref is the policy with its adapters switched off (``adapters_disabled``), the base
  itself: no second copy of the weights (TRL, verl);
- **the probes' leaf**: the input embeddings are frozen, so their output is made to require a gradient
  (``enable_input_require_grads``, TRL issue #3089): GRAIL's and OAR-G's ∂J/∂e exist as under full fine-tuning;
- **the engine's copy**: ``adapter_tensors`` (PEFT's saved names, what vLLM's LoRA loader reads) for
  ``peft.sync=adapter``, ``base_tensors`` (Hugging Face names) for the one push of the frozen base, and
  ``merged_tensors`` for ``peft.sync=merged``: W + (α/r)·B A computed in fp32 into a new tensor from the unchanged
  base, never merged into the trainer's own weights (no merge / unmerge drift: TRL #6688);
- **checkpoints and export**: the adapter as a PEFT adapter folder (``write_adapter``: ``adapter_config.json`` +
  ``adapter_model.safetensors``, what ``peft.PeftModel.from_pretrained`` loads), read back by ``load_adapter``;
- **a snapshot of the adapter** (``AdapterSnapshot``): a teacher defined as an earlier policy (RLSD's frozen teacher)
  is the same base with an earlier adapter, swapped in for its no-grad pass, instead of a copy of the whole model.

Imports ``errors.py`` and ``compute/leading_rows.py`` (the narrowed backward); ``peft`` where it is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import torch

from grail_exp.errors import ConfigError

# Every linear layer of a Qwen3 / Llama decoder layer (the families this project loads): attention and MLP.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SYNC_MODES = ("adapter", "merged")  # peft.sync
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32 / 0.33 LoRAConfig.max_lora_rank's allowed values
ADAPTER = "default"  # PEFT's adapter name inside the policy's state dict (".lora_A.default.weight")
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's adapter folder
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_BASE_PREFIX = "base_model.model."  # a PEFT model's state-dict names start with it


# ---------------------------------------------------------------------------------------------- config
def enabled(cfg) -> bool:
    """``peft=lora`` in a run config (its ``peft`` node; runs composed without the group: off)."""
    node = cfg.get("peft") if hasattr(cfg, "get") else None
    return node is not None and str(node.get("name", "none")) == "lora"


def engine_max_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of rank ``rank``: the smallest value it allows that holds it."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ConfigError(f"peft.rank = {rank}: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}")


def check_config(cfg) -> list[str]:
    """Key-named problems of ``peft.*`` (``validate.py`` calls it), including what the run's engine cannot serve."""
    p = cfg.get("peft")
    if p is None:
        return []
    e: list[str] = []
    name = str(p.get("name", "none"))
    if name not in ("none", "lora"):
        return [f"peft.name = {name!r}: must be none (full fine-tuning) or lora"]
    if name == "none":
        return []
    if importlib.util.find_spec("peft") is None:
        e.append("peft=lora needs PEFT, which is not installed: pip install \"peft==0.21.2\" \"accelerate==1.15.0\" "
                 "(the `lora` extra: pip install -e \".[lora]\")")
    if p.rank <= 0:
        e.append(f"peft.rank = {p.rank}: must be >= 1 (the adapter's inner dimension r)")
    if p.alpha <= 0:
        e.append(f"peft.alpha = {p.alpha}: must be > 0 (the adapter's output is scaled by alpha / rank)")
    if not 0.0 <= p.dropout < 1.0:
        e.append(f"peft.dropout = {p.dropout}: must be in [0, 1)")
    targets = list(p.target_modules or [])
    if not targets:
        e.append("peft.target_modules = []: name at least one of " + ", ".join(LINEAR_MODULES))
    for t in targets:
        if t not in LINEAR_MODULES:
            e.append(f"peft.target_modules: {t!r} is not a linear layer of the decoder; valid: "
                     f"{', '.join(LINEAR_MODULES)} (the embeddings and the output layer stay frozen: the probes "
                     "differentiate with respect to the embeddings' output)")
    if p.get("adapter_dtype") not in (None, "float32"):
        e.append(f"peft.adapter_dtype = {p.adapter_dtype!r}: must be null (model.dtype, fp32 master weights in the "
                 "optimiser) or float32 (PEFT's fp32 adapters)")
    if p.sync not in SYNC_MODES:
        e.append(f"peft.sync = {p.sync!r}: must be adapter (the adapter pushed each sync, the base once) or merged "
                 "(W + alpha/r BA computed in fp32 and pushed whole)")
    e += _engine_problems(cfg, p)
    return e


def _engine_problems(cfg, p) -> list[str]:
    """What the run's rollout engine cannot serve: a rank above vLLM's, a sync mode a plug-in engine lacks (the HF
    engine's merged copy beside sharded parameters: validate.py, which asks the strategy's backend)."""
    engine = str(cfg.rollout.engine)
    if engine == "vllm":
        kw = (cfg.rollout.get("vllm") or {}).get("kwargs") or {}
        cap = kw.get("max_lora_rank")
        if p.rank > VLLM_RANKS[-1]:
            return [f"peft.rank = {p.rank}: above {VLLM_RANKS[-1]}, the largest LoRA rank vLLM serves "
                    f"(max_lora_rank in {{{', '.join(map(str, VLLM_RANKS))}}}); use a smaller rank or rollout=hf"]
        if cap is not None and p.rank > int(cap):
            return [f"peft.rank = {p.rank}: above rollout.vllm.kwargs.max_lora_rank = {cap}; remove that key (the "
                    "engine then takes the smallest allowed rank that holds the adapter) or raise it"]
        for key in ("enable_lora", "max_loras", "max_cpu_loras"):
            if key in kw:
                return [f"rollout.vllm.kwargs.{key} = {kw[key]!r}: set by the engine under peft=lora (one adapter, "
                        "replaced at each sync): remove it"]
        return []
    if ":" in engine:  # a plug-in engine: what it offers decides what it can be synced with
        import importlib

        module_name, cls_name = engine.split(":", 1)
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            return []  # validate's engine check reports it
        own_copy = callable(getattr(cls, "load_weights", None))
        if own_copy and p.sync == "adapter" and not callable(getattr(cls, "load_adapter", None)):
            return [f"peft.sync = adapter: the engine {engine} keeps its own weights (load_weights) but has no "
                    "load_adapter; set peft.sync=merged"]
    return []


# ---------------------------------------------------------------------------------------------- the policy
def lora_config(peft_cfg):
    """PEFT's ``LoraConfig`` of ``peft.*``: B = 0 at the start (``init_lora_weights``), scaling alpha / rank."""
    from peft import LoraConfig

    return LoraConfig(r=int(peft_cfg.rank), lora_alpha=float(peft_cfg.alpha), lora_dropout=float(peft_cfg.dropout),
                      target_modules=list(peft_cfg.target_modules), bias="none", init_lora_weights=True,
                      use_rslora=False, task_type="CAUSAL_LM")


def apply(model: torch.nn.Module, cfg, adapter_dir: str | Path | None = None) -> torch.nn.Module:
    """``model`` (a loaded, trainable Hugging Face causal LM) with adapters on ``peft.target_modules``: only they
    train; the embeddings' output requires a gradient (the probes' leaf, and gradient checkpointing's input). A
    model whose backward narrows to leading rows gets its adapters' linear layers narrowed too. ``adapter_dir``: a
    checkpoint's adapter folder, loaded over the fresh adapter (resume). A's random start is drawn from its own
    stream (``seed``), so it leaves the run's random streams where they were."""
    from peft import get_peft_model

    from grail_exp.compute.leading_rows import NARROWS, narrow_linear_layers, narrows

    missing = [t for t in cfg.peft.target_modules
               if not any(name.rsplit(".", 1)[-1] == t for name, _ in model.named_modules())]
    if missing:
        raise ConfigError(f"peft.target_modules: {', '.join(map(repr, missing))} not found in the model "
                          f"{type(model).__name__}")
    narrowed = narrows(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.get("seed", 0)))
        policy = get_peft_model(model, lora_config(cfg.peft), autocast_adapter_dtype=adapters_in_fp32(cfg))
    policy.enable_input_require_grads()
    if narrowed:  # the adapters' own products narrow like the base layers they sit beside
        narrow_linear_layers(policy.get_base_model())
        setattr(policy, NARROWS, True)
    if adapter_dir is not None:
        load_adapter(policy, adapter_dir)
    return policy


def adapters_in_fp32(cfg) -> bool:
    """Whether the adapters are held in fp32 (``peft.adapter_dtype=float32``, or a strategy whose fp32 parameters are
    its master weights: FSDP's ``policy_overrides``) rather than in model.dtype with fp32 masters beside them."""
    return str(cfg.peft.get("adapter_dtype") or "") == "float32"


def is_lora(model) -> bool:
    """Whether ``model`` is a PEFT model carrying this module's adapter."""
    return hasattr(model, "peft_config") and ADAPTER in getattr(model, "peft_config", {})


@contextlib.contextmanager
def adapters_disabled(model):
    """The block runs ``model`` (a LoRA policy) as its base: every adapter's output left out, nothing copied."""
    if not is_lora(model):
        raise TypeError(f"{type(model).__name__} has no LoRA adapters to disable")
    with model.disable_adapter():
        yield


def adapter_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of the trainable adapter tensors of a LoRA policy."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n]


def count_adapter_parameters(model) -> int:
    return sum(p.numel() for _, p in adapter_parameters(model))


def scaling(peft_cfg) -> float:
    """α / r, the factor on B A (PEFT's ``scaling`` without rsLoRA; vLLM reads the same from the adapter's config)."""
    return float(peft_cfg.alpha) / float(peft_cfg.rank)


def policy_scaling(model) -> float:
    """α / r of a LoRA policy's adapter, read from the policy (PEFT's ``LoraConfig``) rather than the run config."""
    c = model.peft_config[ADAPTER]
    return float(c.lora_alpha) / float(c.r)


class AdapterSnapshot:
    """The adapter's values at one moment (a copy of the adapter only), to run the policy as it was then: the same
    frozen base with the earlier adapter swapped in for the block (``swapped_in``), restored after it."""

    def __init__(self, model):
        self.values = {n: p.detach().clone() for n, p in adapter_parameters(model)}

    @torch.no_grad()
    def update(self, model) -> None:
        for n, p in adapter_parameters(model):
            self.values[n].copy_(p)

    @contextlib.contextmanager
    def swapped_in(self, model):
        """For a no-grad pass: the parameters hold the snapshot's values inside the block (their storage swapped, not
        written, so an autograd graph of the live values, if one is alive, keeps them)."""
        live = adapter_parameters(model)
        kept = [p.data for _, p in live]
        try:
            for n, p in live:
                p.data = self.values[n]
            yield model
        finally:
            for (_, p), data in zip(live, kept):
                p.data = data


# ---------------------------------------------------------------------------------------------- state-dict streams
def adapter_state_name(name: str) -> str | None:
    """A policy state-dict name of an adapter tensor → its name in PEFT's adapter file (the adapter's own name
    dropped: ``...q_proj.lora_A.default.weight`` → ``...q_proj.lora_A.weight``); None for any other tensor."""
    for part in ("lora_A", "lora_B"):
        tag = f".{part}.{ADAPTER}."
        if tag in name:
            return name.replace(tag, f".{part}.")
    return None


def base_state_name(name: str) -> str | None:
    """A policy state-dict name of a base tensor → its Hugging Face name (``base_model.model.`` and ``.base_layer``
    dropped); None for an adapter tensor."""
    if ".lora_" in name:
        return None
    if name.startswith(_BASE_PREFIX):
        name = name[len(_BASE_PREFIX):]
    return name.replace(".base_layer.", ".")


def adapter_tensors(pairs) -> dict[str, torch.Tensor]:
    """The adapter of a stream of the policy's ``(state-dict name, tensor)`` pairs, under PEFT's file names."""
    out = {}
    for name, t in pairs:
        saved = adapter_state_name(name)
        if saved is not None:
            out[saved] = t
    return out


def base_tensors(pairs):
    """``(Hugging Face name, tensor)`` of the frozen base in a stream of the policy's pairs (adapters left out)."""
    for name, t in pairs:
        hf = base_state_name(name)
        if hf is not None:
            yield hf, t


def merged_tensors(pairs, factor: float):
    """``(Hugging Face name, tensor)`` of the merged model W + factor · B A from a stream of the policy's pairs, each
    merged weight computed in fp32 into a new tensor (the base tensors are read, never written). A targeted layer's
    base weight waits for its A and B (the state dict lists them right after it), so at most one layer's three tensors
    are held."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in pairs:
        prefix, kind = _lora_parts(name)
        if kind is None:
            yield base_state_name(name), t
            continue
        parts = waiting.setdefault(prefix, {})
        parts[kind] = t
        if len(parts) == 3:
            del waiting[prefix]
            W, A, B = parts["base"], parts["A"], parts["B"]
            merged = torch.addmm(W.float(), B.float(), A.float(), alpha=factor)  # W + factor · B A, one fp32 pass
            yield base_state_name(prefix + ".base_layer.weight"), merged
    if waiting:
        raise RuntimeError(f"merging LoRA: layers without their three tensors: {sorted(waiting)[:3]}")


def _lora_parts(name: str) -> tuple[str, str | None]:
    """(layer prefix, base | A | B) for the three tensors a merge needs; (name, None) for every other tensor."""
    for suffix, kind in ((".base_layer.weight", "base"), (f".lora_A.{ADAPTER}.weight", "A"),
                         (f".lora_B.{ADAPTER}.weight", "B")):
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return name, None


# ---------------------------------------------------------------------------------------------- the adapter folder
def adapter_config(model, base_name: str | None = None) -> dict:
    """The adapter's ``adapter_config.json`` content (PEFT's own ``to_dict``), naming the base it belongs to."""
    d = model.peft_config[ADAPTER].to_dict()
    if base_name is not None:
        d["base_model_name_or_path"] = str(base_name)
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """A PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (what
    ``peft.PeftModel.from_pretrained(base, directory)`` and vLLM's ``LoRARequest`` read)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def has_adapter(directory) -> bool:
    d = Path(directory)
    return (d / ADAPTER_CONFIG).is_file() and (d / ADAPTER_WEIGHTS).is_file()


@torch.no_grad()
def load_adapter(model, directory) -> None:
    """Copy the adapter of a PEFT adapter folder into ``model``'s adapter (same targets and rank, or an error)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    live = {adapter_state_name(n): p for n, p in adapter_parameters(model)}
    if set(saved) != set(live):
        raise ConfigError(f"{directory}: its adapter's tensors do not match this run's peft.target_modules / "
                          f"peft.rank ({len(saved)} saved, {len(live)} here)")
    for name, p in live.items():
        if p.device.type == "meta":  # a rank that receives its weights from rank 0
            continue
        p.copy_(saved[name])
