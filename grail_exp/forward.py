"""The policy's forward pass as the trainer, the schemes and the loss terms all see it.

    input_ids (B, P+C), attention_mask, position_ids  ──embeddings──▶ decoder body ──▶ h (B, P+C, d)
    h at the C positions that predict the completion ──output layer, chunked──▶ logp, entropy (B, C) float32

Prompts are left-padded to P and completions right-padded to C, so input positions ``P-1 … P+C-2`` predict
completion tokens ``0 … C-1`` (``predicting_window``). Positions are those ``generate`` used for a left-padded batch
(``position_ids_from_mask``), so sampler and trainer log-probs agree exactly.

This file sits below everything that runs a policy forward (the training phases, the update backends, the advantage
schemes, the teacher of RLSD / SDPG, the weights and bench tools) and imports nothing of the project but
``grail_exp.logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.logprobs import linear_logprob


@dataclass
class PolicyForward:
    """What the trainer's policy forward of a micro-batch exposes to a scheme's ``weights_from_forward`` and to loss
    terms (all still in the autograd graph)."""

    embeds: torch.Tensor  # (B, P+C, d) input embeddings (a node of the graph, not a leaf)
    hidden: torch.Tensor  # (B, P+C, d) last hidden state (after the final norm)
    hidden_states: tuple | None  # all layers' outputs when the scheme asked for them (``forward_outputs``)
    head_weight: torch.Tensor  # (V, d) output layer weight (live: detach it for probes)
    head_bias: torch.Tensor | None


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body of a causal LM (``model.model`` for Qwen3 / Llama)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    return body if body is not None else model.base_model


def predicting_window(x: torch.Tensor, prompt_length: int, completion_length: int) -> torch.Tensor:
    """(B, P+C, ...) -> (B, C, ...): the positions that predict the completion tokens."""
    return x[:, prompt_length - 1:prompt_length + completion_length - 1]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` used for a left-padded batch (cumsum − 1), so ratios are exact."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(model, input_ids, attention_mask, position_ids, completion_len: int, temperature: float):
    """Logits at the C positions that predict the completion tokens: (B, C, V), divided by the temperature.

    The straightforward path (the model's own forward); the trainer uses ``policy_forward`` instead.
    ``logits_to_keep = C + 1`` keeps only the completion window, never the prompt's (B, P, V) logits.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :]
    return logits / temperature if temperature != 1.0 else logits


def policy_forward(model, input_ids, attention_mask, position_ids, completion_ids, temperature: float, *,
                   chunk_tokens: int = 4096, hidden_states: bool = False, logprob_dtype: str = "float32"):
    """The trainer's policy forward of a micro-batch: token log-probs and entropies (B, C) in float32, and the
    forward's embeddings / hidden states for schemes that reuse it (``PolicyForward``).

    Runs the decoder body on the embeddings (so GRAIL can take gradients w.r.t. them) and the output layer through
    ``linear_logprob`` (chunks of ``chunk_tokens`` rows; no (B, C, V) float32 logits). For causal LMs whose head
    is a plain linear layer (Qwen3, Llama, Mistral, ...) this is the model's own forward, computed differently.
    ``logprob_dtype`` (``trainer.logprob_dtype``): ``float32`` or ``model`` (rounded as the reference's bf16 log-probs;
    ``grail_exp.logprobs``).
    """
    P, C = input_ids.shape[1] - completion_ids.shape[1], completion_ids.shape[1]
    embeds = model.get_input_embeddings()(input_ids)
    out = decoder_body(model)(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, output_hidden_states=hidden_states)
    h = out.last_hidden_state
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    bias = bias if bias is not None and bias.numel() else None
    logp, entropy = linear_logprob(predicting_window(h, P, C), head.weight, bias, completion_ids, temperature,
                                   chunk_tokens, logprob_dtype)
    fwd = PolicyForward(embeds, h, out.hidden_states if hidden_states else None, head.weight, bias)
    return logp, entropy, fwd
