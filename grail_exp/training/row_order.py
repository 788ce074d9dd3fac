"""The order in which the update runs a rollout batch's rows, chosen once per batch after the scheme's ``prepare``.

Within each mini-batch (a mini-batch keeps its rows, verl's order) and only where the loss does not depend on how rows
are split into micro-batches:

- **probe rows first**: the rows whose weights need the model (GRAIL's probe, OAR's teacher) go to the front, so the
  other micro-batches skip the probe and, inside a micro-batch, the probe's backward reads its leading rows only — as
  rows, or as the whole prompt groups holding them (which keeps each prompt's completions in one micro-batch, so its
  prompt is computed once), whichever ``update_work`` finds cheaper in decoder positions;
- **groups by length**: where rows may be reordered freely (``rows_reorderable``), groups of similar completion length
  next to each other with each group's rows together, so a micro-batch shares its prompts and pads little.

The same numbers up to float summation order: the order is a speed choice, never a change of the objective.
"""

from __future__ import annotations

import torch

from grail_exp.compute.forward import (
    can_share_prompts,
    common_prefix_mode,
    grouped_prefix_attention,
    narrows,
    prompt_pass_positions,
    share_prompts_of,
)
from grail_exp.training.batch import SchemeContext, TrainingBatch, micro_batch_rows, mini_batch_rows

# Aggregations whose value does not depend on how rows are split into micro-batches: rows may be reordered.
SPLIT_INVARIANT = ("grpo", "dr_grpo", "dapo", "token_sum", "seq_mean_token_sum")


def rows_reorderable(cfg, scheme) -> bool:
    """Whether the order of a mini-batch's rows changes nothing but float summation order: a split-invariant loss,
    no per-micro-batch statistic (the top-entropy quantile), a scheme that draws no per-row randomness in row
    order (OAR-G's noise)."""
    loss = cfg.loss
    return (loss.loss_type in SPLIT_INVARIANT and float(loss.get("top_entropy_quantile", 1.0) or 1.0) >= 1.0
            and scheme.row_order_invariant)


def update_order(batch: TrainingBatch, scheme, ctx: SchemeContext, cfg, policy) -> torch.Tensor | None:
    """The permutation of ``batch``'s rows the update runs in (``batch.prepared`` holds the scheme's ``prepare``), or
    None to keep the order."""
    if cfg.loss.loss_type not in SPLIT_INVARIANT:
        return None
    whole = batch.scheme_view(ctx)
    whole.prepared = batch.prepared
    needs = scheme.rows_needing_model(whole)
    probe_first = needs is not None and 0 < int(needs.sum()) < needs.numel()
    mini, micro = mini_batch_rows(cfg), micro_batch_rows(cfg)
    by_length = rows_reorderable(cfg, scheme) and batch.group_ids is not None and micro < mini
    if not (probe_first or by_length):
        return None
    order = row_order(batch, mini, needs if probe_first else None, by_length)
    if probe_first and batch.group_ids is not None:
        # Probe rows first can split every prompt's group across micro-batches, so each computes more distinct
        # prompts; whole groups keep the sharing. The cheaper of the two.
        share = share_prompts_of(cfg) if can_share_prompts(policy) else False
        packed = grouped_prefix_attention(policy)
        grouped = row_order(batch, mini, needs, by_length, whole_groups=True)
        leading = bool(scheme.probes_leading_rows) and narrows(policy)
        order = min((order, grouped), key=lambda o: update_work(batch, o, mini, micro, needs, share, packed, leading))
    return order


def row_order(batch: TrainingBatch, size: int, probe: torch.Tensor | None, by_length: bool,
              whole_groups: bool = False) -> torch.Tensor:
    """The permutation ``prepare`` applies, within each mini-batch of ``size`` rows (a mini-batch keeps its rows):
    probe rows first when ``probe`` is given (``whole_groups``: the groups holding a probe row first, each group's rows
    kept together), then (``by_length``) groups by their longest completion, each group's rows together and by length;
    otherwise the existing order (stable). A rollout batch holds each group's rows together, and every step here
    keeps them so except row-level probe ordering."""
    lengths = batch.attention_mask[:, batch.prompt_length:].sum(1)
    group = batch.group_ids
    parts = []
    for a in range(0, batch.num_rows, size):
        idx = torch.arange(a, min(a + size, batch.num_rows), device=lengths.device)
        if by_length:  # stable sorts from the least significant key: length, group, the group's longest
            g = group[idx]
            longest = torch.zeros(int(g.max()) + 1, dtype=lengths.dtype, device=g.device).scatter_reduce(
                0, g, lengths[idx], "amax")
            idx = idx[torch.argsort(lengths[idx], stable=True)]
            idx = idx[torch.argsort(group[idx], stable=True)]
            idx = idx[torch.argsort(longest[group[idx]], stable=True)]
        if probe is not None and whole_groups and group is not None:
            g = group[idx]  # each group's rows together, groups in order of first appearance, then probed groups first
            first = torch.full((int(g.max()) + 1,), idx.numel(), dtype=torch.long, device=g.device).scatter_reduce(
                0, g, torch.arange(idx.numel(), device=g.device), "amin")
            probed = torch.zeros_like(first).index_add_(0, g, probe[idx].long()) > 0
            idx = idx[torch.argsort(first[g], stable=True)]
            idx = idx[torch.argsort((~probed[group[idx]]).long(), stable=True)]
        elif probe is not None:
            idx = idx[torch.argsort((~probe[idx]).long(), stable=True)]
        parts.append(idx)
    return torch.cat(parts)


def update_work(batch: TrainingBatch, order: torch.Tensor, mini: int, micro: int, probe: torch.Tensor,
                share, packed: bool = False, leading: bool = False) -> int:
    """The update's work under a row order, in decoder positions: per micro-batch (``micro`` rows, within mini-batches
    of ``mini``), 3 × the positions its forward computes (forward + backward; each distinct prompt once when ``share``
    — their common prefix once too, as its ``share_prompt_prefix`` says — as ``grail_exp/compute/forward.py`` counts them, a
    group standing for a distinct prompt) and, when it holds a probe row, 1 × its suffix positions (a scheme's
    input-gradient pass through that forward, which stops at the prompt's keys) — with ``leading`` (the scheme asks
    for the input gradient of its leading rows and the forward narrows, ``grail_exp.compute.leading_rows``) those of its rows
    up to the last probe row.
    ``packed``: a shared suffix pass runs each row's own positions only (``forward.suffix_pass``), not the micro-batch's
    longest."""
    P = batch.prompt_length
    ids, attn = batch.input_ids[order, :P], batch.attention_mask[order, :P]
    prompt, completion = attn.sum(1), batch.attention_mask[order, P:].sum(1)
    group, needs = batch.group_ids[order], probe[order]
    work, n = 0, order.numel()
    for s in (s for a in range(0, n, mini) for s in range(a, min(a + mini, n), micro)):
        rows = slice(s, min(s + micro, n, (s // mini + 1) * mini))
        B, p, c = completion[rows].numel(), int(prompt[rows].max()), int(completion[rows].max())
        groups, inverse = torch.unique(group[rows], return_inverse=True)
        probed = needs[rows].nonzero()
        k = int(probed[-1]) + 1 if leading and probed.numel() else B  # the rows the probe's backward computes
        suffix, probe_suffix = B * (c + 1), k * (c + 1)
        if share and groups.numel() < B:  # one row of each group stands for its prompt
            dev = inverse.device
            one = torch.full((groups.numel(),), B, device=dev).scatter_reduce(0, inverse, torch.arange(B, device=dev),
                                                                               "amin") + s
            prompts = prompt_pass_positions(ids[one, P - p:P - 1], attn[one, P - p:P - 1], common_prefix_mode(share))
            if packed:
                suffix, probe_suffix = int(completion[rows].sum()) + B, int(completion[rows][:k].sum()) + k
            positions = prompts + suffix
        else:
            positions = B * (p + c)
        work += 3 * positions + (probe_suffix if probed.numel() else 0)
    return work
