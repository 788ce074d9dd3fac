"""Small child processes for the stop tests (tests/e2e/test_stops.py), run as ``python -m helpers.stop_child <mode>
<dir>`` with ``PYTHONPATH=tests``. Each writes a ready file into ``<dir>`` once it is at the point the test acts on,
then waits there; the test reads the pids it needs from the files (``read_pid``).

- ``twice``: the job's stop signals in the training phase (a request is recorded in ``<dir>/requests``), then SIGINT
  to itself twice: the second one ends the process at once (exit 130), whatever the main thread is doing;
- ``pool``: a grading pool whose one worker is busy with a job that writes ``worker.ready`` (its pid) and sleeps;
  the test SIGKILLs this process: the worker must go too;
- ``reaper``: a child it started without any parent-death arrangement (``sleep``), as a library would, and a
  ``preemption.Reaper``; the test SIGKILLs this process: the reaper must end the child;
- ``vllm``: a vLLM engine out of process (``engine.ready`` lists the processes vLLM started); the test SIGKILLs this
  process: they must go too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 600  # every mode waits to be ended by the test; this only bounds a child whose test died


def write_pid(path: Path, pid: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(pid))
    os.replace(tmp, path)


def read_pid(path: Path) -> int:
    return int(path.read_text())


def mark_and_sleep(folder: str) -> None:
    """A grading job: mark the worker busy (its pid), then sleep as a hung grader would."""
    write_pid(Path(folder) / "worker.ready", os.getpid())
    time.sleep(WAIT_S)


def twice(folder: Path) -> None:
    from grail_exp.preemption import StopSignals

    stops = StopSignals().install()
    stops.training(lambda signum: (folder / "requests").open("a").write(f"{signum}\n"))
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:  # the main thread busy in Python: only the watcher thread can end it now
        time.sleep(0.05)
    sys.exit(0)  # not ended: the test sees exit 0


def pool(folder: Path) -> None:
    import functools

    from grail_exp.grading.pool import WorkerPool

    workers = WorkerPool(functools.partial(mark_and_sleep, str(folder)), num_workers=1, hard_timeout_s=WAIT_S)
    workers.run([()])  # blocks: the one job sleeps until the test kills this process


def reaper(folder: Path) -> None:
    from grail_exp.preemption import Reaper

    child = subprocess.Popen(["sleep", str(WAIT_S)])
    watcher = Reaper()  # it has recorded the child before it returns
    write_pid(folder / "child.ready", child.pid)
    write_pid(folder / "reaper.ready", watcher.proc.pid)
    time.sleep(WAIT_S)


def vllm_engine(folder: Path) -> None:
    """vLLM's engine out of process (its engine core and worker: processes vLLM starts), on the embedded model."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from transformers import AutoTokenizer

    from grail_exp.preemption import own_descendants
    from grail_exp.rollout.vllm import VLLMRolloutEngine

    model = Path(__file__).resolve().parents[2] / "grail_exp" / "data" / "embedded" / "tiny"
    before = own_descendants()
    engine = VLLMRolloutEngine(str(model), AutoTokenizer.from_pretrained(model), max_model_len=256,
                               gpu_memory_utilization=0.05)
    started = own_descendants() - before - {engine._reaper.proc.pid}
    (folder / "engine.ready.tmp").write_text(" ".join(map(str, sorted(started))))
    os.replace(folder / "engine.ready.tmp", folder / "engine.ready")
    time.sleep(WAIT_S)


if __name__ == "__main__":
    mode, where = sys.argv[1], Path(sys.argv[2])
    {"twice": twice, "pool": pool, "reaper": reaper, "vllm": vllm_engine}[mode](where)
