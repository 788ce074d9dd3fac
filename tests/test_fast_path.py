"""The scheme fast paths equal the straightforward ones (issue 12 §2): shared forward for every GRAIL leaf and OAR-G
variant, per_rollout reuse, skipping A = 0 rows without changing the gradient or the logged diagnostics."""

import pytest
import torch

from helpers.pinned_step import pinned_module


def _shared_vs_separate(overrides):
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import policy_forward

    module, batch = pinned_module(torch.float32, overrides)
    module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
    module.rollout.prepare(batch, {})
    gen_state = module.scheme_generator.get_state()
    sb = batch.scheme_view(module.scheme_ctx, 0, 8)
    with torch.enable_grad():
        _, _, fwd = policy_forward(module.policy, batch.input_ids, batch.attention_mask, batch.position_ids,
                                   batch.completion_ids, 1.0, hidden_states=True)
        shared = module.scheme.weights_from_forward(module.policy, sb, fwd)
    module.scheme_generator.set_state(gen_state)  # OAR-G: the same noise for both paths
    sb = batch.scheme_view(module.scheme_ctx, 0, 8)
    separate = module.scheme.weights(module.policy, sb)
    return shared, separate


@pytest.mark.parametrize("leaf", ["embeddings", "first", "middle", "last"])
def test_grail_shared_forward_equals_separate_probe(leaf):
    shared, separate = _shared_vs_separate(["advantage=grail", "advantage.symmetry=both",
                                            f"advantage.leaf_source={leaf}"])
    # Same function, not bit-identical by construction (answer-slot logits h @ W^T vs the whole window's; another
    # backward graph): fp32 sums in another order. A length-n reduction moves by <= n*eps relative; the longest is
    # the vocabulary (V = 320), so each saliency s moves by <= V*eps relative (every nonzero s of this fixture is
    # >= 1/13 of its row's largest; post-answer s are exactly 0 in both paths) and l = log(s) by V*eps absolute.
    # z = (l - mu)/sigma_l moves by <= (2 + |z|)*V*eps/sigma_l with |z| <= 8 unclipped and sigma_l >= 6 here, and
    # w = w_mean + sigma_w*z (sigma_w = 0.5). Bit-identical on the AVX-512 EPYC where this was measured.
    tol = 0.5 * (2 + 8) * 320 * torch.finfo(torch.float32).eps / 6  # 3.2e-5 on weights in [0.5, 5]
    assert torch.allclose(shared.weights, separate.weights, rtol=0, atol=tol)
    # weight_mean / weight_std move by <= tol, advantages_scale_ratio by <= tol * max|A| / mean|A| = 2 tol; the
    # clip fractions and row counts are exact: every pre-clip weight is >= 1e-3 (>> tol) from w_min and w_max.
    assert shared.metrics == pytest.approx(separate.metrics, rel=0, abs=2 * tol)


@pytest.mark.parametrize("variant", ["grail_repo", "original"])
def test_oar_g_shared_teacher_equals_separate_teacher(variant):
    shared, separate = _shared_vs_separate(["advantage=oar_g", f"advantage.variant={variant}",
                                            "advantage.log_compression=log1p"])
    # Not bit-identical: the teacher P0 comes from the trainer's 8-row forward and a gathered span sum instead of
    # a separate forward of the boxed rows and a masked sum, so fp32 sums run in another order (GEMM blocking
    # differs by CPU: AVX-512 machines give other last bits). A length-n fp32 reduction in another order moves its
    # result by up to n*eps relative; the longest between the two paths is the vocabulary (V = 320: softmax, KL),
    # so the importance scores agree to V*eps of their row's range (measured: <= 8e-6, 67 eps). Bi-Level
    # reshaping then amplifies: the min-max both ends move (x2), omega's slope is max(1/tau_q, beta/(1-tau_q))
    # <= 1/0.02 = 50 (tau_q, the 0.4-quantile of the normalised log-scores, is >= 0.02 in every row of this
    # fixture) and the mass normalisation scales by L/sum(omega) = w_max/(1+beta) <= 1.1. Weights are O(1) (<= 3.3).
    # A fast-path bug moves them by O(1) (a different noise draw: by up to 2.5).
    tol = 2 * 320 * torch.finfo(torch.float32).eps * 50 * 1.1  # 4.2e-3; measured on an AVX-512 EPYC: 1.2e-4
    assert torch.allclose(shared.weights, separate.weights, rtol=0, atol=tol)


def test_probe_runs_only_on_rows_that_need_it():
    from grail_exp.advantages import build_scheme

    module, batch = pinned_module(torch.float32, ["advantage=grail"])  # symmetry wrong: only A <= 0 rows with a box
    module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
    module.rollout.prepare(batch, {})
    needs = module.scheme.rows_needing_model(batch.scheme_view(module.scheme_ctx))
    assert needs.tolist() == sorted(needs.tolist(), reverse=True)  # grouped into the first micro-batches
    assert int(needs.sum()) == 3  # rows 1, 2 (A < 0, boxed) and 6; row 3 has no box


def _step_with_a_zero_variance_group(overrides):
    """The gradient and the scheme's logged diagnostics of one optimiser step on the pinned batch with its first group's
    advantages set to 0, for ``skip_zero_advantage`` true and false: {skip: (gradient, diagnostics)}."""
    from grail_exp.advantages import build_scheme
    from grail_exp.optim import build_optimizer

    results = {}
    for skip in (True, False):
        module, batch = pinned_module(torch.float32, [*overrides, f"advantage.skip_zero_advantage={skip}"])
        module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
        batch.advantages[:4] = 0.0  # a zero-variance group
        module.rollout.prepare(batch, {})
        opt = build_optimizer(module.policy, module.cfg.optim, master_weights=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        grads = {}
        real_step = opt.step

        def capture(closure=None, grads=grads, module=module, real_step=real_step):
            grads["g"] = torch.cat([p.grad.flatten() for p in module.policy.parameters()])
            return real_step(closure)

        opt.step = capture
        metrics = module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, epoch=0)
        name = module.scheme.name
        results[skip] = (grads["g"], {k: v for k, v in metrics.items() if k.startswith(f"{name}/")})
    return results


def test_skip_zero_advantage_changes_neither_gradient_nor_diagnostics():
    results = _step_with_a_zero_variance_group(["advantage=grail"])
    # The probe runs on other rows (a smaller batch): fp32 sums in another order. The A != 0 rows' weights move by
    # <= 1.1e-4 (GRAIL's bound for this batch, test_pinned_step) and the backward by <= 5 x 320 eps = 1.9e-4 of the
    # gradient's scale (x2 for cancellation); the diagnostics by the weight bound (the clip fractions are exact:
    # every pre-clip weight is >= 0.013 from a clip bound). Measured: 0 (AVX-512), 6e-8 (AVX2 kernels).
    g_scale = results[False][0].abs().max().item()
    assert torch.allclose(results[True][0], results[False][0], rtol=0, atol=2 * (1.1e-4 + 5 * 320 * 2**-23) * g_scale)
    assert results[True][1] == pytest.approx(results[False][1], rel=0, abs=2 * 1.1e-4)


@pytest.mark.parametrize("scheme", ["oar_g", "oar_p"])
def test_oar_skip_zero_advantage_changes_neither_gradient_nor_diagnostics(scheme):
    """The zero-variance group fills the first micro-batch (4 rows), and OAR keeps the row order: with the skip that
    micro-batch scores nothing, the second runs exactly the computation it runs without it — OAR-G's noise included,
    which is drawn for the skipped rows too — so the gradient and the diagnostics are equal bit for bit (the first
    micro-batch's loss is 0 × its weights either way). Skipping the draw, or diagnostics over every row, breaks it."""
    results = _step_with_a_zero_variance_group([f"advantage={scheme}"])
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1] and results[True][1][f"{scheme}/weight_mean"] == \
        results[True][1][f"{scheme}/weight_mean"]  # not NaN: the diagnostics saw rows


@pytest.mark.parametrize("scheme", ["oar_g", "oar_p"])
def test_oar_skipped_rows_leave_every_other_rows_weights(scheme):
    """A = 0 on two rows, one in each group: with the skip they get w = 1 on their valid tokens and are not scored;
    every other row's weights are those of the run that scores all rows, from the same noise draws (OAR-G)."""
    from grail_exp.advantages import build_scheme

    module, batch = pinned_module(torch.float32, [f"advantage={scheme}", "advantage.log_compression=log1p"])
    batch.advantages[[0, 5]] = 0.0
    out, state = {}, module.scheme_generator.get_state()
    for skip in (True, False):
        module.cfg.advantage.skip_zero_advantage = skip
        module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
        module.scheme_generator.set_state(state)
        out[skip] = module.scheme.weights(module.policy, batch.scheme_view(module.scheme_ctx, 0, 8)).weights
    live = batch.advantages != 0
    assert torch.equal(out[True][~live], batch.loss_mask[~live].float())
    assert not torch.equal(out[False][~live], batch.loss_mask[~live].float())  # scored without the skip
    # OAR-P scores a row with forwards of that row alone: the same numbers. OAR-G's noisy pass runs on 5 boxed rows
    # instead of 7 (row 3 has no box): fp32 sums in another order, bounded as in
    # test_oar_g_shared_teacher_equals_separate_teacher (4.2e-3 on the weights); a row given another row's noise
    # moves by O(1).
    tol = 0.0 if scheme == "oar_p" else 2 * 320 * torch.finfo(torch.float32).eps * 50 * 1.1
    assert torch.allclose(out[True][live], out[False][live], rtol=0, atol=tol)


def test_per_rollout_reuses_the_first_iteration_weights():
    """recompute=per_rollout: iteration 0 computes (and caches) the weights; later iterations reuse them exactly
    while per_update recomputes them with the updated parameters."""
    from grail_exp.advantages import build_scheme
    from grail_exp.optim import build_optimizer

    seen = {}
    for mode in ("per_rollout", "per_update"):
        module, batch = pinned_module(torch.float32, ["advantage=grail", "advantage.symmetry=both",
                                                       f"advantage.recompute={mode}", "loss.num_iterations=2"])
        module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
        module.rollout.prepare(batch, {})
        batch.old_logp = module.rollout.logps(module.policy, batch)
        module.cfg.optim.lr = 1e-2
        opt = build_optimizer(module.policy, module.cfg.optim, master_weights=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        calls = []
        real = module.update.weights

        def spy(b, s, e, it, fwd, real=real, calls=calls):
            w, m, fresh = real(b, s, e, it, fwd)
            calls.append((it, fresh, w.clone()))
            return w, m, fresh

        module.update.weights = spy
        for it in range(2):
            module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, epoch=it)
        seen[mode] = calls
    it0 = torch.cat([w for it, _, w in seen["per_rollout"] if it == 0])
    it1 = torch.cat([w for it, _, w in seen["per_rollout"] if it == 1])
    assert all(fresh for it, fresh, _ in seen["per_rollout"] if it == 0)
    assert not any(fresh for it, fresh, _ in seen["per_rollout"] if it == 1)
    assert torch.equal(it0, it1)
    up1 = torch.cat([w for it, _, w in seen["per_update"] if it == 1])
    assert not torch.allclose(up1, it1)  # per_update saw the parameters after the first step


def _weights_seen(overrides, lr=1e-2):
    """Every (rows, weights) the update used over one rollout batch's k × μ optimiser steps, and the weights of each
    micro-batch computed by brute force on a frozen copy of the rollout-time model (a fresh scheme, rows one by one
    in micro-batches of 4)."""
    import copy

    from grail_exp.advantages import build_scheme
    from grail_exp.optim import build_optimizer

    module, batch = pinned_module(torch.float32, overrides)
    module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
    module.rollout.prepare(batch, {})
    frozen, reference = copy.deepcopy(module.policy), build_scheme(module.cfg.advantage, module.tokenizer)
    expected = torch.cat([reference.weights(frozen, batch.scheme_view(module.scheme_ctx, s, s + 4)).weights
                          for s in range(0, batch.num_rows, 4)])
    batch.old_logp = module.rollout.logps(module.policy, batch)
    module.cfg.optim.lr = lr
    opt = build_optimizer(module.policy, module.cfg.optim, master_weights=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen, real = [], module.update.weights

    def spy(b, s, e, it, fwd):
        w, m, fresh = real(b, s, e, it, fwd)
        seen.append((s, e, w.clone()))
        return w, m, fresh

    module.update.weights = spy
    list(module.update.optimizer_steps(batch, opt, sched, 0, {}))
    return seen, expected


def test_per_rollout_weights_are_those_of_the_rollout_parameters():
    """recompute=per_rollout with k = 2 mini-batches (one prompt each) and μ = 2: all four optimiser steps use the
    weights of the parameters that sampled the batch, the second mini-batch's included (before: computed in its first
    step, after the first mini-batch's update moved the parameters; per_update does that on purpose)."""
    common = ["advantage=grail", "advantage.symmetry=both", "loss.num_iterations=2",
              "trainer.mini_batches_per_rollout=2"]
    seen, expected = _weights_seen([*common, "advantage.recompute=per_rollout"])
    assert [(s, e) for s, e, _ in seen] == [(0, 4), (4, 8), (0, 4), (4, 8)]
    # The first mini-batch's weights come from the training forward (GRAIL's shared probe), the others from the
    # scheme's own forward at the same parameters: test_grail_shared_forward_equals_separate_probe's bound (3.2e-5).
    tol = 0.5 * (2 + 8) * 320 * torch.finfo(torch.float32).eps / 6
    for s, e, w in seen:
        assert torch.allclose(w, expected[s:e], rtol=0, atol=tol), (s, (w - expected[s:e]).abs().max())
    # The check can tell the parameters apart: per_update's second mini-batch (after one step at lr 1e-2) is far off.
    live, _ = _weights_seen([*common, "advantage.recompute=per_update"])
    assert (live[1][2] - expected[4:8]).abs().max() > 100 * tol


@pytest.mark.parametrize("scheme, probes", [("grpo", False), ("grail", True), ("oar_g", True)])
def test_freed_heap_goes_back_after_the_probe_and_before_the_backward(monkeypatch, scheme, probes):
    """On CPU a scheme that calls the model inside the update (GRAIL's probe, OAR-G's teacher) frees that work's
    memory before the micro-batch's own backward; otherwise glibc keeps it and the backward's peak comes on top
    (SmolLM2's GRAIL step: 4.35 -> 4.21 GB peak RSS, results/bench_real_model.md). GRPO has no such call. The update
    phase asks its backend (``after_probe_backward`` / ``after_backward`` / ``after_step``); the local backend trims
    while the policy is on the CPU."""
    import grail_exp.training.backends.local as local_mod

    module, batch = pinned_module(torch.float32, [f"advantage={scheme}", "trainer.micro_batch_size=4"])
    events = []
    monkeypatch.setattr(local_mod, "return_freed_memory", lambda: events.append("trim"))
    backward = module.update.backend.backward
    monkeypatch.setattr(module.update.backend, "backward", lambda loss: (events.append("backward"), backward(loss)))
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, 0)
    assert batch.num_rows == 8 and events.count("backward") == 2  # two micro-batches of 4
    # Per micro-batch: [trim after the probe], backward, trim (its activations); then one trim after the step.
    one = ["trim", "backward", "trim"] if probes else ["backward", "trim"]
    assert events == one * 2 + ["trim"]


@pytest.mark.parametrize("scheme", ["grpo", "grail"])
@pytest.mark.parametrize("returns", [0, 1, 2])
def test_freed_heap_goes_back_inside_the_backward_after_the_decoder_layers(monkeypatch, scheme, returns):
    """``trainer.backward_heap_returns`` = n: n times per backward, once the gradients of every parameter of one decoder
    layer (and all above it) have arrived and before the embedding's: the pinned model's 2 layers give the points
    layer 0 (n = 1) and layers 1, 0 (n = 2). GRAIL's probe (a gradient to the inputs only) adds none."""
    import grail_exp.compute.host as host

    module, batch = pinned_module(torch.float32, [f"advantage={scheme}", "trainer.micro_batch_size=8",
                                                  f"trainer.backward_heap_returns={returns}"])
    module.backend.placed()  # what on_train_start does once the policy is on its device (and sharded, wrapped)
    named = dict(module.policy.named_parameters())
    with_grad = []
    monkeypatch.setattr(host, "return_freed_memory",
                        lambda: with_grad.append({n for n, p in named.items() if p.grad is not None}))
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)  # leaves each gradient on its parameter
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, 0)

    def layer(i):
        return {n for n in named if n.startswith((f"policy.model.layers.{i}.", f"model.layers.{i}."))}

    assert layer(0) and layer(1) and "model.embed_tokens.weight" in named
    points = {0: [], 1: [0], 2: [1, 0]}[returns]
    assert len(with_grad) == len(points)  # one micro-batch, one backward
    for arrived, i in zip(with_grad, points):
        for j in (0, 1):
            assert (layer(j) <= arrived) == (j >= i) and (layer(j) & arrived == set()) == (j < i), (i, j, arrived)
        assert "model.embed_tokens.weight" not in arrived
    assert len(getattr(module.backend, "heap_hooks", [])) == sum(len(layer(i)) for i in points)


def test_the_heap_is_left_alone_once_the_policy_is_off_the_cpu(monkeypatch):
    """The local backend's heap returns are for a policy on the CPU: placed on another device, ``placed`` sets no
    hook and the phase-boundary hooks return nothing (a GPU run's host heap is not the update's)."""
    import grail_exp.compute.host as host
    import grail_exp.training.backends.local as local_mod

    module, batch = pinned_module(torch.float32, ["advantage=grail", "trainer.micro_batch_size=4"])
    calls = []
    monkeypatch.setattr(host, "return_freed_memory", lambda: calls.append("in-backward"))
    monkeypatch.setattr(local_mod, "return_freed_memory", lambda: calls.append("boundary"))
    monkeypatch.setattr(type(module.backend), "_on_cpu", lambda self: False)
    module.backend.placed()
    assert not getattr(module.backend, "heap_hooks", None)
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    module.update.step(batch, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch.loss_mask.sum().item(),
                       {}, 0)
    assert calls == []
