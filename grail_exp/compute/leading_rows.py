"""Backward passes whose cotangent is nonzero on a micro-batch's leading rows only.

GRAIL's probe differentiates J — the answer log-probs of its probe rows — with respect to the policy forward's
embeddings, through the graph the loss backpropagates through afterwards (``GrailScheme.weights_from_forward``). The
trainer puts a micro-batch's probe rows first (``training/row_order.py``), and the decoder mixes positions only
within a row and from the row's prompt, which that backward never reaches (the gradient with respect to the suffix's
embeddings does not pass through the prompt's keys and values). So every cotangent of that backward is exactly zero
past the first r rows — yet a matrix product computes all of them. ``leading_rows(span)`` says so to the products that
make up most of such a backward, which then compute the first r rows only and return zeros for the rest:

    linear layers (``RowNarrowingLinear``)    dX[:n] = dY[:n] W      n = the positions of rows 0 … r−1 in the pass
    the CPU attention (``cpu_attention``)     its products over rows 0 … r−1

Exact: the left-out rows contribute exact zeros to every sum (a weight's dW, a shared prompt's dK), and each kept row
gets the same dot products (a product with fewer rows may block its sums differently, so float32 results can differ
in the last bits; bfloat16 ones measured equal). Norms and element-wise steps still run on every row (cheap next to
the products). Nothing changes outside the block: the loss backward computes every row as before.

The spans are checked against the shapes they meet: a product narrows only when its rows (attention) or flattened
positions (linear layers) are exactly the pass's, so a node of another pass that this backward might run is computed
whole. A process-wide setting, not a thread-local one: autograd runs a CUDA backward on its own device thread.

Model building (``grail_exp/models/loading.py``, ``trainer.narrow_backward``) swaps the policy's linear layers and marks the
model (``narrow_backward``); a forward of a marked model narrows the input gradients a scheme asks of its leading rows
(``PolicyForward.input_gradient``). Schemes and the training phases never import this file.

This file imports nothing of the project; ``cpu_attention``, ``forward`` and ``models`` use it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LeadingRows:
    """The first ``rows`` of a pass of ``of_rows`` rows carry the backward's cotangent; in the pass's flattened
    position-wise layout ((B·S) padded, or N packed: ``forward.SuffixPacking``) they are the first ``positions`` of
    ``of_positions``."""

    rows: int
    of_rows: int
    positions: int
    of_positions: int


_ACTIVE: LeadingRows | None = None


@contextlib.contextmanager
def leading_rows(span: LeadingRows | None):
    """The block's backward passes have a zero cotangent past ``span`` (None, or every row: nothing narrows)."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = span if span is not None and span.rows < span.of_rows else None
    try:
        yield
    finally:
        _ACTIVE = previous


def live_rows(num_rows: int) -> int | None:
    """r when a leading-rows backward is running and a tensor of ``num_rows`` rows belongs to its pass, else None."""
    span = _ACTIVE
    return span.rows if span is not None and num_rows == span.of_rows else None


def live_positions(num_positions: int) -> int | None:
    """n when a leading-rows backward is running and ``num_positions`` flattened positions are its pass's, else None."""
    span = _ACTIVE
    return span.positions if span is not None and num_positions == span.of_positions else None


def will_run(ctx, index: int) -> bool:
    """Whether a custom function's backward must produce the gradient of its ``index``-th tensor input: it requires
    one, and the backward running now reaches the node that takes it — a parameter's accumulation included, which
    ``torch.autograd.grad`` with respect to an activation (GRAIL's probe) never runs. (The engine cannot answer for a
    leaf while ``autograd.grad`` runs with respect to leaves: then it is computed.)"""
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True


def pad_rows(x: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    """(r, ...) -> (num_rows, ...), zeros after the first r rows."""
    if x is None or x.shape[0] == num_rows:
        return x
    return torch.cat([x, x.new_zeros(num_rows - x.shape[0], *x.shape[1:])])


class _NarrowingLinear(torch.autograd.Function):
    """y = x Wᵀ + b, whose backward computes the leading positions only inside ``leading_rows``. Outside it, the
    products aten's linear backward computes, in its layouts (dX = dY W, dW = dYᵀ X: bit for bit its results)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        xs = x.reshape(-1, x.shape[-1])
        n = live_positions(g.shape[0])
        if n is not None:
            g, xs = g[:n], xs[:n]
        dx = dw = db = None
        if will_run(ctx, 0):
            if n is None:
                dx = g.mm(weight).view(x.shape)
            else:  # the product written into the leading rows of a zero gradient: no copy
                dx = g.new_zeros(x.shape)
                torch.mm(g, weight, out=dx.view(-1, x.shape[-1])[:n])
        if will_run(ctx, 1):
            dw = g.t().mm(xs)
        if ctx.has_bias and will_run(ctx, 2):
            db = g.sum(0)
        return dx, dw, db


class RowNarrowingLinear(torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters, same forward) whose backward honours ``leading_rows``. Without gradients
    (sampling, old log-probs) or under autocast it is the plain linear layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under autocast (the cold start's bf16 steps on fp32 weights, precision=bf16-mixed) the plain linear layer:
        # autocast casts the operands of F.linear, and only aten's own backward knows to cast its products back.
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad) \
                or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight, self.bias)
        return _NarrowingLinear.apply(x, self.weight, self.bias)


NARROWS = "_grail_exp_narrows_backward"  # the attribute that marks a model whose leading-rows backward narrows


def narrow_backward(model: torch.nn.Module, body: torch.nn.Module) -> int:
    """Make ``model``'s leading-rows backwards compute their rows only: every plain linear layer of its decoder
    ``body`` narrows, and the model is marked (``narrows``); returns how many layers were swapped."""
    setattr(model, NARROWS, True)
    return narrow_linear_layers(body)


def narrows(model: torch.nn.Module) -> bool:
    """Whether ``model`` was given ``narrow_backward``."""
    return bool(getattr(model, NARROWS, False))


def narrow_linear_layers(module: torch.nn.Module) -> int:
    """Turn every plain ``torch.nn.Linear`` under ``module`` into a ``RowNarrowingLinear`` in place (the class only:
    parameters, hooks and state dict are untouched); returns how many."""
    count = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = RowNarrowingLinear
            count += 1
    return count
