"""trainer.mini_batches_per_rollout (issue 23 §5): verl's mini-batches. k mini-batches × μ epochs of optimiser steps
per rollout batch; each mini-batch is a rollout batch of its own size to the loss, so k = 4 equals four separate
optimiser steps on the four quarters."""

import pytest
import torch

from helpers.module import FakeOpt, build_module, small_config
from helpers.tolerances import MODEL_REORDER


def _completion_logp(model, batch, rows: slice, temperature: float) -> torch.Tensor:
    """(rows, C) log π(o_t) written out: one full-vocabulary log-softmax of the logits that predict the completion."""
    P, C = batch.prompt_length, batch.completion_ids.shape[1]
    logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                   position_ids=batch.position_ids[rows]).logits[:, P - 1:P - 1 + C].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[rows].unsqueeze(-1)).squeeze(-1)


def _brute_force_quarters(model, batch, cfg, lr: float, loss_type: str):
    """verl's dp_actor.update_policy with ppo_mini_batch_size = 1 prompt (4 rows) and ppo_epochs = 1, written out: the
    old log-probs of every row at the rollout parameters (verl's compute_log_prob before update_actor); then for each
    quarter in row order the PPO-clip loss on ratio = exp(logp − old) — 1 only on the first quarter, whose parameters
    are still the rollout ones — normalised over the quarter alone, and one SGD step. Returns (parameters, the
    quarters' token-mean ratios)."""
    T, eps_lo, eps_hi, L_max = cfg.rollout.temperature, cfg.loss.epsilon, cfg.loss.epsilon_high, \
        cfg.rollout.max_completion_length
    with torch.no_grad():
        old = _completion_logp(model, batch, slice(None), T)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ratios = []
    for q in range(4):
        rows = slice(4 * q, 4 * q + 4)
        m, adv = batch.loss_mask[rows], batch.advantages[rows].unsqueeze(1)
        ratio = torch.exp(_completion_logp(model, batch, rows, T) - old[rows])
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv)
        if loss_type == "dapo":  # token mean over the quarter
            loss = (per_token * m).sum() / m.sum()
        elif loss_type == "dr_grpo":  # token sum / (rows × L_max)
            loss = (per_token * m).sum() / (4 * L_max)
        else:  # grpo: per-row token mean, then the mean over the quarter's rows
            loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ratios.append(((ratio * m).sum() / m.sum()).item())
    return [p.detach().clone() for p in model.parameters()], ratios


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_four_mini_batches_use_rollout_time_old_logprobs(compose_cfg, tiny_model_dir, loss_type):
    """k = 4, μ = 1 with HF rollouts: quarters 2–4 are trained at moved parameters, so their PPO ratio is taken against
    the rollout-time log-probs (verl: on_policy only for one mini-batch and one epoch; TRL: old log-probs whenever a
    generation batch feeds several optimiser steps). The reference is the brute-force loop above, not the code's path."""
    import copy

    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.num_iterations=1", "advantage=grpo",
                                                     f"loss.loss_type={loss_type}", "trainer.micro_batch_size=2",
                                                     "trainer.mini_batches_per_rollout=4", "optim.max_grad_norm=null"])
    module = build_module(cfg, tiny_model_dir)
    module.manual_backward = lambda loss: loss.backward()
    torch.manual_seed(0)
    batch, _ = module.rollout.collect(0, {})  # 4 prompts x 4 rollouts, with whatever old log-probs the rule asks for
    assert batch.advantages.abs().sum() > 0
    reference = copy.deepcopy(module.policy)
    start = [p.detach().clone() for p in reference.parameters()]
    lr = 1.0  # SGD: a step that moves the later quarters' ratios by a few per cent (5-23 % of their tokens clipped)
    opt = torch.optim.SGD(module.policy.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    steps = [m for _, m in module.update.optimizer_steps(batch, FakeOpt(opt), sched, 0, {})]
    expected, ratios = _brute_force_quarters(reference, batch, cfg, lr, loss_type)

    assert ratios[0] == pytest.approx(1.0, abs=1e-6) and max(abs(r - 1) for r in ratios[1:]) > 0.01, ratios
    # Log-probs of one forward in another batch shape / reduction order: <= MODEL_REORDER relative to log π's scale
    # (|log π| <= log V ~ 5.8), so a ratio exp(Δ) moves by <= 2 x 5.8 x MODEL_REORDER.
    tol_ratio = 2 * 5.8 * MODEL_REORDER
    assert [m["ratio_mean"] for m in steps] == pytest.approx(ratios, abs=tol_ratio)
    # SGD moves a weight by lr x its gradient; the two paths' gradients agree to MODEL_REORDER of their scale, so the
    # four steps' total move Δw agrees to 4 x MODEL_REORDER of it, x2 for cancellation. Measured: 1e-6 of Δw.
    moved = max((b - a).abs().max().item() for a, b in zip(start, expected))
    for a, b in zip(module.policy.parameters(), expected):
        assert torch.allclose(a, b, rtol=0, atol=2 * 4 * MODEL_REORDER * moved), (a - b).abs().max()


def test_mini_batches_validate_whole_groups(compose_cfg, tiny_model_dir):
    from grail_exp.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.mini_batches_per_rollout = 3"):
        small_config(compose_cfg, tiny_model_dir, ["trainer.mini_batches_per_rollout=3"])  # 4 prompts
    with pytest.raises(ConfigError, match="trainer.micro_batch_size = 3"):
        small_config(compose_cfg, tiny_model_dir, ["trainer.mini_batches_per_rollout=2", "trainer.micro_batch_size=3"])


def test_counters_over_mini_batches_and_epochs(tmp_path, formatted_model_dir, monkeypatch):
    """k = 2, μ = 2, max_steps = 6 on the warm-started model (answers of different lengths): steps 1-4 train rollout
    batch 1 (mini-batches 0, 1, 0, 1), steps 5-6 rollout batch 2;
    every step of a rollout batch sees the same rollout counter (RLSD's / SDPG's schedules), and the run stops at 6.
    dapo's normaliser for a step is the number of tokens the engine generated for that mini-batch's 8 rollouts
    (rollout rows 0-7 or 8-15 of its round, counted from the engine's completions, not from the batch's mask)."""
    import grail_exp.grading.rewards
    import grail_exp.training.rollout as rollout_module
    from grail_exp.run import run
    from grail_exp.training.update import UpdatePhase
    from helpers.compose import compose
    from helpers.fakes import AlternatingVerifier

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    generated = []  # per round: the token count of each completion, in rollout order
    real_pad = rollout_module.pad_completions

    def counting_pad(completions, pad_id):
        generated.append([len(c.token_ids) for c in completions])
        return real_pad(completions, pad_id)

    monkeypatch.setattr(rollout_module, "pad_completions", counting_pad)
    seen = []
    real = UpdatePhase.step

    def spy(self, batch, optimizer, scheduler, global_tokens, timings, epoch, rows=None, **kw):
        view = batch.scheme_view(self.scheme_ctx, *rows)
        seen.append((self.scheme_ctx.progress.step, view.rollout_index(), epoch, rows, global_tokens))
        return real(self, batch, optimizer, scheduler, global_tokens, timings, epoch, rows, **kw)

    monkeypatch.setattr(UpdatePhase, "step", spy)
    cfg = compose([f"model.name_or_path={formatted_model_dir}", "logger=none", "trainer.prompts_per_step=4",
                   "trainer.micro_batch_size=4", "rollout.num_generations=4", "rollout.max_completion_length=40",
                   "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                   "loss.mask_truncated_completions=false", "loss.num_iterations=2", "loss.loss_type=dapo",
                   "trainer.mini_batches_per_rollout=2", "trainer.max_steps=6"], tmp_path)
    run(cfg)
    assert [s[0] for s in seen] == [0, 1, 2, 3, 4, 5]  # optimiser steps done before each step
    assert [s[1] for s in seen] == [1, 1, 1, 1, 2, 2]  # the rollout batch, 1-based (verl's global step)
    assert [s[2] for s in seen] == [0, 0, 1, 1, 0, 0]  # epoch
    assert [s[3] for s in seen] == [(0, 8), (8, 16)] * 3  # 4 prompts x 4 rollouts, halves in rollout order
    assert len(generated) == 2  # two rollout batches drawn
    half = lambda rnd, h: float(sum(generated[rnd][8 * h:8 * h + 8]))  # noqa: E731
    assert [s[4] for s in seen] == [half(0, 0), half(0, 1), half(0, 0), half(0, 1), half(1, 0), half(1, 1)]
    assert len({s[4] for s in seen}) > 1  # the halves differ, so the check can tell them apart


# (experiment, k, μ, optimiser steps, rollout batches), the numbers written out from the upstream scripts (verl's trainer
# steps = rollout batches): DelTA's run_DelTA.sh train_prompt_bsz 128 / mini 32 (100 rollout batches: our reading,
# UNVERIFIED); SHEAR's App. J batch 512 / mini-batch 32, 300 steps; SDPG's run_qwen3_4b_sdpg_boxed.sh 128 / 16,
# total_training_steps 400; RLSD's rlsd_train.sh global batch = rollout batch (256 / 256), 200 (CHOSEN).
OFFICIAL = [("delta/qwen3_8b_dapo", 4, 1, 400, 100), ("shear/qwen25_math_7b", 16, 1, 4800, 300),
            ("sdpg/qwen3_4b", 8, 1, 3200, 400), ("rlsd/official", 1, 1, 200, 200)]


@pytest.mark.parametrize("experiment, k, mu, steps, n_rollouts", OFFICIAL)
def test_official_recipes_use_the_official_split_and_length(compose_cfg, experiment, k, mu, steps, n_rollouts):
    """Each recipe splits its rollout batches as its official script does and runs as many rollout batches as the
    script's trainer steps; SDPG's β schedule T counts rollout batches (total_training_steps)."""
    cfg = compose_cfg([f"experiment={experiment}"])
    t = cfg.trainer
    assert (t.mini_batches_per_rollout, cfg.loss.num_iterations, t.max_steps) == (k, mu, steps)
    if experiment.startswith("sdpg"):
        assert cfg.loss.terms.sdpg_opd.total_steps == n_rollouts
    # the length is stated in rollout batches: another k keeps it (and the optimiser steps follow)
    assert compose_cfg([f"experiment={experiment}", "trainer.mini_batches_per_rollout=2"]).trainer.max_steps == \
        2 * mu * n_rollouts


def test_the_run_draws_and_announces_its_rollout_batches(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """max_steps = 5 with k = 2, μ = 1: three rollout batches are sampled (the last gives one of its two steps), and
    the start of the run says so in both units."""
    import logging

    import grail_exp.grading.rewards
    from grail_exp.run import run
    from grail_exp.training.rollout import RolloutPhase
    from helpers.compose import compose
    from helpers.fakes import AlternatingVerifier

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    rounds, real = [], RolloutPhase.make_batch
    monkeypatch.setattr(RolloutPhase, "make_batch", lambda self, i, t: rounds.append(i) or real(self, i, t))
    cfg = compose([f"model.name_or_path={tiny_model_dir}", "logger=none", "trainer.prompts_per_step=4",
                   "trainer.micro_batch_size=8", "rollout.num_generations=4", "rollout.max_completion_length=8",
                   "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                   "trainer.mini_batches_per_rollout=2", "trainer.max_steps=5", "trainer.save_final_checkpoint=false"],
                  tmp_path)
    with caplog.at_level(logging.INFO, logger="grail_exp"):
        run(cfg)
    assert rounds == [0, 1, 2]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training length")]
    assert lines == ["training length: 5 optimiser steps = 3 rollout batches (x 2 mini-batches x 1 epoch; the last one "
                     "gives 1 of its 2 steps)"], lines
