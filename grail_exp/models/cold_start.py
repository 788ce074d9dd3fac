"""A supervised cold start of a pretrained model on the arithmetic task's own chain solutions: built once, cached,
recorded with its build configuration and hashes (``model.cold_start``; the real-model study's starting weights).

Small instruct models rarely answer the chain task in its format, and worked examples in the prompt cost ~200
prompt tokens per completion (results/real_model_study.md, section 1). A few dozen AdamW steps on the generator's
solutions instead teach the format with a zero-shot prompt:

- **Data**: ``steps × batch_size`` problems of the task's training stream from index ``first_index`` on (far from
  where any RL run reads it; always the stream of ``data.seed``, whatever ``data.train_seed`` says, so every seed of a
  study starts from the same weights), each prompt rendered exactly as training and evaluation render it
  (``grail_exp.data.prompting``: the model's chat template, system turn, instruction), its completion the generator's
  ``solution`` in ``data.solution_style`` followed by EOS; the loss on the completion only.
- **Update**: float32 weights, bfloat16 autocast, AdamW (``lr``, no weight decay), gradient norm clipped to 1, the
  seed ``seed``; on CUDA when there is one (the GPU row builds it in seconds), else on the CPU.
- **Cache**: ``<paths.cache_dir>/cold_start/<key>/`` where the key hashes the starting weights' sha256, this
  configuration, the task's knobs and the rendered prompt of a probe question, with ``VERSION``. Written into a
  private folder and renamed into place under a file lock (parallel jobs build once). The manifest
  ``grail_exp_cold_start.json`` (written last: its presence means complete) holds the key, everything it hashes, the
  sha256 of every file, the build's wall and CPU seconds, device, thread count and losses.

Deterministic on one machine and thread count (same data, seed and order); another CPU or a GPU computes other
rounding, so a rebuild elsewhere is the same recipe, not the same bits: the study records the starting weights'
sha256 with every arm (``start_weights.sha256``) and the report refuses arms that started from different ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger(__name__)

VERSION = 1  # bump when the procedure changes: cached builds are then rebuilt
MANIFEST = "grail_exp_cold_start.json"
PROBE_QUESTION = "Compute 1+2."  # its rendered prompt goes into the key (template, system turn, instruction)


def _task(cfg):
    """The task whose solutions the cold start learns: the run's, with the training stream of ``data.seed``."""
    from omegaconf import OmegaConf

    from grail_exp.data.sources import arithmetic_task

    return arithmetic_task(OmegaConf.merge(cfg.data, {"train_seed": None}))


def spec(cfg, base_sha256: str, tokenizer) -> dict:
    """Everything that determines the built weights (``cache_key`` hashes it)."""
    from omegaconf import OmegaConf

    from grail_exp.data.prompting import render_prompt

    cs = OmegaConf.to_container(cfg.model.cold_start, resolve=True)
    cs.pop("enabled", None)
    return {"version": VERSION, "base_weights_sha256": base_sha256, "cold_start": cs, "task": asdict(_task(cfg)),
            "probe_prompt": render_prompt(PROBE_QUESTION, tokenizer, cfg.model, cfg.data.instruction)}


def cache_key(s: dict) -> str:
    return hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]


# The measured build an estimate scales from: SmolLM2-135M-Instruct (134,515,008 parameters), 40 steps x 8 problems
# in 630 s of wall time (446 CPU s) on this project's 2-core CPU machine at 2 threads (its manifest's build record;
# results/real_model_study.md section 1). A step's cost scales with parameters x batch (its FLOPs, same task lengths).
REFERENCE_BUILD = {"parameters": 134_515_008, "batch_size": 8, "seconds_per_step": 630.0 / 40}


def estimate(base_dir: str, cs) -> str:
    """The build in words with its expected duration on the CPU (scaled from ``REFERENCE_BUILD``); a GPU builds it
    in seconds (not measured here)."""
    import torch

    from grail_exp.models.architectures import parameter_counts
    from grail_exp.models.embedded import duration_words

    what = f"{cs.steps} AdamW steps x {cs.batch_size} problems"
    if torch.cuda.is_available():
        return f"{what} on CUDA, expected seconds"
    try:
        n = parameter_counts(json.loads((Path(base_dir) / "config.json").read_text()))["total"]
    except (OSError, KeyError, ValueError):  # an architecture the analytic count does not know: no estimate
        return f"{what} on the CPU (no estimate: {base_dir}/config.json is not a dense Llama / Qwen3 decoder)"
    ref = REFERENCE_BUILD
    seconds = cs.steps * ref["seconds_per_step"] * n / ref["parameters"] * cs.batch_size / ref["batch_size"]
    return (f"{what} on the CPU, expected {duration_words(seconds)} ({n:,} parameters; measured: SmolLM2-135M's 40 x 8 "
            f"in {40 * ref['seconds_per_step']:.0f} s on 2 cores, scaled by parameters x batch)")


def ensure_cold_start(base_dir: str, cfg, load_tokenizer, load_causal_lm) -> str:
    """The cold-started model directory for ``cfg`` (built from ``base_dir`` on first use, then cached).

    ``load_tokenizer`` / ``load_causal_lm``: ``grail_exp.models.loading``' loaders, handed in by ``models.resolve_model_path``
    (the one caller), so that this module stays below models.py instead of importing it back."""
    from grail_exp.models.architectures import weights_sha256
    from grail_exp.models.build_cache import build_once

    tokenizer = load_tokenizer(base_dir, cfg)
    s = spec(cfg, weights_sha256(base_dir), tokenizer)
    out = Path(cfg.paths.cache_dir).expanduser() / "cold_start" / f"{Path(base_dir).name}-{cache_key(s)}"

    def build_into(tmp: Path) -> None:
        log.info("cold start: no cached build of this configuration, so this run first builds it: %s on the task's "
                 "solutions from %s (once; cached afterwards at %s)", estimate(base_dir, cfg.model.cold_start),
                 base_dir, out)
        build = train(base_dir, cfg, tokenizer, tmp, load_causal_lm)
        files = {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"key": cache_key(s), **s, "base_dir": str(base_dir),
                                                "files": files, "build": build}, indent=1))
        log.info("cold start built in %.0f s (loss %.3f -> %.3f): %s", build["seconds"], build["losses"][0],
                 build["losses"][-1], out)

    build_once(out, MANIFEST, build_into)
    return str(out)


def train(base_dir: str, cfg, tokenizer, out: Path, load_causal_lm) -> dict:
    """The supervised pass; saves the float32 model and the tokenizer into ``out``; returns the build record. Its seed
    and draws stay inside: the job that builds the cold start samples what a job loading it from the cache samples."""
    import torch

    from grail_exp.checkpoint import random_streams_kept

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with random_streams_kept(init_cuda=device == "cuda"):
        return _train(base_dir, cfg, tokenizer, out, load_causal_lm, device)


def _train(base_dir: str, cfg, tokenizer, out: Path, load_causal_lm, device: str) -> dict:
    import torch
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from grail_exp.checkpoint import seed_started_streams

    cs, task = cfg.model.cold_start, _task(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    seed_started_streams(cs.seed)
    model = load_causal_lm(base_dir, OmegaConf.merge(cfg, {"model": {"dtype": "float32"}}), trainable=True).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cs.lr, weight_decay=0.0)
    losses = []
    for step in tqdm(range(cs.steps), desc="cold start (SFT)", dynamic_ncols=True, leave=False):
        problems = task.train_problems(cs.first_index + step * cs.batch_size, cs.batch_size)
        ids, attn, labels = (x.to(device) for x in sft_batch(problems, tokenizer, cfg))
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 5))
    model.to("cpu").save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1),
            "device": device, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "losses": losses}


def sft_batch(problems, tokenizer, cfg):
    """Left-padded ``prompt + solution + EOS`` (prompts rendered as training renders them), labels on the completion."""
    import torch

    from grail_exp.data.prompting import encode_prompts

    prompts = encode_prompts([p.question for p in problems], tokenizer, cfg.model, cfg.data.instruction)
    rows, labels = [], []
    for p_ids, p in zip(prompts, problems):
        c_ids = tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width, pad = max(map(len, rows)), tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    lab = torch.tensor([[-100] * (width - len(r)) + r for r in labels])
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, attn, lab


def read_manifest(path: str | os.PathLike) -> dict | None:
    f = Path(path) / MANIFEST
    return json.loads(f.read_text()) if f.is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
