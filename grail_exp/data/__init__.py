"""Training datasets, benchmarks and prompt building.

Two registries, each ``name -> builder``:
- ``DATASETS``: training prompt sources (``data=`` group): ``arithmetic`` (generated), ``deepmath``
  (trl-lib/DeepMath-103K or any local file with the same fields), ``scrl_jsonl`` (SCRL curriculum files);
- ``BENCHMARKS``: evaluation sets (``benchmark=`` group), see ``benchmarks.py``.
A dataset may register the check of the files it reads (``DATASET_FILE_CHECKS``), which ``validate`` runs before
anything loads.
"""

from __future__ import annotations

from grail_exp.data.benchmarks import BENCHMARKS, load_benchmark, register_benchmark
from grail_exp.data.sources import DATASET_FILE_CHECKS, DATASETS, Problem, PromptSource, arithmetic_task, build_source
from grail_exp.registry import import_modules

import_modules(__name__, __path__)  # every module here registers its datasets and benchmarks (curriculum: scrl_jsonl)

__all__ = [
    "BENCHMARKS",
    "DATASETS",
    "DATASET_FILE_CHECKS",
    "Problem",
    "PromptSource",
    "arithmetic_task",
    "build_source",
    "load_benchmark",
    "register_benchmark",
]
