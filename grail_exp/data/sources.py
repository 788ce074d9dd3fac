"""Training prompt sources: an indexable stream of ``Problem``s, position = index (exact resume)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from grail_exp.data.arithmetic import ArithmeticTask


@dataclass(frozen=True)
class Problem:
    question: str  # the problem text shown to the model (before the instruction suffix)
    answer: str  # gold answer, graded with math-verify
    meta: dict = field(default_factory=dict, hash=False, compare=False)


class PromptSource(Protocol):
    def __getitem__(self, index: int) -> Problem: ...


DATASETS: dict[str, Callable[[Any], PromptSource]] = {}


def register_dataset(name: str):
    def deco(fn):
        DATASETS[name] = fn
        return fn

    return deco


def arithmetic_task(data_cfg) -> ArithmeticTask:
    """The ``ArithmeticTask`` described by a ``data=arithmetic``-style config node."""
    return ArithmeticTask(
        min_steps=data_cfg.min_steps, max_steps=data_cfg.max_steps, max_operand=data_cfg.max_operand,
        operators=data_cfg.operators, allow_negative=data_cfg.allow_negative, seed=data_cfg.seed,
        num_validation=data_cfg.num_validation, num_test=data_cfg.num_test,
    )


class ArithmeticSource:
    """The infinite, seeded training stream of the arithmetic task."""

    def __init__(self, task: ArithmeticTask):
        self.task = task

    def __getitem__(self, index: int) -> Problem:
        p = self.task.train_problem(index)
        return Problem(p.question, p.answer)


@register_dataset("arithmetic")
def _arithmetic(data_cfg) -> PromptSource:
    return ArithmeticSource(arithmetic_task(data_cfg))


class HubSource:
    """A Hugging Face dataset (hub id, local directory or data file), shuffled once, cycled by index.

    ``problem_field`` may hold plain text or a chat list (``[{"role": "user", "content": ...}]``, as in
    trl-lib/DeepMath-103K); the user turn's content is used.
    """

    def __init__(self, data_cfg):
        import datasets

        path = data_cfg.path
        if path is None:
            raise ValueError("data.path is required for a hub dataset (hub id, local directory or file)")
        kind = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}.get(str(path).rsplit(".", 1)[-1])
        if kind:  # a local data file
            ds = datasets.load_dataset(kind, data_files=str(path), split=data_cfg.split)
        else:
            ds = datasets.load_dataset(path, revision=data_cfg.revision, split=data_cfg.split)
        for f in (data_cfg.problem_field, data_cfg.answer_field):
            if f not in ds.column_names:
                raise ValueError(f"dataset {path!r} has no field {f!r} (data.problem_field / data.answer_field); "
                                 f"fields: {ds.column_names}")
        self.ds = ds.shuffle(seed=data_cfg.shuffle_seed)
        self.problem_field, self.answer_field = data_cfg.problem_field, data_cfg.answer_field

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, index: int) -> Problem:
        row = self.ds[index % len(self.ds)]  # cycle: epochs continue deterministically
        q = row[self.problem_field]
        if isinstance(q, list):  # chat format
            q = next(m["content"] for m in q if m.get("role") == "user")
        return Problem(str(q), str(row[self.answer_field]).strip())


@register_dataset("deepmath")
def _deepmath(data_cfg) -> PromptSource:
    return HubSource(data_cfg)


def build_source(data_cfg) -> PromptSource:
    if data_cfg.name not in DATASETS:
        raise ValueError(f"unknown data.name {data_cfg.name!r}; valid: {', '.join(sorted(DATASETS))}")
    return DATASETS[data_cfg.name](data_cfg)


class DataConfigLike:
    """Default arithmetic knobs, for evaluating the arithmetic benchmark when training on other data."""

    def __init__(self):
        d = ArithmeticTask()
        for k in ("min_steps", "max_steps", "max_operand", "operators", "allow_negative", "seed",
                  "num_validation", "num_test"):
            setattr(self, k, getattr(d, k))
