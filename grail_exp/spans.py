"""Token spans of the boxed answer in a completion: marker, content, closing brace, and what follows.

What the spans are for
----------------------
Token-level credit-assignment schemes treat the tokens of the final answer specially:

* **GRAIL** evaluates its probe objective over the answer span (``span = marker | content |
  closing``) and then overrides the token weights: ``content`` tokens get ``w_max``, ``marker``
  and ``closing`` tokens get ``w_mean``, and every token after the box (``post``, e.g. the EOS)
  gets ``w_mean`` too.
* **OAR-G** builds its teacher distribution over the same span.

Given right-padded completion token ids, ``answer_spans`` returns four boolean (B, C) masks and a
per-row ``has_box`` flag. Rows without a (complete) box have ``has_box = False`` and all masks
empty. ``post`` is already ANDed with ``completion_mask``; ``marker`` / ``content`` / ``closing``
are *not* (in reference mode the span can land on padding, see below; the caller masks).

The reference procedure (method spec §11.3), ``span_mapping="reference"``
-------------------------------------------------------------------------
Per row:

1. ``text = decode(row, skip_special_tokens=True)`` over the whole padded row (pads, EOS and every
   other special token disappear from the text).
2. ``lead`` = number of *leading* pad ids of the row (0 for right-padded completions).
3. ``(s, e)`` = char span of the first complete ``\\boxed{...}`` in ``text`` (marker and closing
   brace included; ``grail_exp.grading.boxed.find_first_boxed_span``). None -> no box.
4. Token positions are *counts from re-encoding* (``add_special_tokens=False``), never matched
   against the live tokens::

       start  = lead + len(enc("a" + text[:s])) - len(enc("a"))
       length = len(enc("a" + text[s:e])) - len(enc("a"))
       end    = min(start + length, C)            # start >= end -> no box

5. ``marker`` = the first ``k = len(enc("a\\\\boxed{")) - len(enc("a"))`` tokens of ``[start, end)`` (clamped
   to the span; the reference encodes ``"\\\\boxed{"`` alone, which gives the same k = 3 on Qwen3 and Llama 3 but
   one token more where a tokenizer prefixes a string's first token), ``closing`` = the single last
   span token, ``content`` = everything strictly between (possibly empty). Marker wins where they overlap (a span shorter than ``k + 1`` tokens).
6. ``post`` = every position ``>= end`` (ANDed with ``completion_mask``).

Quirks of the reference, reproduced on purpose (they are what the published method did):

* A special token in the middle of the completion before the box (``<think>``, a header token)
  is dropped by the decode but still occupies a live position, so the span lands one token
  *left* of the box per such token (leading pads are the only compensated special tokens).
* Decode -> encode is not a round trip. In particular with the usual ``"... 9. \\\\boxed{9}"``
  both embedded tokenizers (and real Qwen / Llama-3 style pre-tokenizers) fuse the space with
  what follows (Qwen: ``Ġ\\``; Llama: ``▁\\boxed{``), but ``"a" + text[:s]`` ends with a bare
  space token, so ``start`` is one token too far *right*: the reference marker then covers
  ``boxed { 9``, the content is ``}`` and the "closing" token is the EOS (or a pad, or - when
  ``start + length`` passes ``C`` - it is clamped away).
* Because of the clamp to ``C``, a row's reference spans can depend on the padded width of its
  batch (only when the re-encoded span runs past the row's own last token).

The reference mode is linear in the text length per row: one batched decode and one batched
encode (two strings per boxed row) for the whole micro-batch.

Switch ``span_mapping`` (``advantage.span_mapping``)
---------------------------------------------------
``"reference"`` (default) is the procedure above. ``"exact"`` maps the char span onto the *live*
tokens by their actual character offsets in ``text``. A token belongs to

* ``marker``  if its characters overlap ``[s, s+7)`` (``\\boxed{``; a fused ``▁\\boxed{`` or
  ``Ġ\\`` counts, as does ``{3`` which also holds content: marker wins, like the reference's
  override order),
* ``closing`` if it contains the char ``e-1`` (the closing ``}``; a fused ``}.`` counts) and is not
  marker,
* ``content`` if it overlaps ``[s+7, e-1)`` and is neither,
* ``post``    if it starts at or after ``e`` (special tokens after the box, e.g. EOS, are post).

Tokens that decode to nothing (special tokens skipped by the decode) are never marker / content
/ closing; they are post when they sit at or after ``e``.

Character offsets come from decoding prefixes of the row, ``decode(ids[:j])`` for a token boundary
``j``, with the same ``skip_special_tokens=True`` as step 1. Boundary ``j`` is *aligned* when the
decoded prefix is literally a prefix of ``text``: its char offset is then ``len(prefix)``. A
boundary inside a multi-byte character (byte-level BPE, byte fallback) decodes to a prefix ending
in U+FFFD replacement characters (or, with a byte-fallback decoder, to a garbled run) and is not
aligned; each such boundary gets a char interval ``[floor, ceil)``: when the prefix is
``text[:f]`` followed only by U+FFFD, the boundary lies inside char ``f`` (``floor = f``,
``ceil = f + 1``); otherwise it conservatively spans the whole stretch up to the next aligned
boundary. A token ``i`` covers chars ``[floor(i), ceil(i+1))``: exactly the characters its bytes
overlap for UTF-8 text. Offsets are assumed monotone in ``j`` (true for every decoder that does not
rewrite earlier text). Cost: the token ranges are found by bisection, so a boxed row needs
``O(log C + span tokens)`` prefix decodes of ``O(C)`` tokens each (rows without a box need none);
much slower than the reference mode but fine for diagnostics and moderate widths.

Switch ``box`` (``advantage.box``)
---------------------------------
``"first"`` (reference): the first complete box drives the probe and the overrides. ``"last"``:
the last balanced box, i.e. the box the reward grades (``grail_exp.grading.boxed.extract_last_boxed``;
with ``model.strip_think`` the reward grades the last box after ``</think>``, which is this box
whenever the answer part contains one).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grail_exp.checkpoint import checkpointable
from grail_exp.errors import ConfigError
from grail_exp.grading.boxed import BOX_LEN, BOX_OPEN, find_first_boxed_span, find_last_boxed_span

__all__ = ["AnswerSpans", "answer_spans", "find_last_boxed_span", "SPAN_MAPPINGS", "BOX_MODES"]

SPAN_MAPPINGS = ("reference", "exact")
BOX_MODES = ("first", "last")

_FFFD = "\ufffd"


_FINDERS: dict[str, Callable[[str], tuple[int, int] | None]] = {
    "first": find_first_boxed_span,
    "last": find_last_boxed_span,
}


@checkpointable
@dataclass
class AnswerSpans:
    """Boolean masks over completion positions; see the module docstring for the definitions."""

    has_box: torch.Tensor  # (B,) bool
    marker: torch.Tensor  # (B, C) bool: the `\boxed{` tokens
    content: torch.Tensor  # (B, C) bool: the answer between the braces
    closing: torch.Tensor  # (B, C) bool: the closing `}` token
    post: torch.Tensor  # (B, C) bool: tokens after the box, already & completion_mask

    @property
    def span(self) -> torch.Tensor:
        return self.marker | self.content | self.closing

    def select(self, idx: torch.Tensor) -> AnswerSpans:
        """The spans of the given rows (a micro-batch of the rollout batch the spans were found on)."""
        i = idx.to(self.has_box.device)
        return AnswerSpans(self.has_box[i], self.marker[i], self.content[i], self.closing[i], self.post[i])


# ------------------------------------------------------------------------------- tokenizer constants
# id(tokenizer) -> (weak or strong ref, len(enc("a")), marker length). The marker length is the token count of
# "\boxed{" encoded in context, len(enc("a\boxed{")) − len(enc("a")), like every other count of the reference
# mapping (all encode behind "a"): a tokenizer that prepends a word-start marker to a string's first token
# (SentencePiece's "▁") would count one token too many on "\boxed{" alone. The two agree on Qwen3 and Llama 3
# (3 tokens; tests/test_real_tokenizers.py). The ref check guards against id reuse after a tokenizer is collected.
_CONSTS: dict[int, tuple[Callable[[], object], int, int]] = {}


def _encode_many(tokenizer, strings: list[str]) -> list[list[int]]:
    if not strings:
        return []
    return tokenizer(strings, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def _tokenizer_consts(tokenizer) -> tuple[int, int]:
    entry = _CONSTS.get(id(tokenizer))
    if entry is not None and entry[0]() is tokenizer:
        return entry[1], entry[2]
    a_ids, a_marker_ids = _encode_many(tokenizer, ["a", "a" + BOX_OPEN])
    marker_len = len(a_marker_ids) - len(a_ids)
    try:
        ref: Callable[[], object] = weakref.ref(tokenizer)
    except TypeError:  # not weak-referenceable: keep it alive instead
        ref = lambda tok=tokenizer: tok  # noqa: E731
    _CONSTS[id(tokenizer)] = (ref, len(a_ids), marker_len)
    return len(a_ids), marker_len


# ------------------------------------------------------------------------------------ public entry
def answer_spans(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    tokenizer,
    *,
    span_mapping: str = "reference",
    box: str = "first",
    texts: list[str] | None = None,
) -> AnswerSpans:
    """Marker / content / closing / post masks of the answer box of each completion row.

    ``completion_ids`` (B, C) right-padded with ``tokenizer.pad_token_id``; ``completion_mask``
    (B, C) 1 on generated tokens (EOS included). ``texts``, if given, must be the rows decoded with
    ``skip_special_tokens=True`` (saves a decode). Returns tensors on the input's device.
    """
    if span_mapping not in SPAN_MAPPINGS:
        raise ConfigError(
            f"advantage.span_mapping = {span_mapping!r}: must be one of {', '.join(map(repr, SPAN_MAPPINGS))}"
        )
    if box not in BOX_MODES:
        raise ConfigError(f"advantage.box = {box!r}: must be one of {', '.join(map(repr, BOX_MODES))}")
    if completion_ids.dim() != 2 or completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_ids and completion_mask must both be (B, C); got {tuple(completion_ids.shape)} "
            f"and {tuple(completion_mask.shape)}"
        )
    B, C = completion_ids.shape
    device = completion_ids.device
    rows: list[list[int]] = completion_ids.tolist()
    if texts is None:
        texts = tokenizer.batch_decode(rows, skip_special_tokens=True) if B else []
    elif len(texts) != B:
        raise ValueError(f"texts has {len(texts)} entries for {B} completion rows")
    finder = _FINDERS[box]
    char_spans = [finder(t) for t in texts]
    valid = completion_mask.to(torch.bool)

    if span_mapping == "reference":
        return _reference_spans(rows, texts, char_spans, valid, tokenizer, B, C, device)
    return _exact_spans(rows, texts, char_spans, valid, tokenizer, B, C)


# ---------------------------------------------------------------------------------- reference mode
def _reference_spans(rows, texts, char_spans, valid, tokenizer, B, C, device) -> AnswerSpans:
    a_len, marker_len = _tokenizer_consts(tokenizer)
    pad_id = tokenizer.pad_token_id

    boxed = [b for b in range(B) if char_spans[b] is not None]
    strings: list[str] = []
    for b in boxed:
        s, e = char_spans[b]
        strings += ["a" + texts[b][:s], "a" + texts[b][s:e]]
    encoded = _encode_many(tokenizer, strings)

    # Sentinel start = end = C for rows without a box: every mask below comes out empty.
    starts, ends = [C] * B, [C] * B
    has = [False] * B
    for n, b in enumerate(boxed):
        lead = 0
        if pad_id is not None:
            row = rows[b]
            while lead < C and row[lead] == pad_id:
                lead += 1
        start = lead + len(encoded[2 * n]) - a_len
        end = min(start + len(encoded[2 * n + 1]) - a_len, C)
        if start < end:
            starts[b], ends[b], has[b] = start, end, True

    has_box = torch.tensor(has, dtype=torch.bool, device=device)
    start_t = torch.tensor(starts, dtype=torch.long, device=device).unsqueeze(1)
    end_t = torch.tensor(ends, dtype=torch.long, device=device).unsqueeze(1)
    marker_end = torch.minimum(start_t + marker_len, end_t)
    pos = torch.arange(C, device=device).unsqueeze(0)
    hb = has_box.unsqueeze(1)
    marker = hb & (pos >= start_t) & (pos < marker_end)
    content = hb & (pos >= marker_end) & (pos < end_t - 1)
    closing = hb & (pos == end_t - 1) & (pos >= marker_end)
    post = hb & (pos >= end_t) & valid
    return AnswerSpans(has_box, marker, content, closing, post)


# -------------------------------------------------------------------------------------- exact mode
class RowOffsets:
    """Lazily computed char intervals ``[floor(j), ceil(j))`` of the token boundaries of one row.

    Boundary ``j`` sits between tokens ``j-1`` and ``j``; token ``i`` covers chars
    ``[floor(i), ceil(i+1))``. Both are non-decreasing in ``j``, so token ranges can be bisected.
    """

    def __init__(self, tokenizer, ids: list[int], text: str):
        self.tokenizer, self.ids, self.text = tokenizer, ids, text
        n = len(ids)
        self.n = n
        self._prefix: dict[int, str] = {}
        self._floor: dict[int, int] = {0: 0, n: len(text)}
        self._ceil: dict[int, int] = {0: 0, n: len(text)}

    def _decoded(self, j: int) -> str:
        p = self._prefix.get(j)
        if p is None:
            p = self.tokenizer.decode(self.ids[:j], skip_special_tokens=True)
            self._prefix[j] = p
        return p

    def _aligned(self, j: int) -> bool:
        if j in self._floor:
            return self._floor[j] == self._ceil[j]
        p = self._decoded(j)
        if self.text.startswith(p):
            self._floor[j] = self._ceil[j] = len(p)
            return True
        return False

    def _inside_char(self, j: int) -> int | None:
        """``f`` if prefix ``j`` reads ``text[:f]`` + U+FFFD..., i.e. the boundary is inside char ``f``."""
        p, text = self._decoded(j), self.text
        if not p.endswith(_FFFD):
            return None
        q = p.rstrip(_FFFD)
        if not text.startswith(q):
            return None
        f, lim = len(q), len(p) - 1  # the last U+FFFD is the incomplete char; earlier ones may be real
        while f < lim and f < len(text) and text[f] == _FFFD:
            f += 1
        return f

    def _resolve(self, j: int) -> None:
        if self._aligned(j):
            return
        v1 = j - 1
        while not self._aligned(v1):
            v1 -= 1
        v2 = j + 1
        while not self._aligned(v2):
            v2 += 1
        base, top = self._floor[v1], self._floor[v2]
        f_run, c_run = base, base
        for k in range(v1 + 1, v2):
            f = self._inside_char(k)
            if f is not None and f_run <= f < top:
                c = f + 1
            else:  # unexplained mismatch (e.g. a byte-fallback run decoded as a whole): whole stretch
                f, c = f_run, top
            f_run = max(f_run, f)
            c_run = max(c_run, c)
            self._floor[k], self._ceil[k] = f_run, c_run

    def floor(self, j: int) -> int:
        if j not in self._floor:
            self._resolve(j)
        return self._floor[j]

    def ceil(self, j: int) -> int:
        if j not in self._ceil:
            self._resolve(j)
        return self._ceil[j]


def lower_bound(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Smallest ``i`` in ``[lo, hi)`` with ``pred(i)`` for a monotone ``pred``; ``hi`` if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _exact_spans(rows, texts, char_spans, valid, tokenizer, B, C) -> AnswerSpans:
    marker = torch.zeros(B, C, dtype=torch.bool)
    content = torch.zeros(B, C, dtype=torch.bool)
    closing = torch.zeros(B, C, dtype=torch.bool)
    post = torch.zeros(B, C, dtype=torch.bool)
    has = [False] * B
    for b in range(B):
        if char_spans[b] is None or C == 0:
            continue
        s, e = char_spans[b]
        m, c = s + BOX_LEN, e - 1  # marker chars [s, m), content [m, c), closing char c
        off = RowOffsets(tokenizer, rows[b], texts[b])
        first = lower_bound(0, C, lambda i, off=off, s=s: off.ceil(i + 1) > s)  # first token reaching into the box
        after = lower_bound(first, C, lambda i, off=off, e=e: off.floor(i) >= e)  # first token starting after it
        for i in range(first, after):
            lo, hi = off.floor(i), off.ceil(i + 1)
            if lo == hi:  # decodes to nothing (a skipped special token): no part of the answer
                continue
            if lo < m and hi > s:
                marker[b, i] = True
            elif lo <= c < hi:
                closing[b, i] = True
            elif lo < c and hi > m:
                content[b, i] = True
        post[b, after:] = True
        has[b] = True
    dev = valid.device
    return AnswerSpans(
        torch.tensor(has, dtype=torch.bool, device=dev),
        marker.to(dev),
        content.to(dev),
        closing.to(dev),
        post.to(dev) & valid,
    )
