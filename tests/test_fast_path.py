"""The scheme fast paths equal the straightforward ones (issue 12 §2): shared forward for every GRAIL leaf and OAR-G
variant, per_rollout reuse, skipping A = 0 rows without changing the gradient or the logged diagnostics."""

import pytest
import torch

from test_bf16 import _module


def _shared_vs_separate(overrides):
    from grail_exp.advantages import build_scheme
    from grail_exp.forward import policy_forward

    module, batch = _module(torch.float32, overrides)
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
    assert torch.allclose(shared.weights, separate.weights, atol=1e-5)
    assert shared.metrics == pytest.approx(separate.metrics, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("variant", ["grail_repo", "original"])
def test_oar_g_shared_teacher_equals_separate_teacher(variant):
    shared, separate = _shared_vs_separate(["advantage=oar_g", f"advantage.variant={variant}",
                                            "advantage.log_compression=log1p"])
    assert torch.allclose(shared.weights, separate.weights, atol=1e-4)


def test_probe_runs_only_on_rows_that_need_it():
    from grail_exp.advantages import build_scheme

    module, batch = _module(torch.float32, ["advantage=grail"])  # symmetry wrong: only A <= 0 rows with a box
    module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
    module.rollout.prepare(batch, {})
    needs = module.scheme.rows_needing_model(batch.scheme_view(module.scheme_ctx))
    assert needs.tolist() == sorted(needs.tolist(), reverse=True)  # grouped into the first micro-batches
    assert int(needs.sum()) == 3  # rows 1, 2 (A < 0, boxed) and 6; row 3 has no box


def test_skip_zero_advantage_changes_neither_gradient_nor_diagnostics():
    from grail_exp.advantages import build_scheme

    results = {}
    for skip in (True, False):
        module, batch = _module(torch.float32, ["advantage=grail", f"advantage.skip_zero_advantage={skip}"])
        module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
        batch.advantages[:4] = 0.0  # a zero-variance group
        module.rollout.prepare(batch, {})
        from grail_exp.optim import build_optimizer

        opt = build_optimizer(module.policy, module.cfg.optim, master_weights=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        grads = {}
        real_step = opt.step

        def capture(closure=None, grads=grads, module=module):
            grads["g"] = torch.cat([p.grad.flatten() for p in module.policy.parameters()])
            return real_step(closure)

        opt.step = capture
        metrics = module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, epoch=0)
        results[skip] = (grads["g"], {k: v for k, v in metrics.items() if k.startswith("grail/")})
    assert torch.allclose(results[True][0], results[False][0], atol=1e-7)
    assert results[True][1] == pytest.approx(results[False][1], rel=1e-6, abs=1e-7)


def test_per_rollout_reuses_the_first_iteration_weights():
    """recompute=per_rollout: iteration 0 computes (and caches) the weights; later iterations reuse them exactly
    while per_update recomputes them with the updated parameters."""
    from grail_exp.advantages import build_scheme
    from grail_exp.optim import build_optimizer

    seen = {}
    for mode in ("per_rollout", "per_update"):
        module, batch = _module(torch.float32, ["advantage=grail", "advantage.symmetry=both",
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
