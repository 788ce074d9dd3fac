"""A checkpoint write that fails on one rank fails it on every rank, at once, with one line (2 gloo ranks).

Rank 1 raises a ``RuntimeError`` — not an ``OSError``, the only failure the ranks used to agree on — inside its own part
of step 1's checkpoint (``GRAIL_EXP_FAULT=raise_in_checkpoint:1:rank1``, grail_exp/faults.py): injected at a known
point, never raced. Before, rank 1 left the checkpoint alone and rank 0 waited for it in the next collective until the
process group's timeout (or until gloo noticed the dead peer); now both ranks meet at the checkpoint's agreement point
and raise the same ``CheckpointError``, which names rank 1 and its error.

The process group's timeout is set to 600 s: a run that waited for it would still end inside the test's hang guard
(``HANG_TIMEOUT_S``), but without the agreed line, which is what the test asserts — rank 0 can only know rank 1's error
message through the agreement. No timing is asserted.
"""

from __future__ import annotations

import re

import pytest

from grail_exp import faults
from grail_exp.checkpoint import complete_checkpoints
from helpers.scripted_run import run_scripted

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)


def test_a_rank_that_raises_in_its_checkpoint_write_fails_every_rank_with_one_line(tmp_path, pinned_model_dir,
                                                                                    monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "raise_in_checkpoint:1:rank1")
    out = run_scripted(run_dir, pinned_model_dir, ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                                                   "trainer.max_steps=2", "trainer.checkpoint_every=1",
                                                   "trainer.dist_timeout_s=600"])
    log = out.stdout + out.stderr
    fired = re.findall(r"GRAIL_EXP_FAULT: raise_in_checkpoint at step (\d+) on rank (\d+)", log)
    assert fired == [("1", "1")], log[-4000:]  # injected once, on rank 1 only
    agreed = [line for line in out.stderr.splitlines() if line.startswith("error: checkpoint ")]
    # rank 0's line (rank 1's too, unless Lightning's launcher ended it first: it stops its children when rank 0 fails)
    assert agreed, log[-4000:]
    for line in agreed:
        assert re.fullmatch(r"error: checkpoint \S+/checkpoints/step-1 was not written \(rank 1: InjectedFault: "
                            r"GRAIL_EXP_FAULT raise_in_checkpoint at step 1 on rank 1\); the previous complete "
                            r"checkpoint is intact", line), line
    assert out.returncode == 2, log[-4000:]  # a CheckpointError is a user-facing error: exit 2, not a hang's
    assert "Traceback" in log  # rank 1 logged where its unexpected error came from
    assert not complete_checkpoints(run_dir / "checkpoints") and not list((run_dir / "checkpoints").glob("*.tmp-*"))
