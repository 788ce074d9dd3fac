"""grail_exp.analysis.plots: binning against hand-computed values, figures on synthetic weight tables.

The MLflow parts (end-of-run logging, the report's plots) are in tests/test_report.py, which has a store."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from grail_exp.analysis import plots as P

PNG = b"\x89PNG\r\n\x1a\n"


def _row(step, row, correct, advantage, weights, n_answer=3, n_post=1, entropy=None):
    """One completion: len(weights) pre-answer tokens, then an answer span and post-answer tokens."""
    n_pre = len(weights)
    regions = ["pre"] * n_pre + ["answer"] * n_answer + ["post"] * n_post
    w = list(weights) + [5.0] * n_answer + [1.0] * n_post
    ent = list(entropy) if entropy is not None else [0.5] * n_pre
    ent += [0.1] * (n_answer + n_post)
    length = len(regions)
    return pd.DataFrame({"step": step, "row": row, "correct": correct, "advantage": advantage,
                         "position": np.arange(length), "length": length, "region": regions,
                         "weight": w, "entropy": ent})


def _frame():
    wrong_a = _row(0, 0, False, -0.5, [3.0, 1.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0, 2.0])  # 10 pre tokens
    wrong_b = _row(0, 1, False, -0.5, [2.0, 1.0, 1.0, 0.5, 4.0])  # 5 pre tokens
    correct = _row(0, 2, True, 0.5, [1.0] * 4)
    no_box = _row(0, 3, False, -0.5, [9.0] * 6, n_answer=0, n_post=0)  # excluded: no answer
    zero_adv = _row(1, 0, False, 0.0, [9.0] * 6)  # excluded: A = 0
    return pd.concat([wrong_a, wrong_b, correct, no_box, zero_adv], ignore_index=True)


def test_positional_profile_matches_hand_computation():
    prof = P.positional_profile(_frame(), bins=5)
    wrong = prof[~prof["correct"]].set_index("bin")
    # bin = floor(5 * t / P): row a (P = 10) puts pairs of tokens in each bin, row b (P = 5) one token each.
    a = [3.0, 1.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0, 2.0]
    b = [2.0, 1.0, 1.0, 0.5, 4.0]
    for k in range(5):
        assert wrong.loc[k, "mean_weight"] == pytest.approx(np.mean(a[2 * k:2 * k + 2] + [b[k]]))
        assert wrong.loc[k, "n_tokens"] == 3
    right = prof[prof["correct"]]
    # the correct row has 4 pre tokens: bins 0, 1, 2, 3 (floor(5t/4) for t = 0..3), none in bin 4
    assert list(right["bin"]) == [0, 1, 2, 3] and np.allclose(right["mean_weight"], 1.0)
    assert np.allclose(wrong["center"], [0.1, 0.3, 0.5, 0.7, 0.9])
    # without the filters, the unanswered and zero-advantage rows come in
    loose = P.positional_profile(_frame(), bins=5, require_answer=False, skip_zero_advantage=False)
    assert loose["n_tokens"].sum() == 10 + 5 + 4 + 6 + 6


def test_entropy_bins_are_equal_count_quantiles():
    ent = np.arange(10) / 10.0
    w = 1.0 + ent  # weight rises with entropy
    f = _row(0, 0, False, -1.0, w, entropy=ent)
    bins = P.entropy_bins(f, bins=5)
    assert list(bins["n_tokens"]) == [2] * 5
    assert np.allclose(bins["entropy_mean"], [0.05, 0.25, 0.45, 0.65, 0.85])
    assert np.allclose(bins["mean_weight"], 1 + bins["entropy_mean"])


def test_mean_curve_over_runs_with_different_steps():
    h1 = {"accuracy": (np.array([0, 1, 2]), np.array([0.1, 0.2, 0.3]))}
    h2 = {"accuracy": (np.array([0, 2]), np.array([0.3, 0.5])), "kl": (np.array([0]), np.array([1.0]))}
    steps, mean, sd, n = P.mean_curve([h1, h2], "accuracy")
    assert list(steps) == [0, 1, 2] and n == 2
    assert np.allclose(mean, [0.2, 0.2, 0.4])
    assert np.allclose(sd, [np.std([0.1, 0.3], ddof=1), 0, np.std([0.3, 0.5], ddof=1)])


def test_figures_are_written(tmp_path):
    frames = {"grail": _frame(), "grpo": _frame().assign(weight=1.0)}
    paths = [P.plot_positional_profile(frames, tmp_path / "prof.png"),
             P.plot_weight_vs_entropy(frames, tmp_path / "ent.png"),
             P.plot_pass_at_k({"grpo": ([1, 2, 3], [0.3, 0.4, 0.45]), "grail": ([1, 2, 3], [0.32, 0.43, 0.5])},
                              tmp_path / "pass.png"),
             P.plot_training_curves({"grpo": [{"accuracy": (np.arange(5), np.linspace(0, 1, 5))}]},
                                    tmp_path / "curves.png")]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    assert P.plot_training_curves({"grpo": [{}]}, tmp_path / "none.png") is None


def test_load_weight_frames_from_a_run_dir(tmp_path):
    d = tmp_path / "run" / "weights"
    d.mkdir(parents=True)
    for step in range(5):
        _frame().assign(step=step).to_parquet(d / f"step_{step:06d}.parquet")
    df = P.load_weight_frames(tmp_path / "run", max_files=3)
    assert sorted(df["step"].unique()) == [0, 2, 4]  # evenly spread, first and last kept
    with pytest.raises(ValueError, match="entropy"):
        P.load_weight_frames(_frame().drop(columns="entropy"))
