"""What passes from the rollout phase to the update phase: a scored rollout batch (``TrainingBatch``), and the counters
every phase reads (``Progress``).

``TrainingBatch`` holds N = prompts × G rows, prompts left-padded to P and completions right-padded to C, all tensors
on the policy's device; ``scheme_view`` gives the advantage scheme its view of some rows (``SchemeBatch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grail_exp.advantages.base import SchemeBatch, slice_prepared


@dataclass
class Progress:
    """The training counters every phase reads (checkpointed with the run)."""

    step: int = 0  # optimiser steps done
    # Rollout batches drawn so far, the current one included: verl's 1-based trainer step (``global_steps``), which
    # RLSD's and SDPG's schedules count. Set from the round index at every training step; not checkpointed.
    rollouts: int = 0


@dataclass
class SchemeContext:
    """What a scheme's view of a batch carries besides the rows: the run's sampling temperature and G, the scheme's
    own seeded RNG stream (OAR-G's noise) and the live counters."""

    temperature: float
    num_generations: int
    generator: torch.Generator
    progress: Progress


@dataclass
class TrainingBatch:
    """A scored rollout batch, ready for the update (all tensors on the policy's device)."""

    input_ids: torch.Tensor  # (N, P+C)
    attention_mask: torch.Tensor  # (N, P+C)
    position_ids: torch.Tensor  # (N, P+C)
    prompt_length: int
    completion_ids: torch.Tensor  # (N, C)
    loss_mask: torch.Tensor  # (N, C) float
    advantages: torch.Tensor  # (N,) sequence advantages (the schemes' polarity); or the row summary of token ones
    rewards: torch.Tensor  # (N,)
    texts: list[str]
    old_logp: torch.Tensor | None = None  # (N, C) trainer log-probs at the rollout parameters (k × μ > 1 or IS)
    ref_logp: torch.Tensor | None = None  # (N, C) when beta > 0
    sampler_logp: torch.Tensor | None = None  # (N, C) the rollout engine's log-probs
    # (N, C) log M_t, the log top-k mass the sampler's processed (top-k-renormalised) log-probs drop: sampler + this =
    # the full-vocabulary log-prob. Only with an engine in processed_logprobs mode (rollout=vllm_paper).
    sampler_log_mass: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None  # (N, C) token-level estimators
    group_ids: torch.Tensor | None = None  # (N,) prompt index within the rank's batch
    problems: list[str] | None = None
    golds: list[str] | None = None
    cached_weights: torch.Tensor | None = None  # (N, C) recompute=per_rollout: weights at the rollout parameters
    weights_ready: torch.Tensor | None = None  # (N,) bool: rows whose cached_weights are computed
    order: torch.Tensor | None = None  # (N,) rollout row of each row (after grouping probe rows)
    prepared: Any = None  # what the scheme's ``prepare`` returned for the whole batch (rows in this batch's order)

    _TENSORS = ("input_ids", "attention_mask", "position_ids", "completion_ids", "loss_mask", "advantages", "rewards",
                "old_logp", "ref_logp", "sampler_logp", "sampler_log_mass", "token_advantages", "group_ids",
                "cached_weights", "weights_ready", "order")

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int, rows: tuple[int, int] | None = None):
        """(start, end) row ranges of ``size`` rows covering ``rows`` (default: the whole batch)."""
        first, last = rows if rows is not None else (0, self.num_rows)
        for s in range(first, last, size):
            yield s, min(s + size, last)

    def permute(self, perm: torch.Tensor) -> None:
        """Reorder the rows in place (tensors, lists and the scheme's prepared state)."""
        for k in self._TENSORS:
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, v[perm.to(v.device)])
        for k in ("texts", "problems", "golds"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, [v[i] for i in perm.tolist()])
        self.prepared = slice_prepared(self.prepared, perm)

    def scheme_view(self, ctx: SchemeContext, s: int | None = None, e: int | None = None) -> SchemeBatch:
        """The scheme's view of rows s:e (all rows when None), with the rollout-batch context."""
        sl = slice(s, e)
        rows = torch.arange(self.num_rows, device=self.input_ids.device)[sl]
        return SchemeBatch(
            input_ids=self.input_ids[sl], attention_mask=self.attention_mask[sl],
            position_ids=self.position_ids[sl], prompt_length=self.prompt_length,
            completion_ids=self.completion_ids[sl], completion_mask=self.loss_mask[sl],
            advantages=self.advantages[sl], rewards=self.rewards[sl], completion_texts=self.texts[sl],
            sampling_temperature=ctx.temperature, generator=ctx.generator, row_index=rows,
            group_ids=self.group_ids[sl] if self.group_ids is not None else None,
            num_generations=ctx.num_generations,
            problems=self.problems[sl] if self.problems else None,
            gold_answers=self.golds[sl] if self.golds else None,
            token_advantages=self.token_advantages[sl] if self.token_advantages is not None else None,
            step=ctx.progress.step, rollout_step=ctx.progress.rollouts or None,
            prepared=slice_prepared(self.prepared, rows) if s is not None else None,
        )

    def to_state(self) -> dict:
        return {"prompt_length": self.prompt_length, "texts": list(self.texts), "problems": self.problems,
                "golds": self.golds,
                "tensors": {k: getattr(self, k).detach().cpu() for k in self._TENSORS if getattr(self, k) is not None}}

    @classmethod
    def from_state(cls, st: dict, device, prepared: Any = None) -> TrainingBatch:
        t = {k: v.to(device) for k, v in st["tensors"].items()}
        if "cached_weights" in t and "weights_ready" not in t:
            # A buffer saved before the flag existed: weights are > 0 on valid tokens, so computed rows are non-zero.
            t["weights_ready"] = (t["cached_weights"] != 0).any(1)
        return cls(prompt_length=st["prompt_length"], texts=st["texts"], problems=st.get("problems"),
                   golds=st.get("golds"), prepared=prepared, **t)


def rank_rows(cfg) -> int:
    """Rows of one rollout batch on this rank: prompts_per_step × G over the data-parallel world (all G rollouts of a
    prompt stay on one rank, so group statistics are exact)."""
    from grail_exp import world

    return cfg.trainer.prompts_per_step * cfg.rollout.num_generations // world.world_size()


def mini_batch_rows(cfg) -> int:
    """Rows of one mini-batch (one optimiser step) on this rank: 1/k of the rank's rollout batch."""
    return rank_rows(cfg) // cfg.trainer.get("mini_batches_per_rollout", 1)


def micro_batch_rows(cfg) -> int:
    """Rows of one micro-batch (one forward / backward) on this rank."""
    return min(cfg.trainer.micro_batch_size, mini_batch_rows(cfg))
