"""trainer.mini_batches_per_rollout (issue 23 §5): verl's mini-batches. k mini-batches × μ epochs of optimiser steps
per rollout batch; each mini-batch is a rollout batch of its own size to the loss, so k = 4 equals four separate
optimiser steps on the four quarters."""

import pytest
import torch

from test_module import _FakeOpt, _build_module, _small


def _rows(batch, a: int, b: int):
    """Rows a:b of a TrainingBatch as a batch of their own (copies)."""
    from grail_exp.training.batch import TrainingBatch

    t = {k: getattr(batch, k)[a:b].clone() for k in TrainingBatch._TENSORS if getattr(batch, k) is not None}
    t["group_ids"] = t["group_ids"] - t["group_ids"][0]
    return TrainingBatch(prompt_length=batch.prompt_length, texts=batch.texts[a:b], problems=batch.problems[a:b],
                         golds=batch.golds[a:b], **t)


def _trained(compose_cfg, model_dir, extra, batch_fn):
    cfg = _small(compose_cfg, model_dir, ["loss.num_iterations=1", *extra])
    module = _build_module(cfg, model_dir)
    module.manual_backward = lambda loss: loss.backward()
    opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = batch_fn(module, _FakeOpt(opt), sched)
    return [p.detach().clone() for p in module.policy.parameters()], metrics


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_four_mini_batches_equal_four_optimiser_steps_on_the_quarters(compose_cfg, tiny_model_dir, loss_type):
    torch.manual_seed(0)
    cfg = _small(compose_cfg, tiny_model_dir)
    batch, _ = _build_module(cfg, tiny_model_dir).rollout.make_batch(0, {})  # 4 prompts x 4 rollouts
    assert batch.advantages.abs().sum() > 0

    def four_mini_batches(module, opt, sched):
        steps = list(module.update.optimizer_steps(batch, opt, sched, 0, {}))
        assert [i for i, _ in steps] == [0, 1, 2, 3]
        return [m for _, m in steps]

    def four_quarters(module, opt, sched):
        return [module.update.step(part, opt, sched, float(part.loss_mask.sum()), {}, epoch=0)
                for part in (_rows(batch, 4 * q, 4 * q + 4) for q in range(4))]

    def one_step(module, opt, sched):
        return [module.update.step(batch, opt, sched, float(batch.loss_mask.sum()), {}, epoch=0)]

    common = [f"loss.loss_type={loss_type}", "trainer.micro_batch_size=2"]
    mini, m_mini = _trained(compose_cfg, tiny_model_dir, [*common, "trainer.mini_batches_per_rollout=4"],
                            four_mini_batches)
    quarters, m_quarters = _trained(compose_cfg, tiny_model_dir, [*common, "trainer.prompts_per_step=1"],
                                    four_quarters)
    whole, _ = _trained(compose_cfg, tiny_model_dir, common, one_step)
    # The same rows in the same micro-batch shapes through the same ops: bit-identical by construction.
    assert all(torch.equal(a, b) for a, b in zip(mini, quarters))
    assert [m["loss"] for m in m_mini] == [m["loss"] for m in m_quarters]
    assert [m["mini_batch"] for m in m_mini] == [0.0, 1.0, 2.0, 3.0]
    assert not all(torch.equal(a, b) for a, b in zip(mini, whole))  # one whole-batch step is another update


def test_mini_batches_validate_whole_groups(compose_cfg, tiny_model_dir):
    from grail_exp.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.mini_batches_per_rollout = 3"):
        _small(compose_cfg, tiny_model_dir, ["trainer.mini_batches_per_rollout=3"])  # 4 prompts
    with pytest.raises(ConfigError, match="trainer.micro_batch_size = 3"):
        _small(compose_cfg, tiny_model_dir, ["trainer.mini_batches_per_rollout=2", "trainer.micro_batch_size=3"])


def test_counters_over_mini_batches_and_epochs(tmp_path, tiny_model_dir, monkeypatch):
    """k = 2, μ = 2, max_steps = 6: steps 1-4 train rollout batch 1 (mini-batches 0, 1, 0, 1), steps 5-6 rollout batch 2;
    every step of a rollout batch sees the same rollout counter (RLSD's / SDPG's schedules), and the run stops at 6."""
    import grail_exp.rewards
    from conftest import AlternatingVerifier, compose
    from grail_exp.run import run
    from grail_exp.training.update import UpdatePhase

    monkeypatch.setattr(grail_exp.rewards, "MathVerifier", AlternatingVerifier)
    seen = []
    real = UpdatePhase.step

    def spy(self, batch, optimizer, scheduler, global_tokens, timings, epoch, rows=None):
        view = batch.scheme_view(self.scheme_ctx, *rows)
        seen.append((self.scheme_ctx.progress.step, view.rollout_index(), epoch, rows,
                     global_tokens == float(batch.loss_mask[rows[0]:rows[1]].sum())))
        return real(self, batch, optimizer, scheduler, global_tokens, timings, epoch, rows)

    monkeypatch.setattr(UpdatePhase, "step", spy)
    cfg = compose([f"model.name_or_path={tiny_model_dir}", "logger=none", "trainer.prompts_per_step=4",
                   "trainer.micro_batch_size=4", "rollout.num_generations=4", "rollout.max_completion_length=8",
                   "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                   "loss.mask_truncated_completions=false", "loss.num_iterations=2",
                   "trainer.mini_batches_per_rollout=2", "trainer.max_steps=6"], tmp_path)
    run(cfg)
    assert [s[0] for s in seen] == [0, 1, 2, 3, 4, 5]  # optimiser steps done before each step
    assert [s[1] for s in seen] == [1, 1, 1, 1, 2, 2]  # the rollout batch, 1-based (verl's global step)
    assert [s[2] for s in seen] == [0, 0, 1, 1, 0, 0]  # epoch
    assert [s[3] for s in seen] == [(0, 8), (8, 16)] * 3  # 4 prompts x 4 rollouts, halves in rollout order
    assert all(s[4] for s in seen)  # dapo's normaliser counts the mini-batch's tokens


@pytest.mark.parametrize("experiment, k, mu, n_rollouts", [("delta/qwen3_8b_dapo", 4, 1, 100),
                                                               ("shear/qwen25_math_7b", 16, 1, 19),
                                                               ("sdpg/qwen3_4b", 8, 1, 400),
                                                               ("rlsd/official", 1, 1, 200)])
def test_official_recipes_use_the_official_split(compose_cfg, experiment, k, mu, n_rollouts):
    """DelTA (4 mini-batches of 32 prompts), SHEAR (16 of 32 completions), SDPG (8 of 16 prompts) and RLSD (the whole
    256-prompt batch) split their rollout batches as their official scripts do; SDPG's T counts rollout batches."""
    from grail_exp.config import rollout_batches

    cfg = compose_cfg([f"experiment={experiment}"])
    t = cfg.trainer
    assert (t.mini_batches_per_rollout, cfg.loss.num_iterations) == (k, mu)
    assert rollout_batches(t.max_steps, mu, k) == rollout_batches_expected(t.max_steps, k * mu) == n_rollouts
    if experiment.startswith("sdpg"):
        assert cfg.loss.terms.sdpg_opd.total_steps == 400


def rollout_batches_expected(max_steps: int, per: int) -> int:
    import math

    return math.ceil(max_steps / per)
