"""The host's memory: how much this machine can give a run, and handing freed heap back to it.

A CPU run's tensors live in the process heap. glibc keeps freed blocks for reuse instead of returning them, so after
a phase that allocated a lot (generation's caches and scores, the update's activations) the resident set stays at that
phase's high-water mark and the next phase's peak is added on top of what fragments remain. ``return_freed_memory``
(glibc's ``malloc_trim``) at the phase boundaries keeps the resident set near what is live; it costs milliseconds.
"""

from __future__ import annotations

import ctypes
import os

_LIBC = None


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


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (``getrusage``; kilobytes on Linux)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * 1024 if os.uname().sysname == "Linux" else rss
