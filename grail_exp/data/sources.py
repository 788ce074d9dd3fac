"""Training prompt sources: an indexable stream of ``Problem``s, position = index (exact resume)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from grail_exp.data.arithmetic import ArithmeticTask
from grail_exp.errors import ConfigError, DataError
from grail_exp.registry import Registry


@dataclass(frozen=True)
class Problem:
    question: str  # the problem text shown to the model (before the instruction suffix)
    answer: str  # gold answer, graded with math-verify
    meta: dict = field(default_factory=dict, hash=False, compare=False)


class PromptSource(Protocol):
    def __getitem__(self, index: int) -> Problem: ...


# name -> builder(data_cfg, seed=run seed, prompts_per_step=P) -> PromptSource
DATASETS: Registry = Registry("dataset (data.name)")
# name -> check(data_cfg) -> problems: the files the source will read, checked by validate() before anything loads
# (one line per problem, naming data.path, the file and the line)
DATASET_FILE_CHECKS: dict[str, Callable[..., list[str]]] = {}


def register_dataset(name: str, check_files: Callable[..., list[str]] | None = None):
    def attach(fn) -> None:
        if check_files is not None:
            DATASET_FILE_CHECKS[name] = check_files

    return DATASETS.register(name, then=attach)


def arithmetic_task(data_cfg) -> ArithmeticTask:
    """The ``ArithmeticTask`` described by a ``data=arithmetic``-style config node."""
    return ArithmeticTask(
        min_steps=data_cfg.min_steps, max_steps=data_cfg.max_steps, max_operand=data_cfg.max_operand,
        operators=data_cfg.operators, allow_negative=data_cfg.allow_negative, seed=data_cfg.seed,
        num_validation=data_cfg.num_validation, num_test=data_cfg.num_test,
        train_seed=data_cfg.get("train_seed"), solution_style=data_cfg.get("solution_style", "compact"),
    )


class ArithmeticSource:
    """The infinite, seeded training stream of the arithmetic task."""

    def __init__(self, task: ArithmeticTask):
        self.task = task

    def __getitem__(self, index: int) -> Problem:
        p = self.task.train_problem(index)
        return Problem(p.question, p.answer)


@register_dataset("arithmetic")
def _arithmetic(data_cfg, seed: int | None = None, prompts_per_step: int | None = None) -> PromptSource:
    if data_cfg.get("order", "shuffled") != "shuffled":
        raise ConfigError(f"data.order = {data_cfg.order!r}: the arithmetic stream is generated; "
                          "order=reference applies to hub datasets (data=deepmath)")
    return ArithmeticSource(arithmetic_task(data_cfg))


class HubSource:
    """A Hugging Face dataset (hub id, local directory or data file) in a fixed order, indexed by position.

    ``problem_field`` may hold plain text or a chat list (``[{"role": "user", "content": ...}]``, as in
    trl-lib/DeepMath-103K); the user turn's content is used.

    Order (``data.order``): ``shuffled`` = ``datasets.shuffle(seed=shuffle_seed)``, cycled. ``reference`` = the
    stream the GRAIL reference trained on (``ReferenceOrder``). Both are pure functions of the position, so a
    resumed run continues the same stream.
    """

    def __init__(self, data_cfg, seed: int | None = None, prompts_per_step: int | None = None):
        import datasets

        path = data_cfg.path
        if path is None:
            raise ConfigError("data.path is required for a hub dataset (hub id, local directory or file)")
        kind = LOCAL_DATA_FILES.get(str(path).rsplit(".", 1)[-1])
        try:
            if kind:  # a local data file
                ds = datasets.load_dataset(kind, data_files=str(path), split=data_cfg.split)
            else:
                ds = datasets.load_dataset(path, revision=data_cfg.revision, split=data_cfg.split)
        except Exception as exc:  # missing file, unknown hub id, no network, bad split or revision
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DataError(f"data.path={str(path)!r} (data.split={data_cfg.split!r}, data.revision="
                            f"{data_cfg.get('revision')!r}): cannot load the dataset: {type(exc).__name__}: {first}") from exc
        for f in (data_cfg.problem_field, data_cfg.answer_field):
            if f not in ds.column_names:
                raise ConfigError(f"dataset {path!r} has no field {f!r} (data.problem_field / data.answer_field); "
                                  f"fields: {ds.column_names}")
        self.ds = ds.shuffle(seed=data_cfg.shuffle_seed)
        self.problem_field, self.answer_field = data_cfg.problem_field, data_cfg.answer_field
        self.order = None
        if data_cfg.get("order", "shuffled") == "reference":
            sampler_seed = data_cfg.get("sampler_seed")
            sampler_seed = seed if sampler_seed is None else sampler_seed
            if sampler_seed is None or prompts_per_step is None:
                raise ValueError("data.order=reference needs the sampler seed (data.sampler_seed, or the run seed) and "
                                 "trainer.prompts_per_step: pass seed= and prompts_per_step= to build_source")
            self.order = ReferenceOrder(len(self.ds), int(prompts_per_step), int(sampler_seed))

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> Problem:
        # shuffled: cycle, so epochs continue deterministically; reference: the sampler's row for this position
        row = self.ds[index % len(self.ds) if self.order is None else self.order[index]]
        q = row[self.problem_field]
        if isinstance(q, list):  # chat format
            q = next(m["content"] for m in q if m.get("role") == "user")
        return Problem(str(q), str(row[self.answer_field]).strip())


class ReferenceOrder:
    """Row order of the GRAIL reference's prompt stream, on top of the ``datasets.shuffle(seed=42)`` rows.

    The reference (declare-lab/grail ``src/train/grail_trainer.py``, a fork of TRL's GRPOTrainer) draws its
    prompts through TRL's ``RepeatSampler`` (huggingface/trl ``trl/trainer/utils.py``) with
    ``batch_size = generation_batch_size // num_generations`` (= P = 32 prompts per rollout batch) and
    ``seed = args.seed``. Each pass over the data (``__iter__``) draws ``torch.randperm(n)`` from one
    ``torch.Generator`` seeded once, cuts it into chunks of P, drops the last incomplete chunk and yields each
    chunk for one rollout batch (its repeats serve the G samples and the mu x accumulation reuses). Rollout
    batch r therefore holds rows ``perm_e[j]`` for positions ``r * P .. r * P + P - 1`` of the epoch stream,
    with epochs of ``floor(n / P) * P`` positions and ``perm_e`` the e-th draw of the generator.
    """

    def __init__(self, n: int, prompts_per_step: int, seed: int):
        if n < prompts_per_step:
            raise ConfigError(f"trainer.prompts_per_step = {prompts_per_step}: the dataset has only {n} rows, so "
                              "the reference sampler would yield no batch at all")
        self.n, self.per_epoch = n, (n // prompts_per_step) * prompts_per_step
        self.seed = seed
        self._perms: list[list[int]] = []  # the generator's draws so far, one per epoch
        self._generator = None

    def __getitem__(self, index: int) -> int:
        import torch

        epoch, pos = divmod(index, self.per_epoch)
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        while len(self._perms) <= epoch:  # the sampler draws one permutation per pass, from the same generator
            self._perms.append(torch.randperm(self.n, generator=self._generator).tolist())
        return self._perms[epoch][pos]


LOCAL_DATA_FILES = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}  # suffix -> datasets builder


def check_hub_files(data_cfg) -> list[str]:
    """A local ``data.path`` (a .jsonl / .json / .parquet / .csv file, or a directory written like a path): it exists,
    parses, and every row has data.problem_field and data.answer_field. A hub id is left to the hub."""
    path = data_cfg.path
    if path is None:
        return ["data.path = None: required for a hub dataset (hub id, local directory or .jsonl/.json/.parquet/.csv "
                "file)"]
    kind, p = LOCAL_DATA_FILES.get(str(path).rsplit(".", 1)[-1]), Path(str(path)).expanduser()
    if kind is None:  # a hub id, or a dataset directory
        local = str(path).startswith(("/", "./", "../", "~"))
        return [f"data.path = {str(path)!r}: no such directory"] if local and not p.is_dir() else []
    if not p.is_file():
        return [f"data.path = {str(path)!r}: no such file"]
    fields = (data_cfg.problem_field, data_cfg.answer_field)
    problem = {"json": _json_rows_problem, "parquet": _parquet_problem, "csv": _csv_problem}[kind](p, fields)
    return [f"data.path = {str(path)!r}: {problem}"] if problem else []


def _missing(fields, have, where: str) -> str | None:
    missing = [f for f in fields if f not in have]
    return f"{where}: no field {missing[0]!r} (data.problem_field / data.answer_field)" if missing else None


def _json_rows_problem(p: Path, fields) -> str | None:
    """JSON Lines (one object per line), or one JSON array of objects (a .json file: datasets loads both)."""
    import json

    from grail_exp.data.jsonl import iter_jsonl_objects

    rows: list = []
    with open(p, encoding="utf-8") as f:
        is_array = p.suffix == ".json" and f.read(4096).lstrip().startswith("[")
    try:
        if is_array:
            rows = [(f"{p}: row {i}", r) for i, r in enumerate(json.loads(p.read_text(encoding="utf-8")))]
        else:
            rows = [(f"{p}:{lineno}", r) for lineno, r in iter_jsonl_objects(p, DataError)]
    except json.JSONDecodeError as exc:
        return f"{p}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})"
    except DataError as exc:
        return str(exc)
    for where, row in rows:
        problem = f"{where}: expected a JSON object" if not isinstance(row, dict) else _missing(fields, row, where)
        if problem:
            return problem
    return None if rows else f"{p}: no rows"


def _parquet_problem(p: Path, fields) -> str | None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(p).names
    except Exception as exc:  # noqa: BLE001 - not Parquet, truncated, unreadable: one line says which file
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{p}: not a readable Parquet file ({type(exc).__name__}: {first})"
    return _missing(fields, names, str(p))


def _csv_problem(p: Path, fields) -> str | None:
    import csv

    with open(p, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f), None)
    return f"{p}: empty (no header row)" if header is None else _missing(fields, header, f"{p}:1")


@register_dataset("deepmath", check_files=check_hub_files)
def _deepmath(data_cfg, seed: int | None = None, prompts_per_step: int | None = None) -> PromptSource:
    return HubSource(data_cfg, seed=seed, prompts_per_step=prompts_per_step)


def build_source(data_cfg, seed: int | None = None, prompts_per_step: int | None = None) -> PromptSource:
    """The training prompt stream of ``data_cfg``. ``seed`` / ``prompts_per_step``: the run's, needed by
    ``data.order=reference`` (the reference's sampler is seeded with the run seed and cuts batches of P)."""
    if data_cfg.name not in DATASETS:
        raise ConfigError(f"unknown data.name {data_cfg.name!r}; valid: {', '.join(sorted(DATASETS))}")
    return DATASETS[data_cfg.name](data_cfg, seed=seed, prompts_per_step=prompts_per_step)


class DataConfigLike:
    """Default arithmetic knobs, for evaluating the arithmetic benchmark when training on other data."""

    def __init__(self):
        d = ArithmeticTask()
        for k in ("min_steps", "max_steps", "max_operand", "operators", "allow_negative", "seed",
                  "num_validation", "num_test", "train_seed", "solution_style"):
            setattr(self, k, getattr(d, k))

    def get(self, key: str, default=None):  # read like a config node (arithmetic_task's optional keys)
        return getattr(self, key, default)
