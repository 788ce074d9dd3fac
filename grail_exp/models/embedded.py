"""The embedded default model: a tiny Qwen3 (or Llama) built locally, warm-started, cached.

Nothing here touches the network. ``ensure_embedded_model(cfg)`` returns a local Hugging Face
directory (``config.json`` + ``model.safetensors`` + tokenizer files) that every other part of the
framework loads exactly like a hub checkpoint (``AutoModelForCausalLM.from_pretrained(dir)``).

Three steps, each deterministic given the config:

1. **Tokenizer.** A BPE trained in well under a second on synthetic chat transcripts of the arithmetic
   task. ``style: qwen`` is byte-level BPE with Qwen's ChatML special tokens and a Qwen3-like chat
   template (``enable_thinking: false`` inserts the empty ``<think>`` block, as Qwen3 does);
   ``style: llama`` is a SentencePiece-style (``▁`` metaspace, byte fallback) BPE with Llama-3 header
   tokens. Digits are always single tokens: merging whole numbers into tokens would turn per-digit
   arithmetic into a lookup over hundreds of number tokens (measured: the model then learns far slower).
2. **Model.** A Qwen3 / Llama config from ``model.build`` (0.4 M parameters by default), random init
   from the seed. Eager attention: at this size SDPA made the backward 4–8x slower on CPU.
3. **Warm start.** Supervised fine-tuning on fresh training problems (loss on the completion only)
   until greedy validation accuracy first reaches ``warm_start.target_accuracy``. Stopping at a
   threshold rather than after a fixed number of steps makes every seed start RL in the same band
   (a fixed step count gave 21 % / 38 % / 48 % for three seeds).

The result is cached under ``<cache_dir>/embedded/<key>/`` where ``key`` hashes everything that
determines it; a second run reuses it. Builds are atomic (a temp dir renamed into place) and
serialised with a file lock, so parallel sweep jobs build once.

**Shipped artifact.** The default build (``model=tiny``) also ships, warm-started, as package data in
``grail_exp/data/embedded/<name>/`` with a manifest (``grail_exp_manifest.json``: the key, the build spec, the
sha256 of every file, the commit and ``BUILD_VERSION`` that built it, the warm start's accuracy and steps).
``ensure_embedded_model`` loads it in place (read-only is fine) when, and only when, the requested key equals
the manifest's and every file's sha256 matches; any other build (another seed, shape, task, architecture or
``BUILD_VERSION``) goes through the builder as before. ``python sweeps/build_shipped_model.py`` rebuilds it
(docs/embedded-model.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from grail_exp.checkpoint import random_streams_kept, seed_started_streams
from grail_exp.data.arithmetic import ArithmeticTask
from grail_exp.errors import ConfigError

log = logging.getLogger(__name__)

# Bump when the build procedure changes so that stale cached models are not reused.
BUILD_VERSION = 1
BUILD_MARKER = "grail_exp_build.json"  # a build directory is complete once it holds this (written last)

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen3-style ChatML. With enable_thinking=false the generation prompt carries an empty think block,
# exactly like Qwen3's own template, so code paths that strip <think> are exercised on CPU too.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


# ---------------------------------------------------------------------------------------------- tokenizer
def _transcripts(task: ArithmeticTask, n: int, chat_template_kwargs: dict, warm: dict | None = None) -> list[str]:
    """Chat transcripts used to train the BPE: what the tokenizer will actually see."""
    out = []
    for p in _with_curriculum(task.train_problems(10_000_000, n), warm):  # an index range RL never uses
        out.append(f"user\n{p.question}\nassistant\n{p.solution}\n")
    # A little generic text so that benchmark prompts tokenise into sensible pieces too.
    out += ["Please reason step by step, and put your final answer within \\boxed{}."] * 50
    return out


def _with_curriculum(problems, warm: dict | None) -> list:
    """SCRL: every ``1/curriculum_fraction``-th problem in the curriculum format (prompt t_K(x), ``<pj>`` answers)."""
    frac = (warm or {}).get("curriculum_fraction") or 0.0
    if frac <= 0:
        return list(problems)
    from types import SimpleNamespace

    from grail_exp.data.curriculum import arithmetic_curriculum, arithmetic_curriculum_solution, render_curriculum

    out = []
    for k, p in enumerate(problems):
        if int((k + 1) * frac) > int(k * frac):  # spread evenly: round(frac · len) of them
            q = render_curriculum(arithmetic_curriculum(p.question), warm["curriculum_prompt_template"],
                                  warm["curriculum_subproblem_template"])
            p = SimpleNamespace(question=q, solution=arithmetic_curriculum_solution(p.question), answer=p.answer)
        out.append(p)
    return out


def build_tokenizer(style: str, task: ArithmeticTask, vocab_size: int = 320, warm: dict | None = None):
    """Train the local tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with a chat template.
    ``warm`` with a ``curriculum_fraction`` > 0 (SCRL) adds curriculum transcripts to the corpus."""
    builders = {"qwen": _qwen_style_tokenizer, "llama": _llama_style_tokenizer}
    if style not in builders:
        raise ConfigError(f"model.build.tokenizer must be 'qwen' or 'llama', got {style!r}")
    fast = builders[style](_transcripts(task, 2000, {}, warm), vocab_size)
    fast.padding_side = "left"
    return fast


def _qwen_style_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE with single digits and Qwen's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte string stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL[1:2] + QWEN_SPECIAL[3:],
        chat_template=QWEN_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _llama_style_tokenizer(corpus: list[str], vocab_size: int):
    """Metaspace BPE with single digits, byte fallback, and Llama's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True),
        ]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA_SPECIAL, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    # Byte fallback: every byte gets a <0xXX> token so unseen characters stay encodable (Llama-2 style).
    vocab = tok.get_vocab()
    merges = json.loads(tok.to_str())["model"]["merges"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok.model = models.BPE(
        vocab=vocab,
        merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges],
        unk_token="<unk>",
        byte_fallback=True,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|eot_id|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["</s>", "<|start_header_id|>", "<|end_header_id|>"],
        chat_template=LLAMA_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------------------------- model
def build_model(build: dict, tokenizer, seed: int):
    """A randomly initialised Qwen3 / Llama causal LM of the shape given by ``model.build``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    arch = build["architecture"]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=build["hidden_size"],
        intermediate_size=build["intermediate_size"],
        num_hidden_layers=build["num_layers"],
        num_attention_heads=build["num_heads"],
        num_key_value_heads=build["num_kv_heads"],
        head_dim=build["head_dim"],
        max_position_embeddings=build["max_position_embeddings"],
        tie_word_embeddings=build["tie_word_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        attention_dropout=0.0,
    )
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ConfigError(f"model.build.architecture must be 'qwen3' or 'llama', got {arch!r}")
    seed_started_streams(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model


# ---------------------------------------------------------------------------------------------- warm start
def _prompt(tokenizer, question: str, chat_template_kwargs: dict, instruction: str) -> str:
    # Same rendering as grail_exp.data.prompting.render_prompt for prompt_style=chat without a system turn.
    return tokenizer.apply_chat_template([{"role": "user", "content": question + instruction}],
                                         add_generation_prompt=True, tokenize=False, **chat_template_kwargs)


def _encode_sft_batch(tokenizer, problems, chat_template_kwargs, instruction):
    """Left-padded ``prompt + solution + eos`` with labels on the completion only."""
    rows, labels = [], []
    for p in problems:
        prompt = _prompt(tokenizer, p.question, chat_template_kwargs, instruction)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + r for r in labels])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, attn, lab


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems, chat_template_kwargs, instruction: str = "",
                    max_new_tokens: int = 64) -> float:
    """Fraction of problems whose greedy completion's last ``\\boxed{}`` equals the gold answer exactly.

    Exact string match is enough for this integer-valued task and keeps the warm-start loop fast;
    RL and evaluation grade with math-verify.
    """
    from grail_exp.grading.boxed import extract_last_boxed

    was_training = model.training
    model.eval()
    prompts = [_prompt(tokenizer, p.question, chat_template_kwargs, instruction) for p in problems]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(extract_last_boxed(t) == p.answer for t, p in zip(texts, problems)) / len(problems)


def warm_start(model, tokenizer, task: ArithmeticTask, ws: dict, chat_template_kwargs: dict, instruction: str,
               seed: int) -> dict:
    """Supervised pass until greedy validation accuracy reaches ``ws['target_accuracy']``."""
    from tqdm.auto import tqdm

    seed_started_streams(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, ws["warmup_steps"])))
    val = list(task.split("validation"))[: ws["eval_problems"]]
    model.train()
    start, history, acc, step = time.time(), [], 0.0, 0
    bar = tqdm(total=ws["max_steps"], desc="warm start (SFT)", dynamic_ncols=True, leave=False)
    for step in range(1, ws["max_steps"] + 1):
        problems = _with_curriculum(
            task.train_problems(20_000_000 + seed * 1_000_000 + step * ws["batch_size"], ws["batch_size"]), ws)
        ids, attn, lab = _encode_sft_batch(tokenizer, problems, chat_template_kwargs, instruction)
        loss = model(input_ids=ids, attention_mask=attn, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.update(1)
        if step % ws["eval_every"] == 0:
            acc = greedy_accuracy(model, tokenizer, val, chat_template_kwargs, instruction)
            history.append({"step": step, "loss": loss.item(), "greedy_acc": acc, "seconds": time.time() - start})
            bar.set_postfix(loss=f"{loss.item():.3f}", greedy_acc=f"{acc:.2f}")
            if acc >= ws["target_accuracy"]:
                break
    bar.close()
    model.eval()
    return {"steps": step, "greedy_val_accuracy": acc, "seconds": time.time() - start, "history": history,
            "reached_target": acc >= ws["target_accuracy"]}


# ---------------------------------------------------------------------------------------------- cache
def cache_key(spec: dict) -> str:
    blob = json.dumps({"v": BUILD_VERSION, **spec}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def embedded_spec(build: dict, warm: dict, task: ArithmeticTask, chat_template_kwargs: dict,
                  instruction: str) -> dict:
    """Everything that determines the built model (``cache_key`` hashes it together with ``BUILD_VERSION``)."""
    if not warm.get("curriculum_fraction"):  # SCRL keys off: the key (and the cached model) of a plain build
        warm = {k: v for k, v in warm.items() if not k.startswith("curriculum_")}
    return {"build": build, "warm_start": warm, "task": _task_spec(task), "chat": chat_template_kwargs,
            "instruction": instruction}


# Task knobs added after models were built and shipped: at their defaults they stay out of the key, so those
# models (and every cache) keep their keys; set, they change the SFT data and therefore the key.
_LATER_TASK_KNOBS = {"train_seed": None, "solution_style": "compact"}


def _task_spec(task: ArithmeticTask) -> dict:
    return {k: v for k, v in asdict(task).items() if k not in _LATER_TASK_KNOBS or v != _LATER_TASK_KNOBS[k]}


# ---------------------------------------------------------------------------------------------- shipped artifact
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "embedded"
MANIFEST = "grail_exp_manifest.json"


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    f = Path(directory) / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else None


def shipped_mismatches(directory: str | os.PathLike, manifest: dict) -> list[str]:
    """Files of a shipped artifact that are missing or whose sha256 differs from the manifest's (empty: intact)."""
    d = Path(directory)
    return [name for name, sha in manifest["files"].items()
            if not (d / name).is_file() or file_sha256(d / name) != sha]


def find_shipped_model(key: str, shipped_dir: str | os.PathLike | None = None) -> Path | None:
    """The packaged warm-started model built for exactly ``key``, if one ships and is intact; else None."""
    for manifest_file in sorted(Path(shipped_dir or SHIPPED_DIR).glob(f"*/{MANIFEST}")):
        if manifest_file.parent.name.startswith("."):  # the rebuild script's temp dir
            continue
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("cache_key") != key:
            continue
        bad = shipped_mismatches(manifest_file.parent, manifest)
        if bad:  # a damaged install: the builder still produces a correct model, only slower
            log.warning("shipped embedded model %s: %s missing or not matching the manifest's sha256; building "
                        "instead", manifest_file.parent, ", ".join(bad))
            return None
        return manifest_file.parent
    return None


def warm_start_estimate(n_params: int, warm: dict, shipped_dir: str | os.PathLike | None = None) -> str:
    """How long a warm start of ``warm`` on a model of ``n_params`` parameters should take, in words: scaled from the
    shipped build's measured one (its grail_exp_build.json) by parameters x batch size (an SFT step's FLOPs on the
    same task's lengths). It stops at ``target_accuracy``: expected = the shipped build's steps to its target, at
    most ``max_steps``."""
    steps, batch = int(warm["max_steps"]), int(warm["batch_size"])
    what = f"a warm start of up to {steps} SFT steps of {batch} problems (until greedy validation accuracy " \
           f"{warm['target_accuracy']})"
    refs = sorted(Path(shipped_dir or SHIPPED_DIR).glob(f"*/{BUILD_MARKER}"))
    if not refs:
        return f"{what}; no shipped build to estimate its duration from"
    ref = json.loads(refs[0].read_text())
    ref_steps, ref_s = ref["warm_start"]["steps"], ref["warm_start"]["seconds"]
    per_step = ref_s / ref_steps * (n_params / ref["parameters"]) * (batch / ref["spec"]["warm_start"]["batch_size"])
    expected, at_most = duration_words(per_step * min(steps, ref_steps)), duration_words(per_step * steps)
    return (f"{what}, expected {expected}, at most {at_most} "
            f"(the shipped build of {ref['parameters']:,} parameters: {ref_steps} steps of "
            f"{ref['spec']['warm_start']['batch_size']} in {ref_s:.0f} s, scaled by parameters x batch)")


def duration_words(seconds: float) -> str:
    """``~12 min`` / ``~40 s``: an estimate's precision."""
    return f"~{seconds / 60:.0f} min" if seconds >= 90 else f"~{seconds:.0f} s"


def ensure_embedded_model(build: dict, warm: dict, task: ArithmeticTask, chat_template_kwargs: dict,
                          instruction: str, cache_dir: str | os.PathLike, use_shipped: bool = True) -> Path:
    """Return the directory of the warm-started embedded model: the shipped artifact when it was built for exactly
    this spec (and ``use_shipped``), else the cached build, building and caching it if needed."""
    from grail_exp.models.build_cache import build_once

    spec = embedded_spec(build, warm, task, chat_template_kwargs, instruction)
    warm = spec["warm_start"]
    key = cache_key(spec)
    if use_shipped and (shipped := find_shipped_model(key)) is not None:
        manifest = read_manifest(shipped)
        log.info("embedded model: the shipped warm-started weights %s (key %s, built at commit %s, greedy validation "
                 "accuracy %.1f %%); no build needed", shipped, key, manifest["git_commit"][:12],
                 100 * manifest["warm_start"]["greedy_val_accuracy"])
        return shipped
    target = Path(cache_dir).expanduser() / "embedded" / f"{build['architecture']}-{key}"
    def build_into(tmp: Path) -> None:
        t0 = time.time()
        tokenizer = build_tokenizer(build["tokenizer"], task, build["vocab_size"], warm)
        seed = build.get("seed", 0)
        with random_streams_kept():  # the building job samples what a job loading the cached build samples
            model = build_model(build, tokenizer, seed)
            n_params = sum(p.numel() for p in model.parameters())
            log.info("embedded model: no shipped or cached build of this spec (key %s), so this run first builds it: "
                     "%s (cached afterwards at %s)", key,
                     warm_start_estimate(n_params, warm) if warm["enabled"] else "no warm start, seconds", target)
            report = warm_start(model, tokenizer, task, warm, chat_template_kwargs, instruction, seed) \
                if warm["enabled"] else {}
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"spec": spec, "parameters": n_params, "build_seconds": time.time() - t0, "warm_start": report}
        (tmp / BUILD_MARKER).write_text(json.dumps(meta, indent=2, default=str))
        acc = report.get("greedy_val_accuracy", math.nan)
        log.info("embedded model: %d parameters, warm start %.1f s, greedy validation accuracy %.1f %%",
                 n_params, meta["build_seconds"], 100 * acc)

    if not build_once(target, BUILD_MARKER, build_into):
        log.info("embedded model: the cached build %s", target)
    return target


def read_build_report(path: str | os.PathLike) -> dict[str, Any] | None:
    f = Path(path) / BUILD_MARKER
    return json.loads(f.read_text()) if f.exists() else None
