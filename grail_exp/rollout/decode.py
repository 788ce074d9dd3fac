"""The decode-step cache and attention of the HF engine's sampling loop (``grail_exp/rollout/hf.py``).

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

``DecodeCache`` is the transformers cache object the decoder layers write each step's keys and values into
(preallocated, in place); its ``update`` hands the attention this two-part view instead of one concatenated tensor.
It implements what the decoder layers and transformers' mask bookkeeping call (``update``, ``get_seq_length``,
``get_mask_sizes``); with the grouped attention registered as the model's attention implementation transformers builds
no 4-D mask (it hands custom implementations none), so the prompt's padding is masked here.
"""

from __future__ import annotations

import torch

from grail_exp.compute.attention import RowGroups

ATTENTION_NAME = "grail_grouped_decode"


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
    """transformers attention-interface function for one decode step: ``key`` is the layer's ``DecodeKV`` (``value``
    unused). query (B, H, 1, D) -> (output (B, 1, H, D) in the query's dtype, None)."""
    kv: DecodeKV = key
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
    t = kv.length
    kg, vg = kv.kg[:, :, :t].float(), kv.vg[:, :, :t].float()
    s_g = (q @ kg.transpose(-1, -2)) * scale  # (B, Hkv, g, t)
    a = torch.softmax(torch.cat([s_p, s_g], -1), -1)
    P = s_p.shape[-1]
    a_p = groups.grouped(a[..., :P]).permute(0, 2, 1, 3, 4).reshape(groups.num_prompts, Hkv, groups.width * g * q_len, P)
    o_p = groups.rows_of((a_p @ kv.vp).view(groups.num_prompts, Hkv, groups.width, g * q_len, D).permute(0, 2, 1, 3, 4))
    o = o_p + a[..., P:] @ vg  # (B, Hkv, g, D)
    return o.view(B, H, q_len, D).transpose(1, 2).to(query.dtype), None


def register() -> str:
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
            return self.kv, None  # grouped_decode_attention reads both parts from it

        def get_seq_length(self) -> int:
            return self.kv.kp.shape[2] + self.kv.length

    cache = DynamicCache()
    cache.layers = [DecodeLayer(DecodeKV(k, v, prompt_mask, capacity, groups)) for k, v in keys_values]
    return cache
