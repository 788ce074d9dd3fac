"""Reading JSONL input with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl_objects(path: str | Path, error: type[Exception] = ValueError,
                       skip_blank: bool = True) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` per line; ``error("<file>:<line>: ...")`` for a bad one.

    ``skip_blank=False`` makes a blank line an error too: for files whose row index must equal line - 1.
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if skip_blank and not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # so a line cut short is reported at its end, not at column 1
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row
