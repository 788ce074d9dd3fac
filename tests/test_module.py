"""The training step: fits of the composed default config, truncation masking, inner iterations, NaN guard."""

import math

import pytest
import torch

from helpers.module import FakeOpt, build_module, small_config, train_step


def test_first_inner_iteration_has_ratio_one_and_no_clipping(compose_cfg, tiny_model_dir):
    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.num_iterations=2"])
    module = build_module(cfg, tiny_model_dir)
    _, metrics = train_step(module)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_ratio/region_mean"] == 0.0


def test_kl_is_zero_when_policy_equals_reference(compose_cfg, tiny_model_dir):
    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.beta=0.04", "loss.num_iterations=2"])
    module = build_module(cfg, tiny_model_dir)
    _, metrics = train_step(module)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)


def test_truncated_completions_carry_no_loss(compose_cfg, tiny_model_dir):
    # 3 new tokens: the random model almost never stops, so (nearly) every completion is truncated.
    cfg = small_config(compose_cfg, tiny_model_dir, ["rollout.max_completion_length=3",
                                                     "loss.mask_truncated_completions=true"])
    module = build_module(cfg, tiny_model_dir)
    torch.manual_seed(0)
    batch, stats = module.rollout.make_batch(0, {})
    assert stats["completions/truncated_rate"] > 0
    # loss mask = 0 on every truncated row, generated-token mask elsewhere
    trunc_rows = batch.attention_mask[:, batch.prompt_length:].sum(1) == 3  # no stop token within budget
    assert torch.all(batch.loss_mask[trunc_rows] == 0) or not trunc_rows.any()

    cfg2 = small_config(compose_cfg, tiny_model_dir, ["rollout.max_completion_length=3",
                                                      "loss.mask_truncated_completions=false"])
    module2 = build_module(cfg2, tiny_model_dir)
    torch.manual_seed(0)
    batch2, _ = module2.rollout.make_batch(0, {})
    assert batch2.loss_mask.sum() > batch.loss_mask.sum()


def test_nonfinite_loss_is_skipped_then_aborts(compose_cfg, tiny_model_dir):
    from grail_exp.training.module import NonFiniteLossError

    cfg = small_config(compose_cfg, tiny_model_dir, ["trainer.max_nonfinite_in_a_row=2"])
    module = build_module(cfg, tiny_model_dir)
    before = [p.detach().clone() for p in module.policy.parameters()]
    real_weights = module.scheme.weights

    def nan_weights(model, batch, *forward):  # inject a NaN into the token advantages
        out = real_weights(model, batch)
        out.weights = out.weights * float("nan")
        return out

    module.scheme.weights = nan_weights
    module.scheme.weights_from_forward = nan_weights
    _, metrics = train_step(module)
    assert metrics["nonfinite_steps_total"] == 1 and math.isnan(metrics["loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))  # update skipped
    with pytest.raises(NonFiniteLossError, match="in a row"):
        train_step(module)


def test_gradient_accumulation_equals_one_big_batch(compose_cfg, tiny_model_dir):
    """Two micro-batches of 8 accumulate to the gradient of one micro-batch of 16, for every loss_type."""
    for loss_type in ("dr_grpo", "bnpo", "dapo", "grpo"):
        grads = []
        for mb in (8, 16):
            cfg = small_config(compose_cfg, tiny_model_dir, [f"trainer.micro_batch_size={mb}",
                                                             "optim.max_grad_norm=null", f"loss.loss_type={loss_type}"])
            module = build_module(cfg, tiny_model_dir)
            torch.manual_seed(0)
            batch, _ = module.rollout.make_batch(0, {})
            module.manual_backward = lambda loss: loss.backward()
            opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
            fake = FakeOpt(opt)
            captured = {}

            def capture_then_step(fake=fake, module=module, captured=captured):
                captured["g"] = torch.cat([p.grad.flatten() for p in module.policy.parameters()])
                fake.opt.step()

            fake.step = capture_then_step
            module.update.step(batch, fake, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                               batch.loss_mask.sum().item(), {}, 0)
            grads.append(captured["g"])
        assert grads[0].abs().sum() > 0
        if loss_type in ("dr_grpo", "dapo"):  # normalisers independent of the micro-batch split
            # Another micro-batch split sums in another order (GEMM shapes, gradient accumulation): <= 5 x 320 eps of
            # the gradient's scale, x2 for cancellation (docs/notes/reliability.md). Measured: 1.3e-8.
            assert torch.allclose(grads[0], grads[1], rtol=0,
                                  atol=2 * 5 * 320 * 2**-23 * grads[1].abs().max().item()), loss_type


def test_fit_of_the_composed_default_config_logs_to_mlflow(compose_cfg, tmp_path, caplog):
    """A 3-step fit of the default config (embedded model, warm start shortened) end to end, into MLflow."""
    import logging

    from mlflow.tracking import MlflowClient

    from grail_exp.run import run

    cfg = compose_cfg(["trainer.max_steps=3", "trainer.prompts_per_step=4", "trainer.micro_batch_size=16",
                       "model.warm_start.max_steps=20", "model.warm_start.eval_every=10",
                       "trainer.sample_table_every=2", "benchmark.limit=8", "eval.n=2", "loss.num_iterations=2",
                       "trainer.progress_log_every=2"])
    with caplog.at_level(logging.INFO, logger="grail_exp.module"):
        value = run(cfg)
    assert 0.0 <= value <= 1.0
    # the one-line progress log of redirected runs: every 2nd step and the last
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split()[1] for m in progress] == ["2/3", "3/3"], progress
    assert all(" reward " in m and " s/step  ETA " in m for m in progress), progress
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    exp = client.get_experiment_by_name("grail_exp")
    (r,) = client.search_runs([exp.experiment_id])
    assert r.info.status == "FINISHED"
    assert r.data.params["loss.loss_type"] == "dr_grpo" and r.data.params["advantage.name"] == "grail"
    history = client.get_metric_history(r.info.run_id, "reward/mean")
    assert [m.step for m in history] == [1, 2, 3]
    for key in ["loss", "grad_norm", "entropy", "clip_ratio/region_mean", "frac_reward_zero_std",
                "completions/mean_length", "completions/truncated_rate", "timing/rollout_s", "timing/scoring_s",
                "timing/update_s", "timing/scheme_s", "grail/reweighted_rows", "grail/advantages_scale_ratio",
                "grail/fallback_rate", "grail/answer_found_rate", "eval/arithmetic/acc", "eval/arithmetic/pass_at_2", "eval_before/arithmetic/acc"]:
        assert key in r.data.metrics, key
    arts = {a.path for a in client.list_artifacts(r.info.run_id, "eval/final")}
    assert "eval/final/pass_at_k.json" in arts and "eval/final/pass_at_k.md" in arts
    assert {a.path for a in client.list_artifacts(r.info.run_id, "samples")} >= {"samples/step_000002.json"}
    assert (tmp_path / "run" / "metrics.json").exists()
    # the per-token weight tables and the end-of-run plots made from them and from the metric histories
    assert any(a.path.endswith(".parquet") for a in client.list_artifacts(r.info.run_id, "weights"))
    import pandas as pd

    table = pd.concat([pd.read_parquet(f) for f in (tmp_path / "run" / "weights").glob("step_*.parquet")])
    assert set(table.columns) >= {"step", "row", "correct", "advantage", "position", "region", "weight", "entropy"}
    plots = {a.path for a in client.list_artifacts(r.info.run_id, "plots")}
    assert "plots/training_curves.png" in plots
    # weight plots need answered rows with A != 0 (a 20-step warm start may solve nothing): present exactly then
    answered = table[(table.region == "answer") & (table.advantage != 0)]
    assert ("plots/weights_vs_entropy.png" in plots) == (len(answered) > 0)


@pytest.mark.parametrize("scheme, diagnostic", [
    ("grpo", "weights/mean"),  # CI keeps one; the others are minutes each on 2 cores (make test-all)
    pytest.param("oar_g", "oar_g/weight_mean", marks=pytest.mark.slow),
    pytest.param("oar_p", "oar_p/weight_mean", marks=pytest.mark.slow)])
def test_short_run_per_scheme_logs_diagnostics(compose_cfg, tmp_path, scheme, diagnostic):
    from mlflow.tracking import MlflowClient

    from grail_exp.run import run

    cfg = compose_cfg([f"advantage={scheme}", "trainer.max_steps=2", "trainer.prompts_per_step=2",
                       "trainer.micro_batch_size=16", "model.warm_start.max_steps=20", "model.warm_start.eval_every=10",
                       "benchmark.limit=4", "eval.n=2", "trainer.eval_before_training=false"])
    run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("grail_exp").experiment_id])
    assert r.info.status == "FINISHED" and r.data.params["advantage.name"] == scheme
    assert len(client.get_metric_history(r.info.run_id, diagnostic)) == 2
