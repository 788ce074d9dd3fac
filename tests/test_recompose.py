"""Overrides applied to a composed config (``grail_exp/memory/recompose.py``, the memory planner's ``replan``) against Hydra
itself: the run's command line with the overrides appended, composed from scratch. The planner plans each suggestion
this way before naming it, so a suggestion's plan is the plan of the run the user would start with it."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers.compose import compose

CASES = [
    # (the run's overrides, the suggestion's, keys where the two may differ: see below)
    (["model=qwen3_8b", "advantage=grail"], ["trainer=fsdp", "trainer.devices=4"], set()),  # fsdp_zero2 → fsdp
    (["model=qwen3_8b", "advantage=grail", "rollout=hf"], ["rollout=vllm", "rollout.vllm.gpu_memory_utilization=0.35"],
     set()),  # hf → vllm: vLLM's file, the recipe's batch-size interpolations kept
    # vllm_paper → hf: the paper recipe and rollout/vllm_paper.yaml both set vllm.gpu_memory_utilization to 0.2. Equal
    # values set twice cannot be told apart in the composed config; the option's file is taken to explain it, so it
    # falls back to the schema's 0.3 (Hydra keeps the recipe's 0.2). An HF run never reads it: the plans are equal.
    (["model=qwen3_8b", "advantage=grpo"], ["rollout=hf"], {"rollout.vllm.gpu_memory_utilization"}),
    (["model=qwen3_4b", "advantage=grail", "trainer=gpu", "trainer.micro_batch_size=3"],
     ["trainer=fsdp_zero2", "trainer.devices=2"], set()),  # a command-line key of the group survives the switch
    (["model=qwen3_8b", "advantage=grail", "trainer=deepspeed_zero2"], ["trainer=fsdp", "trainer.devices=4"],
     set()),  # the DeepSpeed node goes with its option
    (["trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"], ["trainer=fsdp", "trainer.devices=2"], set()),
]


@pytest.mark.parametrize("run, suggestion, ambiguous", CASES)
def test_a_suggestion_is_the_run_hydra_would_compose(run, suggestion, ambiguous):
    from grail_exp.memory import plan, render, replan
    from grail_exp.memory.recompose import _leaves

    planned = replan(compose(run, Path("/nonexistent")), suggestion)
    replaced = {o.split("=", 1)[0] for o in suggestion}  # the command line the user would run: the suggestion wins
    started = compose([o for o in run if o.split("=", 1)[0] not in replaced] + suggestion, Path("/nonexistent"))
    mine, hydra = _leaves(planned), _leaves(started)
    assert {k for k in set(mine) | set(hydra) if mine.get(k, "<absent>") != hydra.get(k, "<absent>")} == ambiguous
    with_device = ["trainer.device_memory_gb=79"]
    assert render(plan(replan(planned, with_device))) == render(plan(replan(started, with_device)))


def test_the_current_option_is_the_one_that_explains_the_run():
    """The composed config does not record a group's option; the one leaving the fewest values set on top is taken,
    also when an experiment or the command line changed several of them."""
    from grail_exp.memory.recompose import _leaves, _schema_defaults, _set_on_top, group_options, option_file

    cfg = compose(["model=qwen3_8b", "advantage=grail", "trainer.devices=2", "trainer.max_steps=7"], Path("/nonexistent"))
    schema, mine = _schema_defaults(cfg.trainer), _leaves(cfg.trainer)
    left = {o: _set_on_top(mine, _leaves(OmegaConf.merge(schema, option_file("trainer", o))))
            for o in group_options("trainer")}
    assert min(left, key=lambda o: len(left[o])) == "fsdp_zero2"  # the paper recipe's trainer
    assert {"devices", "max_steps"} <= set(left["fsdp_zero2"])


def test_under_hydra_a_suggestion_is_recomposed_from_the_runs_own_overrides():
    """Where Hydra composed the run (its command line in HydraConfig), ``replan`` composes that command line with the
    suggestion from scratch: Hydra's answer exactly, also where the composed config alone is ambiguous (the paper
    recipe's vllm.gpu_memory_utilization 0.2 survives `rollout=hf`, which the composed-config path cannot tell)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.memory import replan

    run = ["model=qwen3_8b", "advantage=grpo", "paths.root_dir=/nonexistent"]
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=run, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            planned = replan(cfg, ["rollout=hf"])
            started = hydra_compose(config_name="config", overrides=[*run, "rollout=hf"])
        finally:
            HydraConfig.instance().cfg = None
    assert planned.rollout.vllm.gpu_memory_utilization == 0.2 == started.rollout.vllm.gpu_memory_utilization
    assert OmegaConf.to_container(planned) == OmegaConf.to_container(started)
