"""A backward whose cotangent lives on a pass's leading rows computes those rows only (grail_exp/compute/leading_rows.py) and
gives the full backward's numbers: linear layers and the CPU attention, against float64 products written out here and
against the full backward of the same functions. The end-to-end check — GRAIL's probe on its rows only, through the
trainer's step — is in tests/test_share_prompts.py (``grail_wrong_rows``, ``test_grail_probe_on_its_rows_only``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from grail_exp.compute.leading_rows import LeadingRows, RowNarrowingLinear, leading_rows, narrow_linear_layers


class MatrixProducts(TorchDispatchMode):
    """The row counts (M of an M × K by K × N product) of every aten.mm run inside the block."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


def _bound(a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    """|a @ b − exact| per entry for a length-K product in ``dtype``: K · eps · (|a| @ |b|) (a reordered sum moves by
    at most that), plus the final rounding."""
    k, eps = a.shape[-1], torch.finfo(dtype).eps
    return (k + 1) * eps * (a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 37, 24), (5, 7, 24), (9, 24)])
def test_linear_outside_the_block_is_atens_linear(dtype, bias, shape):
    """Outside ``leading_rows`` the layer is ``torch.nn.Linear``: the same forward, and the backward's products in
    aten's layouts, so every gradient is bit for bit the plain layer's."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 40, bias=bias, dtype=dtype)
    narrowing = torch.nn.Linear(24, 40, bias=bias, dtype=dtype)
    narrowing.load_state_dict(plain.state_dict())
    assert narrow_linear_layers(narrowing) == 1 and isinstance(narrowing, RowNarrowingLinear)
    x0 = torch.randn(*shape, dtype=dtype, requires_grad=True)
    cot = torch.randn(*shape[:-1], 40, dtype=dtype)
    out = []
    for layer in (plain, narrowing):
        x = x0 * 2  # a node, not a leaf: the layer's input gradient flows on
        y = layer(x)
        out.append((y, torch.autograd.grad(y, (x0, *layer.parameters()), cot)))
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_inside_the_block_computes_the_leading_positions_only(dtype):
    """Cotangent zero past position n of N: one product of n rows for dX (the weight's accumulation is not part of a
    backward with respect to an activation: no dW product), dX[:n] = dY[:n] W to a K-long product's rounding, exact
    zeros after; with the weight asked for too, dW = dY[:n]ᵀ X[:n]."""
    torch.manual_seed(1)
    N, n, d_in, d_out = 53, 20, 32, 48
    layer = torch.nn.Linear(d_in, d_out, bias=True, dtype=dtype)
    narrow_linear_layers(layer)
    x0 = torch.randn(1, N, d_in, dtype=dtype, requires_grad=True)
    cot = torch.randn(1, N, d_out, dtype=dtype)
    cot[:, n:] = 0
    span = LeadingRows(rows=3, of_rows=7, positions=n, of_positions=N)

    x = x0 * 1
    y = layer(x)
    with leading_rows(span), MatrixProducts() as mm:
        (dx,) = torch.autograd.grad(y, x, cot, retain_graph=True)
    assert mm.rows == [n]
    g, w = cot[0, :n], layer.weight.detach()
    exact = g.double() @ w.double()
    assert torch.all((dx[0, :n].double() - exact).abs() <= _bound(g, w, dtype) + torch.finfo(dtype).eps * exact.abs())
    assert torch.equal(dx[0, n:], torch.zeros_like(dx[0, n:]))

    with leading_rows(span), MatrixProducts() as mm:
        dx2, dw, db = torch.autograd.grad(y, (x, layer.weight, layer.bias), cot)
    assert sorted(mm.rows) == sorted([n, d_out])  # dX (n rows) and dW = dYᵀ X (d_out rows, a sum over n positions)
    xs = x0.detach()[0, :n]
    exact_w = g.double().t() @ xs.double()
    assert torch.all((dw.double() - exact_w).abs() <= _bound(g.t(), xs, dtype) + torch.finfo(dtype).eps * exact_w.abs())
    sum_bound = (n + 1) * torch.finfo(dtype).eps * g.double().abs().sum(0)  # an n-term sum in any order
    assert torch.all((db.double() - g.double().sum(0)).abs() <= sum_bound)
    assert torch.equal(dx2, dx)


def test_a_span_of_another_pass_narrows_nothing():
    """A product whose positions are not the span's pass's (another pass's node in the same backward) runs whole,
    as does everything outside the block and a span that covers every row."""
    layer = torch.nn.Linear(8, 8)
    narrow_linear_layers(layer)
    x = torch.randn(10, 8, requires_grad=True) * 1
    y = layer(x)
    for span in (LeadingRows(1, 2, 4, 12), LeadingRows(2, 2, 10, 10), None):
        with leading_rows(span), MatrixProducts() as mm:
            torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
        assert mm.rows == [10]


def test_narrowing_turns_plain_linear_layers_only():
    class Sub(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Sub(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert narrow_linear_layers(model) == 2
    assert type(model[1]) is Sub and type(model[0]) is RowNarrowingLinear and type(model[2][0]) is RowNarrowingLinear
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():  # without gradients: the plain layer's call
        assert torch.equal(model[0](torch.ones(1, 4)), F.linear(torch.ones(1, 4), model[0].weight, model[0].bias))


def _attention_inputs(seed: int):
    """A suffix pass's attention over shared prompts: 7 rows of 3 prompts, rows of a prompt not adjacent, prompt
    padding and suffix padding (causal), grouped-query heads (6 query heads on 2 key/value heads)."""
    from grail_exp.compute.attention import RowGroups

    g = torch.Generator().manual_seed(seed)
    B, U, H, hk, S, L, D = 7, 3, 6, 2, 5, 9, 8
    group = torch.tensor([0, 1, 0, 2, 1, 0, 2])
    q = torch.randn(B, H, S, D, generator=g, requires_grad=True)
    kp, vp = (torch.randn(U, hk, L, D, generator=g, requires_grad=True) for _ in range(2))
    ks, vs = (torch.randn(B, hk, S, D, generator=g, requires_grad=True) for _ in range(2))
    prefix_mask = torch.ones(U, L, dtype=torch.bool)
    prefix_mask[1, :3] = False
    prefix_mask[2, :1] = False
    lengths = torch.tensor([5, 3, 4, 5, 2, 5, 1])
    real = torch.arange(S)[None] < lengths[:, None]
    suffix_mask = (torch.ones(S, S, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    return q, kp, vp, ks, vs, prefix_mask, suffix_mask, RowGroups(group, U)


@pytest.mark.parametrize("r", [1, 4, 6])
def test_prefix_suffix_attention_on_leading_rows_equals_the_full_backward(r):
    """Rows r … B−1 with a zero cotangent: the leading rows' dQ, dK_s, dV_s and the prompts' dK_p, dV_p (summed over
    the rows that have each prompt) equal the full backward's to float32 rounding of the same products (each entry is
    the same sum of the same terms; only the products' batching differs); the other rows' gradients are exact zeros."""
    from grail_exp.compute.attention import PrefixSuffixAttention

    q, kp, vp, ks, vs, pm, sm, groups = _attention_inputs(r)
    out = PrefixSuffixAttention.apply(q, kp, vp, ks, vs, pm, sm, 0.35, groups)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    cot[r:] = 0
    inputs = (q, kp, vp, ks, vs)
    full = torch.autograd.grad(out, inputs, cot, retain_graph=True)
    span = LeadingRows(rows=r, of_rows=q.shape[0], positions=0, of_positions=-1)
    with leading_rows(span):
        narrow = torch.autograd.grad(out, inputs, cot)
    for name, a, b in zip(("dq", "dkp", "dvp", "dks", "dvs"), narrow, full):
        scale = float(b.abs().max())
        assert (a - b).abs().max() <= 20 * torch.finfo(torch.float32).eps * scale, name  # sums of <= 14 terms
    for a in (narrow[0], narrow[3], narrow[4]):
        assert torch.equal(a[r:], torch.zeros_like(a[r:]))
        assert a[:r].abs().sum() > 0


def test_explicit_attention_on_leading_rows_equals_the_full_backward():
    from grail_exp.compute.attention import ExplicitAttention

    g = torch.Generator().manual_seed(3)
    B, r = 5, 2
    q = torch.randn(B, 4, 6, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 2, 6, 8, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(B, 1, 6, 6).clone()
    mask[1, :, :, :2] = False  # left padding on one row
    mask[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)
    out = ExplicitAttention.apply(q, k, v, mask, 0.35)
    cot = torch.randn(out.shape, generator=g)
    cot[r:] = 0
    full = torch.autograd.grad(out, (q, k, v), cot, retain_graph=True)
    with leading_rows(LeadingRows(r, B, 0, -1)):
        narrow = torch.autograd.grad(out, (q, k, v), cot)
    for a, b in zip(narrow, full):
        assert (a - b).abs().max() <= 20 * torch.finfo(torch.float32).eps * float(b.abs().max())
        assert torch.equal(a[r:], torch.zeros_like(a[r:]))


@pytest.mark.parametrize("trainer, cuda, expected", [
    ({"accelerator": "cpu"}, True, True), ({"accelerator": "gpu"}, True, False), ({"accelerator": "cuda"}, False, False),
    ({"accelerator": "auto"}, False, True), ({"accelerator": "auto"}, True, False),
    ({"accelerator": "gpu", "narrow_backward": True}, True, True),
    ({"accelerator": "cpu", "narrow_backward": False}, False, False), ({}, False, True)])
def test_the_narrowing_key_is_on_for_cpu_runs_and_off_on_cuda_unless_set(monkeypatch, trainer, cuda, expected):
    from omegaconf import OmegaConf

    from grail_exp.models.loading import narrows_backward

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert narrows_backward(OmegaConf.create({"trainer": trainer})) is expected


@pytest.mark.parametrize("narrow", [True, False])
def test_model_building_swaps_the_policys_linear_layers_and_marks_it(tmp_path, narrow):
    """Where the attention is chosen (``load_causal_lm``), a trainable policy gets the narrowing backward when
    ``trainer.narrow_backward`` says so; a frozen model (the reference) never. The policy forward then narrows the
    input gradients a scheme asks of its leading rows (``PolicyForward.narrows``)."""
    from grail_exp.compute.forward import decoder_body, policy_forward
    from grail_exp.compute.leading_rows import narrows
    from grail_exp.models.loading import load_causal_lm
    from helpers.compose import compose

    tiny = str(__import__("pathlib").Path(__file__).parents[1] / "grail_exp" / "data" / "embedded" / "tiny")
    cfg = compose([f"model.name_or_path={tiny}", f"trainer.narrow_backward={str(narrow).lower()}"], tmp_path)
    policy = load_causal_lm(tiny, cfg, trainable=True)
    ref = load_causal_lm(tiny, cfg, trainable=False)
    linears = [m for m in decoder_body(policy).modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, RowNarrowingLinear) == narrow for m in linears)
    assert narrows(policy) is narrow and not narrows(ref)
    assert not any(isinstance(m, RowNarrowingLinear) for m in ref.modules())
    ids = torch.tensor([[1, 2, 3, 4]])
    _, _, fwd = policy_forward(policy, ids, torch.ones_like(ids), torch.arange(4)[None], ids[:, 2:], 1.0)
    assert fwd.narrows is narrow


def test_under_autocast_the_layer_is_the_plain_linear_layer():
    """A trainable policy's linear layers narrow on CPU runs (model building); a bf16 autocast region over fp32 weights
    (the supervised cold start, precision=bf16-mixed) must train as with ``torch.nn.Linear``: the same output dtype and
    the same gradients, bit for bit (the custom backward would multiply a bf16 cotangent by the fp32 weight)."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(24, 16)
    narrowing = torch.nn.Linear(24, 16)
    narrowing.load_state_dict(plain.state_dict())
    narrow_linear_layers(narrowing)
    x = torch.randn(5, 24)
    grads = []
    for layer in (plain, narrowing):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        grads.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
        layer.zero_grad()
    for a, b in zip(*grads):
        assert torch.equal(a, b)
