"""The chunked linear log-prob (no (B, T, V) float32 copy) equals the straightforward logits path, with gradients."""

import pytest
import torch

from grail_exp.compute.logprobs import entropy_from_logits
from grail_exp.loss import linear_logprob, selective_log_softmax


def _reference(h, W, b, ids, T):
    z = h @ W.T
    if b is not None:
        z = z + b
    z = z.float() / T
    return selective_log_softmax(z, ids), entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [3, 5, 1000])  # several chunks (backward recomputes), one chunk (softmax kept)
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_autograd(chunk, bias):
    g = torch.Generator().manual_seed(0)
    B, T, d, V = 2, 5, 8, 13
    h = torch.randn(B, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    up_lp, up_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    lp, ent = linear_logprob(h, W, b, ids, temperature=0.7, chunk_tokens=chunk)
    ref_lp, ref_ent = _reference(h, W, b, ids, 0.7)
    assert torch.allclose(lp, ref_lp.float(), atol=1e-6) and torch.allclose(ent, ref_ent.float(), atol=1e-6)

    inputs = [h, W] + ([b] if bias else [])
    got = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), inputs)
    want = torch.autograd.grad((ref_lp * up_lp.double()).sum() + (ref_ent * up_ent.double()).sum(), inputs)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-5, rtol=1e-4)


def test_gradient_check_float64():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 6, (4,), generator=g)

    def f(h, W):
        lp, ent = linear_logprob(h, W, None, ids, temperature=1.3, chunk_tokens=2)
        return lp.double().sum() + 0.5 * ent.double().sum()

    # The function's outputs are float32, so compare against finite differences at float32 resolution.
    assert torch.autograd.gradcheck(f, (h, W), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_bf16_matches_float32_reference_within_bf16_precision():
    g = torch.Generator().manual_seed(2)
    h, W = torch.randn(3, 7, 16, generator=g), torch.randn(50, 16, generator=g) * 0.2
    ids = torch.randint(0, 50, (3, 7), generator=g)
    lp, _ = linear_logprob(h.bfloat16(), W.bfloat16(), None, ids, chunk_tokens=4)
    ref, _ = _reference(h, W, None, ids, 1.0)
    assert lp.dtype == torch.float32 and (lp - ref).abs().max() < 0.05


def test_chunking_bounds_the_live_logits():
    """With chunk_tokens = n the forward never builds more than (n, V) logits at once (counted via a matmul spy)."""
    import grail_exp.compute.logprobs as lpmod

    shapes = []
    real = lpmod._chunk_logits

    def spy(h, W, b, inv_t):
        shapes.append(h.shape[0])
        return real(h, W, b, inv_t)

    lpmod._chunk_logits = spy
    try:
        h = torch.randn(2, 9, 4, requires_grad=True)
        lp, _ = linear_logprob(h, torch.randn(11, 4), None, torch.zeros(2, 9, dtype=torch.long), chunk_tokens=4)
        lp.sum().backward()
    finally:
        lpmod._chunk_logits = real
    assert max(shapes) == 4 and sum(shapes) == 2 * 18  # forward + backward recompute, 18 rows each


@pytest.mark.parametrize("top_k, top_p, T", [(1, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.9, 1.3), (20, 0.8, 1.0), (0, 1.0, 1.0)])
def test_kept_log_mass_by_enumeration(top_k, top_p, T):
    """log M_t against an enumeration of the kept set per row, in float64 (top-k: the k largest; top-p within them:
    the fewest largest tokens whose renormalised mass reaches p, written as a loop)."""
    import math

    from grail_exp.compute.logprobs import kept_log_mass

    g = torch.Generator().manual_seed(0)
    h, W, b = torch.randn(2, 7, 8, generator=g), torch.randn(60, 8, generator=g), torch.randn(60, generator=g)
    got = kept_log_mass(h, W, b, top_k, top_p, T, chunk_tokens=4)  # several chunks
    z = ((h @ W.T + b).double() / T).reshape(-1, 60)
    want = []
    for row in z:
        p = torch.softmax(row, -1).tolist()
        order = sorted(range(60), key=lambda v: -p[v])
        cand = order[:top_k] if top_k else order
        kept, mass_c = [], sum(p[v] for v in cand)
        for v in cand:  # largest first, until the renormalised mass reaches p
            kept.append(v)
            if sum(p[u] for u in kept) / mass_c >= top_p:
                break
        want.append(math.log(sum(p[v] for v in kept)))
    # fp32 logits (|z| ~ 10): logsumexp differences to ~1e-5
    assert torch.allclose(got.reshape(-1).double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)
    assert got.shape == (2, 7) and (got <= 1e-6).all()
    if top_k == 0 and top_p == 1.0:
        assert torch.equal(got, torch.zeros(2, 7))
