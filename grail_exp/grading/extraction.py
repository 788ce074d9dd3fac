"""Which part of a completion is graded: the extraction modes of ``reward.extraction`` and ``benchmark.extraction``.

Three modes, chosen by config (the same names for the training reward and for evaluation):

``last_balanced`` (default for both)
    The content of the balanced ``\\boxed{...}`` that starts last (``boxed.extract_last_boxed``):
    an unterminated box is skipped; a box nested in another box wins over its parent.

``paper``
    What the GRAIL reference code does at that place (declare-lab/grail @ 749aa4c4):

    - reward (``src/train/utils/reward_utils.py``): the recursive regex
      ``\\boxed\\{((?:[^{}]+|\\{(?1)\\})*)\\}`` with ``finditer``, last match, ``.strip()``. Matches do not
      overlap, so a box nested inside a matched box is never a match of its own; an unterminated box fails
      to match and the scan moves on (boxes inside it can still match). ``reward_reference``.
    - evaluation (``src/eval/run_eval.py`` and ``eval_results_base.py``, ``extract_boxed_inner``): boxes
      are read left to right, each search resuming after the previous box's closing brace, and the scan
      **stops at the first unterminated box**; the last box read wins (``\\boxed{}`` gives ``""``).
      ``eval_reference``. The evaluation also drops samples whose text is empty from the problem's
      denominator and averages tokens over samples with an extracted answer only (``evaluate.py`` and
      ``metrics.summarize_benchmark(protocol="paper")``).

``math_verify``
    No box search of ours: math-verify's own extraction runs over the whole completion, configured as
    TRL's ``accuracy_reward`` (huggingface/trl ``trl/rewards/accuracy_rewards.py``): LaTeX only, boxed
    matched first, no anchor-free extraction, ``first_match``. Measured (math-verify 0.9.0,
    ``python sweeps/bench_extraction.py`` -> ``results/extraction_modes.md``): it reads several boxes as one
    list answer (``\\boxed{2}, \\boxed{3}`` is ``2,3``), and inside ``$...$`` after an anchor such as
    "the answer is" it also reads ``\\boxed {5}`` (a space), ``\\fbox{5}`` and an unboxed ``$5$``; in bare text
    (no ``$``, no anchor) it reads none of those three. An earlier ``\\boxed{4}`` before the final
    ``\\boxed{5}`` gives 5. The gold is parsed as in the other modes (``$gold$``).

With ``model.strip_think: true``, a thinking model's completion is first cut to the text after its last
``</think>`` (``strip_think``), whatever the mode.

Box extraction runs in the calling process (pure string work, linear time); ``math_verify`` sends the
whole completion to the grading worker, under the same hard timeout (``rewards.MathVerifier``).
Standard library only, like ``grail_exp.grading.rewards`` (it sits on the grading path).
"""

from __future__ import annotations

from collections.abc import Callable

from grail_exp.errors import ConfigError
from grail_exp.grading.boxed import BOX_LEN, BOX_OPEN, extract_last_boxed, matching_close


def strip_think(text: str) -> str:
    """Text after the last ``</think>`` (thinking models, ``model.strip_think``), or ``text`` unchanged if absent:
    a box drafted while thinking is never graded."""
    head, sep, tail = text.rpartition("</think>")
    return tail if sep else text


MODES = ("paper", "last_balanced", "math_verify")  # the values of reward.extraction / benchmark.extraction
WHOLE_COMPLETION = "math_verify"  # the rule that hands the whole completion to math-verify


def eval_reference(text: str) -> str | None:
    """The reference evaluation's box: last box read left to right before the first unterminated one."""
    answer, pos = None, 0
    while (start := text.find(BOX_OPEN, pos)) >= 0:
        close = matching_close(text, start + BOX_LEN - 1)
        if close < 0:  # unterminated: the reference stops here, boxes after it are never read
            break
        answer, pos = text[start + BOX_LEN : close], close + 1
    return answer


def reward_reference(text: str) -> str | None:
    """The reference reward's box: last non-overlapping balanced box, unterminated ones skipped, stripped."""
    answer, pos = None, 0
    while (start := text.find(BOX_OPEN, pos)) >= 0:
        close = matching_close(text, start + BOX_LEN - 1)
        if close < 0:  # no match here: the regex scan moves on and may match a box inside this one
            pos = start + 1
        else:  # a match: the scan resumes after it, so boxes nested inside are not matches of their own
            answer, pos = text[start + BOX_LEN : close].strip(), close + 1
    return answer


# Concrete rules, by name: a function text -> answer string (None = no answer), or None for math_verify.
RULES: dict[str, Callable[[str], str | None] | None] = {
    "last_balanced": extract_last_boxed,
    "paper_reward": reward_reference,
    "paper_eval": eval_reference,
    WHOLE_COMPLETION: None,
}


# One line per mode and place, recorded with every run and table.
DESCRIPTIONS = {
    "last_balanced": {"reward": "last balanced \\boxed{}", "benchmark": "last balanced \\boxed{}"},
    "paper": {"reward": "declare-lab/grail reward regex: last non-nested \\boxed{}, stripped",
              "benchmark": "declare-lab/grail extract_boxed_inner (boxes before the first unterminated one); "
                           "empty samples out of the denominator; tokens over extracted samples"},
    "math_verify": {"reward": "math-verify over the whole completion (TRL accuracy_reward settings)",
                    "benchmark": "math-verify over the whole completion (TRL accuracy_reward settings)"},
}


def _rule(mode: str, paper_rule: str, key: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"{key} = {mode!r}: must be one of: {', '.join(MODES)}")
    return paper_rule if mode == "paper" else mode


def reward_rule(mode: str) -> str:
    """The concrete rule behind ``reward.extraction``."""
    return _rule(mode, "paper_reward", "reward.extraction")


def benchmark_rule(mode: str) -> str:
    """The concrete rule behind ``benchmark.extraction``."""
    return _rule(mode, "paper_eval", "benchmark.extraction")
