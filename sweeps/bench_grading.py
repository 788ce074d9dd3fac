"""Grading throughput: answers per second of the reward path (last ``\\boxed{}`` + math-verify).

    python sweeps/bench_grading.py                       # workers 0 (in-process), 1 and 2
    python sweeps/bench_grading.py --workers 1 2 --machine "2 cores, shared"

Grades typical completions with ``MathVerifier`` (the settings of ``conf/config.yaml``: hard timeout
15 s, math-verify parse/verify timeouts 5 s) and writes a Markdown table (default
``results/grading_throughput.md``). Workloads:

- MATH-500, right: each vendored gold answer boxed at the end of a short completion, graded against
  itself (500 answers of typical LaTeX: fractions, intervals, matrices, text);
- MATH-500, wrong: the same completions graded against the *next* row's gold (unequal answers are the
  slow path of math-verify, which tries several comparisons before giving up);
- arithmetic: the embedded task's reference solutions (``... \\boxed{42}``) of the test split, half of
  them with the boxed answer changed to a wrong one.

Worker start-up (importing sympy) is excluded: every pool grades one answer before the clock starts.
Keep this module light: grading workers (spawn) import the parent's ``__main__``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path


def _workloads(n_arithmetic: int) -> dict[str, tuple[list[str], list[str]]]:
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.data.benchmarks import PAPER_BENCHMARKS

    golds = [p.answer for p in PAPER_BENCHMARKS["math500"].load()]
    completions = [f"Putting everything together, the answer is $\\boxed{{{g}}}$." for g in golds]
    task = ArithmeticTask(num_test=n_arithmetic)
    ar_completions, ar_golds = [], []
    for i, p in enumerate(task.split("test")):
        sol = p.solution
        if i % 2:  # a wrong final answer
            sol = sol[: sol.rindex("\\boxed{")] + f"\\boxed{{{int(p.answer) + 1}}}"
        ar_completions.append(sol)
        ar_golds.append(p.answer)
    return {
        "MATH-500 golds, right": (completions, golds),
        "MATH-500 golds, wrong (next row's gold)": (completions, golds[1:] + golds[:1]),
        "arithmetic solutions, half wrong": (ar_completions, ar_golds),
    }


def _warmup() -> tuple[list[str], list[str]]:
    """Other benchmarks' gold answers (OlympiadBench), boxed: warms ANTLR's and math-verify's caches on LaTeX
    that none of the timed workloads contains, like a long-lived training pool."""
    from grail_exp.data.benchmarks import PAPER_BENCHMARKS

    golds = [p.answer for p in PAPER_BENCHMARKS["olympiadbench_200"].load()][:100]
    return ["\\boxed{" + g + "}" for g in golds], golds


def run(workers: list[int], n_arithmetic: int = 512, repeats: int = 3, hard_timeout_s: float = 15.0,
        parse_timeout: int = 5, verify_timeout: int = 5) -> list[dict]:
    """Time every workload with every worker count; one dict per (workload, workers).

    Each of the ``repeats`` passes starts a fresh pool (and, in-process, clears sympy's cache), so no pass
    grades answers that an earlier pass already parsed; the pool is warmed up on other LaTeX answers first.
    The median pass is reported.
    """
    from sympy.core.cache import clear_cache

    from grail_exp.grading.rewards import MathVerifier

    workloads = _workloads(n_arithmetic)
    warmup = _warmup()
    rows = []
    for w in workers:
        times: dict[str, list[float]] = {name: [] for name in workloads}
        results: dict[str, list] = {}
        for _ in range(repeats):
            clear_cache()
            with MathVerifier(num_workers=w, hard_timeout_s=hard_timeout_s, parse_timeout=parse_timeout,
                              verify_timeout=verify_timeout) as verifier:
                verifier.score(*warmup)  # start and warm up the workers (parser caches) off the clock
                for name, (completions, golds) in workloads.items():
                    start = time.perf_counter()
                    results[name] = verifier.score(completions, golds)
                    times[name].append(time.perf_counter() - start)
        for name, res in results.items():
            seconds = statistics.median(times[name])
            row = dict(workload=name, workers=w, answers=len(res), seconds=seconds, per_s=len(res) / seconds,
                       correct=sum(r.correct for r in res), timeouts=sum(r.status == "timeout" for r in res),
                       errors=sum(r.status == "error" for r in res))
            print(f"{name:42s} workers={w}  {row['answers']:4d} answers  "
                  f"passes {' '.join(f'{t:.2f}' for t in times[name])} s  {row['per_s']:7.1f}/s  "
                  f"correct {row['correct']}  timeouts {row['timeouts']}", flush=True)
            rows.append(row)
    return rows


def to_markdown(rows: list[dict], machine: str, command: str, repeats: int, load: tuple[float, float]) -> str:
    from importlib.metadata import version

    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Grading throughput",
        "",
        "Answers per second of the reward path (`grail_exp.grading.rewards.MathVerifier.score`: last `\\boxed{}`, then",
        "math-verify in worker processes; workers 0 = in the calling process, no hard timeout).",
        f"Seconds: median of {repeats} passes, each with a fresh pool (cold sympy cache) warmed up on 100 OlympiadBench",
        "gold answers first (parser caches warm, as in a long-lived training pool). Worker start-up is excluded.",
        "Produced by `sweeps/bench_grading.py`.",
        "",
        f"- date: {now}",
        f"- machine: {machine} ({platform.machine()}, {os.cpu_count()} CPUs visible); "
        f"1-min load average {load[0]:.2f} before, {load[1]:.2f} after",
        f"- math-verify {version('math-verify')}, sympy {version('sympy')}, Python {platform.python_version()}",
        "- grading settings: hard timeout 15 s, parse/verify timeouts 5 s (the `reward` defaults)",
        f"- command: `{command}`",
        "",
        "| workload | workers | answers | seconds | answers/s | correct | timeouts | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['workers']} | {r['answers']} | {r['seconds']:.2f} | {r['per_s']:.1f} | "
                     f"{r['correct']} | {r['timeouts']} | {r['errors']} |")
    totals: dict[int, list[float]] = {}
    for r in rows:
        t = totals.setdefault(r["workers"], [0, 0.0])
        t[0] += r["answers"]
        t[1] += r["seconds"]
    for w, (n, s) in totals.items():
        lines.append(f"| **all workloads** | {w} | {n} | {s:.2f} | **{n / s:.1f}** | | | |")
    lines += ["", "Timings on a shared machine vary by tens of percent between runs; compare rows of one table.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts to time (0 = in-process)")
    ap.add_argument("--arithmetic", type=int, default=512, help="arithmetic completions (test split size)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per workload (the median is reported)")
    ap.add_argument("--machine", default=f"{os.cpu_count()} cores", help='machine note, e.g. "2 cores, shared"')
    ap.add_argument("--output", default="results/grading_throughput.md", help="Markdown table to write ('-': none)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = run(args.workers, n_arithmetic=args.arithmetic, repeats=args.repeats)
    load = (load_before, os.getloadavg()[0])
    command = shlex.join(["python", "-m", "grail_exp.bench_grading", *(sys.argv[1:] if argv is None else argv)])
    text = to_markdown(rows, args.machine, command, args.repeats, load)
    if args.output != "-":
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
