"""GRAIL's token weights on SmolLM2's own completions, from weight tables (``weights/step_*.parquet`` of a run
directory or of a study arm's folder): a heatmap (one line per rollout, token position across, colour = weight), the
positional profile of the tokens before the first box (the GRAIL paper's U-shape analysis) and, where the tables
carry the token ids, an HTML heatmap of a few completions with their text.

    python sweeps/real_model_weights.py outputs/real_model/run_grail_weights --out results/real_model
    python sweeps/real_model_weights.py results/real_model_study/<study>/*-grail-s* --out <dir> \
        --min-length 40 --max-length 150          # the study's GRAIL arms, rollouts of 40-150 tokens

With several folders the rollouts of all of them are pooled. ``--min-length`` / ``--max-length`` keep the rollouts
of that many completion tokens. The profile uses every boxed rollout the tables hold, A = 0 included; the study's
arms (skip_zero_advantage: true, symmetry: wrong) leave correct and A = 0 rollouts at weight 1 (their boxed content
at w_max by the overrides, which multiplies A = 0), so ``--wrong-only`` (the default for study folders) profiles and
shows the rollouts GRAIL actually reweighted: wrong, A != 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from real_model_report import markdown  # sweeps/ is on sys.path when run as `python sweeps/...`


def load(folders: list[Path], min_length: int, max_length: int):
    import pandas as pd

    from grail_exp.plots import load_weight_frames

    frames = []
    for i, folder in enumerate(folders):
        df = load_weight_frames(folder)
        if df is not None:  # rows of different folders stay apart
            frames.append(df.assign(row=df["row"] + 1_000_000 * i, source=folder.name))
    if not frames:
        raise SystemExit(f"no weight tables (weights/step_*.parquet) under {', '.join(map(str, folders))}")
    df = pd.concat(frames, ignore_index=True)
    return df[(df["length"] >= min_length) & (df["length"] <= max_length)]


def tokenizer_for(folder: Path):
    """The tokenizer of a study arm (its arm.json's model.name_or_path) or None when the folder is not an arm."""
    record = folder / "arm.json"
    if not record.is_file():
        return None
    from transformers import AutoTokenizer

    from grail_exp.packaged_models import is_packaged_model, resolve

    name = json.loads(record.read_text())["config"]["model.name_or_path"]
    if is_packaged_model(name):
        import os

        name = resolve(name, os.environ.get("GRAIL_EXP_CACHE", str(Path.home() / ".cache/grail_exp")))
    return AutoTokenizer.from_pretrained(name)


def text_heatmap(df, tokenizer, path: Path, per_outcome: int = 3) -> None:
    """``per_outcome`` wrong and correct rollouts of the last table that has rollouts with A != 0 (a table of
    zero-variance groups only shows weights that multiply nothing), their tokens coloured by weight (HTML)."""
    from grail_exp.viz import weights_html

    live = df[df["advantage"] != 0]
    source = live if not live.empty else df
    last = source[source["step"] == source["step"].max()]
    rows = []
    for correct in (False, True):
        keys = last.loc[last["correct"] == correct, "row"].drop_duplicates().head(per_outcome)
        for r in keys:
            g = last[last["row"] == r].sort_values("position")
            rows.append({"tokens": [tokenizer.decode([int(t)]) for t in g["token_id"]],
                         "weights": g["weight"].tolist(), "advantage": float(g["advantage"].iloc[0])})
    path.write_text(weights_html(rows, title=f"GRAIL token weights, step {int(last['step'].iloc[0])}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", type=Path, nargs="+", help="run directories or study arm folders")
    ap.add_argument("--out", type=Path, default=Path("results/real_model"))
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--min-length", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=10**9)
    ap.add_argument("--wrong-only", action=argparse.BooleanOptionalAction, default=None,
                    help="profile the wrong rollouts only (default: on for study arm folders)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from grail_exp.plots import positional_profile

    df = load(args.folders, args.min_length, args.max_length)
    wrong_only = args.wrong_only if args.wrong_only is not None else (args.folders[0] / "arm.json").is_file()
    args.out.mkdir(parents=True, exist_ok=True)
    key = ["step", "row"]
    boxed = df.loc[df.region == "answer", key].drop_duplicates()
    probed = df.merge(boxed, on=key)
    if wrong_only:
        probed = probed[~probed["correct"] & (probed["advantage"] != 0)]
    lengths = df.groupby(key)["length"].first()
    summary = (f"rollouts {len(lengths)}, boxed {len(boxed)}, profiled {probed.groupby(key).ngroups}; completion "
               f"length mean {lengths.mean():.0f}, median {lengths.median():.0f}, range {lengths.min()}-"
               f"{lengths.max()} tokens")
    print(summary)
    if probed.empty:  # nothing to draw: say so in the table's place
        (args.out / "grail_weights_profile.md").write_text(
            f"No boxed rollout of {args.min_length}-{args.max_length} tokens to profile ({summary}).\n")
        return

    # heatmap: the profiled rollouts, sorted by length
    rows = sorted((g for _, g in probed.groupby(key)), key=len)[-60:]
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

    # positional profile over the profiled rollouts
    prof = positional_profile(probed, bins=args.bins, require_answer=True, skip_zero_advantage=False)
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
    ax.set_title(f"SmolLM2-135M, {probed.groupby(key).ngroups} {'wrong ' if wrong_only else ''}boxed rollouts, "
                 f"median {lengths.median():.0f} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out / "grail_weights_profile.png", dpi=110)

    tokenizer = tokenizer_for(args.folders[0])
    if tokenizer is not None and "token_id" in df:
        text_heatmap(df.merge(boxed, on=key), tokenizer, args.out / "grail_weights_text.html")
        print(f"heatmap with the tokens' text: {args.out / 'grail_weights_text.html'}")


if __name__ == "__main__":
    main()
