"""How a job stops: its stop signals by phase, the lifetime of the processes it starts, and handing a preempted
submitit job back to submitit for its requeue (docs/reliability.md, "Every stop, by signal and phase").

**Stop signals** (SIGTERM, SIGINT = Ctrl-C, and submitit's signal in its jobs). ``StopSignals`` is installed by
``job.train`` for the whole job; what a signal does depends on the phase the job is in:

- *starting* (model load, rendezvous, engine build, the evaluation before training): there is no step to agree on and
  nothing to save, so the job ends at once: the handler raises ``errors.StoppedBySignal`` in the main thread (the
  tracker and the engine are closed on the way out), the entry point prints one line and exits 128 + the signal
  (143 SIGTERM, 130 SIGINT). Should the main thread be stuck in native code (a collective whose peer is gone), the
  watcher thread ends the process ``STOP_GRACE_S`` after the signal;
- *training*: the request is recorded (``on_request``); the ranks agree on it at the end of the optimiser step
  (``RLVRModule._after_step``), every rank checkpoints that step and the job exits with the same codes;
- *closing* (after the last optimiser step: the final checkpoint and evaluation): recorded; the run finishes.

A second stop signal, in any phase, ends the process at once with one line (``os._exit`` from the watcher thread: the
main thread may be inside a collective and never run a Python handler). The watcher reads the signals from
``signal.set_wakeup_fd``, which the interpreter's C-level handler writes even while the main thread is blocked.

**Children go with their parent**, on every path, SIGKILL of the parent included (nothing of the parent runs then):

- a process whose parent is a grail_exp process asks the kernel for a parent-death signal (``die_with_parent``:
  ``prctl(PR_SET_PDEATHSIG)``, Linux): the ranks Lightning launches and the preflight's run (``DIE_WITH_PID``,
  ``follow_parent``), the grading workers (``grading/pool.py``);
- processes a library starts (vLLM's engine core and workers, when the engine runs out of process) cannot be asked:
  a ``Reaper``, a small process started beside them, watches its parent's pid and kills the processes its parent had
  started once the parent is gone.

Standard library only: the grading workers import this module.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from grail_exp.errors import StoppedBySignal

log = logging.getLogger(__name__)

# Seconds after a stop signal before the first optimiser step within which the job ends by itself (closing its tracker
# and engine); past them the watcher ends the process. The orderly way out takes about a second.
STOP_GRACE_S = 10.0
# A grail_exp process started with this variable ends with the process it names, its parent (``follow_parent``).
DIE_WITH_PID = "GRAIL_EXP_DIE_WITH_PID"


def submitit_signal() -> signal.Signals | None:
    """The signal submitit uses for timeouts and preemption, when this process is a submitit job; else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


def stop_signals() -> list[signal.Signals]:
    """Signals after which training checkpoints and stops: SIGTERM and SIGINT always, plus submitit's signal in its
    jobs."""
    extra = submitit_signal()
    base = [signal.SIGTERM, signal.SIGINT]
    return base + ([extra] if extra is not None and extra not in base else [])


def exit_code(signum: int) -> int:
    """The exit status of a job ended by ``signum``, as a shell reports a process a signal ended: 128 + its number
    (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def hand_back_to_submitit() -> bool:
    """After a checkpoint written on a stop signal: let submitit requeue this job (with ``resume=auto``).

    Raises submitit's signal again, now that training's handler is gone; submitit's handler then resubmits
    the job and exits this process (``SystemExit``), so this returns only outside submitit (False)."""
    sig = submitit_signal()
    if sig is None or not callable(signal.getsignal(sig)):
        return False
    log.warning("checkpoint written; asking submitit to requeue this job")
    signal.raise_signal(sig)
    return True


def with_resume_auto(overrides: list[str]) -> list[str]:
    """A job's overrides with any ``resume=...`` replaced by ``resume=auto`` (what a requeued job runs with)."""
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    return [o for o in overrides if key(o) != "resume"] + ["resume=auto"]


# ------------------------------------------------------------------------------------------------- stop signals
_current: StopSignals | None = None


def current() -> StopSignals | None:
    """The installed ``StopSignals`` of this process's job, or None."""
    return _current


def set_stage(stage: str) -> None:
    """What the job is doing before training (named in the line a stop signal prints then)."""
    if _current is not None:
        _current.stage = stage


def peer_stopped(signum: int) -> None:
    """A rank this process launched exited on a stop signal: before training, this process stops the same way
    (the rank may have been signalled alone; its launcher would otherwise wait for it at the rendezvous). After the
    first step the ranks agree on a stop themselves, so nothing is done then."""
    stops = _current
    if stops is not None and stops.phase == "starting" and not stops.received:
        os.kill(os.getpid(), signum)


class StopSignals:
    """The job's stop signals from its start to its end, by phase (the module docstring)."""

    def __init__(self):
        self.phase = "starting"  # starting -> training -> closing
        self.stage = "start-up"  # what the job does before training, for the line
        self.on_request: Callable[[int], None] | None = None  # training: records a request (the module's)
        self.received: list[int] = []  # every stop signal delivered, in order (counted by the watcher)
        self._handled = 0  # signals the main thread's handler has seen
        self.stopped_by = 0  # the signal that ended the job before training (its handler raised StoppedBySignal)
        self._previous: dict = {}
        self._fds: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ install / uninstall
    def install(self) -> StopSignals:
        """Take the stop signals (main thread only: elsewhere the job keeps the defaults, as Python allows)."""
        global _current
        if threading.current_thread() is not threading.main_thread():
            return self
        ours = stop_signals()
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._previous = {sig: signal.signal(sig, self._handler) for sig in ours}
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(r, {int(s) for s in ours}), daemon=True,
                                        name="stop-signal-watcher")
        self._thread.start()
        _current = self
        return self

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers (the job is over; the entry point prints its line)."""
        global _current
        if self._fds is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        r, w = self._fds
        self._fds = None
        os.close(w)  # the watcher reads EOF and returns
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(r)
        if _current is self:
            _current = None

    # ------------------------------------------------------------------ phases
    def training(self, on_request: Callable[[int], None]) -> None:
        """The first optimiser step may start: from here a stop is agreed at the end of a step."""
        self.on_request = on_request
        self.phase = "training"

    def closing(self) -> None:
        """The last optimiser step is done: the final checkpoint and evaluation run to their end."""
        self.phase = "closing"

    # ------------------------------------------------------------------ the main thread's handler
    def _handler(self, signum: int, frame) -> None:
        name = signal_name(signum)
        self._handled += 1
        if self._handled > 1:  # a second signal: the watcher thread ends the process
            return
        if self.phase == "starting":  # once: the way out (closing the tracker, the engine) is not interrupted again
            self.stopped_by = signum
            raise StoppedBySignal(signum, self.stage)
        elif self.phase == "training":
            log.warning("%s received: finishing the current optimiser step, then checkpointing (every rank); %s "
                        "again ends at once", name, name)
            if self.on_request is not None:
                self.on_request(signum)
        else:
            log.warning("%s received after the last optimiser step: the final checkpoint and evaluation finish "
                        "first; %s again ends at once", name, name)

    # ------------------------------------------------------------------ the watcher thread
    def _watch(self, fd: int, ours: set[int]) -> None:
        """Counts every stop signal as the C-level handler reports it; a second one ends the process at once, and so
        does the first one before training when the job has not ended ``STOP_GRACE_S`` later."""
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([fd], [], [], timeout)
            except (OSError, ValueError):  # the pipe was closed under us: uninstalled
                return
            if not ready:
                self._end_now(self.received[0], f"the job did not end within {STOP_GRACE_S:g} s of the signal "
                                                f"({self.stage})")
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum not in ours:
                    continue
                self.received.append(signum)
                if len(self.received) >= 2:
                    self._end_now(signum, "a second stop signal")
                if self.phase == "starting":
                    deadline = time.monotonic() + STOP_GRACE_S

    def _end_now(self, signum: int, why: str) -> None:
        """One line on stderr (a raw write: the main thread may hold the stream's lock), then exit 128 + the signal.
        The processes this one started go with it (their parent-death signal, the reaper)."""
        name = signal_name(signum)
        if self.phase == "training":
            what = "no checkpoint of the current step; resume=auto continues from the latest complete checkpoint"
        elif self.phase == "closing":
            what = "the final checkpoint or evaluation may be unfinished; resume=auto finishes them"
        else:
            what = "before training started: nothing to save"
        os.write(2, f"\n{name}: ending at once ({why}), {what}\n".encode(errors="replace"))
        os._exit(exit_code(signum))


def exit_now(code: int) -> None:
    """End a stopped job once its line is out: logs and streams flushed, then ``os._exit``. The job has closed what
    it owns (tracker, engine, grading workers, process group) on its way out; the interpreter's own finalisation would
    add seconds (measured: 2-6 s with torch and Lightning loaded on a busy 2-core machine) before this process's
    children, which die with it, are gone."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def before_training_line(signum: int, stage: str) -> str:
    """The line a job stopped before its first optimiser step prints."""
    return (f"stopped by {signal_name(signum)} before training started (during {stage}): nothing to save; "
            f"exit {exit_code(signum)}")


# --------------------------------------------------------------------------------------------- children's lifetime
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent ends (any way, SIGKILL included); if the parent has
    already gone (this process was re-parented before it asked), end now as ``sig`` would. The signal comes when the
    parent *thread* that started this process ends, so the parent must start it from a thread that lives as long as
    the parent (its main thread). False where prctl is not available (not Linux): nothing is asked."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:
        os._exit(exit_code(sig))
    return True


def started_by_parent() -> bool:
    """Whether this process was started with ``DIE_WITH_PID`` naming another process, its parent (the ranks
    Lightning launches, the preflight's run)."""
    pid = os.environ.get(DIE_WITH_PID, "")
    return pid.isdigit() and int(pid) != os.getpid()


def follow_parent() -> bool:
    """In a process ``started_by_parent``: die with that parent. True when this process is such a child."""
    if not started_by_parent():
        return False
    die_with_parent(int(os.environ[DIE_WITH_PID]))
    return True


def launcher_speaks() -> bool:
    """Whether this process is a rank that Lightning's launcher started beside itself (``started_by_parent``, local
    rank > 0): the launcher, in the same terminal or job, prints the line of a stop for the node."""
    return started_by_parent() and os.environ.get("LOCAL_RANK", "0") != "0"


def watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """A daemon thread that ends this process once ``parent_pid`` is no longer its parent: for a process whose parent
    started it from a thread that may end before the parent (where the parent-death signal would fire too early)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(exit_code(signal.SIGKILL))

    threading.Thread(target=watch, daemon=True, name="parent-watcher").start()


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every process (Linux ``/proc``); the start time
    tells a process from a later one that reuses its pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and parentheses
        out[int(entry)] = (int(fields[1]), int(fields[19]))
    return out


def descendants(pid: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """pid -> start time of every descendant of ``pid`` in ``table``."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out[c] = table[c][1]
                todo.append(c)
    return out


def own_descendants() -> set[int]:
    """The pids of every process this one started, and those started, in turn; empty without ``/proc``."""
    return set(descendants(os.getpid(), process_table())) if os.path.isdir("/proc") else set()


REAPER_POLL_S = 0.5


def reap_when_parent_ends(parent: int) -> None:
    """The reaper's main loop (a process of its own, ``Reaper``): every ``REAPER_POLL_S`` note the parent's
    descendants; once the parent has gone (its pid is no longer this process's parent, or its end of the pipe on stdin
    closed without a ``done``), kill those still alive, and whatever they started meanwhile, with SIGKILL. A ``done``
    line: the parent closed them itself; leave. Stop signals are ignored: the reaper acts on its parent's end only."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    me = os.getpid()

    def snapshot() -> dict[int, int]:
        return {p: t for p, t in descendants(parent, process_table()).items() if p != me}

    known = snapshot()
    os.write(1, b"ready\n")  # what the parent had started so far is known: its Reaper() returns
    while os.getppid() == parent:
        ready, _, _ = select.select([0], [], [], REAPER_POLL_S)
        if ready:
            data = os.read(0, 64)
            if data.startswith(b"done"):
                return
            if not data:  # the parent is ending (its end of the pipe closed with it)
                break
        known = snapshot()
    table = process_table()
    doomed = {p for p, t in known.items() if p in table and table[p][1] == t}
    for p in list(doomed):
        doomed |= set(descendants(p, table))
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Reaper:
    """A small process that kills what this process started once this process ends, however it ends: for children a
    library starts (vLLM's engine core and workers), on which ``die_with_parent`` cannot be set. ``release()`` when
    this process has closed them itself. Linux (``/proc``); elsewhere it does nothing."""

    def __init__(self):
        import subprocess

        self.proc = None
        if not os.path.isdir("/proc"):
            return
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (f"import sys; sys.path.insert(0, {package_root!r}); "
                "from grail_exp.preemption import reap_when_parent_ends; reap_when_parent_ends(int(sys.argv[1]))")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        self.proc.stdout.readline()  # "ready": it has noted every process this one started before now

    def release(self) -> None:
        """This process closed its children itself: the reaper leaves without killing anything."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.write(b"done\n")
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, ValueError):
            pass
        except Exception:  # noqa: BLE001 - a reaper that would not leave is ended; the job's own outcome stands
            proc.kill()
