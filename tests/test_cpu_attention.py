"""The explicit CPU attention (grail_exp/compute/attention.py) against attention written out by hand, and its use in models.

The reference is the textbook formula evaluated in float64 one query row at a time: for query head h (key/value head
h // G), row i: p_j = exp(s_j) / Σ_allowed exp(s), s_j = scale · q_i · k_j over the keys the mask allows, o_i = Σ p_j v_j;
a row with no allowed key outputs 0. Its gradients come from autograd through that loop.

Tolerances. float64 inputs: the kernel computes in float64 too, so only summation order differs (reductions of
≤ 64 terms: 64 · 2^-52 of the terms' scale; 1e-12 covers it with room). bfloat16 inputs: the kernel computes in
float32 and rounds each result to bfloat16 once — half a bfloat16 ulp (8 significant bits), ≤ 2^-8 of the
value, plus float32 error of
reductions of ≤ 64 terms (64 · 2^-24 ≈ 4e-6 of the terms' scale, bounded here by 1e-4 of the largest entry).
"""

from __future__ import annotations

import pytest
import torch

from helpers.tolerances import MODEL_REORDER

B, H, HK, D = 3, 6, 2, 8


def reference(q, k, v, mask, scale):
    """Attention by hand, float64, one (batch, head, query row) at a time."""
    q, k, v = q.double(), k.double(), v.double()
    b_, h_, lq, d = q.shape
    groups = h_ // k.shape[1]
    rows = []
    for b in range(b_):
        heads = []
        for h in range(h_):
            out = []
            for i in range(lq):
                allowed = [j for j in range(k.shape[2]) if bool(mask[b if mask.shape[0] > 1 else 0, 0, i, j])]
                if not allowed:
                    out.append(torch.zeros(d, dtype=torch.float64))
                    continue
                s = torch.stack([scale * (q[b, h, i] * k[b, h // groups, j]).sum() for j in allowed])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out.append(sum(p[n] * v[b, h // groups, j] for n, j in enumerate(allowed)))
            heads.append(torch.stack(out))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def inputs(dtype, lq=5, lk=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, HK, lk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, HK, lk, D, generator=g).to(dtype).requires_grad_()
    # causal with the queries at the last lq key positions, and left padding: row 1 pads 3 keys, row 2 pads 6, so
    # row 2's first query has no key to attend to (a left-padding position)
    mask = torch.ones(B, 1, lq, lk, dtype=torch.bool).tril(lk - lq)
    mask[1, :, :, :3] = False
    mask[2, :, :, :6] = False
    return q, k, v, mask


def grads(fn, q, k, v, go):
    for t in (q, k, v):
        t.grad = None
    out = fn()
    out.backward(go)
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_output_and_gradients_equal_attention_written_out(dtype):
    from grail_exp.compute.attention import explicit_attention

    q, k, v, mask = inputs(dtype)
    scale = D ** -0.5
    go = torch.randn(B, H, q.shape[2], D, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, g = grads(lambda: explicit_attention(q, k, v, mask, scale), q, k, v, go)
    ref_out, ref_g = grads(lambda: reference(q, k, v, mask, scale), q, k, v, go)
    assert out.dtype == dtype and all(x.dtype == dtype for x in g)
    for name, a, r in [("out", out, ref_out), *zip(("dq", "dk", "dv"), g, ref_g)]:
        a, r = a.double(), r.double()
        if dtype == torch.float64:
            bound = 1e-12 * r.abs().max()
        else:
            bound = 2.0 ** -8 * r.abs() + 1e-4 * r.abs().max()
        assert ((a - r).abs() <= bound).all(), f"{name}: {(a - r).abs().max():.3g}"
    assert torch.equal(out[2, :, 0], torch.zeros_like(out[2, :, 0]))  # the query with no key: zero output


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_prompts_apart_equal_attention_written_out_over_each_rows_whole_sequence(dtype):
    """``PrefixSuffixAttention``: 5 rows of 2 prompts, interleaved and of unequal count (3 + 2), prompt 1 left-padded by
    2 keys, row 4's suffix right-padded by 2 (its keys masked), against the reference on each row's own copy of its
    prompt ⊕ its suffix; gradients of the prompts' keys and values against the reference's, summed over each
    prompt's rows by hand. Tolerances as above (reductions of ≤ 64 terms)."""
    from grail_exp.compute.attention import PrefixSuffixKV, RowGroups, prefix_suffix_attention

    g = torch.Generator().manual_seed(3)
    rows, prompts, L, S = 5, 2, 6, 4
    group = torch.tensor([0, 1, 0, 1, 0])

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    q, kp, vp, ks, vs = t(rows, H, S, D), t(prompts, HK, L, D), t(prompts, HK, L, D), t(rows, HK, S, D), t(rows, HK, S, D)
    prompt_mask = torch.ones(prompts, L, dtype=torch.bool)
    prompt_mask[1, :2] = False
    suffix_mask = torch.ones(rows, 1, S, S, dtype=torch.bool).tril()
    suffix_mask[4, :, :, 2:] = False  # row 4's last two positions are padding: no query attends to them
    mask = torch.cat([prompt_mask[group][:, None, None, :].expand(rows, 1, S, L), suffix_mask], -1)
    go = torch.randn(rows, H, S, D, generator=g).to(dtype)
    scale = D ** -0.5

    out = prefix_suffix_attention(q, PrefixSuffixKV(kp, vp, ks, vs, RowGroups(group, prompts)), mask, scale)
    mine = (out, *torch.autograd.grad(out, (q, kp, vp, ks, vs), go))
    # the reference on each row's own copy of its prompt, in float64 leaves holding the same values (gradients taken
    # at the inputs' bfloat16 would round each copy's before the sum): autograd sums the copies' into the prompt's
    q64, kp64, vp64, ks64, vs64 = (x.detach().double().requires_grad_() for x in (q, kp, vp, ks, vs))
    ref = reference(q64, torch.cat([kp64[group], ks64], 2), torch.cat([vp64[group], vs64], 2), mask, scale)
    expected = (ref, *torch.autograd.grad(ref, (q64, kp64, vp64, ks64, vs64), go.double()))
    for name, a, r in zip(("out", "dq", "dkp", "dvp", "dks", "dvs"), mine, expected):
        assert a.dtype == dtype
        a, r = a.detach().double(), r.detach().double()
        bound = 1e-12 * r.abs().max() if dtype == torch.float64 else 2.0 ** -8 * r.abs() + 1e-4 * r.abs().max()
        assert ((a - r).abs() <= bound).all(), f"{name}: {(a - r).abs().max():.3g}"


def test_backward_equals_numerical_derivatives():
    """The hand-written backward against finite differences (float64), fully masked row included."""
    from grail_exp.compute.attention import explicit_attention

    q, k, v, mask = inputs(torch.float64, lq=3, lk=5)
    mask[2, :, :, :4] = False  # row 2's first two queries see nothing
    assert torch.autograd.gradcheck(lambda a, b, c: explicit_attention(a, b, c, mask, 0.4), (q, k, v))


def test_additive_mask_equals_boolean_mask():
    from grail_exp.compute.attention import explicit_attention

    q, k, v, mask = inputs(torch.float64)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    keep = mask.any(-1, keepdim=True).expand(-1, H, -1, D)  # rows with at least one key
    a = explicit_attention(q, k, v, mask, 0.3)
    b = explicit_attention(q, k, v, additive, 0.3)
    assert torch.allclose(a[keep], b[keep], rtol=0, atol=1e-12)


def test_same_as_the_fused_kernel_and_bad_shapes_refused():
    from grail_exp.compute.attention import explicit_attention

    q, k, v, mask = inputs(torch.float32)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    ours = explicit_attention(q, k, v, mask, 0.25)
    real = mask.any(-1, keepdim=True).expand(-1, H, -1, D)
    assert (ours - fused)[real].abs().max() <= 1e-5 * fused.abs().max()  # float32, reductions of <= 8 terms
    with pytest.raises(ValueError, match="not a multiple"):
        explicit_attention(q[:, :5], k, v, mask, 0.25)
    with pytest.raises(ValueError, match="mask"):
        explicit_attention(q, k, v, mask.expand(-1, H, -1, -1), 0.25)


def _policy_pass(model, batch, share):
    from grail_exp.compute.forward import policy_forward

    model.zero_grad()
    m = batch.loss_mask
    logp, ent, _ = policy_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                  batch.completion_ids, 0.7, share_prompts=share)
    ((logp * m).sum() + 0.3 * (ent * m).sum()).backward()
    return logp.detach() * m, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("share", [False, True])
def test_model_forward_and_gradients_equal_the_fused_kernel(share, monkeypatch):
    """A grouped-query model (4 query heads, 2 key/value heads) with left-padded prompts of three lengths: the policy's
    log-probs and every parameter's gradient with the explicit attention equal the fused kernel's within a reordered
    reduction per stage; the explicit path ran in the training pass and not under no_grad."""
    from grail_exp.compute import attention as cpu_attention
    from grail_exp.compute.forward import policy_forward
    from grail_exp.compute.model_attention import use_kernel_gqa
    from helpers.batches import interleaved_training_batch
    from helpers.pinned_step import build_model_and_tokenizer

    calls = []
    real_apply = cpu_attention.ExplicitAttention.apply
    monkeypatch.setattr(cpu_attention.ExplicitAttention, "apply", lambda *a: calls.append(1) or real_apply(*a))
    model, tok = build_model_and_tokenizer()
    model.config._attn_implementation = "sdpa"
    batch = interleaved_training_batch(tok)
    use_kernel_gqa(model, 0)
    fused_logp, fused_g = _policy_pass(model, batch, share)
    assert not calls
    use_kernel_gqa(model, 10 ** 6)
    logp, g = _policy_pass(model, batch, share)
    assert len(calls) >= model.config.num_hidden_layers
    n = len(calls)
    with torch.no_grad():
        policy_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, 0.7,
                       share_prompts=share)
    assert len(calls) == n  # no gradient: the fused kernel
    assert (logp - fused_logp).abs().max() <= MODEL_REORDER * fused_logp.abs().max()
    scale = max(x.abs().max() for x in fused_g)
    assert max((a - b).abs().max() for a, b in zip(g, fused_g)) <= MODEL_REORDER * scale


def test_config_key_reaches_every_attention_module(compose_cfg):
    from grail_exp.compute.model_attention import EXPLICIT_ATTENTION_ATTR
    from grail_exp.models.loading import load_causal_lm, resolve_model_path
    from grail_exp.validate import validate

    tiny = "model.random_init_overrides={num_hidden_layers: 2, hidden_size: 72, intermediate_size: 96}"
    from grail_exp.compute.attention import DEFAULT_MAX_SCORES
    from grail_exp.config import ModelConfig

    assert ModelConfig.cpu_explicit_attention_max_scores == DEFAULT_MAX_SCORES
    for value in (DEFAULT_MAX_SCORES, 0):
        cfg = validate(compose_cfg(["model=smollm2_135m", "model.random_init=true", tiny, "advantage=grpo",
                                    f"model.cpu_explicit_attention_max_scores={value}"]))
        model = load_causal_lm(resolve_model_path(cfg), cfg, trainable=True)
        attn = [mod for mod in model.modules() if hasattr(mod, "num_key_value_groups")]
        assert len(attn) == 2 and all(getattr(mod, EXPLICIT_ATTENTION_ATTR) == value for mod in attn)


def test_suffix_packing_keeps_each_rows_positions_up_to_its_last_token():
    """``SuffixPacking`` against a loop over rows and columns: the packed positions are each row's columns up to its
    last attended one (a masked column before it, as in OAR-P's masked copies, included), in row order; the mask is the
    padded layout's (the row's prompt columns, its own suffix causally, masked columns masked); unpack(pack(x)) is x
    there and zero elsewhere."""
    from grail_exp.compute.attention import SuffixPacking

    suffix = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    prefix = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    packing = SuffixPacking(suffix, prefix)
    expected = [r * 5 + j for r in range(4) for j in range(5) if suffix[r, j:].any()]
    assert packing.index.tolist() == expected == [0, 1, 2, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15]
    B, S, L = 4, 5, 3
    assert packing.mask.shape == (B, 1, S, L + S)
    for b in range(B):
        for i in range(S):
            for j in range(L):
                assert bool(packing.mask[b, 0, i, j]) == bool(prefix[b, j])
            for j in range(S):
                assert bool(packing.mask[b, 0, i, L + j]) == (j <= i and bool(suffix[b, j]))
    x = torch.randn(B, S, 2, 3)
    packed = packing.pack(x)
    assert packed.shape == (1, len(expected), 2, 3)
    back = packing.unpack(packed)
    kept = torch.zeros(B * S, dtype=torch.bool)
    kept[expected] = True
    kept = kept.view(B, S)
    assert torch.equal(back[kept], x[kept]) and not back[~kept].any()
    heads = torch.randn(1, 2, len(expected), 3)  # (1, heads, N, D) as a layer's keys arrive
    assert torch.equal(packing.unpack_heads(heads).transpose(1, 2)[kept], heads[0].transpose(0, 1))


def test_a_gradient_with_respect_to_the_suffix_only_leaves_out_the_prompts_gradients(monkeypatch):
    """``PrefixSuffixAttention`` computes dK_p, dV_p only when the backward running reaches the prompts' keys and
    values: a gradient with respect to the suffix's inputs alone (GRAIL's probe through the policy forward: the
    suffix embeddings) skips both products, and its dQ, dK_s, dV_s are those of the full backward, bit for bit."""
    from grail_exp.compute.attention import PrefixSuffixAttention, PrefixSuffixKV, RowGroups, prefix_suffix_attention

    g = torch.Generator().manual_seed(5)
    rows, prompts, L, S = 4, 2, 6, 3
    group = torch.tensor([0, 0, 1, 1])
    leaves = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
              for shape in ((rows, H, S, D), (prompts, HK, L, D), (prompts, HK, L, D), (rows, HK, S, D), (rows, HK, S, D))]
    q, kp, vp, ks, vs = (x * 1.0 for x in leaves)  # nodes of a graph, as a layer's projections are
    mask = torch.cat([torch.ones(rows, 1, S, L, dtype=torch.bool), torch.ones(rows, 1, S, S, dtype=torch.bool).tril()], -1)
    out = prefix_suffix_attention(q, PrefixSuffixKV(kp, vp, ks, vs, RowGroups(group, prompts)), mask, D ** -0.5)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    seen = []
    real = PrefixSuffixAttention.backward

    def spy(ctx, grad_out):
        grads = real(ctx, grad_out)
        seen.append([x is not None for x in grads[:5]])
        return grads

    monkeypatch.setattr(PrefixSuffixAttention, "backward", staticmethod(spy))
    suffix_only = torch.autograd.grad(out, (leaves[0], leaves[3], leaves[4]), go, retain_graph=True)
    everything = torch.autograd.grad(out, leaves, go)
    assert seen == [[True, False, False, True, True], [True] * 5]
    for a, b in zip(suffix_only, (everything[0], everything[3], everything[4])):
        assert torch.equal(a, b)
