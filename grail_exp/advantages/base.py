"""Registry and the scheme contract shared by every advantage scheme.

A scheme turns a rollout batch into detached token weights w (B, C); the trainer forms Â = sg(w)·A. The
trainer drives a scheme in three calls, all optional but the last:

1. ``prepare(model, batch)`` once per rollout batch, with the **whole** rollout batch (complete groups of G
   rollouts, rewards, advantages, gold answers, problem texts, the step counters), after the advantages and before
   the μ updates. Batch-level schemes (DelTA's centroids, SHEAR's group distances) compute their weights here; the
   answer spans that GRAIL / OAR need are found here once instead of at every micro-batch. The return value comes
   back as ``batch.prepared`` (sliced to the micro-batch's rows by the trainer via ``SchemeBatch.prepared_rows``).
2. ``weights_from_forward(model, batch, forward)`` per micro-batch when the scheme can reuse the policy forward
   the trainer already runs for the loss (``forward``: the embeddings and hidden states of that forward, still in
   the autograd graph). GRAIL takes the gradient of its answer NLL from this graph, OAR-G its clean teacher:
   one forward fewer, the same numbers (tests compare with ``weights``). Return None to fall back to 3.
3. ``weights(model, batch)`` per micro-batch: the straightforward implementation with its own forward passes.

``config.recompute`` (every scheme): ``per_update`` (default; both references recompute the weights at every
micro-batch and every inner iteration with the current parameters, spec §3) or ``per_rollout`` (each row's weights
computed once per rollout batch, with the parameters that generated it, and reused by every epoch and mini-batch:
with k > 1 mini-batches the trainer computes those of mini-batches 2..k through ``weights`` before the first
optimiser step; ``UpdatePhase.weigh_later_mini_batches``).
Multi-GPU: ``prepare`` sees the rollout batch of its own data-parallel rank (all G rollouts of a prompt stay on one
rank), so batch-level statistics are per rank, as DelTA's official code computes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from grail_exp.compute.forward import PolicyForward  # noqa: F401  (part of the scheme contract)
from grail_exp.registry import Registry

SCHEMES: Registry = Registry("advantage scheme")
RECOMPUTE = ("per_update", "per_rollout")


@dataclass
class SchemeConfig:
    """Keys every scheme has (each scheme's config dataclass inherits them)."""

    name: str = "?"
    # per_update: recompute the weights at every micro-batch and inner iteration with the live parameters
    # (both reference codebases, spec §3) | per_rollout: once per rollout batch with the parameters that generated
    # it, reused by all k x mu optimiser steps of the batch (cheaper; a logged deviation from the references)
    recompute: str = "per_update"


@dataclass
class SchemeBatch:
    """A micro-batch (or the whole rollout batch, in ``prepare``) as a scheme sees it. P = padded prompt width,
    C = padded completion width.

    Prompts are left-padded and completions right-padded, so ``input_ids[:, P:]`` is the completion window and
    ``input_ids[:, P-1:-1]`` are the input positions that *predict* the completion tokens.
    """

    input_ids: torch.Tensor  # (B, P+C) prompt ++ completion
    attention_mask: torch.Tensor  # (B, P+C) 1 on real prompt and generated completion tokens
    position_ids: torch.Tensor  # (B, P+C) cumsum(attention_mask) - 1: the positions generate() used
    prompt_length: int  # P
    completion_ids: torch.Tensor  # (B, C)
    completion_mask: torch.Tensor  # (B, C) loss mask: generated tokens up to EOS, 0 for masked truncations
    advantages: torch.Tensor  # (B,) sequence advantages A_i (for token-level estimators: the row's sequence summary)
    rewards: torch.Tensor  # (B,)
    completion_texts: list[str] | None = None  # decoded completions (special tokens skipped)
    sampling_temperature: float = 1.0  # the rollout temperature (GRAIL's probe divides its logits by it)
    generator: torch.Generator | None = None  # seeded RNG for stochastic schemes (OAR-G noise)
    # Rollout-batch context (filled by the trainer and the weights CLI; None where unknown)
    row_index: torch.Tensor | None = None  # (B,) rows of the rollout batch these are (indexes ``prepared``)
    group_ids: torch.Tensor | None = None  # (B,) prompt index: rows with equal ids are one group of G rollouts
    num_generations: int | None = None  # G
    problems: list[str] | None = None  # the problem text of each row (privileged / teacher prompts)
    gold_answers: list[str] | None = None  # the reference answer of each row (RLSD's teacher, ...)
    prompt_ids: list[list[int]] | None = None  # unpadded prompt token ids per row
    token_advantages: torch.Tensor | None = None  # (B, C) when the estimator is token-level
    step: int = 0  # optimiser steps done so far
    prepared: Any = None  # what ``prepare`` returned for the rollout batch
    # 1-based index of the rollout batch these rows come from: 1 for the run's first rollout batch, +1 per rollout
    # batch, the same for every optimiser step (inner iteration, mini-batch) taken on it; after a resume it continues
    # (rollout batches completed before + 1). It is the official verl-based trainers' ``global_step(s)`` (RLSD, SDPG:
    # incremented before each batch is generated). None = step + 1 (exact when each rollout batch gives one optimiser
    # step). Schedules read it through ``rollout_index()``.
    rollout_step: int | None = None

    def rollout_index(self) -> int:
        return self.rollout_step if self.rollout_step is not None else self.step + 1

    def rows_with_advantage(self) -> torch.Tensor:
        """(B,) bool: rows whose advantage is nonzero somewhere (the row's A, or any of its token advantages under a
        token-level estimator, whose row summary can be 0 with nonzero tokens). Only these rows' weights reach the
        gradient (Â = sg(w)·A): a scheme may skip the model work for the others."""
        if self.token_advantages is not None:
            return self.token_advantages.ne(0).any(1)
        return self.advantages.ne(0)

    def rows(self, idx: torch.Tensor) -> SchemeBatch:
        """The sub-batch of the given row indices (same P and C)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.input_ids.shape[0]:
                v = v[idx.to(v.device)]
            elif isinstance(v, list) and len(v) == self.input_ids.shape[0]:
                v = [v[i] for i in idx.tolist()]
            out[f.name] = v
        return replace(self, **out)


@dataclass
class SchemeOutput:
    weights: torch.Tensor  # (B, C), detached, > 0 on valid tokens
    metrics: dict[str, float] = field(default_factory=dict)  # logged as "<scheme>/<key>"


class AdvantageScheme:
    """Base class. Subclasses set ``name`` / ``config_class`` (via ``register_scheme``) and implement ``weights``."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    # False for schemes that never look at the model (GRPO): the trainer can skip work for them.
    needs_model: ClassVar[bool] = True
    # Extra outputs the trainer's policy forward must produce for ``weights_from_forward`` ("hidden_states").
    forward_outputs: ClassVar[tuple[str, ...]] = ()
    # True when ``weights`` must see the rollout batch's ``prepared`` state (batch-level schemes).
    batch_level: ClassVar[bool] = False
    # Run settings the scheme is defined with, {dotted key: value}; validate() refuses a run that changes one
    # (grail_exp/validate.py required_settings). None of the shipped schemes has any.
    requires: ClassVar[dict[str, Any]] = {}
    # False for schemes whose weights depend on the order of the rows in the micro-batches (OAR-G draws its noise row
    # by row from a seeded stream): the trainer then never reorders rows for speed (``RolloutPhase.prepare``).
    row_order_invariant: ClassVar[bool] = True
    # True when ``weights_from_forward`` asks the policy forward for the input gradient of the micro-batch's leading rows
    # (``PolicyForward.input_gradient(..., rows=)``: the probe rows, which the trainer puts first); the row-order cost
    # model then counts that backward on those rows only where the forward narrows (``training/row_order.py``).
    probes_leading_rows: bool = False
    # Passes over a micro-batch's completions this scheme adds to the update, in forwards' worth of matmul FLOPs (GRAIL:
    # its probe's input-gradient backward; OAR-G: its noisy forward and that backward): the bench's arithmetic floor.
    planned_completion_passes: ClassVar[int] = 0

    def __init__(self, cfg, tokenizer=None, context: dict | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.context = context or {}  # model config (prompt building), seed, ...: what a scheme may need to build

    @property
    def share_prompts(self) -> bool:
        """Whether this scheme's own forwards compute each distinct prompt once (``trainer.share_prompts``, given in
        the context by the trainer; ``grail_exp.compute.forward.body_forward``)."""
        return bool(self.context.get("share_prompts", False))

    @staticmethod
    def check_config(cfg) -> list[str]:
        """Problems with the scheme's config, each as ``"<key> = <value>: <why>"``; empty if valid."""
        return []

    @classmethod
    def planned_update_transient(cls, cfg, graph_bytes: float) -> tuple[str, float, str] | None:
        """The memory planner's question (``grail_exp/memory/plan.py``), answered from the config before any model
        exists: the largest transient this scheme adds on top of a micro-batch's saved activations during the update,
        as ``(what, bytes, how)``; ``graph_bytes`` is what one graph of the micro-batch holds (its saved activations
        plus a layer recomputed in backward). None (the default): nothing beyond the policy's own forward."""
        return None

    def prepare(self, model: torch.nn.Module, batch: SchemeBatch) -> Any:
        return None

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        raise NotImplementedError

    def weights_from_forward(self, model: torch.nn.Module, batch: SchemeBatch,
                             forward: PolicyForward) -> SchemeOutput | None:
        return None

    def rows_needing_model(self, batch: SchemeBatch) -> torch.Tensor | None:
        """(B,) bool: rows whose weights depend on the model and can change the loss (the probe rows). The trainer
        groups them into the same micro-batches so the others skip the probe. None = all rows."""
        return None

    def spans(self, batch: SchemeBatch):
        """The answer-span token masks of the batch, with this scheme's ``span_mapping`` and ``box`` switches
        (taken from ``prepare``'s result when the rollout batch's spans were found there)."""
        from grail_exp.spans import answer_spans

        prepared = batch.prepared
        if isinstance(prepared, dict) and "spans" in prepared:
            return prepared["spans"]
        return answer_spans(batch.completion_ids, batch.completion_mask, self.tokenizer,
                            span_mapping=self.cfg.span_mapping, box=self.cfg.box, texts=batch.completion_texts)


def slice_prepared(prepared: Any, idx: torch.Tensor) -> Any:
    """Index a scheme's prepared state by rollout rows: tensors (N, ...) and objects with ``select(idx)``, in dicts."""
    if prepared is None:
        return None
    if isinstance(prepared, dict):
        return {k: slice_prepared(v, idx) for k, v in prepared.items()}
    if isinstance(prepared, torch.Tensor):  # before ``select``: tensors have a ``select(dim, index)`` method
        return prepared[idx.to(prepared.device)] if prepared.dim() >= 1 else prepared
    if hasattr(prepared, "select"):
        return prepared.select(idx)
    return prepared


def register_scheme(name: str, config_class: type) -> Callable[[type[AdvantageScheme]], type[AdvantageScheme]]:
    """Class decorator: ``@register_scheme("grail", GrailConfig)``."""

    def attach(cls: type[AdvantageScheme]) -> None:
        cls.name, cls.config_class = name, config_class

    return SCHEMES.register(name, then=attach)


def scheme_config_class(name: str) -> type:
    return SCHEMES[name].config_class


def check_common(cfg, batch_level: str | None = None) -> list[str]:
    """Checks of the keys every scheme has. ``batch_level``: the name of a scheme whose weights are statistics of the
    whole rollout batch (``AdvantageScheme.batch_level``), which only ``recompute: per_rollout`` can give."""
    rc = cfg.get("recompute", "per_update") if hasattr(cfg, "get") else getattr(cfg, "recompute", "per_update")
    if rc not in RECOMPUTE:
        return [f"recompute = {rc!r}: must be one of {', '.join(RECOMPUTE)}"]
    if batch_level and rc != "per_rollout":
        return [f"recompute = {rc!r}: {batch_level} computes its batch-level weights once per rollout batch; "
                "use per_rollout"]
    return []


def build_scheme(cfg, tokenizer=None, context: dict | None = None) -> AdvantageScheme:
    return SCHEMES[cfg.name](cfg, tokenizer, context)  # an unknown name: an error naming the known ones
