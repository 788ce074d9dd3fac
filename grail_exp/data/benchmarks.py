"""Benchmark registry: ``name -> loader(cfg) -> list[Problem]``.

``arithmetic`` is the embedded task's fixed test split. The paper's six sets register here too
(one entry each), so evaluation code never special-cases a benchmark.

The paper's six sets (GRAIL paper, method spec §7.1) are vendored byte for byte in
``grail_exp/data/benchmark_files/`` (see ``MANIFEST.md`` there: provenance, sha256, fields). Each entry in
``PAPER_BENCHMARKS`` says which file it reads, which field holds the problem, how the gold answer is
obtained (``gold_rule``) and how many rows the file must have; a wrong count or a malformed row is an
error naming the file (and the line). Parsed files are cached per path, so repeated loads are cheap.

Gold answers are strings graded by ``grail_exp.grading.rewards`` (math-verify): ``verify(parse("$gold$"),
parse("$pred$"))``. Rules:

- ``aime24``: ``answer``, kept as the string (zero padding such as ``"025"`` is harmless: math-verify
  compares numbers);
- ``amc23``: ``answer`` is a JSON float (``27.0``), written as the integer string ``"27"``;
- ``math500``, ``college_math_200``: ``answer``;
- ``minerva_math``: the last ``\\boxed{}`` of ``solution`` (the file has no answer field);
- ``olympiadbench_200``: ``final_answer`` is a list of one string. ``benchmark.olympiad_gold=first``
  (default) uses ``final_answer[0]``; ``str`` uses ``str(final_answer)`` like the paper's evaluation
  (method spec §11.14): e.g. ``"['$\\\\frac{a b}{2}$']"``, against which the right answer, boxed, verifies
  in only 142 of the 200 rows (math-verify 0.9.0; the spec quotes 146).

Every ``Problem.meta`` records ``benchmark``, ``index`` (0-based row = line number - 1), ``id`` (the file's
own id, if any), ``gold_rule`` and ``free_form`` (the reason from ``FREE_FORM`` or None).

``FREE_FORM`` lists the rows whose gold answer does not even verify against itself when boxed
(``score(["\\boxed{" + gold + "}"], [gold])``): no completion can score on them.
``tests/test_benchmarks.py`` pins the list so that it stays exact. Passing the self-check is necessary,
not sufficient: CollegeMATH's sentence answers pass because math-verify pulls the same fragment out of
both sides; against such a gold a right answer can be graded wrong (and a fragment right).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grail_exp.data.jsonl import iter_jsonl_objects
from grail_exp.data.sources import Problem, arithmetic_task
from grail_exp.errors import ConfigError, UserError
from grail_exp.registry import Registry

BENCHMARKS: Registry = Registry("benchmark")
# name -> "test" | "validation". Hyper-parameter search (grail_exp.tune) may only select on validation splits.
BENCHMARK_SPLITS: dict[str, str] = {}

DATA_DIR = Path(__file__).with_name("benchmark_files")  # the vendored JSONL files and MANIFEST.md

OLYMPIAD_GOLD_RULES = ("first", "str")  # benchmark.olympiad_gold: final_answer[0] | str(final_answer)


def register_benchmark(name: str, split: str = "test"):
    if split not in ("test", "validation"):
        raise ValueError(f"benchmark {name!r}: split must be 'test' or 'validation', got {split!r}")

    def attach(fn) -> None:
        BENCHMARK_SPLITS[name] = split

    return BENCHMARKS.register(name, then=attach)


@register_benchmark("arithmetic")
def _arithmetic(cfg) -> list[Problem]:
    """The held-out test split of the arithmetic task (same knobs as ``data=arithmetic``)."""
    from grail_exp.data.sources import DataConfigLike

    task = arithmetic_task(cfg.data if cfg.data.name == "arithmetic" else DataConfigLike())
    return [Problem(p.question, p.answer, {"solution": p.solution}) for p in task.split("test")]


@register_benchmark("arithmetic_val", split="validation")
def _arithmetic_val(cfg) -> list[Problem]:
    """The validation split of the arithmetic task (``data.num_validation`` problems, disjoint from the test split
    and from training): what hyper-parameter search selects on (``benchmark=arithmetic_val``)."""
    from grail_exp.data.sources import DataConfigLike

    task = arithmetic_task(cfg.data if cfg.data.name == "arithmetic" else DataConfigLike())
    return [Problem(p.question, p.answer, {"solution": p.solution}) for p in task.split("validation")]


def load_benchmark(name: str, cfg) -> list[Problem]:
    """Problems of a registered benchmark, cut to ``cfg.benchmark.limit`` when set."""
    if name not in BENCHMARKS:
        raise ConfigError(f"benchmark.names: unknown benchmark {name!r}; valid: {', '.join(sorted(BENCHMARKS))}")
    problems = BENCHMARKS[name](cfg)
    limit = cfg.benchmark.limit
    return problems[:limit] if limit else problems


# ---------------------------------------------------------------------------------------------- files
class BenchmarkDataError(UserError, ValueError):
    """A vendored benchmark file that is missing, has the wrong row count or a malformed row."""


@functools.cache
def read_jsonl(path: str) -> tuple[dict, ...]:
    """Parsed rows of a JSONL file (cached per path: treat the rows as read-only).

    Raises ``BenchmarkDataError`` naming the file and line for a line that is not a JSON object.
    """
    # Blank lines are errors here: a row's index must stay its line number - 1.
    return tuple(row for _, row in iter_jsonl_objects(path, BenchmarkDataError, skip_blank=False))


# ---------------------------------------------------------------------------------------------- gold rules
class _RowError(ValueError):
    """A problem with one row; the loader adds file and line."""


def _field(row: dict, name: str, types: type | tuple[type, ...]) -> Any:
    if name not in row:
        raise _RowError(f"missing field {name!r}")
    value = row[name]
    if not isinstance(value, types) or isinstance(value, bool):
        want = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise _RowError(f"field {name!r} must be {want}, got {type(value).__name__} {value!r:.60}")
    return value


def _gold_string(row: dict, name: str) -> str:
    gold = _field(row, name, str)
    if not gold.strip():
        raise _RowError(f"field {name!r} is empty")
    return gold


def _gold_integral_number(row: dict, name: str) -> str:
    value = _field(row, name, (int, float))
    if not math.isfinite(value):
        raise _RowError(f"field {name!r} is not finite: {value!r}")
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _gold_last_boxed(row: dict, name: str) -> str:
    from grail_exp.grading.boxed import extract_last_boxed

    text = _field(row, name, str)
    gold = extract_last_boxed(text)
    if gold is None or not gold.strip():
        raise _RowError(f"field {name!r} has no non-empty balanced \\boxed{{...}}")
    return gold


def _gold_list(row: dict, name: str, rule: str) -> str:
    value = _field(row, name, list)
    if not value or not all(isinstance(v, str) for v in value):
        raise _RowError(f"field {name!r} must be a non-empty list of strings, got {value!r:.60}")
    if rule == "first":
        return value[0]
    return str(value)  # the paper's evaluation (method spec §11.14): "['$...$']"


def _olympiad_rule(cfg) -> str:
    rule = getattr(getattr(cfg, "benchmark", None), "olympiad_gold", "first")
    if rule not in OLYMPIAD_GOLD_RULES:
        raise ConfigError(f"benchmark.olympiad_gold = {rule!r}: must be one of: {', '.join(OLYMPIAD_GOLD_RULES)}")
    return rule


@dataclass(frozen=True)
class BenchmarkSpec:
    """One vendored evaluation set: where it is, what to read, how many rows it must have."""

    name: str
    file: str  # file name in DATA_DIR
    rows: int  # expected row count (the paper's eval script asserts the same counts)
    problem_field: str
    gold_field: str
    gold_kind: str  # string | integral_number | last_boxed | list
    data_dir: Path = DATA_DIR  # tests point this elsewhere

    @property
    def path(self) -> Path:
        return Path(self.data_dir) / self.file

    def gold_rule(self, cfg=None) -> str:
        """Human-readable rule, recorded in every Problem's meta."""
        return self._rule(_olympiad_rule(cfg) if self.gold_kind == "list" else None)

    def _rule(self, list_rule: str | None) -> str:
        f = self.gold_field
        if self.gold_kind == "string":
            return f
        if self.gold_kind == "integral_number":
            return f"{f} (number, integral -> integer string)"
        if self.gold_kind == "last_boxed":
            return f"last \\boxed{{}} of {f}"
        return f"{f}[0]" if list_rule == "first" else f"str({f})"

    def gold(self, row: dict, cfg=None) -> str:
        """The gold answer of one row (raises ``ValueError`` for a malformed row)."""
        return self._gold(row, _olympiad_rule(cfg) if self.gold_kind == "list" else None)

    def _gold(self, row: dict, list_rule: str | None) -> str:
        if self.gold_kind == "string":
            return _gold_string(row, self.gold_field)
        if self.gold_kind == "integral_number":
            return _gold_integral_number(row, self.gold_field)
        if self.gold_kind == "last_boxed":
            return _gold_last_boxed(row, self.gold_field)
        return _gold_list(row, self.gold_field, list_rule)

    def load(self, cfg=None) -> list[Problem]:
        """All problems, in file order. Checks the row count and every row; errors name file and line."""
        path = str(self.path)
        if not self.path.is_file():
            raise BenchmarkDataError(f"{self.name}: data file {path} is missing (it ships with the package)")
        rows = read_jsonl(path)
        if len(rows) != self.rows:
            raise BenchmarkDataError(f"{self.name}: {path} has {len(rows)} rows, expected {self.rows}")
        list_rule = _olympiad_rule(cfg) if self.gold_kind == "list" else None
        rule = self._rule(list_rule)
        free = FREE_FORM.get(self.name, {})
        problems = []
        for i, row in enumerate(rows):
            try:
                question = _field(row, self.problem_field, str)
                gold = self._gold(row, list_rule)
            except _RowError as exc:
                raise BenchmarkDataError(f"{self.name}: {path}:{i + 1}: {exc}") from None
            meta = {"benchmark": self.name, "index": i, "id": row.get("id"), "gold_rule": rule,
                    "free_form": free.get(i)}
            problems.append(Problem(question, gold, meta))
        return problems


PAPER_BENCHMARKS: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        BenchmarkSpec("math500", "math500.jsonl", 500, "problem", "answer", "string"),
        BenchmarkSpec("aime24", "aime24.jsonl", 30, "problem", "answer", "string"),
        BenchmarkSpec("amc23", "amc23.jsonl", 40, "problem", "answer", "integral_number"),
        BenchmarkSpec("minerva_math", "minerva_math.jsonl", 272, "problem", "solution", "last_boxed"),
        BenchmarkSpec("college_math_200", "college_math_200.jsonl", 200, "problem", "answer", "string"),
        BenchmarkSpec("olympiadbench_200", "olympiadbench_200.jsonl", 200, "problem", "final_answer", "list"),
    )
}

def check_benchmark_files(cfg) -> list[str]:
    """Every vendored benchmark ``benchmark.names`` names, read as evaluation will read it (row count, fields, gold
    rule; rows are cached), for ``validate`` before anything loads: one problem per file, naming the file and line."""
    e = []
    for name in cfg.benchmark.names:
        spec = PAPER_BENCHMARKS.get(str(name))
        try:
            if spec is not None:
                spec.load(cfg)
        except BenchmarkDataError as exc:
            e.append(f"benchmark.names = {str(name)!r}: {exc}")
        except ConfigError:  # benchmark.olympiad_gold: reported by validate with the key
            pass
    return e


for _spec in PAPER_BENCHMARKS.values():
    register_benchmark(_spec.name)(_spec.load)
del _spec


# ---------------------------------------------------------------------------------------------- free-form rows
# Rows (0-based index = line - 1) whose gold answer, boxed, does NOT verify against itself with
# math-verify 0.9.0 (grail_exp.grading.boxed.extract_last_boxed + grail_exp.grading.rewards.grade_one). A model cannot score on them
# under rule-based grading. Pinned by tests/test_benchmarks.py: a row may leave this list only when it
# starts verifying, and every listed row must still fail.
FREE_FORM: dict[str, dict[int, str]] = {
    "college_math_200": {
        26: "piecewise function written with an unmatched \\left\\{ ... \\right.: its raw `{` unbalances "
            "\\boxed{}, so the brace-counting extractor finds no box (no_answer)",
        110: "a system of three ODEs in an align* environment: math-verify extracts nothing from it",
    },
    "minerva_math": {
        86: "the boxed gold ends with a newline (`I(0) e^{-\\frac{t}{R C}}\\n`): math-verify's `$...$` "
            "pattern does not span a newline, so it parses to nothing (stripped, it verifies)",
    },
}
