"""DelTA: discriminative token credit assignment (Zhang, Wu, Lin, arXiv 2605.21467; code RUCBM/DelTA @ cf048bd,
``dp_actor.compute_log_prob_h``; other-methods.md §1 and "DelTA: exact details of the official code").

A batch-level scheme: once per rollout batch (per data-parallel rank), with no gradients,

    v_{i,t}  = (1 − p_{i,t}) · h_{i,t}        h = last hidden state (after the final norm = lm_head input) at the
                                               position predicting token t; p = softmax(logits / T)[o_t]
                                               (v is ∂ log p / ∂W_lm[o_t], App. F's last-layer gradient proxy)
    a±_i     = max(±A_i, 0)
    μ±       = Σ a± m v / max(Σ a± m, 1e-8)                       side centroids (an empty side gives the origin)
    M_{i,t}  = ‖v − μ⁻‖² − ‖v − μ⁺‖²  if A_i > 0,   ‖v − μ⁺‖² − ‖v − μ⁻‖²  if A_i < 0      (margin, §3.1)
    γ±       = sqrt(max(E[M²] − E[M]², 1e-8)) over the side's valid tokens   (population std, one-pass formula)
    K rounds: α = σ(M/γ);  μ± ← Σ α a± m v / max(Σ α a± m, 1e-8);  γ ← std of *this round's* M (before the update)
    w        = λ_min + (λ_max − λ_min) · σ(M(μ_K) / γ)    ∈ [λ_min, λ_max]        (Eq. 3 → 4: sigmoid of the margin)
               rows with A = 0 get λ_min; then w ← w · Σm / max(Σ w m, 1e-8) over the rank's whole rollout batch

so the mean weight over valid tokens is 1 and Â = sg(w)·A enters the ordinary clipped loss (§3.2).

Reproduced quirks of the official code, each with a switch:
- ``gamma_lag: true``: γ of the last round comes from the margins of the centroids *before* that round's update,
  so for K = 1 the final γ is the initial γ (false: γ from the updated centroids' margins);
- ``zero_adv_in_norm: true``: the λ_min tokens of A = 0 rows enter both sums of the self-normalisation and raise
  every other weight (false: normalise over A ≠ 0 rows only; A = 0 rows get 1, which multiplies A = 0 anyway).
The metric is the identity (the code computes a diagonal variance metric and then overwrites it with ones).

Cost: one no-grad forward of the rollout batch (v is cached, N_tok × H floats) instead of the reference's K + 3;
the rounds are O(K · N_tok · H). ``recompute`` is ``per_rollout`` by construction (the code computes the weights
once, before the μ updates); ``per_update`` is rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grail_exp.advantages.base import (
    AdvantageScheme,
    SchemeBatch,
    SchemeConfig,
    SchemeOutput,
    check_common,
    register_scheme,
)
from grail_exp.checkpoint import checkpointable
from grail_exp.compute.forward import body_forward, output_layer
from grail_exp.compute.logprobs import linear_logprob

GAMMA_VAR_FLOOR = 1e-8  # the code clamps the variance, so γ >= 1e-4
CENTROID_FLOOR = 1e-8  # clamp of the centroid denominators
NORM_FLOOR = 1e-8  # clamp of Σ w·m in the self-normalisation


@dataclass
class DeltaConfig(SchemeConfig):
    # Defaults: the official code RUCBM/DelTA @ cf048bd, run_DelTA.sh.
    name: str = "delta"
    recompute: str = "per_rollout"  # weights once per rollout batch, before the μ updates (the code); only value
    K: int = 1  # rounds of soft reassignment (run_DelTA.sh delta_K = 1)
    lambda_min: float = 0.8  # lower end of the weight range before normalisation (run_DelTA.sh)
    lambda_max: float = 1.2  # upper end (run_DelTA.sh)
    gamma_lag: bool = True  # code: last γ from the margins before the last centroid update | false: after
    zero_adv_in_norm: bool = True  # code: A = 0 rows (at λ_min) enter the normalisation | false: A != 0 rows only
    probe_temperature: float | None = None  # p = softmax(logits / T); null = rollout.temperature (code: rollout T)
    chunk_rows: int = 8  # rows per no-grad forward in prepare (memory bound; the weights do not depend on it)


def hidden_window(model, batch: SchemeBatch, window: str = "predicting", chunk_rows: int = 8,
                  with_token_prob: float | None = None, share_prompts: bool = False):
    """Last hidden states (after the final norm) of the completion window, (B, C, d), from no-grad forwards of at
    most ``chunk_rows`` rows (each distinct prompt of a chunk once with ``share_prompts``). ``window``: predicting
    (position P-1+t, the lm_head input that scores token t) | own (position P+t). With ``with_token_prob = T`` also
    returns p = softmax(logits / T)[o_t], (B, C) float32, with (chunk, V) logits alive at a time."""
    P = batch.prompt_length
    hs, ps = [], []
    weight, bias = output_layer(model)
    with torch.no_grad():
        for s in range(0, batch.input_ids.shape[0], chunk_rows):
            sl = slice(s, s + chunk_rows)
            fwd = body_forward(model, batch.input_ids[sl], batch.attention_mask[sl], batch.position_ids[sl], P,
                               share_prompts=share_prompts)
            hp = fwd.predicting(fwd.hidden)
            hs.append(hp if window == "predicting" else fwd.own(fwd.hidden))
            if with_token_prob is not None:
                logp, _ = linear_logprob(hp, weight.detach(), bias, batch.completion_ids[sl], with_token_prob, 1024)
                ps.append(logp.exp())
    h = torch.cat(hs)
    return (h, torch.cat(ps)) if with_token_prob is not None else h


def _side_gamma(M: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """Population std of the margins over one side's tokens by the one-pass formula, count clamped to >= 1."""
    n = side.float().sum().clamp(min=1)
    mean = (M * side).sum() / n
    mean_sq = (M * M * side).sum() / n
    return (mean_sq - mean * mean).clamp(min=GAMMA_VAR_FLOOR).sqrt()


def delta_weights(v: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, K: int = 1, lambda_min: float = 0.8,
                  lambda_max: float = 1.2, gamma_lag: bool = True, zero_adv_in_norm: bool = True):
    """The algorithm on features v (N, C, d), sequence advantages (N,) and the valid mask (N, C), all rows of the
    rollout batch. Returns (weights (N, C), diagnostics dict)."""
    v = v.float()
    m = mask.float()
    A = adv.float().view(-1, 1).expand_as(m)
    a_pos, a_neg = A.clamp(min=0) * m, (-A).clamp(min=0) * m  # token masses a±_i m_{i,t}
    pos, neg = (A > 0) & mask.bool(), (A < 0) & mask.bool()

    def centroid(mass):
        return (mass.unsqueeze(-1) * v).sum((0, 1)) / mass.sum().clamp(min=CENTROID_FLOOR)

    def margins(mu_pos, mu_neg):
        d_pos = (v - mu_pos).pow(2).sum(-1)
        d_neg = (v - mu_neg).pow(2).sum(-1)
        return torch.where(A > 0, d_neg - d_pos, torch.where(A < 0, d_pos - d_neg, torch.zeros_like(d_pos)))

    def gammas(M):
        return _side_gamma(M, pos), _side_gamma(M, neg)

    def temperature(g):
        return torch.where(A > 0, g[0], g[1])  # (N, C): each token's side γ

    mu_pos, mu_neg = centroid(a_pos), centroid(a_neg)
    M = margins(mu_pos, mu_neg)
    gamma = gammas(M)
    for _ in range(K):
        alpha = torch.sigmoid(M / temperature(gamma))
        mu_pos, mu_neg = centroid(alpha * a_pos), centroid(alpha * a_neg)
        if gamma_lag:
            gamma = gammas(M)  # this round's margins: the centroids before the update (the code)
        M = margins(mu_pos, mu_neg)
        if not gamma_lag:
            gamma = gammas(M)
    alpha = torch.sigmoid(M / temperature(gamma))
    raw = torch.where(A != 0, lambda_min + (lambda_max - lambda_min) * alpha, torch.full_like(alpha, lambda_min)) * m
    norm_rows = m if zero_adv_in_norm else m * (A != 0)
    total = norm_rows.sum()
    c = total / (raw * norm_rows).sum().clamp(min=NORM_FLOOR) if total > 0 else torch.tensor(1.0)
    w = raw * c
    if not zero_adv_in_norm:
        w = torch.where(A != 0, w, m)
    valid = mask.bool()
    nonzero = valid & (A != 0)
    stats = {
        "gamma_pos": float(gamma[0]) if pos.any() else float("nan"),
        "gamma_neg": float(gamma[1]) if neg.any() else float("nan"),
        "norm_factor": float(c),
        "raw_mean": float(raw[nonzero].mean()) if nonzero.any() else float("nan"),
        "frac_at_lambda_min": float(((raw - lambda_min).abs() < 1e-3 * max(lambda_max - lambda_min, 1e-12))[nonzero]
                                    .float().mean()) if nonzero.any() else float("nan"),
        "frac_at_lambda_max": float(((lambda_max - raw).abs() < 1e-3 * max(lambda_max - lambda_min, 1e-12))[nonzero]
                                    .float().mean()) if nonzero.any() else float("nan"),
        "zero_adv_token_frac": float((valid & (A == 0)).float().sum() / valid.float().sum().clamp(min=1)),
        "empty_side": float(not pos.any() or not neg.any()),
    }
    return w, stats


@checkpointable
@dataclass
class PreparedWeights:
    """A batch-level scheme's prepared state: the rollout batch's weights (N, C) and its statistics repeated per row
    (N, k). ``select`` slices rows (``base.slice_prepared`` would call ``Tensor.select(dim, index)`` on a bare
    tensor, so the tensors travel in this checkpointable container)."""

    weights: torch.Tensor
    stats: torch.Tensor

    def select(self, idx: torch.Tensor) -> PreparedWeights:
        i = idx.to(self.weights.device)
        return PreparedWeights(self.weights[i], self.stats[i.to(self.stats.device)])

    @classmethod
    def of(cls, weights: torch.Tensor, stats: dict, keys: tuple[str, ...], device) -> PreparedWeights:
        row = torch.tensor([stats[k] for k in keys], dtype=torch.float32)
        return cls(weights.to(device), row.expand(weights.shape[0], -1).clone())


def prepared_output(batch: SchemeBatch, name: str, keys: tuple[str, ...]) -> SchemeOutput:
    prepared = batch.prepared
    if not isinstance(prepared, PreparedWeights):
        raise RuntimeError(f"{name} is a batch-level scheme: call prepare(model, rollout_batch) first and pass its "
                           "result (sliced to the rows) as batch.prepared")
    return batch_level_output(prepared.weights, prepared.stats, batch.completion_mask, keys)


STAT_KEYS = ("gamma_pos", "gamma_neg", "norm_factor", "raw_mean", "frac_at_lambda_min", "frac_at_lambda_max",
             "zero_adv_token_frac", "empty_side")


def batch_level_output(weights_rows: torch.Tensor, stats_rows: torch.Tensor, mask: torch.Tensor,
                       keys: tuple[str, ...]) -> SchemeOutput:
    """A micro-batch's weights from the prepared state, with the rollout batch's statistics and the micro-batch's
    weight mean / std / min / max over valid tokens."""
    w = weights_rows.float()
    valid = mask.bool()
    metrics = {k: float(stats_rows[0, i]) for i, k in enumerate(keys)} if stats_rows.shape[0] else {}
    if valid.any():
        wv = w[valid]
        metrics.update({"weight_mean": wv.mean().item(), "weight_std": wv.std(unbiased=False).item(),
                        "weight_min": wv.min().item(), "weight_max": wv.max().item()})
    return SchemeOutput(w, metrics)


@register_scheme("delta", DeltaConfig)
class DeltaScheme(AdvantageScheme):
    batch_level = True

    @staticmethod
    def check_config(cfg) -> list[str]:
        e = check_common(cfg, batch_level="delta")  # once per rollout batch, as the official code
        if int(cfg.K) != cfg.K or cfg.K < 0:
            e.append(f"K = {cfg.K}: must be an integer >= 0")
        if not 0 < cfg.lambda_min <= cfg.lambda_max:
            e.append(f"lambda_min = {cfg.lambda_min}, lambda_max = {cfg.lambda_max}: need 0 < lambda_min <= lambda_max")
        if cfg.probe_temperature is not None and cfg.probe_temperature <= 0:
            e.append(f"probe_temperature = {cfg.probe_temperature}: must be > 0 or null")
        if cfg.chunk_rows < 1:
            e.append(f"chunk_rows = {cfg.chunk_rows}: must be >= 1")
        return e

    def features(self, model, batch: SchemeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, C, d) at the predicting positions and p (B, C) of the sampled tokens (tests replace this)."""
        T = self.cfg.probe_temperature or batch.sampling_temperature
        return hidden_window(model, batch, "predicting", int(self.cfg.chunk_rows), with_token_prob=T,
                             share_prompts=self.share_prompts)

    def prepare(self, model, batch: SchemeBatch) -> PreparedWeights:
        h, p = self.features(model, batch)
        v = (1 - p.float()).unsqueeze(-1) * h.float()  # float32 from here on, as in the code
        cfg = self.cfg
        w, stats = delta_weights(v, batch.advantages, batch.completion_mask, int(cfg.K), cfg.lambda_min,
                                 cfg.lambda_max, cfg.gamma_lag, cfg.zero_adv_in_norm)
        return PreparedWeights.of(w, stats, STAT_KEYS, batch.completion_mask.device)

    def weights(self, model, batch: SchemeBatch) -> SchemeOutput:
        return prepared_output(batch, "delta", STAT_KEYS)
