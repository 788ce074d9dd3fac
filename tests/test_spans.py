"""Answer spans (marker / content / closing / post) in reference and exact mode, first and last box.

Observed tokenisations that the tests below pin (embedded tokenizers, vocab 320):

* qwen (byte-level BPE): ``" \\boxed{9}"`` -> ``Ġ\\ boxed { 9 }``; ``"\\boxed{"`` -> ``\\ boxed {``
  (marker = 3 tokens); fused ``Ġ\\`` and ``{}.`` / ``{}`` exist; ``}.`` and ``{3`` do not.
* llama (metaspace BPE + byte fallback): ``" \\boxed{9}"`` -> ``▁\\boxed{ 9 }``; ``"\\boxed{"`` ->
  ``\\b oxed{`` (marker = 2 tokens); fused ``▁\\boxed{``, ``▁\\boxed{}.``, ``}.`` exist.
* Both re-encode ``"a" + "... 9. "`` with a bare trailing space token, so the reference span of
  the usual ``"... 9. \\boxed{9}"`` is one token to the right of the box (pinned below).
* A tiny extra byte-level tokenizer with merges ``{3``, ``}.`` and ``}Ã`` covers fused tokens that
  neither embedded tokenizer has.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from grail_exp.grading.boxed import extract_last_boxed, find_first_boxed_span
from grail_exp.spans import AnswerSpans, answer_spans, find_last_boxed_span

MODES = ("reference", "exact")
PLAIN = "7+5=12. 12-3=9. \\boxed{9}"


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def toks():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_tokenizer

    task = ArithmeticTask()
    return {"qwen": build_tokenizer("qwen", task), "llama": build_tokenizer("llama", task)}


@pytest.fixture(scope="module")
def tiny():
    """Byte-level BPE over single bytes with exactly three merges: ``{3``, ``}.`` and ``}Ã``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("{", "3"), ("}", "."), ("}", "Ã")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )


# ------------------------------------------------------------------------------------------- helpers
def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def completion(tok, text: str, eos: bool = True) -> list[int]:
    return enc(tok, text) + ([tok.eos_token_id] if eos else [])


def batch(tok, rows: list[list[int]], width: int | None = None):
    """Right-pad ``rows`` with the pad id; the mask is 1 on the given tokens (pads excluded)."""
    C = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), C), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), C, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    return ids, mask


def spans_of(tok, rows, width=None, **kw) -> AnswerSpans:
    ids, mask = batch(tok, rows, width)
    return answer_spans(ids, mask, tok, **kw)


def pos(m: torch.Tensor) -> list[int]:
    return m.nonzero().flatten().tolist()


def dec(tok, ids: list[int], m: torch.Tensor) -> str:
    return tok.decode([ids[i] for i in pos(m)])


def masks(sp: AnswerSpans, b: int = 0, width: int | None = None) -> dict:
    w = slice(0, width)
    return {
        "has_box": bool(sp.has_box[b]),
        "marker": pos(sp.marker[b, w]),
        "content": pos(sp.content[b, w]),
        "closing": pos(sp.closing[b, w]),
        "post": pos(sp.post[b, w]),
    }


def shifted(d: dict, by: int) -> dict:
    return {k: (v if k == "has_box" else [i + by for i in v]) for k, v in d.items()}


def reference_oracle(tok, ids: list[int], mask: list[int], box: str = "first") -> tuple[dict, int | None]:
    """Literal per-row transcription of method spec §11.3 (plus the unclamped end, for tests)."""
    C = len(ids)
    text = tok.decode(ids, skip_special_tokens=True)
    lead = 0
    while lead < C and ids[lead] == tok.pad_token_id:
        lead += 1
    empty = {"has_box": False, "marker": [], "content": [], "closing": [], "post": []}
    span = (find_first_boxed_span if box == "first" else find_last_boxed_span)(text)
    if span is None:
        return empty, None
    s, e = span
    a = len(enc(tok, "a"))
    start = lead + len(enc(tok, "a" + text[:s])) - a
    length = len(enc(tok, "a" + text[s:e])) - a
    end = min(start + length, C)
    if start >= end:
        return empty, start + length
    k = min(len(enc(tok, "\\boxed{")), end - start)
    out = {
        "has_box": True,
        "marker": list(range(start, start + k)),
        "content": list(range(start + k, end - 1)),
        "closing": [end - 1] if end - 1 >= start + k else [],
        "post": [i for i in range(end, C) if mask[i]],
    }
    return out, start + length


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


def token_bytes(tok, style: str, tid: int) -> bytes:
    if tid in tok.all_special_ids:
        return b""
    piece = tok.convert_ids_to_tokens(tid)
    if style == "qwen":
        return bytes(_BYTE_OF[c] for c in piece)
    m = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()


def exact_oracle(tok, style: str, ids: list[int], mask: list[int], box: str = "first") -> dict:
    """Exact mode from byte offsets: a token covers the characters its UTF-8 bytes overlap."""
    text = tok.decode(ids, skip_special_tokens=True)
    char_of = []  # byte offset -> index of the character holding it
    for ci, ch in enumerate(text):
        char_of += [ci] * len(ch.encode())
    char_of.append(len(text))
    out = {"has_box": False, "marker": [], "content": [], "closing": [], "post": []}
    span = (find_first_boxed_span if box == "first" else find_last_boxed_span)(text)
    if span is None:
        return out
    s, e = span
    out["has_box"] = True
    b0 = 0
    for i, tid in enumerate(ids):
        nb = len(token_bytes(tok, style, tid))
        lo = char_of[b0]
        hi = char_of[b0 + nb - 1] + 1 if nb else lo
        b0 += nb
        if lo >= e:
            if mask[i]:
                out["post"].append(i)
        elif lo == hi:
            continue
        elif lo < s + 7 and hi > s:
            out["marker"].append(i)
        elif lo <= e - 1 < hi:
            out["closing"].append(i)
        elif lo < e - 1 and hi > s + 7:
            out["content"].append(i)
    assert b0 == len(text.encode())
    return out


STYLES = ("qwen", "llama")


# --------------------------------------------------------------------------------- plain completion
@pytest.mark.parametrize("style", STYLES)
def test_plain_completion_exact_mode(toks, style):
    tok = toks[style]
    ids = completion(tok, PLAIN)
    sp = spans_of(tok, [ids], span_mapping="exact")
    assert sp.has_box.tolist() == [True]
    # the fused leading-space tokens (qwen `Ġ\`, llama `▁\boxed{`) count as marker
    assert dec(tok, ids, sp.marker[0]) == " \\boxed{"
    assert dec(tok, ids, sp.content[0]) == "9"
    assert dec(tok, ids, sp.closing[0]) == "}"
    assert pos(sp.post[0]) == [len(ids) - 1] and ids[-1] == tok.eos_token_id
    assert torch.equal(sp.span, sp.marker | sp.content | sp.closing)
    for m in (sp.has_box, sp.marker, sp.content, sp.closing, sp.post):
        assert m.dtype == torch.bool and m.device == torch.device("cpu")


@pytest.mark.parametrize("style", STYLES)
def test_reference_agrees_with_exact_when_nothing_is_fused_across_the_box(toks, style):
    tok = toks[style]
    for text in ["7+5=12. 12-3=9.\n\\boxed{9}", "7+5=12. 12-3=9.\\boxed{9}", "\\boxed{9}"]:
        ids = completion(tok, text)
        ref = masks(spans_of(tok, [ids], span_mapping="reference"))
        assert ref == masks(spans_of(tok, [ids], span_mapping="exact")), text
        assert tok.decode([ids[i] for i in ref["marker"]]) == "\\boxed{"
        assert tok.decode([ids[i] for i in ref["content"]]) == "9"
        assert tok.decode([ids[i] for i in ref["closing"]]) == "}"
        assert ref["post"] == [len(ids) - 1]


def test_reference_plain_completion_is_one_token_right_qwen(toks):
    """`"a"+"... 9. "` re-encodes with a bare `Ġ`, live has fused `Ġ\\`: start is one too far right."""
    tok = toks["qwen"]
    ids = completion(tok, PLAIN)
    assert tok.convert_ids_to_tokens(ids[-6:]) == ["Ġ\\", "boxed", "{", "9", "}", "<|im_end|>"]
    sp = spans_of(tok, [ids], span_mapping="reference")
    C = len(ids)
    assert masks(sp) == {"has_box": True, "marker": [C - 5, C - 4, C - 3], "content": [C - 2],
                         "closing": [C - 1], "post": []}
    assert dec(tok, ids, sp.marker[0]) == "boxed{9"
    assert masks(sp) == shifted(masks(spans_of(tok, [ids], span_mapping="exact")), 1) | {"post": []}


def test_reference_plain_completion_is_one_token_right_llama(toks):
    tok = toks["llama"]
    ids = completion(tok, PLAIN)
    assert tok.convert_ids_to_tokens(ids[-4:]) == ["▁\\boxed{", "9", "}", "<|eot_id|>"]
    sp = spans_of(tok, [ids], span_mapping="reference")
    C = len(ids)
    # start = C-3, length 4 runs past C: end clamped to C; marker (2 tokens) = `9 }`, closing = EOS
    assert masks(sp) == {"has_box": True, "marker": [C - 3, C - 2], "content": [], "closing": [C - 1],
                         "post": []}


# ------------------------------------------------------------------------------- first / last box
@pytest.mark.parametrize("style", STYLES)
def test_several_boxes_first_and_last(toks, style):
    tok = toks[style]
    text = "x \\boxed{3}. Done \\boxed{4}"
    ids = completion(tok, text)
    first = spans_of(tok, [ids], span_mapping="exact", box="first")
    last = spans_of(tok, [ids], span_mapping="exact", box="last")
    assert dec(tok, ids, first.content[0]) == "3"
    assert dec(tok, ids, last.content[0]) == "4"
    assert dec(tok, ids, last.closing[0]) == "}"
    assert pos(last.post[0]) == [len(ids) - 1]
    assert pos(first.post[0])[0] > pos(first.closing[0])[0] and pos(first.post[0])[-1] == len(ids) - 1
    for box in ("first", "last"):
        want, _ = reference_oracle(tok, ids, [1] * len(ids), box)
        assert masks(spans_of(tok, [ids], box=box)) == want


def test_find_last_boxed_span_matches_the_graded_box():
    cases = ["x \\boxed{3}. Done \\boxed{4}", "\\boxed{\\frac{1}{2}}", "\\boxed{1} \\boxed{2",
             "\\boxed{a \\boxed{b}}", "no box", "\\boxed{1 \\boxed{2} \\boxed{3"]
    for t in cases:
        span = find_last_boxed_span(t)
        got = None if span is None else t[span[0] + 7 : span[1] - 1]
        assert got == extract_last_boxed(t), t
        if span is not None:
            assert t[span[0] : span[0] + 7] == "\\boxed{" and t[span[1] - 1] == "}"
    assert find_last_boxed_span("\\boxed{1} \\boxed{2") == (0, 9)


# ----------------------------------------------------------------------------- nested / fused tokens
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", MODES)
def test_nested_braces(toks, style, mode):
    tok = toks[style]
    ids = completion(tok, "\\boxed{\\frac{1}{2}}.")
    sp = spans_of(tok, [ids], span_mapping=mode)
    assert dec(tok, ids, sp.marker[0]) == "\\boxed{"
    assert dec(tok, ids, sp.content[0]) == "\\frac{1}{2}"
    # llama fuses the closing brace with the full stop: `}.` is the closing token
    assert dec(tok, ids, sp.closing[0]) == ("}" if style == "qwen" else "}.")
    n_post = 2 if style == "qwen" else 1  # qwen: `.` and EOS; llama: EOS only
    assert pos(sp.post[0]) == list(range(len(ids) - n_post, len(ids)))


def test_fused_closing_token_llama(toks):
    tok = toks["llama"]
    ids = completion(tok, "x \\boxed{3}. Done")
    assert "}." in tok.convert_ids_to_tokens(ids)
    for mode in MODES:
        sp = spans_of(tok, [ids], span_mapping=mode)
        if mode == "exact":
            assert tok.convert_ids_to_tokens([ids[i] for i in pos(sp.closing[0])]) == ["}."]
            assert dec(tok, ids, sp.content[0]) == "3"
        else:  # shifted right by one: `}.` lands in the marker
            assert masks(sp) == reference_oracle(tok, ids, [1] * len(ids))[0]


@pytest.mark.parametrize("style", STYLES)
def test_fused_empty_box_is_all_marker(toks, style):
    """qwen `{}.` and llama `▁\\boxed{}.` hold marker and closing: marker wins, nothing is closing."""
    tok = toks[style]
    ids = completion(tok, "x \\boxed{}.")
    fused = {"qwen": "{}.", "llama": "▁\\boxed{}."}[style]
    assert fused in tok.convert_ids_to_tokens(ids)
    sp = spans_of(tok, [ids], span_mapping="exact")
    assert masks(sp) == {"has_box": True, "marker": list(range(1, len(ids) - 1)), "content": [], "closing": [],
                         "post": [len(ids) - 1]}


@pytest.mark.parametrize("mode", MODES)
def test_tiny_tokenizer_fused_boundary_tokens(tiny, mode):
    ids = completion(tiny, "x\\boxed{3}.")
    assert tiny.convert_ids_to_tokens(ids)[-3:] == ["{3", "}.", "<eos>"]
    sp = spans_of(tiny, [ids], span_mapping=mode)
    C = len(ids)
    # `{3` overlaps marker and content: marker wins; `}.` is the closing token
    assert masks(sp) == {"has_box": True, "marker": list(range(1, C - 2)), "content": [], "closing": [C - 2],
                         "post": [C - 1]}

    ids = completion(tiny, "x\\boxed{3}é")  # `}Ã` = `}` + first byte of é; `©` finishes é
    assert tiny.convert_ids_to_tokens(ids)[-4:] == ["{3", "}Ã", "©", "<eos>"]
    sp = spans_of(tiny, [ids], span_mapping=mode)
    C = len(ids)
    assert pos(sp.closing[0]) == [C - 3] and pos(sp.post[0]) == [C - 2, C - 1]


# ----------------------------------------------------------------------------------- no box at all
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("box", ("first", "last"))
def test_no_box_or_unbalanced(toks, style, mode, box):
    tok = toks[style]
    rows = [completion(tok, t) for t in ["7+5=12.", "\\boxed{3", "\\boxed{1+{2} = 3", "boxed{3}"]]
    sp = spans_of(tok, rows, span_mapping=mode, box=box)
    assert not sp.has_box.any()
    for m in (sp.marker, sp.content, sp.closing, sp.post):
        assert not m.any()
    # an unterminated box is skipped; the complete one after it is used
    ids = completion(tok, "\\boxed{3 and \\boxed{4}")
    sp = spans_of(tok, [ids], span_mapping="exact", box=box)
    assert dec(tok, ids, sp.content[0]) == "4"


# --------------------------------------------------------------------------- padding and batching
ROWS = ["\\boxed{1}", "7+5=12.\n\\boxed{12}", "no box here", "x \\boxed{3}. Done \\boxed{4}", PLAIN,
        "é ü 中 \\boxed{é中}é"]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("box", ("first", "last"))
def test_right_padding_matches_rows_alone(toks, style, mode, box):
    tok = toks[style]
    rows = [completion(tok, t) for t in ROWS]
    C = max(map(len, rows))
    together = spans_of(tok, rows, span_mapping=mode, box=box)
    texts = tok.batch_decode(batch(tok, rows)[0].tolist(), skip_special_tokens=True)
    assert texts == [tok.decode(r, skip_special_tokens=True) for r in rows]
    assert masks(answer_spans(*batch(tok, rows), tok, span_mapping=mode, box=box, texts=texts)) == masks(together)
    for b, ids in enumerate(rows):
        got = masks(together, b)
        assert got == masks(spans_of(tok, [ids], width=C, span_mapping=mode, box=box)), ROWS[b]
        if mode == "exact":
            assert got == masks(spans_of(tok, [ids], span_mapping=mode, box=box)), ROWS[b]
        else:
            want, unclamped_end = reference_oracle(tok, ids + [tok.pad_token_id] * (C - len(ids)),
                                                   [1] * len(ids) + [0] * (C - len(ids)), box)
            assert got == want, ROWS[b]
            if unclamped_end is None or unclamped_end <= len(ids):  # no clamp: width does not matter
                assert got == masks(spans_of(tok, [ids], span_mapping=mode, box=box)), ROWS[b]


@pytest.mark.parametrize("style", STYLES)
def test_exact_mode_matches_byte_offsets(toks, style):
    tok = toks[style]
    rows = [completion(tok, t) for t in ROWS + ["ü\\boxed{中}é", "中 \\boxed{\\frac{é}{2}}. é"]]
    C = max(map(len, rows))
    for box in ("first", "last"):
        sp = spans_of(tok, rows, span_mapping="exact", box=box)
        for b, ids in enumerate(rows):
            padded = ids + [tok.pad_token_id] * (C - len(ids))
            mask = [1] * len(ids) + [0] * (C - len(ids))
            assert masks(sp, b) == exact_oracle(tok, style, padded, mask, box), (box, b)


@pytest.mark.parametrize("style", STYLES)
def test_leading_pads_are_compensated(toks, style):
    tok = toks[style]
    for text in ["7+5=12.\n\\boxed{12}", PLAIN]:
        ids = completion(tok, text)
        lead = [tok.pad_token_id] * 2
        mask = torch.tensor([[0, 0] + [1] * len(ids)])
        for mode in MODES:
            plain = masks(spans_of(tok, [ids], span_mapping=mode))
            padded = masks(answer_spans(torch.tensor([lead + ids]), mask, tok, span_mapping=mode))
            assert padded == shifted(plain, 2), (text, mode)


# --------------------------------------------------------------------------------- reference quirks
@pytest.mark.parametrize("style,special", [("qwen", "<think>"), ("llama", "<|start_header_id|>")])
def test_special_token_before_box_shifts_reference_left(toks, style, special):
    tok = toks[style]
    sid = tok.convert_tokens_to_ids(special)
    ids = enc(tok, "7+5=12.") + [sid] + completion(tok, "\n\\boxed{12}")
    assert tok.decode(ids, skip_special_tokens=True) == "7+5=12.\n\\boxed{12}"
    exact = masks(spans_of(tok, [ids], span_mapping="exact"))
    assert tok.decode([ids[i] for i in exact["content"]]) == "12"
    assert exact["post"] == [len(ids) - 1]
    ref = masks(spans_of(tok, [ids], span_mapping="reference"))
    assert ref == shifted(exact, -1) | {"post": [len(ids) - 2, len(ids) - 1]}


def test_clamp_to_padded_width(toks):
    """llama: the re-encoded span of `PLAIN` runs one token past the row (see the shift above)."""
    tok = toks["llama"]
    ids = completion(tok, PLAIN, eos=False)  # ... ▁\boxed{ 9 }; start = C-2, length 4
    C = len(ids)
    sp = masks(spans_of(tok, [ids], span_mapping="reference"))
    # end clamped to C; the 2-token marker fills the span, so marker wins over closing
    assert sp == {"has_box": True, "marker": [C - 2, C - 1], "content": [], "closing": [], "post": []}
    # the same row in a wider batch is not clamped: the closing token lands on padding
    wide = masks(spans_of(tok, [ids], width=C + 3, span_mapping="reference"))
    assert wide == {"has_box": True, "marker": [C - 2, C - 1], "content": [C], "closing": [C + 1], "post": []}
    # a start at or past C means no box in reference mode; exact still finds it
    ids = completion(tok, "x \\boxed{}.", eos=False)
    assert tok.convert_ids_to_tokens(ids) == ["x", "▁\\boxed{}."]
    assert masks(spans_of(tok, [ids], span_mapping="reference"))["has_box"] is False
    assert masks(spans_of(tok, [ids], span_mapping="exact")) == {
        "has_box": True, "marker": [1], "content": [], "closing": [], "post": []}


# ------------------------------------------------------------------------------ validation, speed
def test_bad_options(toks):
    tok = toks["qwen"]
    ids, mask = batch(tok, [completion(tok, PLAIN)])
    with pytest.raises(ValueError, match=r"advantage\.span_mapping.*'reference', 'exact'"):
        answer_spans(ids, mask, tok, span_mapping="fuzzy")
    with pytest.raises(ValueError, match=r"advantage\.box.*'first', 'last'"):
        answer_spans(ids, mask, tok, box="middle")
    with pytest.raises(ValueError, match="texts"):
        answer_spans(ids, mask, tok, texts=["a", "b"])


def test_empty_batch(toks):
    tok = toks["qwen"]
    sp = answer_spans(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5), tok)
    assert sp.marker.shape == (0, 5) and sp.has_box.shape == (0,)


def test_reference_mode_is_fast(toks):
    tok = toks["qwen"]
    rows = []
    for b in range(64):
        ids = enc(tok, "12+34=46. " * (15 + b % 5))[: 185 + b % 10] + completion(tok, " \\boxed{46}")
        rows.append(ids)
    ids, mask = batch(tok, rows, width=200)
    answer_spans(ids[:1], mask[:1], tok)  # tokenizer constants cached
    t0 = time.process_time()  # CPU time of this process: the work done, not how busy the machine is
    sp = answer_spans(ids, mask, tok)
    elapsed = time.process_time() - t0
    assert sp.has_box.all()
    assert elapsed < 0.5, f"reference spans for 64 x 200 took {elapsed:.3f} s"


def _prefixing_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, prepend_scheme="first"): a string's first token gets the word-start
    marker "▁", so "\\boxed{" alone is 4 tokens (▁ \\ boxed {) but 3 behind "a" (▁a \\ boxed {)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["▁", "a", "\\", "b", "o", "x", "e", "d", "{", "}", "9", "<pad>", "<eos>"]
    vocab = {c: i for i, c in enumerate(chars)}
    merges = [("b", "o"), ("bo", "x"), ("box", "e"), ("boxe", "d"), ("▁", "a"), ("▁", "9")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def test_marker_length_is_counted_in_context():
    """The marker's token count is encoded behind "a" like the span's own counts: on a tokenizer that prefixes a
    string's first token, "\\boxed{" alone would give k = 4 and swallow the answer into the marker."""
    from grail_exp.spans import _tokenizer_consts

    tok = _prefixing_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert len(enc("\\boxed{")) == 4 and len(enc("a\\boxed{")) - len(enc("a")) == 3
    assert _tokenizer_consts(tok) == (1, 3)
    ids = enc("9 \\boxed{9}") + [tok.eos_token_id]  # ▁9 ▁ \ boxed { 9 } <eos>
    words = tok.convert_ids_to_tokens(ids)
    spans = answer_spans(torch.tensor([ids]), torch.ones(1, len(ids)), tok, span_mapping="reference")
    pick = lambda m: [words[i] for i in m[0].nonzero().flatten().tolist()]  # noqa: E731
    assert pick(spans.marker) == ["\\", "boxed", "{"]
    assert pick(spans.content) == ["9"] and pick(spans.closing) == ["}"]


# ------------------------------------------------------------- SmolLM2's layout of the study's box: " \boxed{13}."
@pytest.fixture(scope="module")
def smol():
    """Byte-level BPE with GPT-2's pre-tokenizer and the five merges that give SmolLM2-135M's pieces of the study's
    answers (checked on the real tokenizer: `` is \\boxed{13}.`` -> `` is`` `` \\`` ``box`` ``ed`` ``{`` ``1`` ``3``
    ``}.``): the space fused into `` \\``, ``box``, ``ed`` and the closing brace fused with the full stop."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = [("Ġ", "\\"), ("b", "o"), ("bo", "x"), ("e", "d"), ("}", ".")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )


SMOL_TOKENS = ["9", "+", "4", "=", "1", "3", " \\", "box", "ed", "{", "1", "3", "}.", "<eos>"]
#               0    1    2    3    4    5    6      7      8     9    10   11   12    13


def test_smollm2_layout_reference_span_is_one_token_right_and_exact_is_the_box(smol):
    """The study's ``... 9+4=13 \\boxed{13}.``. By hand: the reference re-encodes ``"a" + "9+4=13 "`` with a bare
    space token (8 - 1 = 7 tokens: start 7, one right of the `` \\`` at 6), its span is 7 tokens long
    (``\\ box ed { 1 3 }``) and its marker 4 (``\\ box ed {``): marker 7-10 (``box ed { 1``), content 11-12 (``3``
    and ``}.``), closing 13 (the EOS). ``span_mapping="exact"``: marker 6-9 (`` \\ box ed {``), content 10-11 (the
    answer ``1 3``), closing 12 (``}.`` holds the brace), post 13 (the EOS)."""
    ids = completion(smol, "9+4=13 \\boxed{13}.")
    assert [smol.decode([i]) for i in ids] == SMOL_TOKENS
    assert masks(spans_of(smol, [ids], span_mapping="reference")) == {
        "has_box": True, "marker": [7, 8, 9, 10], "content": [11, 12], "closing": [13], "post": []}
    assert masks(spans_of(smol, [ids], span_mapping="exact")) == {
        "has_box": True, "marker": [6, 7, 8, 9], "content": [10, 11], "closing": [12], "post": [13]}


def test_grail_overrides_follow_advantage_span_mapping_on_the_smollm2_layout(smol):
    """GRAIL's w_max override lands where ``advantage.span_mapping`` puts the content: on ``3`` and ``}.`` with the
    reference's offset (the study's default), on the answer ``1 3`` with ``exact``; marker, closing and the EOS get
    w_mean. The row has A > 0, so ``symmetry: wrong`` leaves it unprobed: every other token keeps w = 1 (no model
    needed)."""
    from omegaconf import OmegaConf

    from grail_exp.advantages import SchemeBatch, build_scheme, scheme_config_class

    ids = torch.tensor([completion(smol, "9+4=13 \\boxed{13}.")])
    C = ids.shape[1]
    prompt = torch.tensor([[smol.encode("x")[0]]])
    batch = SchemeBatch(torch.cat([prompt, ids], 1), torch.ones(1, C + 1), torch.arange(C + 1).unsqueeze(0), 1, ids,
                        torch.ones(1, C), torch.tensor([0.5]), torch.tensor([1.0]))
    weights = {}
    for mode in MODES:
        cfg = OmegaConf.merge(OmegaConf.structured(scheme_config_class("grail")), {"span_mapping": mode})
        weights[mode] = build_scheme(cfg, smol).weights(None, batch).weights[0].tolist()
    at_max = lambda w: [i for i, x in enumerate(w) if x == 5.0]  # noqa: E731
    assert at_max(weights["reference"]) == [11, 12] and at_max(weights["exact"]) == [10, 11]
    assert all(x == 1.0 for i, x in enumerate(weights["exact"]) if i not in (10, 11))
