"""SCRL curricula: a problem rewritten as K verifiable subproblems, answered in order in ``<pj>…</pj>`` tags.

SCRL (arXiv 2605.22074 §3.1) shows all K subproblems ``s⁽¹⁾…s⁽ᴷ⁾`` in one curriculum prompt ``t_K(x)`` (the last
one is the original problem ``x``) and asks for the answers in order: ``<p1> a⁽¹⁾ </p1> … <pK> a⁽ᴷ⁾ </pK>``.

Where curricula come from:
- ``data=arithmetic``: exact and free. Every intermediate result of the chain ``15+75-48`` is a verifiable
  subproblem (``Compute 15+75.`` → 90, ``Compute 15+75-48.`` → 42), so K = the number of operations.
- ``data=scrl_jsonl``: a curriculum file built offline (the paper uses an external LLM on reference solutions).
  One JSON object per line::

      {"problem": "<original problem>", "answer": "<gold>",
       "subproblems": [{"question": "<s1>", "answer": "<a1>"}, ..., {"question": "<sK>", "answer": "<aK>"}]}

  ``subproblems`` are ordered easy → hard and the last one *is* the original problem (its answer must equal
  ``answer``). ``data.num_subproblems`` (paper: 4; null = any K) is checked per line. A tiny sample ships in
  ``grail_exp/data/curriculum_files/sample.jsonl``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from grail_exp.data.jsonl import iter_jsonl_objects
from grail_exp.data.sources import Problem, register_dataset
from grail_exp.errors import UserError

__all__ = ["Curriculum", "CurriculumError", "SAMPLE_FILE", "arithmetic_curriculum", "arithmetic_curriculum_solution",
           "curriculum_for", "load_curriculum_jsonl", "render_curriculum"]

SAMPLE_FILE = Path(__file__).parent / "curriculum_files" / "sample.jsonl"
# Datasets whose problems come with curricula (estimator=scrl checks data.name against this).
CURRICULUM_DATASETS = ("arithmetic", "scrl_jsonl")

_CHAIN = re.compile(r"\d+(?:[+\-*]\d+)+")
_STEP = re.compile(r"([+\-*])(\d+)")


class CurriculumError(UserError, ValueError):
    """A curriculum file or setting that cannot work; the message names the file and line, or the key."""


@dataclass(frozen=True)
class Curriculum:
    questions: tuple[str, ...]  # s⁽¹⁾ … s⁽ᴷ⁾, the last = the original problem
    answers: tuple[str, ...]  # a⁽¹⁾ … a⁽ᴷ⁾, the last = the original gold answer

    @property
    def K(self) -> int:
        return len(self.questions)


def _chain_values(question: str) -> tuple[str, list[tuple[str, int, int, int]]]:
    """The chain expression in ``question`` and its left-to-right steps ``(op, left, operand, result)``."""
    m = _CHAIN.search(question)
    if m is None:
        raise CurriculumError(f"no arithmetic chain like '15+75-48' in the question {question!r}")
    expr = m.group(0)
    head = re.match(r"\d+", expr).group(0)
    value, steps = int(head), []
    for op, operand in _STEP.findall(expr[len(head):]):
        new = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
        steps.append((op, value, int(operand), new))
        value = new
    return expr, steps


def arithmetic_curriculum(question: str) -> Curriculum:
    """The exact curriculum of an arithmetic chain: subproblem j computes the first j operations."""
    expr, steps = _chain_values(question)
    head = re.match(r"\d+", expr).group(0)
    prefix, questions, answers = head, [], []
    for op, _, operand, result in steps:
        prefix += f"{op}{operand}"
        questions.append(question.replace(expr, prefix, 1))
        answers.append(str(result))
    return Curriculum(tuple(questions), tuple(answers))


def arithmetic_curriculum_solution(question: str) -> str:
    """The reference curriculum completion (warm start): each step's equation, then its result in ``<pj>``."""
    _, steps = _chain_values(question)
    return " ".join(f"{left}{op}{operand}={result}. <p{j}>{result}</p{j}>"
                    for j, (op, left, operand, result) in enumerate(steps, start=1))


def render_curriculum(c: Curriculum, prompt_template: str, subproblem_template: str) -> str:
    """The curriculum prompt ``t_K(x)``: all K subproblems at once (``{subproblems}``, one line each)."""
    lines = "\n".join(subproblem_template.format(j=j, question=q) for j, q in enumerate(c.questions, start=1))
    return prompt_template.format(subproblems=lines, K=c.K)


def curriculum_for(problem: Problem, data_name: str) -> Curriculum:
    """A problem's curriculum: shipped with it (``meta['curriculum']``) or, on arithmetic, generated."""
    c = problem.meta.get("curriculum") if problem.meta else None
    if c is not None:
        return c
    if data_name == "arithmetic":
        return arithmetic_curriculum(problem.question)
    raise CurriculumError(f"data.name={data_name!r} has no curricula; estimator=scrl needs one of "
                          f"{', '.join(CURRICULUM_DATASETS)}")


# ---------------------------------------------------------------------------------------------- JSONL files
def _text(path, lineno, obj, key, where=""):
    v = obj.get(key)
    if not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
        raise CurriculumError(f"{path}:{lineno}: {where}{key!r} must be a non-empty string, got {v!r}")
    return str(v).strip()


def load_curriculum_jsonl(path: str | Path, num_subproblems: int | None = None) -> list[Problem]:
    """Problems with ``meta['curriculum']``; errors name ``file:line`` and the key."""
    path = Path(path)
    if not path.is_file():
        raise CurriculumError(f"data.path={str(path)!r}: no such curriculum file")
    out = []
    for lineno, row in iter_jsonl_objects(path, error=CurriculumError):
        problem, answer = _text(path, lineno, row, "problem"), _text(path, lineno, row, "answer")
        subs = row.get("subproblems")
        if not isinstance(subs, list) or not subs:
            raise CurriculumError(f"{path}:{lineno}: 'subproblems' must be a non-empty list, got {subs!r}")
        if num_subproblems is not None and len(subs) != num_subproblems:
            raise CurriculumError(f"{path}:{lineno}: 'subproblems' has {len(subs)} entries; data.num_subproblems="
                                  f"{num_subproblems}")
        qs, ans = [], []
        for j, s in enumerate(subs):
            if not isinstance(s, dict):
                raise CurriculumError(f"{path}:{lineno}: subproblems[{j}] must be an object with 'question' and "
                                      f"'answer', got {s!r}")
            qs.append(_text(path, lineno, s, "question", f"subproblems[{j}]."))
            ans.append(_text(path, lineno, s, "answer", f"subproblems[{j}]."))
        if ans[-1] != answer:
            raise CurriculumError(f"{path}:{lineno}: subproblems[{len(subs) - 1}].answer {ans[-1]!r} must equal "
                                  f"'answer' {answer!r} (the last subproblem is the original problem)")
        out.append(Problem(problem, answer, meta={"curriculum": Curriculum(tuple(qs), tuple(ans))}))
    if not out:
        raise CurriculumError(f"{path}: no curriculum rows")
    return out


class CurriculumSource:
    """A curriculum file, cycled in file order by index (deterministic resume)."""

    def __init__(self, data_cfg):
        self.rows = load_curriculum_jsonl(data_cfg.path or SAMPLE_FILE, data_cfg.get("num_subproblems"))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Problem:
        return self.rows[index % len(self.rows)]


def check_curriculum_file(data_cfg) -> list[str]:
    """``data.path`` (null = the shipped sample): the whole file read as training will read it, so a missing file or
    a malformed line is one problem naming the key, the file and the line."""
    if data_cfg.path is None:
        return []
    path = Path(str(data_cfg.path)).expanduser()
    if not path.is_file():
        return [f"data.path = {str(data_cfg.path)!r}: no such curriculum file (one JSON object per line: problem, "
                "answer, subproblems)"]
    try:
        load_curriculum_jsonl(path, data_cfg.get("num_subproblems"))
    except CurriculumError as exc:
        return [f"data.path = {str(data_cfg.path)!r}: {exc}"]
    return []


@register_dataset("scrl_jsonl", check_files=check_curriculum_file)
def _scrl_jsonl(data_cfg):
    return CurriculumSource(data_cfg)
