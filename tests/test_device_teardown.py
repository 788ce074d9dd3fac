"""The end of a fit copies nothing to the host (grail_exp/device_teardown.py). Lightning's own teardown moves every
optimiser-state tensor and the whole module to the CPU on every rank; on a GPU node that is the model state of every
rank at once, more host memory than the job has. The CPU cannot see that copy (``.cpu()`` of a CPU tensor is a no-op),
so ``meta`` tensors stand in for the GPU's: the host cannot copy out of them (``NotImplementedError: Cannot copy out of
meta tensor``), and a teardown that tries fails here as it would exhaust a GPU node's memory there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "grail_exp" / "data" / "embedded" / "tiny"


class _MetaModule(L.LightningModule):
    """A module whose parameters live on the meta device, as a GPU rank's do out of the host's reach."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3, device="meta")


def _meta_adamw(module) -> torch.optim.Optimizer:
    """AdamW over the module's parameters with one step's state (moments on the meta device, the step count on the
    CPU as torch keeps it)."""
    opt = torch.optim.AdamW(module.parameters())
    for p in module.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        p.grad = torch.zeros_like(p)
    return opt


def _trainer_options() -> list[str]:
    from grail_exp.memory.recompose import group_options

    return sorted(group_options("trainer"))


@pytest.mark.parametrize("option", _trainer_options())
def test_every_trainers_strategy_tears_down_on_the_device(option, compose_cfg, monkeypatch):
    """For every trainer option (``auto``: Lightning's single-device strategy; every other: the DDP launcher the update
    backends share), at world size 1 on the CPU: the teardown moves nothing (the meta parameters and the meta moments
    would raise), frees the optimiser state and the gradients, and still runs the accelerator's and the cluster
    environment's teardown."""
    from grail_exp.distributed import build_strategy

    cfg = compose_cfg([f"trainer={option}", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.num_nodes=1"])
    monkeypatch.setenv("WORLD_SIZE", "1")  # the cluster environment's teardown removes it
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=build_strategy(cfg, timedelta(seconds=1800)), logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    strategy = trainer.strategy
    module = _MetaModule()
    strategy.connect(module)
    strategy.optimizers = [_meta_adamw(module)]
    calls = []
    monkeypatch.setattr(strategy.accelerator, "teardown", lambda: calls.append("accelerator"))
    strategy.teardown()
    assert calls == ["accelerator"]
    assert all(p.device.type == "meta" for p in module.parameters())
    assert len(strategy.optimizers[0].state) == 0
    assert all(p.grad is None for p in module.parameters())
    if option != "cpu" and option != "gpu":  # the DDP launcher's cluster environment was torn down too
        assert "WORLD_SIZE" not in os.environ


def test_the_single_device_is_the_one_lightning_picks(monkeypatch):
    """``trainer.strategy=auto`` builds its single-device strategy on the device Lightning's own ``auto`` would pick
    (its accelerator connector, the expectation), with 4 CUDA devices made visible to Lightning's device parser."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from grail_exp.device_teardown import single_device

    assert single_device("cpu", 1) == torch.device("cpu")
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for accelerator, devices in (("gpu", 1), ("gpu", [2]), ("cuda", "3,"), ("auto", 1)):
        lightning = _AcceleratorConnector(accelerator=accelerator, devices=devices, strategy="auto").strategy
        assert single_device(accelerator, devices) == lightning.root_device, (accelerator, devices)


@pytest.mark.e2e
def test_a_run_writes_its_metrics_plots_and_study_arm_after_the_teardown(tmp_path):
    """A real fit of the shipped tiny model (2 steps, MLflow on sqlite, a study folder) whose policy and optimiser
    state sit on the meta device once the closing is done (``helpers.teardown_probe``): the teardown copies neither,
    and the job goes on to write ``metrics.json``, the training plots and the study's arm record. (With Lightning's
    teardown the job raised ``Cannot copy out of meta tensor`` there and wrote none of them.)"""
    probe_dir = tmp_path / "probe"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRAIL_EXP_PROBE": "helpers.teardown_probe:DeviceStandIn",
           "GRAIL_EXP_PROBE_DIR": str(probe_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    args = [f"model.name_or_path={TINY}", "advantage=grpo", "trainer.max_steps=2", "trainer.prompts_per_step=2",
            "rollout.num_generations=4", "trainer.micro_batch_size=8", "rollout.max_completion_length=16",
            "trainer.weights_table_every=1", "eval.max_tokens=16", "eval.n=2", "benchmark.limit=4",
            "trainer.eval_before_training=false", "reward.num_workers=0", f"study.dir={tmp_path / 'study'}",
            f"paths.root_dir={tmp_path}", f"hydra.run.dir={run_dir}"]
    out = subprocess.run([sys.executable, "-m", "grail_exp.run", *args], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path)
    tail = (out.stdout + out.stderr)[-3000:]
    (closed,) = [json.loads(x) for x in (probe_dir / "rank0.jsonl").read_text().splitlines()]
    assert closed["optimizer_tensors_on_meta"] > 0 and closed["policy_device"] == "meta", closed
    assert out.returncode == 0, tail
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    assert metrics["train/steps"] == 2, tail
    plots = sorted(p.name for p in tmp_path.rglob("plots/*.png"))
    assert "training_curves.png" in plots, (plots, tail)
    (arm,) = (tmp_path / "study").glob("*/arm.json")
    assert json.loads(arm.read_text())["metrics"]["train/steps"] == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_the_gpu_checks_cardchecks_mode_on_the_cpu(tmp_path):
    """`bash sweeps/gpu_checks.sh cardchecks` (on one GPU) with CARDCHECKS_DRY=1: the teardown check and the CUDA
    context check run on the CPU with the shipped tiny model, the preflight's card command is composed. On the CPU the
    teardown's copy is a no-op either way, but what each teardown leaves is not: Lightning's keeps the optimiser state
    (copied to the CPU), the project's frees it; the task started as srun's local rank 1 exports LOCAL_RANK=1 before
    validate() and initialises no CUDA."""
    from omegaconf import OmegaConf

    env = {**os.environ, "CARDCHECKS_DRY": "1", "CARDCHECKS_TMP": str(tmp_path / "tmp"), "PY": sys.executable,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(["bash", str(ROOT / "sweeps" / "gpu_checks.sh"), "cardchecks", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    teardown = {x["mode"]: x for x in map(json.loads, (tmp_path / "out" / "teardown.jsonl").read_text().splitlines())}
    assert teardown["device"]["optimizer_state_entries_after_fit"] == 0, tail
    assert teardown["device"]["optimizer_state_devices_closed"] == ["cpu"]
    assert teardown["lightning"]["optimizer_state_entries_after_fit"] > 0
    assert teardown["lightning"]["optimizer_state_devices_after_fit"] == ["cpu"]
    assert {x["policy_device_after_fit"] for x in teardown.values()} == {"cpu"}
    contexts = [json.loads(x) for x in (tmp_path / "out" / "cuda_context.jsonl").read_text().splitlines()]
    assert [c["mode"] for c in contexts] == ["nvml", "cuda"], tail
    assert all(c["local_rank"] == "1" and c["cuda_initialized"] is False for c in contexts)
    job = OmegaConf.load(tmp_path / "out" / "preflight_card_job.yaml")
    assert (job.trainer.strategy, job.trainer.devices, job.model.name) == ("fsdp", 1, "qwen3_8b")
