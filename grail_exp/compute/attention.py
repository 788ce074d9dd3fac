"""Attention written as two products and a float32 softmax, for short sequences on a CPU.

    S = scale · Q Kᵀ (masked)      P = softmax(S) = exp(S − lse)      O = P V

with grouped-query heads (the G query heads of a key/value head share it; no copy of K, V per query head). The
backward recomputes P from the saved log-sum-exp instead of keeping it, as flash attention does, so autograd holds
what PyTorch's fused kernel holds (Q, K, V in their own dtype, one float per query row):

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ⊙ (dP − rowsum(P ⊙ dP))      dQ = scale · dS K      dK = scale · dSᵀ Q

(summed over the G query heads of each key/value head by the products themselves).

Why: at the real-model study's lengths (~40–160 key positions) PyTorch's fused CPU attention kernel spends most of its
time outside arithmetic; its backward was ~23 % of the update's backward. These few batched matrix products measured
35-40 % cheaper per layer forward + backward at SmolLM2's heads (``python -m grail_exp.bench bench.mode=attention``;
numbers in docs/performance.md). Longer sequences keep the fused kernel (``model.cpu_explicit_attention_max_scores``), as do
forward passes without gradients, where the fused kernel is the faster one. Computed in float32 for bfloat16 / float16
inputs (as the fused kernel accumulates), in the inputs' own dtype otherwise. A query row with no key to attend to
(a left-padding position) gets a zero output and zero gradients, as from the fused kernel.
"""

from __future__ import annotations

import torch

from grail_exp.compute.leading_rows import live_rows, pad_rows, will_run

SDPA_GQA = "sdpa_gqa"  # transformers' SDPA attention, grouped-query heads left to the kernel on CPU (model_attention.py)
SHARED_PROMPTS = "shared_prompts"  # the keyword carrying a suffix pass's prompts (one PrefixLayer per decoder layer)

# The default of model.cpu_explicit_attention_max_scores (query x key positions per head): where the explicit path
# stops being the faster one on a 2-core x86 machine (bench.mode=attention, explicit / fused at 2 threads: 0.87 at
# 128 x 128, 0.93 at 160 x 160, 1.61 at 192 x 192; at 1 thread 0.91 at 130 x 130, 1.05 at 160 x 160), so that it
# covers the prefix pass of SmolLM2's 131-token few-shot prompts (130 x 130) as well as the study's short prompts.
DEFAULT_MAX_SCORES = 20_000


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _grouped(q: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, L, D) -> (B, kv_heads, G·L, D): the G query heads of each key/value head stacked along the rows."""
    b, h, length, d = q.shape
    return q.to(dtype).reshape(b, kv_heads, (h // kv_heads) * length, d)


def _scores(qg: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, groups: int) -> torch.Tensor:
    """scale · Q Kᵀ with masked entries at −inf: (B, kv_heads, G·Lq, Lk)."""
    s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)
    b, hk, rows, lk = s.shape
    s5 = s.view(b, hk, groups, rows // groups, lk)
    if mask.dtype == torch.bool:
        s5.masked_fill_(~mask.unsqueeze(2), float("-inf"))
    else:
        s5.add_(mask.unsqueeze(2).to(s.dtype))
    return s


class ExplicitAttention(torch.autograd.Function):
    """O = softmax(scale · Q Kᵀ + mask) V with grouped-query heads; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        b, h, lq, d = q.shape
        hk = k.shape[1]
        groups = h // hk
        dt = _compute_dtype(q.dtype)
        qg, kf, vf = _grouped(q, hk, dt), k.to(dt), v.to(dt)
        s = _scores(qg, kf, mask, scale, groups)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp_(s.sub_(m))
        total = p.sum(-1, keepdim=True)
        p.div_(total.clamp_min(torch.finfo(dt).tiny))  # a row with no key: all zeros, not 0/0
        out = torch.matmul(p, vf)  # (B, kv_heads, G·Lq, D)
        # lse = +inf for a row with no key, so the backward's exp(S − lse) is 0 there too.
        lse = torch.where(total > 0, m + total.log(), torch.full_like(total, float("inf")))
        ctx.save_for_backward(q, k, v, mask, lse)
        ctx.scale, ctx.groups = scale, groups
        return out.reshape(b, h, lq, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, lse = ctx.saved_tensors
        need = [will_run(ctx, i) for i in range(3)]
        b = q.shape[0]
        r = live_rows(b)  # a backward whose cotangent is zero past row r (``grail_exp.compute.leading_rows``)
        if r is not None:
            q, k, v, lse, grad_out = q[:r], k[:r], v[:r], lse[:r], grad_out[:r]
            mask = mask[:r] if mask.shape[0] == b else mask
        scale, groups = ctx.scale, ctx.groups
        hk = k.shape[1]
        dt = _compute_dtype(q.dtype)
        qg, kf, vf = _grouped(q, hk, dt), k.to(dt), v.to(dt)
        p = torch.exp_(_scores(qg, kf, mask, scale, groups).sub_(lse))
        dog = _grouped(grad_out, hk, dt)
        dv = torch.matmul(p.transpose(-1, -2), dog) if need[2] else None
        dp = torch.matmul(dog, vf.transpose(-1, -2))
        ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p).mul_(scale)
        dq = torch.matmul(ds, kf).reshape(q.shape) if need[0] else None
        dk = torch.matmul(ds.transpose(-1, -2), qg) if need[1] else None
        grads = [pad_rows(g.to(t.dtype), b) if g is not None else None for g, t in zip((dq, dk, dv), (q, k, v))]
        return (*grads, None, None)


class RowGroups:
    """Rows laid out by their prompt for grouped products (the decode step's, the update's suffix pass): ``slot`` (B,)
    places row r at ``prompt × width + its rank among its prompt's rows`` (rows in any order; width = the most rows
    of one prompt)."""

    def __init__(self, group: torch.Tensor, num_prompts: int):
        self.group = group  # (B,) prompt of each computed row
        counts = torch.bincount(group, minlength=num_prompts)
        self.width = int(counts.max()) if group.numel() else 1
        first = torch.cumsum(counts, 0) - counts
        by_prompt = torch.argsort(group, stable=True)
        rank = torch.empty_like(group)
        rank[by_prompt] = torch.arange(group.numel(), device=group.device) - first[group[by_prompt]]
        self.slot = group * self.width + rank
        self.num_prompts = num_prompts
        self.rows = torch.arange(group.numel(), device=group.device)
        # prompt-major with the same count per prompt (the trainer's usual micro-batch): slot = row, no scatter needed
        self.dense = group.numel() == num_prompts * self.width and bool((self.slot == self.rows).all())
        self.first = torch.full((num_prompts,), group.numel(), dtype=torch.long, device=group.device).scatter_reduce(
            0, group, self.rows, "amin")  # each prompt's first row (none: the row count)

    def grouped(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(B, ...) -> (U, width, ...), ``fill`` where a prompt has fewer rows."""
        out = x.new_full((self.num_prompts * self.width, *x.shape[1:]), fill)
        out[self.slot] = x
        return out.view(self.num_prompts, self.width, *x.shape[1:])

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """(U, width, ...) -> (B, ...)."""
        return x.reshape(self.num_prompts * self.width, *x.shape[2:])[self.slot]


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """query (B, H, Lq, D), key / value (B, kv_heads, Lk, D), mask (B | 1, 1, Lq, Lk) boolean (True: attend) or
    additive -> (B, H, Lq, D)."""
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads")
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected a (batch, 1, queries, keys) mask, got shape {tuple(mask.shape)}")
    return ExplicitAttention.apply(query, key, value, mask, float(scale))


class SuffixPacking:
    """A suffix pass run on its rows' own positions only: the (B, S) layout's padding (completion columns past a row's
    last token) is left out of every position-wise product — projections, MLP, norms — by packing each row's positions
    up to its last token into one row (1, N); the attention unpacks queries, keys and values to (B, S) and runs there
    under ``mask``, the padded layout's (B, 1, S, L+S) boolean mask (the row's prompt columns, its own suffix causally,
    masked columns masked). A masked column before a row's last token (a token masked out, as OAR-P's copies do) is
    still computed: its output is the row's, as in the padded layout."""

    def __init__(self, suffix_mask: torch.Tensor, prefix_mask: torch.Tensor):
        """``suffix_mask`` (B, S): the suffix columns attended to; ``prefix_mask`` (B, L): each row's prompt columns."""
        self.rows, self.width = suffix_mask.shape
        keys = suffix_mask.bool()
        computed = keys.flip(1).cumsum(1).flip(1) > 0  # up to each row's last attended column
        self.index = computed.reshape(-1).nonzero().squeeze(1)  # (N,) row-major: row r's positions in order
        self.row_offsets = torch.cat([computed.new_zeros(1, dtype=torch.long), computed.sum(1).cumsum(0)])  # (B+1,)
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=keys.device).tril()
        self.mask = torch.cat([prefix_mask.bool()[:, None, :].expand(-1, self.width, -1),
                               causal[None] & keys[:, None, :]], -1)[:, None]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (1, N, ...)."""
        return x.reshape(self.rows * self.width, *x.shape[2:]).index_select(0, self.index).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (B, S, ...), zeros at padding."""
        out = x.new_zeros(self.rows * self.width, *x.shape[2:]).index_copy(0, self.index, x[0])
        return out.view(self.rows, self.width, *x.shape[2:])

    def unpack_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(1, heads, N, D) -> (B, heads, S, D)."""
        return self.unpack(x.transpose(1, 2)).transpose(1, 2)


class PrefixSuffixKV:
    """One layer's keys and values in the suffix pass of a micro-batch whose distinct prompts were computed once
    (``grail_exp/compute/forward.py``): the prompts' (U rows, L positions) and the rows' own suffix (B rows, S positions;
    ``packing``: the pass ran on the real positions only and these are unpacked from them)."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, groups: RowGroups, packing: SuffixPacking | None = None):
        if packing is not None:
            keys, values = packing.unpack_heads(keys), packing.unpack_heads(values)
        self.kp, self.vp, self.ks, self.vs, self.groups = prefix_keys, prefix_values, keys, values, groups
        self.packing = packing

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (prompt ⊕ suffix) keys and values, (B, kv_heads, L+S, D): what a plain cache would hold."""
        g = self.groups.group
        return (torch.cat([self.kp.index_select(0, g), self.ks], 2), torch.cat([self.vp.index_select(0, g), self.vs], 2))


class PrefixSuffixAttention(torch.autograd.Function):
    """Attention of a suffix pass over its rows' shared prompts and their own suffixes, as one softmax:

        S_p = scale · Q K_p[g(r)]ᵀ (prompt padding masked)   S_s = scale · Q K_sᵀ (causal, padding masked)
        P = softmax([S_p, S_s])      O = P_p V_p[g(r)] + P_s V_s

    with the rows of one prompt stacked into one product against that prompt's keys and values (as the decode step
    does, ``grail_exp/compute/model_attention.py``): (G · heads · S) × L products per prompt instead of a copy of the prompt per
    row and G small products; the prompt's gradients dK_p = scale · dS_pᵀ Q and dV_p = P_pᵀ dO come out summed over its
    rows by the same products. Float32 for half-precision inputs, the backward recomputes P from the saved
    log-sum-exp (``ExplicitAttention``'s scheme)."""

    @staticmethod
    def forward(ctx, q, kp, vp, ks, vs, prefix_mask, suffix_mask, scale, groups):
        b, h, lq, d = q.shape
        hk = ks.shape[1]
        dt = _compute_dtype(q.dtype)
        qr = _grouped(q, hk, dt)  # (B, hk, G·S, D)
        sp, ss = _prefix_suffix_scores(qr, rows_to_groups(qr, groups), kp.to(dt), ks.to(dt), prefix_mask, suffix_mask,
                                       scale, h // hk)
        m = torch.maximum(groups_to_rows(sp.amax(-1, keepdim=True), groups), ss.amax(-1, keepdim=True))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        pp = torch.exp_(sp.sub_(rows_to_groups(m, groups)))
        ps = torch.exp_(ss.sub_(m))
        total = groups_to_rows(pp.sum(-1, keepdim=True), groups) + ps.sum(-1, keepdim=True)
        inv = 1.0 / total.clamp_min(torch.finfo(dt).tiny)  # a row with no key: all zeros, not 0/0
        out = groups_to_rows(pp @ vp.to(dt), groups).add_(ps @ vs.to(dt)).mul_(inv)
        lse = torch.where(total > 0, m + total.log(), torch.full_like(total, float("inf")))
        ctx.save_for_backward(q, kp, vp, ks, vs, prefix_mask, suffix_mask, lse)
        ctx.scale, ctx.groups = scale, groups
        return out.reshape(b, h, lq, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, kp, vp, ks, vs, prefix_mask, suffix_mask, lse = ctx.saved_tensors
        need = [will_run(ctx, i) for i in range(5)]
        r = live_rows(q.shape[0])  # a backward whose cotangent is zero past row r (``grail_exp.compute.leading_rows``)
        if r is None:
            grads = _prefix_suffix_backward(q, kp, vp, ks, vs, prefix_mask, suffix_mask, lse, grad_out, ctx.scale,
                                            ctx.groups, need)
        else:
            # The leading rows against a copy of their own prompt each: stacked by prompt, a subset's uneven counts
            # leave padding slots in every product, and without the prompts' gradients (the probe's case) nothing
            # needs their sum (measured: docs/performance.md, "Numbers behind the code's choices").
            g = ctx.groups.group[:r]
            own = RowGroups(torch.arange(r, device=g.device), r)
            dq, dkp, dvp, dks, dvs = _prefix_suffix_backward(
                q[:r], kp.index_select(0, g), vp.index_select(0, g), ks[:r], vs[:r], prefix_mask.index_select(0, g),
                suffix_mask[:r], lse[:r], grad_out[:r], ctx.scale, own, need, cast_prompt=False)
            # a prompt's gradient: its rows' summed in the compute dtype, rounded once (as the stacked products do)
            dkp, dvp = (None if d is None else d.new_zeros(p.shape).index_add_(0, g, d).to(p.dtype)
                        for d, p in ((dkp, kp), (dvp, vp)))
            grads = (pad_rows(dq, q.shape[0]), dkp, dvp, pad_rows(dks, q.shape[0]), pad_rows(dvs, q.shape[0]))
        return (*grads, None, None, None, None)


def _prefix_suffix_backward(q, kp, vp, ks, vs, prefix_mask, suffix_mask, lse, grad_out, scale, groups, need,
                            cast_prompt: bool = True):
    """(dQ, dK_p, dV_p, dK_s, dV_s) of ``PrefixSuffixAttention``, each None where ``need`` says it is not wanted (a
    detached prompt, or a backward that never reaches the node that made it: GRAIL's probe differentiates with respect
    to the suffix embeddings only, so the prompt's keys and values need no dK_p, dV_p there). ``cast_prompt=False``:
    dK_p, dV_p stay in the compute dtype (float32 for half-precision inputs) for a caller that sums them further."""
    hk = ks.shape[1]
    dt = _compute_dtype(q.dtype)
    qr = _grouped(q, hk, dt)
    qg = rows_to_groups(qr, groups)
    kpf, vpf, ksf, vsf = kp.to(dt), vp.to(dt), ks.to(dt), vs.to(dt)
    sp, ss = _prefix_suffix_scores(qr, qg, kpf, ksf, prefix_mask, suffix_mask, scale, q.shape[1] // hk)
    pp = torch.exp_(sp.sub_(rows_to_groups(lse, groups, fill=float("inf"))))  # a padding slot: exp(-inf) = 0
    ps = torch.exp_(ss.sub_(lse))
    do = _grouped(grad_out, hk, dt)
    dog = rows_to_groups(do, groups)
    dvp = pp.transpose(-1, -2) @ dog if need[2] else None
    dvs = ps.transpose(-1, -2) @ do if need[4] else None
    dpp = dog @ vpf.transpose(-1, -2)
    dps = do @ vsf.transpose(-1, -2)
    delta = groups_to_rows((pp * dpp).sum(-1, keepdim=True), groups) + (ps * dps).sum(-1, keepdim=True)
    dsp = dpp.sub_(rows_to_groups(delta, groups)).mul_(pp).mul_(scale)
    dss = dps.sub_(delta).mul_(ps).mul_(scale)
    dq = groups_to_rows(dsp @ kpf, groups).add_(dss @ ksf).reshape(q.shape) if need[0] else None
    dkp = dsp.transpose(-1, -2) @ qg if need[1] else None
    dks = dss.transpose(-1, -2) @ qr if need[3] else None
    keep = (False, not cast_prompt, not cast_prompt, False, False)
    return tuple(None if g is None else g if k else g.to(t.dtype)
                 for g, t, k in zip((dq, dkp, dvp, dks, dvs), (q, kp, vp, ks, vs), keep))


def rows_to_groups(x: torch.Tensor, groups: RowGroups, fill: float = 0.0) -> torch.Tensor:
    """(B, kv_heads, R, X) -> (U, kv_heads, width·R, X): each prompt's rows stacked (``fill`` in padding slots)."""
    b, hk, r, n = x.shape
    u, w = groups.num_prompts, groups.width
    stacked = x.view(u, w, hk, r, n) if groups.dense else groups.grouped(x, fill)
    return stacked.permute(0, 2, 1, 3, 4).reshape(u, hk, w * r, n)


def groups_to_rows(y: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """(U, kv_heads, width·R, X) -> (B, kv_heads, R, X)."""
    u, hk, wr, n = y.shape
    per_row = y.view(u, hk, groups.width, wr // groups.width, n).permute(0, 2, 1, 3, 4)
    return per_row.reshape(-1, hk, wr // groups.width, n) if groups.dense else groups.rows_of(per_row)


def _prefix_suffix_scores(qr, qg, kp, ks, prefix_mask, suffix_mask, scale, heads_per_kv):
    """S_p (U, kv_heads, width·G·S, L) and S_s (B, kv_heads, G·S, S), masked entries at −inf; ``qg`` = the queries
    ``qr`` stacked by prompt."""
    sp = (qg @ kp.transpose(-1, -2)).mul_(scale)
    sp.masked_fill_(~prefix_mask[:, None, None, :], float("-inf"))
    ss = (qr @ ks.transpose(-1, -2)).mul_(scale)
    b, hk, rows, s = ss.shape
    ss.view(b, hk, heads_per_kv, rows // heads_per_kv, s).masked_fill_(~suffix_mask.unsqueeze(2), float("-inf"))
    return sp, ss


def prefix_suffix_attention(query: torch.Tensor, kv: PrefixSuffixKV, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """query (B, H, S, D) of a suffix pass, its layer's ``PrefixSuffixKV``, the pass's boolean mask (B, 1, S, L+S)
    over (prompt ⊕ suffix) keys (True: attend) -> (B, H, S, D). The prompt part of the mask is its padding (every
    prompt key precedes every suffix query), the same for the rows of one prompt: read from each prompt's first row."""
    L = kv.kp.shape[2]
    prefix_mask = mask[kv.groups.first.clamp(max=kv.groups.group.numel() - 1), 0, 0, :L]
    return PrefixSuffixAttention.apply(query, kv.kp, kv.vp, kv.ks, kv.vs, prefix_mask, mask[:, :, :, L:],
                                       float(scale), kv.groups)
