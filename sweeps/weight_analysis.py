"""Where GRAIL's token weights go on the study's arithmetic chains: the computations behind
``sweeps/real_model_weights.py``, on weight tables (``grail_exp.analysis.plots.load_weight_frames``) whose tokens carry their
text (``decode_tokens``).

- ``annotate``: each token's class (words, operand / result digits, operators, ``=``, the box's parts) by character
  offsets in its rollout's text, the rollout's tokens before its first complete box, and its first arithmetic slip.
- ``population``: the rollouts a profile is taken over (boxed; wrong with A != 0 by default: the ones GRAIL
  reweighted).
- ``bootstrap_means``: mean weight per category (position bin, token class) with a 95 % percentile band from
  resampling rollouts.
- ``override_effect``: the mean weight with and without the tokens the answer-span override set to ``w_max``.
- ``error_vs_control``: the weight of each wrong chain's first slip against position-matched controls.

Pure functions of DataFrames (no tokenizer, no files), so the tests build their tables by hand.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from grail_exp.grading.boxed import BOX_LEN, find_first_boxed_span

ROLLOUT = ["source", "step", "row"]  # one rollout: a row of one step's table of one arm
STEP = re.compile(r"(\d+)\s*([+\-])\s*(\d+)\s*=\s*(\d+)")  # one written chain step: "a+b=c" or "a-b=c"
PRE_CLASSES = ("word", "space", "punctuation", "operand digit", "operator", "=", "result digit")
BOX_CLASSES = ("box marker \\boxed{", "answer digit, not the last", "answer digit, last", "closing brace }.",
               "end of turn")
CLASS_ORDER = PRE_CLASSES + ("other",) + BOX_CLASSES + ("after the box",)


def decode_tokens(df: pd.DataFrame, tokenizer) -> pd.DataFrame:
    """``df`` with a ``text`` column: each token decoded alone with special tokens skipped (the end-of-turn token
    reads ''), so a rollout's texts join to its decoded completion (true of byte-level BPE on ASCII text)."""
    ids = df["token_id"].astype(int)
    text = {i: tokenizer.decode([i], skip_special_tokens=True) for i in map(int, ids.unique())}
    return df.assign(text=ids.map(text))


def first_arithmetic_error(text: str) -> tuple[int, int] | None:
    """(character, step index) of a chain's first arithmetic slip, or None when every step adds up.

    The chain's steps are the matches of ``a+b=c`` / ``a-b=c`` in ``text``, in order (index 0, 1, ...). The slip is
    the first step whose written result c differs from a ± b computed from its own written operands; its character
    is the first digit of c that differs from the true result written in decimal, compared left to right (c's last
    digit when one is a prefix of the other: "1" for 12). Copy slips (an operand that is neither the problem's nor
    the previous result) are not seen: they need the problem, which the weight tables do not hold."""
    for k, m in enumerate(STEP.finditer(text)):
        a, op, b, c = int(m[1]), m[2], int(m[3]), m[4]
        truth = str(a + b if op == "+" else a - b)
        if c != truth:
            diff = next((i for i, (x, y) in enumerate(zip(c, truth)) if x != y), len(c) - 1)
            return m.start(4) + diff, k
    return None


def _pre_class(tok: str, after_equals: bool) -> str:
    t = tok.strip()
    if not t:
        return "space"
    if t.isdigit():
        return "result digit" if after_equals else "operand digit"
    if t in ("+", "-"):
        return "operator"
    if t == "=":
        return "="
    if t.isalpha():
        return "word"
    return "punctuation" if all(c in ".,:;" for c in t) else "other"


def _box_class(text: str, lo: int, hi: int, s: int, e: int) -> str:
    """Class of a token covering chars [lo, hi) that reaches into the box [s, e) or lies after it."""
    if lo == hi:  # a special token after the box (skipped by the decode)
        return "end of turn"
    if lo < s + BOX_LEN:
        return BOX_CLASSES[0]
    if lo <= e - 1 < hi:  # holds the closing brace (SmolLM2 fuses it with the full stop: "}.")
        return BOX_CLASSES[3]
    if lo < e - 1:
        digits = [p for p in range(s + BOX_LEN, e - 1) if text[p].isdigit()]
        if digits and lo <= digits[-1] < hi:
            return BOX_CLASSES[2]
        return BOX_CLASSES[1] if any(lo <= p < hi for p in digits) else "other"
    return "after the box"


def annotate_rollout(texts: list[str]) -> dict:
    """One rollout's token classes from its token texts, in order.

    Returns ``cls`` (per token: a ``PRE_CLASSES`` entry before the first complete box, a ``BOX_CLASSES`` entry from
    the token holding its ``\\`` on, "after the box" or "other"), ``n_pre`` (the tokens wholly before the box; all of
    them without a box), ``boxed`` and ``first_error``: (token, step index, digit index) of the first arithmetic
    slip before the box (``first_arithmetic_error``) or None. A digit counts as a result digit when it follows
    ``=`` with only digits or spaces between."""
    text = "".join(texts)
    ends = np.cumsum([len(t) for t in texts])
    starts = ends - np.array([len(t) for t in texts], dtype=int)
    span = find_first_boxed_span(text)
    s, e = span if span else (len(text) + 1, len(text) + 1)
    cls, after_equals = [], False
    for t, lo, hi in zip(texts, starts, ends):
        if hi <= s:
            c = _pre_class(t, after_equals)
            after_equals = c == "=" or (after_equals and c in ("result digit", "space"))
            cls.append(c)
        else:
            cls.append(_box_class(text, int(lo), int(hi), s, e))
    n_pre = sum(1 for hi in ends if hi <= s) if span else len(texts)
    error = first_arithmetic_error(text[:s] if span else text)
    first_error = None
    if error is not None:
        char, k = error
        token = int(np.searchsorted(ends, char, side="right"))
        digit = char - next(m for i, m in enumerate(STEP.finditer(text)) if i == k).start(4)
        first_error = (token, k, digit)
    return {"cls": cls, "n_pre": n_pre, "boxed": span is not None, "first_error": first_error,
            "results": _result_tokens(text[:s] if span else text, ends)}


def _result_tokens(text: str, ends: np.ndarray) -> list[list[int]]:
    """Per chain step, the tokens holding its written result's digits."""
    return [[int(np.searchsorted(ends, p, side="right")) for p in range(m.start(4), m.end(4))]
            for m in STEP.finditer(text)]


def annotate(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Token table with ``cls`` and ``pre`` (before the first box) added, and one row per rollout (``ROLLOUT`` key,
    ``correct``, ``advantage``, ``length``, ``n_pre``, ``boxed``, ``first_error`` as in ``annotate_rollout``,
    ``results``). Needs the ``text`` column (``decode_tokens``)."""
    df = df.sort_values(ROLLOUT + ["position"]).reset_index(drop=True)
    cls = np.empty(len(df), dtype=object)
    pre = np.zeros(len(df), dtype=bool)
    rows = []
    for key, g in df.groupby(ROLLOUT, sort=False):
        a = annotate_rollout(g["text"].tolist())
        cls[g.index] = a["cls"]
        pre[g.index] = g["position"].to_numpy() < a["n_pre"]
        first = g.iloc[0]
        rows.append(dict(zip(ROLLOUT, key), correct=bool(first["correct"]), advantage=float(first["advantage"]),
                         length=int(first["length"]), n_pre=a["n_pre"], boxed=a["boxed"],
                         first_error=a["first_error"], results=a["results"]))
    columns = [*ROLLOUT, "correct", "advantage", "length", "n_pre", "boxed", "first_error", "results"]
    return df.assign(cls=cls, pre=pre), pd.DataFrame(rows, columns=columns)  # the columns even with no rollout


def population(rollouts: pd.DataFrame, wrong_only: bool = True) -> pd.DataFrame:
    """The rollouts a profile is taken over: boxed, and with ``wrong_only`` wrong with A != 0 (the rows GRAIL's
    ``symmetry: wrong`` reweights and whose weights reach the loss; every other row keeps w = 1 but for the
    overrides)."""
    keep = rollouts["boxed"]
    if wrong_only:
        keep = keep & ~rollouts["correct"] & (rollouts["advantage"] != 0)
    return rollouts[keep]


def bootstrap_means(tokens: pd.DataFrame, by: str, n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Mean ``weight`` per value of column ``by`` over all tokens (token-weighted), with a 95 % percentile band from
    resampling whole rollouts (``ROLLOUT``) with replacement ``n_boot`` times. Columns: mean_w, lo, hi, n_tokens,
    n_rollouts; a category absent from a replicate's rollouts leaves that replicate out of its band."""
    keys = tokens[ROLLOUT].drop_duplicates().reset_index(drop=True)
    rid = tokens.merge(keys.reset_index(), on=ROLLOUT, how="left")["index"].to_numpy()
    cats = pd.Index(sorted(tokens[by].unique(), key=str)) if tokens[by].dtype == object \
        else pd.Index(sorted(tokens[by].unique()))
    cid = cats.get_indexer(tokens[by])
    R, K = len(keys), len(cats)
    sums, counts = np.zeros((R, K)), np.zeros((R, K))
    np.add.at(sums, (rid, cid), tokens["weight"].to_numpy(dtype=float))
    np.add.at(counts, (rid, cid), 1.0)
    rng = np.random.default_rng(seed)
    draws = np.stack([np.bincount(rng.integers(0, R, R), minlength=R) for _ in range(n_boot)])  # (n_boot, R)
    s, c = draws @ sums, draws @ counts
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = np.where(c > 0, s / c, np.nan)
    lo, hi = np.nanpercentile(reps, [2.5, 97.5], axis=0)
    out = pd.DataFrame({"mean_w": sums.sum(0) / counts.sum(0), "lo": lo, "hi": hi,
                        "n_tokens": counts.sum(0).astype(int), "n_rollouts": (counts > 0).sum(0)}, index=cats)
    out.index.name = by
    return out


def profile_bins(tokens: pd.DataFrame, rollouts: pd.DataFrame, bins: int) -> pd.DataFrame:
    """The tokens before the first box with their relative-position bin ``bin`` = floor(bins · position / n_pre)."""
    pre = tokens[tokens["pre"]].merge(rollouts[ROLLOUT + ["n_pre"]], on=ROLLOUT)
    return pre.assign(bin=np.minimum(bins * pre["position"] // pre["n_pre"], bins - 1).astype(int))


def override_tokens(tokens: pd.DataFrame, w_max: float) -> pd.Series:
    """The tokens GRAIL's overrides set to ``w_max``: the answer span as the tables record it (the span the scheme
    used) at exactly ``w_max`` (outside it weights are the clipped probe's, and the span's other overrides are
    w_mean)."""
    return (tokens["region"] == "answer") & (tokens["weight"] == w_max)


def override_effect(tokens: pd.DataFrame, rollouts: pd.DataFrame, w_max: float) -> pd.DataFrame:
    """Mean weight with and without the ``w_max`` override tokens, over every rollout of the tables (what the
    training log's ``weights/mean`` averages) and over the reweighted population; and what the override tokens
    are (their share per token class)."""
    rows = {}
    for name, keys in (("every rollout in the length range", rollouts), ("reweighted (wrong, A != 0, boxed)",
                                                                  population(rollouts))):
        t = tokens.merge(keys[ROLLOUT], on=ROLLOUT)
        o = override_tokens(t, w_max)
        rows[name] = {"rollouts": len(keys), "tokens": len(t), "override tokens": int(o.sum()),
                      "mean w": t["weight"].mean(), "mean w without them": t.loc[~o, "weight"].mean()}
    out = pd.DataFrame(rows).T
    counts = {"rollouts": int, "tokens": int, "override tokens": int}
    return out.astype(counts).astype(object)  # object: a row keeps its counts as integers


def override_classes(tokens: pd.DataFrame, w_max: float) -> pd.Series:
    """How many of the ``w_max`` override tokens fall in each token class."""
    return tokens.loc[override_tokens(tokens, w_max), "cls"].value_counts()


def error_vs_control(tokens: pd.DataFrame, rollouts: pd.DataFrame, n_boot: int = 2000, seed: int = 0):
    """Each population rollout's first arithmetic slip against two controls, paired per slip.

    - position: the mean weight of the tokens at the same position in the other rollouts of ``rollouts`` that are
      still before their box there, their own slips left out;
    - result digit: the mean weight of the same digit (index) of the same chain step's result in the other
      rollouts whose step is right up to that step (no slip at or before it).

    Returns (table, slips): per control the number of slips with a control, the slips' mean weight, the controls'
    mean and the mean paired difference with a 95 % percentile band over slips; and the slips themselves."""
    pre = tokens[tokens["pre"]]
    w = pre.set_index(ROLLOUT + ["position"])["weight"]
    slips = rollouts[rollouts["first_error"].notna()]
    slip_at = {tuple(r[ROLLOUT]): r["first_error"][0] for _, r in slips.iterrows()}
    by_pos = pre.assign(is_slip=[slip_at.get(k) == p for k, p in zip(map(tuple, pre[ROLLOUT].to_numpy()),
                                                                      pre["position"])])
    by_pos = by_pos[~by_pos["is_slip"]]
    pos_sum = by_pos.groupby("position")["weight"].agg(["sum", "count"])
    pos_own = by_pos.groupby(ROLLOUT + ["position"])["weight"].agg(["sum", "count"])
    digit_w = _result_digit_weights(w, rollouts)
    out = []
    for _, r in slips.iterrows():
        key = tuple(r[ROLLOUT])
        tok, k, d = r["first_error"]
        if (*key, tok) not in w.index:
            continue
        wt = float(w.loc[(*key, tok)])
        row = {"slip": wt, "position": tok, "step_index": k}
        s, c = pos_sum.loc[tok] if tok in pos_sum.index else (0.0, 0)
        if (*key, tok) in pos_own.index:  # this rollout's own non-slip token there (none: it is the slip)
            s, c = s - pos_own.loc[(*key, tok), "sum"], c - pos_own.loc[(*key, tok), "count"]
        row["position control"] = s / c if c else np.nan
        others = digit_w[(digit_w["k"] == k) & (digit_w["d"] == d) & (digit_w["key"] != key)]["weight"]
        row["result-digit control"] = others.mean() if len(others) else np.nan
        out.append(row)
    detail = pd.DataFrame(out)
    rng = np.random.default_rng(seed)
    table = {}
    for control in ("position control", "result-digit control"):
        d = detail.dropna(subset=[control]) if len(detail) else detail
        diff = (d["slip"] - d[control]).to_numpy() if len(d) else np.array([])
        boots = [diff[rng.integers(0, len(diff), len(diff))].mean() for _ in range(n_boot)] if len(diff) else [np.nan]
        table[control] = {"slips": len(d), "slip mean w": d["slip"].mean() if len(d) else np.nan,
                          "control mean w": d[control].mean() if len(d) else np.nan,
                          "difference": diff.mean() if len(diff) else np.nan,
                          "lo": np.percentile(boots, 2.5), "hi": np.percentile(boots, 97.5)}
    return pd.DataFrame(table).T, detail


def _result_digit_weights(w: pd.Series, rollouts: pd.DataFrame) -> pd.DataFrame:
    """The weight of every result digit (step k, digit index d) of every rollout's steps before its first slip."""
    rows = []
    for _, r in rollouts.iterrows():
        key = tuple(r[ROLLOUT])
        last_ok = r["first_error"][1] if r["first_error"] is not None else len(r["results"])
        for k, toks in enumerate(r["results"][:last_ok]):
            for d, tok in enumerate(toks):
                if (*key, tok) in w.index:
                    rows.append({"key": key, "k": k, "d": d, "weight": float(w.loc[(*key, tok)])})
    return pd.DataFrame(rows, columns=["key", "k", "d", "weight"])


def override_line(tokens: pd.DataFrame, rollouts: pd.DataFrame, w_max: float, tail: int = 9) -> str:
    """The last ``tail`` tokens of one reweighted rollout with an answer of several digits, each as ``text:weight``, the
    override tokens in bold: the evidence line for where the ``w_max`` override lands."""
    pop = population(rollouts)
    t = tokens.merge(pop[ROLLOUT], on=ROLLOUT)
    two = t.loc[t["cls"] == BOX_CLASSES[1], ROLLOUT].drop_duplicates()
    if two.empty:
        return ""
    g = t.merge(two.iloc[[0]], on=ROLLOUT).sort_values("position").tail(tail)
    o = override_tokens(g, w_max)
    cells = [(f"**{x!r}:{v:.2f}**" if hit else f"{x!r}:{v:.2f}") for x, v, hit in zip(g["text"], g["weight"], o)]
    head = ", ".join(f"{k} {v}" for k, v in zip(ROLLOUT, two.iloc[0]))
    return f"{head}: … " + " ".join(cells)
