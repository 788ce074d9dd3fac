"""Plots logged as MLflow artifacts: training curves, pass@k vs k, and where the token weights go.

Training curves come from MLflow metric histories (one line per scheme: the mean over its seeds, a band of ± one
standard deviation). The weight plots read the per-token tables the training module writes every
``trainer.weights_table_every`` steps as ``weights/step_<NNNNNN>.parquet`` with the columns of ``WEIGHT_COLUMNS``:
one row per valid completion token with the scheme weight w it actually used in the loss (Â = sg(w)·A), and (tables
written since the real-model study) the token's id, ``token_id``, for heatmaps with the tokens' text.

- **Positional profile** (the GRAIL paper's U-shape analysis): mean w by relative position over the tokens before
  the first complete ``\\boxed{`` (``region == "pre"``), in 20 bins, correct and wrong rollouts apart. A token at
  position t of a row with P pre-answer tokens has relative position t / P and falls in bin ⌊bins · t / P⌋.
- **Weight vs entropy**: a hexbin of (token entropy, w) over the same tokens, with the mean w per entropy decile.

Every figure function writes a PNG and returns its path (matplotlib's Agg backend: no display needed); the binning
functions are separate and return data frames so they can be tested and tabulated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# What a training step logs (grail_exp/training/rollout.py and update.py, the loss), in panel order.
TRAINING_CURVES = ("reward/mean", "accuracy", "completions/mean_length", "entropy", "kl",
                   "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "weights/mean")
WEIGHT_COLUMNS = ("step", "row", "correct", "advantage", "position", "length", "region", "weight", "entropy")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------------------------- training curves
def fetch_histories(client, run_ids: Iterable[str], keys: Sequence[str] = TRAINING_CURVES) -> dict[str, dict]:
    """``{run_id: {key: (steps, values)}}`` from MLflow metric histories (keys a run never logged are left out)."""
    out: dict[str, dict] = {}
    for run_id in run_ids:
        logged = set(client.get_run(run_id).data.metrics)
        hist = {}
        for key in keys:
            if key not in logged:
                continue
            points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
            last = {m.step: m.value for m in points}  # a resumed run may re-log a step: keep the latest value
            steps = np.array(sorted(last), dtype=np.int64)
            hist[key] = (steps, np.array([last[s] for s in steps], dtype=np.float64))
        out[run_id] = hist
    return out


def mean_curve(histories: Sequence[Mapping[str, tuple]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Mean and standard deviation over runs at every step any run logged (runs missing a step are left out of
    that step's statistics). Returns ``(steps, mean, sd, n_runs)``; sd is 0 where one run has the step."""
    per_step: dict[int, list[float]] = {}
    n = 0
    for h in histories:
        if key not in h:
            continue
        n += 1
        for s, v in zip(*h[key]):
            per_step.setdefault(int(s), []).append(float(v))
    steps = np.array(sorted(per_step), dtype=np.int64)
    mean = np.array([np.mean(per_step[s]) for s in steps])
    sd = np.array([np.std(per_step[s], ddof=1) if len(per_step[s]) > 1 else 0.0 for s in steps])
    return steps, mean, sd, n


def plot_training_curves(groups: Mapping[str, Sequence[Mapping[str, tuple]]], path: str | Path,
                         keys: Sequence[str] = TRAINING_CURVES, title: str = "") -> Path | None:
    """One panel per metric key, one line per group (e.g. scheme): mean over its runs ± sd. None if no data."""
    present = [k for k in keys if any(k in h for hs in groups.values() for h in hs)]
    if not present:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        for label, hs in groups.items():
            steps, mean, sd, n = mean_curve(hs, key)
            if n == 0:
                continue
            (line,) = ax.plot(steps, mean, lw=1.4, label=f"{label} (n={n})")
            if n > 1:
                ax.fill_between(steps, mean - sd, mean + sd, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_pass_at_k(curves: Mapping[str, tuple[Sequence[int], Sequence[float]]], path: str | Path,
                   title: str = "") -> Path:
    """pass@k (%) vs k, one line per label; ``curves[label] = (ks, values as fractions)``. The single-run version
    with per-benchmark lines and CIs is ``grail_exp.evaluation.pass_at_k_plot``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, (ks, vals) in curves.items():
        ax.plot(list(ks), [100 * v for v in vals], marker="o", label=label)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_xticks(sorted({int(k) for ks, _ in curves.values() for k in ks}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------- weight tables
def load_weight_frames(source: Any, max_files: int | None = None):
    """The weight tables of a run as one DataFrame (or None when there are none).

    ``source``: a DataFrame, a list of DataFrames, a parquet file, or a directory searched for
    ``weights/step_*.parquet`` (a run directory or a downloaded artifact directory; ``step_*.parquet`` directly
    inside it also counts). ``max_files`` keeps that many tables, evenly spread over training (first and last kept).
    """
    import pandas as pd

    if source is None:
        return None
    if isinstance(source, pd.DataFrame):
        frames = [source]
    elif isinstance(source, (list, tuple)):
        frames = [f if isinstance(f, pd.DataFrame) else pd.read_parquet(f) for f in source]
    else:
        p = Path(source)
        files = [p] if p.is_file() else sorted(set(p.glob("step_*.parquet")) | set(p.rglob("weights/step_*.parquet")))
        if max_files and len(files) > max_files:
            keep = np.unique(np.linspace(0, len(files) - 1, max_files).round().astype(int))
            files = [files[i] for i in keep]
        frames = [pd.read_parquet(f) for f in files]
    frames = [f for f in frames if len(f)]
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    missing = [c for c in WEIGHT_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"weight table lacks columns {missing}; expected {list(WEIGHT_COLUMNS)}")
    return df


def _pre_answer_tokens(df, require_answer: bool = True, skip_zero_advantage: bool = True):
    """Tokens before the first complete box, with their row's pre-answer length ``n_pre``.

    ``require_answer``: only rows that have a box (rows without one get the neutral weight and would flatten the
    profile). ``skip_zero_advantage``: rows with A = 0 add nothing to the loss whatever their weights."""
    key = ["step", "row"]
    rows = df
    if require_answer:
        answered = df.loc[df["region"] == "answer", key].drop_duplicates()
        rows = df.merge(answered, on=key)
    if skip_zero_advantage:
        rows = rows[rows["advantage"] != 0]
    pre = rows[rows["region"] == "pre"].copy()
    pre["n_pre"] = pre.groupby(key)["position"].transform("size")
    return pre


def positional_profile(df, bins: int = 20, require_answer: bool = True, skip_zero_advantage: bool = True):
    """Mean weight by relative position before the first box, per outcome.

    Returns a DataFrame with columns ``correct`` (bool), ``bin`` (0..bins-1), ``center`` (bin centre in [0, 1]),
    ``mean_weight``, ``n_tokens``; bins without tokens are absent."""
    import pandas as pd

    pre = _pre_answer_tokens(df, require_answer, skip_zero_advantage)
    if pre.empty:
        return pd.DataFrame(columns=["correct", "bin", "center", "mean_weight", "n_tokens"])
    pre["bin"] = np.minimum((bins * pre["position"] // pre["n_pre"]).astype(int), bins - 1)
    out = (pre.groupby(["correct", "bin"])["weight"].agg(mean_weight="mean", n_tokens="size").reset_index())
    out["center"] = (out["bin"] + 0.5) / bins
    return out[["correct", "bin", "center", "mean_weight", "n_tokens"]]


def entropy_bins(df, bins: int = 10, require_answer: bool = True, skip_zero_advantage: bool = True):
    """Mean weight per entropy quantile bin (pre-answer tokens): columns ``bin``, ``entropy_mean``,
    ``mean_weight``, ``n_tokens``."""
    import pandas as pd

    pre = _pre_answer_tokens(df, require_answer, skip_zero_advantage)
    if pre.empty:
        return pd.DataFrame(columns=["bin", "entropy_mean", "mean_weight", "n_tokens"])
    # rank-based quantile bins: equal token counts even with many tied entropies
    ranks = pre["entropy"].rank(method="first").to_numpy() - 1
    pre["bin"] = (bins * ranks // len(pre)).astype(int)
    return (pre.groupby("bin").agg(entropy_mean=("entropy", "mean"), mean_weight=("weight", "mean"),
                                   n_tokens=("weight", "size")).reset_index())


def plot_positional_profile(frames: Mapping[str, Any], path: str | Path, bins: int = 20,
                            title: str = "") -> Path | None:
    """One panel per label (e.g. scheme): mean w by relative pre-answer position, correct vs wrong rollouts."""
    profiles = {label: positional_profile(df, bins) for label, df in frames.items() if df is not None}
    profiles = {k: v for k, v in profiles.items() if len(v)}
    if not profiles:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 3.2), squeeze=False, sharey=True)
    for ax, (label, prof) in zip(axes.flat, profiles.items()):
        for correct, style in ((False, dict(color="tab:red", label="wrong")),
                               (True, dict(color="tab:blue", label="correct"))):
            part = prof[prof["correct"] == correct]
            if len(part):
                ax.plot(part["center"], part["mean_weight"], marker=".", **style)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("relative position before the first \\boxed{", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes.flat[0].set_ylabel("mean token weight w")
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_weight_vs_entropy(frames: Mapping[str, Any], path: str | Path, title: str = "") -> Path | None:
    """One panel per label: hexbin of (entropy, w) over pre-answer tokens (token counts, log colour scale) and
    the mean w per entropy decile."""
    data = {label: _pre_answer_tokens(df) for label, df in frames.items() if df is not None}
    data = {k: v for k, v in data.items() if len(v)}
    if not data:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.2), squeeze=False, sharey=True)
    for ax, (label, pre) in zip(axes.flat, data.items()):
        hb = ax.hexbin(pre["entropy"], pre["weight"], gridsize=30, bins="log", cmap="viridis", mincnt=1)
        cb = fig.colorbar(hb, ax=ax, pad=0.01)
        cb.set_label("tokens", fontsize=7)
        cb.ax.tick_params(labelsize=6)
        deciles = entropy_bins(frames[label])
        ax.plot(deciles["entropy_mean"], deciles["mean_weight"], color="tab:orange", marker="o", ms=3,
                label="mean per entropy decile")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("token entropy (nats)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].set_ylabel("token weight w")
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


# ----------------------------------------------------------------------------------------------- end of a run
def log_training_plots(tracker, run_dir_or_frames: Any = None, label: str | None = None,
                       keys: Sequence[str] = TRAINING_CURVES, max_weight_files: int | None = 50) -> list[str]:
    """Plots of one run, logged under ``plots/`` of the tracker's run; returns the artifact paths.

    Training curves from the run's metric histories (needs an MLflow tracker); weight plots from
    ``run_dir_or_frames`` (see :func:`load_weight_frames`; None: the run's own ``weights/`` artifacts). The
    training module calls this once at the end of a run; a failure to plot is logged, never fatal."""
    import tempfile

    client, run_id = getattr(tracker, "client", None), getattr(tracker, "run_id", None)
    if run_id is None:
        return []
    logged: list[str] = []
    label = label or "run"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            source = run_dir_or_frames
            if source is None and client is not None:
                source = download_weight_tables(client, run_id, Path(tmp) / "dl", max_weight_files)
            frames = load_weight_frames(source, max_weight_files)
            figures = []
            if client is not None:
                hist = fetch_histories(client, [run_id], keys)[run_id]
                figures.append(plot_training_curves({label: [hist]}, Path(tmp) / "training_curves.png", keys))
            if frames is not None:
                figures.append(plot_positional_profile({label: frames}, Path(tmp) / "weights_positional_profile.png"))
                figures.append(plot_weight_vs_entropy({label: frames}, Path(tmp) / "weights_vs_entropy.png"))
            for fig in figures:
                if fig is not None:
                    tracker.log_artifact(str(fig), "plots")
                    logged.append(f"plots/{fig.name}")
        except Exception as exc:  # plots are a convenience: never fail a finished training run over them
            log.warning("training plots failed: %s: %s", type(exc).__name__, exc)
    return logged


def download_weight_tables(client, run_id: str, dst: Path, max_files: int | None = None) -> Path | None:
    """Download a run's ``weights/step_*.parquet`` artifacts (at most ``max_files``, evenly spread); None if none."""
    try:
        names = sorted(a.path for a in client.list_artifacts(run_id, "weights") if a.path.endswith(".parquet"))
    except Exception:
        return None
    if not names:
        return None
    if max_files and len(names) > max_files:
        names = [names[i] for i in np.unique(np.linspace(0, len(names) - 1, max_files).round().astype(int))]
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        client.download_artifacts(run_id, name, str(dst))
    return dst
