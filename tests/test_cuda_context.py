"""The plan's free-memory question opens no CUDA context, and asks the rank's own device (grail_exp/memory/nvml.py).

Under ``srun`` (one task per GPU) ``LOCAL_RANK`` was exported only when the job built its parts, after ``validate()``
had asked ``torch.cuda.mem_get_info(LOCAL_RANK or 0)``: every task opened a context on GPU 0 and planned against its
free memory; the preflight's launching process did the same. NVML stands in here as a fake ``pynvml`` module (the
boundary: what the real one would answer), ``torch.cuda`` as four visible devices whose ``mem_get_info`` must not be
called."""

from __future__ import annotations

import importlib.abc
import sys
import types

import pytest
import torch

GiB = 2**30


def _fake_nvml(calls: list) -> types.ModuleType:
    """pynvml's calls the planner makes, answering 100 GiB free of 140 GiB for every device, each call recorded."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: calls.append("init")
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetHandleByIndex = lambda i: calls.append(("handle", i)) or f"h{i}"
    m.nvmlDeviceGetMemoryInfo = lambda h: calls.append(("memory", h)) or types.SimpleNamespace(
        free=100 * GiB, total=140 * GiB, used=40 * GiB)
    return m


@pytest.fixture
def four_gpus_under_srun(monkeypatch):
    """Task 1 of 4 of an srun step (SLURM_LOCALID=1, no LOCAL_RANK yet), four CUDA devices visible; a CUDA context
    (``mem_get_info``) is recorded."""
    contexts = []
    for var in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "RANK"):
        monkeypatch.setenv(var, "")  # recorded, so that what the code under test exports is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda i=None: contexts.append(i) or (50 * GiB, 140 * GiB))
    return contexts


def test_the_plan_asks_nvml_for_the_ranks_own_device(four_gpus_under_srun, monkeypatch, compose_cfg):
    from grail_exp.memory.plan import device_capacity

    calls: list = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(calls))
    cfg = compose_cfg(["trainer=gpu"])
    free, total, source = device_capacity(cfg)
    assert (free, total) == (100 * GiB, 140 * GiB)
    assert ("handle", 1) in calls and calls[-1] == "shutdown", calls
    assert four_gpus_under_srun == []  # no CUDA context anywhere
    assert source.startswith("NVML, cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")  # CUDA's device 1 is the node's device 5
    calls.clear()
    device_capacity(cfg)
    assert ("handle", 5) in calls and four_gpus_under_srun == []


def test_without_nvidia_ml_py_the_plan_asks_cuda_on_the_ranks_own_device(four_gpus_under_srun, monkeypatch,
                                                                        compose_cfg):
    from grail_exp.memory.plan import device_capacity

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    free, total, source = device_capacity(compose_cfg(["trainer=gpu"]))
    assert (free, total) == (50 * GiB, 140 * GiB) and four_gpus_under_srun == [1]
    assert "nvidia-ml-py is not installed" in source and "CUDA context on device 1" in source


class _ImportRecorder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.asked = []

    def find_spec(self, name, path=None, target=None):
        if name == "pynvml":
            self.asked.append(name)
        return None


def test_a_cpu_run_never_imports_nvml(monkeypatch, compose_cfg):
    from grail_exp.memory.plan import device_capacity

    recorder = _ImportRecorder()
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    device_capacity(compose_cfg([]))
    assert recorder.asked == []


def test_the_job_exports_the_local_rank_before_it_validates(four_gpus_under_srun, monkeypatch, compose_cfg):
    """``run`` (what ``python -m grail_exp.run`` calls): under srun, ``LOCAL_RANK`` is the task's local id by the time
    ``validate`` plans against a device."""
    from grail_exp import job

    seen = {}
    monkeypatch.setattr(job, "validate", lambda cfg: seen.setdefault("LOCAL_RANK", __import__("os").environ.get(
        "LOCAL_RANK")))
    monkeypatch.setattr(job, "train", lambda cfg, on_eval=None: {})
    job.run(compose_cfg(["optimized_metric=null"]))
    assert seen == {"LOCAL_RANK": "1"}


def test_the_preflight_exports_the_local_rank_before_it_plans(four_gpus_under_srun, monkeypatch, tmp_path):
    import os

    import grail_exp.preflight.rehearsal as rehearsal
    from grail_exp.preflight.cli import main

    class Stop(Exception):
        pass

    def record(*a, **k):
        raise Stop(os.environ.get("LOCAL_RANK"))

    monkeypatch.setattr(rehearsal, "Rehearsal", record)
    with pytest.raises(Stop, match="^1$"):
        main([f"preflight.dir={tmp_path}/pf"])
