"""The learning-rate schedule's unit (``optim.schedule_unit``): the rate of every optimiser step against the upstream
arithmetic, written out here from the upstream code, not from ours.

verl (``verl/utils/torch_functional.py`` get_constant_schedule_with_warmup, ``fsdp_workers.update_actor``): the
factor after n scheduler steps is n / max(1, W) for n < W, else 1, and ``actor_lr_scheduler.step()`` runs once per
``update_actor``, i.e. once per rollout batch after all of its ppo_epochs × mini-batch optimiser steps. So rollout
batch j (0-based) trains every one of its steps at lr · min(j / W, 1). EasyR1 (RLSD's base) does the same.
TRL / transformers (``Trainer``, get_constant_schedule_with_warmup): the scheduler steps after every optimiser step, so
optimiser step g (0-based) trains at lr · min(g / W, 1).
"""

from types import SimpleNamespace

import pytest
import torch

from helpers.module import FakeOpt, build_module, small_config


def verl_factors(rollout_batches: int, steps_per_batch: int, warmup: int) -> list[float]:
    return [j / max(1, warmup) if j < warmup else 1.0 for j in range(rollout_batches) for _ in range(steps_per_batch)]


def trl_factors(steps: int, warmup: int) -> list[float]:
    return [g / max(1, warmup) if g < warmup else 1.0 for g in range(steps)]


class _RecordingOpt(FakeOpt):
    """Records the rate each optimiser step runs at."""

    def __init__(self, opt):
        super().__init__(opt)
        self.rates = []

    def step(self):
        self.rates.append(self.opt.param_groups[0]["lr"])
        super().step()


def _schedule_of(cfg, policy, backend):
    """The module's own scheduler (RLVRModule.configure_optimizers) for ``policy``."""
    from grail_exp.training.module import RLVRModule

    opts, scheds = RLVRModule.configure_optimizers(SimpleNamespace(cfg=cfg, policy=policy, backend=backend))
    return opts[0], scheds[0]["scheduler"]


@pytest.mark.parametrize("unit", ["rollout_batch", "optimizer_step"])
def test_rates_of_every_step_follow_the_upstream_schedule(compose_cfg, tiny_model_dir, unit):
    """k = 4 mini-batches × μ = 2 epochs = 8 optimiser steps per rollout batch, warmup 3, five rollout batches."""
    cfg = small_config(compose_cfg, tiny_model_dir, ["advantage=grpo", "trainer.micro_batch_size=4",
                                                     "loss.num_iterations=2", "trainer.mini_batches_per_rollout=4",
                                                     "optim.warmup_steps=3", f"optim.schedule_unit={unit}",
                                                     "optim.lr=1e-3"])
    module = build_module(cfg, tiny_model_dir)
    module.manual_backward = lambda loss: loss.backward()
    opt, sched = _schedule_of(cfg, module.policy, module.backend)
    fake = _RecordingOpt(opt)
    torch.manual_seed(0)
    batch, _ = module.rollout.collect(0, {})
    logged = []
    for _ in range(5):  # the same rollout batch five times: only the schedule matters here
        logged += [m["lr"] for _, m in module.update.optimizer_steps(batch, fake, sched, 0, {})]
    expected = verl_factors(5, 8, 3) if unit == "rollout_batch" else trl_factors(40, 3)
    assert fake.rates == pytest.approx([1e-3 * f for f in expected], rel=1e-12, abs=0)
    assert logged == fake.rates  # the logged lr is the rate the step used


def test_sdpg_recipe_warms_up_over_ten_rollout_batches(compose_cfg):
    """experiment=sdpg/qwen3_4b: lr_warmup_steps 10 in verl's unit, 8 mini-batches per rollout batch. The official
    run's factors per rollout batch are 0, 0.1, …, 0.9, then 1.0 (before: 0–0.7, 0.8–1.0 within the first two)."""
    from grail_exp.training.update import UpdatePhase

    cfg = compose_cfg(["experiment=sdpg/qwen3_4b"])
    assert (cfg.optim.schedule_unit, cfg.optim.warmup_steps, cfg.trainer.mini_batches_per_rollout) == \
        ("rollout_batch", 10, 8)
    param = torch.nn.Parameter(torch.zeros(1))
    opt, sched = _schedule_of(cfg, None, SimpleNamespace(build_optimizer=lambda policy: torch.optim.SGD([param],
                                                                                                       lr=1e-6)))
    update = UpdatePhase(cfg, None, None, None, None, None)
    rates = []
    for _ in range(12):
        for index in range(update.steps_per_rollout):
            rates.append(opt.param_groups[0]["lr"])
            opt.step()  # no gradient: no update, only the order torch expects
            if update.schedules_after(index):
                sched.step()
    assert rates == pytest.approx([1e-6 * f for f in verl_factors(12, 8, 10)], rel=1e-12, abs=0)


@pytest.mark.parametrize("experiment, unit", [("delta/qwen3_8b_dapo", "rollout_batch"),
                                              ("sdpg/qwen3_4b", "rollout_batch"),
                                              ("shear/qwen25_math_7b", "rollout_batch"),
                                              ("rlsd/official", "rollout_batch"),
                                              ("paper/qwen3_8b_grail", "optimizer_step"),
                                              ("baselines/dapo", "optimizer_step")])
def test_each_recipe_schedules_in_its_upstream_unit(compose_cfg, experiment, unit):
    """verl-based codebases (DelTA's and SDPG's verl forks, RLSD's EasyR1; SHEAR's paper describes verl's batch /
    mini-batch split) step the schedule per rollout batch; the GRAIL reference (a TRL fork) and the baselines laid out
    like it, per optimiser step."""
    assert compose_cfg([f"experiment={experiment}"]).optim.schedule_unit == unit


def test_schedule_unit_is_validated(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match="optim.schedule_unit"):
        validate(compose_cfg(["logger=none", "optim.schedule_unit=epoch"]))
