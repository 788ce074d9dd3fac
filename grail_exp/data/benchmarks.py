"""Benchmark registry: ``name -> loader(cfg) -> list[Problem]``.

``arithmetic`` is the embedded task's fixed test split. The paper's six sets register here too
(one entry each), so evaluation code never special-cases a benchmark.
"""

from __future__ import annotations

from typing import Any, Callable

from grail_exp.data.sources import Problem, arithmetic_task

BENCHMARKS: dict[str, Callable[[Any], list[Problem]]] = {}


def register_benchmark(name: str):
    def deco(fn):
        if name in BENCHMARKS:
            raise ValueError(f"benchmark {name!r} registered twice")
        BENCHMARKS[name] = fn
        return fn

    return deco


@register_benchmark("arithmetic")
def _arithmetic(cfg) -> list[Problem]:
    """The held-out test split of the arithmetic task (same knobs as ``data=arithmetic``)."""
    from grail_exp.data.sources import DataConfigLike

    task = arithmetic_task(cfg.data if cfg.data.name == "arithmetic" else DataConfigLike())
    return [Problem(p.question, p.answer, {"solution": p.solution}) for p in task.split("test")]


def load_benchmark(name: str, cfg) -> list[Problem]:
    """Problems of a registered benchmark, cut to ``cfg.benchmark.limit`` when set."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {', '.join(sorted(BENCHMARKS))}")
    problems = BENCHMARKS[name](cfg)
    limit = cfg.benchmark.limit
    return problems[:limit] if limit else problems
