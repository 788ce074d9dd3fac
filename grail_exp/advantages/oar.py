"""OAR: outcome-grounded advantage reshaping (arXiv 2601.07408), gradient (OAR-G) and perturbation (OAR-P).

Token importance I_t measures how much token t moves the model's *outcome distribution* P_final; the
Bi-Level reshaping (method spec §5.4) turns it into weights that suppress unimportant tokens, boost
important ones and preserve the advantage mass:

    Ī_t = log(1 + I_t);  Î_t = (Ī_t − min Ī) / (max Ī − min Ī);  τ_q = quantile_τ(Î)
    ω_t = max(Î_t / τ_q, 0.1)                         if Î_t <  τ_q     (suppress, floor 0.1)
    ω_t = 1 + β (Î_t − τ_q) / (1 − τ_q)                if Î_t >= τ_q     (boost, up to 1 + β)
    w_t = ω_t · T / Σ_s ω_s                                             (mass preservation: mean 1)

**OAR-G** (§5.3 / §5.6): one clean forward gives the teacher P0 = softmax(mean of the logits at the
slots that predict the answer span); Gaussian noise (σ_n) on the embeddings, one noisy forward,
J = KL(P0 ‖ P_noisy), one backward: I_t = |⟨∂J/∂e_t, e_t⟩|. At zero noise the KL sits at its minimum and
its gradient is exactly 0, which is why the noise is needed (the score is second order in σ_n).

``variant: grail_repo`` (default) is the re-implementation the GRAIL paper compares against (§5.6, §11.10):
every valid completion token is scored, at the *predicting* position (the GRAIL shift), with the noisy
embedding in the product; noise on the whole window; min–max denominator max − min + eps; the quantile is
the order statistic ``sorted[int(T·τ)]``; ``log(1+s)`` in float32 (``log_compression: reference``; ``log1p``
is the exact alternative, §11.9); rows without a box → 1. ``variant: original`` is the OAR authors' code
(§5.3–§5.4): only the reasoning span (tokens before the box) is scored, at the token's own position, with
the clean embedding in the product, noise on reasoning positions only, ``np.quantile`` interpolation, a
range of 1 when all scores are equal, and the answer tokens keep weight 1.

**OAR-P** (§5.2): I_t = KL(P_final ‖ P_final with token t replaced by PAD), one no-grad forward per
scored token, batched in chunks of at most ``max_batch_tokens`` tokens. Same reshaping as ``original``.

The noise comes from the trainer's seeded generator (the reference draws it from the global CUDA RNG,
which is not reproducible across world sizes; a documented deviation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.advantages.base import (
    AdvantageScheme,
    PolicyForward,
    SchemeBatch,
    SchemeConfig,
    SchemeOutput,
    check_common,
    register_scheme,
)
from grail_exp.advantages.gradient_probe import detached_head_logits, masked_mean_std
from grail_exp.compute.forward import body_forward, continue_forward, frozen_parameters, output_layer
from grail_exp.compute.logprobs import linear_logprob

SUPPRESS_FLOOR = 0.1  # both codebases floor suppressed tokens at 0.1


@dataclass
class OARGConfig(SchemeConfig):
    name: str = "oar_g"
    variant: str = "grail_repo"  # grail_repo (GRAIL's re-implementation, the paper's baseline) | original
    tau: float = 0.4  # quantile level τ (GRAIL's config 0.4; the OAR README suggests 0.25)
    beta: float = 2.0  # boost strength β (GRAIL's config 2.0; the OAR README suggests 1.0)
    noise_std: float = 1e-3  # σ_n of the embedding noise (drawn from the run's seeded generator)
    eps: float = 1e-12  # KL / min-max epsilon (oar_g_eps)
    p_final: str = "answer_mean"  # answer_mean: softmax of the mean logits over the answer span slots
    log_compression: str = "reference"  # reference: torch.log(1 + s) in float32 (small scores collapse, §11.9) | log1p
    span_mapping: str = "reference"  # reference (re-encode decoded text, as GRAIL's spans) | exact (live token offsets)
    box: str = "first"  # first complete \boxed{} (reference) | last
    # Take the clean teacher P0 from the trainer's policy forward (the same clean forward of the same parameters)
    # instead of a separate no-grad forward: one forward fewer, same numbers. false = the reference's separate pass.
    shared_forward: bool = True
    # Skip the noisy pass for rows whose advantage is 0 (zero-variance groups): their weights multiply A = 0, so the
    # gradient is identical; they get w = 1. Their noise is still drawn, so every other row's noise is the one it gets
    # with false, and diagnostics are over rows with A != 0 either way, so logs match. false scores them too.
    skip_zero_advantage: bool = True


@dataclass
class OARPConfig(SchemeConfig):
    name: str = "oar_p"
    tau: float = 0.4  # quantile level τ: tokens below the τ-quantile are suppressed
    beta: float = 2.0  # boost strength β: weights reach 1 + β before renormalisation
    eps: float = 1e-12
    # answer_mean | last (the slot predicting the first answer-content token; the OAR README's OAR-P choice) | answer_joint
    p_final: str = "answer_mean"
    log_compression: str = "log1p"  # log1p | reference (torch.log(1 + s) in float32)
    max_batch_tokens: int = 16384  # memory budget of one masked-copies forward: rows x sequence length
    span_mapping: str = "reference"
    box: str = "first"
    # Skip the masked forwards for rows whose advantage is 0: identical gradient (their weights multiply A = 0), w = 1
    # for them, diagnostics over rows with A != 0 either way. false scores them too.
    skip_zero_advantage: bool = True


def _check_common(cfg, e: list[str]) -> None:
    e.extend(check_common(cfg))
    if not 0 <= cfg.tau < 1:
        e.append(f"tau = {cfg.tau}: must be in [0, 1)")
    if cfg.beta < 0:
        e.append(f"beta = {cfg.beta}: must be >= 0")
    if cfg.eps < 0:
        e.append(f"eps = {cfg.eps}: must be >= 0")
    if cfg.log_compression not in ("reference", "log1p"):
        e.append(f"log_compression = {cfg.log_compression!r}: must be reference or log1p")
    if cfg.span_mapping not in ("reference", "exact"):
        e.append(f"span_mapping = {cfg.span_mapping!r}: must be reference or exact")
    if cfg.box not in ("first", "last"):
        e.append(f"box = {cfg.box!r}: must be first or last")


# ----------------------------------------------------------------------------------------- Bi-Level reshaping
def compress(scores: torch.Tensor, mode: str) -> torch.Tensor:
    s = scores.float()
    return torch.log(1 + s) if mode == "reference" else torch.log1p(s)


def bilevel_grail_repo(scores: torch.Tensor, mask: torch.Tensor, tau: float, beta: float, eps: float,
                       mode: str = "reference") -> torch.Tensor:
    """GRAIL repo's reshaping over valid tokens (§11.10): (B, C) scores -> (B, C) weights, mean 1 per row."""
    m = mask.bool()
    s = compress(scores, mode)
    mx = torch.where(m, s, torch.full_like(s, -1e9)).amax(1, keepdim=True)
    mn = torch.where(m, s, torch.full_like(s, 1e9)).amin(1, keepdim=True)
    hat = (s - mn) / (mx - mn + eps)
    T = m.float().sum(1, keepdim=True)  # float32 count, as in the reference
    idx = (T * torch.tensor(tau, dtype=torch.float32)).long().clamp(min=0)
    idx = torch.minimum(idx, (T - 1).clamp(min=0).long())
    srt = torch.where(m, hat, torch.full_like(hat, float("inf"))).sort(1).values
    tq = srt.gather(1, idx)  # order statistic, not an interpolated quantile
    omega = torch.where(hat < tq, torch.clamp(hat / (tq + eps), min=SUPPRESS_FLOOR),
                        1 + beta * (hat - tq) / ((1 - tq) + eps))  # ties go to the boost branch
    omega = omega * mask
    return omega * T / (omega.sum(1, keepdim=True) + 1e-8)


def bilevel_original(scores: torch.Tensor, mask: torch.Tensor, tau: float, beta: float,
                     mode: str = "log1p") -> torch.Tensor:
    """The OAR authors' reshaping per row over the scored tokens (§5.4): np.quantile, range 1 if flat, sum_to_L."""
    w = torch.ones_like(scores, dtype=torch.float32)
    for i in range(scores.shape[0]):
        m = mask[i].bool()
        L = int(m.sum())
        if L == 0:
            continue
        s = compress(scores[i][m], mode)
        rng = (s.max() - s.min()).item()
        hat = (s - s.min()) / (rng if rng > 0 else 1.0)
        tq = torch.quantile(hat.double(), tau).float()  # linear interpolation, like numpy's default
        omega = torch.where(hat < tq, torch.clamp(hat / (tq + 1e-8), min=SUPPRESS_FLOOR),
                            1 + beta * (hat - tq) / (1 - tq + 1e-8))
        w[i, m] = omega * L / omega.sum()
    return w


# ----------------------------------------------------------------------------------------- outcome distribution
def span_mean_logits(logits: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Mean of the (B, C, V) logits over the span slots: (B, V); rows without a span give zeros (uniform).

    The count is an integer tensor so the mean stays in the logits' dtype (bf16 in the paper runs), exactly as the
    reference computes it; a float32 count would promote it to float32."""
    n = span.long().sum(1, keepdim=True).clamp(min=1)
    return (logits * span.unsqueeze(-1).to(logits.dtype)).sum(1) / n


def span_mean_logits_gathered(model, hidden_window: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """``span_mean_logits(detached_head_logits(model, hidden_window), span)`` with logits built only at the span
    slots ((n_span, V) instead of (B, C, V)); equal up to the order of the float sum."""
    rows, slots = span.nonzero(as_tuple=True)  # row-major: each row's slots are contiguous
    logits = detached_head_logits(model, hidden_window[rows, slots])  # (n_span, V)
    return span_sum_rows(logits, span.long().sum(1)) / span.long().sum(1, keepdim=True).clamp(min=1)


def span_sum_rows(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(n_span, V) logits grouped by row (``counts[b]`` consecutive rows each) -> (B, V) per-row sums in the logits'
    dtype: accumulated in float32 and rounded once, as the (B, C, V) ``sum(1)`` of ``span_mean_logits`` reduces.
    Not ``index_add_`` into a buffer of the logits' dtype: in bf16 that rounds after every add (and on CUDA adds in a
    nondeterministic order), and OAR-G's weights are highly sensitive to this teacher distribution."""
    parts = torch.split(logits, counts.tolist())
    sums = [p.float().sum(0) if p.shape[0] else logits.new_zeros(logits.shape[-1], dtype=torch.float32)
            for p in parts]
    return torch.stack(sums).to(logits.dtype) if sums else logits.new_zeros(0, logits.shape[-1])


def _reasoning_mask(spans, mask: torch.Tensor) -> torch.Tensor:
    """Valid tokens strictly before the answer span (the original OAR 'reasoning' segment)."""
    C = mask.shape[1]
    pos = torch.arange(C, device=mask.device).unsqueeze(0)
    first = torch.where(spans.span.any(1), spans.span.float().argmax(1), torch.full_like(spans.has_box, C, dtype=torch.long))
    return mask.bool() & (pos < first.unsqueeze(1)) & spans.has_box.unsqueeze(1)


@register_scheme("oar_g", OARGConfig)
class OARGScheme(AdvantageScheme):
    row_order_invariant = False  # the noise is drawn row by row, in micro-batch order
    planned_completion_passes = 2  # the noisy forward and an input-gradient backward over the completions

    @classmethod
    def planned_update_transient(cls, cfg, graph_bytes: float) -> tuple[str, float, str] | None:
        """The noisy teacher pass builds a second graph of the micro-batch beside the policy's."""
        return ("OAR-G noisy teacher pass", graph_bytes,
                "a second graph of the micro-batch (activations + its recompute)")

    @staticmethod
    def check_config(cfg) -> list[str]:
        e: list[str] = []
        _check_common(cfg, e)
        if cfg.variant not in ("grail_repo", "original"):
            e.append(f"variant = {cfg.variant!r}: must be grail_repo or original")
        if cfg.noise_std < 0:
            e.append(f"noise_std = {cfg.noise_std}: must be >= 0")
        if cfg.p_final != "answer_mean":
            e.append(f"p_final = {cfg.p_final!r}: OAR-G supports answer_mean")
        return e

    def prepare(self, model, batch: SchemeBatch):
        """The answer spans of the whole rollout batch, found once (they do not change across iterations)."""
        return {"spans": self.spans(batch)}

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        """The reference's way: a separate clean no-grad forward for the teacher, then the noisy forward."""
        return self._weights(model, batch, None)

    def weights_from_forward(self, model, batch: SchemeBatch, forward: PolicyForward) -> SchemeOutput | None:
        """The teacher from the trainer's (clean) policy forward; only the noisy forward is extra."""
        if not self.cfg.shared_forward:
            return None
        return self._weights(model, batch, forward)

    def _weights(self, model, batch: SchemeBatch, forward: PolicyForward | None) -> SchemeOutput:
        cfg = self.cfg
        mask = batch.completion_mask.float()
        spans = self.spans(batch)
        original = cfg.variant == "original"
        scored = _reasoning_mask(spans, mask) if original else mask.bool()
        scores = torch.zeros_like(mask)
        live = batch.rows_with_advantage()  # the rows whose weights reach the gradient (diagnostics: these)
        rows = spans.has_box.nonzero().squeeze(1)
        if rows.numel():
            # Drawn for every boxed row, skipped or not: the stream, and so each row's noise, is that of false.
            width = (batch.input_ids.shape[1], model.get_input_embeddings().weight.shape[1])
            noise = torch.randn(rows.numel(), *width, generator=batch.generator, dtype=torch.float32)
            keep = live[rows] if cfg.skip_zero_advantage else torch.ones_like(rows, dtype=torch.bool)
            if bool(keep.any()):  # all kept: the noise as drawn, not a copy (rows x (P+C) x d floats: ~1 GB at 4k)
                kept_noise = noise if bool(keep.all()) else noise[keep.to(noise.device)]
                scores[rows[keep]] = self.importance(model, batch, spans.span, scored, rows[keep], kept_noise, forward)
        if original:
            w = bilevel_original(scores, scored, cfg.tau, cfg.beta, cfg.log_compression)
            w = torch.where(scored, w, torch.ones_like(w)) * mask
        else:
            w = bilevel_grail_repo(scores, mask, cfg.tau, cfg.beta, cfg.eps, cfg.log_compression)
            w = torch.where(spans.has_box.unsqueeze(1), w, torch.ones_like(w)) * mask
        return SchemeOutput(w.detach(), _diagnostics(w, mask, scored, spans, scores, live))

    def importance(self, model, batch: SchemeBatch, span: torch.Tensor, scored: torch.Tensor,
                   rows: torch.Tensor, noise: torch.Tensor, forward: PolicyForward | None = None) -> torch.Tensor:
        """|⟨∂KL(P0‖P_noisy)/∂e, e⟩| per completion token for the given rows: (b, C). ``noise``: (b, P+C, d) standard
        normal float32 draws, one per position of each row (scaled by ``noise_std`` here).

        The noise touches completion-window positions only (P-1 … P+C-1), so the noisy forward shares the clean
        forward's prompt: when that forward computed each distinct prompt once, its keys and values are reused and
        only the rows' suffixes are recomputed (``grail_exp.compute.forward.continue_forward``)."""
        cfg = self.cfg
        P, C = batch.prompt_length, batch.completion_ids.shape[1]
        ids, attn, pos = batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows]
        span_r = span[rows]
        original = cfg.variant == "original"
        if forward is None:  # the reference's separate clean forward of these rows
            with torch.no_grad():
                clean = body_forward(model, ids, attn, pos, P, share_prompts=self.share_prompts)
            sel = torch.arange(rows.numel(), device=ids.device)
        else:  # the trainer's policy forward is this clean forward
            clean, sel = forward, rows.to(forward.embeds.device)
        window = clean.own if original else clean.predicting
        emb = clean.embeds.detach()[sel]  # (b, S, d): the computed columns, from absolute position clean.start
        with torch.no_grad():  # teacher: clean forward, detached head, no temperature
            h = clean.hidden.detach()[sel]
            if forward is not None:
                p0 = torch.softmax(span_mean_logits_gathered(model, clean.predicting(h), span_r), -1)
            else:
                p0 = torch.softmax(span_mean_logits(detached_head_logits(model, clean.predicting(h)), span_r), -1)
        # The noise is drawn for every position (P+C) as the reference does, so the stream does not depend on which
        # columns were computed; positions outside the window get none.
        where = torch.zeros(emb.shape[0], P + C, dtype=emb.dtype, device=emb.device)
        if original:
            where[:, P:] = scored[rows].to(emb.dtype)
        else:
            where[:, P - 1:P + C - 1] = 1.0
        noise = noise.to(emb) * cfg.noise_std
        cols = slice(clean.start, clean.start + emb.shape[1])
        noisy = emb + noise[:, cols] * where[:, cols].unsqueeze(-1)
        # J is a sum over rows and a row's gradient is its own: the noisy pass may run the rows in any split, the same
        # numbers. With the parameters held constant (``frozen_parameters``) its graph keeps no layer inputs for
        # weight gradients — about half of what a training forward keeps — so the micro-batch's rows run at once.
        gathered = forward is not None
        with frozen_parameters(model):
            g = self._noisy_gradient(model, clean, noisy, sel, attn, pos, span_r, p0, gathered)
        act = emb if original else noisy
        return (window(g).float() * window(act).float()).sum(-1).abs()

    def _noisy_gradient(self, model, clean, noisy, sel, attn, pos, span, p0, gathered: bool) -> torch.Tensor:
        """∂KL(P0 ‖ P_noisy)/∂e for some rows: the noisy forward (sharing the clean forward's prompts) and its input
        gradient."""
        noisy = noisy.detach().requires_grad_(True)
        with torch.enable_grad():
            h = clean.predicting(continue_forward(model, clean, noisy, sel, attn, pos))
            logits = span_mean_logits_gathered(model, h, span) if gathered else \
                span_mean_logits(detached_head_logits(model, h), span)
            logq = torch.log_softmax(logits, -1)
            J = (p0 * (torch.log(p0 + self.cfg.eps) - logq)).sum()  # KL(P0 ‖ P_noisy), summed over the rows
            (g,) = torch.autograd.grad(J, noisy)
        return g


@register_scheme("oar_p", OARPConfig)
class OARPScheme(AdvantageScheme):
    @staticmethod
    def check_config(cfg) -> list[str]:
        e: list[str] = []
        _check_common(cfg, e)
        if cfg.p_final not in ("answer_mean", "last", "answer_joint"):
            e.append(f"p_final = {cfg.p_final!r}: must be answer_mean, last or answer_joint")
        if cfg.max_batch_tokens < 1:
            e.append(f"max_batch_tokens = {cfg.max_batch_tokens}: must be >= 1")
        return e

    def prepare(self, model, batch: SchemeBatch):
        return {"spans": self.spans(batch)}

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        cfg = self.cfg
        mask = batch.completion_mask.float()
        spans = self.spans(batch)
        scored = _reasoning_mask(spans, mask)
        live = batch.rows_with_advantage()  # the rows whose weights reach the gradient (diagnostics: these)
        if cfg.skip_zero_advantage:
            scored = scored & live.unsqueeze(1)
        scores = self.importance(model, batch, spans, scored)
        w = bilevel_original(scores, scored, cfg.tau, cfg.beta, cfg.log_compression)
        w = torch.where(scored, w, torch.ones_like(w)) * mask
        return SchemeOutput(w.detach(), _diagnostics(w, mask, scored, spans, scores, live))

    def _outcome(self, model, ids, attn, pos, spans_row, P: int, C: int) -> torch.Tensor:
        """P_final of each row of a batch of (masked) copies of one sequence: (n, V) log-probs, or (n,) for answer_joint.
        The copies share their prompt (computed once with ``trainer.share_prompts``); logits are built only where
        P_final reads them (the span, or one slot), never (n, C, V)."""
        fwd = body_forward(model, ids, attn, pos, P, share_prompts=self.share_prompts)
        h = fwd.predicting(fwd.hidden)  # (n, C, d)
        span, content = spans_row
        if self.cfg.p_final == "answer_joint":
            weight, bias = output_layer(model)
            lp, _ = linear_logprob(h, weight, bias, ids[:, P:], 1.0, 1024)  # (1024, V) logits at a time
            return (lp * span).sum(1) / span.sum().clamp(min=1)
        if self.cfg.p_final == "last":
            t = int(content.float().argmax()) if content.any() else int(span.float().argmax())
            return torch.log_softmax(detached_head_logits(model, h[:, t]).float(), -1)
        slots = span.nonzero().squeeze(1)
        logits = detached_head_logits(model, h[:, slots]).float()  # (n, k, V) at the span's k slots
        return torch.log_softmax(logits.sum(1) / span.long().sum().clamp(min=1), -1)

    @torch.no_grad()
    def importance(self, model, batch: SchemeBatch, spans, scored: torch.Tensor) -> torch.Tensor:
        """I_t = KL(P_final ‖ P_final^(t)), token t replaced by PAD; one forward per scored token, chunked."""
        cfg = self.cfg
        P, C = batch.prompt_length, batch.completion_ids.shape[1]
        pad = self.tokenizer.pad_token_id
        scores = torch.zeros(scored.shape, dtype=torch.float32, device=scored.device)
        width = batch.input_ids.shape[1]
        chunk = max(1, cfg.max_batch_tokens // width)
        for i in scored.any(1).nonzero().squeeze(1).tolist():
            ids, attn, pos = batch.input_ids[i:i + 1], batch.attention_mask[i:i + 1], batch.position_ids[i:i + 1]
            row_spans = (spans.span[i].float(), spans.content[i])
            base = self._outcome(model, ids, attn, pos, row_spans, P, C)
            positions = scored[i].nonzero().squeeze(1)
            for s in range(0, positions.numel(), chunk):
                ts = positions[s:s + chunk]
                masked = ids.repeat(ts.numel(), 1)
                masked[torch.arange(ts.numel()), P + ts] = pad
                out = self._outcome(model, masked, attn.expand_as(masked), pos.expand_as(masked), row_spans, P, C)
                if cfg.p_final == "answer_joint":
                    scores[i, ts] = (base - out).float()  # drop in the answer log-likelihood
                else:
                    scores[i, ts] = (base.exp() * (base - out)).sum(-1).float()  # KL(P ‖ P^(t))
        return scores.clamp(min=0)


def _diagnostics(w, mask, scored, spans, scores, live) -> dict[str, float]:
    """Weight and score statistics over the rows with A != 0 (the weights that reach the loss), so they are the same
    whether or not the others were scored (``skip_zero_advantage``); the answer rates over all rows."""
    valid = mask.bool() & live.unsqueeze(1)
    w_mean, w_std = masked_mean_std(w, valid)
    sc = scored.bool() & live.unsqueeze(1)
    s_mean, _ = masked_mean_std(scores, sc & spans.has_box.unsqueeze(1))
    return {
        "weight_mean": w_mean,
        "weight_std": w_std,
        "scored_weight_mean": masked_mean_std(w, sc)[0],
        "suppressed_frac": ((w < 1) & sc).sum().item() / max(1, sc.sum().item()),
        "answer_found_rate": spans.has_box.float().mean().item(),
        "fallback_rate": (~spans.has_box).float().mean().item(),
        "score_mean": s_mean,
    }
