"""The base of the tests' probes (``GRAIL_EXP_PROBE``, grail_exp/training/probe_points.py): each rank appends one JSON line
per probe point to ``$GRAIL_EXP_PROBE_DIR/rank<r>.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path


class JsonlProbe:
    def __init__(self):
        self.dir = Path(os.environ["GRAIL_EXP_PROBE_DIR"])
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, point: str, **data) -> None:
        from grail_exp import world

        with open(self.dir / f"rank{world.rank()}.jsonl", "a") as f:
            f.write(json.dumps({"point": point, **data}) + "\n")
