"""GRAIL's token weights on SmolLM2's own completions, from a run's weight tables (<run dir>/weights/*.parquet):
a heatmap (one line per rollout, token position across, colour = weight) and the positional profile of the tokens
before the first box (the GRAIL paper's U-shape analysis), over every boxed rollout the probe ran on.

    python sweeps/real_model_weights.py outputs/real_model/run_grail_weights --out results/real_model
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from real_model_report import markdown  # sweeps/ is on sys.path when run as `python sweeps/...`


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("results/real_model"))
    ap.add_argument("--bins", type=int, default=10)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from grail_exp.plots import load_weight_frames, positional_profile

    df = load_weight_frames(args.run_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    key = ["step", "row"]
    boxed = df.loc[df.region == "answer", key].drop_duplicates()
    probed = df.merge(boxed, on=key)
    lengths = df.groupby(key)["length"].first()
    print(f"rollouts {len(lengths)}, boxed {len(boxed)}; completion length mean {lengths.mean():.0f}, "
          f"median {lengths.median():.0f}, range {lengths.min()}-{lengths.max()} tokens")

    # heatmap: boxed rollouts, sorted by length
    rows = [g for _, g in probed.groupby(key)]
    rows.sort(key=lambda g: len(g))
    width = max(len(g) for g in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, g in enumerate(rows):
        grid[i, g.position.to_numpy()] = g.weight.to_numpy()
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(rows) + 1.2))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", norm=LogNorm(vmin=0.5, vmax=5.0), interpolation="nearest")
    for i, g in enumerate(rows):  # mark where the answer span starts
        a = g.loc[g.region == "answer", "position"]
        if len(a):
            ax.plot([a.min() - 0.5] * 2, [i - 0.5, i + 0.5], color="k", lw=1)
    ax.set_xlabel("token position in the completion (black tick: start of the \\boxed{} span)")
    ax.set_ylabel("rollout (boxed, by length)")
    fig.colorbar(im, ax=ax, label="GRAIL weight w")
    fig.tight_layout()
    fig.savefig(args.out / "grail_weights_heatmap.png", dpi=110)

    # positional profile: every boxed rollout (the probe ran on all of them, A = 0 included)
    prof = positional_profile(df, bins=args.bins, require_answer=True, skip_zero_advantage=False)
    allrows = prof.groupby("bin").apply(lambda p: np.average(p.mean_weight, weights=p.n_tokens)).rename("mean_weight")
    counts = prof.groupby("bin")["n_tokens"].sum()
    table = allrows.to_frame().join(counts)
    table.index = [f"{(b + 0.5) / args.bins:.2f}" for b in table.index]
    print(markdown(table))
    (args.out / "grail_weights_profile.md").write_text(markdown(table) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([(b + 0.5) / args.bins for b in allrows.index], allrows.values, marker="o")
    ax.axhline(1.0, color="grey", ls=":")
    ax.set_xlabel("relative position before the first \\boxed{")
    ax.set_ylabel("mean GRAIL weight (pre-answer tokens)")
    ax.set_title(f"SmolLM2-135M, {len(boxed)} boxed rollouts, median {lengths.median():.0f} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "grail_weights_profile.png", dpi=110)


if __name__ == "__main__":
    main()
