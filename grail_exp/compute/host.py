"""The host's memory: this process's resident set (now and its peak), and handing freed heap back to the machine.

A CPU run's tensors live in the process heap. glibc keeps freed blocks for reuse instead of returning them, so after
a phase that allocated a lot (generation's caches and scores, the update's activations) the resident set stays at that
phase's high-water mark and the next phase's peak is added on top of what fragments remain. ``return_freed_memory``
(glibc's ``malloc_trim``) at the phase boundaries keeps the resident set near what is live; it costs milliseconds.
``return_freed_memory_after_gradients`` does the same inside a backward pass, at a point given by parameters.
"""

from __future__ import annotations

import ctypes
import os
import resource
from pathlib import Path

_LIBC = None


def peak_resident_bytes() -> int:
    """This process's peak resident set so far, in bytes (``getrusage``'s ``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``; 0 where there is none)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc; a no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def return_freed_memory_after_gradients(params) -> list:
    """Hand freed heap back once every parameter of ``params`` has received its gradient in a backward pass (the
    hooks' handles, to remove them). With the first decoder layer's parameters this runs after the layers' backward
    freed their activations and before the embedding's gradient (tied: the output layer's too) is allocated.

    Why there: the master gradients made during the backward do not reuse every block the freed activations leave, so
    the heap's high-water mark lands at the end of the backward, above what is live; the memory handed back is what
    the trim after the backward returns anyway (measured: docs/performance.md, "Numbers behind the code's choices").
    """
    params = [p for p in params if p.requires_grad]
    arrived: set[int] = set()

    def hook(p) -> None:  # p: the parameter whose gradient arrived
        arrived.add(id(p))
        if len(arrived) == len(params):
            arrived.clear()
            if p.device.type == "cpu":  # the model may have moved to a GPU since the hooks were set: no host heap then
                return_freed_memory()

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


def memory_bytes() -> tuple[int | None, int | None]:
    """(available, total) bytes of host memory (``/proc/meminfo``: MemAvailable, MemTotal, or a cgroup's limit when it
    is lower); (None, None) where the kernel does not say."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
    except OSError:
        return None, None
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    limit = _cgroup_limit()
    if limit is not None and total is not None and limit < total:
        available = min(available or limit, limit)
        total = limit
    return available, total


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None
