"""The attention implementations this package registers with transformers, and the caches that feed them.

**``sdpa_gqa``** (``use_kernel_gqa``, every CPU model loaded with ``attn_implementation=sdpa``): transformers' SDPA
attention with the grouped-query heads left to the CPU kernel, the explicit float32 attention of
``compute/attention.py`` for short sequences under autograd, and — when a suffix pass runs over prompts computed once
(``compute/forward.py``) — the prompt / suffix attention. The suffix pass hands the prompts' keys and values as the
keyword ``SHARED_PROMPTS`` (one ``PrefixLayer`` per decoder layer, read at the attention module's ``layer_idx``); the
``key`` and ``value`` arguments are the pass's own.

**The grouped decode attention** (``register_decode_attention``): one decode step of the HF engine's sampling loop
(``grail_exp/rollout/hf.py``).

After the prefill, row r of the batch (a completion of prompt g(r)) attends to two key/value sets:

    its prompt's      K_p[g(r)], V_p[g(r)]   (U distinct prompts, P positions, padding masked)  — shared by G rows
    its own generated K_g[r],    V_g[r]      (the tokens sampled so far, t positions)

``GroupedDecodeAttention`` computes one decode step as a single softmax over both sets:

    s_p = q_r · K_p[g(r)]ᵀ · scale,   s_g = q_r · K_g[r]ᵀ · scale,   a = softmax([s_p, s_g])  (float32)
    o_r = a_p · V_p[g(r)] + a_g · V_g[r]

with the rows of one prompt stacked into one matrix product against that prompt's keys (the prompt is never copied
per row: a (G·heads) × P product per prompt instead of G products of 1 × P with G copies of the prompt's cache). It is
the attention of the row's full sequence — the same function as the model's SDPA attention, whose CPU and GPU kernels
also accumulate scores and the softmax in float32 — in another summation order.

``decode_cache`` is the transformers cache the decoder layers write each step's keys and values into (preallocated,
in place); its ``update`` returns each row's generated keys and values so far (the attention's ``key`` and ``value``),
and the prompts' parts travel as the keyword ``DECODE_PROMPTS`` (the layers' ``DecodeKV``, read at ``layer_idx``). It
implements what the decoder layers and transformers' mask bookkeeping call (``update``, ``get_seq_length``); with the
grouped attention registered as the model's attention implementation transformers builds no 4-D mask (it hands custom
implementations none), so the prompt's padding is masked here.
"""

from __future__ import annotations

import torch

from grail_exp.compute.attention import (
    DEFAULT_MAX_SCORES,
    SDPA_GQA,
    SHARED_PROMPTS,
    PrefixSuffixKV,
    RowGroups,
    explicit_attention,
    prefix_suffix_attention,
)

ATTENTION_NAME = "grail_grouped_decode"
DECODE_PROMPTS = "decode_prompts"  # the keyword carrying every layer's ``DecodeKV`` into the decode attention
EXPLICIT_ATTENTION_ATTR = "cpu_explicit_attention_max_scores"

__all__ = ["DECODE_PROMPTS", "DEFAULT_MAX_SCORES", "EXPLICIT_ATTENTION_ATTR", "DecodeKV", "decode_cache",
           "grouped_decode_attention", "register_decode_attention", "sdpa_gqa_attention", "use_kernel_gqa"]


# ---------------------------------------------------------------------------------------------- sdpa_gqa
def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' SDPA attention, except on CPU with a mask:

    - grouped-query heads: transformers repeats each key/value head for its query heads (``repeat_kv``; it lets the
      kernel group them only without a mask, for CUDA kernels' sake), and autograd keeps the repeated copies — for
      SmolLM2 (9 query heads, 3 key/value heads) 3x the keys and values of every layer. The CPU kernel groups them
      itself (``enable_gqa``), with the same numbers (tests/test_share_prompts.py compares).
    - short sequences under autograd: two products and a float32 softmax (``grail_exp/compute/attention.py``) instead of
      the fused kernel, up to ``model.cpu_explicit_attention_max_scores`` query × key positions (the attribute
      ``use_kernel_gqa`` sets on each attention module; 0 = never).
    - a suffix pass over shared prompts (keyword ``SHARED_PROMPTS``): the prompts' keys and values beside the pass's
      own ``key`` / ``value``, attended as one sequence per row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared = kwargs.pop(SHARED_PROMPTS, None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if shared is not None:  # a suffix pass over shared prompts (grail_exp/compute/forward.py)
        layer = shared[module.layer_idx]
        kv = PrefixSuffixKV(layer.prefix_keys, layer.prefix_values, key, value, layer.groups, layer.packing)
        if kv.packing is not None:  # a pass on its real positions only: this attention in the padded layout, repacked
            padded = PrefixSuffixKV(kv.kp, kv.vp, kv.ks, kv.vs, kv.groups)
            out = _prefix_suffix(module, kv.packing.unpack_heads(query), padded, kv.packing.mask, dropout, scale)
            if out is None:
                k, v = padded.expanded()
                out, _ = sdpa_gqa_attention(module, kv.packing.unpack_heads(query), k, v, kv.packing.mask, dropout,
                                            scaling, is_causal, **kwargs)
            return kv.packing.pack(out), None
        out = _prefix_suffix(module, query, kv, attention_mask, dropout, scale)
        if out is not None:
            return out, None
        key, value = kv.expanded()
    if query.device.type != "cpu" or attention_mask is None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if _explicit_applies(module, query, key.shape[2], attention_mask, dropout, (query, key, value)):
        out = explicit_attention(query, key, value, attention_mask, scale)
    elif getattr(module, "num_key_value_groups", 1) == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _prefix_suffix(module, query, kv: PrefixSuffixKV, mask, dropout: float, scale: float):
    """The prompt / suffix attention (B, S, H, D) where the explicit attention applies with a boolean mask; None
    elsewhere (the caller attends over the concatenated keys)."""
    if (_explicit_applies(module, query, kv.kp.shape[2] + kv.ks.shape[2], mask, dropout,
                          (query, kv.kp, kv.vp, kv.ks, kv.vs)) and mask.dtype == torch.bool):
        return prefix_suffix_attention(query, kv, mask, scale).transpose(1, 2).contiguous()
    return None


def _explicit_applies(module, query, keys: int, mask, dropout: float, inputs) -> bool:
    """The explicit CPU attention's regime: CPU, a (B, 1, Lq, Lk) mask, no dropout, under autograd with an input that
    needs a gradient, and at most the module's ``cpu_explicit_attention_max_scores`` query × key positions."""
    return (query.device.type == "cpu" and mask is not None and dropout == 0.0 and torch.is_grad_enabled()
            and mask.dim() == 4 and mask.shape[1] == 1
            and query.shape[2] * keys <= getattr(module, EXPLICIT_ATTENTION_ATTR, 0)
            and any(t.requires_grad for t in inputs))


def use_kernel_gqa(model, explicit_max_scores: int = 0) -> None:
    """A model loaded with ``attn_implementation=sdpa`` runs ``sdpa_gqa_attention`` (registered with transformers under
    ``SDPA_GQA``, with SDPA's own mask construction); its attention modules take the explicit float32 attention on
    CPU under autograd up to ``explicit_max_scores`` query × key positions."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.config._attn_implementation = SDPA_GQA
    for mod in model.modules():
        if hasattr(mod, "num_key_value_groups"):
            setattr(mod, EXPLICIT_ATTENTION_ATTR, int(explicit_max_scores))


# ---------------------------------------------------------------------------------------------- decoding


class DecodeKV:
    """One layer's keys and values for decoding: the prompts' (U rows) and each row's generated ones."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prompt_mask: torch.Tensor, capacity: int,
                 groups: RowGroups):
        U, H, P, D = keys.shape
        self.kp, self.vp = keys.float(), values.float()  # (U, H_kv, P, D), read in float32 by every step
        self.prompt_mask = prompt_mask.bool()[:, None, None, :]  # (U, 1, 1, P)
        B = groups.rows.numel()
        self.kg = keys.new_zeros(B, H, capacity, D)  # the generated keys / values in the model's dtype (half the memory
        self.vg = torch.zeros_like(self.kg)          # of float32 at 2 B); read in float32, a step's slice at a time
        self.length = 0  # generated positions written
        self.groups = groups

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        self.kg[:, :, self.length:self.length + n] = keys
        self.vg[:, :, self.length:self.length + n] = values
        self.length += n

    def keep(self, rows: torch.Tensor) -> None:
        self.kg, self.vg = self.kg[rows], self.vg[rows]


def grouped_decode_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface function for one decode step: ``key`` / ``value`` are each row's generated
    keys and values so far (B, kv_heads, t, D), the keyword ``DECODE_PROMPTS`` every layer's ``DecodeKV`` (its prompts'
    part, read at ``module.layer_idx``). query (B, H, 1, D) -> (output (B, 1, H, D) in the query's dtype, None)."""
    kv: DecodeKV = kwargs[DECODE_PROMPTS][module.layer_idx]
    groups = kv.groups
    B, H, q_len, D = query.shape
    Hkv = kv.kp.shape[1]
    g = H // Hkv
    scale = scaling if scaling is not None else D ** -0.5
    q = query.float().view(B, Hkv, g * q_len, D)
    qg = groups.grouped(q).permute(0, 2, 1, 3, 4).reshape(groups.num_prompts, Hkv, groups.width * g * q_len, D)
    s_p = (qg @ kv.kp.transpose(-1, -2)) * scale  # (U, Hkv, width·g, P)
    s_p = s_p.masked_fill(~kv.prompt_mask, float("-inf"))
    s_p = groups.rows_of(s_p.view(groups.num_prompts, Hkv, groups.width, g * q_len, -1).permute(0, 2, 1, 3, 4))
    kg, vg = key.float(), value.float()
    s_g = (q @ kg.transpose(-1, -2)) * scale  # (B, Hkv, g, t)
    a = torch.softmax(torch.cat([s_p, s_g], -1), -1)
    P = s_p.shape[-1]
    a_p = groups.grouped(a[..., :P]).permute(0, 2, 1, 3, 4).reshape(groups.num_prompts, Hkv, groups.width * g * q_len, P)
    o_p = groups.rows_of((a_p @ kv.vp).view(groups.num_prompts, Hkv, groups.width, g * q_len, D).permute(0, 2, 1, 3, 4))
    o = o_p + a[..., P:] @ vg  # (B, Hkv, g, D)
    return o.view(B, H, q_len, D).transpose(1, 2).to(query.dtype), None


def register_decode_attention() -> str:
    """Register the grouped decode attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, grouped_decode_attention)
    return ATTENTION_NAME


def decode_cache(keys_values: list, prompt_mask: torch.Tensor, capacity: int, groups: RowGroups):
    """A transformers ``DynamicCache`` holding ``DecodeKV`` layers built from the prefill's keys and values (per layer
    (K, V), each (U, kv_heads, P, head_dim)) and their columns' mask (U, P)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class DecodeLayer(DynamicLayer):
        def __init__(self, kv: DecodeKV):
            super().__init__()
            self.kv, self.is_initialized = kv, True
            self.dtype, self.device = keys_values[0][0].dtype, kv.kp.device

        def update(self, keys, values, *args, **kwargs):
            self.kv.write(keys, values)
            t = self.kv.length
            return self.kv.kg[:, :, :t], self.kv.vg[:, :, :t]  # the prompts' part: the DECODE_PROMPTS keyword

        def get_seq_length(self) -> int:
            return self.kv.kp.shape[2] + self.kv.length

    cache = DynamicCache()
    cache.layers = [DecodeLayer(DecodeKV(k, v, prompt_mask, capacity, groups)) for k, v in keys_values]
    return cache
