"""The policy's forward pass as the trainer, the schemes and the loss terms all see it.

    input_ids (B, P+C), attention_mask, position_ids  ──embeddings──▶ decoder body ──▶ h (B, S, d)
    h at the C positions that predict the completion ──output layer, chunked──▶ logp, entropy (B, C) float32

Prompts are left-padded to P and completions right-padded to C, so input positions ``P-1 … P+C-2`` predict
completion tokens ``0 … C-1`` (``predicting_window``). Positions are those ``generate`` used for a left-padded batch
(``position_ids_from_mask``), so sampler and trainer log-probs agree exactly.

**Each distinct prompt once** (``trainer.share_prompts``). The G completions of a prompt share it, so a micro-batch
of B rows usually holds only U << B distinct prompts. ``body_forward`` then runs the decoder twice:

    prefix pass  the U distinct prompts without their last token, positions 0 … P-2   ──▶ keys / values per layer
    suffix pass  every row's last prompt token ⊕ its completion, positions P-1 … P+C-1, attending to its prompt's
                 keys / values (copied to the row's slot of the cache: the attention kernel wants one (K, V) per row)

Causal attention makes this the same function of the same inputs: the suffix tokens see exactly the keys and values
the unshared forward gives them, and the prompt positions never see the completion. The gradient of the prompt's
keys and values is summed over its G rows by the cache's row index (autograd's ``index_select`` backward) and flows
through the prefix pass once. Only floating-point reduction order differs (smaller matrix products, one summed
gradient instead of G). The last prompt token is computed per row, in the suffix: every position a scheme reads
(the predicting window starts at P-1) is then its row's own, so GRAIL's saliency (∂J/∂e at P-1 …) keeps its meaning —
a shared embedding would sum the G rows' gradients there.

**A prefix every prompt starts with, once** (``trainer.share_prompt_prefix``). Distinct prompts often begin with the
same tokens — a system prompt, few-shot examples (SmolLM2's recipe: 121 of its ~132 tokens). ``prompts_once`` then
splits the prefix pass in two:

    common pass  the c tokens every distinct prompt starts with, one row, positions 0 … c-1   ──▶ keys / values
    tail pass    each distinct prompt's tokens after them (right-aligned, U rows), attending to the common keys /
                 values (one copy per prompt) and to its own tail causally

and the prompts' keys and values are laid out ``[common | tail]`` with their own mask (a tail's columns before its
first token masked), which the suffix pass and the sampler read instead of the batch's columns. Causality again makes
this the same function: position i's keys and values depend on tokens 0 … i only, the same for every prompt sharing
them; the common prefix's gradient is the sum over the prompts (autograd's ``expand`` backward). ``auto`` splits when it
saves at least ``MIN_COMMON_PREFIX_SAVING`` positions ((U - 1) · c; below that the extra pass's per-layer overhead
outweighs it).

**No padding columns.** Each micro-batch is cut to the columns it uses: left-padding columns that every row pads, and
completion columns past its longest completion. ``PolicyForward.predicting`` / ``own`` give (B, C, …) windows back,
zero past the computed columns (positions that only ever meet a zero loss mask). The output layer and its
log-softmax over the vocabulary — the largest product of a small model's step — run on the completion tokens only,
not on the right padding of the shorter completions inside the window: ``policy_forward``'s log-probs and entropies
are 0 there.

On CPU with the ``sdpa_gqa`` attention the suffix pass does not copy the prompt to each row: its cache hands the
attention each prompt's keys and values once, and the rows of a prompt attend to them in one product
(``grail_exp.compute.attention.PrefixSuffixAttention``; the autograd sum over rows then happens inside that product).
Its position-wise work — projections, MLP, norms — then runs on each row's own positions only (``suffix_pass``,
``SuffixPacking``): the rows' suffixes up to their last token are packed into one sequence, and the attention unpacks
queries, keys and values to the (B, S) layout under its mask. Completion lengths vary within a micro-batch (SmolLM2's
average ~16 tokens, its micro-batches' longest ~20), so this leaves out the padding the column cut above cannot.

This file sits below everything that runs a policy forward (the training phases, the update backends, the advantage
schemes, the teacher of RLSD / SDPG, the weights and bench tools) and imports nothing of the project but
``grail_exp.compute.logprobs`` and ``grail_exp.compute.attention``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from grail_exp.compute.attention import SDPA_GQA, SHARED_PROMPTS, RowGroups, SuffixPacking
from grail_exp.compute.leading_rows import LeadingRows, leading_rows, narrows
from grail_exp.compute.logprobs import linear_logprob

SHARE_PROMPTS = ("auto", True, False)  # trainer.share_prompts
MIN_COMMON_PREFIX_SAVING = 64  # positions ((U - 1) · c) from which ``auto`` computes a common prefix once


@dataclass(frozen=True)
class PromptSharing:
    """``trainer.share_prompts`` and ``trainer.share_prompt_prefix`` resolved, as the forwards take them: true (each
    distinct prompt of a micro-batch once) or false, like the bool it stands in for; ``common_prefix`` says whether the
    prefix every distinct prompt starts with is computed once too (``auto``, ``True``, ``False``)."""

    prompts: bool
    common_prefix: object = "auto"

    def __bool__(self) -> bool:
        return self.prompts


def common_prefix_mode(share_prompts) -> object:
    """The ``common_prefix`` setting a forward's ``share_prompts`` argument carries (``auto`` for a plain bool)."""
    return share_prompts.common_prefix if isinstance(share_prompts, PromptSharing) else "auto"


@dataclass
class SharedPrefix:
    """The keys and values of a micro-batch's distinct prompts (all but their last token), computed once."""

    keys_values: list  # per layer (K, V), each (U, kv_heads, L, head_dim), in the autograd graph of the prefix pass
    inverse: torch.Tensor  # (B,) which distinct prompt each row has
    mask: torch.Tensor | None = None  # (U, L) the prompts' key columns' mask ([common | tail] layout, ``prompts_once``)

    def attention_mask(self, suffix_mask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The 2-D mask of a suffix pass over rows ``rows`` (default all): each row's prompt columns as the prefix
        laid them out, then ``suffix_mask`` (b, S) of its own columns."""
        inv = self.inverse if rows is None else self.inverse[rows]
        return torch.cat([self.mask.index_select(0, inv).to(suffix_mask.dtype), suffix_mask], 1)

    def cache(self, rows: torch.Tensor | None = None, detach: bool = False, grouped: bool = False,
              packing: SuffixPacking | None = None):
        """A transformers ``DynamicCache`` holding each row's prompt (rows of the micro-batch; default all): a copy of
        the prompt's keys and values per row, or (``grouped``) layers whose ``update`` hands the attention the prompts
        and the suffix apart (the prompts as the keyword ``SHARED_PROMPTS``: only the model's ``sdpa_gqa`` attention reads it; ``packing``: the
        suffix pass runs on its real positions only)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        inv = self.inverse if rows is None else self.inverse[rows]
        cache = DynamicCache()
        cache.layers = []
        if grouped:
            used, inv = torch.unique(inv, return_inverse=True)  # only the prompts these rows have
            groups = RowGroups(inv, used.numel())
        for k, v in self.keys_values:
            k, v = (k.detach(), v.detach()) if detach else (k, v)
            if grouped:
                if used.numel() < k.shape[0]:
                    k, v = k.index_select(0, used), v.index_select(0, used)
                cache.layers.append(_prefix_layer_class()(k, v, groups, packing))
                continue
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k.index_select(0, inv), v.index_select(0, inv)
            cache.layers.append(layer)
        return cache


@functools.cache
def _prefix_layer_class():
    """The cache layer class of a grouped suffix pass (made on first use: transformers is imported lazily here)."""
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        """A cache layer holding the distinct prompts' keys and values, which the attention reads through the keyword
        ``SHARED_PROMPTS`` (``compute/model_attention.py``); ``update`` returns the suffix pass's own."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, groups: RowGroups, packing=None):
            super().__init__()
            self.prefix_keys, self.prefix_values, self.groups, self.packing = keys, values, groups, packing
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        def update(self, keys, values, *args, **kwargs):
            return keys, values  # the pass's own; the prompts reach the attention as the SHARED_PROMPTS keyword

        def get_seq_length(self) -> int:
            return self.prefix_keys.shape[2]

    return PrefixLayer


def grouped_prefix_attention(model) -> bool:
    """Whether the suffix pass hands the attention the prompts apart (``SharedPrefix.cache(grouped=True)``): the
    model's attention is ``sdpa_gqa`` (``grail_exp.compute.model_attention.use_kernel_gqa``) on CPU, which reads that form where its
    explicit attention applies (under autograd, short sequences) and concatenates the parts elsewhere."""
    cfg = getattr(model, "config", None)
    return (getattr(cfg, "_attn_implementation", None) == SDPA_GQA
            and next(model.parameters()).device.type == "cpu")


@dataclass
class BodyOutput:
    """The decoder body's output on the columns it computed: ``embeds`` / ``hidden`` / ``hidden_states`` are
    (B, S, d), column j holding absolute position ``start + j``; ``width`` = S."""

    embeds: torch.Tensor  # (B, S, d) input embeddings of the computed columns (a node of the graph, not a leaf)
    hidden: torch.Tensor  # (B, S, d) last hidden state (after the final norm)
    hidden_states: tuple | None  # every layer's output on those columns, when asked for
    prompt_length: int  # P of the batch
    completion_length: int  # C of the batch
    start: int = 0  # absolute position of column 0 (P-1 when the prompts were shared; > 0 after trimming padding)
    prefix: SharedPrefix | None = None  # the shared prompts' keys and values (None: every row computed its own)
    positions: int = 0  # positions the decoder computed (rows × columns, over both passes): token efficiency
    # (B+1,) where each row's positions start in the flattened layout of the pass ``embeds`` feeds, when it ran packed
    # (``SuffixPacking``); None: the (B, S) layout, row r at r·S
    row_offsets: torch.Tensor | None = None

    def leading_rows(self, rows: int) -> LeadingRows:
        """The first ``rows`` rows of the pass ``embeds`` feeds, for a backward whose cotangent is zero past them
        (``grail_exp.compute.leading_rows``)."""
        B, S = self.embeds.shape[:2]
        if self.row_offsets is None:
            return LeadingRows(rows, B, rows * S, B * S)
        return LeadingRows(rows, B, int(self.row_offsets[rows]), int(self.row_offsets[-1]))

    def predicting(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (B, C, ...): the columns that predict completion tokens 0 … C-1 (zero past the computed)."""
        return self._window(x, self.prompt_length - 1)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (B, C, ...): the completion tokens' own positions P … P+C-1 (zero past the computed)."""
        return self._window(x, self.prompt_length)

    def _window(self, x: torch.Tensor, first: int) -> torch.Tensor:
        lo = first - self.start
        w = x[:, lo:lo + self.completion_length]
        missing = self.completion_length - w.shape[1]
        if missing <= 0:
            return w
        return torch.cat([w, w.new_zeros(w.shape[0], missing, *w.shape[2:])], 1)


@dataclass
class PolicyForward(BodyOutput):
    """What the trainer's policy forward of a micro-batch exposes to a scheme's ``weights_from_forward`` and to loss
    terms (all still in the autograd graph): the body's output and the output layer."""

    head_weight: torch.Tensor | None = None  # (V, d) output layer weight (live: detach it for probes)
    head_bias: torch.Tensor | None = None
    narrows: bool = False  # the model's leading-rows backward computes those rows only (``trainer.narrow_backward``)

    def input_gradient(self, J: torch.Tensor, leaf: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """∂J/∂leaf through this forward's graph, which is kept for the loss's backward. ``rows``: J reads the first
        ``rows`` rows of the micro-batch only, so every cotangent past them is zero; a forward whose model narrows
        computes those rows only (``grail_exp.compute.leading_rows``), any other computes every row (zeros past them)."""
        span = self.leading_rows(rows) if rows is not None and self.narrows else None
        with leading_rows(span):
            (g,) = torch.autograd.grad(J, leaf, retain_graph=True)
        return g


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The transformer body of a causal LM (``model.model`` for Qwen3 / Llama)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    return body if body is not None else model.base_model


def predicting_window(x: torch.Tensor, prompt_length: int, completion_length: int) -> torch.Tensor:
    """(B, P+C, ...) -> (B, C, ...): the positions that predict the completion tokens."""
    return x[:, prompt_length - 1:prompt_length + completion_length - 1]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` used for a left-padded batch (cumsum − 1), so ratios are exact."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def resolve_share_prompts(value, gradient_checkpointing: bool) -> bool:
    """``trainer.share_prompts`` → on / off: ``auto`` is on unless layers are recomputed in the backward
    (gradient checkpointing replays a layer without its cache: the suffix pass would lose its prompt)."""
    if value == "auto":
        return not gradient_checkpointing
    return bool(value)


def share_prompts_of(cfg) -> PromptSharing:
    """A run config's ``trainer.share_prompts`` (resolved against its ``model.gradient_checkpointing``) and
    ``trainer.share_prompt_prefix``."""
    trainer, model = cfg.get("trainer") or {}, cfg.get("model") or {}
    prompts = resolve_share_prompts(trainer.get("share_prompts", "auto"), bool(model.get("gradient_checkpointing", False)))
    return PromptSharing(prompts, trainer.get("share_prompt_prefix", "auto"))


def can_share_prompts(model) -> bool:
    """Whether the prompt/suffix split is exact for this model: every layer attends to all earlier positions (no
    sliding window), and no layer is replayed without its cache (gradient checkpointing while training)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config(decoder=True) if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        return False
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        return False
    return not (getattr(model, "is_gradient_checkpointing", False) and model.training)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int):
    """(first, inverse): a row of each distinct prompt (U,) and each row's distinct prompt (B,); None when no two rows
    share one (or the prompts are one token long: nothing to share)."""
    B, P = input_ids.shape[0], prompt_length
    if B < 2 or P < 2:
        return None
    key = torch.where(attention_mask[:, :P].bool(), input_ids[:, :P], -1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    U = uniq.shape[0]
    if U == B:
        return None
    rows = torch.arange(B, device=input_ids.device)
    first = torch.full((U,), B, dtype=torch.long, device=input_ids.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def used_columns(attention_mask: torch.Tensor, prompt_length: int) -> tuple[int, int]:
    """(first, end): the columns some row uses — left-padding columns every row pads and completion columns past the
    longest completion are outside. The completion mask is a prefix of each row's completion columns."""
    m = attention_mask.bool()
    first = int(m[:, :prompt_length].any(0).long().argmax()) if prompt_length else 0
    used_c = int(m[:, prompt_length:].sum(1).max()) if m.shape[1] > prompt_length else 0
    return first, prompt_length + used_c


def common_prefix_length(ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """The number of leading tokens every row of a left-padded batch (U, L) starts with (0 when the rows are not
    left-padded token runs: nothing is assumed about other layouts)."""
    lengths = attention_mask.long().sum(1)
    n = int(lengths.min()) if ids.shape[0] else 0
    if ids.shape[0] < 2 or n == 0:
        return 0
    start = ids.shape[1] - lengths  # each row's first real column
    cols = torch.arange(ids.shape[1], device=ids.device)
    if not torch.equal(attention_mask.bool(), cols >= start[:, None]):
        return 0
    aligned = ids.gather(1, start[:, None] + cols[:n])
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.long().argmax()) if bool(differs.any()) else n


def common_prefix_used(ids: torch.Tensor, attention_mask: torch.Tensor, mode) -> int:
    """The common prefix ``prompts_once`` computes apart under ``mode`` (``auto`` / true / false): its length, or 0."""
    if mode is False or mode == "false" or ids.shape[0] < 2:
        return 0
    c = min(common_prefix_length(ids, attention_mask), ids.shape[1] - 1)  # a tail column at least (equal rows)
    if mode == "auto" and (ids.shape[0] - 1) * c < MIN_COMMON_PREFIX_SAVING:
        return 0
    return c


def prompt_pass_positions(ids: torch.Tensor, attention_mask: torch.Tensor, mode) -> int:
    """Positions ``prompts_once`` computes for these rows (U, L): c + U · (L − c) with a common prefix c, else U · L."""
    c = common_prefix_used(ids, attention_mask, mode)
    return ids.numel() if c == 0 else c + ids.shape[0] * (ids.shape[1] - c)


@dataclass
class PromptPass:
    """Left-padded token rows run through the decoder with their keys and values kept (``prompts_once``)."""

    keys_values: list  # per layer (K, V), each (U, kv_heads, L', head_dim)
    mask: torch.Tensor  # (U, L') which of those key columns each row attends to
    hidden: list  # the passes' last hidden states (the last column of the last one: each row's last token)
    positions: int  # positions computed


def prompts_once(model, ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 common_prefix="auto") -> PromptPass:
    """The decoder on U left-padded rows (U, L) with their keys and values kept, the tokens every row starts with
    computed once when ``common_prefix`` says so (``common_prefix_used``; module docstring): a common pass of one row
    (c tokens), then a tail pass of the U rows' last L − c columns attending to the common keys and values. A tail
    shorter than the longest holds some of its row's common tokens in its first columns: masked there (their keys are
    the common pass's). Keys / values / mask columns are ``[common | tail]``; ``hidden[-1][:, -1]`` is each row's
    last token."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    body, embed = decoder_body(model), model.get_input_embeddings()
    c = common_prefix_used(ids, attention_mask, common_prefix)
    if c == 0:
        out = body(inputs_embeds=embed(ids), attention_mask=attention_mask, position_ids=position_ids, use_cache=True)
        return PromptPass([(x.keys, x.values) for x in out.past_key_values.layers], attention_mask,
                          [out.last_hidden_state], ids.numel())
    U, L = ids.shape
    first = L - int(attention_mask[0].sum())  # row 0's first token: its c tokens are everyone's
    head = body(inputs_embeds=embed(ids[:1, first:first + c]), attention_mask=attention_mask[:1, first:first + c],
                position_ids=position_ids[:1, first:first + c], use_cache=True)
    cache = DynamicCache()
    cache.layers = []
    for x in head.past_key_values.layers:  # one (autograd) copy of the common keys / values per row
        layer = DynamicLayer()
        layer.lazy_initialization(x.keys, x.values)
        layer.keys, layer.values = x.keys.expand(U, -1, -1, -1), x.values.expand(U, -1, -1, -1)
        cache.layers.append(layer)
    T = L - c  # tail columns: every row's tokens after the common ones fit (a row has at most L tokens)
    cols = torch.arange(L - T, L, device=ids.device)
    after_common = cols >= (L - attention_mask.long().sum(1) + c)[:, None]
    mask = torch.cat([attention_mask.new_ones(U, c), attention_mask[:, L - T:] * after_common], 1)
    tail = body(inputs_embeds=embed(ids[:, L - T:]), attention_mask=mask, position_ids=position_ids[:, L - T:],
                past_key_values=cache, use_cache=True)
    return PromptPass([(x.keys, x.values) for x in tail.past_key_values.layers], mask,
                      [head.last_hidden_state, tail.last_hidden_state], c + U * T)


def suffix_pass(model, prefix: SharedPrefix, embeds: torch.Tensor, suffix_mask: torch.Tensor,
                position_ids: torch.Tensor, rows: torch.Tensor | None = None, detach: bool = False,
                hidden_states: bool = False):
    """The decoder on the suffixes (b, S) of rows ``rows`` (default all) against their shared prompts: (last hidden
    state (b, S, d), every layer's output or None, positions computed, and where each row's positions start in the
    packed layout (b+1,) or None when it ran in the (b, S) layout). Where the suffix pass hands the attention
    the prompts apart (``grouped_prefix_attention``) and some suffix columns are padding, it runs on the real
    positions only (``SuffixPacking``) and its output is unpacked with zeros at the padding — unless every layer's
    output is asked for: a scheme differentiating with respect to one (GRAIL's middle-layer leaf) needs the tensor
    the next layer read, not an unpacked copy of it."""
    body = decoder_body(model)
    grouped = grouped_prefix_attention(model)
    mask = prefix.attention_mask(suffix_mask, rows)
    real = suffix_mask.bool()
    if not grouped or hidden_states or bool(real[:, -1].all()):  # no row ends before the last column: nothing to drop
        cache = prefix.cache(rows, detach=detach, grouped=grouped)
        out = body(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                   use_cache=True, output_hidden_states=hidden_states, **_shared(cache, grouped))
        return out.last_hidden_state, out.hidden_states if hidden_states else None, real.numel(), None
    prompt_columns = mask.shape[1] - real.shape[1]
    packing = SuffixPacking(suffix_mask, mask[:, :prompt_columns])
    cache = prefix.cache(rows, detach=detach, grouped=True, packing=packing)
    out = body(inputs_embeds=packing.pack(embeds), position_ids=packing.pack(position_ids),
               attention_mask=mask.new_ones(1, prompt_columns + packing.index.numel()),  # the attention uses packing.mask
               past_key_values=cache, use_cache=True, **_shared(cache, True))
    return packing.unpack(out.last_hidden_state), None, packing.index.numel(), packing.row_offsets


def _shared(cache, grouped: bool) -> dict:
    """The keyword that hands a grouped suffix pass's prompts to the attention (none for a plain cache)."""
    return {SHARED_PROMPTS: cache.layers} if grouped else {}


class _Anchor(torch.autograd.Function):
    """y = x in the forward; the ``anchors`` get zero gradients in the backward (they join the graph, nothing else)."""

    @staticmethod
    def forward(ctx, x, *anchors):
        ctx.anchors = [(a.shape, a.dtype) for a in anchors]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g, *(g.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.anchors))


def body_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 prompt_length: int, *, share_prompts: bool = False, hidden_states: bool = False,
                 trim: bool = True, anchor_prefix: bool = False) -> BodyOutput:
    """The decoder body on a left-padded batch (B, P+C): each distinct prompt once when ``share_prompts`` (and the
    model allows it, ``can_share_prompts``), unused padding columns skipped when ``trim``.

    ``anchor_prefix``: the prefix pass's output joins the graph of the returned hidden state with a zero gradient.
    FSDP2 gathers a layer's parameters for its backward from a hook on that layer's outputs; without the anchor the
    last layer's prefix call would get its gradient only through its keys and values, which are not outputs."""
    P, C = prompt_length, input_ids.shape[1] - prompt_length
    lo, hi = used_columns(attention_mask, P) if trim else (0, P + C)
    hi = max(hi, min(P + 1, P + C))  # the last prompt token and (when C > 0) one completion column at least
    ids, attn, pos = input_ids[:, lo:hi], attention_mask[:, lo:hi], position_ids[:, lo:hi]
    Pt = P - lo
    groups = prompt_groups(ids, attn, Pt) if share_prompts and can_share_prompts(model) else None
    embed = model.get_input_embeddings()
    body = decoder_body(model)
    if groups is None:
        embeds = embed(ids)
        out = body(inputs_embeds=embeds, attention_mask=attn, position_ids=pos, use_cache=False,
                   output_hidden_states=hidden_states)
        return BodyOutput(embeds, out.last_hidden_state, out.hidden_states if hidden_states else None, P, C,
                          start=lo, positions=ids.numel())
    first, inverse = groups
    L = Pt - 1  # prefix columns: the prompt without its last token
    pre = prompts_once(model, ids[first, :L], attn[first, :L], pos[first, :L], common_prefix_mode(share_prompts))
    prefix = SharedPrefix(pre.keys_values, inverse, pre.mask)
    embeds = embed(ids[:, L:])
    last, layers, suffix_positions, row_offsets = suffix_pass(model, prefix, embeds, attn[:, L:], pos[:, L:],
                                                              hidden_states=hidden_states)
    hidden = _Anchor.apply(last, *pre.hidden) if anchor_prefix else last
    return BodyOutput(embeds, hidden, layers, P, C, start=lo + L, prefix=prefix,
                      positions=pre.positions + suffix_positions, row_offsets=row_offsets)


def continue_forward(model, fwd: BodyOutput, inputs_embeds: torch.Tensor, rows: torch.Tensor,
                     attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The decoder body again on other embeddings of the same computed columns (``fwd.embeds``' shape, rows ``rows``
    of the micro-batch), with the same prompts: when ``fwd`` shared them, their (detached) keys and values are reused,
    so only the suffix is recomputed. ``attention_mask`` / ``position_ids``: those rows' full (B, P+C) tensors.
    Returns the last hidden state (b, S, d)."""
    hi = fwd.start + inputs_embeds.shape[1]
    if fwd.prefix is None:
        return decoder_body(model)(inputs_embeds=inputs_embeds, attention_mask=attention_mask[:, fwd.start:hi],
                                   position_ids=position_ids[:, fwd.start:hi], use_cache=False).last_hidden_state
    return suffix_pass(model, fwd.prefix, inputs_embeds, attention_mask[:, fwd.start:hi], position_ids[:, fwd.start:hi],
                       rows, detach=True)[0]


def completion_logits(model, input_ids, attention_mask, position_ids, completion_len: int, temperature: float):
    """Logits at the C positions that predict the completion tokens: (B, C, V), divided by the temperature.

    The straightforward path (the model's own forward); the trainer uses ``policy_forward`` instead.
    ``logits_to_keep = C + 1`` keeps only the completion window, never the prompt's (B, P, V) logits.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :]
    return logits / temperature if temperature != 1.0 else logits


@contextlib.contextmanager
def frozen_parameters(model):
    """The model's parameters as constants for the block: a pass that differentiates with respect to its inputs only
    (OAR-G's noisy pass) then records no layer input for a weight gradient. Graphs built before or after are
    untouched (their parameters' ``requires_grad`` is restored on exit)."""
    live = [p for p in model.parameters() if p.requires_grad]
    for p in live:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in live:
            p.requires_grad_(True)


def output_layer(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (V, d), bias or None) of the model's output layer."""
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    return head.weight, (bias if bias is not None and bias.numel() else None)


def policy_forward(model, input_ids, attention_mask, position_ids, completion_ids, temperature: float, *,
                   chunk_tokens: int = 4096, hidden_states: bool = False, logprob_dtype: str = "float32",
                   share_prompts: bool = False, anchor_prefix: bool = False):
    """The trainer's policy forward of a micro-batch: token log-probs and entropies (B, C) in float32, and the
    forward's embeddings / hidden states for schemes that reuse it (``PolicyForward``).

    Runs the decoder body on the embeddings (so GRAIL can take gradients w.r.t. them; ``body_forward``: each distinct
    prompt once with ``share_prompts``) and the output layer through ``linear_logprob`` (chunks of ``chunk_tokens``
    rows; no (B, C, V) float32 logits). For causal LMs whose head is a plain linear layer (Qwen3, Llama, Mistral, ...)
    this is the model's own forward, computed differently. ``logprob_dtype`` (``trainer.logprob_dtype``): ``float32``
    or ``model`` (rounded as the reference's bf16 log-probs; ``grail_exp.compute.logprobs``).
    """
    P = input_ids.shape[1] - completion_ids.shape[1]
    body = body_forward(model, input_ids, attention_mask, position_ids, P, share_prompts=share_prompts,
                        hidden_states=hidden_states, anchor_prefix=anchor_prefix)
    weight, bias = output_layer(model)
    C_used = min(completion_ids.shape[1], body.start + body.hidden.shape[1] - (P - 1))  # computed predicting columns
    h = predicting_window(body.hidden, P - body.start, C_used)
    ids = completion_ids[:, :C_used]
    real = attention_mask[:, P:P + C_used].bool()  # the completions' tokens; the rest is right padding
    if bool(real.all()):
        logp_u, ent_u = linear_logprob(h, weight, bias, ids, temperature, chunk_tokens, logprob_dtype)
    else:  # the output layer on real tokens only: zeros at the padding, which only ever meets a zero loss mask
        lp, en = linear_logprob(h[real], weight, bias, ids[real], temperature, chunk_tokens, logprob_dtype)
        logp_u = lp.new_zeros(real.shape).index_put((real,), lp)
        ent_u = en.new_zeros(real.shape).index_put((real,), en)
    logp, entropy = _pad_columns(logp_u, completion_ids.shape[1]), _pad_columns(ent_u, completion_ids.shape[1])
    fwd = PolicyForward(body.embeds, body.hidden, body.hidden_states, body.prompt_length, body.completion_length,
                        body.start, body.prefix, body.positions, body.row_offsets, weight, bias, narrows(model))
    return logp, entropy, fwd


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, c) -> (B, width), zeros on the right (columns past every row's completion)."""
    return x if x.shape[1] == width else torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], 1)
