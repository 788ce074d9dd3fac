"""Log-probabilities of sampled tokens without a (B, T, V) float32 copy of the logits.

    logp_t = log softmax(z_t / T)[o_t],   z_t = h_t · Wᵀ (+ b)          (the policy's per-token log-prob)
    H_t    = −Σ_v p_v log p_v                                            (token entropy, for logging / bonuses)

``linear_logprob`` takes the hidden states and the output layer instead of logits and computes both in chunks
of rows: the forward keeps one chunk's (n, V) logits alive at a time and saves only (N,) log-sum-exps; the
backward recomputes each chunk's softmax (exactly, from the saved log-sum-exp) and accumulates
``∂/∂h = g·(onehot − p)·W/T`` and ``∂/∂W``. At Qwen3's 151,936-token vocabulary a (8, 4096, V) float32 logits
tensor is 20 GB; this path needs (chunk, V). When the whole batch fits in one chunk the probabilities are kept
for the backward instead (no recompute), which is the cheapest choice on small vocabularies.

Numerics: the matmul runs in the weights' dtype (bf16 on GPU), the softmax in float32, as most RL trainers do for
the policy log-probs (``trainer.logprob_dtype: float32``, the default). ``logprob_dtype: model`` rounds the
log-probs as the GRAIL reference (TRL) computes them: logits in the model's dtype, divided by T in that dtype, then
``log_softmax`` in that dtype (bf16: after a small update most ratios π/π_old are then exactly 1, as in the
reference). The values are returned as float32 tensors holding those bf16 numbers; entropies and the backward stay
the float32 softmax (the derivative of the same function, without bf16 rounding). The GRAIL / OAR probes do *not*
use this path: they keep the reference's dtypes (``selective_log_softmax`` in the logits' dtype, method spec §11.8).
"""

from __future__ import annotations

import torch

LOGPROB_DTYPES = ("float32", "model")  # trainer.logprob_dtype


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without keeping a (B, T, V) log-prob tensor alive: (..., V), (...) -> (...).

    In the logits' dtype, as TRL's helper that the GRAIL reference calls: float32/64 as picked logit minus
    logsumexp; half precision row by row with ``log_softmax`` (logsumexp loses too much there)."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    return torch.stack([torch.log_softmax(row, -1).gather(-1, i.unsqueeze(-1)).squeeze(-1) for row, i in zip(logits, ids)])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Token entropy H = −Σ_v p log p: (..., V) -> (...), in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    z = h @ weight.T
    if bias is not None:
        z = z + bias
    z = z.float() if z.dtype != torch.float32 else z  # a fresh (n, V) float32 tensor either way: scaled in place
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, inv_t: float, chunk: int, temperature: float = 1.0,
                model_dtype: bool = False):
        N = hidden.shape[0]
        logp = hidden.new_empty(N, dtype=torch.float32)
        entropy = hidden.new_empty(N, dtype=torch.float32)
        lse = hidden.new_empty(N, dtype=torch.float32)
        probs = None
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            z = _chunk_logits(hidden[s:e], weight, bias, inv_t)
            lse[s:e] = torch.logsumexp(z, -1)
            logz = z.sub_(lse[s:e, None])  # in place: one (n, V) float32 tensor for z and log p
            if model_dtype:  # the reference's rounding: logits / T and log_softmax in the model's dtype
                zm = hidden[s:e] @ weight.T
                if bias is not None:
                    zm = zm + bias
                if temperature != 1.0:
                    zm = zm / temperature
                logp[s:e] = torch.log_softmax(zm, -1).gather(1, ids[s:e, None]).squeeze(1).float()
            else:
                logp[s:e] = logz.gather(1, ids[s:e, None]).squeeze(1)
            p = logz.exp()
            entropy[s:e] = -torch.bmm(p.unsqueeze(1), logz.unsqueeze(2)).view(-1)  # Σ_v p log p, no (n, V) product
            if N <= chunk:
                probs = p  # one chunk: keep the softmax for the backward instead of recomputing it
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0), ids, lse, entropy,
                              probs if probs is not None else hidden.new_empty(0))
        ctx.has_bias, ctx.inv_t, ctx.chunk, ctx.kept = bias is not None, inv_t, chunk, probs is not None
        ctx.mark_non_differentiable(ids)
        # An output no loss reads (the entropy, usually) gets None in the backward, not zeros: its (n, V) gradient
        # term is then skipped instead of computed as zero.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, ids, lse, entropy, kept = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        N = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g_h = torch.zeros_like(hidden) if need_h else None
        # One chunk: its weight gradient straight from the product (accumulated in fp32 inside it, rounded once, as the
        # fp32 buffer below would give), without a (V, d) fp32 buffer and its copy. Several: fp32 across chunks.
        single = N <= ctx.chunk
        g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w and not single else None
        g_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if (need_b and ctx.has_bias) else None
        for s in range(0, N, ctx.chunk):
            e = min(s + ctx.chunk, N)
            if ctx.kept:
                p = kept
            else:
                p = _chunk_logits(hidden[s:e], weight, bias, ctx.inv_t).sub_(lse[s:e, None]).exp_()
            # ∂logp/∂z = onehot − p;   ∂H/∂z = −p (log p + H);   z = (h·Wᵀ + b)/T: the 1/T rides on the (n,) factors
            g = g_logp[s:e, None] * ctx.inv_t if g_logp is not None else None
            if g is None:
                gz = torch.zeros_like(p)
            elif ctx.kept or g_entropy is not None:
                gz = -p * g
            else:
                gz = p.mul_(-g)  # this chunk's recomputed p is not needed again: in place
            if g is not None:
                gz.scatter_add_(1, ids[s:e, None], g)
            if g_entropy is not None:
                logp_all = torch.log(p.clamp_min(1e-30))
                gz = gz - p * (logp_all + entropy[s:e, None]) * (g_entropy[s:e, None] * ctx.inv_t)
            if g_b is not None:
                g_b += gz.sum(0)
            gz = gz.to(weight.dtype)
            if need_h:
                g_h[s:e] = gz @ weight
            if need_w:
                if single:
                    g_w = gz.T @ hidden[s:e]
                else:
                    g_w += (gz.T @ hidden[s:e]).float()
        return (g_h, g_w.to(weight.dtype) if g_w is not None else None,
                g_b.to(bias.dtype) if g_b is not None else None, None, None, None, None, None)


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                   temperature: float = 1.0, chunk_tokens: int = 4096,
                   dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(h·Wᵀ/T)[ids], entropy) for hidden (..., d) and ids (...): two float32 tensors of ids' shape.

    Differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` (also through the entropy). ``chunk_tokens`` bounds the
    (chunk, V) logits alive at once. ``dtype`` (``trainer.logprob_dtype``): ``float32`` = the softmax in float32;
    ``model`` = the log-probs rounded as the reference computes them, in the weights' dtype (module docstring)."""
    if dtype not in LOGPROB_DTYPES:
        raise ValueError(f"trainer.logprob_dtype must be one of {LOGPROB_DTYPES}, got {dtype!r}")
    shape = ids.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _LinearLogprob.apply(h, weight, bias, ids.reshape(-1), 1.0 / temperature, max(1, int(chunk_tokens)),
                                     temperature, dtype == "model")
    return logp.view(shape), ent.view(shape)



@torch.no_grad()
def kept_log_mass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int = 0,
                  top_p: float = 1.0, temperature: float = 1.0, chunk_tokens: int = 4096) -> torch.Tensor:
    """log M_t = log Σ_{v kept} softmax(z_t / T)_v, the log of the probability mass top-k / top-p sampling keeps:
    hidden (..., d) -> (...) float32, ≤ 0 (0 when neither filter is on).

    Kept, as vLLM's sampler filters (``apply_top_k_top_p``): top-k keeps every token whose logit is ≥ the k-th largest
    (ties at the threshold included); top-p then keeps, within those, the most probable tokens whose renormalised mass
    reaches p (ascending order, dropping while the cumulative mass is ≤ 1 − p; the top token always stays). With both
    on, top-p runs over exactly k candidates (ties at the k-th logit are then not added). A sampler that renormalises
    over the kept tokens (vLLM's ``processed_logprobs``) reports log p_t − log M_t for a kept token, so
    ``processed − raw = −log M_t``."""
    shape = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    out = h.new_zeros(h.shape[0], dtype=torch.float32)
    if top_k <= 0 and top_p >= 1.0:
        return out.view(shape)
    chunk = max(1, int(chunk_tokens))
    for s in range(0, h.shape[0], chunk):
        z = _chunk_logits(h[s:s + chunk], weight, bias, 1.0 / temperature)
        if top_p >= 1.0:  # top-k only: a threshold, no sort
            kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
            kept = torch.logsumexp(z.masked_fill(z < kth, float("-inf")), -1)
        else:
            k = min(top_k, z.shape[-1]) if top_k > 0 else z.shape[-1]
            asc = torch.topk(z, k, dim=-1).values.flip(-1)  # the candidates, ascending (a full sort without top-k)
            cum = torch.softmax(asc, -1).cumsum(-1)
            drop = cum <= 1 - top_p
            drop[:, -1] = False
            kept = torch.logsumexp(asc.masked_fill(drop, float("-inf")), -1)
        out[s:s + chunk] = kept - torch.logsumexp(z, -1)
    return out.view(shape)
