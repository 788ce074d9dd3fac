"""Finding ``\\boxed{...}`` in text: the primitives the extraction rules (``grail_exp.grading.extraction``, which the grader
uses) and the answer spans (``grail_exp.spans``) share. Standard library only, linear time."""

from __future__ import annotations

import re

BOX_OPEN = "\\boxed{"
BOX_LEN = len(BOX_OPEN)  # 7; the opening brace sits at start + 6
# Runs of identical braces are matched at once: fewer Python-level iterations.
_BRACE_RUN_RE = re.compile(r"\{+|\}+")
# `\boxed{` is tried first, so its brace is consumed as a box opener.
_TOKEN_RE = re.compile(r"\\boxed\{|\{+|\}+")


def matching_close(text: str, open_idx: int) -> int:
    """Index of the brace closing the `{` at ``open_idx``, or -1 if unterminated."""
    depth = 0
    for m in _BRACE_RUN_RE.finditer(text, open_idx):
        run = m.end() - m.start()
        if text[m.start()] == "{":
            depth += run
        else:
            depth -= run
            if depth <= 0:  # the closer that reached depth 0 sits `-depth` before the run's last brace
                return m.end() + depth - 1
    return -1


def _balanced_boxes(text: str, pos: int):
    """Yield ``(start, close_idx)`` for every balanced ``\\boxed{`` at or after ``pos``.

    One left-to-right pass with a stack of open braces. Stack matching pairs
    each `{` with the first later position where the brace count returns to
    its level, which is exactly what an independent "walk and count" from
    that box would find; so this gives the same answer as scanning every
    occurrence separately, in O(n) instead of O(n * occurrences).
    Boxes are yielded in closing order, not start order.
    """
    stack: list[int] = []  # box start for a box opener, -1 for a plain brace
    for m in _TOKEN_RE.finditer(text, pos):
        first = text[m.start()]
        if first == "}":
            for close in range(m.start(), m.end()):
                # An unmatched `}` cannot close anything opened later: ignore it.
                if not stack:
                    break
                start = stack.pop()
                if start >= 0:
                    yield start, close
        elif first == "{":
            stack.extend([-1] * (m.end() - m.start()))
        else:
            stack.append(m.start())


def find_last_boxed_span(text: str) -> tuple[int, int] | None:
    """Span ``[start, end)`` of the last balanced ``\\boxed{...}``, marker and closing brace included.

    Among all ``\\boxed{`` occurrences whose braces balance, the one that starts last (nested braces
    are kept; an unterminated box is skipped). ``\\boxed {`` and ``\\fbox`` are not recognised.
    Linear time.
    """
    last = text.rfind(BOX_OPEN)
    if last < 0:
        return None
    # Common case: the last box is balanced; only the tail is scanned.
    close = matching_close(text, last + BOX_LEN - 1)
    if close >= 0:
        return last, close + 1
    # The last box is unterminated: one linear pass over all boxes.
    best: tuple[int, int] | None = None
    for start, close in _balanced_boxes(text, text.find(BOX_OPEN)):
        if best is None or start > best[0]:
            best = (start, close)
    return None if best is None else (best[0], best[1] + 1)


def extract_last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` in ``text`` (the answer the reward grades), or None."""
    span = find_last_boxed_span(text)
    return None if span is None else text[span[0] + BOX_LEN : span[1] - 1]


def find_first_boxed_span(text: str) -> tuple[int, int] | None:
    """Span ``[start, end)`` of the first complete ``\\boxed{...}``, marker and closing brace included.

    GRAIL reference semantics: take the first ``\\boxed{``, count braces; if
    the text ends unbalanced, skip it and continue with the next occurrence
    (so a balanced box nested inside an unterminated one is found). This is
    the balanced box with the smallest start, computed in linear time.
    """
    first = text.find(BOX_OPEN)
    if first < 0:
        return None
    close = matching_close(text, first + BOX_LEN - 1)
    if close >= 0:
        return first, close + 1
    best: tuple[int, int] | None = None
    for start, close in _balanced_boxes(text, first):
        if best is None or start < best[0]:
            best = (start, close)
    return None if best is None else (best[0], best[1] + 1)
