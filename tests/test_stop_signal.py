"""A stop signal during training is one decision for all ranks: the handler only records it
(``job.TrainingHooks``), and the ranks agree on it at one point of every optimiser step
(``RLVRModule._after_step``); before training it ends the job at once (``preemption.StopSignals``). The 2-rank run
where one rank alone is signalled is tests/e2e/test_stop_on_one_rank.py; the stops that end processes,
tests/e2e/test_stops.py."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from grail_exp import world
from grail_exp.errors import Preempted, StoppedBySignal
from grail_exp.preemption import StopSignals, before_training_line, current, exit_code, set_stage
from grail_exp.training.module import RLVRModule
from helpers.tolerances import HANG_TIMEOUT_S


def test_in_training_a_signal_is_recorded_and_lightning_installs_no_handler_of_its_own():
    """Lightning's SIGTERM handler broadcasts from inside the handler (a collective on the signalled rank alone) and
    leaves a flag that ends the fit with exit 0 and no checkpoint; its Ctrl-C ends the fit with exit 1. Under
    ``stop_on_signal`` neither is installed (the fit's registration, called here as ``trainer.fit`` does, installs
    nothing) and, once the fit has started (the job's hooks' ``start``, as ``on_train_start`` calls it), SIGTERM and
    SIGINT only record the request the module reads at the end of a step."""
    import lightning as L

    from grail_exp.job import TrainingHooks, stop_on_signal

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for sig in (signal.SIGINT, signal.SIGTERM):  # one fit each: a second signal would end this process at once
        cfg = OmegaConf.create({"trainer": {"eval_before_training": False}})
        hooks, module = TrainingHooks(cfg, evaluator=None, saver=None, phases={}, state=None), SimpleNamespace()
        with stop_on_signal(trainer):
            ours = signal.getsignal(signal.SIGTERM)
            trainer._signal_connector.register_signal_handlers()  # what the fit does before its first batch
            assert signal.getsignal(signal.SIGTERM) == ours and signal.getsignal(signal.SIGINT) == ours
            assert hooks.stop_requested(module) == 0
            hooks.start(module)  # the fit has started: the first optimiser step may begin
            signal.raise_signal(sig)  # the handler runs before raise_signal returns
            assert hooks.stop_requested(module) == sig and trainer.received_sigterm is False
            _counted(sig)
        assert {s: signal.getsignal(s) for s in before} == before


def _counted(sig: int) -> None:
    """Wait until the watcher thread has counted ``sig`` (so that the uninstall that follows does not race it)."""
    end = time.monotonic() + HANG_TIMEOUT_S
    while current().received != [sig]:
        assert time.monotonic() < end and len(current().received) < 2
        time.sleep(0.01)


def test_before_training_a_stop_signal_ends_the_job_at_once():
    """Before the first optimiser step there is nothing to agree on or save: the signal raises ``StoppedBySignal``
    where the main thread is, naming what the job was doing, for the entry point's line and exit code."""
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN under a background job
    stops = StopSignals().install()
    try:
        set_stage("the rendezvous (waiting for every rank)")
        with pytest.raises(StoppedBySignal) as stopped:
            signal.raise_signal(signal.SIGINT)
        assert stopped.value.signum == signal.SIGINT and "rendezvous" in stopped.value.stage
        assert before_training_line(signal.SIGINT, stopped.value.stage) == (
            "stopped by SIGINT before training started (during the rendezvous (waiting for every rank)): nothing to "
            "save; exit 130")
    finally:
        stops.uninstall()
    assert current() is None and signal.getsignal(signal.SIGINT) is before


def test_exit_codes_are_the_shells():
    assert exit_code(signal.SIGTERM) == 143 and exit_code(signal.SIGINT) == 130


def _module(events: list, stop_signal: int):
    """What ``_after_step`` touches of a module, every call recorded in ``events``: no evaluation, checkpoints only
    on a stop (``checkpoint_every=0``), a round of one optimiser step."""
    cfg = OmegaConf.create({"trainer": {"log_every": 1, "max_steps": 5, "eval_every": 0, "checkpoint_every": 0,
                                        "save_weights_only_every": 0}, "advantage": {"name": "grpo"}})
    quiet = SimpleNamespace(progress_line=lambda *a: None, log_sample_table=lambda *a: None,
                            log_weight_table=lambda *a: None)
    hooks = SimpleNamespace(stop_requested=lambda module: stop_signal,
                            checkpoint=lambda module, position: events.append(("checkpoint", position["round"])))
    return SimpleNamespace(
        cfg=cfg, rank=0, hooks=hooks, records=quiet,
        rollout=SimpleNamespace(verifier=SimpleNamespace(counters={}), samples=[]),
        update=SimpleNamespace(steps_per_rollout=1), tracker=SimpleNamespace(log_metrics=lambda *a, **k: None),
        log_dict=lambda *a, **k: None)


def _after_step(module, step: int = 2) -> None:
    RLVRModule._after_step(module, step, {"loss": 0.5}, None, {"reward/mean": 0.25}, round_index=step - 1, index=0)


@pytest.mark.parametrize("here, elsewhere", [(0, signal.SIGTERM), (signal.SIGINT, 0), (signal.SIGINT, signal.SIGTERM)])
def test_every_rank_checkpoints_and_stops_when_any_rank_asked(monkeypatch, here, elsewhere):
    """The request is reduced over the ranks before the checkpoint decision (the other rank emulated through
    ``world.max_over_ranks``): this rank checkpoints the step and stops whether it or another rank got the signal,
    with the largest signal number asked (SIGTERM over SIGINT: one exit code on every rank)."""
    events: list = []
    monkeypatch.setattr(world, "max_over_ranks", lambda sig: events.append(("agree", sig)) or max(sig, elsewhere))
    module = _module(events, here)
    with pytest.raises(Preempted, match="after step 2") as stopped:
        _after_step(module)
    assert events == [("agree", here), ("checkpoint", 2)]  # agreed first; then the checkpoint of round 2's end
    assert stopped.value.signum == max(here, elsewhere) and stopped.value.step == 2
    assert stopped.value.here is bool(here) and ("on another rank" in str(stopped.value)) is not bool(here)


def test_no_request_anywhere_trains_on_and_still_agrees_every_step(monkeypatch):
    """Without a request on any rank the step ends normally, and the agreement is still made (one collective per step,
    on every rank: a rank that skipped it would pair its next collective with another rank's agreement)."""
    events: list = []
    monkeypatch.setattr(world, "max_over_ranks", lambda sig: events.append(("agree", sig)) or sig)
    module = _module(events, 0)
    for step in (1, 2, 3):
        _after_step(module, step)
    assert events == [("agree", 0)] * 3
