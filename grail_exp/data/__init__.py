"""Training datasets, benchmarks and prompt building.

Two registries, each ``name -> builder``:
- ``DATASETS``: training prompt sources (``data=`` group): ``arithmetic`` (generated), ``deepmath``
  (trl-lib/DeepMath-103K or any local file with the same fields);
- ``BENCHMARKS``: evaluation sets (``benchmark=`` group), see ``benchmarks.py``.
"""

from __future__ import annotations

from grail_exp.data.benchmarks import BENCHMARKS, load_benchmark, register_benchmark
from grail_exp.data.sources import DATASETS, Problem, PromptSource, arithmetic_task, build_source

__all__ = [
    "BENCHMARKS",
    "DATASETS",
    "Problem",
    "PromptSource",
    "arithmetic_task",
    "build_source",
    "load_benchmark",
    "register_benchmark",
]
