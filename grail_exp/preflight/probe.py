"""The preflight's probe (``GRAIL_EXP_PROBE=grail_exp.preflight.probe:PreflightProbe``): every rank of a rehearsal
run writes what it did, one JSON line per probe point (grail_exp/training/probe_points.py), to
``$GRAIL_EXP_PROBE_DIR/rank<r>.jsonl``; the preflight's checks judge the run by these files.

Every record carries the rank, the time, the peak memory so far (this device's CUDA allocator; the process's
resident set), the resident set now, and this process's collectives by device (``world.collective_devices``).
Besides:

- ``setup``: the world (size, rank, backend), this process's pid and host, the rank's device, the engine, and what
  the CUDA allocator holds once the engine is built (the engine's share: nothing else is on the device yet, the
  policy is moved there after ``setup``; vLLM sizes it by ``gpu_memory_utilization``, not by the model's depth);
- ``started``: a fingerprint of the full weights once they are placed (restored, when resuming);
- ``synced``: the engine's log-probs of a fixed completion against the trainer's forward on the same tokens, and under
  ``peft.sync=adapter`` the adapter version it used and the adapters the engine lists;
- ``step``: the step and a fingerprint of the full weights;
- ``evaluated``: which rank generated each chunk, the problems in each chunk and each rank's, a digest of the gathered
  result.

A stop signal delivered by the preflight: at step ``$GRAIL_EXP_PREFLIGHT_STOP_STEP`` the rank
``$GRAIL_EXP_PREFLIGHT_STOP_RANK`` writes its record, then waits until the preflight has sent it SIGTERM (the file
``signal_sent`` appears in the probe directory), so the signal lands during that step on every machine, however busy.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import torch

from grail_exp.compute.host import peak_resident_bytes, resident_bytes

QUESTION = "Compute 12+7."  # the fixed prompt whose continuation the engine and the trainer both score
SIGNAL_FILE = "signal_sent"
STOP_RANK, STOP_STEP = "GRAIL_EXP_PREFLIGHT_STOP_RANK", "GRAIL_EXP_PREFLIGHT_STOP_STEP"
SIGNAL_WAIT_S = 600  # the preflight sends the signal within a poll interval; this only guards a dead preflight
FINGERPRINT_CHUNK = 1 << 24  # elements summed at a time: the fingerprint needs no copy of a whole tensor


def fingerprint(tensors) -> str:
    """A digest of ``(name, tensor)`` pairs computed where the tensors live: per tensor, float64 sums of its values,
    their squares and their products with their positions, in chunks. Equal weights give equal digests on the same
    device type; a checkpoint that loses or reorders a value changes it."""
    h = hashlib.sha256()
    for name, t in tensors:
        flat = t.detach().reshape(-1)
        sums = torch.zeros(3, dtype=torch.float64, device=flat.device)
        for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
            x = flat[start:start + FINGERPRINT_CHUNK].to(torch.float64)
            pos = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.float64, device=x.device)
            sums += torch.stack([x.sum(), (x * x).sum(), (x * pos).sum()])
        h.update(f"{name}:{tuple(t.shape)}:{str(t.dtype)}:".encode())
        h.update(sums.cpu().numpy().tobytes())
    return h.hexdigest()


class PreflightProbe:
    def __init__(self):
        self.dir = Path(os.environ["GRAIL_EXP_PROBE_DIR"])
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, point: str, **data) -> None:
        from grail_exp import world

        rec = {"point": point, "rank": world.rank(), "time": time.time(),
               "peak_rss_bytes": peak_resident_bytes(), "rss_bytes": resident_bytes(),
               "collectives": world.collective_devices(), **data}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rec["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        with open(self.dir / f"rank{world.rank()}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    def setup(self, module):
        from grail_exp import world

        engine = module.rollout.engine
        # the device Lightning placed this rank on (a rank that receives rank 0's weights holds a meta skeleton here)
        device = str(module.trainer.strategy.root_device)
        engine_bytes = 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = f"cuda:{torch.cuda.current_device()}"
            engine_bytes = torch.cuda.memory_allocated()
        peft = module.cfg.get("peft") or {}
        self._write("setup", world_size=world.world_size(), backend=world.backend_name(), pid=os.getpid(),
                    host=socket.gethostname(), device=device, local_rank=os.environ.get("LOCAL_RANK"),
                    engine=type(engine).__name__, engine_cuda_bytes=engine_bytes, peft=str(peft.get("name", "none")),
                    peft_sync=peft.get("sync"))

    def started(self, module):
        self._write("started", step=module.step, weights=fingerprint(module.backend.full_tensors()))

    def synced(self, backend, engine):
        temperature = float(backend.module.cfg.rollout.temperature)
        tokens, engine_lp, trainer_lp = engine_and_trainer_logprobs(backend, engine, temperature)
        self._write("synced", tokens=tokens, engine=engine_lp.tolist(), trainer=trainer_lp.tolist(),
                    **adapter_in_engine(engine))

    def step(self, module, step):
        self._write("step", step=step, weights=fingerprint(module.backend.full_tensors()))
        from grail_exp import world

        if os.environ.get(STOP_RANK) == str(world.rank()) and os.environ.get(STOP_STEP) == str(step):
            end = time.monotonic() + SIGNAL_WAIT_S
            while not (self.dir / SIGNAL_FILE).exists() and time.monotonic() < end:
                time.sleep(0.05)

    def evaluated(self, module, tag, result):
        chunks = {str(k): int(v) for k, v in result.generated_by.items()}
        digest = hashlib.sha256(json.dumps([s.get("completion") for s in result.samples]).encode()).hexdigest()
        per_call = max(1, int(module.cfg.eval.batch_size) // int(module.cfg.eval.n))
        self._write("evaluated", tag=tag, generated_by=chunks, samples=len(result.samples), digest=digest,
                    problems_by_rank=problems_by_rank(result.samples, chunks, per_call),
                    chunk_problems=problems_by_chunk(result.samples, per_call))


def problems_by_chunk(samples: list[dict], per_call: int) -> dict[str, int]:
    """``<benchmark>/<chunk>`` -> its distinct problems: a problem's chunk is its index // the problems per generate
    call (grail_exp/evaluation.py)."""
    out: dict[str, int] = {}
    for b, i in sorted({(s["benchmark"], int(s["problem_index"])) for s in samples}):
        key = f"{b}/{i // per_call}"
        out[key] = out.get(key, 0) + 1
    return out


def adapter_in_engine(engine) -> dict:
    """peft.sync=adapter: the adapter version generation now uses and the adapters the engine itself lists (its own
    ``list_loras``); {} for an engine without one."""
    request = getattr(engine, "adapter_request", None)
    if request is None:
        return {}
    return {"adapter": request.lora_name, "adapter_id": int(request.lora_int_id),
            "engine_adapters": sorted(int(i) for i in engine.adapters.loaded())}


def problems_by_rank(samples: list[dict], generated_by: dict[str, int], per_call: int) -> dict[str, int]:
    """rank -> distinct problems whose completions that rank generated (``generated_by`` names each
    ``<benchmark>/<chunk>``'s rank; "?" when unnamed)."""
    out: dict[str, int] = {}
    for key, n in problems_by_chunk(samples, per_call).items():
        r = str(generated_by.get(key, "?"))
        out[r] = out.get(r, 0) + n
    return out


def engine_and_trainer_logprobs(backend, engine, temperature: float = 1.0, max_new_tokens: int = 12):
    """The engine's completion of the fixed ``QUESTION`` (greedy at T = 1, sampled at T otherwise: both sides divide
    by it) and the log-probs of its tokens as the engine reported them and as the trainer's policy forward computes
    them: (token ids, engine (T,), trainer (T,)), float32 on the CPU. The run's RNG streams are left untouched."""
    from grail_exp.checkpoint import random_streams_kept
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.rollout import SamplingParams, pad_completions

    module = backend.module
    cfg = module.cfg
    params = SamplingParams(n=1, temperature=0.0 if temperature == 1.0 else temperature,
                            max_new_tokens=max_new_tokens, logprobs=True)
    prompt = encode_prompts([QUESTION], module.tokenizer, cfg.model, cfg.data.instruction)
    with random_streams_kept(), backend.generation(engine):
        out = engine.generate(prompt, params)
    rb = pad_completions(out, module.tokenizer.pad_token_id)
    dev = module.policy.device
    mask = rb.attention_mask.to(dev)
    with torch.no_grad():
        trainer, _, _ = backend.forward(module.policy, rb.input_ids.to(dev), mask, position_ids_from_mask(mask),
                                        rb.completion_ids.to(dev))
    m = rb.completion_mask.bool()
    return out[0].token_ids, rb.sampling_logprobs[m].float(), trainer.float().cpu()[m]

