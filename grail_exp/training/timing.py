"""Phase timings: ``with timed(timings, "rollout"): ...`` adds the block's wall time to ``timings["rollout"]``."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(timings: dict, key: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
