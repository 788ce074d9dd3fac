"""A stop signal that reaches one rank of a data-parallel job stops every rank after the same optimiser step.

SLURM may signal one task of a job, or the tasks at different moments; a rank that acted on its own signal alone would
checkpoint (a collective) while the others went on to the next step's collectives, and the job would hang until the
process group's watchdog. The signal is delivered from inside rank 1 at the end of its first optimiser step
(``GRAIL_EXP_FAULT=term_at_step:1:rank1``, grail_exp/faults.py), never raced. Judged by what rank 0 wrote and its exit
code (a gloo worker may abort after finishing).
"""

from __future__ import annotations

import re

import pytest

from grail_exp import faults
from grail_exp.checkpoint import complete_checkpoints, load_rank_state, load_training_state
from helpers.scripted_run import run_scripted

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)


@pytest.mark.slow  # two 2-rank runs: 124 s on 2 cores shared with other jobs
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, pinned_model_dir, monkeypatch):
    """Rank 1 alone gets SIGTERM after step 1 of 2: both ranks checkpoint step 1 together and stop with the exit code
    of a single-process SIGTERM (143); ``resume=auto`` then trains step 2 from that checkpoint. Bounded by
    ``HANG_TIMEOUT_S`` (``run_scripted``): before the ranks agreed on the stop, this run hung."""
    run_dir = tmp_path / "run"
    two_ranks = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2"]
    monkeypatch.setenv(faults.ENV, "term_at_step:1:rank1")
    out = run_scripted(run_dir, pinned_model_dir, two_ranks)
    log = out.stdout + out.stderr
    fired = re.findall(r"GRAIL_EXP_FAULT: term_at_step at step (\d+) of \w+ on rank (\d+)", log)
    assert fired == [("1", "1")], log[-3000:]
    assert log.count("SIGTERM received") == 1, log[-3000:]  # the signal reached rank 1 only
    assert out.returncode == 143, log[-3000:]  # rank 0, which got no signal, stopped as if it had
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("preempted at step")]  # rank 0, after the same step
    assert line.startswith("preempted at step 1 (SIGTERM on another rank): checkpoint "), log[-3000:]
    assert "resume=auto" in line
    ckpts = complete_checkpoints(run_dir / "checkpoints")
    assert [c.name for c in ckpts] == ["step-1"], log[-3000:]  # one checkpoint, and no step 2 on rank 0
    state = load_training_state(ckpts[0])
    assert state["step"] == 1 and state["world_size"] == 2
    assert all("rng" in load_rank_state(ckpts[0], r) for r in (0, 1))  # each rank wrote its own part

    monkeypatch.delenv(faults.ENV)
    resumed = run_scripted(run_dir, pinned_model_dir, [*two_ranks, "resume=auto"])
    log = resumed.stdout + resumed.stderr
    assert "continuing at rollout batch 2" in log, log[-3000:]
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")] == ["step-1", "step-2"], log[-3000:]
    assert load_training_state(run_dir / "checkpoints" / "step-2")["step"] == 2
