"""``python -m grail_exp.extrapolate``: RELEX, rank-r extrapolation of a training trajectory.

    python -m grail_exp.run trainer.save_weights_only_every=1 hydra.run.dir=R      # keeps R/trajectory/step-<N>
    python -m grail_exp.extrapolate trajectory=R/trajectory observe.max_step=45 target_step=150
    python -m grail_exp.evaluate model.name_or_path=<the printed output directory>

RELEX: Wei et al., "You Only Need Minimal RLVR Training: Extrapolating LLMs via Rank-1 Trajectories",
arXiv 2605.21468 (official code: weizhepei/RELEX ``scripts/svd_extrapolation.py``; other-methods.md §3).
For every weight tensor W (flattened to d entries), with observed checkpoints at steps s_1 < ... < s_T:

    M   = [W(s_1) - W(0); ...; W(s_T) - W(0)]        (T, d)  deltas from the starting weights θ_0
    G   = M Mᵀ = U Λ Uᵀ                               (T, T)  Gram matrix (the d x T SVD is never formed)
    S_r = sqrt(Λ_r),  V_r = Mᵀ U_r S_r⁻¹             rank-r SVD  M ≈ U_r S_r V_rᵀ   (S_k <= 1e-6 S_1 dropped)
    C   = U_r S_r = M V_r                             (T, r)  temporal coefficients
    c_k(s) = a_k s + b_k                              least squares on the last ``fit_window`` rows of C
    Ŵ(s*) = W(0) + c(s*) V_rᵀ = W(0) + Σ_t α_t M_t,  α = U_r S_r⁻¹ c(s*)    (T,)

The last line is what makes streaming cheap: the prediction is a fixed linear combination α of the observed
deltas. Pass 1 accumulates G over row-chunks of the tensor, a T x T eigenproblem gives α, and pass 2
accumulates Σ_t α_t M_t chunk by chunk; V_r is never materialised. Memory: one row-chunk of the T deltas
(``chunk_mb``) plus one output shard (``max_shard_mb``), whatever the model size; a tensor that fits in one
chunk is read once.

Modes: ``extrapolate`` (RELEX: s* beyond the last observed step), ``fit`` (the fitted line at any step, the
official ``fit_reconstruct``), ``reconstruct`` (the real delta at a step with a checkpoint projected on the
rank-r subspace, c = δ V_r, the paper's Finding 1).

Departure from the official code, on purpose: the line is fitted against the step number, not against the
checkpoint's position 0..T-1. The two agree for an every-step trajectory from step 1 (the paper's setting);
with a checkpoint every k steps the position axis would be off by k (the official code patches that with a
per-model step scale).

Tied heads (``tie_word_embeddings``): the head is not fitted; the written checkpoint omits it, as
``save_pretrained`` does for tied weights, and transformers re-ties it to the predicted embedding on load,
which is the official code's "lm_head reuses the embed_tokens delta".
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import ConfigError, PathsConfig, register_configs
from grail_exp.errors import UserError

log = logging.getLogger("grail_exp.extrapolate")


# The schema of conf/extrapolate.yaml, beside its validator (validate_extrapolate); stored as ``extrapolate_schema``
# when this module is imported (tests/conftest.compose imports it for config_name="extrapolate").
@dataclass
class ObserveConfig:
    """Which trajectory checkpoints RELEX fits on: steps in [min_step, max_step] that are multiples of ``every``."""

    min_step: int = 1  # first observed step; θ_0 (step 0, delta 0) is never a row (official code: steps 1..T_cut)
    max_step: int | None = None  # T_cut, inclusive (paper: 75 of 500 steps for 1.5B/4B, 100 of 750 for 8B); null = all
    fraction: float | None = None  # instead of max_step: T_cut = floor(fraction x target_step) (paper: 0.15-0.2)
    every: int = 1  # use only steps that are multiples of this (thin an every-step trajectory); 1 = all


@dataclass
class ExtrapolateConfig:
    """Schema of ``python -m grail_exp.extrapolate`` (conf/extrapolate.yaml): RELEX, arXiv 2605.21468."""

    trajectory: str = MISSING  # directory of step-<N>/ HF directories: <run dir>/trajectory or <run dir>/checkpoints
    base: str | None = None  # θ_0, the starting weights (HF dir); null = <trajectory>/step-0
    output: str = MISSING  # HF directory to write (default <hydra run dir>/model)
    overwrite: bool = False  # replace an existing output directory
    # extrapolate: the fitted line beyond the last observed step (RELEX) | fit: the fitted line at any step (the
    # official `fit_reconstruct`) | reconstruct: a real checkpoint's delta projected on the rank-r subspace (Finding 1)
    mode: str = "extrapolate"
    target_step: int = MISSING  # step to predict (paper: 500 from T_cut 75); reconstruct: a step with a checkpoint
    rank: int = 1  # r, kept singular directions per tensor (paper: 1; higher rank does not help)
    fit_window: int | None = None  # fit the line on the last W observed checkpoints; null = all (official: -1)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    exclude: str | None = None  # regex on tensor names kept at θ_0, e.g. 'norm'; null = fit all (official: all)
    dtype: str = "auto"  # output dtype: auto (θ_0's, per tensor) | float32 | bfloat16 (official) | float16
    compute_dtype: str = "float32"  # deltas and Gram matrix: float32 (official) | float64
    chunk_mb: int = 1024  # memory for one row-chunk of all observed deltas of one tensor (streaming bound)
    max_shard_mb: int = 4096  # output safetensors shard size (another memory bound: one shard is buffered)
    compare_to_actual: bool = True  # if target_step has a checkpoint: relative weight error of prediction vs it
    progress: bool = True  # progress bar over tensors
    paths: PathsConfig = field(default_factory=PathsConfig)
    task_name: str = "extrapolate"


register_configs()
ConfigStore.instance().store(name="extrapolate_schema", node=ExtrapolateConfig)

MODES = ("extrapolate", "fit", "reconstruct")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SV_RTOL = 1e-6  # singular directions with S_k <= SV_RTOL * S_1 are dropped (the official threshold)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
_WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


class ExtrapolateError(UserError, ValueError):
    """Unusable checkpoints (missing, mismatched); the message names the directory / tensor and the fix."""


# --------------------------------------------------------------------------------------------- the math
def gram_svd(G: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Top-``rank`` left singular vectors U_r (T, r) and singular values S_r (r,) of M from G = M Mᵀ (T, T).

    Also returns the explained variance Σ_{k<=r} λ_k / Σ_k λ_k (0 for an unchanged tensor). Directions with
    S_k <= SV_RTOL * S_1 get S_k = 0 (callers then ignore them).
    """
    lam, U = torch.linalg.eigh(G.double())  # ascending
    lam, U = lam.flip(0).clamp(min=0), U.flip(1)
    total = float(lam.sum())
    r = min(rank, G.shape[0])
    S = lam[:r].sqrt()
    S = torch.where(S > SV_RTOL * S[0], S, torch.zeros_like(S)) if S[0] > 0 else torch.zeros_like(S)
    explained = float(lam[:r].sum()) / total if total > 0 else 0.0
    return U[:, :r], S, explained


def fit_line(steps: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares c_k(s) = slope_k s + intercept_k for each column of C (n, r) against ``steps`` (n,)."""
    s = steps.double()
    sc = s - s.mean()
    slope = (sc[:, None] * (C - C.mean(0))).sum(0) / (sc * sc).sum()
    return slope, C.mean(0) - slope * s.mean()


def _inverse(S: torch.Tensor) -> torch.Tensor:
    """1 / S_k, and 0 for dropped directions (S_k = 0)."""
    return torch.where(S > 0, 1.0 / S.clamp(min=torch.finfo(S.dtype).tiny), torch.zeros_like(S))


def mixing_weights(U: torch.Tensor, S: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """α (T,) with c V_rᵀ = Σ_t α_t M_t, since V_r = Mᵀ U_r S_r⁻¹: α = U_r (c / S_r); dropped directions add 0."""
    return U @ (c * _inverse(S))


@dataclass
class TensorFit:
    """What one tensor's Gram matrix gives: α and the diagnostics written to relex.json."""

    alpha: torch.Tensor  # (T,) float64
    singular_values: list[float]
    explained_variance: float
    coefficient: list[float] = field(default_factory=list)  # c(s*) (r,)
    slope: list[float] = field(default_factory=list)
    intercept: list[float] = field(default_factory=list)


def solve(G: torch.Tensor, steps: torch.Tensor, rank: int, mode: str, target_step: int,
          fit_window: int | None, g_target: torch.Tensor | None = None) -> TensorFit:
    """α for one tensor. ``g_target`` = M δ_targetᵀ (T,) is needed by ``reconstruct`` only."""
    U, S, explained = gram_svd(G, rank)
    out = TensorFit(torch.zeros(G.shape[0], dtype=torch.float64), [float(x) for x in S], explained)
    if not bool((S > 0).any()):
        return out  # the tensor never moved (or only below the threshold): prediction = θ_0
    if mode == "reconstruct":
        c = (g_target.double() @ U) * _inverse(S)  # c = δ V_r = δ Mᵀ U_r S_r⁻¹
    else:
        C = U * S  # (T, r) = M V_r
        w = C.shape[0] if fit_window is None else min(fit_window, C.shape[0])
        slope, intercept = fit_line(steps[-w:], C[-w:])
        c = slope * float(target_step) + intercept
        out.slope, out.intercept = slope.tolist(), intercept.tolist()
    out.alpha = mixing_weights(U, S, c)
    out.coefficient = c.tolist()
    return out


# --------------------------------------------------------------------------------------------- checkpoints
def safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file.

    The format: an 8-byte little-endian header length N, N bytes of JSON, then the raw little-endian data.
    """
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise ExtrapolateError(f"{path}: not a readable safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return 8 + n, header


def weight_files(ckpt: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a Hugging Face directory (single file or sharded with an index)."""
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: ckpt / f for name, f in weight_map.items()}
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ExtrapolateError(f"{ckpt}: no safetensors weights (expected model.safetensors or an index); "
                               f"save checkpoints with save_pretrained(safe_serialization=True)")
    return {name: f for f in files for name in safetensors_header(f)[1]}


class CheckpointReader:
    """Reads one tensor, or a range of its rows, from one checkpoint's safetensors files.

    Plain positioned reads, not memory maps: a mapped file's touched pages count in the process's memory until
    it is unmapped, so mapping T checkpoints would hold T copies of each tensor however it is chunked.
    """

    def __init__(self, ckpt: Path):
        self.path = ckpt
        self.files = weight_files(ckpt)
        self._headers: dict[Path, tuple[int, dict]] = {}

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        f = self.files[name]
        if f not in self._headers:
            self._headers[f] = safetensors_header(f)
        start, header = self._headers[f]
        if name not in header:
            raise ExtrapolateError(f"{f}: no tensor {name} (the index names this file for it)")
        return f, start, header[name]

    def header(self, name: str) -> tuple[list[int], str]:
        entry = self._entry(name)[2]
        return list(entry["shape"]), entry["dtype"]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole tensor, or rows [a, b) of its first dimension (only those bytes are read)."""
        f, start, entry = self._entry(name)
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ExtrapolateError(f"{f}: tensor {name} has dtype {entry['dtype']}, which RELEX does not read")
        shape = list(entry["shape"])
        a, b = entry["data_offsets"]
        if rows is not None:
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            a, b = a + rows[0] * row_bytes, a + rows[1] * row_bytes
            shape = [rows[1] - rows[0], *shape[1:]]
        out = torch.empty(math.prod(shape), dtype=dtype)
        with open(f, "rb", buffering=0) as fh:
            fh.seek(start + a)
            got = fh.readinto(out.view(torch.uint8).numpy()) if out.numel() else 0
        if got != b - a:
            raise ExtrapolateError(f"{f}: tensor {name} is truncated (read {got} of {b - a} bytes)")
        return out.view(shape)


def list_trajectory(traj: Path) -> dict[int, Path]:
    """step -> directory for every ``step-<N>/`` under ``traj`` that holds weights (``.tmp-*`` are partial)."""
    if not traj.is_dir():
        raise ExtrapolateError(f"trajectory={str(traj)!r}: not a directory. Train with "
                               f"trainer.save_weights_only_every=<k> and pass <run dir>/trajectory")
    found = {}
    for d in traj.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and (list(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").exists()):
            found[int(m.group(1))] = d
    if not found:
        raise ExtrapolateError(f"trajectory={str(traj)!r}: no step-<N>/ checkpoint directories with safetensors "
                               f"weights in it")
    return dict(sorted(found.items()))


@dataclass
class Plan:
    """The checkpoints one extrapolation reads, resolved and checked before any tensor is loaded."""

    base: Path
    observed: dict[int, Path]  # step -> dir, ascending
    target_dir: Path | None  # the real checkpoint at target_step, when there is one
    names: list[str]  # tensors written, in θ_0's order
    tied_head: str | None  # tensor dropped because it is tied to the embedding


def validate_extrapolate(cfg: DictConfig) -> None:
    """Config values that cannot work, all at once, before any file is read."""
    e = []
    if cfg.mode not in MODES:
        e.append(f"mode = {cfg.mode!r}: must be one of: {', '.join(MODES)}")
    if cfg.rank < 1:
        e.append(f"rank = {cfg.rank}: must be >= 1 (paper: 1)")
    if cfg.target_step < 1:
        e.append(f"target_step = {cfg.target_step}: must be >= 1")
    if cfg.fit_window is not None and cfg.fit_window < 2:
        e.append(f"fit_window = {cfg.fit_window}: a line needs >= 2 points (null = all observed)")
    o = cfg.observe
    if o.max_step is not None and o.fraction is not None:
        e.append(f"observe.max_step = {o.max_step} and observe.fraction = {o.fraction}: set one of them")
    if o.fraction is not None and not 0 < o.fraction < 1:
        e.append(f"observe.fraction = {o.fraction}: must be in (0, 1) (T_cut = fraction x target_step)")
    if o.every < 1:
        e.append(f"observe.every = {o.every}: must be >= 1")
    if o.min_step < 1:
        e.append(f"observe.min_step = {o.min_step}: must be >= 1 (θ_0 has delta 0 and is never fitted)")
    if cfg.dtype != "auto" and cfg.dtype not in ("float32", "bfloat16", "float16"):
        e.append(f"dtype = {cfg.dtype!r}: must be one of: auto, float32, bfloat16, float16")
    if cfg.compute_dtype not in ("float32", "float64"):
        e.append(f"compute_dtype = {cfg.compute_dtype!r}: must be float32 or float64")
    if cfg.chunk_mb < 1 or cfg.max_shard_mb < 1:
        e.append(f"chunk_mb = {cfg.chunk_mb}, max_shard_mb = {cfg.max_shard_mb}: must be >= 1")
    if cfg.exclude:
        try:
            re.compile(cfg.exclude)
        except re.error as exc:
            e.append(f"exclude = {cfg.exclude!r}: not a regular expression ({exc})")
    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))


def plan(cfg: DictConfig) -> Plan:
    """Choose θ_0, the observed steps and the target checkpoint; check names and shapes agree everywhere."""
    traj = Path(cfg.trajectory).expanduser()
    available = list_trajectory(traj)
    base = Path(cfg.base).expanduser() if cfg.base else traj / "step-0"
    if not base.is_dir():
        raise ExtrapolateError(
            f"θ_0 missing: {base} does not exist. The starting weights are <trajectory>/step-0 (written by "
            f"trainer.save_weights_only_every on a fresh run), or pass base=<HF dir of the starting model>")
    o, target = cfg.observe, int(cfg.target_step)
    t_cut = o.max_step if o.max_step is not None else (
        math.floor(o.fraction * target) if o.fraction is not None else None)
    observed = {s: d for s, d in available.items()
                if s >= o.min_step and (t_cut is None or s <= t_cut) and s % o.every == 0
                and not (cfg.mode == "extrapolate" and t_cut is None and s >= target)}
    have = _short(list(available))
    if len(observed) < 2:
        upper = f"<= {t_cut}" if t_cut is not None else (f"< target_step {target}" if cfg.mode == "extrapolate" else "")
        raise ExtrapolateError(
            f"{len(observed)} observed checkpoint(s) in {traj} with step >= {o.min_step} {upper} (multiples of "
            f"{o.every}); RELEX fits a line and needs >= 2. Available steps: {have}")
    last = max(observed)
    if cfg.mode == "extrapolate" and target <= last:
        raise ExtrapolateError(
            f"target_step = {target} is inside the observed range (last observed step {last}): extrapolate "
            f"predicts beyond it. Use mode=fit for the fitted line at an observed step, mode=reconstruct for the "
            f"rank-{cfg.rank} projection of a real checkpoint, or lower observe.max_step")
    if cfg.mode == "reconstruct" and target not in available:
        raise ExtrapolateError(f"mode=reconstruct needs a checkpoint at target_step = {target}; available: {have}")
    if cfg.rank > len(observed):
        log.warning("rank = %d > %d observed checkpoints: using rank %d", cfg.rank, len(observed), len(observed))
    target_dir = available.get(target) if (cfg.mode == "reconstruct" or cfg.compare_to_actual) else None

    base_reader = CheckpointReader(base)
    tied_head = _tied_head(base)
    names = [n for n in base_reader.files if n != tied_head]
    shapes = {n: base_reader.header(n)[0] for n in names}
    for d in [*observed.values(), *([target_dir] if target_dir else [])]:
        r = CheckpointReader(d)
        got = set(r.files) - {tied_head}
        missing, extra = sorted(set(names) - got), sorted(got - set(names))
        if missing or extra:
            diff = ", ".join(f"{what} {_short(v)}" for what, v in (("missing", missing), ("extra", extra)) if v)
            raise ExtrapolateError(f"{d} does not hold the same tensors as θ_0 ({base}): {diff}. All checkpoints "
                                   f"must come from one model (same architecture)")
        for n in names:
            shape = r.header(n)[0]
            if shape != shapes[n]:
                raise ExtrapolateError(f"tensor {n}: shape {shape} in {d} but {shapes[n]} in θ_0 ({base})")
    return Plan(base, observed, target_dir, names, tied_head)


def _tied_head(ckpt: Path) -> str | None:
    """The output head's name when the config ties it to the input embedding (then it is not fitted)."""
    config = json.loads((ckpt / "config.json").read_text()) if (ckpt / "config.json").is_file() else {}
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
    return "lm_head.weight" if tied else None


def _short(items: list, n: int = 8) -> str:
    items = list(items)
    return "[" + ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "") + "]"


# --------------------------------------------------------------------------------------------- streaming
class ShardWriter:
    """Writes output tensors into safetensors shards of at most ``max_bytes``; only one shard is buffered.

    The shard of every tensor is fixed up front from the headers (sizes are known), so the files can carry
    Hugging Face's ``model-0000k-of-0000n`` names and the index is exact.
    """

    def __init__(self, out: Path, sizes: list[tuple[str, int]], max_bytes: int):
        self.out, self.shards, cur, cur_bytes = out, [], [], 0
        for name, nbytes in sizes:
            if cur and cur_bytes + nbytes > max_bytes:
                self.shards.append(cur)
                cur, cur_bytes = [], 0
            cur.append(name)
            cur_bytes += nbytes
        if cur:
            self.shards.append(cur)
        n = len(self.shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shard_of = {name: i for i, shard in enumerate(self.shards) for name in shard}
        self.buffer: dict[str, torch.Tensor] = {}
        self.total_bytes = 0
        self.max_buffered_bytes = 0  # measured peak (tests)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        self.buffer[name] = tensor.contiguous()
        self.max_buffered_bytes = max(self.max_buffered_bytes, sum(t.nbytes for t in self.buffer.values()))
        i = self.shard_of[name]
        if len(self.buffer) == len(self.shards[i]) and set(self.buffer) == set(self.shards[i]):
            save_file(self.buffer, str(self.out / self.files[i]), metadata={"format": "pt"})
            self.total_bytes += sum(t.nbytes for t in self.buffer.values())
            self.buffer = {}

    def finish(self) -> None:
        assert not self.buffer, f"tensors never completed their shard: {list(self.buffer)}"
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.files[i] for name, i in self.shard_of.items()}}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def row_chunks(shape: list[int], n_rows_held: int, itemsize: int, budget_bytes: int) -> list[tuple[int, int] | None]:
    """Row ranges of the first dimension such that ``n_rows_held`` copies of one range fit in ``budget_bytes``.

    ``[None]`` (read whole) when the tensor fits at once or has no first dimension to split.
    """
    if len(shape) == 0:
        return [None]
    row_bytes = max(1, math.prod(shape[1:])) * itemsize * n_rows_held
    if row_bytes * shape[0] <= budget_bytes:
        return [None]
    per = max(1, budget_bytes // row_bytes)  # one row at least, even past the budget
    return [(a, min(a + per, shape[0])) for a in range(0, shape[0], per)]


def extrapolate_tensor(name: str, base: CheckpointReader, observed: list[CheckpointReader], steps: torch.Tensor,
                       target: CheckpointReader | None, cfg: DictConfig, out_dtype: torch.dtype,
                       stats: dict) -> tuple[torch.Tensor, TensorFit]:
    """The predicted tensor: pass 1 accumulates G (and M δ_target) over row-chunks, pass 2 Σ_t α_t M_t."""
    cdt = DTYPES[cfg.compute_dtype]
    shape = base.header(name)[0]
    T = len(observed)
    target_observed = target is not None and target.path in {r.path for r in observed}
    need_target = target is not None and not target_observed
    held = T + 1 + int(need_target)  # deltas + θ_0 (+ the target's row-chunk)
    chunks = row_chunks(shape, held, torch.finfo(cdt).bits // 8, cfg.chunk_mb * 2**20)

    def load(rows):
        theta0 = base.read(name, rows).to(cdt)
        M = torch.empty((T, *theta0.shape), dtype=cdt)  # (T, rows, ...) one row-chunk of every delta
        for i, r in enumerate(observed):
            M[i] = r.read(name, rows).to(cdt) - theta0
        dt = target.read(name, rows).to(cdt) - theta0 if need_target else None
        return theta0, M.reshape(T, -1), dt

    G = torch.zeros((T, T), dtype=torch.float64)
    g = torch.zeros(T, dtype=torch.float64)
    cached = None
    for rows in chunks:  # pass 1
        theta0, M, dt = load(rows)
        G += (M @ M.T).double()
        if need_target:
            g += (M @ dt.reshape(-1)).double()
        if len(chunks) == 1:
            cached = (theta0, M, dt)  # one chunk: pass 2 reuses it instead of reading again
        del theta0, M, dt
    if target_observed:
        g = G[[r.path for r in observed].index(target.path)]
    fit = solve(G, steps, cfg.rank, cfg.mode, cfg.target_step, cfg.fit_window, g)
    alpha = fit.alpha.to(cdt)

    out = torch.empty(shape, dtype=out_dtype)
    flat_out = out.view(shape[0], -1) if len(shape) else out.view(1)
    for rows in chunks:  # pass 2
        theta0, M, dt = cached if cached is not None else load(rows)
        delta = alpha @ M  # Σ_t α_t M_t
        pred = theta0.reshape(-1) + delta
        if not torch.isfinite(pred).all():
            raise ExtrapolateError(f"tensor {name}: the prediction is not finite (a checkpoint holds inf/nan?)")
        dst = flat_out if rows is None else flat_out[rows[0]:rows[1]]
        dst.copy_(pred.view(dst.shape))
        if target is not None:
            true = M[[r.path for r in observed].index(target.path)] if target_observed else dt.reshape(-1)
            stats["err_sq"] += float(((delta - true) ** 2).sum())
            stats["last_err_sq"] += float(((M[-1] - true) ** 2).sum())
            stats["true_sq"] += float((true ** 2).sum())
        del theta0, M, dt
    return out, fit


# --------------------------------------------------------------------------------------------- the job
def extrapolate(cfg: DictConfig) -> dict:
    """Write the predicted checkpoint to ``cfg.output``; return the report (also ``<output>/relex.json``)."""
    from tqdm.auto import tqdm

    from grail_exp.checkpoint import write_dir_atomically

    validate_extrapolate(cfg)
    t0 = time.perf_counter()
    p = plan(cfg)
    out = Path(cfg.output).expanduser()
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise ExtrapolateError(f"output={str(out)!r} exists and is not empty; pass overwrite=true or another output")
    base = CheckpointReader(p.base)
    observed = [CheckpointReader(d) for d in p.observed.values()]
    steps = torch.tensor(list(p.observed), dtype=torch.float64)
    target = CheckpointReader(p.target_dir) if p.target_dir else None
    exclude = re.compile(cfg.exclude) if cfg.exclude else None
    dtype_of = {}
    for n in p.names:
        stored = _SAFETENSORS_DTYPES.get(base.header(n)[1])
        if stored is None:
            raise ExtrapolateError(f"{p.base}: tensor {n} has dtype {base.header(n)[1]}, which RELEX does not read")
        dtype_of[n] = stored if cfg.dtype == "auto" or not stored.is_floating_point else DTYPES[cfg.dtype]
    sizes = [(n, math.prod(base.header(n)[0]) * dtype_of[n].itemsize) for n in p.names]
    log.info("RELEX %s: θ_0 %s, %d observed steps %s, target step %d, rank %d, %d tensors", cfg.mode, p.base,
             len(observed), _short(list(p.observed)), cfg.target_step, cfg.rank, len(p.names))
    stats = {"err_sq": 0.0, "last_err_sq": 0.0, "true_sq": 0.0}
    per_tensor = []

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        writer = ShardWriter(tmp, sizes, cfg.max_shard_mb * 2**20)
        total = sum(math.prod(base.header(n)[0]) for n in p.names)
        with tqdm(total=total, desc=f"RELEX {cfg.mode}", unit="param", unit_scale=True, disable=not cfg.progress,
                  dynamic_ncols=True, leave=False) as bar:
            for n in p.names:
                if (exclude and exclude.search(n)) or not dtype_of[n].is_floating_point:
                    t = base.read(n).to(dtype_of[n])  # kept at θ_0
                    writer.add(n, t)
                    per_tensor.append({"name": n, "numel": t.numel(), "fitted": False})
                    del t
                else:
                    pred, fit = extrapolate_tensor(n, base, observed, steps, target, cfg, dtype_of[n], stats)
                    writer.add(n, pred)
                    per_tensor.append({"name": n, "numel": pred.numel(), "fitted": True,
                                       "explained_variance": fit.explained_variance,
                                       "singular_values": fit.singular_values, "coefficient": fit.coefficient,
                                       "slope": fit.slope, "intercept": fit.intercept})
                    del pred
                bar.update(math.prod(base.header(n)[0]))
        writer.finish()
        _copy_side_files(p.base, tmp, None if cfg.dtype == "auto" else cfg.dtype)
        report.update(_summary(cfg, p, per_tensor, stats, writer, time.perf_counter() - t0))
        (tmp / "relex.json").write_text(json.dumps({**report, "tensors": per_tensor}, indent=2))

    report: dict = {}
    write_dir_atomically(out, write, what="RELEX output", stale=f"{out.name}.tmp-*")
    return report


def _copy_side_files(src: Path, dst: Path, dtype: str | None) -> None:
    """config, tokenizer, chat template, generation config: everything of θ_0's directory except weights/state."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name != "COMPLETE" and not f.name.startswith("."):
            shutil.copy2(f, dst / f.name)
    cfg_file = dst / "config.json"
    if dtype and cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in c:
                c[key] = dtype
        cfg_file.write_text(json.dumps(c, indent=2))


def _summary(cfg, p: Plan, per_tensor: list[dict], stats: dict, writer: ShardWriter, seconds: float) -> dict:
    fitted = [t for t in per_tensor if t["fitted"]]
    ev = sorted(t["explained_variance"] for t in fitted)
    numel = sum(t["numel"] for t in fitted)
    summary = {
        "mode": cfg.mode, "rank": cfg.rank, "target_step": cfg.target_step, "fit_window": cfg.fit_window,
        "base": str(p.base), "observed_steps": list(p.observed), "tied_head": p.tied_head,
        "tensors_fitted": len(fitted), "tensors_kept_at_base": len(per_tensor) - len(fitted),
        "explained_variance": {
            "mean": sum(ev) / len(ev) if ev else None, "median": ev[len(ev) // 2] if ev else None,
            "min": ev[0] if ev else None,
            "param_weighted": sum(t["explained_variance"] * t["numel"] for t in fitted) / numel if numel else None},
        "output_shards": len(writer.files), "seconds": round(seconds, 2),
    }
    if p.target_dir is not None and stats["true_sq"] > 0:
        # ‖Δ̂ - Δ(s*)‖ / ‖Δ(s*)‖ over all fitted tensors, and the same for "just use the last observed checkpoint"
        summary["vs_actual"] = {
            "checkpoint": str(p.target_dir),
            "relative_error": math.sqrt(stats["err_sq"] / stats["true_sq"]),
            "last_observed_relative_error": math.sqrt(stats["last_err_sq"] / stats["true_sq"])}
    return summary


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="extrapolate")
def main(cfg: DictConfig) -> None:
    from grail_exp.errors import exit_on_user_error

    with exit_on_user_error(extra=(ExtrapolateError,)):
        report = extrapolate(cfg)
        ev = report["explained_variance"]
        lines = [f"RELEX {report['mode']}: {report['tensors_fitted']} tensors, rank {report['rank']}, "
                 f"observed steps {_short(report['observed_steps'])} -> step {report['target_step']} "
                 f"in {report['seconds']:.1f} s",
                 f"explained variance of rank {report['rank']}: mean {ev['mean']:.4f}, median {ev['median']:.4f}, "
                 f"min {ev['min']:.4f}, parameter-weighted {ev['param_weighted']:.4f}"]
        if "vs_actual" in report:
            v = report["vs_actual"]
            lines.append(f"vs the real step-{report['target_step']} checkpoint: relative weight error "
                         f"{v['relative_error']:.4f} (last observed checkpoint: {v['last_observed_relative_error']:.4f})")
        lines.append(f"wrote {cfg.output} (relex.json has per-tensor details); evaluate it with:\n"
                     f"  python -m grail_exp.evaluate model.name_or_path={cfg.output}")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
