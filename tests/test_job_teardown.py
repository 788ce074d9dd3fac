"""The end of a training job on every path: the rollout engine is closed and the process group destroyed, whether the
fit finished or raised (a job left with a live NCCL communicator can abort at interpreter exit, and SLURM then records
a finished job as FAILED). ``train`` runs with its parts replaced by recorders; the process group is a real one-rank
gloo group, created where Lightning creates it (inside the fit)."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist


class _Engine:
    def __init__(self, events: list):
        self.events = events

    def close(self):
        self.events.append("engine closed")


@pytest.fixture
def job_with_recorders(monkeypatch, tmp_path, compose_cfg):
    """``train(cfg)`` with recording parts; returns (cfg, events, make_fit) where make_fit(fail) installs a fit that
    creates the process group and the engine (as Lightning and the module's setup do), then returns or raises."""
    import grail_exp.tracking as tracking
    import grail_exp.training.module as module_mod
    from grail_exp import job

    events: list = []

    class Tracker:
        def __getattr__(self, name):
            return lambda *a, **k: None

        def end(self, status):
            events.append(f"tracker {status}")

    class Module:
        def __init__(self, *a, **k):
            self.rollout = types.SimpleNamespace(engine=None)

    verifier = types.SimpleNamespace(close=lambda: events.append("verifier closed"))
    parts = types.SimpleNamespace(policy=None, tokenizer=None, scheme=None, source=None, verifier=verifier,
                                  ref_model=None, terms=[], engine_factory=None, start_sha256=None)
    monkeypatch.setattr(tracking, "build_tracker", lambda *a, **k: Tracker())
    monkeypatch.setattr(job, "_resume_point", lambda cfg: (None, None))
    monkeypatch.setattr(job, "build_parts", lambda *a, **k: parts)
    evaluator = types.SimpleNamespace(tables={})
    monkeypatch.setattr(job, "Evaluator", lambda *a, **k: evaluator)
    monkeypatch.setattr(job, "Saver", lambda *a, **k: types.SimpleNamespace(save_start=lambda module: None))
    monkeypatch.setattr(job, "finish", lambda *a, **k: events.append("finished"))
    monkeypatch.setattr(module_mod, "RLVRModule", Module)

    def make_fit(fail: bool):
        def fit(cfg, module, state):
            dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
            module.rollout.engine = _Engine(events)
            if fail:
                raise RuntimeError("the fit failed")

        monkeypatch.setattr(job, "fit", fit)

    cfg = compose_cfg(["trainer.eval_before_training=false"])
    yield cfg, events, make_fit
    if dist.is_initialized():  # the old code left it: do not hand it to the next test
        dist.destroy_process_group()


def test_a_finished_job_closes_its_engine_and_destroys_the_process_group(job_with_recorders):
    from grail_exp.job import train

    cfg, events, make_fit = job_with_recorders
    make_fit(fail=False)
    train(cfg)
    assert not dist.is_initialized()
    assert events == ["finished", "verifier closed", "tracker FINISHED", "engine closed"]


def test_a_failed_job_closes_its_engine_and_destroys_the_process_group(job_with_recorders):
    from grail_exp.job import train

    cfg, events, make_fit = job_with_recorders
    make_fit(fail=True)
    with pytest.raises(RuntimeError, match="the fit failed"):
        train(cfg)
    assert not dist.is_initialized()
    assert events == ["verifier closed", "tracker FAILED", "engine closed"]


def test_teardown_goes_on_when_the_engine_fails_to_close(tmp_path, caplog):
    """A failing engine shutdown is logged; the process group is destroyed all the same. Without a module (the job
    failed before building it) only the group is destroyed."""
    from grail_exp.job import teardown

    def broken():
        raise RuntimeError("engine core already gone")

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        teardown(types.SimpleNamespace(rollout=types.SimpleNamespace(engine=types.SimpleNamespace(close=broken))))
        assert not dist.is_initialized()
        assert "closing the rollout engine failed: RuntimeError: engine core already gone" in caplog.text
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1)
        teardown(None)
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
