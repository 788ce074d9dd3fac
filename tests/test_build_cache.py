"""``grail_exp/models/build_cache.py``: a model directory built once, whoever asks for it and however the build ends.

The concurrent case is made deterministic: the test holds the lock itself, so the second caller is known to be
waiting on it while the first "process" (the test) completes the directory."""

from __future__ import annotations

import threading

import pytest

from grail_exp.models.build_cache import build_once

MARKER = "done.json"


def _builder(calls: list):
    def build(tmp):
        calls.append(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "weights.bin").write_bytes(b"w")
        (tmp / MARKER).write_text("{}")  # last, as the callers do
    return build


def test_a_directory_is_built_once_then_reused(tmp_path):
    out, calls = tmp_path / "cache" / "model-abc", []
    assert build_once(out, MARKER, _builder(calls)) is True
    assert (out / "weights.bin").read_bytes() == b"w" and (out / MARKER).is_file()
    assert calls[0].name == f".tmp-model-abc-{__import__('os').getpid()}" and not calls[0].exists()  # renamed
    assert build_once(out, MARKER, _builder(calls)) is False and len(calls) == 1


def test_a_failed_build_leaves_nothing_that_looks_complete_and_the_next_call_builds(tmp_path):
    out = tmp_path / "model"

    def broken(tmp):
        tmp.mkdir()
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        build_once(out, MARKER, broken)
    assert not out.exists()
    calls = []
    assert build_once(out, MARKER, _builder(calls)) is True and len(calls) == 1  # the stale private folder is replaced


def test_a_caller_that_waited_on_the_lock_finds_the_directory_built_and_builds_nothing(tmp_path):
    from filelock import FileLock

    out, calls, result = tmp_path / "model", [], {}
    lock = FileLock(str(out) + ".lock")
    lock.acquire()  # another process is building
    waiter = threading.Thread(target=lambda: result.update(built=build_once(out, MARKER, _builder(calls))))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive()  # it waits on the lock (no marker yet)
    _builder([])(out)  # the other process completes the directory
    lock.release()
    waiter.join(timeout=60)
    assert result == {"built": False} and calls == []
