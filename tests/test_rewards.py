"""Tests for grail_exp.grading.rewards: extraction, math-verify grading, and the killable worker pool."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import pytest

from grail_exp.grading.boxed import extract_last_boxed, find_first_boxed_span
from grail_exp.grading.extraction import strip_think
from grail_exp.grading.rewards import GradeResult, MathVerifier, grade_one

BOX = "\\boxed{"
HANG_GUARD_S = 1.0  # generous: these only guard against quadratic blow-ups / hangs (CPU seconds, not wall time)
# The pool's per-answer wall-time limit in these tests. A real answer needs milliseconds of CPU; 5 s of wall time
# leaves it room on a machine loaded many times over. A debug sleep of SLEEP_S never ends on its own during a test:
# an answer that comes back "timeout" was killed by the pool (a finished sleep reports "ok").
POOL_HARD_S = 5.0
SLEEP_S = 600


# --------------------------------------------------------------------------
# Naive reference implementations (quadratic, written straight from the spec)
# --------------------------------------------------------------------------


def _walk(text: str, open_idx: int) -> int:
    depth = 0
    for j in range(open_idx, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def _ref_last_boxed(text: str) -> str | None:
    best = None
    i = text.find(BOX)
    while i >= 0:
        close = _walk(text, i + len(BOX) - 1)
        if close >= 0:
            best = text[i + len(BOX) : close]
        i = text.find(BOX, i + 1)
    return best


def _ref_first_span(text: str) -> tuple[int, int] | None:
    i = text.find(BOX)
    while i >= 0:
        close = _walk(text, i + len(BOX) - 1)
        if close >= 0:
            return i, close + 1
        i = text.find(BOX, i + 7)
    return None


# --------------------------------------------------------------------------
# Extraction
# --------------------------------------------------------------------------


def test_extract_nested_braces_kept():
    assert extract_last_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_last_boxed(r"\boxed{\left\{1,2\right\}}") == r"\left\{1,2\right\}"


def test_extract_last_of_several():
    assert extract_last_boxed(r"\boxed{1} then \boxed{2} and finally \boxed{3}") == "3"


def test_extract_no_box():
    assert extract_last_boxed("the answer is 42") is None
    assert extract_last_boxed("") is None
    # Variants that are deliberately not recognised.
    assert extract_last_boxed(r"\boxed {3}") is None
    assert extract_last_boxed(r"\fbox{3}") is None


def test_extract_unbalanced_last_falls_back_to_previous():
    assert extract_last_boxed(r"\boxed{7} and then \boxed{8") == "7"
    assert extract_last_boxed(r"\boxed{7} \boxed{\frac{1}{2}") == "7"
    assert extract_last_boxed(r"\boxed{") is None


def test_extract_nested_box_inside_unterminated():
    assert extract_last_boxed(r"\boxed{ \boxed{5} ") == "5"


def test_extract_empty_box():
    assert extract_last_boxed(r"\boxed{}") == ""


def test_extract_matches_naive_reference_on_random_strings():
    rng = random.Random(0)
    pieces = [BOX, BOX, "{", "}", "}", "{{", "}}}", "a", "\\boxed", "x{"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 16)))
        assert extract_last_boxed(text) == _ref_last_boxed(text), text
        assert find_first_boxed_span(text) == _ref_first_span(text), text


@pytest.mark.parametrize(
    "text",
    [
        "x" * 1_000_000 + r"\boxed{5}",  # 1 MB of prose
        "{}" * 500_000 + r"\boxed{5}",  # 1 MB of braces
        BOX + "{" * 5000 + "a" + "}" * 5000 + "}",  # 5,000 nested braces
        BOX + "{" * 5000 + "a" + "}" * 4999,  # ... unterminated
        BOX * 150_000,  # ~1 MB of unterminated openers
        BOX * 100_000 + "}" * 99_999,  # deeply nested boxes, outermost unterminated
        r"\boxed{1}" + BOX + "{" * 1_000_000,  # long unterminated tail
    ],
    ids=["1MB-prose", "1MB-braces", "5k-nested", "5k-nested-open", "openers", "nested-boxes", "open-tail"],
)
def test_extraction_is_fast_on_pathological_input(text):
    t0 = time.process_time()  # this process's CPU time: the work done, whatever else loads the machine
    extract_last_boxed(text)
    find_first_boxed_span(text)
    assert time.process_time() - t0 < 2 * HANG_GUARD_S


def test_first_span_several_boxes():
    text = r"a \boxed{1} b \boxed{22}"
    start, end = find_first_boxed_span(text)
    assert text[start:end] == r"\boxed{1}"
    assert (start, end) == (2, 11)


def test_first_span_nested_inside_unterminated():
    text = r"pre \boxed{ x \boxed{y{z}} tail"
    start, end = find_first_boxed_span(text)
    assert text[start:end] == r"\boxed{y{z}}"
    assert start == text.index(r"\boxed{y")


def test_first_span_outer_box_wins_over_inner():
    text = r"\boxed{\boxed{1}+1}"
    assert find_first_boxed_span(text) == (0, len(text))


def test_first_span_offsets_and_none():
    text = "We get " + r"\boxed{\frac{3}{4}}" + " done"
    start, end = find_first_boxed_span(text)
    assert text[start:end].startswith(BOX) and text[start:end].endswith("}")
    assert text[start:end] == r"\boxed{\frac{3}{4}}"
    assert find_first_boxed_span("no box") is None
    assert find_first_boxed_span(BOX + "never closed") is None


def test_strip_think():
    assert strip_think("<think>a</think>b</think>answer") == "answer"
    assert strip_think("plain answer") == "plain answer"


# --------------------------------------------------------------------------
# Grading, in process
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred,gold,expected",
    [
        (r"\frac{1}{2}", "0.5", True),
        ("0.5", r"\frac{1}{2}", True),
        ("42", "42", True),
        ("41", "42", False),
        (None, "42", False),
        ("", "42", False),
    ],
)
def test_grade_one(pred, gold, expected):
    assert grade_one(pred, gold) is expected


def test_grade_one_outside_main_thread():
    # math-verify's signal.alarm raises in threads; grade_one must disable it instead.
    out = {}
    thread = threading.Thread(target=lambda: out.update(ok=grade_one("14", "14")))
    thread.start()
    thread.join(30)
    assert out == {"ok": True}


def test_in_process_verifier_counters_add_up():
    mv = MathVerifier(num_workers=0)
    res = mv.score([r"\boxed{14}", r"\boxed{13}", "none", r"\boxed{}"], ["14"] * 4)
    assert [r.status for r in res] == ["ok", "ok", "no_answer", "no_answer"]
    assert [r.correct for r in res] == [True, False, False, False]
    assert [r.extracted for r in res] == ["14", "13", None, ""]
    assert mv.counters == {"graded": 4, "correct": 1, "no_answer": 2, "timeout": 0, "error": 0}
    with pytest.raises(ValueError):
        mv.grade(["1"], [])


# --------------------------------------------------------------------------
# Grading in the worker pool
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    mv = MathVerifier(
        num_workers=2, hard_timeout_s=POOL_HARD_S, parse_timeout=1, verify_timeout=1, _allow_debug=True
    )
    yield mv
    mv.close()


EQUIV_CASES = [
    (r"\frac{1}{2}", "0.5", True),
    ("42", "42", True),
    ("41", "42", False),
    (r"\sqrt{4}", "2", True),
    ("x+1", "1+x", True),
    (r"\frac{2}{3}", "0.7", False),
    ("3", r"x=3", True),
    (r"\{1,2\}", r"\{2,1\}", True),
]


def test_pool_grades_equivalent_forms(pool):
    preds, golds, expected = zip(*EQUIV_CASES)
    res = pool.grade(list(preds), list(golds))
    assert [r.correct for r in res] == list(expected)
    assert all(r.status == "ok" for r in res)
    assert [r.extracted for r in res] == list(preds)


def test_in_process_agrees_with_pool(pool):
    preds, golds, _ = zip(*EQUIV_CASES)
    in_process = MathVerifier(num_workers=0, parse_timeout=1, verify_timeout=1)
    a = pool.grade(list(preds), list(golds))
    b = in_process.grade(list(preds), list(golds))
    assert a == b


def test_pool_score_extracts_last_box(pool):
    comps = [r"12+5=17. \boxed{17} 17-3=14. \boxed{14}", r"\boxed{13}", "no answer", r"\boxed{}"]
    res = pool.score(comps, ["14"] * 4)
    assert res == [
        GradeResult(True, "14", "ok"),
        GradeResult(False, "13", "ok"),
        GradeResult(False, None, "no_answer"),
        GradeResult(False, "", "no_answer"),
    ]


def test_hard_timeout_kills_worker_and_pool_keeps_working(pool):
    before = dict(pool.counters)
    restarts = pool.worker_restarts
    res = pool.grade(["42", f"__sleep__:{SLEEP_S}", "41", r"\frac{1}{2}"], ["42", "42", "42", "0.5"])
    assert [r.status for r in res] == ["ok", "timeout", "ok", "ok"]  # killed at POOL_HARD_S, not after SLEEP_S
    assert [r.correct for r in res] == [True, False, False, True]
    assert pool.worker_restarts == restarts + 1
    assert pool.counters["timeout"] == before["timeout"] + 1
    # The pool still works, with the replacement worker.
    res = pool.grade(["7"] * 6, ["7"] * 6)
    assert all(r.correct and r.status == "ok" for r in res)


def test_answers_queued_behind_a_timeout_are_still_graded(pool):
    # Each worker has one answer queued behind the running one; when the running
    # one is killed, the queued one must be re-dispatched, not lost.
    preds = [f"__sleep__:{SLEEP_S}"] + [str(n) for n in range(12)]
    golds = ["0"] + [str(n) for n in range(12)]
    res = pool.grade(preds, golds)
    assert res[0].status == "timeout"
    assert all(r.correct and r.status == "ok" for r in res[1:])


def test_hard_timeout_is_per_answer_not_per_batch(pool):
    # Two answers of 0.55 x the limit per worker exceed it together, not individually (0.45 x 5 s = 2.25 s of slack
    # for the scheduler per answer).
    res = pool.grade([f"__sleep__:{0.55 * POOL_HARD_S}"] * 4, ["1"] * 4)
    assert [r.status for r in res] == ["ok"] * 4


def test_worker_crash_is_error_and_replaced(pool):
    before = dict(pool.counters)
    res = pool.grade(["1", "__crash__", "2", "3", "4"], ["1", "1", "1", "3", "4"])
    assert [(r.correct, r.status) for r in res] == [
        (True, "ok"),
        (False, "error"),
        (False, "ok"),
        (True, "ok"),
        (True, "ok"),
    ]
    assert pool.counters["error"] == before["error"] + 1
    assert all(r.correct for r in pool.grade(["5", "6"], ["5", "6"]))


def test_hostile_answer_does_not_hang(pool):
    res = pool.grade([r"2^{2^{2^{2^{2^{100}}}}}", "4"], ["4", "4"])  # returns: the pool kills it at POOL_HARD_S
    assert res[0].correct is False and res[0].status in ("ok", "timeout")
    assert res[1] == GradeResult(True, "4", "ok")


def test_pool_counters_add_up(pool):
    before = dict(pool.counters)
    res = pool.score([r"\boxed{3}", r"\boxed{4}", "nothing", r"\boxed{}"], ["3", "3", "3", "3"])
    delta = {k: pool.counters[k] - before[k] for k in before}
    assert delta == {"graded": 4, "correct": 1, "no_answer": 2, "timeout": 0, "error": 0}
    ok = sum(r.status == "ok" for r in res)
    assert delta["graded"] == ok + delta["no_answer"] + delta["timeout"] + delta["error"]


def test_debug_hook_off_by_default_and_close_reaps_workers():
    with MathVerifier(num_workers=1) as mv:
        # Without _allow_debug the marker is just a (wrong) answer, graded at once: honoured, it would sleep past the
        # default hard timeout (15 s) and come back "timeout".
        res = mv.grade([f"__sleep__:{SLEEP_S}", "9"], ["9", "9"])
        assert res[0].status in ("ok", "error") and res[0].correct is False
        assert res[1] == GradeResult(True, "9", "ok")
        processes = [w.process for w in mv._pool.workers]
        assert len(processes) == 1 and processes[0].is_alive()
    for p in processes:
        assert not p.is_alive() and p.exitcode is not None  # exited and reaped
        assert p not in multiprocessing.active_children()
    mv.close()  # idempotent
    with pytest.raises(RuntimeError):
        mv.grade(["1"], ["1"])
