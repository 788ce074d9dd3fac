"""Synthetic multi-step arithmetic word problems: the embedded default task.

A problem is a left-to-right chain such as ``Compute 15+75-48.``; the reference solution writes one
equation per step and ends in ``\\boxed{answer}``::

    15+75=90. 90-48=42. \\boxed{42}

Each step's result feeds the next, so an error in any intermediate step makes the final answer wrong.
That is the property token-level credit assignment is about: the reward is one bit for the whole
sequence, but only a few tokens (the wrong digit of one intermediate result) caused it.

Splits are deterministic functions of ``(seed, split, index)``. The validation and test sets are fixed
lists; the training stream is infinite and skips any problem that occurs in validation or test. ``train_seed``
(default: ``seed``) reorders the training stream alone, so that runs can see different problem orders while
being evaluated on the same held-out problems.

``solution_style`` writes the same steps in other words, for models that learn from worked examples rather than
from this generator's own supervised data (SmolLM2, ``experiment=real/chain_*``)::

    compact  15+75=90. 90-48=42. \\boxed{42}
    steps    Step 1: 15 + 75 = 90.  Step 2: 90 - 48 = 42.  The answer is \\boxed{42}.   (one line each)
    words    We go from left to right. First, 15+75=90. Finally, 90-48=42. So the answer is \\boxed{42}.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache

from grail_exp.errors import ConfigError

__all__ = ["ArithmeticProblem", "ArithmeticTask"]

# Stable per-split salts: adding a split must never change the problems of another one.
_SPLIT_SALT = {"train": 0, "validation": 1, "test": 2}
_WORDS = ("First", "Next", "Then")  # words style: the last step is always "Finally"


def render_solution(steps: list[tuple[int, str, int, int]], style: str = "compact") -> str:
    """A chain ``[(value, op, operand, result), ...]`` written out in ``style`` (compact | steps | words)."""
    final = steps[-1][3]
    if style == "compact":
        return " ".join(f"{a}{op}{b}={c}." for a, op, b, c in steps) + f" \\boxed{{{final}}}"
    if style == "steps":
        lines = [f"Step {i}: {a} {op} {b} = {c}." for i, (a, op, b, c) in enumerate(steps, 1)]
        return "\n".join(lines) + f"\nThe answer is \\boxed{{{final}}}."
    if style == "words":
        words = [_WORDS[min(i, 2)] for i in range(len(steps) - 1)] + ["Finally" if len(steps) > 1 else "First"]
        body = " ".join(f"{w}, {a}{op}{b}={c}." for w, (a, op, b, c) in zip(words, steps))
        return f"We go from left to right. {body} So the answer is \\boxed{{{final}}}."
    raise ConfigError(f"data.solution_style must be compact, steps or words, got {style!r}")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: the question text, the step-by-step reference solution and the gold answer."""

    question: str
    solution: str
    answer: str


@dataclass(frozen=True)
class ArithmeticTask:
    """Generator of arithmetic chains; every field is a difficulty knob from ``conf/data/arithmetic.yaml``."""

    min_steps: int = 2
    max_steps: int = 3
    max_operand: int = 99
    operators: str = "+-"
    allow_negative: bool = False
    question_template: str = "Compute {expr}."
    seed: int = 1234
    num_validation: int = 256
    num_test: int = 256
    train_seed: int | None = None  # the training stream's order; None = seed
    solution_style: str = "compact"

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(f"data.min_steps ({self.min_steps}) must be in [1, data.max_steps={self.max_steps}]")
        if self.max_operand < 1:
            raise ConfigError(f"data.max_operand must be >= 1, got {self.max_operand}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ConfigError(f"data.operators must be a non-empty subset of '+-*', got {self.operators!r}")
        render_solution([(1, "+", 1, 2)], self.solution_style)  # an unknown style fails here, naming the key

    # ------------------------------------------------------------------ generation
    def _rng(self, split: str, index: int) -> random.Random:
        # A string seed hashes deterministically (unlike hash() of a tuple across processes).
        seed = self.train_seed if split == "train" and self.train_seed is not None else self.seed
        key = f"{seed}:{_SPLIT_SALT[split]}:{index}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def sample(self, rng: random.Random) -> ArithmeticProblem:
        """Draw one problem; operations are evaluated left to right, as written in the solution."""
        n_ops = rng.randint(self.min_steps, self.max_steps)
        value = rng.randint(1, self.max_operand)
        expr, steps = str(value), []
        for _ in range(n_ops):
            op = rng.choice(self.operators)
            if op == "-" and not self.allow_negative:
                if value == 0:
                    op = "+"
                operand = rng.randint(1, min(value, self.max_operand)) if op == "-" else rng.randint(1, self.max_operand)
            elif op == "*":
                operand = rng.randint(2, 9)  # keep products in a range a tiny model can learn
            else:
                operand = rng.randint(1, self.max_operand)
            new = {"+": value + operand, "-": value - operand, "*": value * operand}[op]
            steps.append((value, op, operand, new))
            expr += f"{op}{operand}"
            value = new
        solution = render_solution(steps, self.solution_style)
        return ArithmeticProblem(self.question_template.format(expr=expr), solution, str(value))

    # ------------------------------------------------------------------ splits
    # B019: keyed by the frozen task's value on purpose (validation and the job build equal tasks and share the split);
    # at most 8 tasks are held.
    @lru_cache(maxsize=8)  # noqa: B019
    def split(self, name: str) -> tuple[ArithmeticProblem, ...]:
        """The fixed ``validation`` or ``test`` set (deduplicated, disjoint from each other)."""
        if name not in ("validation", "test"):
            raise ValueError(f"fixed splits are 'validation' and 'test', got {name!r}")
        size = self.num_validation if name == "validation" else self.num_test
        exclude = {p.question for p in self.split("validation")} if name == "test" else set()
        out, seen, i = [], set(), 0
        while len(out) < size:
            p = self.sample(self._rng(name, i))
            i += 1
            if p.question not in seen and p.question not in exclude:
                seen.add(p.question)
                out.append(p)
            if i > 50 * size + 1000:
                after = " besides the validation split's" if name == "test" else ""
                raise ConfigError(
                    f"data.num_{name}={size}: only {len(out)} distinct {name} problems{after} in {i} draws from "
                    f"data.min_steps={self.min_steps}, data.max_steps={self.max_steps}, data.max_operand="
                    f"{self.max_operand}, data.operators={self.operators!r}; lower data.num_{name} or widen those knobs")
        return tuple(out)

    @property
    def _held_out(self) -> frozenset[str]:
        return _held_out_questions(self)

    def train_problem(self, index: int) -> ArithmeticProblem:
        """The ``index``-th problem of the infinite training stream (held-out questions are skipped)."""
        attempt = 0
        while True:
            p = self.sample(self._rng("train", index * 1000 + attempt))
            if p.question not in self._held_out:
                return p
            attempt += 1
            if attempt == 100_000:  # the held-out splits cover (almost) every question these knobs can produce
                raise ConfigError(
                    f"data.num_validation={self.num_validation}, data.num_test={self.num_test}: the held-out splits "
                    f"leave no training problems for data.min_steps={self.min_steps}, data.max_steps="
                    f"{self.max_steps}, data.max_operand={self.max_operand}, data.operators={self.operators!r}; "
                    "lower them or widen those knobs")

    def train_problems(self, start: int, count: int) -> list[ArithmeticProblem]:
        return [self.train_problem(i) for i in range(start, start + count)]


@lru_cache(maxsize=8)
def _held_out_questions(task: ArithmeticTask) -> frozenset[str]:
    return frozenset(p.question for s in ("validation", "test") for p in task.split(s))
