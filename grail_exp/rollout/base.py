"""The rollout-engine protocol: what the trainer and the evaluator need from a generator.

An engine turns tokenised prompts into ``n`` sampled completions each and reports, per completion,
the token ids, the log-probabilities under the *sampling* distribution and whether it was cut off at
the token budget. ``rollout=hf`` (transformers ``generate``) implements it on any device;
``rollout=vllm`` implements the same protocol, unchanged for its callers.

Weights. An engine that samples from the policy object itself (HF) only needs ``sync_weights(model)``. An engine
that keeps its own copy (vLLM) also offers ``load_weights(chunks)``: it consumes the policy's full parameters as
an iterator of chunks, each a list of ``(name, tensor)`` pairs in the engine's dtype (``dtype``) of at most
``sync_chunk_bytes`` bytes (one tensor larger than that travels alone; ``grail_exp/compute/chunks.py``). The update
backend produces that iterator from any parallel layout, gathering sharded parameters one chunk at a time
(``UpdateBackend.weight_chunks``), so the trainer never holds a second full copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    repetition_penalty: float = 1.0
    # Return log π(sampled token) under the temperature-scaled, *untruncated* distribution log softmax(z / T): the
    # quantity the trainer computes, so sampler-vs-trainer diagnostics and IS ratios compare like with like
    # (top-k / top-p only restrict which tokens can be drawn). Training asks for them; evaluation never does.
    logprobs: bool = False
    # Engines that batch many requests (vLLM): give each completion its own seed, drawn from torch's RNG, so it depends
    # on that seed alone and not on what else the engine batched with it — evaluation's common random numbers (each
    # chunk seeded on its own) ask for this. None = the engine's default (vLLM: rollout.vllm.seeded_rollouts, off: its
    # batched sampling stream, the fast path). rollout=hf always draws from torch's RNG and ignores it.
    per_request_seeds: bool | None = None


@dataclass
class Completion:
    """One sampled completion, unpadded."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, up to and including the stop token when there is one
    logprobs: list[float] | None  # log softmax(z/T)[token] of each generated token (None unless asked for)
    truncated: bool  # True when the token budget ran out before a stop token


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``len(prompts) * params.n`` completions, prompt-major: rows j*n … j*n+n-1 belong to prompt j."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current parameters (and wake it if it sleeps)."""
        ...

    # Optional: ``sleep()`` — give the engine's memory back until the next ``sync_weights`` (vLLM's sleep mode). The
    # trainer calls it (``release``) after each round's generation and after each evaluation.
    # Optional: ``load_weights(chunks)`` with ``dtype`` and ``sync_chunk_bytes`` attributes — the engine keeps its own
    # copy of the weights and takes them as streamed chunks (module docstring).


def release(engine) -> None:
    """Let an engine that can free its memory between generations do so (``rollout.vllm.sleep_mode``: weights and KV
    cache released for the update); the next ``sync_weights`` wakes it. A no-op for engines without ``sleep``."""
    sleep = getattr(engine, "sleep", None)
    if callable(sleep):
        sleep()


@dataclass
class RolloutBatch:
    """Completions padded into tensors: prompts left-padded, completions right-padded."""

    prompt_ids: torch.Tensor  # (N, P)
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, C)
    completion_mask: torch.Tensor  # (N, C) 1 on generated tokens (stop token included)
    sampling_logprobs: torch.Tensor | None  # (N, C), 0 on padding
    is_truncated: torch.Tensor  # (N,) bool

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


def pad_completions(completions: list[Completion], pad_id: int) -> RolloutBatch:
    """Pad a list of completions into a ``RolloutBatch`` (widths = the longest prompt / completion)."""
    P = max(len(c.prompt_ids) for c in completions)
    C = max(1, max(len(c.token_ids) for c in completions))
    N = len(completions)
    prompt_ids = torch.full((N, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((N, P), dtype=torch.long)
    completion_ids = torch.full((N, C), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((N, C), dtype=torch.long)
    has_lp = all(c.logprobs is not None for c in completions)
    logprobs = torch.zeros((N, C), dtype=torch.float32) if has_lp else None
    for i, c in enumerate(completions):
        if c.prompt_ids:
            prompt_ids[i, P - len(c.prompt_ids):] = torch.tensor(c.prompt_ids)
            prompt_mask[i, P - len(c.prompt_ids):] = 1
        if c.token_ids:
            completion_ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
            completion_mask[i, : len(c.token_ids)] = 1
            if has_lp:
                logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs, dtype=torch.float32)
    truncated = torch.tensor([c.truncated for c in completions], dtype=torch.bool)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, logprobs, truncated)
