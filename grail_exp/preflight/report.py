"""The preflight's one table and its exit code."""

from __future__ import annotations

from grail_exp.preflight.checks import Result

VERDICT = {True: "PASS", False: "FAIL", None: "n/a"}


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def render(results: list[Result], header: list[str] = ()) -> str:
    """The table (check, result, measured, expected / planned), then one line per failure naming the key that
    fixes it."""
    out = list(header)
    out += ["| check | result | measured | expected / planned |", "|---|---|---|---|"]
    out += [f"| {r.check} | {VERDICT[r.ok]} | {_cell(r.measured)} | {_cell(r.expected)} |" for r in results]
    failures = failure_lines(results)
    out.append("")
    out += failures if failures else ["preflight: every check passed"]
    return "\n".join(out)


def failure_lines(results: list[Result]) -> list[str]:
    """``FAIL <check>: <why> -> fix: <key>`` for each failed check (``fix: no config key`` when none does)."""
    lines = []
    for r in results:
        if r.ok is False:
            fix = f"set {r.key}" if r.key else "no config key (a fault of the code or the cluster)"
            lines.append(f"FAIL {r.check}: {r.why} -> fix: {fix}")
    return lines


def exit_code(results: list[Result]) -> int:
    """1 when any check failed, else 0 (checks not judged in this layout do not fail the preflight)."""
    return 1 if any(r.ok is False for r in results) else 0
