"""Function lengths: every function of the package (methods and nested functions included) over 60 and over 80 lines,
longest first, as ``file:line  lines  name``, then the two counts. A function's length is its physical lines from the
``def`` line to its last line, as ``ast`` reports them (decorators not counted; docstring and comments counted).
``tests/test_layout.py`` holds the package to a ceiling with the same measure.

    python sweeps/function_lengths.py                    # grail_exp/
    python sweeps/function_lengths.py grail_exp sweeps   # other folders or files, relative to the repository
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THRESHOLDS = (60, 80)


def function_lengths(source: str) -> list[tuple[int, int, str]]:
    """(lines, first line, qualified name) of every function defined in ``source``, in source order."""
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                found.append((child.end_lineno - child.lineno + 1, child.lineno, name))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def measure(paths: list[Path]) -> list[tuple[int, str, str]]:
    """(lines, ``file:line``, name) of every function under ``paths``, longest first."""
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    rows = []
    for f in files:
        rel = f.resolve().relative_to(ROOT).as_posix()
        rows += [(n, f"{rel}:{line}", name) for n, line, name in function_lengths(f.read_text())]
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["grail_exp"], help="folders or files (default: grail_exp)")
    args = parser.parse_args(argv)
    rows = measure([ROOT / p for p in args.paths])
    low, high = THRESHOLDS
    over = [r for r in rows if r[0] > low]
    width = max((len(r[1]) for r in over), default=0)
    for n, where, name in over:
        print(f"{where:<{width}}  {n:4d}  {name}{'  (over ' + str(high) + ')' if n > high else ''}")
    print(f"{len(rows)} functions; over {low} lines: {len(over)}; over {high} lines: {sum(r[0] > high for r in rows)}")


if __name__ == "__main__":
    main()
