"""trainer=deepspeed_zero2 (grail_exp/training/backends/deepspeed.py): config, checkpointable state, bf16 master weights.
The 2-rank equality with one process and exact resume are in tests/test_ddp.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grail_exp.config import ConfigError
from grail_exp.validate import validate
from helpers.tolerances import HANG_TIMEOUT_S

pytest.importorskip("deepspeed")
TESTS = Path(__file__).resolve().parent


def test_recipe_composes_with_the_papers_zero2(compose_cfg):
    from grail_exp.training.backends.deepspeed import deepspeed_config

    cfg = validate(compose_cfg(["trainer=deepspeed_zero2", "model.dtype=bfloat16", "optim.master_weights=false"]))
    ds = deepspeed_config(cfg)
    assert cfg.trainer.strategy == "deepspeed" and ds["zero_optimization"]["stage"] == 2
    assert ds["managed_gradient_accumulation"] is False  # the trainer's step is the boundary
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert ds["gradient_clipping"] == cfg.optim.max_grad_norm
    fp32 = deepspeed_config(validate(compose_cfg(["trainer=deepspeed_zero2", "optim.max_grad_norm=null",
                                                  "trainer.deepspeed.zero_optimization.overlap_comm=true",
                                                  "+trainer.deepspeed.zero_optimization.round_robin_gradients=true"])))
    assert fp32["bf16"]["enabled"] is False and fp32["gradient_clipping"] == 0.0
    assert fp32["zero_optimization"] == {**ds["zero_optimization"], "overlap_comm": True,
                                         "round_robin_gradients": True}  # any DeepSpeed key passes through


@pytest.mark.parametrize("override, key", [
    ("trainer.deepspeed.zero_optimization.stage=3", "trainer.deepspeed.zero_optimization.stage"),
    ("trainer.strategy=deepspeed_stage_2", "trainer.strategy"),  # Lightning's strategy name: refused, explained
])
def test_bad_deepspeed_settings_name_the_key(compose_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg(["trainer=deepspeed_zero2", override]))


def test_plain_state_drops_deepspeed_objects_and_keeps_tensors():
    import enum

    from grail_exp.training.backends.deepspeed import _plain

    class Scaler:
        pass

    class Stage(enum.IntEnum):  # an int that torch.load(weights_only=True) refuses
        gradients = 2

    sd = {"loss_scaler": Scaler(), "single_partition_of_fp32_groups": [torch.ones(3)], "ds_version": "0.19.8",
          "base_optimizer_state": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"betas": (0.9, 0.99)}]},
          "param_slice_mappings": [{"w": Scaler()}], "group_paddings": [0], "zero_stage": Stage.gradients}
    out = _plain(sd)
    assert set(out) == {"single_partition_of_fp32_groups", "ds_version", "base_optimizer_state", "group_paddings"}
    assert out["base_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.99)


@pytest.mark.e2e
@pytest.mark.slow  # 30 s; the bf16 resume test in e2e/test_ddp.py (in make test) also depends on the fp32 masters
def test_bf16_run_keeps_fp32_masters_that_move_at_the_papers_lr(tmp_path):
    """bf16 parameters, lr 1e-6, 2 steps: a bf16-only AdamW would leave almost every weight where it was; ZeRO's fp32
    master partition moves (> 90 % of its entries are no longer bf16-representable), the bf16 weights are its
    rounding, and the checkpoint loads with weights_only."""
    from helpers.pinned_step import build_model_and_tokenizer

    model_dir = tmp_path / "model"
    model, tok = build_model_and_tokenizer()
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    args = ["logger=none", "rollout.engine=helpers.fakes:ScriptedEngine", f"model.name_or_path={model_dir}",
            "model.dtype=bfloat16", "optim.master_weights=false", "optim.lr=1e-6", "trainer=deepspeed_zero2",
            "trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_steps=2", "trainer.prompts_per_step=4",
            "rollout.num_generations=4", "trainer.micro_batch_size=8", "trainer.eval_before_training=false",
            "trainer.eval_at_end=false", "advantage=grail", f"paths.root_dir={tmp_path}", f"hydra.run.dir={run_dir}"]
    env = {**__import__("os").environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "grail_exp.run", *args], env=env, capture_output=True, text=True,
                         timeout=HANG_TIMEOUT_S)
    ckpt = run_dir / "checkpoints" / "step-2"
    assert (ckpt / "COMPLETE").exists(), out.stderr[-3000:]
    from grail_exp.checkpoint import load_rank_state

    master = load_rank_state(ckpt, 0)["optimizer"]["single_partition_of_fp32_groups"][0]
    assert master.dtype == torch.float32
    off_grid = (master != master.bfloat16().float()).float().mean().item()
    assert off_grid > 0.9, f"only {off_grid:.1%} of the fp32 masters moved off the bf16 grid"
