"""Checkpoints that a crash can never corrupt, and exact resume.

Layout: ``<run dir>/checkpoints/step-<N>/``
    config.json, model.safetensors, tokenizer files     the policy, loadable by transformers / vLLM / evaluate (the
                                                         "HF export"; optional between the final checkpoints of a
                                                         sharded run: ``trainer.export_hf_weights``)
    training_state.pt                                    what every rank shares (rank 0 writes it): step, data position,
                                                         scheduler, counters, MLflow run id, the world size; the
                                                         optimiser too where every rank holds all of it (one process,
                                                         DDP)
    rank-<r>.pt                                          what rank r alone holds: its RNG streams, its half-used
                                                         rollout batch, its ZeRO optimiser partition (DeepSpeed)
    sharded/                                             FSDP: model and optimiser shards (torch.distributed
                                                         .checkpoint), each rank writing and reading its own;
                                                         reshardable to another world size
    COMPLETE                                             written last

No rank materialises the full optimiser state or, under FSDP, the full model on the host: each writes its own part
into the same directory (a shared filesystem when the ranks sit on several nodes). Checkpoints of the older layout
(``training_state.pt`` holding every rank's part and the full optimiser state) still resume.

Trajectory (``trainer.save_weights_only_every``): ``<run dir>/trajectory/step-<N>/`` holds the same Hugging Face
files and the marker but no training state: cheap, never pruned, not a resume point; ``step-0`` is the starting
model θ_0. ``python -m grail_exp.extrapolate`` (RELEX) reads it.

A checkpoint is written into ``step-<N>.tmp-<pid>/``, flushed, and renamed into place: the rename is
atomic, so a process killed mid-write leaves only a ``.tmp-*`` directory, which resume ignores (and the
next save removes). ``training_state.pt`` holds only tensors and plain Python containers and is read with
``torch.load(weights_only=True)``: loading a checkpoint never runs pickled code.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from grail_exp.errors import UserError

log = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
MARKER = "COMPLETE"
SHARDED_DIR = "sharded"  # FSDP's model and optimiser shards (torch.distributed.checkpoint)
FORMAT = 2  # training_state.pt's "format": 2 = per-rank files; absent = the older all-on-rank-0 layout
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and the fix."""


# Plain data classes of this package that a training state may hold (e.g. a scheme's prepared state inside a
# half-used rollout batch). ``torch.load(weights_only=True)`` rebuilds only these, never arbitrary objects.
SAFE_TYPES: list[type] = []


def checkpointable(cls: type) -> type:
    """Class decorator: allow instances of this (plain, tensor-holding) data class in training states."""
    SAFE_TYPES.append(cls)
    return cls


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])



def _cuda_started() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextmanager
def random_streams_kept(*, init_cuda: bool = False):
    """Run the block, then put back every random stream it may move: Python's and NumPy's global generators, torch's
    CPU generator and every CUDA device's (when CUDA is initialized). Work that must not shift the run's own
    streams (an evaluation between steps, building a cached model, an engine that seeds the globals) runs inside, so
    the run draws the same samples whether that work happened in this process or not.

    ``init_cuda``: the block will start CUDA. CUDA applies the seed queued before its initialization (the run's
    ``seed_everything``) when it starts, so it is started here, first, where its stream can be saved and restored."""
    if init_cuda and torch.cuda.is_available():
        torch.cuda.init()
    py, npy = random.getstate(), np.random.get_state()
    try:
        devices = list(range(torch.cuda.device_count())) if _cuda_started() else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def seed_started_streams(seed: int) -> None:
    """Seed torch's CPU generator and, once CUDA is initialized, every CUDA device's. Never a CUDA seed before CUDA
    starts: ``torch.manual_seed`` would queue one that CUDA's initialization applies later, outside any
    ``random_streams_kept``, replacing the run's own seed."""
    torch.default_generator.manual_seed(seed)
    if _cuda_started():
        torch.cuda.manual_seed_all(seed)

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_weights(root: Path, step: int, model, tokenizer, state_dict: dict | None = None) -> Path:
    """Weights-only ``root/step-<step>`` (Hugging Face directory, no optimiser state), atomically; never pruned.

    The training trajectory that ``python -m grail_exp.extrapolate`` (RELEX) reads: ``trainer.save_weights_only_every``.
    """

    def write(tmp: Path) -> None:
        if state_dict is not None:  # a sharded model's gathered weights
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomically(root / f"step-{step}", write, what="trajectory checkpoint")


def write_dir_atomically(final: Path, write, what: str = "checkpoint", stale: str = "step-*.tmp-*") -> Path:
    """Fill ``<final>.tmp-<pid>/`` with ``write(tmp)``, fsync it, add the ``COMPLETE`` marker, rename into place.

    A crash mid-write leaves only a ``.tmp-*`` directory; the next write removes those matching ``stale`` under
    the same parent. An existing ``final`` is replaced. A full disk becomes a ``CheckpointError`` that names the fix.
    """
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob(stale):  # left behind by a crash mid-write
        shutil.rmtree(left, ignore_errors=True)
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    try:
        write(tmp)
        seal(tmp, final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise write_error(exc, what, final) from exc
        raise
    return final


def write_error(exc: OSError, what: str, final: Path) -> CheckpointError:
    """The one-line error for an ``OSError`` while writing ``final`` (a full disk names the fix)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left on the device writing {what} {final}: free disk space, lower "
            f"trainer.keep_last_checkpoints or trainer.save_weights_only_every, or point hydra.run.dir at a "
            f"larger disk. The previous complete checkpoint is intact.")
    return CheckpointError(f"cannot write {what} {final}: {exc}")


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` (and the directories themselves) to disk."""
    for d, _, files in os.walk(path):
        for name in files:
            with open(Path(d) / name, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(d))


def seal(tmp: Path, final: Path) -> None:
    """Flush the filled ``tmp``, add the ``COMPLETE`` marker and rename it to ``final`` (atomic)."""
    fsync_tree(tmp)
    (tmp / MARKER).write_text(final.name)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. SIGTERM right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def prune(root: Path, keep_last: int | None) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints under ``root`` (None: keep all)."""
    if keep_last:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def rank_file(ckpt: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its own part of a checkpoint."""
    return ckpt / f"rank-{rank}.pt"


def has_hf_weights(ckpt: Path) -> bool:
    """The checkpoint holds the full Hugging Face weights (single file or an index of shards)."""
    return (ckpt / "model.safetensors").exists() or (ckpt / "model.safetensors.index.json").exists()


def save_torch(obj, path: Path) -> None:
    """``torch.save`` into ``path``, flushed to disk (tensors and plain containers: it loads with
    ``weights_only=True``). Each rank flushes its own files: another node's fsync need not reach them."""
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def load_torch(path: Path):
    """A file written by ``save_torch``, read with ``weights_only=True`` (no pickled code runs). Memory-mapped: its
    tensors are pages of the file (copy-on-write), read as they are placed, not a second copy in the process's heap.
    A loaded file is never rewritten in place (checkpoints are removed or renamed over, which leaves the pages valid)."""
    if not path.exists():
        raise CheckpointError(f"{path.parent} is not a complete checkpoint (no {path.name})")
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MARKER).exists() and (d / STATE_FILE).exists():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def load_training_state(ckpt: Path) -> dict:
    """The shared ``training_state.pt`` of a checkpoint (every rank reads it; small in the per-rank layout)."""
    return load_torch(ckpt / STATE_FILE)


def load_rank_state(ckpt: Path, rank: int) -> dict:
    """Rank ``rank``'s own part of a checkpoint of the per-rank layout (``rank-<r>.pt``)."""
    return load_torch(rank_file(ckpt, rank))


def check_resume(resume: str | None) -> list[str]:
    """``resume`` naming a checkpoint directory (not null / auto): it is a complete one, for ``validate``."""
    if not resume or resume == "auto":
        return []
    p = Path(str(resume)).expanduser()
    if (p / MARKER).exists():
        return []
    return [f"resume = {str(resume)!r}: not a complete checkpoint directory (expected {p / MARKER}); use resume=auto "
            "or a checkpoints/step-N directory"]


def resolve_resume(resume: str | None, checkpoint_root: Path) -> Path | None:
    """``resume``: null (fresh start), ``auto`` (latest complete checkpoint of this run dir, or a fresh start
    if there is none) or a path to a checkpoint directory."""
    if not resume:
        return None
    if resume == "auto":
        ckpt = latest_checkpoint(checkpoint_root)
        if ckpt is None:
            log.info("resume=auto: no complete checkpoint under %s, starting fresh", checkpoint_root)
        return ckpt
    p = Path(resume).expanduser()
    if not (p / MARKER).exists():
        raise CheckpointError(f"resume={resume!r} is not a complete checkpoint directory (expected {p / MARKER}); "
                              f"use resume=auto or a checkpoints/step-N directory")
    return p


# safetensors' dtype names (the format's header: https://github.com/huggingface/safetensors, "Format")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors_streaming(path: Path, specs: list[tuple[str, torch.dtype, tuple]], tensors) -> None:
    """A safetensors file written one tensor at a time: ``specs`` (name, dtype, shape) in file order make the header,
    then each tensor of ``tensors`` (``(name, tensor)`` in the same order) is appended as it arrives. At most one tensor
    is held beyond the caller's: a sharded model's full weights stream through without the whole state dict existing.
    ``tensors`` may be a collective (every rank iterates it); ``path`` None only consumes it (the other ranks). A failure
    (a write error, a tensor that differs from its header) is raised only once ``tensors`` is consumed to its end."""
    import json
    import struct

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    error: Exception | None = None
    fh = None
    try:
        if path is not None:
            fh = open(path, "wb")
            fh.write(struct.pack("<Q", len(raw)) + raw)
    except OSError as exc:
        error = exc
    try:
        for (name, t), (want, dtype, shape) in zip(tensors, specs):
            if error is None and (name != want or t.dtype != dtype or tuple(t.shape) != tuple(shape)):
                error = CheckpointError(f"streamed tensor {name} {tuple(t.shape)} {t.dtype} does not match the "
                                        f"header's {want} {tuple(shape)} {dtype}")
            if fh is not None and error is None:
                try:
                    fh.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                except Exception as exc:  # noqa: BLE001 - keep consuming: the other ranks are still gathering
                    error = exc
            del t
        if fh is not None and error is None:
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        if fh is not None:
            fh.close()
    if error is not None:
        raise error
