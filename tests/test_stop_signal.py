"""A stop signal is one decision for all ranks: the handler only records it (``job.py:stop_on_signal``), and
the ranks agree on it at one point of every optimiser step (``GRPOModule._after_step``). The 2-rank run where one rank
alone is signalled is tests/e2e/test_stop_on_one_rank.py."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from grail_exp.errors import Preempted
from grail_exp import world
from grail_exp.training.module import GRPOModule


def test_the_signal_is_recorded_and_lightning_installs_no_handler_of_its_own():
    """Lightning's SIGTERM handler broadcasts from inside the handler (a collective on the signalled rank alone) and
    leaves a flag that ends the fit with exit 0 and no checkpoint: under ``stop_on_signal`` it is never installed
    (the fit's registration, called here as ``trainer.fit`` does, installs nothing) and the signal only sets the
    module's request."""
    import lightning as L

    from grail_exp.job import stop_on_signal

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = SimpleNamespace(stop_requested=False)
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signal(module, trainer):
        ours = signal.getsignal(signal.SIGTERM)
        trainer._signal_connector.register_signal_handlers()  # what the fit does before its first batch
        assert signal.getsignal(signal.SIGTERM) is ours
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes of this thread, at the latest here
        assert module.stop_requested and trainer.received_sigterm is False
    assert signal.getsignal(signal.SIGTERM) is before


def _module(events: list, stop_requested: bool):
    """What ``_after_step`` touches of a module, every call recorded in ``events``: no evaluation, checkpoints only
    on a stop (``checkpoint_every=0``), a round of one optimiser step."""
    cfg = OmegaConf.create({"trainer": {"log_every": 1, "max_steps": 5, "eval_every": 0, "checkpoint_every": 0,
                                        "save_weights_only_every": 0}, "advantage": {"name": "grpo"}})
    quiet = SimpleNamespace(progress_line=lambda *a: None, log_sample_table=lambda *a: None,
                            log_weight_table=lambda *a: None)
    return SimpleNamespace(
        cfg=cfg, rank=0, stop_requested=stop_requested, evaluate_fn=None, weights_fn=None, records=quiet,
        rollout=SimpleNamespace(verifier=SimpleNamespace(counters={}), samples=[]),
        update=SimpleNamespace(steps_per_rollout=1), tracker=SimpleNamespace(log_metrics=lambda *a, **k: None),
        log_dict=lambda *a, **k: None, checkpoint_fn=lambda position: events.append(("checkpoint", position["round"])))


def _after_step(module, step: int = 2) -> None:
    GRPOModule._after_step(module, step, {"loss": 0.5}, None, {"reward/mean": 0.25}, round_index=step - 1, index=0)


@pytest.mark.parametrize("here, elsewhere", [(False, True), (True, False), (True, True)])
def test_every_rank_checkpoints_and_stops_when_any_rank_asked(monkeypatch, here, elsewhere):
    """The request is reduced over the ranks before the checkpoint decision (the other rank emulated through
    ``world.any_true``): this rank checkpoints the step and stops whether it or another rank got the signal."""
    events: list = []
    monkeypatch.setattr(world, "any_true", lambda flag: events.append(("agree", flag)) or flag or elsewhere)
    module = _module(events, here)
    with pytest.raises(Preempted, match="after step 2") as stopped:
        _after_step(module)
    assert events == [("agree", here), ("checkpoint", 2)]  # agreed first; then the checkpoint of round 2's end
    assert ("on another rank" in str(stopped.value)) is not here


def test_no_request_anywhere_trains_on_and_still_agrees_every_step(monkeypatch):
    """Without a request on any rank the step ends normally, and the agreement is still made (one collective per step,
    on every rank: a rank that skipped it would pair its next collective with another rank's agreement)."""
    events: list = []
    monkeypatch.setattr(world, "any_true", lambda flag: events.append(("agree", flag)) or flag)
    module = _module(events, False)
    for step in (1, 2, 3):
        _after_step(module, step)
    assert events == [("agree", False)] * 3
