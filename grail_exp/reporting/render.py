"""The report's pages: Markdown (tables, Δ table, decisions, sections, footnotes, legend), LaTeX (booktabs) and the
JSON payload."""

from __future__ import annotations

import math
import re

import numpy as np
from omegaconf import DictConfig, OmegaConf

from grail_exp.analysis import stats
from grail_exp.reporting.runs import Notes, letter
from grail_exp.reporting.schema import has_primary
from grail_exp.reporting.tables import AVG, DASH, ONE_SEED, Cell, MetricTable, Row, expected_seeds, pct


def endpoint_text(steps, name: str | None) -> str:
    what = "the final evaluation" if steps is None else \
        "the mean of the evaluations at steps " + ", ".join(str(int(x)) for x in steps)
    return f"endpoint {name} ({what})" if name else what


def _p(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _main_cell(cell: Cell, row: Row, alpha: float, mark) -> str:
    if cell.value is None:
        text = DASH
    else:
        text = pct(cell.value)
        if not row.baseline:
            if cell.delta is None:
                text += f" (Δ {DASH})"
            else:
                star = "*" if cell.delta.significant(alpha) else ""
                one = f"; {ONE_SEED}" if cell.delta.n_seeds == 1 else ""  # a one-seed Δ says nothing of the scheme
                text += f" ({pct(cell.delta.delta, True)}{star}{one})"
    return text + "".join(mark(n) for n in cell.notes)


def _seeds_text(row: Row) -> str:
    if not row.seeds:
        return "0"
    if len(row.paired_seeds) == len(row.seeds):
        return str(len(row.seeds))
    return f"{len(row.seeds)} ({len(row.paired_seeds)} paired)"


def _seed_tests_text(d: stats.PairedResult) -> tuple[str, str, str]:
    """The Δ table's seed-level cells: ``t (df), p [t interval]``, ``sign-flip p (min p)``, Holm-adjusted p's."""
    if not d.seed_level():
        return ONE_SEED if d.n_seeds == 1 else DASH, ONE_SEED if d.n_seeds == 1 else DASH, DASH
    t = f"{d.seed_t:+.2f}" if math.isfinite(d.seed_t) else ("+inf" if d.seed_t > 0 else "-inf")
    t_text = f"t({d.seed_df}) = {t}, p {_p(d.seed_t_p)} [{pct(d.seed_t_lo, True)}, {pct(d.seed_t_hi, True)}]"
    flip_text = f"{_p(d.seed_flip_p)} (min {_p(d.seed_flip_min_p)})"
    if d.primary:
        holm_text = "primary"
    elif d.seed_t_p_holm is None:
        holm_text = DASH
    else:
        holm_text = f"{_p(d.seed_t_p_holm)} / {_p(d.seed_flip_p_holm)}"
    return t_text, flip_text, holm_text


def render_markdown(tables: list[MetricTable], notes: Notes, cfg: DictConfig, header: str,
                    generation: list[dict] | None = None, sections: list[str] | None = None) -> str:
    alpha = cfg.stats.alpha
    mark = lambda n: f"<sup>{n}</sup>"  # noqa: E731
    out = [header, ""]
    for t in tables:
        at = "" if cfg.endpoint.steps is None else f", {endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}"
        out += [f"### {t.label} (%){at}" + "".join(mark(n) for n in t.notes), ""]
        head = ["model", "scheme", "seeds"] + t.columns
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---", "---", "--:"] + ["--:"] * len(t.columns)) + "|")
        for r in t.rows:
            scheme = r.scheme + (" (baseline)" if r.baseline else "") + "".join(mark(n) for n in r.notes)
            cells = [_main_cell(r.cells[c], r, alpha, mark) for c in t.columns]
            out.append("| " + " | ".join([r.model, scheme, _seeds_text(r)] + cells) + " |")
        out += ["", f"Δ vs {cfg.baseline}, paired (percentage points):", ""]
        conf = int(round(100 * (1 - alpha)))
        out.append(f"| model | scheme | benchmark | Δ | {conf} % CI | per-seed Δ, mean ± sd | seed-level t, p "
                   f"[{conf} % t interval] | seed-level sign-flip p (min) | Holm p (t / sign-flip) | "
                   f"per-problem p (these trained models only) | seeds | problems |")
        out.append("|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
        blank = " | " * 8
        for r in t.rows:
            if r.baseline:
                continue
            if not r.seeds:  # no runs at all: one line, not one per column
                out.append(f"| {r.model} | {r.scheme} | all | {DASH}{blank}|")
                continue
            for c in t.columns:
                d = r.cells[c].delta
                if d is None:
                    out.append(f"| {r.model} | {r.scheme} | {c} | {DASH}{blank}|")
                    continue
                sd = f" ± {100 * d.seed_sd:.1f}" if d.seed_sd is not None else " (1 seed)"
                t_text, flip_text, holm_text = _seed_tests_text(d)
                out.append(f"| {r.model} | {r.scheme} | {c} | {pct(d.delta, True)} | "
                           f"[{pct(d.lo, True)}, {pct(d.hi, True)}] | {pct(d.seed_mean, True)}{sd} | "
                           f"{t_text} | {flip_text} | {holm_text} | {_p(d.p_value)} | {d.n_seeds} | "
                           f"{d.n_problems} |")
        out.append("")
        out += _decision_markdown(t, cfg, conf)
    out += sections or []
    if generation:
        out += _generation_markdown(generation)
    out.append(_legend(cfg, tables))
    if notes.texts:
        out += ["", "Notes:", ""]
        out += [f"- <sup>{letter(i)}</sup> {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(out) + "\n"


def _decision_markdown(table: MetricTable, cfg: DictConfig, conf: int) -> list[str]:
    """The declared rule and its verdict per row, under the table that holds the primary comparison (else nothing)."""
    decided = [(r, d) for r in table.rows for c in table.columns
               if (d := r.cells[c].delta) is not None and d.decision is not None]
    if not decided:
        return []
    rule = cfg.decision
    family = (f" and its seed-level t p, Holm-adjusted over the declared family of primary comparisons "
              f"(decision.multiplicity = holm, below), is below {cfg.stats.alpha}" if rule.multiplicity == "holm" else "")
    out = [f"Declared rule on the primary comparison (decision.seeds, decision.min_same_sign): a scheme beats "
           f"{cfg.baseline} only if at least {rule.min_same_sign} of {rule.seeds} seeds have Δ > 0 and the seed-level "
           f"{conf} % t interval lies above 0{family} (is worse: the mirror rule); otherwise not settled.", ""]
    for r, d in decided:
        interval = (f"; t interval [{pct(d.seed_t_lo, True)}, {pct(d.seed_t_hi, True)}]"
                    if d.seed_t_lo is not None else "")
        out.append(f"- {r.model} × {r.scheme}: {d.decision['text']}{interval}")
    return out + [""]


def family_markdown(family: list[dict], cfg: DictConfig) -> list[str]:
    if not family:
        return []
    out = ["### Multiplicity: the declared family of primary comparisons (decision.multiplicity = holm)", "",
           f"The {len(family)} primary comparisons below are adjusted as one family by Holm's method over their "
           f"seed-level t p-values at familywise α {cfg.stats.alpha}; a comparison the rule cannot apply to yet (fewer "
           f"paired seeds than the {cfg.decision.seeds} declared) counts as p = 1, the most conservative value it "
           f"could take. A verdict other than \"not settled\" needs the rule's clauses and an adjusted p below "
           f"{cfg.stats.alpha}.", "",
           "| comparison | paired seeds | seed-level t p | counted as | Holm-adjusted p | the declared rule |",
           "|---|--:|--:|--:|--:|---|"]
    for m in family:
        where = f"{m['folder']}: " if m["folder"] else ""
        raw = DASH if m["seed_t_p"] is None else _p(m["seed_t_p"])
        out.append(f"| {where}{m['model']} × {m['scheme']} | {m['n_seeds']} | {raw} | {_p(m['counted_p'])} | "
                   f"{_p(m['holm_p'])} | {m['verdict']} |")
    return out + [""]


def _signed(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}"


def _range_text(values: list) -> str:
    point, lo, hi = values
    return f"{point} [{lo}, {hi}]"


def spread_markdown(spread: list[dict], cfg: DictConfig, label: str) -> list[str]:
    if not spread:
        return []
    a_name, b_name = cfg.endpoint.name or "A", cfg.spread.name or "B"
    a_text = endpoint_text(cfg.endpoint.steps, None)
    b_text = endpoint_text(cfg.spread.steps, None)
    conf, level = int(round(100 * (1 - cfg.stats.alpha))), int(round(100 * cfg.power.level))
    out = [f"### Seed spread of the primary comparison: endpoint {b_name} against endpoint {a_name}", "",
           f"Per paired seed, Δ = {label} of the scheme − {cfg.baseline}, in points, under endpoint {a_name} "
           f"({a_text}) and endpoint {b_name} ({b_text}); an arm's last step is its final evaluation. sd: sample sd "
           f"(ddof 1) over the seeds with its {conf} % chi-square interval. Ratio sd_{b_name} / sd_{a_name}: "
           f"{conf} % seed-bootstrap percentile interval ({cfg.spread.n_boot} resamples of the seeds with "
           f"replacement, each seed's two Δ together, generator seed {cfg.spread.seed}; resamples with "
           f"sd_{a_name} = 0 dropped and counted). Seeds needed: the smallest n whose two-sided paired t test at "
           f"α {cfg.stats.alpha} has {level} % power (noncentral t), at the sd [at the ends of its interval].", ""]
    for e in spread:
        out += [f"{e['model']} × {e['scheme']}:", "", f"| seed | Δ, endpoint {a_name} | Δ, endpoint {b_name} |",
                "|--:|--:|--:|"]
        out += [f"| {seed} | {_signed(x)} | {_signed(y)} |" for seed, x, y in zip(e["seeds"], e["a"], e["b"])]
        out.append("")
        if "note" in e:
            out += [e["note"], ""]
            continue
        out += [f"| endpoint | mean Δ | sd [{conf} % χ²] | "
                + " | ".join(f"seeds for {_num(x)} points at {level} %" for x in cfg.power.effects) + " |",
                "|---|--:|--:|" + "--:|" * len(cfg.power.effects)]
        for key, name in (("a", a_name), ("b", b_name)):
            lo, hi = e[f"sd_{key}_interval"]
            needed = " | ".join(_range_text(e[f"needed_{key}"][str(x)]) for x in cfg.power.effects)
            mean = float(np.mean(e[key]))
            out.append(f"| {name} | {_signed(mean)} | {e[f'sd_{key}']:.2f} [{lo:.2f}, {hi:.2f}] | {needed} |")
        r = e["ratio"]
        out.append("")
        if r is None:
            out.append(f"sd_{b_name} / sd_{a_name}: undefined (sd_{a_name} = 0).")
        else:
            out.append(f"sd_{b_name} / sd_{a_name} = {r['value']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] ({r['kept']} "
                       f"resamples kept, {r['dropped']} dropped with sd_{a_name} = 0).")
        if e.get("rule") is not None:
            k = e["rule"]["ratio"]
            verdict = "holds" if e["rule"]["holds"] else "does not hold"
            sign = "≤" if e["rule"]["holds"] else ">"
            out.append(f"Declared rule (spread.rule_ratio = {_num(k)}: endpoint {b_name} when sd_{b_name} ≤ {_num(k)} "
                       f"× sd_{a_name}, on the point estimates): sd_{b_name} {e['sd_b']:.2f} {sign} {_num(k)} × "
                       f"{e['sd_a']:.2f} = {k * e['sd_a']:.2f}: **{verdict}**.")
        out.append("")
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def pooled_markdown(pooled: list[dict], cfg: DictConfig, label: str) -> list[str]:
    if not pooled:
        return []
    conf, level = int(round(100 * (1 - cfg.stats.alpha))), int(round(100 * cfg.power.level))
    out = ["### Pooled over study folders (descriptive, no verdict)", "",
           f"Per paired seed, Δ = {label} of the scheme − {cfg.baseline} in points, "
           f"{endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}, from this folder and pooled.dirs, each read "
           f"with this report's settings. t interval: {conf} %, df = n − 1; sd with its {conf} % chi-square interval; "
           f"detectable: the smallest effect the two-sided paired t test over the n pooled seeds at α "
           f"{cfg.stats.alpha} detects with {level} % power, at the sd [at the ends of its interval].", ""]
    for e in pooled:
        out += [f"{e['model']} × {e['scheme']}:", "", "| folder | seeds | per-seed Δ | mean |", "|---|---|---|--:|"]
        for f in e["folders"]:
            deltas = ", ".join(_signed(x) for x in f["deltas"])
            mean = DASH if f["mean"] is None else _signed(f["mean"])
            out.append(f"| {f['folder']} | {', '.join(map(str, f['seeds']))} | {deltas} | {mean} |")
        out.append("")
        if "mean" in e:
            lo, hi = e["sd_interval"]
            det = e["detectable"]
            out.append(f"Pooled, n = {e['n']}: mean Δ {_signed(e['mean'])}, t interval [{_signed(e['t_lo'])}, "
                       f"{_signed(e['t_hi'])}] (df {e['df']}); sd {e['sd']:.2f} [{lo:.2f}, {hi:.2f}]; detectable at "
                       f"{level} % power with {e['n']} seeds: {det[0]:.1f} points [{det[1]:.1f}, {det[2]:.1f}].")
        if e["differ"]:
            out.append("The folders differ in: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in e["differ"].items())
                       + ".")
        out.append("")
    return out


def _generation_markdown(generation: list[dict]) -> list[str]:
    out = ["### What the arms generated (final evaluation)", "",
           "| model | scheme | seed | samples | truncated (%) | mean completion tokens | truncation from |",
           "|---|---|--:|--:|--:|--:|---|"]
    for g in generation:
        out.append(f"| {g['model']} | {g['scheme']} | {g['seed']} | {g['samples']} | {pct(g['truncated_rate'])} | "
                   + (f"{g['mean_tokens']:.1f}" if g["mean_tokens"] is not None else DASH) + f" | {g['source']} |")
    return out + [""]


def _smallest_seed_counts(tables: list[MetricTable]) -> list[tuple[int, int]]:
    """(seeds, seeds with a non-zero Δ) of every Δ in the tables, distinct, sorted."""
    return sorted({(r.cells[c].delta.n_seeds, stats.nonzero_seeds(r.cells[c].delta.seed_deltas)) for t in tables
                   for r in t.rows for c in t.columns if r.cells[c].delta is not None})


def _legend(cfg: DictConfig, tables: list[MetricTable] | None = None) -> str:
    s = cfg.stats
    counts = _smallest_seed_counts(tables or [])
    reach = "; ".join(f"{n} seeds: {_p(stats.seed_sign_flip_min_p(m))}" if m == n else
                      f"{n} seeds of which {n - m} {'has' if n - m == 1 else 'have'} Δ = 0: "
                      f"{_p(stats.seed_sign_flip_min_p(m))}"
                      for n, m in counts if n > 1)
    primary = (f"the declared primary comparison is {cfg.primary_metric} on the {AVG} column (or the only "
               f"benchmark), used as it is; every other comparison of a row is Holm-adjusted over the row's "
               f"comparisons across metrics and benchmarks (t and sign-flip separately)"
               if has_primary(cfg) else "every comparison of a row is Holm-adjusted over the row's "
               "comparisons across metrics and benchmarks (t and sign-flip separately); no primary comparison "
               + ("declared" if cfg.primary_metric is None
                  else f"(primary_metric = {cfg.primary_metric} is not one of the metrics)"))
    return (f"Cells: mean over seeds, in percent; non-baseline cells show (Δ vs {cfg.baseline}) in percentage "
            f"points. * = significant at {s.alpha} for the scheme: both seed-level p-values below {s.alpha} (Holm-"
            f"adjusted unless primary) and the CI excluding 0; never with one seed ({ONE_SEED}). {AVG} = "
            f"{cfg.average} mean over the benchmark columns. Δ pairs each run with the {cfg.baseline} run of the "
            f"same model and seed, problem by problem. CI: two-level paired bootstrap (seeds"
            f"{' and' if s.resample_seeds else ' fixed,'} problems resampled, stratified by benchmark; {s.n_boot} "
            f"replicates). Seed-level tests, on the per-seed Δ (the unit of replication of a training scheme): "
            f"paired t with df = seeds − 1 and its t interval, and the exact sign-flip over all 2^seeds sign "
            f"assignments, whose smallest attainable two-sided p is 2 / 2^m for m seeds with a non-zero Δ"
            + (f" ({reach})" if reach else "") + f"; {primary}. Per-problem p (these trained models only): "
            f"two-sided paired sign-flip test on the seed-averaged per-problem differences, stratified by "
            f"benchmark (exact up to {s.exact_max} non-zero problems, else {s.n_perm} random flips); it holds the "
            f"trained models fixed and says nothing about another training seed. per-seed Δ: mean ± sd over the "
            f"paired seeds (grail_exp/analysis/stats.py)." + _design_text(cfg))


def _design_text(cfg: DictConfig) -> str:
    plans = []
    for model, plan in (cfg.design or {}).items():
        schemes = ", ".join(map(str, plan.schemes)) if plan.get("schemes") is not None else "every scheme"
        seeds = ", ".join(map(str, expected_seeds(model, cfg) or [])) or "the seeds found"
        plans.append(f"{model}: {schemes} × seeds {seeds}")
    return f" Planned cells (others not run by design): {'; '.join(plans)}." if plans else ""


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "—": "---",
                  "Δ": r"$\Delta$", "×": r"$\times$", "±": r"$\pm$", "≥": r"$\geq$", "→": r"$\to$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))


def _tex_pct(x: float | None, signed: bool = False) -> str:
    """Like pct, with a typographic minus and --- for missing."""
    return pct(x, signed).replace("-", "$-$").replace(DASH, "---")


def render_latex(tables: list[MetricTable], notes: Notes, cfg: DictConfig, title: str) -> str:
    """booktabs tables (``\\usepackage{booktabs}``): the main table per metric and its Δ table."""
    alpha = cfg.stats.alpha
    mark = lambda n: rf"\textsuperscript{{{n}}}"  # noqa: E731
    out = [f"% {latex_escape(title)} -- generated by python -m grail_exp.report; needs \\usepackage{{booktabs}}"]
    for t in tables:
        lab = latex_escape(t.label + ("" if cfg.endpoint.steps is None else
                                      f", {endpoint_text(cfg.endpoint.steps, cfg.endpoint.name)}"))
        out += [r"\begin{table}[t]", r"\centering", r"\small",
                rf"\caption{{{lab}{''.join(mark(n) for n in t.notes)} (\%) per model and scheme; "
                rf"in parentheses $\Delta$ vs "
                rf"{latex_escape(cfg.baseline)} in points, * both seed-level $p<{alpha}$ and the CI excluding 0.}}",
                r"\begin{tabular}{ll" + "r" * (1 + len(t.columns)) + "}", r"\toprule",
                " & ".join(["Model", "Scheme", "Seeds"] + [latex_escape(c) for c in t.columns]) + r" \\",
                r"\midrule"]
        last_model = None
        for r in t.rows:
            cells = []
            for c in t.columns:
                cell = r.cells[c]
                if cell.value is None:
                    txt = "---"
                else:
                    txt = _tex_pct(cell.value)
                    if not r.baseline:
                        if cell.delta is None:
                            txt += r"\,{\scriptsize($\Delta$ ---)}"
                        else:
                            star = "*" if cell.delta.significant(alpha) else ""
                            one = f"; {ONE_SEED}" if cell.delta.n_seeds == 1 else ""
                            txt += rf"\,{{\scriptsize({_tex_pct(cell.delta.delta, True)}{star}{one})}}"
                cells.append(txt + "".join(mark(n) for n in cell.notes))
            model = latex_escape(r.model) if r.model != last_model else ""
            last_model = r.model
            scheme = latex_escape(r.scheme) + "".join(mark(n) for n in r.notes)
            out.append(" & ".join([model, scheme, latex_escape(_seeds_text(r))] + cells) + r" \\")
        out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
        # Δ table
        out += [r"\begin{table}[t]", r"\centering", r"\small",
                rf"\caption{{{lab}: $\Delta$ vs {latex_escape(cfg.baseline)} (points), paired "
                rf"{int(round(100 * (1 - alpha)))}\% bootstrap CI, per-seed mean $\pm$ sd, seed-level $t$ and "
                rf"sign-flip $p$ (min.\ attainable), Holm-adjusted $p$ ($t$ / sign-flip), per-problem sign-flip "
                rf"$p$ (these trained models only).}}",
                r"\begin{tabular}{lllrrrrrrrrr}", r"\toprule",
                r"Model & Scheme & Benchmark & $\Delta$ & CI & Per-seed $\Delta$ & Seed $t$, $p$ & Seed flip $p$ & "
                r"Holm $p$ & Problem $p$ & Seeds & Problems \\",
                r"\midrule"]
        for r in t.rows:
            if r.baseline:
                continue
            for c in (t.columns if r.seeds else ["all"]):
                d = r.cells[c].delta if r.seeds else None
                head = [latex_escape(r.model), latex_escape(r.scheme), latex_escape(c)]
                if d is None:
                    out.append(" & ".join(head + ["---"] + [""] * 8) + r" \\")
                    continue
                sd = rf" $\pm$ {100 * d.seed_sd:.1f}" if d.seed_sd is not None else ""
                ci = f"[{_tex_pct(d.lo, True)}, {_tex_pct(d.hi, True)}]"
                seed_cells = [re.sub(r"-(?=[\d.i])", "$-$", latex_escape(x)) for x in _seed_tests_text(d)]
                out.append(" & ".join(head + [_tex_pct(d.delta, True), ci, _tex_pct(d.seed_mean, True) + sd,
                                              *seed_cells, latex_escape(_p(d.p_value)), str(d.n_seeds),
                                              str(d.n_problems)]) + r" \\")
        out += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    if notes.texts:
        out.append(r"% Notes:")
        out.append(r"\begin{itemize}\footnotesize")
        out += [rf"\item[\textsuperscript{{{letter(i)}}}] {latex_escape(t)}" for i, t in enumerate(notes.texts)]
        out.append(r"\end{itemize}")
    return "\n".join(out) + "\n"


def to_json(tables: list[MetricTable], notes: Notes, runs: dict, cfg: DictConfig) -> dict:
    def cell(c: Cell):
        return {"value": c.value, "n_seeds": c.n_seeds, "notes": c.notes,
                "delta": c.delta.to_dict() if c.delta else None}

    return {
        "baseline": cfg.baseline, "average": cfg.average,
        "stats": OmegaConf.to_container(cfg.stats, resolve=True),
        "tables": [{"metric": t.spec, "label": t.label, "columns": t.columns, "notes": t.notes,
                    "rows": [{"model": r.model, "scheme": r.scheme, "baseline": r.baseline, "seeds": r.seeds,
                              "paired_seeds": r.paired_seeds, "notes": r.notes,
                              "cells": {c: cell(r.cells[c]) for c in t.columns}} for r in t.rows]}
                   for t in tables],
        "notes": {letter(i): t for i, t in enumerate(notes.texts)},
        "runs": runs,
    }
