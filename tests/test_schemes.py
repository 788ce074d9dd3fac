"""The scheme registry, and GRAIL, OAR-G and OAR-P token weights on a tiny model built in the test (method spec §4, §5,
§11)."""

import pytest
import torch
from omegaconf import OmegaConf

from grail_exp.advantages import SCHEMES, build_scheme, scheme_config_class
from grail_exp.compute.forward import completion_logits
from grail_exp.config import LossConfig
from grail_exp.loss import AggregationContext, compose_objective, selective_log_softmax
from helpers.batches import batch_of, rows_of
from helpers.tolerances import MODEL_REORDER

EOS = "<|im_end|>"


def cfg_of(name, **kw):
    return OmegaConf.merge(OmegaConf.structured(scheme_config_class(name)), kw)


ITEMS = [
    ("Compute 7+5-3.", "7+5=12. 12-3=9. \\boxed{9}", -0.5),  # wrong-side row: reweighted under symmetry=wrong
    ("Compute 2+2+2.", "2+2=4. 4+2=6. \\boxed{6}", 0.5),  # correct: excluded by symmetry=wrong
    ("Compute 9-4.", "9-4=5. so the answer is 5", -0.5),  # no box
    ("Compute 8+1+1.", "8+1=9. 9+1=10. \\boxed{10}. Let me double check: 8+1=9, 9+1=10.", -0.25),  # post-answer tail
]


@pytest.fixture
def setup(tiny_model, tiny_tokenizer):
    rows = rows_of(tiny_tokenizer, ITEMS)
    return tiny_model, tiny_tokenizer, rows, batch_of(tiny_tokenizer, rows)


def test_registry_lists_all_schemes():
    assert {"grpo", "grail", "oar_g", "oar_p"} <= set(SCHEMES)


def test_registry_has_grpo_and_grpo_weights_are_ones():
    from grail_exp.advantages import SchemeBatch

    assert "grpo" in SCHEMES
    scheme = build_scheme(OmegaConf.create({"name": "grpo"}))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = scheme.weights(None, SchemeBatch(torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5), torch.zeros(2, 5),
                                           2, torch.zeros(2, 3, dtype=torch.long), mask, torch.zeros(2), torch.zeros(2)))
    assert out.weights.shape == (2, 3) and torch.all(out.weights == 1)


def test_unknown_scheme():
    with pytest.raises(KeyError, match="grpo"):
        build_scheme(OmegaConf.create({"name": "nope"}))


def test_grail_std0_without_overrides_is_exactly_grpo(setup):
    model, tok, rows, batch = setup
    grpo = build_scheme(cfg_of("grpo"), tok).weights(model, batch).weights * batch.completion_mask
    grail = build_scheme(cfg_of("grail", std=0.0, overrides=False, symmetry="both"), tok).weights(model, batch).weights
    assert torch.equal(grail, grpo)
    C = batch.completion_ids.shape[1]
    grads = []
    for w in (grpo, grail):
        model.zero_grad(set_to_none=True)
        logp = selective_log_softmax(completion_logits(model, batch.input_ids, batch.attention_mask,
                                                       batch.position_ids, C, 1.0), batch.completion_ids)
        out = compose_objective(LossConfig(loss_type="dr_grpo", epsilon=0.2, epsilon_high=0.28), AggregationContext(C),
                                logp, logp.detach(), w * batch.advantages.unsqueeze(1), batch.completion_mask)
        out.loss.backward()
        grads.append((out.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert grads[0][0] == grads[1][0] and torch.equal(grads[0][1], grads[1][1])
    # σ_w = 0 alone is not GRPO: with the overrides on (the default) boxed content still gets w_max
    with_overrides = build_scheme(cfg_of("grail", std=0.0, symmetry="both"), tok)
    spans = with_overrides.spans(batch)
    w = with_overrides.weights(model, batch).weights
    assert spans.content.any() and (w[spans.content] == 5.0).all() and not torch.equal(w, grpo)


def test_grail_clip_rates_count_weights_on_the_bounds():
    """The reference's clip rates use <= w_min and >= w_max: a pre-clip weight exactly on a bound counts."""
    from types import SimpleNamespace

    scheme = build_scheme(cfg_of("grail"), None)
    raw = torch.tensor([[0.5, 0.49, 1.0, 5.0, 5.1, 2.0]])  # w_min = 0.5, w_max = 5
    mask = torch.ones(1, 6)
    m = scheme._diagnostics(raw.clamp(0.5, 5.0), raw, mask, SimpleNamespace(has_box=torch.tensor([True])),
                            torch.tensor([False]), torch.tensor([True]), torch.tensor([-1.0]), torch.tensor([True]))
    assert m["clip_low_frac"] == pytest.approx(2 / 6) and m["clip_high_frac"] == pytest.approx(2 / 6)


def test_grail_overrides_and_fallbacks(setup):
    model, tok, rows, batch = setup
    cfg = cfg_of("grail")  # paper values: std 0.5, mean 1, w in [0.5, 5], symmetry wrong
    scheme = build_scheme(cfg, tok)
    w = scheme.weights(model, batch).weights
    from grail_exp.spans import answer_spans

    sp = answer_spans(batch.completion_ids, batch.completion_mask, tok, texts=batch.completion_texts)
    assert sp.has_box.tolist() == [True, True, False, True]
    assert torch.all(w[sp.content] == 5.0)
    assert torch.all(w[sp.marker | sp.closing] == 1.0)
    assert torch.all(w[sp.post] == 1.0)
    valid = batch.completion_mask.bool()
    # row 1 (A > 0, excluded by symmetry=wrong) and row 2 (no box): uniform except the overrides
    for r in (1, 2):
        rest = valid[r] & ~sp.content[r]
        assert torch.all(w[r][rest] == 1.0)
    # row 0 (A < 0, has a box): really reweighted before the box
    before_box = valid[0] & ~sp.span[0] & ~sp.post[0]
    assert w[0][before_box].std() > 0
    assert torch.all(w[~valid & ~sp.span] == 0)


def test_grail_symmetry_switch(setup):
    model, tok, rows, batch = setup
    w_both = build_scheme(cfg_of("grail", symmetry="both"), tok).weights(model, batch).weights
    w_correct = build_scheme(cfg_of("grail", symmetry="correct"), tok).weights(model, batch).weights
    w_wrong = build_scheme(cfg_of("grail", symmetry="wrong"), tok).weights(model, batch).weights
    # The probe runs on the rows each symmetry selects, and the forward keeps only the columns those rows use: the
    # same weights up to float reduction order (the saliency's log and z-score are scale-free: relative error).
    same = lambda a, b: torch.allclose(a, b, rtol=MODEL_REORDER, atol=0)  # noqa: E731
    assert same(w_both[0], w_wrong[0]) and same(w_both[1], w_correct[1])
    assert not same(w_wrong[1], w_both[1]) and not same(w_correct[0], w_both[0])


def test_grail_prelip_zscores_have_mean_zero_over_valid_tokens(setup):
    model, tok, rows, batch = setup
    std = 0.5
    scheme = build_scheme(cfg_of("grail", std=std, w_min=1e-6, w_max=1e6, symmetry="both"), tok)
    scheme.weights(model, batch)
    z = (scheme.last_pre_clip - 1.0) / std
    valid = batch.completion_mask.bool()
    for r in (0, 1, 3):  # rows with a box
        assert z[r][valid[r]].mean().abs() < 1e-4
        assert z[r][valid[r]].std(unbiased=False) == pytest.approx(1.0, abs=1e-3)


def test_grail_zero_saliency_post_answer_switch(setup):
    model, tok, rows, batch = setup
    inc = build_scheme(cfg_of("grail", symmetry="both"), tok)
    exc = build_scheme(cfg_of("grail", symmetry="both", zscore_post_answer="exclude"), tok)
    sal = inc.saliency(model, batch, __import__("grail_exp.spans", fromlist=["x"]).answer_spans(
        batch.completion_ids, batch.completion_mask, tok, texts=batch.completion_texts).span, torch.tensor([3]))
    from grail_exp.spans import answer_spans

    sp = answer_spans(batch.completion_ids, batch.completion_mask, tok, texts=batch.completion_texts)
    assert torch.all(sal[0][sp.post[3]] == 0)  # J cannot depend on tokens after the box (causal attention)
    w_inc, w_exc = inc.weights(model, batch).weights, exc.weights(model, batch).weights
    pre = batch.completion_mask[3].bool() & ~sp.span[3] & ~sp.post[3]
    # the long zero-saliency tail drags mu down and inflates every pre-answer weight (spec §11.1)
    assert w_inc[3][pre].mean() > w_exc[3][pre].mean()


@pytest.mark.parametrize("name", ["grail", "oar_g"])
def test_weights_do_not_depend_on_batching(setup, name):
    model, tok, rows, batch = setup
    scheme = build_scheme(cfg_of(name, **({"symmetry": "both"} if name == "grail" else {"noise_std": 0.0})), tok)
    together = scheme.weights(model, batch).weights
    for i, r in enumerate(rows):
        alone = scheme.weights(model, batch_of(tok, [r])).weights[0]
        n = len(r["completion_ids"])
        assert torch.allclose(alone[:n], together[i, :n], atol=1e-5), i


def test_oar_g_weights_average_one_over_scored_tokens(setup):
    model, tok, rows, batch = setup
    for variant in ("grail_repo", "original"):
        scheme = build_scheme(cfg_of("oar_g", variant=variant, noise_std=1e-2, log_compression="log1p"), tok)
        w = scheme.weights(model, batch).weights
        valid = batch.completion_mask.bool()
        from grail_exp.spans import answer_spans

        sp = answer_spans(batch.completion_ids, batch.completion_mask, tok, texts=batch.completion_texts)
        for r in (0, 1, 3):
            if variant == "grail_repo":
                scored = valid[r]
            else:
                first = int(sp.span[r].float().argmax())
                scored = valid[r] & (torch.arange(w.shape[1]) < first)
                assert torch.all(w[r][valid[r] & ~scored] == 1.0)
            assert w[r][scored].mean() == pytest.approx(1.0, abs=1e-5)
            assert w[r][scored].std() > 0 and w[r][scored].min() > 0
        assert torch.all(w[2][valid[2]] == 1.0)  # no box -> 1


def test_oar_g_noise_is_reproducible_from_the_generator(tiny_model, tiny_tokenizer):
    rows = rows_of(tiny_tokenizer, ITEMS[:1])
    scheme = build_scheme(cfg_of("oar_g", noise_std=1e-2, log_compression="log1p"), tiny_tokenizer)
    a = scheme.weights(tiny_model, batch_of(tiny_tokenizer, rows, seed=3)).weights
    b = scheme.weights(tiny_model, batch_of(tiny_tokenizer, rows, seed=3)).weights
    c = scheme.weights(tiny_model, batch_of(tiny_tokenizer, rows, seed=4)).weights
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_oar_g_zero_noise_gives_uniform_weights(setup):
    model, tok, rows, batch = setup
    w = build_scheme(cfg_of("oar_g", noise_std=0.0), tok).weights(model, batch).weights
    assert torch.allclose(w[batch.completion_mask.bool()], torch.ones(1), atol=1e-6)


def test_oar_g_order_statistic_quantile_and_ties():
    from grail_exp.advantages.oar import bilevel_grail_repo

    s = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]])
    m = torch.ones_like(s)
    w = bilevel_grail_repo(torch.expm1(s), m, tau=0.4, beta=2.0, eps=1e-12, mode="log1p")
    # Î = s/9; T = 10, τ = 0.4 -> index 4 -> τ_q = 4/9; ties at τ_q go to the boost branch (ω = 1)
    hat = s / 9
    tq = 4 / 9
    omega = torch.where(hat < tq, torch.clamp(hat / tq, min=0.1), 1 + 2 * (hat - tq) / (1 - tq))
    assert torch.allclose(w, omega * 10 / omega.sum(), atol=1e-6)
    flat = bilevel_grail_repo(torch.ones(1, 5), torch.ones(1, 5), 0.4, 2.0, 1e-12)
    assert torch.allclose(flat, torch.ones(1, 5))


def test_oar_log_compression_switch():
    from grail_exp.advantages.oar import compress

    s = torch.tensor([1e-8, 3e-8, 1e-3])
    ref, exact = compress(s, "reference"), compress(s, "log1p")
    assert ref[0] == 0 and ref[1] == 0  # log(1 + s) in float32 collapses tiny scores (spec §11.9)
    assert exact[0] > 0 and exact[1] > exact[0]


def test_oar_p_importance_matches_brute_force_single_token_masking(setup):
    model, tok, rows, batch = setup
    scheme = build_scheme(cfg_of("oar_p", max_batch_tokens=80), tok)  # small budget -> several chunks
    from grail_exp.advantages.oar import _reasoning_mask
    from grail_exp.spans import answer_spans

    sp = answer_spans(batch.completion_ids, batch.completion_mask, tok, texts=batch.completion_texts)
    scored = _reasoning_mask(sp, batch.completion_mask)
    model.eval()
    fast = scheme.importance(model, batch, sp, scored)
    P, C = batch.prompt_length, batch.completion_ids.shape[1]
    r = 0
    with torch.no_grad():
        def outcome(ids):
            logits = completion_logits(model, ids, batch.attention_mask[r:r + 1], batch.position_ids[r:r + 1], C, 1.0)
            span = sp.span[r].float()
            return torch.log_softmax((logits[0] * span[:, None]).sum(0) / span.sum(), -1)

        base = outcome(batch.input_ids[r:r + 1])
        slow = []
        for t in scored[r].nonzero().squeeze(1).tolist():
            ids = batch.input_ids[r:r + 1].clone()
            ids[0, P + t] = tok.pad_token_id
            slow.append((base.exp() * (base - outcome(ids))).sum().item())
    slow = torch.tensor(slow)
    got = fast[r][scored[r]]
    assert torch.allclose(got, slow.clamp(min=0), atol=1e-6)
    assert torch.equal(torch.argsort(got, stable=True), torch.argsort(slow.clamp(min=0), stable=True))
    w = scheme.weights(model, batch).weights
    assert w[r][scored[r]].mean() == pytest.approx(1.0, abs=1e-5)


class _TwoTokenLM(torch.nn.Module):
    """A hand-built causal LM in float64 with the interface the probe uses: h_t = tanh(W_a e_t + W_b e_{t-1})."""

    def __init__(self, vocab=7, d=4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, d).double()
        self.emb.weight.data = torch.randn(vocab, d, generator=g, dtype=torch.float64)
        self.W_a = torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))
        self.W_b = torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))
        self.head = torch.nn.Linear(d, vocab, bias=True).double()
        body = self

        class Body(torch.nn.Module):
            def forward(self, inputs_embeds, attention_mask=None, position_ids=None, use_cache=False,
                        output_hidden_states=False):
                e = inputs_embeds
                prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
                h = torch.tanh(e @ body.W_a.T + prev @ body.W_b.T)
                return type("Out", (), {"last_hidden_state": h, "hidden_states": (e, h)})()

        self.body = Body()

    def get_decoder(self):
        return self.body

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


def test_grail_saliency_matches_finite_differences():
    """Hand-built two-token case: s_t = ‖∂J/∂e ⊙ e‖ at the predicting positions, against central differences."""
    from grail_exp.advantages import SchemeBatch
    from grail_exp.advantages.grail import GrailScheme

    model = _TwoTokenLM()
    ids = torch.tensor([[3, 6, 2]])  # prompt [3]; completion [6, 2] is the answer span
    batch = SchemeBatch(ids, torch.ones_like(ids), torch.arange(3).unsqueeze(0), 1, ids[:, 1:], torch.ones(1, 2),
                        torch.tensor([-1.0]), torch.zeros(1))
    sal = GrailScheme(cfg_of("grail"), None).saliency(model, batch, torch.ones(1, 2, dtype=torch.bool), torch.tensor([0]))

    E0 = model.emb(ids).detach()

    def J(E):  # answer NLL: positions 0 and 1 predict completion tokens 6 and 2
        h = model.body(E).last_hidden_state
        return -torch.log_softmax(model.head(h[:, 0:2]), -1).gather(-1, ids[:, 1:].unsqueeze(-1)).sum()

    g = torch.zeros_like(E0)
    step = 1e-6
    for p in range(3):
        for d in range(E0.shape[-1]):
            plus, minus = E0.clone(), E0.clone()
            plus[0, p, d] += step
            minus[0, p, d] -= step
            g[0, p, d] = (J(plus) - J(minus)).item() / (2 * step)
    assert torch.all(g[0, 2] == 0)  # the last token's embedding predicts nothing in the window
    expected = torch.linalg.vector_norm(g[0, :2] * E0[0, :2], dim=-1)
    assert torch.allclose(sal[0].double(), expected, rtol=1e-5, atol=1e-9), (sal[0].tolist(), expected.tolist())


@pytest.mark.parametrize("leaf", ["first", "middle", "last"])
def test_grail_hidden_state_leaves_run(setup, leaf):
    model, tok, rows, batch = setup
    w = build_scheme(cfg_of("grail", leaf_source=leaf, symmetry="both"), tok).weights(model, batch).weights
    assert torch.isfinite(w).all()


def test_scheme_config_validation():
    from grail_exp.advantages import SCHEMES

    assert any("w_min" in e for e in SCHEMES["grail"].check_config(cfg_of("grail", w_min=6.0)))
    assert any("symmetry" in e for e in SCHEMES["grail"].check_config(cfg_of("grail", symmetry="all")))
    assert any("tau" in e for e in SCHEMES["oar_g"].check_config(cfg_of("oar_g", tau=1.5)))
    assert any("variant" in e for e in SCHEMES["oar_g"].check_config(cfg_of("oar_g", variant="x")))
    assert any("p_final" in e for e in SCHEMES["oar_p"].check_config(cfg_of("oar_p", p_final="x")))


def test_grail_exact_span_mapping_puts_w_max_on_the_answer_digits(setup):
    model, tok, rows, batch = setup
    w = build_scheme(cfg_of("grail", span_mapping="exact"), tok).weights(model, batch).weights
    for r, answer in ((0, "9"), (1, "6"), (3, "10")):
        ids = batch.completion_ids[r][w[r] == 5.0]
        assert tok.decode(ids) == answer
