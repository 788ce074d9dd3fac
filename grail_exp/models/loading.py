"""Policy / reference / tokenizer loading.

``model.name_or_path`` is a hub id (loaded with its pinned ``revision``) or a local Hugging Face
directory; null builds (once, then cached) the embedded model of ``model.build``, or loads the shipped
warm-started one when the build is exactly the one that ships (``model.shipped_weights``, ``embedded.py``).
Loading is safe by default: safetensors only, ``trust_remote_code=false`` unless the config says otherwise.

``model.random_init=true`` builds the model's exact architecture with random weights, offline
(``grail_exp/models/architectures.py``); ``model.tokenizer_name_or_path`` picks another tokenizer, e.g. a real
one shipped by a package (``pkg:qwen3``, ``grail_exp/models/tokenizers.py``). ``model.name_or_path: pkg:smollm2``
loads a real pretrained model shipped by a package (``grail_exp/models/packaged.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from grail_exp.compute.attention import DEFAULT_MAX_SCORES
from grail_exp.compute.forward import decoder_body
from grail_exp.compute.leading_rows import narrow_backward
from grail_exp.compute.model_attention import use_kernel_gqa
from grail_exp.errors import UserError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError, RuntimeError):
    """A model or tokenizer that cannot be loaded; the message says what to fix."""


def looks_local(name: str) -> bool:
    """A filesystem path (existing, or written like one) rather than a hub id such as ``Qwen/Qwen3-4B``."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def check_local_files(model_cfg) -> list[str]:
    """The model's files on this machine, for ``validate`` before anything loads: a local ``model.name_or_path`` is a
    Hugging Face directory (a config.json that parses), a local ``model.tokenizer_name_or_path`` a directory, and a
    ``model.architecture`` that is not a shipped name a config.json that parses. Hub ids and ``pkg:`` names are
    checked where they load. (``model.random_init`` builds from the architecture: ``check_model_config`` checks it.)"""
    import json

    from grail_exp.models.architectures import ArchitectureError, load_architecture

    e: list[str] = []
    name, tok = model_cfg.get("name_or_path"), model_cfg.get("tokenizer_name_or_path")
    arch = model_cfg.get("architecture")
    if name is not None and not model_cfg.get("random_init") and ":" not in str(name) and looks_local(str(name)):
        config = Path(str(name)).expanduser() / "config.json"
        if not config.is_file():
            e.append(f"model.name_or_path = {str(name)!r}: no Hugging Face model there (expected {config}); point "
                     "it at a directory written by save_pretrained (e.g. a run's checkpoints/step-N/)")
        else:
            try:
                json.loads(config.read_text())
            except json.JSONDecodeError as exc:
                e.append(f"model.name_or_path = {str(name)!r}: {config}:{exc.lineno}: invalid JSON: {exc.msg}")
    if tok is not None and ":" not in str(tok) and looks_local(str(tok)) and not Path(str(tok)).expanduser().is_dir():
        e.append(f"model.tokenizer_name_or_path = {str(tok)!r}: no such directory")
    if arch and not model_cfg.get("random_init"):
        try:
            load_architecture(str(arch))
        except ArchitectureError as exc:
            e.append(str(exc))
    return e


def resolve_model_path(cfg) -> str:
    """The directory or hub id to load; builds the embedded model when ``model.name_or_path`` is null, and the
    cached supervised cold start on top when ``model.cold_start.enabled`` (grail_exp/models/cold_start.py)."""
    path = _resolve_base(cfg)
    cs = cfg.model.get("cold_start")
    if cs is not None and cs.enabled:
        from grail_exp.models.cold_start import ensure_cold_start

        return ensure_cold_start(path, cfg, load_tokenizer, load_causal_lm)
    return path


def _resolve_base(cfg) -> str:
    m = cfg.model
    if m.get("random_init"):
        from grail_exp.models.architectures import ArchitectureError, materialize_random_init

        try:
            return str(materialize_random_init(m, _cache_dir(cfg)))
        except ArchitectureError as exc:
            raise ModelLoadError(str(exc)) from exc
    if m.name_or_path is None:
        from grail_exp.models.embedded import ensure_embedded_model

        path = ensure_embedded_model(**embedded_build_args(cfg), cache_dir=cfg.paths.cache_dir,
                                     use_shipped=m.get("shipped_weights", True))
        return str(path)
    name = str(m.name_or_path)
    from grail_exp.models.packaged import PackagedModelError, is_packaged_model
    from grail_exp.models.packaged import resolve as resolve_packaged_model

    if is_packaged_model(name):  # pkg:<name>: a model file shipped by a package, converted once into the cache
        try:
            return resolve_packaged_model(name, _cache_dir(cfg))
        except PackagedModelError as exc:
            raise ModelLoadError(str(exc)) from exc
    if looks_local(name):
        p = Path(name).expanduser()
        if not (p / "config.json").is_file():
            raise ModelLoadError(
                f"model.name_or_path={name!r}: no Hugging Face model there (expected {p / 'config.json'}). "
                "Point it at a directory written by save_pretrained (e.g. a run's checkpoints/step-N/)."
            )
        return str(p)
    return name


def embedded_build_args(cfg) -> dict:
    """What determines the embedded model of ``cfg`` (the arguments of ``embedded.embedded_spec``)."""
    from omegaconf import OmegaConf

    from grail_exp.data import arithmetic_task
    from grail_exp.data.sources import DataConfigLike

    m = cfg.model
    # The warm start trains on the same task distribution the run trains on.
    task = arithmetic_task(cfg.data if cfg.data.name == "arithmetic" else DataConfigLike())
    return dict(
        build=OmegaConf.to_container(m.build, resolve=True),
        warm=OmegaConf.to_container(m.warm_start, resolve=True) if m.warm_start else {"enabled": False},
        task=task,
        chat_template_kwargs=OmegaConf.to_container(m.chat_template_kwargs, resolve=True) or {},
        instruction=cfg.data.instruction if cfg.data.name == "arithmetic" else "",
    )


# ---------------------------------------------------------------------------------------------- the hub, probed once
HUB_PROBE_TIMEOUT_S = 3.0  # one HEAD request to the endpoint; a reachable hub answers in well under a second
_hub_probes: dict[str, tuple[bool, str]] = {}  # endpoint -> (reachable, why not): one probe per process and endpoint


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(whether the Hugging Face endpoint answers at all, the error if not), probed once per process.

    Any HTTP answer counts as reachable (even 4xx/5xx: the hub's own error is then the right message). Without this,
    transformers retries every file request five times with backoff before its error: 58-70 s offline."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    endpoint = constants.ENDPOINT
    if endpoint not in _hub_probes:
        try:
            get_session().head(endpoint, timeout=timeout_s, follow_redirects=False)
            _hub_probes[endpoint] = (True, "")
        except Exception as exc:  # noqa: BLE001 - connection refused, DNS failure, timeout, proxy error: all mean offline
            _hub_probes[endpoint] = (False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return _hub_probes[endpoint]


def _hub_offline_kwargs(name: str, revision, probe_file: str) -> dict:
    """Before loading hub id ``name``: {} when the hub answers (or HF_HUB_OFFLINE is set: the libraries then read
    the cache without retrying); ``local_files_only`` when it does not but the cache holds the repo; otherwise the
    ModelLoadError now, instead of a minute of retries."""
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or looks_local(name):
        return {}
    ok, why = hub_reachable()
    if ok:
        return {}
    cached = try_to_load_from_cache(name, probe_file, revision=revision)
    if isinstance(cached, str):
        log.warning("the Hugging Face hub (%s) is unreachable (%s): loading %r from the local cache", constants.ENDPOINT,
                    why, name)
        return {"local_files_only": True}
    raise _hub_error(name, OSError(f"the hub {constants.ENDPOINT} is unreachable ({why}; probed once, "
                                   f"{HUB_PROBE_TIMEOUT_S:g} s timeout) and {name!r} is not in the local cache"))


def _hub_error(name: str, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"cannot load {name!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
        "If this is a hub id, this machine may be offline: download it where the hub is reachable "
        "(huggingface-cli download ...) and set model.name_or_path=<local dir>, or set HF_HUB_OFFLINE=1 "
        "to use the local cache."
    )


def _cache_dir(cfg) -> str:
    paths = cfg.get("paths")
    return str(paths.cache_dir) if paths is not None and paths.get("cache_dir") else "~/.cache/grail_exp"


def resolve_tokenizer_path(path: str, cfg) -> tuple[str, bool]:
    """(what to load, whether ``model.revision`` applies): ``model.tokenizer_name_or_path`` if set, else the
    packaged tokenizer a random-init directory names, else the model's own ``path``."""
    from grail_exp.models.architectures import read_marker
    from grail_exp.models.tokenizers import PackagedTokenizerError, is_packaged, resolve

    spec = cfg.model.get("tokenizer_name_or_path")
    key = "model.tokenizer_name_or_path"
    if spec is None:
        marker = read_marker(path)
        if marker is None:
            return path, True
        spec, key = marker.get("tokenizer"), f"the tokenizer of architecture {marker['architecture']!r}"
        if not spec:
            raise ModelLoadError(f"{path}: a random-init model with no tokenizer; set model.tokenizer_name_or_path")
    if is_packaged(spec):
        try:
            return resolve(spec, _cache_dir(cfg), key), False
        except PackagedTokenizerError as exc:
            raise ModelLoadError(str(exc)) from exc
    return str(spec), False


def load_tokenizer(path: str, cfg):
    from transformers import AutoTokenizer

    m = cfg.model
    tok_path, own = resolve_tokenizer_path(path, cfg)
    offline = _hub_offline_kwargs(tok_path, m.revision if own else None, "tokenizer_config.json")
    try:
        tok = AutoTokenizer.from_pretrained(tok_path, revision=m.revision if own else None,
                                            trust_remote_code=m.trust_remote_code, **offline)
    except (OSError, ValueError) as exc:
        raise _hub_error(tok_path, exc) from exc
    if m.get("strip_think") and "</think>" not in tok.decode(tok.encode("</think>", add_special_tokens=False),
                                                           skip_special_tokens=True):
        # Completions are decoded with skip_special_tokens=True: a special </think> would vanish and
        # strip_think would then grade the whole text, drafts included.
        raise ModelLoadError(f"model.strip_think=true, but the tokenizer {tok_path!r} marks </think> as special, so "
                             "decoding drops it; use a tokenizer where it is a plain added token")
    if tok.pad_token is None:  # Llama-3 tokenizers ship without one; pad with EOS (masked everywhere)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if m.chat_template:
        tok.chat_template = m.chat_template
    return tok


def load_causal_lm(path: str, cfg, *, trainable: bool, weights: bool = True, adapter_dir=None):
    """The policy (``trainable=True``) or a frozen copy (reference model).

    ``weights=False``: the same module tree on the meta device, holding no memory (the config is read, no weight file):
    a rank of a multi-rank run whose weights arrive from rank 0 once the process group exists (the update backend's
    ``configure_model``), so that only rank 0 holds a host copy of the weights.

    ``peft=lora``: the trainable policy carries LoRA adapters on its frozen weights (``grail_exp/models/lora.py``);
    ``adapter_dir``, a checkpoint's adapter folder, gives them their trained values (resume)."""
    from transformers import AutoModelForCausalLM

    from grail_exp.models.architectures import build_random_model, read_marker

    m = cfg.model
    if not weights:
        model = model_skeleton(path, cfg)
    elif read_marker(path) is not None:  # model.random_init: the architecture in `path`, seeded random weights
        model = build_random_model(path, DTYPES[m.dtype], m.attn_implementation)
    else:
        kwargs = dict(revision=m.revision, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code,
                      use_safetensors=True, **_hub_offline_kwargs(path, m.revision, "config.json"))
        if m.attn_implementation:
            kwargs["attn_implementation"] = m.attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as exc:
            raise _hub_error(path, exc) from exc
    use_kernel_gqa(model, m.get("cpu_explicit_attention_max_scores", DEFAULT_MAX_SCORES))
    if trainable:
        narrow_if_configured(model, cfg)
    # Dropout makes log-prob ratios noisy and is off in the paper's recipe.
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    if trainable:
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        from grail_exp.models import lora

        if lora.enabled(cfg):
            model = lora.apply(model, cfg, adapter_dir)
        model.train()  # from_pretrained returns eval mode
    else:
        model.eval().requires_grad_(False)
    return model


def model_skeleton(path: str, cfg):
    """The model of ``path`` (its config.json, with ``model.revision``) built on the meta device in ``model.dtype``:
    every parameter and buffer has its shape and dtype but no storage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    kwargs = dict(revision=m.revision, trust_remote_code=m.trust_remote_code,
                  **_hub_offline_kwargs(path, m.revision, "config.json"))
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise _hub_error(path, exc) from exc
    extra = {"attn_implementation": m.attn_implementation} if m.attn_implementation else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[m.dtype], trust_remote_code=m.trust_remote_code,
                                                **extra)


def narrows_backward(cfg) -> bool:
    """``trainer.narrow_backward`` resolved: null = on when the run trains on the CPU (``trainer.accelerator: cpu``,
    or ``auto`` without CUDA), off on a GPU until one measures it."""
    trainer = cfg.get("trainer") or {}
    value = trainer.get("narrow_backward")
    if value is not None:
        return bool(value)
    accelerator = str(trainer.get("accelerator", "auto"))
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def narrow_if_configured(model, cfg) -> None:
    """A trainable policy's leading-rows backward computes those rows only when ``trainer.narrow_backward`` says so
    (``grail_exp.compute.leading_rows``: the decoder's linear layers swapped, the model marked)."""
    if narrows_backward(cfg):
        narrow_backward(model, decoder_body(model))


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def decoder_layer_classes(cfg) -> set:
    """The decoder-layer classes of the model family (FSDP wraps each layer as its own shard unit)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    return {Qwen3DecoderLayer, LlamaDecoderLayer}


def decoder_layers(model: torch.nn.Module, cfg=None) -> list[torch.nn.Module]:
    """The model's decoder layers, from the embeddings up (a backward computes their gradients in reverse)."""
    classes = tuple(decoder_layer_classes(cfg))
    return [m for m in model.modules() if isinstance(m, classes)]
