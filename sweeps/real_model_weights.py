"""GRAIL's token weights on SmolLM2's own completions, from weight tables (``weights/step_*.parquet`` of a run
directory or of a study arm's folder): a page of tables (``grail_weights_profile.md``), a heatmap (one line per
rollout, token position across, colour = weight), the positional profile with its bootstrap band and, where the
tables carry the token ids, an HTML heatmap of a few completions with their text, in two columns by correctness.

    python sweeps/real_model_weights.py outputs/real_model/run_grail_weights --out results/real_model
    python sweeps/real_model_weights.py results/real_model_study/<study>/*-grail-s* --out <dir> \
        --min-length 40 --max-length 150          # the study's GRAIL arms (whichever exist), 40-150 tokens

With several folders the rollouts of all of them are pooled (non-folders among the arguments are skipped).
``--min-length`` / ``--max-length`` keep the rollouts of that many completion tokens. The population profiled is
stated on the page: the boxed rollouts, and with ``--wrong-only`` (the default for study folders) only the wrong ones
with A != 0 — the rows the study's GRAIL (skip_zero_advantage: true, symmetry: wrong) reweighted; every other row
keeps w = 1 but for the answer-span overrides. With the arm's tokenizer the page adds (``weight_analysis.py``): the
mean weight by token class, the mean weight with and without the w_max override tokens (and what they are), one
rollout's last tokens as evidence, and each wrong chain's first arithmetic slip against position-matched controls.
Bands: 95 % percentile intervals from resampling rollouts (``--boot`` resamples).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import weight_analysis as wa  # sweeps/ is on sys.path when run as `python sweeps/...`
from real_model_report import markdown


def load(folders: list[Path], min_length: int, max_length: int):
    import pandas as pd

    from grail_exp.analysis.plots import load_weight_frames

    frames = []
    for i, folder in enumerate(folders):
        df = load_weight_frames(folder)
        if df is not None:  # rows of different folders stay apart
            frames.append(df.assign(row=df["row"] + 1_000_000 * i, source=folder.name))
    if not frames:
        raise SystemExit(f"no weight tables (weights/step_*.parquet) under {', '.join(map(str, folders))}")
    df = pd.concat(frames, ignore_index=True)
    kept = df[(df["length"] >= min_length) & (df["length"] <= max_length)]
    kept.attrs["rollouts_total"] = len(df[["source", "step", "row"]].drop_duplicates())  # before the length filter
    return kept


def arm_config(folder: Path) -> dict:
    """A study arm's flat resolved configuration (its arm.json), or {} when the folder is not an arm."""
    record = folder / "arm.json"
    return json.loads(record.read_text()).get("config", {}) if record.is_file() else {}


def tokenizer_for(folder: Path):
    """The tokenizer of a study arm (its arm.json's model.name_or_path) or None when the folder is not an arm."""
    record = folder / "arm.json"
    if not record.is_file():
        return None
    from transformers import AutoTokenizer

    from grail_exp.analysis.portable import resolve_recorded
    from grail_exp.models.packaged import is_packaged_model, resolve

    name = resolve_recorded(json.loads(record.read_text())["config"]["model.name_or_path"])  # recorded portable
    if is_packaged_model(name):
        import os

        name = resolve(name, os.environ.get("GRAIL_EXP_CACHE", str(Path.home() / ".cache/grail_exp")))
    return AutoTokenizer.from_pretrained(name)


def text_heatmap(df, tokenizer, path: Path, per_outcome: int = 3) -> None:
    """``per_outcome`` wrong and correct rollouts of the last table that has rollouts with A != 0 (a table of
    zero-variance groups only shows weights that multiply nothing), their tokens coloured by weight (HTML), in two
    columns by correctness (a correct rollout of an all-correct group has A = 0 and is still correct)."""
    from grail_exp.analysis.viz import weights_html

    live = df[df["advantage"] != 0]
    source = live if not live.empty else df
    last = source[source["step"] == source["step"].max()]
    rows = []
    for correct in (False, True):
        keys = last.loc[last["correct"] == correct, "row"].drop_duplicates().head(per_outcome)
        for r in keys:
            g = last[last["row"] == r].sort_values("position")
            rows.append({"tokens": [tokenizer.decode([int(t)]) for t in g["token_id"]], "correct": correct,
                         "weights": g["weight"].tolist(), "advantage": float(g["advantage"].iloc[0])})
    path.write_text(weights_html(rows, title=f"GRAIL token weights, step {int(last['step'].iloc[0])}"))


def annotated(df, tokenizer):
    """Token and rollout tables (``weight_analysis.annotate``); without a tokenizer or token ids, tokens have the
    class "unknown" and "before the box" is the tables' own ``region == "pre"``."""
    if tokenizer is not None and "token_id" in df:
        return wa.annotate(wa.decode_tokens(df, tokenizer))
    tokens = df.sort_values(wa.ROLLOUT + ["position"]).reset_index(drop=True)
    tokens = tokens.assign(cls="unknown", pre=tokens["region"] == "pre", text="")
    g = tokens.groupby(wa.ROLLOUT)
    rollouts = g.agg(correct=("correct", "first"), advantage=("advantage", "first"), length=("length", "first"),
                     n_pre=("pre", "sum"), boxed=("region", lambda r: bool((r == "answer").any()))).reset_index()
    rollouts["first_error"], rollouts["results"] = None, [[] for _ in range(len(rollouts))]
    return tokens, rollouts


def draw_heatmap(tokens, pop, path: Path, w_min: float, w_max: float) -> None:
    """The population's rollouts (the 60 longest), token position across, colour = weight, box start ticked."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    t = tokens.merge(pop[wa.ROLLOUT + ["n_pre"]], on=wa.ROLLOUT)
    rows = sorted((g for _, g in t.groupby(wa.ROLLOUT)), key=len)[-60:]
    grid = np.full((len(rows), max(len(g) for g in rows)), np.nan)
    for i, g in enumerate(rows):
        grid[i, g.position.to_numpy()] = g.weight.to_numpy()
    fig, ax = plt.subplots(figsize=(10, 0.22 * len(rows) + 1.2))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", norm=LogNorm(vmin=w_min, vmax=w_max),
                   interpolation="nearest")
    for i, g in enumerate(rows):
        ax.plot([g["n_pre"].iloc[0] - 0.5] * 2, [i - 0.5, i + 0.5], color="k", lw=1)
    ax.set_xlabel("token position in the completion (black tick: the token holding the box's \\)")
    ax.set_ylabel("rollout (by length)")
    fig.colorbar(im, ax=ax, label="GRAIL weight w")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_profile(prof, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = [float(i) for i in prof.index]
    ax.fill_between(x, prof["lo"], prof["hi"], alpha=0.25, label="95 % band (rollouts resampled)")
    ax.plot(x, prof["mean_w"], marker="o")
    ax.axhline(1.0, color="grey", ls=":")
    ax.set_xlabel("relative position before the first \\boxed{")
    ax.set_ylabel("mean GRAIL weight")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(tokens, rollouts, pop, args, summary: str) -> tuple[str, object]:
    """The Markdown page of the analysis and the positional profile table."""
    t = tokens.merge(pop[wa.ROLLOUT], on=wa.ROLLOUT)
    lengths = pop["length"]
    who = "wrong, A != 0, boxed" if args.wrong_only else "boxed"
    lines = [f"# GRAIL's token weights: {', '.join(sorted(rollouts['source'].unique()))}", "", summary, "",
             f"**Population**: the {len(pop)} rollouts ({who}) of {args.min_length}-{args.max_length} completion "
             f"tokens in the weight tables (lengths {lengths.min()}-{lengths.max()}, mean {lengths.mean():.1f}), "
             f"{len(t)} tokens. Bands: 95 % percentile intervals from {args.boot} resamples of these rollouts. They "
             f"treat the rollouts as independent, which they are not (a group's rollouts are often the same text with "
             f"the same weights: {t.groupby(wa.ROLLOUT)['text'].apply(''.join).nunique()} distinct texts here; an "
             f"arm's share its policy), so a band describes these rollouts, not another training run.", ""]
    prof = wa.bootstrap_means(wa.profile_bins(t, pop, args.bins), "bin", args.boot)
    prof.index = [f"{(b + 0.5) / args.bins:.2f}" for b in prof.index]
    prof.index.name = "position"
    lines += ["## Mean weight by relative position before the first box", "", markdown(prof), ""]
    if (t["cls"] != "unknown").any():
        classes = wa.bootstrap_means(t, "cls", args.boot)
        classes["at w_max"] = t.groupby("cls")["weight"].apply(lambda w: (w >= args.w_max).mean())
        classes["at w_min"] = t.groupby("cls")["weight"].apply(lambda w: (w <= args.w_min).mean())
        classes = classes.loc[[c for c in wa.CLASS_ORDER if c in classes.index]]
        lines += ["## Mean weight by token class", "", markdown(classes), ""]
        effect = wa.override_effect(tokens, rollouts, args.w_max)
        where = wa.override_classes(tokens, args.w_max)
        lines += ["## The w_max override (answer span, reference mapping) and the mean weight", "",
                  markdown(effect), "", "Override tokens by class (every rollout in the length range): "
                  + ", ".join(f"{k} {v}" for k, v in where.items()) + ".", "",
                  "One reweighted rollout's last tokens (`text:weight`, override tokens in bold): "
                  + wa.override_line(tokens, rollouts, args.w_max), ""]
        table, slips = wa.error_vs_control(t, pop, args.boot)
        n_slip = int(pop["first_error"].notna().sum())
        lines += ["## First arithmetic slip against position-matched controls", "",
                  f"{n_slip} of the {len(pop)} rollouts have an arithmetic slip before the box (a step whose written "
                  "result differs from its own operands' sum or difference; the slip token is the first wrong digit "
                  "of that result). In the others every written step adds up: the error lies in the operands they "
                  "copied (the tables do not hold the problem to tell) or in the number they boxed. Controls: the "
                  "tokens at the same position in the other rollouts of the population (their own slips left out), "
                  "and the same digit of the same step's result in the other rollouts whose chain is right up to "
                  "that step. Paired per slip; the band resamples slips.", "", markdown(table), ""]
    return "\n".join(lines), prof


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", type=Path, nargs="+", help="run directories or study arm folders")
    ap.add_argument("--out", type=Path, default=Path("results/real_model"))
    ap.add_argument("--bins", type=int, default=10)
    ap.add_argument("--boot", type=int, default=2000, help="bootstrap resamples for the bands")
    ap.add_argument("--min-length", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=10**9)
    ap.add_argument("--w-min", type=float, default=None,
                    help="the clip's lower bound (default: the first arm's advantage.w_min, else 0.5)")
    ap.add_argument("--w-max", type=float, default=None,
                    help="the override weight (default: the first arm's advantage.w_max, else 5)")
    ap.add_argument("--wrong-only", action=argparse.BooleanOptionalAction, default=None,
                    help="profile the wrong rollouts with A != 0 only (default: on for study arm folders)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    args.folders = [f for f in args.folders if f.is_dir()]
    df = load(args.folders, args.min_length, args.max_length)
    if args.wrong_only is None:
        args.wrong_only = (args.folders[0] / "arm.json").is_file()
    recorded = arm_config(args.folders[0])
    args.w_min = args.w_min if args.w_min is not None else float(recorded.get("advantage.w_min", 0.5))
    args.w_max = args.w_max if args.w_max is not None else float(recorded.get("advantage.w_max", 5.0))
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_for(args.folders[0])
    tokens, rollouts = annotated(df, tokenizer)
    pop = wa.population(rollouts, args.wrong_only)
    summary = (f"Weight tables: {df.attrs['rollouts_total']} rollouts, {len(rollouts)} of them of "
               f"{args.min_length}-{args.max_length} tokens, "
               f"{int(rollouts['boxed'].sum())} boxed, {len(pop)} profiled; completion length mean "
               f"{rollouts['length'].mean():.1f}, median {rollouts['length'].median():.0f}, range "
               f"{rollouts['length'].min()}-{rollouts['length'].max()} tokens.")
    print(summary)
    if pop.empty:  # nothing to draw: say so in the table's place
        (args.out / "grail_weights_profile.md").write_text(f"No rollout to profile. {summary}\n")
        return
    page, prof = report(tokens, rollouts, pop, args, summary)
    (args.out / "grail_weights_profile.md").write_text(page + "\n")
    print(page)
    draw_heatmap(tokens, pop, args.out / "grail_weights_heatmap.png", args.w_min, args.w_max)
    draw_profile(prof, args.out / "grail_weights_profile.png",
                 f"SmolLM2-135M, {len(pop)} {'wrong ' if args.wrong_only else ''}boxed rollouts, "
                 f"median {pop['length'].median():.0f} tokens")
    if tokenizer is not None and "token_id" in df:
        text_heatmap(df, tokenizer, args.out / "grail_weights_text.html")
        print(f"heatmap with the tokens' text: {args.out / 'grail_weights_text.html'}")


if __name__ == "__main__":
    main()
