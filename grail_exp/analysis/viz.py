"""Per-token weight heatmaps (HTML): correct and wrong rollouts side by side."""

from __future__ import annotations

import html
import math


def _color(w: float) -> str:
    """Diverging on log(w): blue below 1 (suppressed), white at 1, red above 1 (boosted); saturates at 0.25x / 4x."""
    if w <= 0:
        return "rgb(220,220,220)"
    x = max(-1.0, min(1.0, math.log(w) / math.log(4.0)))
    if x >= 0:
        g = int(255 - 175 * x)
        return f"rgb(255,{g},{g})"
    g = int(255 + 175 * x)
    return f"rgb({g},{g},255)"


def _row_html(row: dict, index: int) -> str:
    spans = []
    for tok, w in zip(row["tokens"], row["weights"]):
        text = html.escape(tok).replace("\n", "↵<br>")
        spans.append(f'<span class="t" style="background:{_color(w)}" title="w = {w:.3f}">{text}</span>')
    ws = row["weights"]
    mean = sum(ws) / max(1, len(ws))
    return (f'<div class="row"><div class="meta">#{index} · A = {row.get("advantage", 0):+.3f} · '
            f'{len(ws)} tokens · mean w {mean:.3f} · max {max(ws, default=0):.2f}</div>'
            f'<div class="text">{"".join(spans)}</div></div>')


def _is_correct(row: dict) -> bool:
    """A row's grade: its ``correct`` entry; rows without one fall back to the sign of A (A > 0: correct), which
    misfiles the rollouts of all-correct groups (A = 0)."""
    return bool(row["correct"]) if "correct" in row else row.get("advantage", 0) > 0


def weights_html(rows: list[dict], title: str = "token weights") -> str:
    """An HTML page of ``rows`` (dicts with ``tokens``, ``weights``, ``advantage`` and ``correct``), each token
    coloured by its weight, in two columns: correct and wrong rollouts."""
    correct = [(i, r) for i, r in enumerate(rows) if _is_correct(r)]
    wrong = [(i, r) for i, r in enumerate(rows) if not _is_correct(r)]
    legend = " ".join(f'<span class="t key" style="background:{_color(w)}">{w:g}</span>' for w in (0.25, 0.5, 1, 2, 4))

    def col(name, items):
        return f'<div class="col"><h2>{name} ({len(items)})</h2>' + "".join(_row_html(r, i) for i, r in items) + "</div>"

    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
.cols {{ display: flex; gap: 2em; align-items: flex-start; }}
.col {{ flex: 1; min-width: 0; }}
.row {{ border: 1px solid #ddd; border-radius: 6px; padding: .6em; margin-bottom: .8em; }}
.meta {{ font-size: .8em; color: #666; margin-bottom: .3em; }}
.text {{ font-family: ui-monospace, monospace; font-size: .9em; line-height: 1.7; word-break: break-word; }}
.t {{ padding: 1px 0; border-radius: 2px; white-space: pre-wrap; }}
.key {{ padding: 1px 6px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Token colour = weight w (Â = w·A): {legend} &nbsp; hover a token for its value.</p>
<div class="cols">{col("correct rollouts", correct)}{col("wrong rollouts", wrong)}</div>
</body></html>"""
