"""A model directory built once and cached: the embedded model, the de-quantised packaged model, the cold start.

Concurrent processes (DDP ranks, parallel tests, sweep jobs) asking for the same directory build it once: a file lock
serialises them, the directory is written under a private name and renamed into place when complete (a crash never
leaves a half-written directory that looks complete), and a directory counts as complete when it holds its marker
file, which the build writes last.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def build_once(out: Path, marker: str, build: Callable[[Path], None]) -> bool:
    """Make ``out`` exist complete: when it lacks ``marker``, ``build(tmp)`` fills a private folder beside it (writing
    ``marker`` last) under a lock on ``out``, and the folder is renamed to ``out``. Whether this call built it."""
    from filelock import FileLock

    if (out / marker).is_file():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / marker).is_file():  # built by a concurrent process while this one waited
            return False
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        os.replace(tmp, out)  # atomic
    return True
