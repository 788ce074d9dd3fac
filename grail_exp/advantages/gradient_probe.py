"""Shared pieces of the gradient probes (GRAIL, OAR-G): window logits with a detached head, masked statistics.

Both reference implementations run the decoder body on detached embeddings (a fresh autograd leaf, so
no parameter ``.grad`` is touched), project only the completion window with **detached** lm_head weights,
and take ``torch.autograd.grad`` of a scalar probe with respect to the leaf (method spec §4.1, §5.8). Here the
forward is ``grail_exp.compute.forward.body_forward`` (each distinct prompt once) and the gradient is taken with
``torch.autograd.grad`` with respect to its embeddings, which touches no parameter ``.grad`` either.

The window: prompts are left-padded to P, completions right-padded to C, so input positions
``P-1 … P+C-2`` are the ones that *predict* completion tokens ``0 … C-1`` (slot t reads the embedding of
token t-1, or of the last prompt token for t = 0): ``x[:, P-1:P+C-1]``.
"""

from __future__ import annotations

import torch

from grail_exp.compute.forward import predicting_window  # noqa: F401  (the probes' name for it)


def detached_head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from the lm_head with detached weight (and bias): gradients reach the hidden states only."""
    head = model.get_output_embeddings()
    return detached_projection(hidden, head.weight, getattr(head, "bias", None))


def detached_projection(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden @ sg(W)^T + sg(b): the output layer as the probes use it, its parameters outside the graph."""
    logits = hidden @ weight.detach().T
    if bias is not None and bias.numel():
        logits = logits + bias.detach()
    return logits


def masked_mean_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    m = mask.bool()
    if not m.any():
        return float("nan"), float("nan")
    v = x[m].float()
    return v.mean().item(), (v.std(unbiased=False).item() if v.numel() > 1 else 0.0)
