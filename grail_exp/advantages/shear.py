"""SHEAR: span-level Wasserstein advantage reweighting (Chen et al., "Hidden States Know Where Reasoning Diverges",
arXiv 2604.23318, §3 / Algorithm 1; no code released: other-methods.md §6, from a secondary formalisation).

A batch-level scheme. Per group of G rollouts of a prompt, with the last-layer hidden states h_{i,t} (after the
final norm, the lm_head input) of each rollout's T_i valid tokens and no gradients:

    spans     S_{i,k} = [k·s, min(k·s + w, T_i)),  k = 0 … K_i − 1,  K_i = 1 if T_i <= w else ⌈(T_i − w)/s⌉ + 1
    P̂_{i,k}   = uniform empirical distribution of {h_{i,t} : t ∈ S_{i,k}}
    O(i)      = the rollouts of the group in the other reward class (reward >= reward_threshold or not)
    d_{i,k}   = min_{j ∈ O(i)} min_ℓ W_ε(P̂_{i,k}, P̂_{j,ℓ})      Step 1: Sinkhorn W₁, Euclidean ground cost
    n̄         = mean_{i ∈ group, t} ‖h_{i,t}‖₂                    Step 2: the group's mean hidden norm
    ω_{i,t}   = max_{k : t ∈ S_{i,k}} d_{i,k} / n̄                  Step 3: max over the spans covering t
    Â_{i,t}   = A_i · ω_{i,t}                                      Step 4 (ω >= 0 keeps the sign)

O(i) = ∅ (a uniform group) → ω = 1 (GRPO). There is no mean-1 renormalisation (the paper's; the mean weight is
logged). W_ε(P, Q) = ⟨T_ε, C⟩: the transport cost of the entropic plan T_ε (log-domain Sinkhorn), which satisfies
W₁ <= W_ε <= W₁ + ε log n for uniform marginals of n = m points (the paper's stated bias bound).

UNVERIFIED in the paper and chosen here (see conf/advantage/shear.yaml): ε and the iteration count (the paper gives
only ε log n ≈ 20.8, i.e. ε ≈ 4.5 absolute for n = 100 on 7B hidden states; we scale ε by each problem's mean
ground cost so one value works across models, ``epsilon_scale: absolute`` gives the paper's reading), which hidden
state stands for token t (its own position by default), the span enumeration at the end of a rollout, and the
reward-class split for non-binary rewards.

Cost: one no-grad forward of the rollout batch; Sinkhorn over Σ_groups (Σ_{i∈G⁺} K_i)(Σ_{j∈G⁻} K_j) span pairs
(each W_ε is symmetric, so computed once per pair), each O(iters · w² · 1) after an O(w² d) cost matrix.
"""

from __future__ import annotations

import math
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
from grail_exp.advantages.delta import PreparedWeights, hidden_window, prepared_output


@dataclass
class ShearConfig(SchemeConfig):
    name: str = "shear"
    recompute: str = "per_rollout"  # weights once per rollout batch (the paper computes ω once per batch); only value
    # w: span length in tokens (paper 100; insensitive over 80-120). The embedded model's ~30-token completions make
    # one span per rollout: experiment=shear/cpu_embedded has CPU values.
    window: int = 100
    stride: int = 25  # s: span stride (paper 25; smaller is better than 75)
    # Sinkhorn ε (UNVERIFIED in the paper: ε log n ≈ 20.8, i.e. ≈ 4.5 absolute at n = 100, epsilon_scale=absolute);
    # ours: 0.05 × each problem's mean ground cost.
    epsilon: float = 0.05
    epsilon_scale: str = "mean_cost"  # mean_cost: ε × each problem's mean ground cost (scale-free) | absolute
    max_iter: int = 200  # Sinkhorn iterations at most (UNVERIFIED in the paper; ours)
    tol: float = 1e-4  # stop when every problem's row-marginal L1 error is below tol (ours)
    max_pairs: int = 2048  # span pairs per Sinkhorn batch (memory: max_pairs · w² floats per buffer)
    reward_threshold: float = 0.5  # correct class: reward >= threshold (binary 0/1 rewards: r = 1 vs 0, the paper)
    hidden_position: str = "own"  # own: h at token t's own position (ours, UNVERIFIED) | predicting: at the position that scores t
    normalize: str = "group_mean_norm"  # group_mean_norm (paper: ÷ the group's mean ‖h‖; per-rollout was worse) | none
    chunk_rows: int = 8  # rows per no-grad forward in prepare (memory bound; the weights do not depend on it)


# ----------------------------------------------------------------------------------------- Sinkhorn
def sinkhorn_w1(x: torch.Tensor, x_mask: torch.Tensor, y: torch.Tensor, y_mask: torch.Tensor, epsilon,
                max_iter: int = 200, tol: float = 1e-4) -> tuple[torch.Tensor, dict]:
    """Batched entropic W₁ between uniform empirical distributions of variable size.

    x (P, n, d), x_mask (P, n) bool; y (P, m, d), y_mask (P, m) bool; epsilon: float or (P,) tensor. Log-domain
    Sinkhorn on the potentials (f, g) with the Euclidean cost C = ‖x − y‖; padded points have zero mass. Returns
    ⟨T_ε, C⟩ (P,) and {"iters", "marginal_err"} (the largest row-marginal L1 error at exit)."""
    if x.dtype != torch.float64:  # float32 for model states; float64 inputs stay float64 (exactness tests)
        x, y = x.float(), y.float()
    C = torch.cdist(x, y.to(x.dtype))  # (P, n, m)
    valid = x_mask.unsqueeze(2) & y_mask.unsqueeze(1)
    C = torch.where(valid, C, torch.zeros_like(C))
    eps = torch.as_tensor(epsilon, dtype=C.dtype, device=C.device).reshape(-1, 1, 1).expand(C.shape[0], 1, 1)
    n = x_mask.sum(1, keepdim=True).clamp(min=1).to(C.dtype)
    m = y_mask.sum(1, keepdim=True).clamp(min=1).to(C.dtype)
    neg_inf = torch.finfo(C.dtype).min
    log_a = torch.where(x_mask, -n.log(), torch.full_like(x_mask, neg_inf, dtype=C.dtype))  # (P, n)
    log_b = torch.where(y_mask, -m.log(), torch.full_like(y_mask, neg_inf, dtype=C.dtype))  # (P, m)
    Ke = -C / eps  # (P, n, m)
    f = torch.zeros_like(log_a)
    g = torch.zeros_like(log_b)
    # Each problem stops on its own (frozen once its row marginals are within tol), so a problem's value does not
    # depend on which other problems share its batch (the weights do not depend on max_pairs or micro-batching).
    active = torch.ones(C.shape[0], 1, dtype=torch.bool, device=C.device)
    row_err = torch.full((C.shape[0],), float("inf"), dtype=C.dtype, device=C.device)
    it = 0
    for it in range(1, max_iter + 1):
        # f_i = −ε log Σ_j b_j exp((g_j − C_ij)/ε); g likewise: each update fits one marginal exactly
        f_new = -eps.squeeze(2) * torch.logsumexp(log_b.unsqueeze(1) + g.unsqueeze(1) / eps + Ke, dim=2)
        f = torch.where(active, f_new, f)
        g_new = -eps.squeeze(2) * torch.logsumexp(log_a.unsqueeze(2) + f.unsqueeze(2) / eps + Ke, dim=1)
        g = torch.where(active, g_new, g)
        if it % 10 == 0 or it == max_iter:
            log_T = log_a.unsqueeze(2) + log_b.unsqueeze(1) + (f.unsqueeze(2) + g.unsqueeze(1)) / eps + Ke
            err_now = ((log_T.exp().sum(2) - log_a.exp()).abs() * x_mask).sum(1)
            row_err = torch.where(active.squeeze(1), err_now, row_err)
            active = active & (row_err >= tol).unsqueeze(1)
            if not active.any():
                break
    log_T = log_a.unsqueeze(2) + log_b.unsqueeze(1) + (f.unsqueeze(2) + g.unsqueeze(1)) / eps + Ke
    T = log_T.exp() * valid
    err = float(((T.sum(2) - log_a.exp()).abs() * x_mask).sum(1).max())
    return (T * C).sum((1, 2)), {"iters": it, "marginal_err": err}


# ----------------------------------------------------------------------------------------- spans
def span_starts(length: int, window: int, stride: int) -> list[int]:
    """Starts of the windows [a, min(a + w, T)) of a rollout of T tokens: 0, s, 2s, … until one reaches T."""
    if length <= 0:
        return []
    k = 1 if length <= window else math.ceil((length - window) / stride) + 1
    return [i * stride for i in range(k)]


def shear_weights(h: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor,
                  cfg) -> tuple[torch.Tensor, dict]:
    """ω (N, C) for hidden states h (N, C, d) of all rows of the rollout batch, valid mask (N, C) (a prefix per row),
    rewards (N,) and group ids (N,). Returns (ω, diagnostics)."""
    N, C = mask.shape
    h = h.float()
    valid = mask.bool()
    lengths = valid.sum(1).tolist()
    correct = (rewards.float() >= cfg.reward_threshold).tolist()
    w = valid.float().clone()  # fallback 1 (uniform groups, no opposing rollouts)
    W = int(cfg.window)
    spans = []  # (row, start, end)
    for i in range(N):
        spans += [(i, a, min(a + W, lengths[i])) for a in span_starts(lengths[i], W, int(cfg.stride))]
    pairs = []  # (span index of a correct row, span index of a wrong row) in the same group
    by_row: dict[int, list[int]] = {}
    for si, (i, _, _) in enumerate(spans):
        by_row.setdefault(i, []).append(si)
    gid = group_ids.tolist()
    groups: dict = {}
    for i in range(N):
        groups.setdefault(gid[i], []).append(i)
    reweighted = [False] * N
    for rows in groups.values():
        good = [i for i in rows if correct[i] and lengths[i] > 0]
        bad = [i for i in rows if not correct[i] and lengths[i] > 0]
        if not good or not bad:
            continue
        for i in good + bad:
            reweighted[i] = True
        pairs += [(p, q) for i in good for p in by_row[i] for j in bad for q in by_row[j]]
    span_d = torch.full((len(spans),), float("inf"))
    iters, err = 0, 0.0
    for s in range(0, len(pairs), int(cfg.max_pairs)):
        chunk = pairs[s:s + int(cfg.max_pairs)]
        xs, xm = _stack([spans[p] for p, _ in chunk], h, W)
        ys, ym = _stack([spans[q] for _, q in chunk], h, W)
        if cfg.epsilon_scale == "mean_cost":
            cost = torch.cdist(xs, ys)
            vm = (xm.unsqueeze(2) & ym.unsqueeze(1)).float()
            eps = cfg.epsilon * (cost * vm).sum((1, 2)) / vm.sum((1, 2))
            eps = eps.clamp(min=1e-12)
        else:
            eps = float(cfg.epsilon)
        d, info = sinkhorn_w1(xs, xm, ys, ym, eps, int(cfg.max_iter), float(cfg.tol))
        iters, err = max(iters, info["iters"]), max(err, info["marginal_err"])
        p_idx = torch.tensor([p for p, _ in chunk])
        q_idx = torch.tensor([q for _, q in chunk])
        span_d.scatter_reduce_(0, p_idx, d.cpu(), reduce="amin")  # min over the opposing spans and rollouts
        span_d.scatter_reduce_(0, q_idx, d.cpu(), reduce="amin")
    norms = h.norm(dim=-1)
    mean_norms = []
    for rows in groups.values():
        if not any(reweighted[i] for i in rows):
            continue
        r = torch.tensor(rows)
        nbar = (norms[r] * valid[r]).sum() / valid[r].sum().clamp(min=1)
        mean_norms.append(float(nbar))
        scale = 1.0 / float(nbar) if cfg.normalize == "group_mean_norm" else 1.0
        for i in rows:
            if not reweighted[i]:
                continue
            omega = torch.zeros(C)
            for si in by_row[i]:
                _, a, b = spans[si]
                omega[a:b] = torch.maximum(omega[a:b], span_d[si])  # max over the covering spans
            w[i] = omega.to(w.device) * scale * valid[i]
    n_rows = sum(1 for x in lengths if x > 0)
    stats = {
        "fallback_rate": 1.0 - sum(reweighted) / max(n_rows, 1),
        "span_pairs": float(len(pairs)),
        "sinkhorn_iters": float(iters),
        "sinkhorn_marginal_err": float(err),
        "mean_hidden_norm": sum(mean_norms) / len(mean_norms) if mean_norms else float("nan"),
        "reweighted_weight_mean": float(w[torch.tensor(reweighted, dtype=torch.bool).unsqueeze(1) & valid].mean())
        if any(reweighted) else float("nan"),
    }
    return w, stats


def _stack(span_list, h: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, L, d) span points padded to the longest span of the list (L <= width) and their (P, L) mask."""
    rows = torch.tensor([i for i, _, _ in span_list], device=h.device)
    starts = torch.tensor([a for _, a, _ in span_list], device=h.device)
    lens = torch.tensor([b - a for _, a, b in span_list], device=h.device)
    L = min(int(lens.max()), width)
    offs = torch.arange(L, device=h.device)
    msk = offs.unsqueeze(0) < lens.unsqueeze(1)
    cols = torch.where(msk, starts.unsqueeze(1) + offs, torch.zeros_like(msk, dtype=torch.long))
    out = h[rows.unsqueeze(1), cols] * msk.unsqueeze(-1)
    return out, msk


STAT_KEYS = ("fallback_rate", "span_pairs", "sinkhorn_iters", "sinkhorn_marginal_err", "mean_hidden_norm",
             "reweighted_weight_mean")


@register_scheme("shear", ShearConfig)
class ShearScheme(AdvantageScheme):
    batch_level = True

    @staticmethod
    def check_config(cfg) -> list[str]:
        e = check_common(cfg, batch_level="shear")
        for key in ("window", "stride", "max_iter", "max_pairs", "chunk_rows"):
            if getattr(cfg, key) < 1:
                e.append(f"{key} = {getattr(cfg, key)}: must be >= 1")
        if cfg.epsilon <= 0:
            e.append(f"epsilon = {cfg.epsilon}: must be > 0")
        if cfg.tol <= 0:
            e.append(f"tol = {cfg.tol}: must be > 0")
        if cfg.epsilon_scale not in ("mean_cost", "absolute"):
            e.append(f"epsilon_scale = {cfg.epsilon_scale!r}: must be mean_cost or absolute")
        if cfg.hidden_position not in ("own", "predicting"):
            e.append(f"hidden_position = {cfg.hidden_position!r}: must be own or predicting")
        if cfg.normalize not in ("group_mean_norm", "none"):
            e.append(f"normalize = {cfg.normalize!r}: must be group_mean_norm or none")
        return e

    def hidden(self, model, batch: SchemeBatch) -> torch.Tensor:
        """(B, C, d) last hidden states of the completion tokens (tests replace this)."""
        return hidden_window(model, batch, self.cfg.hidden_position, int(self.cfg.chunk_rows),
                             share_prompts=self.share_prompts)

    def prepare(self, model, batch: SchemeBatch) -> PreparedWeights:
        if batch.group_ids is None:
            raise ValueError("shear needs the rollout batch's group ids (complete groups of G rollouts)")
        h = self.hidden(model, batch)
        w, stats = shear_weights(h, batch.completion_mask, batch.rewards, batch.group_ids, self.cfg)
        return PreparedWeights.of(w, stats, STAT_KEYS, batch.completion_mask.device)

    def weights(self, model, batch: SchemeBatch) -> SchemeOutput:
        return prepared_output(batch, "shear", STAT_KEYS)
