"""GRAIL: gradient×activation saliency of the answer, turned into token weights (arXiv 2606.04889).

Method spec §4.1 with the reference's verified details (§11). Per micro-batch, with the live model:

    E      = embed(ids)  (a detached leaf; or hidden_states[k] for leaf_source first / middle / last)
    logp_t = log softmax( body(E)[window] · W_lm.detach()ᵀ / T_sal )[o_t]       window = P-1 … P+C-2
    J      = − Σ_i Σ_{t ∈ answer(i)} logp_{i,t}                                  first complete \\boxed{}
    g      = ∂J/∂E                                                              one backward, no .grad
    s_t    = ‖ g_{t-1} ⊙ e_{t-1} ‖₂                                             the predicting position
    ℓ_t    = log(s_t + 1e-8);  z_t = (ℓ_t − μ) / sqrt(var + 1e-8)              per row, population stats
    w_t    = clip(w_mean + σ_w · z_t, w_min, w_max)

then, in the reference's order (§11.4): rows without a box or excluded by ``symmetry`` → 1; × mask;
overrides: content → w_max, marker / closing brace → w_mean, valid post-answer tokens → w_mean.
The trainer uses Â = sg(w)·A.

Reference quirks, reproduced by default, each with a switch (spec §12):
- post-answer slots have exactly zero saliency (J cannot depend on them) and sit in the z-score
  statistics at log(1e-8) (``zscore_post_answer: include`` | ``exclude``, §11.1);
- the span comes from re-encoding decoded text (``span_mapping: reference`` | ``exact``, §11.3);
- the probe and overrides use the first complete box, the reward the last (``box: first`` | ``last``, §11.5).

``saliency_temperature`` divides the probe's logits (null = the sampling temperature, as the reference
does; paper 1.0). A global scale of g cancels in the log-space z-score, so T matters only through the
softmax: low T saturates confident answer tokens (p → 1 gives ∂logp/∂logit → 0), concentrating saliency
on the positions that move *uncertain* answer tokens; high T flattens p, so every answer token pulls on
the inputs like its raw logit gradient and the weights spread out. It is the knob the Optuna study tunes.
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
from grail_exp.advantages.gradient_probe import detached_head_logits, detached_projection, masked_mean_std
from grail_exp.compute.forward import body_forward
from grail_exp.compute.logprobs import selective_log_softmax


@dataclass
class GrailConfig(SchemeConfig):
    # Defaults: the reference's qwen3_grail.yaml, i.e. the paper's runs (spec §4.3), and the reference's quirks (§11-§12).
    name: str = "grail"
    # σ_w: spread of the log-saliency z-score mapping (paper 0.5). The reference raises at 0; here 0 is
    # allowed and gives w = w_mean on every token the overrides leave alone. With ``overrides`` on, boxed content
    # still gets w_max, so the GRPO limit is σ_w = 0, overrides off and w_mean = 1 (tested: exact GRPO equivalence).
    std: float = 0.5
    mean: float = 1.0  # w_mean: neutral weight; also the marker / closing / post-answer override weight
    w_min: float = 0.5  # lower clip (paper 0.5; GrailConfigV2 default 0.1)
    w_max: float = 5.0  # upper clip; also the weight of boxed answer content tokens
    leaf_source: str = "embeddings"  # embeddings | first | middle | last (hidden_states[1], [L//2], [L-1])
    symmetry: str = "wrong"  # which rollouts are reweighted: wrong (A <= 0; paper) | correct (A > 0) | both
    saliency_temperature: float | None = None  # divides the probe logits; null = rollout.temperature (paper: 1.0); tuned by hparams_search
    overrides: bool = True  # content -> w_max, marker/closing/post -> w_mean (reference: always on)
    zscore_post_answer: str = "include"  # include (reference) | exclude: post-answer slots out of mu / sigma
    span_mapping: str = "reference"  # reference (re-encode behind "a") | exact (live token offsets)
    box: str = "first"  # first (reference: probe + overrides) | last (the box the reward grades)
    # Skip the probe for A = 0 rows (zero-variance groups): their weights multiply A = 0, so the gradient is
    # identical; they get w = 1 (+ overrides). Diagnostics are over rows with A != 0 either way, so logs match.
    # false probes them too. (A row counts as A != 0 when any of its token advantages is, under token-level estimators.)
    skip_zero_advantage: bool = True
    # Take the probe's gradient from the trainer's policy forward (one forward fewer, same numbers: the forward is
    # the same function of the same parameters and inputs, and w is detached) instead of a separate forward from a
    # detached embedding leaf as the reference does. false = the reference's separate probe (for comparison).
    shared_forward: bool = True


@register_scheme("grail", GrailConfig)
class GrailScheme(AdvantageScheme):
    planned_completion_passes = 1  # the probe's input-gradient backward over the completions

    @staticmethod
    def check_config(cfg) -> list[str]:
        e = check_common(cfg)
        if cfg.std < 0:
            e.append(f"std = {cfg.std}: must be >= 0")
        if not 0 < cfg.w_min <= cfg.w_max:
            e.append(f"w_min = {cfg.w_min}: must satisfy 0 < w_min <= w_max (= {cfg.w_max})")
        if cfg.mean <= 0:
            e.append(f"mean = {cfg.mean}: must be > 0 (weights must keep the advantage's sign)")
        for key, valid in (("leaf_source", ("embeddings", "first", "middle", "last")),
                           ("symmetry", ("wrong", "correct", "both")),
                           ("zscore_post_answer", ("include", "exclude")),
                           ("span_mapping", ("reference", "exact")), ("box", ("first", "last"))):
            if cfg[key] not in valid:
                e.append(f"{key} = {cfg[key]!r}: must be one of {', '.join(valid)}")
        if cfg.saliency_temperature is not None and cfg.saliency_temperature <= 0:
            e.append(f"saliency_temperature = {cfg.saliency_temperature}: must be > 0 or null")
        return e

    def __init__(self, cfg, tokenizer=None, context=None):
        super().__init__(cfg, tokenizer, context)
        # The shared forward must return every layer's output when the leaf is a hidden state.
        self.forward_outputs = ("hidden_states",) if cfg.leaf_source != "embeddings" else ()
        self.probes_leading_rows = bool(cfg.shared_forward)

    def prepare(self, model, batch: SchemeBatch):
        """The answer spans of the whole rollout batch: found once, reused by every micro-batch and iteration."""
        return {"spans": self.spans(batch)}

    def _plan(self, batch: SchemeBatch):
        """Spans, fallback rows (no box, or excluded by ``symmetry``) and the rows the probe must run on."""
        cfg = self.cfg
        spans = self.spans(batch)
        A = batch.advantages.float()
        if cfg.symmetry == "wrong":
            excluded = A > 0
        elif cfg.symmetry == "correct":
            excluded = A <= 0
        else:
            excluded = torch.zeros_like(A, dtype=torch.bool)
        fallback = ~spans.has_box | excluded  # (B,)
        probe_rows = ~fallback
        if cfg.skip_zero_advantage:
            probe_rows = probe_rows & batch.rows_with_advantage()
        return spans, A, fallback, probe_rows

    def rows_needing_model(self, batch: SchemeBatch) -> torch.Tensor:
        return self._plan(batch)[3]

    def weights(self, model: torch.nn.Module, batch: SchemeBatch) -> SchemeOutput:
        """The reference's way: a separate probe forward from a detached embedding leaf (spec §4.1)."""
        spans, A, fallback, probe_rows = self._plan(batch)
        sal = None
        if probe_rows.any():
            sal = self.saliency(model, batch, spans.span, probe_rows.nonzero().squeeze(1))
        return self._finish(batch, spans, A, fallback, probe_rows, sal)

    def weights_from_forward(self, model, batch: SchemeBatch, forward: PolicyForward) -> SchemeOutput | None:
        """The same saliency from the trainer's policy forward: J's gradient w.r.t. that forward's embeddings (or
        hidden state), taken with ``retain_graph`` so the loss can backpropagate through the same graph afterwards.
        Logits are built only at the answer positions of the probe rows, never (B, C, V)."""
        if not self.cfg.shared_forward:
            return None
        spans, A, fallback, probe_rows = self._plan(batch)
        sal = None
        if probe_rows.any():
            cfg = self.cfg
            idx = probe_rows.nonzero().squeeze(1)
            leaf = forward.embeds if cfg.leaf_source == "embeddings" else \
                hidden_leaf(forward.hidden_states, cfg.leaf_source)
            span = spans.span[idx]  # (b, C) answer slots of the probe rows
            rows, slots = span.nonzero(as_tuple=True)
            h = forward.predicting(forward.hidden)[idx][rows, slots]  # (n_answer, d)
            temperature = cfg.saliency_temperature or batch.sampling_temperature
            logits = _head(forward, h) / temperature
            logp = selective_log_softmax(logits, batch.completion_ids[idx][rows, slots])  # logits' dtype, as the reference
            J = -logp.sum()
            g = forward.input_gradient(J, leaf, rows=int(idx[-1]) + 1)  # J reads rows 0 … idx[-1]: the trainer's order
            sal = gradient_times_input(forward, g[idx], leaf.detach()[idx])
        return self._finish(batch, spans, A, fallback, probe_rows, sal)

    def _finish(self, batch, spans, A, fallback, probe_rows, sal) -> SchemeOutput:
        """Log-space z-score, clip, fallback, mask, overrides (spec §4.1 steps 8-11, in the reference's order §11.4)."""
        cfg = self.cfg
        mask = batch.completion_mask.float()  # (B, C) loss mask (0 on padding and masked truncations)
        B, C = batch.completion_ids.shape
        w = torch.ones(B, C, device=mask.device)
        raw = torch.ones(B, C, device=mask.device)
        if sal is not None:
            idx = probe_rows.nonzero().squeeze(1)
            stats_mask = mask[idx]
            if cfg.zscore_post_answer == "exclude":
                stats_mask = stats_mask * (~spans.post[idx]).float()
            ell = torch.log(sal + 1e-8)
            n = stats_mask.sum(1, keepdim=True).clamp(min=1.0)
            mu = (ell * stats_mask).sum(1, keepdim=True) / n
            var = (((ell - mu) ** 2) * stats_mask).sum(1, keepdim=True) / n
            z = (ell - mu) / torch.sqrt(var + 1e-8)
            raw[idx] = cfg.mean + cfg.std * z
            w[idx] = raw[idx].clamp(cfg.w_min, cfg.w_max)
        # Rows that fell back (or were skipped) keep w = 1; then the reference's order (§11.4):
        w = w * mask
        if cfg.overrides:
            w = torch.where(spans.content, torch.full_like(w, cfg.w_max), w)
            w = torch.where(spans.marker | spans.closing, torch.full_like(w, cfg.mean), w)
            w = torch.where(spans.post & mask.bool(), torch.full_like(w, cfg.mean), w)

        self.last_pre_clip = raw.detach()  # w_mean + σ_w·z before clipping (1 on rows without a probe)
        return SchemeOutput(w.detach(), self._diagnostics(w, raw, mask, spans, fallback, probe_rows, A,
                                                          batch.rows_with_advantage()))

    # -------------------------------------------------------------------------------------------
    def saliency(self, model, batch: SchemeBatch, span_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """s = ‖g ⊙ a‖₂ over the hidden dimension at the predicting positions, for the given rows: (b, C). The leaf
        is the embeddings (or a hidden state) of the forward's computed columns (each distinct prompt once when the
        trainer shares prompts: the predicting positions are every row's own either way, ``grail_exp.compute.forward``)."""
        cfg = self.cfg
        ids, attn, pos = batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows]
        temperature = cfg.saliency_temperature or batch.sampling_temperature
        with torch.enable_grad():
            fwd = body_forward(model, ids, attn, pos, batch.prompt_length, share_prompts=self.share_prompts,
                               hidden_states=cfg.leaf_source != "embeddings")
            leaf = fwd.embeds if cfg.leaf_source == "embeddings" else hidden_leaf(fwd.hidden_states, cfg.leaf_source)
            logits = detached_head_logits(model, fwd.predicting(fwd.hidden)) / temperature
            logp = selective_log_softmax(logits, batch.completion_ids[rows])  # in the logits' dtype, as the reference
            J = -(logp * span_mask[rows].float()).sum()  # answer NLL summed over the micro-batch
            (g,) = torch.autograd.grad(J, leaf)
        return gradient_times_input(fwd, g, leaf.detach())

    def _diagnostics(self, w, raw, mask, spans, fallback, probe_rows, A, live) -> dict[str, float]:
        """Weight statistics over the valid tokens of rows with A != 0 (the weights that reach the loss), so they are
        the same whether or not A = 0 rows were probed (``skip_zero_advantage``)."""
        cfg = self.cfg
        valid = mask.bool() & live.unsqueeze(1)
        w_mean, w_std = masked_mean_std(w, valid)
        rew = valid & probe_rows.unsqueeze(1)
        n_rew = rew.sum().clamp(min=1)
        denom = mask.sum().clamp(min=1)
        a_mean = A.abs().mean()
        return {
            "weight_mean": w_mean,
            "weight_std": w_std,
            # a weight on a bound counts as clipped (<= / >=, as the reference's clip rates)
            "clip_low_frac": ((raw <= cfg.w_min) & rew).sum().item() / n_rew.item(),
            "clip_high_frac": ((raw >= cfg.w_max) & rew).sum().item() / n_rew.item(),
            "fallback_rate": fallback.float().mean().item(),
            "answer_found_rate": spans.has_box.float().mean().item(),
            "reweighted_rows": (probe_rows & live).float().sum().item(),
            # The reference's logged ratio (§11.12): token-weighted mean |w·A| over the row mean of |A|.
            "advantages_scale_ratio": ((w * A.abs().unsqueeze(1) * mask).sum() / denom / a_mean).item()
            if a_mean > 0 else 1.0,
        }


def gradient_times_input(forward, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """GRAIL's saliency s = ‖∂J/∂leaf ⊙ leaf‖₂ over the hidden dimension at each completion token's predicting position
    (spec §4.1): ``g`` = ∂J/∂leaf and ``a`` = the leaf, both (b, S, d) on ``forward``'s columns; returns (b, C) in
    float32. Both paths call it: the probe inside the trainer's forward and the reference's separate probe."""
    g_w = forward.predicting(g).float()
    a_w = forward.predicting(a).float()
    return torch.linalg.vector_norm(g_w * a_w, dim=-1)


def hidden_leaf(hidden_states: tuple, leaf_source: str) -> torch.Tensor:
    """The hidden state ``leaf_source`` names among a forward's (L+1) ``hidden_states`` (the embeddings, then each
    layer's output): ``first`` = hidden_states[1], ``middle`` = [L // 2], ``last`` = [L - 1]."""
    L = len(hidden_states) - 1
    return hidden_states[{"first": 1, "middle": L // 2, "last": L - 1}[leaf_source]]


def _head(forward: PolicyForward, h: torch.Tensor) -> torch.Tensor:
    """Logits of hidden states through the output layer with detached weight and bias (the probe's lm_head)."""
    return detached_projection(h, forward.head_weight, forward.head_bias)
