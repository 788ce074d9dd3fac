"""Which answer forms each extraction mode accepts, measured on the MATH-500 golds.

    python sweeps/bench_extraction.py                     # writes results/extraction_modes.md
    python sweeps/bench_extraction.py --limit 50 --out /tmp/x.md

For every vendored MATH-500 gold ``g`` a few completions are crafted that state ``g`` in a different way
(``\\boxed {g}`` with a space, ``\\fbox{g}``, one box per element of a list answer, an earlier box with another
value, an unterminated box before or after the answer, no box at all), and each is graded against ``g`` with
every concrete extraction rule of ``grail_exp.grading.extraction.RULES`` through ``MathVerifier`` (one worker, the hard
timeout of ``conf/config.yaml``). The table counts the completions graded correct.
Keep this module light: grading workers (spawn) import the parent's ``__main__``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# form -> (what it is, builder(gold, other gold) -> completion or None when the form does not apply)
FORMS = {
    "boxed": ("`\\boxed{g}` at the end", lambda g, w: f"Putting it together, the answer is $\\boxed{{{g}}}$."),
    "boxed_space": ("`\\boxed {g}` (a space), bare text", lambda g, w: f"Hence we get \\boxed {{{g}}}."),
    "boxed_space_math": ("`the answer is $\\boxed {g}$` (a space)",
                         lambda g, w: f"So the answer is $\\boxed {{{g}}}$."),
    "fbox": ("`\\fbox{g}`, bare text", lambda g, w: f"Hence we get \\fbox{{{g}}}."),
    "fbox_math": ("`the answer is $\\fbox{g}$`", lambda g, w: f"So the answer is $\\fbox{{{g}}}$."),
    "box_per_element": ("one box per element of a list gold (top-level commas only)",
                        lambda g, w: (", ".join(f"\\boxed{{{p.strip()}}}" for p in _top_level_split(g))
                                      if len(_top_level_split(g)) > 1 else None)),
    "earlier_box": ("`\\boxed{other}` first, then `\\boxed{g}`",
                    lambda g, w: f"A first attempt gives $\\boxed{{{w}}}$. Correcting it, the answer is $\\boxed{{{g}}}$."),
    "unterminated_before": ("an unterminated `\\boxed{` before `\\boxed{g}`",
                            lambda g, w: f"We try $\\boxed{{\\frac{{1}}{{2}}$ first. The answer is $\\boxed{{{g}}}$."),
    "unterminated_after": ("`\\boxed{g}`, then an unterminated `\\boxed{`",
                           lambda g, w: f"The answer is $\\boxed{{{g}}}$. Check: $\\boxed{{"),
    "unboxed": ("`the answer is $g$`, no box", lambda g, w: f"Therefore the answer is ${g}$."),
    "unboxed_no_anchor": ("`$g$`, no box, no \"answer\" phrase", lambda g, w: f"Hence we get ${g}$."),
}


def _top_level_split(gold: str) -> list[str]:
    """Split on commas outside any {} [] () pair (so intervals and tuples stay whole)."""
    parts, depth, cur = [], 0, ""
    for ch in gold:
        depth += ch in "{[(" and 1 or 0
        depth -= ch in "}])" and 1 or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def measure(limit: int | None = None, workers: int = 1) -> tuple[dict, dict, float]:
    from grail_exp.data.benchmarks import PAPER_BENCHMARKS
    from grail_exp.grading.extraction import RULES
    from grail_exp.grading.rewards import MathVerifier

    golds = [p.answer for p in PAPER_BENCHMARKS["math500"].load()][:limit]
    counts: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    t0 = time.perf_counter()
    with MathVerifier(num_workers=workers, hard_timeout_s=15.0, parse_timeout=5, verify_timeout=5) as mv:
        for form, (_, build) in FORMS.items():
            pairs = [(build(g, golds[(i + 1) % len(golds)]), g) for i, g in enumerate(golds)]
            pairs = [(c, g) for c, g in pairs if c is not None]
            totals[form] = len(pairs)
            counts[form] = {}
            for rule in RULES:
                res = mv.score([c for c, _ in pairs], [g for _, g in pairs], extraction=rule)
                counts[form][rule] = sum(r.correct for r in res)
    return counts, totals, time.perf_counter() - t0


def to_markdown(counts: dict, totals: dict, seconds: float, limit: int | None) -> str:
    from importlib.metadata import version

    from grail_exp.grading.extraction import RULES

    rules = list(RULES)
    lines = [
        "# Extraction modes on crafted MATH-500 completions",
        "",
        f"Completions graded correct against their own gold, per extraction rule (`python sweeps/bench_extraction.py"
        f"{f' --limit {limit}' if limit else ''}`; math-verify {version('math-verify')}; "
        f"{seconds:.0f} s). `paper_reward` / `paper_eval` are `reward.extraction=paper` / `benchmark.extraction=paper`.",
        "",
        "| form | n | " + " | ".join(rules) + " |",
        "|---|---:|" + "---:|" * len(rules),
    ]
    for form, (what, _) in FORMS.items():
        n = totals[form]
        lines.append(f"| {what} | {n} | " + " | ".join(f"{counts[form][r]} ({100 * counts[form][r] / max(n, 1):.0f} %)"
                                                         for r in rules) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N MATH-500 golds (default: all 500)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="results/extraction_modes.md")
    args = ap.parse_args(argv)
    counts, totals, seconds = measure(args.limit, args.workers)
    text = to_markdown(counts, totals, seconds, args.limit)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
