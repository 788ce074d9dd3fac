"""DelTA and SHEAR (batch-level schemes): hand-computed cases, an independent brute force, exact small-case W₁,
degenerate limits, batching invariance, the weights CLI's parity with the training path, 2-step runs."""

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from grail_exp.advantages import SchemeBatch, build_scheme, scheme_config_class
from grail_exp.advantages.shear import sinkhorn_w1, span_starts
from grail_exp.weights import scheme_weights
from helpers.batches import batch_of, rows_of
from helpers.tolerances import HANG_TIMEOUT_S


def cfg_of(name, **kw):
    return OmegaConf.merge(OmegaConf.structured(scheme_config_class(name)), kw)


def fake_batch(adv, lengths, C=None, rewards=None, groups=None):
    """A SchemeBatch carrying only what the schemes read once ``features`` / ``hidden`` are replaced."""
    N = len(adv)
    C = C or max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in lengths])
    ids = torch.zeros(N, C + 1, dtype=torch.long)
    return SchemeBatch(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=ids, prompt_length=1,
                       completion_ids=ids[:, 1:], completion_mask=mask, advantages=torch.tensor(adv, dtype=torch.float),
                       rewards=torch.tensor(rewards if rewards is not None else [float(a > 0) for a in adv]),
                       group_ids=torch.tensor(groups if groups is not None else [0] * N))


def run_fake(name, h, batch, p=None, micro=None, **kw):
    """Weights through the contract (prepare + per-micro-batch weights) on given hidden states."""
    scheme = build_scheme(cfg_of(name, **kw))
    if name == "delta":
        scheme.features = lambda model, b: (h[b.row_index], (p if p is not None else torch.zeros(h.shape[:2]))[b.row_index])
    else:
        scheme.hidden = lambda model, b: h[b.row_index]
    batch.row_index = torch.arange(h.shape[0])
    return scheme_weights(scheme, None, batch, micro or h.shape[0]), scheme


# ----------------------------------------------------------------------------------------- DelTA
def brute_delta(v, adv, mask, K, lmin, lmax, gamma_lag, zero_in_norm):
    """Token-by-token loops over python floats, written from other-methods.md's description of the code."""
    N, C, d = v.shape
    toks = [(i, t) for i in range(N) for t in range(C) if mask[i][t] > 0]
    vec = {k: [float(x) for x in v[k[0], k[1]]] for k in toks}
    A = [float(a) for a in adv]

    def centroid(side, alpha):
        num, den = [0.0] * d, 0.0
        for k in toks:
            a = max(side * A[k[0]], 0.0) * alpha[k]
            den += a
            num = [n + a * x for n, x in zip(num, vec[k])]
        return [n / max(den, 1e-8) for n in num]

    def sq(x, y):
        return sum((a - b) ** 2 for a, b in zip(x, y))

    def margins(mp, mn):
        out = {}
        for k in toks:
            a = A[k[0]]
            out[k] = (sq(vec[k], mn) - sq(vec[k], mp)) if a > 0 else (sq(vec[k], mp) - sq(vec[k], mn)) if a < 0 else 0.0
        return out

    def gam(M, side):
        xs = [M[k] for k in toks if side * A[k[0]] > 0]
        n = max(len(xs), 1)
        mean, msq = sum(xs) / n, sum(x * x for x in xs) / n
        return math.sqrt(max(msq - mean * mean, 1e-8))

    def sig(x):
        return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))

    ones = dict.fromkeys(toks, 1.0)
    mp, mn = centroid(1, ones), centroid(-1, ones)
    M = margins(mp, mn)
    g = (gam(M, 1), gam(M, -1))
    for _ in range(K):
        alpha = {k: sig(M[k] / (g[0] if A[k[0]] > 0 else g[1])) for k in toks}
        mp, mn = centroid(1, alpha), centroid(-1, alpha)
        newM = margins(mp, mn)
        g = (gam(M, 1), gam(M, -1)) if gamma_lag else (gam(newM, 1), gam(newM, -1))
        M = newM
    raw = {k: (lmin + (lmax - lmin) * sig(M[k] / (g[0] if A[k[0]] > 0 else g[1]))) if A[k[0]] != 0 else lmin
           for k in toks}
    norm = [k for k in toks if zero_in_norm or A[k[0]] != 0]
    c = len(norm) / max(sum(raw[k] for k in norm), 1e-8) if norm else 1.0
    w = torch.zeros(N, C, dtype=torch.float64)
    for k in toks:
        w[k] = raw[k] * c if (zero_in_norm or A[k[0]] != 0) else 1.0
    return w


def random_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 6, 4, 2, 5]
    adv = [0.7, -0.3, 0.0, 1.2, -0.9, -0.5]
    C = 6
    mask = torch.tensor([[1.0] * n + [0.0] * (C - n) for n in lengths])
    h = torch.randn(len(adv), C, 3, generator=g)
    p = torch.rand(len(adv), C, generator=g)
    return h, p, adv, lengths, mask


def test_delta_hand_computed_case():
    # row 0 (A = +1): v = (1, 0), (3, 0); row 1 (A = -1): v = (-2, 0); p = 0 so v = h
    h = torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[-2.0, 0.0], [0.0, 0.0]]])
    w, _ = run_fake("delta", h, fake_batch([1.0, -1.0], [2, 1]))
    # μ+ = (2, 0), μ- = (-2, 0): margins 9 - 1 = 8 and 25 - 1 = 24 (γ+ = std{8, 24} = 8); row 1: 16 - 0 (γ- = 1e-4)
    s1, s3 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-3))
    mu = (s1 * 1 + s3 * 3) / (s1 + s3)  # round 1: α-weighted centroid; μ- stays (-2, 0); γ+ stays 8 (lag)
    m0, m1 = (1 + 2) ** 2 - (1 - mu) ** 2, (3 + 2) ** 2 - (3 - mu) ** 2
    raw = [0.8 + 0.4 / (1 + math.exp(-m0 / 8)), 0.8 + 0.4 / (1 + math.exp(-m1 / 8)), 1.2]  # row 1: σ(huge) = 1
    c = 3 / sum(raw)
    expect = torch.tensor([[raw[0] * c, raw[1] * c], [raw[2] * c, 0.0]])
    assert torch.allclose(w, expect, atol=1e-6)


@pytest.mark.parametrize("K,lag,zero_in_norm", [(1, True, True), (1, False, True), (2, True, False), (0, True, True),
                                                (3, False, False)])
def test_delta_matches_brute_force(K, lag, zero_in_norm):
    h, p, adv, lengths, mask = random_case()
    v = (1 - p).unsqueeze(-1) * h
    w, _ = run_fake("delta", h, fake_batch(adv, lengths), p=p, K=K, gamma_lag=lag, zero_adv_in_norm=zero_in_norm)
    ref = brute_delta(v, adv, mask, K, 0.8, 1.2, lag, zero_in_norm)
    assert torch.allclose(w.double(), ref, atol=1e-5)


def test_delta_switches_change_the_weights_and_normalise_as_documented():
    h, p, adv, lengths, mask = random_case(1)
    b = lambda: fake_batch(adv, lengths)  # noqa: E731
    lag, _ = run_fake("delta", h, b(), p=p)
    nolag, _ = run_fake("delta", h, b(), p=p, gamma_lag=False)
    assert (lag - nolag).abs().max() > 1e-4  # for K = 1 the lag decides which γ the final weights use
    incl, _ = run_fake("delta", h, b(), p=p)
    excl, _ = run_fake("delta", h, b(), p=p, zero_adv_in_norm=False)
    valid, nz = mask.bool(), mask.bool() & (torch.tensor(adv) != 0).unsqueeze(1)
    assert incl[valid].mean() == pytest.approx(1.0, abs=1e-6)  # mean 1 over the whole batch, A = 0 rows included
    assert excl[nz].mean() == pytest.approx(1.0, abs=1e-6)  # mean 1 over A != 0 rows; A = 0 rows at 1
    assert torch.all(excl[2][valid[2]] == 1.0)
    assert incl[2][valid[2]].mean() < 1.0 and (incl[nz].mean() > 1.0)  # the λ_min tokens raise every other weight
    assert torch.all(incl[~valid] == 0) and torch.all(excl[~valid] == 0)


def test_delta_degenerate_limits():
    h, p, adv, lengths, mask = random_case(2)
    zeros, _ = run_fake("delta", h, fake_batch([0.0] * len(adv), lengths), p=p)
    assert torch.equal(zeros, mask)  # all A = 0: every weight exactly 1
    flat, _ = run_fake("delta", h, fake_batch(adv, lengths), p=p, lambda_min=1.0, lambda_max=1.0)
    assert torch.allclose(flat, mask, atol=1e-7)  # λ_min = λ_max = 1: GRPO
    w, _ = run_fake("delta", h, fake_batch(adv, lengths), p=p)
    raw_range = w[mask.bool()] / w[mask.bool()].mean()
    assert raw_range.max() / raw_range.min() <= 1.2 / 0.8 + 1e-6


def test_delta_weights_do_not_depend_on_the_micro_batch_split():
    h, p, adv, lengths, mask = random_case(3)
    whole, _ = run_fake("delta", h, fake_batch(adv, lengths), p=p)
    for micro in (1, 4):
        split, _ = run_fake("delta", h, fake_batch(adv, lengths), p=p, micro=micro)
        assert torch.equal(split, whole)


def test_delta_features_on_a_real_model(tiny_model, tiny_tokenizer):
    """p and h from the chunked no-grad forward equal the trainer's log-prob path, for any chunk size."""
    from grail_exp.compute.forward import completion_logits
    from grail_exp.loss import selective_log_softmax

    rows = rows_of(tiny_tokenizer, [("Compute 1+2.", "1+2=3. \\boxed{3}", 0.5), ("Compute 4-1.", "4-1=2 \\boxed{2}", -0.5),
                                    ("Compute 2+2.", "2+2=4, so \\boxed{4}", 0.0)])
    batch = batch_of(tiny_tokenizer, rows)
    C = batch.completion_ids.shape[1]
    scheme = build_scheme(cfg_of("delta", chunk_rows=1))
    h1, p1 = scheme.features(tiny_model, batch)
    scheme8 = build_scheme(cfg_of("delta", chunk_rows=8))
    h8, p8 = scheme8.features(tiny_model, batch)
    m = batch.completion_mask.bool()  # features of padding positions are not defined (a chunk computes its own columns)
    assert torch.allclose(h1[m], h8[m], atol=1e-5) and torch.allclose(p1[m], p8[m], atol=1e-6)
    logp = selective_log_softmax(completion_logits(tiny_model, batch.input_ids, batch.attention_mask,
                                                   batch.position_ids, C, 1.0), batch.completion_ids)
    assert torch.allclose(p1[m], logp.exp()[m].detach(), atol=1e-5)
    w1 = scheme_weights(scheme, tiny_model, batch, 1)
    w3 = scheme_weights(scheme8, tiny_model, batch, 3)
    assert torch.allclose(w1, w3, atol=1e-5) and w1[m].mean().item() == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------------------- SHEAR: Sinkhorn
def exact_w1(x, y):
    """W₁ between equal-size uniform empirical distributions: the best assignment, by brute force."""
    C = torch.cdist(x.double(), y.double())
    n = x.shape[0]
    return min(sum(C[i, s[i]].item() for i in range(n)) / n for s in itertools.permutations(range(n)))


@pytest.mark.parametrize("n,eps", [(4, 0.3), (5, 0.5), (6, 0.2)])
def test_sinkhorn_is_within_the_entropic_bias_of_exact_w1(n, eps):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(3, n, 4, generator=g, dtype=torch.float64) + 0.5
    ones = torch.ones(3, n, dtype=torch.bool)
    w_eps, info = sinkhorn_w1(x, ones, y, ones, eps, max_iter=2000, tol=1e-9)
    # an unconverged plan misses its marginals by err (L1), which moves its cost by at most err · max C
    slack = 2 * info["marginal_err"] * torch.cdist(x, y).max().item() + 1e-9
    assert info["marginal_err"] < 1e-4
    for k in range(3):
        w1 = exact_w1(x[k], y[k])
        assert w1 - slack <= w_eps[k].item() <= w1 + eps * math.log(n) + slack, (k, w1, w_eps[k].item())
        assert w_eps[k].item() > w1 + 1e-6  # ε > 0 really blurs the plan (the test can fail)
    sharper, info2 = sinkhorn_w1(x, ones, y, ones, eps / 4, max_iter=2000, tol=1e-9)
    assert torch.all(sharper <= w_eps + slack)


def test_sinkhorn_padding_gives_the_unpadded_problem():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(1, 3, 2, generator=g), torch.randn(1, 5, 2, generator=g)
    small, _ = sinkhorn_w1(x, torch.ones(1, 3, dtype=torch.bool), y, torch.ones(1, 5, dtype=torch.bool), 0.1, 2000, 1e-7)
    xp = torch.cat([x, torch.full((1, 4, 2), 50.0)], 1)
    yp = torch.cat([y, torch.full((1, 2, 2), -50.0)], 1)
    xm = torch.tensor([[True] * 3 + [False] * 4])
    ym = torch.tensor([[True] * 5 + [False] * 2])
    padded, _ = sinkhorn_w1(xp, xm, yp, ym, 0.1, 2000, 1e-7)
    assert padded.item() == pytest.approx(small.item(), abs=1e-5)
    # one point against many: the exact W₁ is the mean distance, and entropy cannot change a single-row plan
    one, _ = sinkhorn_w1(x[:, :1], torch.ones(1, 1, dtype=torch.bool), y, torch.ones(1, 5, dtype=torch.bool), 0.1)
    assert one.item() == pytest.approx(torch.cdist(x[0, :1], y[0]).mean().item(), abs=1e-5)


def test_pot_agrees_when_installed():
    ot = pytest.importorskip("ot")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(1, 7, 3, generator=g), torch.randn(1, 6, 3, generator=g)
    M = torch.cdist(x[0], y[0]).double().numpy()
    import numpy as np

    a, b = np.full(7, 1 / 7), np.full(6, 1 / 6)
    plan = ot.sinkhorn(a, b, M, 0.1, method="sinkhorn_log", numItermax=5000, stopThr=1e-10)
    ours, _ = sinkhorn_w1(x, torch.ones(1, 7, dtype=torch.bool), y, torch.ones(1, 6, dtype=torch.bool), 0.1, 5000, 1e-8)
    assert ours.item() == pytest.approx(float((plan * M).sum()), abs=1e-5)
    assert ot.emd2(a, b, M) <= ours.item() + 1e-6


# ----------------------------------------------------------------------------------------- SHEAR: weights
def test_span_enumeration():
    assert span_starts(30, 100, 25) == [0]  # the embedded model's completions: one span with the paper's defaults
    assert span_starts(110, 100, 25) == [0, 25]  # [0, 100), [25, 110)
    assert span_starts(200, 100, 25) == [0, 25, 50, 75, 100]
    assert span_starts(7, 4, 2) == [0, 2, 4] and span_starts(0, 4, 2) == []


def test_shear_hand_computed_single_span():
    # correct row: (0, 0), (2, 0); wrong row: (0, 1), (2, 1): exact W₁ = 1 (match each point to the one above it)
    h = torch.tensor([[[0.0, 0.0], [2.0, 0.0]], [[0.0, 1.0], [2.0, 1.0]]])
    eps = 0.02
    kw = dict(epsilon=eps, epsilon_scale="absolute", max_iter=1000, tol=1e-6)
    w, scheme = run_fake("shear", h, fake_batch([0.5, -0.5], [2, 2]), **kw)
    none, _ = run_fake("shear", h, fake_batch([0.5, -0.5], [2, 2]), normalize="none", **kw)
    assert torch.all(none >= 1 - 1e-3) and torch.all(none <= 1 + eps * math.log(2) + 1e-3)  # W₁ <= W_ε <= W₁ + ε log n
    nbar = (0 + 2 + 1 + math.sqrt(5)) / 4
    assert torch.allclose(w, none / nbar, atol=1e-6)  # ÷ the group's mean hidden norm


def test_shear_min_over_opposing_spans_max_over_covering_spans():
    # 1-D points on the x axis (second coordinate 0). Windows of 2, stride 1 -> spans [0,2), [1,3) of 3-token rows.
    pts = lambda xs: torch.tensor([[x, 0.0] for x in xs])  # noqa: E731
    h = torch.stack([pts([0.0, 0.0, 4.0]), pts([0.0, 1.0, 1.0]), pts([10.0, 10.0, 10.0])])
    batch = fake_batch([0.5, -0.25, -0.25], [3, 3, 3])
    eps = 0.02
    w, _ = run_fake("shear", h, batch, window=2, stride=1, epsilon=eps, epsilon_scale="absolute", max_iter=1000,
                    tol=1e-6, normalize="none")

    def w1(a, b):  # sorted matching: exact for equal-size uniform 1-D distributions
        return sum(abs(x - y) for x, y in zip(sorted(a), sorted(b))) / len(a)

    rows = [[0.0, 0.0, 4.0], [0.0, 1.0, 1.0], [10.0, 10.0, 10.0]]
    spans = {i: [rows[i][0:2], rows[i][1:3]] for i in range(3)}
    d = {(i, k): min(w1(spans[i][k], s) for j in ((1, 2) if i == 0 else (0,)) for s in spans[j])
         for i in range(3) for k in range(2)}
    expect = torch.tensor([[d[i, 0], max(d[i, 0], d[i, 1]), d[i, 1]] for i in range(3)])
    assert torch.all(w >= expect - 1e-3) and torch.all(w <= expect + eps * math.log(2) + 1e-3), (w, expect)


def test_shear_uniform_groups_fall_back_to_grpo_and_batching_invariance():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 7, 3, generator=g)
    lengths = [7, 5, 6, 4, 7, 3]
    groups = [0, 0, 0, 1, 1, 1]
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # group 1 uniform
    adv = [1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]
    batch = lambda: fake_batch(adv, lengths, rewards=rewards, groups=groups)  # noqa: E731
    mask = batch().completion_mask
    w, scheme = run_fake("shear", h, batch(), window=3, stride=2)
    assert torch.equal(w[3:], mask[3:])
    assert torch.all(w[:3][mask[:3].bool()] > 0) and torch.all(w[~mask.bool()] == 0)
    for micro, pairs in ((1, 2048), (4, 5)):
        split, _ = run_fake("shear", h, batch(), micro=micro, window=3, stride=2, max_pairs=pairs)
        assert torch.allclose(split, w, atol=1e-6)
    b = batch()
    b.row_index = torch.arange(6)
    b.prepared = scheme.prepare(None, b)
    metrics = scheme.weights(None, b).metrics
    assert metrics["fallback_rate"] == pytest.approx(0.5)
    assert metrics["weight_mean"] == pytest.approx(w[mask.bool()].mean().item(), abs=1e-6)  # no mean-1 renormalisation
    assert abs(metrics["reweighted_weight_mean"] - 1.0) > 1e-3
    all_uniform, _ = run_fake("shear", h, fake_batch([0.0] * 6, lengths, rewards=[1.0] * 6, groups=groups))
    assert torch.equal(all_uniform, mask)


def test_config_validation():
    from grail_exp.advantages import SCHEMES

    assert any("recompute" in e for e in SCHEMES["delta"].check_config(cfg_of("delta", recompute="per_update")))
    assert any("lambda_min" in e for e in SCHEMES["delta"].check_config(cfg_of("delta", lambda_min=1.5)))
    assert any("K" in e for e in SCHEMES["delta"].check_config(cfg_of("delta", K=-1)))
    assert any("epsilon" in e for e in SCHEMES["shear"].check_config(cfg_of("shear", epsilon=0.0)))
    assert any("recompute" in e for e in SCHEMES["shear"].check_config(cfg_of("shear", recompute="per_update")))
    assert any("hidden_position" in e for e in SCHEMES["shear"].check_config(cfg_of("shear", hidden_position="x")))
    assert SCHEMES["delta"].check_config(cfg_of("delta")) == [] and SCHEMES["shear"].check_config(cfg_of("shear")) == []
    with pytest.raises(RuntimeError, match="prepare"):
        build_scheme(cfg_of("delta")).weights(None, fake_batch([1.0], [1]))


# ----------------------------------------------------------------------------------------- trainer and CLI
@pytest.mark.parametrize("scheme", ["delta", "shear"])
def test_weights_cli_matches_training_path(compose_cfg, tiny_model_dir, tmp_path, scheme):
    """The whole rollout batch through the trainer (prepare, then every micro-batch) equals the weights CLI on the
    same rows with their groups and rewards."""
    from grail_exp.training.batch import micro_batch_rows
    from grail_exp.weights import compute
    from helpers.compose import compose_weights
    from helpers.module import build_module, small_config

    extra = [f"advantage={scheme}", "trainer.micro_batch_size=4"] + (["advantage.window=6", "advantage.stride=3"]
                                                                       if scheme == "shear" else [])
    cfg = small_config(compose_cfg, tiny_model_dir, extra)
    module = build_module(cfg, tiny_model_dir)
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    module.rollout.prepare(batch, {})
    N = batch.input_ids.shape[0]
    w_train = torch.zeros(batch.completion_ids.shape)
    for s, e in batch.micro_batches(micro_batch_rows(module.cfg)):
        w_train[s:e] = module.scheme.weights(module.policy, batch.scheme_view(module.scheme_ctx, s, e)).weights
    P = batch.prompt_length
    rows = []
    for i in range(N):
        pm, cm = batch.attention_mask[i, :P].bool(), batch.loss_mask[i].bool()
        rows.append({"prompt_ids": batch.input_ids[i, :P][pm].tolist(), "completion_ids": batch.completion_ids[i][cm].tolist(),
                     "advantage": float(batch.advantages[i]), "reward": float(batch.rewards[i]),
                     "group": int(batch.group_ids[i])})
    assert len({r["reward"] for r in rows}) > 1 or scheme == "delta"
    inp = tmp_path / "rows.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    wcfg = compose_weights(tmp_path, [f"model.name_or_path={tiny_model_dir}", f"input={inp}",
                                      f"output={tmp_path}/w.json", "batch_size=5", *extra[:1], *extra[2:]])
    result = compute(wcfg)
    for i, r in enumerate(result):
        n = len(rows[i]["completion_ids"])
        assert torch.allclose(torch.tensor(r["weights"]), w_train[i, :n], atol=1e-5), i


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["delta", "shear"])
def test_two_step_run_on_the_embedded_default(tmp_path, scheme):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", f"advantage={scheme}", "trainer.max_steps=2",
                           "debug=fast", "logger=none", f"paths.root_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
