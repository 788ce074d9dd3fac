"""Every stop stops (docs/reliability.md, "Every stop, by signal and phase"): a stop signal before the first optimiser
step ends the job in seconds, Ctrl-C during training takes the agreed path and resumes bit for bit, a second one ends
at once, a world that cannot form fails in bounded time with one line, and children go with their parent, SIGKILL
included.

Every fault is placed deterministically: a rank at the rendezvous of a world that cannot form writes a ready file
(``GRAIL_EXP_FAULT=ready_at:rendezvous:<dir>``) and waits there by itself; SIGINT at the end of optimiser step N comes
from inside the run (``int_at_step:<N>``); the small children of ``helpers.stop_child`` write their ready files at the
point the test acts on. The bounds below are the issue's promises (an exit within 15 s of the signal, no process left
a few seconds after its parent died), each far from what the code takes (under a second, measured on a loaded 2-core
machine) and far below what the code before this change took (the process group's timeout: 30 minutes).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grail_exp import faults
from grail_exp.checkpoint import complete_checkpoints, load_training_state
from helpers.scripted_run import run_scripted
from helpers.states import states_equal
from helpers.stop_child import read_pid
from helpers.tolerances import HANG_TIMEOUT_S

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
EXIT_BOUND_S = 15  # the bound on a stop before training: "exit <= 15 s"
GONE_BOUND_S = 10  # "no process left after a few seconds"


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", **extra)


def _run_args(run_dir: Path, model_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "grail_exp.run", "logger=none", "rollout.engine=helpers.fakes:ScriptedEngine",
            f"model.name_or_path={model_dir}", "trainer.prompts_per_step=4", "rollout.num_generations=4",
            "trainer.micro_batch_size=8", "trainer.eval_before_training=false", "trainer.eval_at_end=false",
            "reward.num_workers=0", f"paths.root_dir={run_dir.parent}", f"hydra.run.dir={run_dir}", *extra]


def _wait_for(paths: list[Path], proc: subprocess.Popen) -> None:
    """Until every file exists (the processes are at their point), while ``proc`` lives; bounded against a hang."""
    deadline = time.monotonic() + HANG_TIMEOUT_S
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"never appeared: {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by whoever inherited it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _left_after(pids: list[int], bound_s: float) -> list[int]:
    """The pids still running ``bound_s`` seconds from now, looking every 0.1 s (returns as soon as none is)."""
    end = time.monotonic() + bound_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)


def test_sigterm_during_the_rendezvous_of_a_world_that_cannot_form_ends_every_rank_in_seconds(tmp_path,
                                                                                              pinned_model_dir):
    """The embedded command with ``trainer.num_nodes=2`` on one machine: ranks 0 and 1 start and wait for ranks 2 and
    3, which never come. SIGTERM to the launching process (rank 0): it exits 143 with one line naming the rendezvous,
    and rank 1, which Lightning started, goes with it. Before: both waited out the process group's timeout (30 min),
    ignoring SIGTERM."""
    ready = tmp_path / "ready"
    ready.mkdir()
    args = _run_args(tmp_path / "run", pinned_model_dir, ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                                                          "trainer.num_nodes=2"])
    proc = subprocess.Popen(args, env=_env(**{faults.ENV: f"ready_at:rendezvous:{ready}"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ranks = [ready / "rendezvous.rank0", ready / "rendezvous.rank1"]
    try:
        _wait_for(ranks, proc)
        pids = [read_pid(p) for p in ranks]
        assert pids[0] == proc.pid
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=EXIT_BOUND_S)
        assert proc.returncode == 143, err[-3000:]
        lines = [x for x in err.splitlines() if "stopped by SIGTERM before training started" in x]
        assert len(lines) == 1 and "rendezvous" in lines[0], err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert _left_after(pids[1:], GONE_BOUND_S) == []  # rank 1 went with its launcher
    finally:
        _kill_all([proc.pid] + [read_pid(p) for p in ranks if p.exists()])


def test_a_world_that_cannot_form_fails_at_the_rendezvous_timeout_naming_the_keys(tmp_path, pinned_model_dir):
    """``trainer.rendezvous_timeout_s=2`` and a second node that never starts: one line, naming who arrived (rank 0 on
    node 0), who did not (node 1) and ``trainer.num_nodes``; exit 2 (a user error). Before: the process group's
    timeout (30 minutes; 44 for an 8B model) and no line."""
    args = _run_args(tmp_path / "run", pinned_model_dir, ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1",
                                                          "trainer.num_nodes=2", "trainer.rendezvous_timeout_s=2"])
    out = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error: ")]
    assert "did not form within 2 s (trainer.rendezvous_timeout_s)" in line, line
    assert "1 of 2 ranks arrived (node 0" in line and "rank 0)" in line and "missing: node 1 rank 1" in line, line
    assert "trainer.num_nodes=2" in line and "trainer.devices=1" in line and "MASTER_ADDR" in line, line


def test_sigint_at_step_n_checkpoints_step_n_and_resume_gives_the_uninterrupted_run_bit_for_bit(tmp_path,
                                                                                                 pinned_model_dir,
                                                                                                 monkeypatch):
    """Ctrl-C (SIGINT, delivered inside the run at the end of step 1 of 2) takes the agreed path: step 1's checkpoint,
    one line (interrupted at step 1, the checkpoint's path, resume=auto), exit 130; ``resume=auto`` then trains step 2
    to the weights, optimiser and scheduler state of a run never interrupted (OAR-G: its noise stream is restored
    too). Before: Lightning's KeyboardInterrupt ended the fit with exit 1, no checkpoint, no line."""
    common = ["advantage=oar_g", "trainer.max_steps=2", "reward.num_workers=0"]  # grading in process: no pool to start
    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    assert run_scripted(straight, pinned_model_dir, common).returncode == 0
    monkeypatch.setenv(faults.ENV, "int_at_step:1")
    stopped = run_scripted(split, pinned_model_dir, common)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    ckpts = complete_checkpoints(split / "checkpoints")
    assert [c.name for c in ckpts] == ["step-1"]
    (line,) = [x for x in stopped.stderr.splitlines() if x.startswith("interrupted at step")]
    assert line.startswith("interrupted at step 1 (SIGINT): checkpoint ") and str(ckpts[0]) in line, line
    assert f"hydra.run.dir={split} resume=auto" in line, line
    monkeypatch.delenv(faults.ENV)
    resumed = run_scripted(split, pinned_model_dir, [*common, "resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = straight / "checkpoints" / "step-2", split / "checkpoints" / "step-2"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = load_training_state(a), load_training_state(b)
    assert sa["step"] == sb["step"] == 2
    for part in ("optimizer", "scheduler"):
        assert states_equal(sa[part], sb[part]), part
    start = load_file(Path(pinned_model_dir) / "model.safetensors")
    assert any(not torch.equal(start[k], wa[k]) for k in wa)  # the steps really trained




def test_sigkill_of_the_preflight_leaves_no_rank_behind(tmp_path, pinned_model_dir):
    """The preflight's rehearsal with its ranks 0 and 1 held at the rendezvous (``hold_at``: the preflight rehearses
    one node, so its world would form): SIGKILL to the preflight (nothing of it runs after) leaves no rank: the run
    dies with the preflight (parent-death signal), rank 1 with the run. Before: both ranks ran on, orphaned, ignoring
    SIGTERM and SIGINT."""
    ready = tmp_path / "ready"
    ready.mkdir()
    args = [sys.executable, "-m", "grail_exp.preflight", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
            "logger=none", "rollout.engine=helpers.fakes:ScriptedEngine",
            f"model.name_or_path={pinned_model_dir}", "trainer.prompts_per_step=4", "rollout.num_generations=4",
            "trainer.micro_batch_size=8", "reward.num_workers=0", f"paths.root_dir={tmp_path}",
            f"preflight.dir={tmp_path / 'pf'}"]
    proc = subprocess.Popen(args, env=_env(**{faults.ENV: f"hold_at:rendezvous:{ready}"}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    ranks = [ready / "rendezvous.rank0", ready / "rendezvous.rank1"]
    try:
        _wait_for(ranks, proc)
        pids = [read_pid(p) for p in ranks]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=HANG_TIMEOUT_S)
        assert _left_after(pids, GONE_BOUND_S) == []
    finally:
        _kill_all([proc.pid] + [read_pid(p) for p in ranks if p.exists()])


def _child(mode: str, folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "helpers.stop_child", mode, str(folder)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_stop_signal_during_training_ends_the_process_at_once(tmp_path):
    """The first SIGINT in training is a request (recorded for the step's agreement); the second ends the process at
    once, exit 130, with one line, while its main thread is busy elsewhere."""
    proc = _child("twice", tmp_path)
    out, err = proc.communicate(timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 130, err[-3000:]
    assert (tmp_path / "requests").read_text().split()[0] == str(int(signal.SIGINT))
    assert len([x for x in err.splitlines() if "SIGINT: ending at once (a second stop signal)" in x]) == 1, err


def test_a_busy_grading_worker_dies_with_its_killed_parent(tmp_path):
    """A worker hung in a grading job never reads its pipe's end: SIGKILL of the process that owns the pool leaves it
    running, unless it asked for a parent-death signal."""
    proc = _child("pool", tmp_path)
    try:
        _wait_for([tmp_path / "worker.ready"], proc)
        worker = read_pid(tmp_path / "worker.ready")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_TIMEOUT_S)
        assert _left_after([worker], GONE_BOUND_S) == []
    finally:
        _kill_all([proc.pid] + ([read_pid(tmp_path / "worker.ready")] if (tmp_path / "worker.ready").exists() else []))


def test_the_reaper_ends_what_a_library_started_when_its_parent_is_killed(tmp_path):
    """A child started with no parent-death arrangement (as vLLM starts its engine core) outlives a SIGKILLed parent;
    the reaper beside it ends it, and then itself."""
    proc = _child("reaper", tmp_path)
    files = [tmp_path / "child.ready", tmp_path / "reaper.ready"]
    try:
        _wait_for(files, proc)
        child, reaper = (read_pid(f) for f in files)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_TIMEOUT_S)
        assert _left_after([child, reaper], GONE_BOUND_S) == []
    finally:
        _kill_all([proc.pid] + [read_pid(f) for f in files if f.exists()])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_vllms_own_processes_die_with_their_killed_parent(tmp_path):
    """vLLM's engine out of process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``): its engine core and worker are vLLM's
    processes, on which no parent-death signal can be set; SIGKILL of the process that built the engine leaves none of
    them (the reaper). Without it vLLM 0.32's engine core and worker ran on, re-parented to init."""
    proc = subprocess.Popen([sys.executable, "-m", "helpers.stop_child", "vllm", str(tmp_path)],
                            env=_env(VLLM_CPU_KVCACHE_SPACE="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ready = tmp_path / "engine.ready"
    try:
        _wait_for([ready], proc)
        started = [int(p) for p in ready.read_text().split()]
        assert started, "the engine started no process of its own: not out of process"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=HANG_TIMEOUT_S)
        assert _left_after(started, GONE_BOUND_S) == []
    finally:
        _kill_all([proc.pid] + ([int(p) for p in ready.read_text().split()] if ready.exists() else []))
