"""Real architectures with random weights (``model.random_init=true``), offline.

The five paper models' ``config.json`` files ship in ``grail_exp/data/architectures/<name>.json``
(keys starting with ``_`` are our notes: hub id, default packaged tokenizer, published size, sources).
``model.random_init=true`` builds that exact architecture with random weights, without the hub:

    python -m grail_exp.run model=qwen3_8b model.random_init=true                      # 8B-shaped, random, paper recipe
    python -m grail_exp.run model=qwen3_4b recipe=demo model.random_init=true \\
        'model.random_init_overrides={num_hidden_layers: 2}'                          # real vocab, 2 layers, CPU

``resolve_model_path`` writes the (overridden) ``config.json`` and a marker file to
``<paths.cache_dir>/random_init/<arch>-<hash>/``; ``load_causal_lm`` sees the marker and builds the
model with ``AutoModelForCausalLM.from_config`` under ``model.init_seed`` (the global RNG is left
untouched). Checkpoints of such a run are ordinary Hugging Face directories.

``python -m grail_exp.models.architectures`` prints the parameter counts (the real module tree, built on the
meta device: no memory) and the memory of a bf16 + fp32-master-weights + AdamW training step.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from grail_exp.errors import UserError

ARCH_DIR = Path(__file__).resolve().parents[1] / "data" / "architectures"
MARKER = "grail_exp_random_init.json"  # written beside config.json; its presence means "build, don't load"


class ArchitectureError(UserError, ValueError):
    """An architecture that cannot be resolved or overridden; the message names the key."""


def available() -> list[str]:
    return sorted(p.stem for p in ARCH_DIR.glob("*.json"))


def load_architecture(name_or_path: str, key: str = "model.architecture") -> dict:
    """A shipped architecture by name, or a ``config.json`` file / a directory holding one."""
    p = ARCH_DIR / f"{name_or_path}.json"
    if not p.is_file():
        p = Path(str(name_or_path)).expanduser()
        if p.is_dir():
            p = p / "config.json"
    if not p.is_file():
        raise ArchitectureError(f"{key}={name_or_path!r}: not a shipped architecture ({', '.join(available())}) "
                                "nor a config.json file or a directory with one")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ArchitectureError(f"{key}={name_or_path!r}: {p}:{exc.lineno}: invalid JSON: {exc.msg}") from exc


def by_hub_id(hub_id: str) -> str | None:
    for name in available():
        if json.loads((ARCH_DIR / f"{name}.json").read_text()).get("_hub_id") == hub_id:
            return name
    return None


def architecture_of(model_cfg) -> tuple[str, dict]:
    """(name or path, config dict) for ``model.random_init``: ``model.architecture``, else the shipped
    architecture whose hub id is ``model.name_or_path``, else ``model.name_or_path``'s own config.json."""
    arch = model_cfg.get("architecture")
    if arch:
        return str(arch), load_architecture(str(arch))
    name = model_cfg.get("name_or_path")
    if name:
        shipped = by_hub_id(str(name))
        if shipped:
            return shipped, load_architecture(shipped)
        if Path(str(name)).expanduser().is_dir():
            return str(name), load_architecture(str(name), "model.name_or_path")
    raise ArchitectureError(
        f"model.random_init=true needs an architecture: set model.architecture to one of {', '.join(available())} "
        f"or to a config.json path (model.name_or_path={name!r} is not the hub id of a shipped one)")


def hf_config(arch: dict, overrides: dict | None = None, key: str = "model.random_init_overrides") -> dict:
    """The ``config.json`` dict to build: our ``_`` notes removed, ``overrides`` applied.

    An override must name a key of the architecture or an attribute of its transformers config class,
    so a typo (``num_layers``) fails instead of being silently ignored."""
    from transformers import CONFIG_MAPPING

    cfg = {k: v for k, v in arch.items() if not k.startswith("_")}
    if not overrides:
        return cfg
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ArchitectureError(f"model_type={model_type!r} is not known to this transformers version")
    known = set(cfg) | set(vars(CONFIG_MAPPING[model_type]()))
    for k, v in dict(overrides).items():
        if k not in known or k.startswith("_"):
            raise ArchitectureError(f"{key}.{k}: not a key of the {model_type} config "
                                    f"(e.g. num_hidden_layers, hidden_size, vocab_size)")
        cfg[k] = v
    return cfg


def _plain(x: Any) -> Any:
    """OmegaConf containers -> plain Python (for JSON and hashing)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(x):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return x


def materialize_random_init(model_cfg, cache_dir: str | os.PathLike) -> Path:
    """Write ``config.json`` + the marker for ``model.random_init`` and return the directory (idempotent)."""
    name, arch = architecture_of(model_cfg)
    overrides = _plain(model_cfg.get("random_init_overrides")) or {}
    config = hf_config(arch, overrides)
    marker = {"architecture": name, "overrides": overrides, "init_seed": int(model_cfg.get("init_seed", 0)),
              "tokenizer": arch.get("_tokenizer"), "hub_id": arch.get("_hub_id")}
    blob = json.dumps([config, marker], sort_keys=True)
    d = Path(cache_dir).expanduser() / "random_init" / f"{Path(name).stem}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    if not (d / MARKER).is_file():
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        (d / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))  # written last: marks completion
    return d


def read_marker(path: str | os.PathLike) -> dict | None:
    f = Path(path) / MARKER
    return json.loads(f.read_text()) if f.is_file() else None


def build_random_model(path: str | os.PathLike, dtype, attn_implementation: str | None = None):
    """The architecture in ``path`` with seeded random weights (transformers' own init, ``initializer_range``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grail_exp.checkpoint import random_streams_kept, seed_started_streams

    marker = read_marker(path)
    config = AutoConfig.from_pretrained(str(path))
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    # Shapes on the meta device, then one draw of every weight: a plain from_config draws each weight twice
    # (torch's default init in the constructors, then transformers' N(0, initializer_range)), which costs
    # minutes at 8B on a CPU. init_weights also recomputes the RoPE buffers, which to_empty leaves blank.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model = model.to_empty(device="cpu")
    # The init seed must not shift the run's own random streams (sampling, data order), nor queue a CUDA seed.
    with random_streams_kept():
        seed_started_streams(int(marker["init_seed"]))
        model.init_weights()
    return model


def check_model_config(model_cfg) -> list[str]:
    """Problems with the random-init / tokenizer keys of ``model`` (for ``validate.py``)."""
    from grail_exp.models.tokenizers import check_spec, is_packaged

    e: list[str] = []
    tok = model_cfg.get("tokenizer_name_or_path")
    e += check_spec(tok)
    overrides = _plain(model_cfg.get("random_init_overrides"))
    if overrides is not None and not isinstance(overrides, dict):
        e.append(f"model.random_init_overrides = {overrides!r}: must be a mapping such as {{num_hidden_layers: 2}} or null")
        return e
    if not model_cfg.get("random_init"):
        return e
    try:
        _, arch = architecture_of(model_cfg)
        hf_config(arch, _plain(model_cfg.get("random_init_overrides")) or {})
    except ArchitectureError as exc:
        e.append(str(exc))
        return e
    if tok is None and not arch.get("_tokenizer"):
        e.append("model.tokenizer_name_or_path = None: this architecture names no packaged tokenizer; set "
                 "pkg:qwen3 | pkg:llama3 | pkg:r1_distill_llama or a local tokenizer directory")
    if tok is not None and not is_packaged(tok) and not Path(str(tok)).expanduser().is_dir():
        e.append(f"model.tokenizer_name_or_path = {tok!r}: model.random_init=true never uses the hub; use pkg:<name> "
                 "or a local directory")
    return e


# ------------------------------------------------------------------------------- parameter counts
def parameter_counts(config: dict) -> dict[str, int]:
    """Analytic parameter count of a dense Llama / Qwen3 decoder from its ``config.json`` dict.

    Per layer: q, k, v, o projections ``h*(n_h*d) + 2*h*(n_kv*d) + (n_h*d)*h`` (+ biases with
    ``attention_bias``), SwiGLU MLP ``3*h*i`` (+ biases with ``mlp_bias``), two RMSNorms ``2*h``, and for
    Qwen3 the per-head q/k norms ``2*d``. Plus the embedding ``V*h``, the final norm ``h`` and, unless
    tied, the output layer ``V*h``."""
    h, i, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv, L = config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // nh
    attn = h * nh * d + 2 * h * nkv * d + nh * d * h
    if config.get("attention_bias"):
        attn += nh * d + 2 * nkv * d + h
    mlp = 3 * h * i + ((2 * i + h) if config.get("mlp_bias") else 0)
    layer = attn + mlp + 2 * h + (2 * d if config["model_type"] == "qwen3" else 0)
    embedding = V * h
    output = 0 if config.get("tie_word_embeddings") else V * h
    total = L * layer + embedding + h + output
    return {"total": total, "per_layer": layer, "embedding": embedding, "output": output,
            "non_embedding": total - embedding - output}


def meta_parameter_count(config: dict) -> int:
    """Parameters of the real transformers module tree, built on the meta device (no memory, ~1 s)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    return sum(p.numel() for p in model.parameters())  # tied weights are one Parameter, counted once


# ------------------------------------------------------------------------------- training memory
# Bytes per parameter of full fine-tuning with bf16 compute, fp32 master weights and AdamW (fp32 moments),
# the paper's setup (DeepSpeed ZeRO-2, bf16): what each copy costs, before activations.
BYTES = {"weights_bf16": 2, "master_fp32": 4, "adam_moments_fp32": 8, "grads_bf16": 2}
GPU_GIB = 78.0  # usable memory of one "80 GB" H100 as this project's device reports it


def training_memory(params: int, gpus: int = 1, grads_bytes: int = 2, offload_optimizer: bool = False) -> dict:
    """Per-GPU and CPU bytes of the model states under ZeRO-2 on ``gpus`` GPUs (``gpus=1``: no sharding).

    ZeRO-2 keeps the bf16 weights whole on every GPU and shards gradients, fp32 master weights and Adam
    moments ``gpus`` ways. Optimizer offload moves master weights and moments (and the step) to CPU
    memory. Activations, logits and a colocated vLLM engine come on top."""
    opt = BYTES["master_fp32"] + BYTES["adam_moments_fp32"]
    gpu = BYTES["weights_bf16"] + grads_bytes / gpus + (0 if offload_optimizer else opt / gpus)
    cpu = (opt / gpus) if offload_optimizer else 0
    return {"gpu_bytes": params * gpu, "cpu_bytes": params * cpu, "gpu_bytes_per_param": gpu}


def logits_bytes(tokens: int, vocab: int) -> dict:
    """Full-vocabulary logits of ``tokens`` positions: bf16 logits and an fp32 log-softmax copy."""
    return {"bf16": tokens * vocab * 2, "fp32": tokens * vocab * 4}


def memory_table(micro_batch_tokens: int = 8 * 4096) -> str:
    """Markdown table: parameter counts and training-step memory of every shipped architecture."""
    gib = 2**30
    rows = ["| model | params (published) | non-embedding | states on 1 GPU, bf16 / fp32 grads | 1 x 80 GB? | "
            "ZeRO-2 x2 / x4 / x8 per GPU | 1 GPU + optimizer offload (GPU / CPU) | logits of 8 x 4096 tokens (bf16 / fp32) |",
            "|---|---|---|---|---|---|---|---|"]
    for name in available():
        arch = load_architecture(name)
        cfg = hf_config(arch)
        n = parameter_counts(cfg)["total"]
        ne = parameter_counts(cfg)["non_embedding"]
        one = training_memory(n)["gpu_bytes"] / gib
        one32 = training_memory(n, grads_bytes=4)["gpu_bytes"] / gib
        z = [training_memory(n, g)["gpu_bytes"] / gib for g in (2, 4, 8)]
        off = training_memory(n, offload_optimizer=True)
        lg = logits_bytes(micro_batch_tokens, cfg["vocab_size"])
        left = GPU_GIB - one
        verdict = ("no" if left < 0 else f"states fit, {left:.0f} GiB left" if left < 30 else f"yes, {left:.0f} GiB left")
        rows.append(f"| {name} | {n / 1e9:.2f} B ({arch['_published']['params_b']} B) | {ne / 1e9:.2f} B | "
                    f"{one:.1f} / {one32:.1f} GiB | {verdict} | {z[0]:.1f} / {z[1]:.1f} / {z[2]:.1f} GiB | "
                    f"{off['gpu_bytes'] / gib:.1f} / {off['cpu_bytes'] / gib:.1f} GiB | "
                    f"{lg['bf16'] / gib:.1f} / {lg['fp32'] / gib:.1f} GiB |")
    return "\n".join(rows)


def main() -> None:  # pragma: no cover - a printout
    print("| model | layers | hidden | heads (KV) | head_dim | MLP | vocab | tied | RoPE | params: formula = meta build |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in available():
        c = hf_config(load_architecture(name))
        n, meta = parameter_counts(c)["total"], meta_parameter_count(c)
        rope = f"theta {c['rope_theta']:g}" + (f", {c['rope_scaling']['rope_type']} x{c['rope_scaling']['factor']:g}"
                                               if c.get("rope_scaling") else "")
        print(f"| {name} | {c['num_hidden_layers']} | {c['hidden_size']} | {c['num_attention_heads']} "
              f"({c['num_key_value_heads']}) | {c.get('head_dim')} | {c['intermediate_size']} | {c['vocab_size']} | "
              f"{c['tie_word_embeddings']} | {rope} | {n:,} {'=' if n == meta else '!='} {meta:,} |")
    print()
    print(memory_table())
    print(f"\n1 GiB = 2^30 bytes; one H100 '80 GB' = {GPU_GIB:.0f} GiB usable; states = bf16 weights 2 + fp32 master 4 + "
          "Adam moments 8 + grads 2 (bf16) or 4 (fp32) bytes per parameter.")


if __name__ == "__main__":  # pragma: no cover
    main()


def weights_sha256(model_dir) -> str:
    """sha256 over a model directory's weight files (names and bytes, in name order): the starting weights' identity.
    A hub id without a local directory hashes its name."""
    p = Path(model_dir)
    files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.gguf") for f in p.glob(pattern)) if p.is_dir() else []
    h = hashlib.sha256()
    if not files:
        h.update(f"name:{model_dir}".encode())
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()
