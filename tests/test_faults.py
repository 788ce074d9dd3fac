"""Which call fires which injected fault (grail_exp/faults.py), with the signals caught instead of sent. The recovery
they drive is tested end to end where each fault is used (test_checkpoint, test_evaluate, test_tune,
test_real_model_study, test_rewards)."""

from __future__ import annotations

import signal

import pytest

from grail_exp import faults


@pytest.fixture
def fired(monkeypatch):
    """Every signal a fault would send this process, in order ("KILL" for a SIGKILL after the log flush)."""
    out = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: out.append(signal.Signals(sig).name))
    monkeypatch.setattr(faults, "_sigkill", lambda: out.append("KILL"))
    return out


def test_nothing_fires_without_the_variable(monkeypatch, fired):
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setattr(faults, "_chunks_put", 0)
    for step in range(3):
        faults.term_at_step(step, "grail")
        faults.kill_after_step(step, "grail")
        faults.kill_eval_after_chunks()
        faults.stall_checkpoint(step)
    faults.tune_kill("trial_started", 0)
    assert fired == []


def test_step_faults_fire_at_their_step_and_scheme_only(monkeypatch, fired):
    monkeypatch.setenv(faults.ENV, "term_at_step:2:grail")
    for step, scheme in [(1, "grail"), (2, "grpo"), (3, "grail")]:
        faults.term_at_step(step, scheme)
    faults.kill_after_step(2, "grail")  # another fault's name
    assert fired == []
    faults.term_at_step(2, "grail")
    assert fired == ["SIGTERM"]
    monkeypatch.setenv(faults.ENV, "kill_after_step:1")  # no scheme: any job
    faults.term_at_step(1, "grpo")
    faults.kill_after_step(1, "grpo")
    assert fired == ["SIGTERM", "KILL"]


def test_step_faults_can_name_one_rank(monkeypatch, fired):
    """``:rank<R>`` fires on data-parallel rank R only, with or without a scheme before it."""
    monkeypatch.setenv(faults.ENV, "term_at_step:1:rank1")
    faults.term_at_step(1, "grpo", 0)
    faults.term_at_step(2, "grpo", 1)
    assert fired == []
    faults.term_at_step(1, "grpo", 1)
    assert fired == ["SIGTERM"]
    monkeypatch.setenv(faults.ENV, "kill_after_step:2:grail:rank0")
    faults.kill_after_step(2, "grpo", 0)  # another scheme
    faults.kill_after_step(2, "grail", 1)  # another rank
    faults.kill_after_step(2, "grail", 0)
    assert fired == ["SIGTERM", "KILL"]


def test_the_evaluation_fault_counts_cached_chunks(monkeypatch, fired):
    monkeypatch.setenv(faults.ENV, "kill_eval_after_chunks:3")
    monkeypatch.setattr(faults, "_chunks_put", 0)
    faults.kill_eval_after_chunks()
    faults.kill_eval_after_chunks()
    assert fired == []
    faults.kill_eval_after_chunks()
    assert fired == ["KILL"]


def test_the_tune_fault_matches_point_then_trial_number_or_state(monkeypatch, fired):
    monkeypatch.setenv(faults.ENV, "tune_kill:run_ended:PRUNED")
    faults.tune_kill("trial_started", 0)
    faults.tune_kill("run_ended", 0, "FAIL")
    assert fired == []
    faults.tune_kill("run_ended", 0, "PRUNED")
    monkeypatch.setenv(faults.ENV, "tune_kill:reported:4")
    faults.tune_kill("reported", 3)
    faults.tune_kill("reported", 4)
    monkeypatch.setenv(faults.ENV, "tune_kill:parent_created")  # no trial or state: the first time the point passes
    faults.tune_kill("parent_created", -1)
    assert fired == ["KILL", "KILL", "KILL"]


def test_the_grading_hooks_only_react_to_their_markers():
    assert faults.grading_answer("42") is False
    assert faults.grading_answer(faults.GRADING_SLEEP + "0") is True  # slept 0 s: reported graded, wrong
