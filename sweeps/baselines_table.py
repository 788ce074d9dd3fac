"""Collect a baselines multirun (sweeps/baselines_cpu.sh) into results/baselines.md: accuracy after RL per preset
and seed, and the paired difference against GRPO on the same seed.

    python sweeps/baselines_table.py <sweep dir> <output.md>
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import yaml


def collect(sweep: Path) -> dict[tuple[str, int], dict]:
    rows = {}
    for f in sorted(sweep.glob("*/metrics.json")):
        m = json.loads(f.read_text())["metrics"]
        over = yaml.safe_load((f.parent / ".hydra" / "overrides.yaml").read_text())
        kv = dict(o.split("=", 1) for o in over)
        rows[(kv["experiment"].split("/")[-1].removesuffix("_cpu"), int(kv["seed"]))] = m
    return rows


def render(rows: dict) -> str:
    names = sorted({n for n, _ in rows}, key=lambda n: (n != "grpo", n))
    seeds = sorted({s for _, s in rows})
    out = ["| preset | seed | acc@4 before | acc@4 after | pass@4 after | Δ acc vs grpo (same seed) | RL wall (s) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    summary = ["| preset | mean acc@4 after | seeds | mean paired Δ vs grpo | Δ range |", "|---|---:|---:|---:|---:|"]
    for n in names:
        deltas, accs = [], []
        for s in seeds:
            if (n, s) not in rows:
                continue
            m = rows[(n, s)]
            a = m["eval/arithmetic/acc"]
            accs.append(a)
            ref = rows.get(("grpo", s))
            d = a - ref["eval/arithmetic/acc"] if ref and n != "grpo" else None
            if d is not None:
                deltas.append(d)
            before = m.get("eval_before/arithmetic/acc")
            out.append(f"| {n} | {s} | {'' if before is None else f'{100 * before:.1f}'} | {100 * a:.1f} | "
                       f"{100 * m.get('eval/arithmetic/pass_at_4', float('nan')):.1f} | "
                       f"{'' if d is None else f'{100 * d:+.1f}'} | {m.get('phase/train_s', 0):.0f} |")
        rng = f"[{100 * min(deltas):+.1f}, {100 * max(deltas):+.1f}]" if deltas else ""
        md = f"{100 * statistics.mean(deltas):+.1f}" if deltas else ""
        summary.append(f"| {n} | {100 * statistics.mean(accs):.1f} | {len(accs)} | {md} | {rng} |")
    return "\n".join(out) + "\n\n" + "\n".join(summary) + "\n"


if __name__ == "__main__":
    sweep, dest = Path(sys.argv[1]), Path(sys.argv[2])
    table = render(collect(sweep))
    print(table)
    dest.write_text(table)
