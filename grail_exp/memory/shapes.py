"""What the memory planner knows without a config: the shapes of the shipped architectures and the byte arithmetic
of each tensor a run holds — activations per layer, the chunked output layer, KV caches (HF ``generate`` and vLLM's
paged cache), vLLM's profile run — and the planner's constants. Pure arithmetic: the vLLM engine imports it to size
its cache, the plan (``memory/plan.py``) to add up a run. docs/memory-planner.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 2**30


HEADROOM_FIXED = 2 * GiB  # allocator fragmentation, NCCL buffers, cuBLAS workspace, CUDA graphs


HEADROOM_FRACTION = 0.05


# vLLM's profile run, which it subtracts from its share before sizing the KV cache (vLLM 0.32
# v1/worker/gpu_model_runner.py profile_run): one forward over rollout.vllm.max_num_batched_tokens tokens, then its
# sampler over min(max_num_seqs, tokens) rows of the vocabulary. The forward's largest transient is a decoder layer's
# MLP (gate and up projections, 2 x intermediate, and the activation, 1 x intermediate) beside ~4 hidden-size tensors
# (residual, normed input, attention output, hidden state); the sampler holds, beyond the model-dtype logits, per
# (row, token) the float32 logits, the top-k/top-p sort's float32 values and int64 indices and float32 probabilities
# (24 bytes). Plus the non-torch memory vLLM measures in the profile (CUDA context growth, cuBLAS / NCCL workspaces).
# Read from vLLM's source, not measured on a GPU (none with CUDA vLLM available): approximate.
VLLM_SAMPLER_BYTES = 24


VLLM_NON_TORCH_BYTES = 0.5 * GiB


# The planner's own error: against every CUDA peak recorded so far the plan was 0.91-1.05 of the measurement
# (results/memory_plan.md), i.e. up to 9 % under it. A plan that fits by less than 10 % of its peak is reported as tight.
PLAN_ERROR = 0.10


# Padded prompt length per rollout / evaluation call (HF pads a call to its longest prompt). Benchmarks: the longest
# prompt of each shipped benchmark with the paper's instruction and chat template (Qwen3 / Llama-3 tokenizers measure
# within 2 tokens of each other), rounded up; training sets: DeepMath-103K is not available offline, its prompts are
# ~300 tokens (the DeepMath-103K card's statistics), 512 is the planner's pad width.
PROMPT_TOKENS = {"arithmetic": 64, "arithmetic_val": 64, "deepmath": 512, "scrl_jsonl": 512, "math500": 800,
                 "aime24": 400, "amc23": 256, "minerva_math": 416, "college_math_200": 384, "olympiadbench_200": 1280}


DEFAULT_PROMPT_TOKENS = 512


# Output layer (grail_exp/compute/logprobs.py), in fp32 (chunk, V) tensors alive at once, measured on CPU with the real
# function (tests/test_plan.py::test_logprob_peak_matches_the_function; z and log p share one buffer): several chunks:
# forward 4.1 (bf16 and fp32 weights alike); one chunk: 2.2 (its probabilities kept for the backward). Backward with
# bf16 weights: 3.3 (several chunks) / 3.1 (one chunk, its kept probabilities included), plus the fp32 output-layer
# gradient (4·V·h) and, per chunk, its bf16 + fp32 contribution (6·V·h) when that outweighs 1.65 units of the chunk's
# tensors (measured with h = 64 ... 2,048); fp32 weights need less (2.2 / 3.1): the bf16 figures bound them.
LOGITS_FWD_UNITS = {"multi_half": 4.1, "multi_fp32": 4.1, "single": 2.2}


LOGITS_GRAD_OVERLAP = 1.65  # units of the chunk's tensors the output-layer gradient's per-chunk copy reuses


# One generation step of HF generate, bytes per row and vocabulary entry: the model's bf16 logits (2), their fp32 copy
# (4), the log-prob recorder's scaled copy and log-softmax (8) with the previous step's still pending (4), the
# sampling probabilities (4). Against the H100 generation peaks of results/gpu.md: results/memory_plan.md.
SCORE_BYTES = 22


LOGITS_BWD_UNITS = {"multi": 3.3, "single": 3.1}  # single: 2.1 above the forward's kept probabilities (1.0)


class PlanError(ValueError):
    """A plan that cannot be made (unknown architecture); the message says what is missing."""


# ---------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """What the plan needs of an architecture."""

    name: str
    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool  # Qwen3's per-head q/k RMSNorms (saved activations)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in elements (× bytes per element by the caller)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def model_shape(model_cfg) -> Shape:
    """The policy's shape: a shipped architecture (``model.architecture`` or the one whose hub id is
    ``model.name_or_path``, with ``model.random_init_overrides``), a local directory's config.json, or the embedded
    ``model.build``."""
    from grail_exp.models.architectures import by_hub_id, hf_config, load_architecture, parameter_counts

    name_or_path = model_cfg.get("name_or_path")
    arch = model_cfg.get("architecture")
    if name_or_path is None and not arch and model_cfg.get("build") is not None:
        b = model_cfg.build
        c = {"model_type": "qwen3" if b.architecture == "qwen3" else "llama", "hidden_size": b.hidden_size,
             "intermediate_size": b.intermediate_size, "vocab_size": b.vocab_size,
             "num_attention_heads": b.num_heads, "num_key_value_heads": b.num_kv_heads,
             "num_hidden_layers": b.num_layers, "head_dim": b.head_dim, "tie_word_embeddings": b.tie_word_embeddings}
        return _shape(str(model_cfg.get("name", "embedded")), c, parameter_counts(c)["total"])
    if not arch and name_or_path:
        arch = by_hub_id(str(name_or_path))
        if arch is None and os.path.isfile(os.path.join(os.path.expanduser(str(name_or_path)), "config.json")):
            arch = str(name_or_path)
    if not arch:
        raise PlanError(f"model.name_or_path={name_or_path!r}: no shipped architecture with this hub id and no local "
                        "config.json; set model.architecture to one of grail_exp/data/architectures or a config.json")
    from omegaconf import OmegaConf

    overrides = model_cfg.get("random_init_overrides") if model_cfg.get("random_init") else None
    overrides = OmegaConf.to_container(overrides, resolve=True) if OmegaConf.is_config(overrides) else overrides
    c = hf_config(load_architecture(str(arch)), overrides or None)
    return _shape(str(arch), c, parameter_counts(c)["total"])


def _shape(name: str, c: dict, params: int) -> Shape:
    return Shape(name=name, params=params, layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                 intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                 kv_heads=c["num_key_value_heads"], head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                 vocab=c["vocab_size"], tied=bool(c.get("tie_word_embeddings")), qk_norm=c.get("model_type") == "qwen3")


def configured_world_size(t) -> int:
    """``world.configured_world_size`` of a trainer config, imported when asked (the planner's import stays light)."""
    from grail_exp.world import configured_world_size as world_size

    return world_size(t)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a config's dtype name: 4 for float32, else 2 (bfloat16, float16)."""
    return 4 if str(dtype) == "float32" else 2


def few_shot_tokens(model_cfg) -> int:
    """Tokens the worked examples of ``model.few_shot`` add to every prompt: ~3 characters per token and 10 tokens of
    chat-turn markup per example (SmolLM2's three arithmetic examples: 63 tokens; measured: 131-133-token prompts
    against the table's 64 for arithmetic)."""
    return sum(len(str(ex.get("question", ""))) // 3 + len(str(ex.get("answer", ""))) // 3 + 10
               for ex in (model_cfg.get("few_shot") or []))


def benchmark_prompt_tokens(names) -> int:
    """The longest typical prompt (tokens) among benchmarks ``names`` (``PROMPT_TOKENS``, else the default)."""
    return max((PROMPT_TOKENS.get(str(n), DEFAULT_PROMPT_TOKENS) for n in names), default=DEFAULT_PROMPT_TOKENS)


def layer_activation_bytes(s: Shape, b: int) -> float:
    """Bytes autograd saves per token in one decoder layer (SDPA attention), as counted with saved-tensor hooks on the
    real HF Qwen3 / Llama layers (tests/test_plan.py): two RMSNorms keep an fp32 copy of their input and the
    normalised b-byte tensor (2·(4 + b)·h); q, k, v, the rotated q and k, the attention output and o_proj's input
    (b·(4·n_h·d + 3·n_kv·d)); Qwen3's q/k norms ((4 + b)·(n_h + n_kv)·d); the SwiGLU MLP's gate, up, activation and
    product (4·b·i)."""
    qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return (2 * (4 + b) * s.hidden + b * (4 * qd + 3 * kd) + ((4 + b) * (qd + kd) if s.qk_norm else 0)
            + 4 * b * s.intermediate)


# peft=lora (grail_exp/models/lora.py): the planner plans adapters on all seven linear layers of a decoder layer (the
# default peft.target_modules); a subset holds less of every term below, so its plan is an upper bound.
LORA_TARGETS = 7


def lora_parameters(s: Shape, rank: int) -> int:
    """Adapter elements of rank ``rank`` on every linear layer of attention and MLP: r x (in + out) per layer (Qwen3-8B:
    2,727,936 x r)."""
    qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_rank = (s.hidden + qd) + 2 * (s.hidden + kd) + (qd + s.hidden) + 2 * (s.hidden + s.intermediate) \
        + (s.intermediate + s.hidden)
    return int(rank) * s.layers * per_rank


def adapted_linear_parameters(s: Shape) -> int:
    """Weight elements of every linear layer of attention and MLP (what ``lora_parameters`` adapts): the merged copy the
    HF engine holds under ``peft.sync=merged`` (Qwen3-8B: 36 x 192,937,984 = 6,945,767,424)."""
    qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return s.layers * (2 * s.hidden * qd + 2 * s.hidden * kd + 3 * s.hidden * s.intermediate)


def frozen_layer_activation_bytes(s: Shape, b: int) -> float:
    """Bytes autograd saves per token in one decoder layer whose weights are all frozen (peft=lora's base), counted with
    saved-tensor hooks on the real HF layers (tests/test_plan.py): a frozen weight's input is not kept for its
    gradient, so against ``layer_activation_bytes`` the RMSNorms keep their fp32 input only (2·4·h), attention keeps
    q, k, v and its output (b·(2·n_h·d + 2·n_kv·d)), Qwen3's q/k norms their fp32 input (4·(n_h + n_kv)·d), the MLP
    gate, up and activation (3·b·i)."""
    qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return 8 * s.hidden + b * (2 * qd + 2 * kd) + (4 * (qd + kd) if s.qk_norm else 0) + 3 * b * s.intermediate


def lora_layer_activation_bytes(s: Shape, b: int, rank: int, a: int, narrowed: bool = False) -> float:
    """``frozen_layer_activation_bytes`` plus what the adapters keep, measured like it, with a bytes per adapter
    element (b: adapters in model.dtype, 4: ``peft.adapter_dtype=float32``): the adapters' inputs, the layer's own
    tensors, once per distinct one (a·(h + n_h·d + i)), and their r-wide intermediates (a·r each). fp32 adapters on a
    b = 2 base: PEFT casts the input for each adapter, so q, k, v, gate and up keep a copy each (16·h more), and with
    the CPU's narrowed linear layers (``trainer.narrow_backward``), which keep their input whatever needs a gradient,
    the base layers' b-byte inputs too (b·(h + n_h·d + i)); in one dtype those are the adapters' own inputs."""
    qd = s.heads * s.head_dim
    inputs = a * (s.hidden + qd + s.intermediate)
    cast = a == 4 and b != 4
    extra = (16 * s.hidden + (b * (s.hidden + qd + s.intermediate) if narrowed else 0)) if cast else 0
    return frozen_layer_activation_bytes(s, b) + inputs + extra + a * LORA_TARGETS * int(rank)


def logits_bytes(rows: int, chunk: int, s: Shape, b: int) -> tuple[float, float, str]:
    """(forward peak, backward peak, how) of the chunked output layer over ``rows`` completion tokens."""
    n = min(rows, chunk)
    unit = n * s.vocab * 4
    multi = rows > chunk
    fwd_u = LOGITS_FWD_UNITS["multi_half" if b == 2 else "multi_fp32"] if multi else LOGITS_FWD_UNITS["single"]
    bwd_u = LOGITS_BWD_UNITS["multi" if multi else "single"]
    vh = s.vocab * s.hidden
    fwd = fwd_u * unit
    bwd = max(bwd_u * unit, (bwd_u - LOGITS_GRAD_OVERLAP) * unit + 6 * vh) + 4 * vh
    how = (f"{fwd_u:g} / {bwd_u:g} x ({n:,} rows x V {s.vocab:,} x 4 B), + 4·V·h fp32 output-layer gradient"
           + (" (several chunks)" if multi else " (one chunk)"))
    return fwd, bwd, how


def vllm_profile_bytes(cfg, s: Shape) -> tuple[float, str]:
    """(bytes, how) of vLLM's profile run inside its share: the larger of one forward over
    ``rollout.vllm.max_num_batched_tokens`` tokens and its sampler over min(``max_num_seqs``, tokens) rows of the
    vocabulary, plus the non-torch memory (see ``VLLM_SAMPLER_BYTES``)."""
    v = cfg.rollout.vllm
    vb = dtype_bytes(v.get("dtype") or cfg.model.dtype)
    tokens = int(v.get("max_num_batched_tokens") or 4096)
    rows = min(int(v.get("max_num_seqs") or 256), tokens)
    forward = tokens * (3 * s.intermediate + 4 * s.hidden) * vb
    sampler = rows * s.vocab * (vb + VLLM_SAMPLER_BYTES)
    return max(forward, sampler) + VLLM_NON_TORCH_BYTES, (
        f"max of a forward over rollout.vllm.max_num_batched_tokens {tokens:,} tokens x (3 x intermediate + 4 x hidden) "
        f"x {vb} B ({forward / GiB:.2f}) and the sampler over {rows} rows x V x ({vb} + {VLLM_SAMPLER_BYTES}) B "
        f"({sampler / GiB:.2f}), + {VLLM_NON_TORCH_BYTES / GiB:.1f} non-torch; inside the reserve, not added to it")


def vllm_kv_cache_bytes(cfg, max_model_len: int, block: int = 16) -> int:
    """The KV cache a vLLM engine on CPU is given (``kv_cache_memory_bytes``; on GPU ``gpu_memory_utilization`` sizes
    it): every row of one rollout batch at ``max_model_len`` tokens, in ``block``-token pages, in the engine's dtype,
    x ``VLLM_CPU_PAGE_FACTOR`` (vLLM's CPU pages hold fewer tokens than the bare keys and values: SmolLM2 at 118 MB,
    3,200 tokens instead of 5,120). With prefix caching the G rows of a prompt share its pages: room to spare."""
    s, r, t = model_shape(cfg.model), cfg.rollout, cfg.trainer
    rows = max(1, min(int(r.generation_batch_size), t.prompts_per_step // configured_world_size(t) * int(r.num_generations)))
    pages = -(-int(max_model_len) // block)
    dtype = dtype_bytes(r.vllm.get("dtype") or cfg.model.dtype)
    return int(VLLM_CPU_PAGE_FACTOR * rows * pages * block * s.kv_bytes_per_token * dtype)


VLLM_CPU_PAGE_FACTOR = 1.6


def computed_positions(cfg, rows: int, P: int, C: int) -> int:
    """Positions one micro-batch of ``rows`` computes: with ``trainer.share_prompts`` each of its prompts once (rows
    come grouped: ceil(rows / G) prompts of P − 1 positions, every row's last prompt token and completion), else every
    row's whole sequence (grail_exp/compute/forward.py). An upper bound where the prompts share a prefix
    (``trainer.share_prompt_prefix``) or completions end before C (the packed suffix pass): the planner does not
    know the prompts' tokens nor the completions' lengths."""
    from grail_exp.compute.forward import share_prompts_of

    if not share_prompts_of(cfg) or P < 2:
        return rows * (P + C)
    groups = -(-rows // int(cfg.rollout.num_generations))
    return groups * (P - 1) + rows * (C + 1)


def positions_how(cfg, rows: int, P: int, C: int) -> str:
    from grail_exp.compute.forward import share_prompts_of

    if not share_prompts_of(cfg) or P < 2:
        return f"{rows} rows x {P + C} tokens"
    groups = -(-rows // int(cfg.rollout.num_generations))
    return f"{groups} prompts x {P - 1} + {rows} rows x {C + 1}: each prompt once"


def hf_engine_kv_bytes(s: Shape, b: int, prompts: int, n: int, P: int, C: int, cpu: bool) -> tuple[float, str]:
    """The HF engine's cache for ``prompts`` prompts x ``n`` completions (grail_exp/rollout/hf.py). On CPU (its own
    decode loop): each prompt's keys and values once, in float32 for the decode attention, and every row's generated
    ones in b bytes. On GPU (transformers ``generate``): every row's whole sequence in b bytes."""
    per_token = s.kv_bytes_per_token
    if not cpu:
        rows = prompts * n
        return rows * (P + C) * per_token * b, (f"{rows} rows x {P + C} tokens x {s.layers} layers x {s.kv_heads} KV "
                                                f"heads x {s.head_dim} x 2 (K, V) x {b} B")
    kv = prompts * P * per_token * 4 + prompts * n * C * per_token * b
    return kv, (f"{prompts} prompts x {P} tokens x {per_token:,} (K, V) x 4 B + {prompts * n} rows x {C} generated x "
                f"{per_token:,} x {b} B")
