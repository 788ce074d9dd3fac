"""Memory plan of a run, per device, before anything is loaded (the library; the CLI is ``grail_exp/plan.py``).

``validate.py`` calls :func:`check` and refuses a run whose plan does not fit, naming keys and values that would;
``python -m grail_exp.plan <overrides>`` prints :func:`render` of :func:`plan` (docs/memory-planner.md).

Per rank (one device), with N parameters, b bytes per model-dtype element, W ranks, from the shipped architecture
(``grail_exp/data/architectures/*.json``) or the embedded model's ``model.build``:

- **model state**: parameters (N·b; fp32 shards 4N/W under FSDP), fp32 master weights (4N, or 4N/W sharded), Adam
  moments (8N, or 8N/W), gradients (fp32 4N accumulated on one device; 4N/W sharded under FSDP; bf16 2N/W + fp32
  4N/W partitions under DeepSpeed ZeRO-2) and, under FSDP, the bf16 parameters it gathers (N·b kept from forward to
  backward with SHARD_GRAD_OP; one layer with FULL_SHARD; all of them while generating);
- **the update** of one micro-batch of m rows × T = prompt + completion tokens: the activations autograd saves
  (gradient checkpointing: each layer's input, m·T·h·b, plus one layer recomputed in backward; without: every
  layer's full set, measured on the real HF decoder layers), the chunked output layer of
  ``trainer.logprob_chunk_tokens`` rows (forward ≈ 5.5 and backward ≈ 5.4 fp32 (chunk, V) tensors alive at once,
  plus the fp32 output-layer gradient), OAR-G's noisy teacher pass (a second graph of the micro-batch);
- **rollouts / evaluation** with HF ``generate``: the KV cache of every row of one call,
  rows × (prompt + completion) × layers × KV heads × head_dim × 2 (K and V) × b, and one step's (rows, V) scores;
  with vLLM: ``rollout.vllm.gpu_memory_utilization`` × the device, reserved for the whole run (no sleep mode);
- **the reference model** (β > 0, KL in the reward, loss terms that need it): a frozen copy, N·b per rank;
- a **headroom** of 2 GiB + 5 % of the device (allocator fragmentation, NCCL and cuBLAS workspaces, CUDA graphs).

What a parallel strategy holds (the state rows, the update's gradients and gathered parameters, the gradient sync)
is the answer of its update backend (``training/backends/``: ``planned_*``), so this file never asks which strategy it
plans. ``plan`` is one function per phase — ``model_state_lines``, ``update_lines``, ``logp_lines``,
``vllm_share`` / ``rollout_lines``, ``eval_lines`` — and ``assemble``.

The peak is the largest phase; vLLM's reserve is held through every phase. CPU runs (``trainer.accelerator=cpu``) are
planned in RAM against the host's memory and refused like GPU runs when they do not fit. A GPU config validated
where no CUDA device is visible is refused only with ``trainer.device_memory_gb`` set (planning offline); otherwise
its plan is printed by ``python -m grail_exp.plan`` without a verdict. A GPU layout's plan also carries the host memory
of the node holding rank 0, one row per phase that passes weights or state through the host (``host_node_lines``:
load, checkpoint, resume); ``planned_mem_gb`` turns it into SLURM's ``--mem``. Measured peaks against the plan: results/memory_plan.md
(``python sweeps/memory_plan.py``).

The plan also states the process-group timeout the run needs (``needed_dist_timeout``: the planned checkpoint written
at a conservative bandwidth, grail_exp/timeouts.py; ``trainer.dist_timeout_s``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

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
    from grail_exp.models.architectures import _by_hub_id, hf_config, load_architecture, parameter_counts

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
        arch = _by_hub_id(str(name_or_path))
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


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class Line:
    phase: str  # state | update | rollout | eval | logp | step
    what: str
    bytes: float
    how: str  # the formula with its numbers


@dataclass
class MemoryPlan:
    lines: list[Line]
    phases: dict[str, float]  # phase -> bytes per device (its lines + the state + vLLM's reserve)
    peak_phase: str
    capacity: Optional[float]  # bytes usable per device; None = unknown (CPU, or no device and no device_memory_gb)
    capacity_source: str
    headroom: float
    problems: list[str] = field(default_factory=list)  # impossible independently of the sum (vLLM too small, ...)
    facts: dict = field(default_factory=dict)  # the inputs, for the table's header
    notes: list[str] = field(default_factory=list)  # what the totals leave out, said under the table
    timeouts: list[str] = field(default_factory=list)  # timeout_lines(): the process-group timeout the run needs
    host: list[Line] = field(default_factory=list)  # a GPU layout's host memory per node (host_node_lines)

    @property
    def host_peak(self) -> Optional[float]:
        """Host bytes the busiest node needs (its steady part + its largest phase), or None for a CPU run (planned in
        the device table)."""
        if not self.host:
            return None
        steady = sum(x.bytes for x in self.host if x.phase == "host")
        return steady + max(x.bytes for x in self.host if x.phase != "host")

    @property
    def peak(self) -> float:
        return self.phases[self.peak_phase]

    @property
    def fits(self) -> Optional[bool]:
        if self.capacity is None:
            return None
        return not self.problems and self.peak <= self.capacity - self.headroom

    @property
    def tight(self) -> bool:
        """Fits, but by less than the planner's own error (``PLAN_ERROR`` of the peak): it may not on the GPU."""
        return bool(self.fits) and self.peak * (1 + PLAN_ERROR) > self.capacity - self.headroom


def _world(t) -> int:
    from grail_exp.world import configured_world_size

    return configured_world_size(t)


def _dtype_bytes(dtype) -> int:
    return 4 if str(dtype) == "float32" else 2


def device_capacity(cfg) -> tuple[Optional[float], Optional[float], str]:
    """(usable bytes, total bytes, where from) of one device; (None, None, why) when there is none to plan for."""
    t = cfg.trainer
    gb = t.get("device_memory_gb")
    if gb:
        return float(gb) * GiB, float(gb) * GiB, f"trainer.device_memory_gb={gb}"
    if str(t.accelerator) == "cpu":
        return host_capacity()
    try:
        import torch

        if torch.cuda.is_available():
            dev = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            free, total = torch.cuda.mem_get_info(dev)
            return float(free), float(total), f"torch.cuda.mem_get_info({dev}): {free / GiB:.1f} of {total / GiB:.1f} GiB free"
    except Exception as exc:  # noqa: BLE001 - a broken driver is the run's problem, not the planner's
        return None, None, f"no CUDA device ({type(exc).__name__})"
    return None, None, "no CUDA device visible: set trainer.device_memory_gb to plan for one"


def _probes_between_forward_and_backward(cfg) -> bool:
    """The scheme needs the model (a probe gradient, extra forwards) or loss terms are on: the update backend then keeps
    a sharded policy gathered from a micro-batch's forward to its backward (training/backends/fsdp.py ``hold``)."""
    if cfg.loss.get("terms"):
        return True
    try:
        from grail_exp.advantages import SCHEMES

        return bool(SCHEMES[str(cfg.advantage.get("name"))].needs_model)
    except Exception:  # noqa: BLE001 - an unknown scheme: validate() reports it; plan the larger case
        return True


def few_shot_tokens(model_cfg) -> int:
    """Tokens the worked examples of ``model.few_shot`` add to every prompt: ~3 characters per token and 10 tokens of
    chat-turn markup per example (SmolLM2's three arithmetic examples: 63 tokens; measured: 131-133-token prompts
    against the table's 64 for arithmetic)."""
    return sum(len(str(ex.get("question", ""))) // 3 + len(str(ex.get("answer", ""))) // 3 + 10
               for ex in (model_cfg.get("few_shot") or []))


def _prompt_tokens(names) -> int:
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


def backend_of(cfg):
    """The update backend class serving ``trainer.strategy``: it answers the plan's questions about the strategy's own
    memory (training/backends/base.py ``planned_*``). An unregistered name: validate() reports it; no plan."""
    from grail_exp.training.backends import BACKENDS

    name = str(cfg.trainer.strategy)
    if name not in BACKENDS:
        raise PlanError(f"trainer.strategy={name!r}: no update backend of that name ({', '.join(sorted(BACKENDS))})")
    return BACKENDS[name]


@dataclass
class Sizes:
    """What every phase of the plan reads, worked out once from the config."""

    shape: Shape
    b: int  # bytes per model-dtype element
    world: int  # W: ranks
    backend: type  # the update backend of trainer.strategy
    rows: int  # m: rows of one micro-batch
    P: int  # padded prompt tokens of a training row
    C: int  # completion tokens
    positions: int  # decoder positions one micro-batch computes
    capacity: Optional[float]  # usable bytes of one device (None: no device to judge)
    total: Optional[float]  # the device's bytes
    capacity_source: str
    cpu: bool

    @property
    def T(self) -> int:
        return self.P + self.C

    @property
    def n(self) -> int:
        return self.shape.params


def sizes(cfg, prompt_tokens: Optional[int] = None) -> Sizes:
    t, m = cfg.trainer, cfg.model
    s, W = model_shape(m), _world(t)
    local_rows = max(1, t.prompts_per_step * cfg.rollout.num_generations // W)
    mb = min(int(t.micro_batch_size), local_rows)
    C = int(cfg.rollout.max_completion_length)
    P = int(prompt_tokens) if prompt_tokens else _prompt_tokens([cfg.data.name]) + few_shot_tokens(m)
    cap, total, src = device_capacity(cfg)
    return Sizes(s, _dtype_bytes(m.dtype), W, backend_of(cfg), mb, P, C, computed_positions(cfg, mb, P, C), cap, total,
                 src, str(t.accelerator) == "cpu")


def plan(cfg, prompt_tokens: Optional[int] = None) -> MemoryPlan:
    """The per-device memory plan of the composed run config ``cfg`` (resolved lazily; nothing is loaded).
    ``prompt_tokens``: the padded prompt length of training rows (default: ``PROMPT_TOKENS`` of ``data.name``).
    The lines come phase by phase in the table's order; ``assemble`` sums them into the phases' totals."""
    z = sizes(cfg, prompt_tokens)
    lines = model_state_lines(cfg, z) + update_lines(cfg, z) + logp_lines(cfg, z)
    reserve, reserve_lines, problems, notes = vllm_share(cfg, z)
    lines += reserve_lines + rollout_lines(cfg, z) + eval_lines(cfg, z)
    if z.cpu:
        lines += host_lines(cfg)
    p = assemble(cfg, z, lines, reserve, problems, notes)
    p.timeouts = timeout_lines(cfg)
    if not z.cpu:
        p.host = host_node_lines(cfg, z)
    return p


def model_state_lines(cfg, z: Sizes) -> list[Line]:
    """The model state held through every phase, as the strategy's backend lays it out, with what its update adds to it
    (gradients, gathered parameters, the gradient sync), and the frozen reference model when one is loaded."""
    B, n, b, W = z.backend, z.n, z.b, z.world
    lines = [Line("state", *item) for item in B.planned_state(cfg, n, b, W)]
    lines += [Line("update", *item) for item in B.planned_gradients(cfg, n, b, W)]
    gathered = B.planned_gathered(cfg, z.shape, b, _probes_between_forward_and_backward(cfg))
    lines += [Line("update", *gathered)] if gathered else []
    lines += [Line("step", *item) for item in B.planned_gradient_sync(cfg, n, b, W)]
    from grail_exp.loss import needs_reference

    if needs_reference(cfg):
        lines.append(Line("state", "reference model", n * b, "a frozen copy, N x b (loss.beta > 0 / KL in reward / a "
                          "term needs it)"))
    return lines


def _saved_activations(cfg, z: Sizes) -> tuple[float, float, Line]:
    """(bytes autograd saves for one micro-batch, a recomputed layer's transients in backward, the table's line)."""
    s, b, tok, mb = z.shape, z.b, z.positions, z.rows
    layer = layer_activation_bytes(s, b)
    final = tok * s.hidden * (4 + b) + mb * z.C * s.hidden * b  # final RMSNorm + the completion window's hidden copy
    mask = mb * z.T * z.T  # the (m, 1, T, T) boolean attention mask of a left-padded batch
    if cfg.model.get("gradient_checkpointing"):
        saved = s.layers * tok * s.hidden * b + final + mask
        recompute = tok * layer + tok * b * (2 * s.hidden + 2 * s.intermediate)  # one layer again + its grads in flight
        return saved, recompute, Line("update", "activations (checkpointed)", saved, f"{s.layers} layers x {mb} rows x "
                                      f"{z.T} tokens x h {s.hidden} x {b} B + final norm, window copy, mask")
    saved = s.layers * tok * layer + final + mask
    return saved, 0.0, Line("update", "activations", saved, f"{s.layers} layers x {tok:,} positions "
                            f"({_positions_how(cfg, mb, z.P, z.C)}) x {layer:,.0f} B + final norm, mask")


def update_lines(cfg, z: Sizes) -> list[Line]:
    """One micro-batch's update: the saved activations and the largest transient on top of them (the output layer's
    chunks, a layer recomputed in backward, or OAR-G's second graph)."""
    saved, recompute, activations = _saved_activations(cfg, z)
    lf, lb, lhow = logits_bytes(z.rows * z.C, int(cfg.trainer.logprob_chunk_tokens), z.shape, z.b)
    teacher = saved + recompute if str(cfg.advantage.get("name", "")) == "oar_g" else 0.0  # its noisy pass's own graph
    transient = {"output layer, forward": lf, "output layer, backward": lb, "layer recomputed in backward": recompute,
                 "OAR-G noisy teacher pass": teacher}
    what, worst = max(transient.items(), key=lambda kv: kv[1])
    how = (lhow if what.startswith("output") else "one decoder layer's saved set + gradients in flight"
           if what.startswith("layer") else "a second graph of the micro-batch (activations + its recompute)")
    return [activations, Line("update", f"peak transient: {what}", worst, how)]


def logp_lines(cfg, z: Sizes) -> list[Line]:
    """The no-grad forward of old / reference log-probs, when k x mu > 1, an IS correction or a reference needs them."""
    from grail_exp.loss import needs_reference
    from grail_exp.training.batch import needs_old_logprobs

    if not (needs_old_logprobs(cfg) or needs_reference(cfg)):
        return []
    s, b = z.shape, z.b
    lf, _, _ = logits_bytes(z.rows * z.C, int(cfg.trainer.logprob_chunk_tokens), s, b)
    lines = [Line("logp", "no-grad forward", z.positions * b * (2 * s.hidden + 2 * s.intermediate) + lf
                  + z.rows * z.T * z.T, "one layer's transients + the output layer's chunk")]
    gathered = z.backend.planned_gathered(cfg, s, b, _probes_between_forward_and_backward(cfg))
    if gathered and gathered.bytes:
        lines.append(Line("logp", "gathered parameters", gathered.bytes, "as in the update"))
    return lines


def vllm_share(cfg, z: Sizes) -> tuple[float, list[Line], list[str], list[str]]:
    """(bytes vLLM reserves on the device through every phase, its lines, problems, notes). On CPU its weights and KV
    cache are host lines instead (``host_lines``); with no device named its share is left out and said so."""
    r = cfg.rollout
    if str(r.engine) != "vllm" or z.cpu:
        return 0.0, [], [], []
    util = float(r.vllm.gpu_memory_utilization)
    if z.total is None:
        return 0.0, [Line("state", "vLLM reserve (not counted)", 0.0, f"rollout.vllm.gpu_memory_utilization {util:g} "
                          "x the device: no device named, so not in the totals (trainer.device_memory_gb=<GiB> counts "
                          "it)")], [], [
            f"vLLM's share (rollout.vllm.gpu_memory_utilization {util:g} of each device) is not in the totals: no "
            "device is named; set trainer.device_memory_gb to count it"]
    reserve, total = util * z.total, z.total
    vb = _dtype_bytes(r.vllm.get("dtype") or cfg.model.dtype)
    kv = z.shape.kv_bytes_per_token * vb * z.T
    profile, how = vllm_profile_bytes(cfg, z.shape)
    need = z.n * vb + profile + kv
    problems = [] if reserve >= need else [
        f"rollout.vllm.gpu_memory_utilization = {util:g}: {reserve / GiB:.1f} GiB of the {total / GiB:.1f} GiB device "
        f"cannot hold the engine's weights ({z.n * vb / GiB:.1f} GiB), its profile (~{profile / GiB:.1f} "
        f"GiB) and the KV cache of one {z.T:,}-token sequence ({kv / GiB:.2f} GiB); needs >= "
        f"{math.ceil(need / total * 100) / 100:.2f}"]
    lines = [Line("vllm", "profile run (inside the reserve)", profile, how)]  # a phase no total adds: in the reserve
    return reserve, lines, problems, [] if problems else [vllm_concurrency(cfg, z, reserve - z.n * vb - profile, kv)]


def vllm_profile_bytes(cfg, s: Shape) -> tuple[float, str]:
    """(bytes, how) of vLLM's profile run inside its share: the larger of one forward over
    ``rollout.vllm.max_num_batched_tokens`` tokens and its sampler over min(``max_num_seqs``, tokens) rows of the
    vocabulary, plus the non-torch memory (see ``VLLM_SAMPLER_BYTES``)."""
    v = cfg.rollout.vllm
    vb = _dtype_bytes(v.get("dtype") or cfg.model.dtype)
    tokens = int(v.get("max_num_batched_tokens") or 4096)
    rows = min(int(v.get("max_num_seqs") or 256), tokens)
    forward = tokens * (3 * s.intermediate + 4 * s.hidden) * vb
    sampler = rows * s.vocab * (vb + VLLM_SAMPLER_BYTES)
    return max(forward, sampler) + VLLM_NON_TORCH_BYTES, (
        f"max of a forward over rollout.vllm.max_num_batched_tokens {tokens:,} tokens x (3 x intermediate + 4 x hidden) "
        f"x {vb} B ({forward / GiB:.2f}) and the sampler over {rows} rows x V x ({vb} + {VLLM_SAMPLER_BYTES}) B "
        f"({sampler / GiB:.2f}), + {VLLM_NON_TORCH_BYTES / GiB:.1f} non-torch; inside the reserve, not added to it")


def vllm_concurrency(cfg, z: Sizes, kv_space: float, per_sequence: float) -> str:
    """The plan's note on vLLM's KV space: how many sequences of the run's length it holds at once (capped by
    ``rollout.vllm.max_num_seqs``), against the rows one rank samples per round."""
    r = cfg.rollout
    fits = int(kv_space // per_sequence) if per_sequence else 0
    cap = int(r.vllm.get("max_num_seqs") or 256)
    rows = max(1, cfg.trainer.prompts_per_step // z.world) * int(r.num_generations)
    at_once = min(fits, cap)
    waves = -(-rows // at_once) if at_once else 0
    return (f"vLLM's KV space: {kv_space / GiB:.1f} GiB of its share after the weights and the profile holds {fits:,} "
            f"sequences of {z.T:,} tokens at once (rollout.vllm.max_num_seqs {cap} caps it at {at_once:,}); a rank's "
            f"{rows:,} rollout rows per round run in {waves} wave{'s' if waves != 1 else ''} (prefix caching shares "
            "each prompt's pages among its G samples: the count is a floor)")


def rollout_lines(cfg, z: Sizes) -> list[Line]:
    """Sampling the rollout batch: vLLM's weight sync, or the HF engine's KV cache, scores and prefill (with the
    parameters gathered where the strategy shards them)."""
    r, s, b = cfg.rollout, z.shape, z.b
    if str(r.engine) == "vllm":
        sync = _sync_chunk_bytes(cfg, z)
        return [Line("rollout", "weight sync: one chunk in flight", sync, _SYNC_HOW)] if sync else []
    G = r.num_generations
    per_call = max(1, int(r.generation_batch_size) // G)
    rows = min(per_call, max(1, cfg.trainer.prompts_per_step // z.world)) * G
    kv, how = hf_engine_kv_bytes(s, b, rows // G, G, z.P, z.C, z.cpu)
    lines = [Line("rollout", "KV cache (HF engine)", kv, how),
             Line("rollout", "scores and prefill", rows * s.vocab * SCORE_BYTES + rows * z.P * b
                  * (2 * s.hidden + 3 * s.intermediate) + s.kv_bytes_per_token * b * rows * z.T / s.layers,
                  f"{SCORE_BYTES} B x rows x V of one step's scores + one prefill layer's transients + one layer's KV "
                  "being grown")]
    if z.backend.shards_parameters:
        lines.append(Line("rollout", "gathered parameters", z.n * b, "full_parameters(): every layer's b-byte copy"))
    return lines


def eval_lines(cfg, z: Sizes) -> list[Line]:
    """Evaluation on the benchmarks, when the run evaluates: vLLM's weight sync, or the HF engine's KV cache and scores
    of one call (with the parameters gathered where the strategy shards them)."""
    t, s, b = cfg.trainer, z.shape, z.b
    if not (t.get("eval_at_end") or t.get("eval_before_training") or t.get("eval_every")):
        return []
    if str(cfg.rollout.engine) == "vllm":
        sync = _sync_chunk_bytes(cfg, z)
        return [Line("eval", "weight sync: one chunk in flight", sync, _SYNC_HOW)] if sync else []
    ev = cfg.eval
    per_call = max(1, int(ev.batch_size) // int(ev.n))
    rows = per_call * int(ev.n)
    Pe = _prompt_tokens(cfg.benchmark.names)
    kv, how = hf_engine_kv_bytes(s, b, per_call, int(ev.n), Pe, int(ev.max_tokens), z.cpu)
    lines = [Line("eval", "KV cache (HF engine)", kv, how + "; every rank (its share of the chunks)"),
             Line("eval", "scores and prefill", rows * s.vocab * SCORE_BYTES + s.kv_bytes_per_token * b * rows
                  * (Pe + int(ev.max_tokens)) / s.layers,
                  f"{SCORE_BYTES} B x rows x V of one step's scores + one layer's KV being grown")]
    if z.backend.shards_parameters:
        lines.append(Line("eval", "gathered parameters", z.n * b, "full_parameters()"))
    return lines


def assemble(cfg, z: Sizes, lines: list[Line], reserve: float, problems: list[str], notes: list[str]) -> MemoryPlan:
    """The phases' totals (the state, plus each phase's own lines, plus vLLM's reserve held through all of them), the
    headroom and the table's header."""
    state = sum(x.bytes for x in lines if x.phase == "state")
    phases = {"state": state}
    for ph in ("update", "logp", "step", "rollout", "eval"):
        if any(x.phase == ph for x in lines):
            extra = sum(x.bytes for x in lines if x.phase == ph)
            if ph == "step":  # DDP's all-reduce happens with the gradients of the update allocated
                extra += sum(x.bytes for x in lines if x.phase == "update" and x.what == "gradients")
            phases[ph] = state + extra
    phases = {ph: v + reserve for ph, v in phases.items()}
    r = cfg.rollout
    if reserve:
        lines.append(Line("state", "vLLM reserve", reserve, f"rollout.vllm.gpu_memory_utilization "
                          f"{r.vllm.gpu_memory_utilization:g} x the device, held through every phase"))
    headroom = 0.0 if z.capacity is None else (
        (HOST_HEADROOM_FIXED if z.cpu else HEADROOM_FIXED) + HEADROOM_FRACTION * (z.total if z.cpu else z.capacity))
    return MemoryPlan(lines, phases, max(phases, key=phases.get), z.capacity, z.capacity_source, headroom, problems,
                      _facts(cfg, z), notes)


def _facts(cfg, z: Sizes) -> dict:
    """The table's header: the inputs the plan was made from."""
    r, m, engine = cfg.rollout, cfg.model, str(cfg.rollout.engine)
    sampling = (f" (gpu_memory_utilization {r.vllm.gpu_memory_utilization:g})" if engine == "vllm" else
                f" (generation_batch_size {r.generation_batch_size}, eval.batch_size {cfg.eval.batch_size})")
    return {"model": f"{z.shape.name} ({z.n / 1e9:.2f} B parameters, {m.dtype})",
            "strategy": f"{z.backend.memory_layout(cfg, z.world)}, {z.world} device(s)",
            "micro-batch": f"{z.rows} rows x ({z.P} prompt + {z.C} completion) tokens", "engine": engine + sampling,
            "checkpointing": bool(m.get("gradient_checkpointing")),
            "logprob_chunk_tokens": int(cfg.trainer.logprob_chunk_tokens)}


_SYNC_HOW = ("rollout.vllm.sync_chunk_mb of full parameters gathered and cast to the engine's dtype (a larger tensor, "
             "the embedding, alone)")


def _sync_chunk_bytes(cfg, z: Sizes) -> float:
    """Bytes a weight sync to vLLM holds beyond the model: one chunk (or the largest tensor, V x h) in the engine's
    dtype — when sharded parameters are gathered or the engine's dtype differs from the model's (else the live
    tensors are pushed as they are: 0)."""
    r, m = cfg.rollout, cfg.model
    vdtype = r.vllm.get("dtype") or m.dtype
    if not z.backend.shards_parameters and str(vdtype) == str(m.dtype):
        return 0.0
    chunk = float(r.vllm.get("sync_chunk_mb", 256) or 256) * 2**20
    return max(chunk, z.shape.vocab * z.shape.hidden * _dtype_bytes(vdtype))


def vllm_kv_cache_bytes(cfg, max_model_len: int, block: int = 16) -> int:
    """The KV cache a vLLM engine on CPU is given (``kv_cache_memory_bytes``; on GPU ``gpu_memory_utilization`` sizes
    it): every row of one rollout batch at ``max_model_len`` tokens, in ``block``-token pages, in the engine's dtype,
    x ``VLLM_CPU_PAGE_FACTOR`` (vLLM's CPU pages hold fewer tokens than the bare keys and values: SmolLM2 at 118 MB,
    3,200 tokens instead of 5,120). With prefix caching the G rows of a prompt share its pages: room to spare."""
    s, r, t = model_shape(cfg.model), cfg.rollout, cfg.trainer
    rows = max(1, min(int(r.generation_batch_size), t.prompts_per_step // _world(t) * int(r.num_generations)))
    pages = -(-int(max_model_len) // block)
    dtype = _dtype_bytes(r.vllm.get("dtype") or cfg.model.dtype)
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


def _positions_how(cfg, rows: int, P: int, C: int) -> str:
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


# Host memory of a CPU run beyond its tensors, measured on this project's machines (docs/memory-planner.md): the
# imported libraries (torch, transformers, Lightning, Hydra, MLflow: ~0.6 GiB of resident pages) and each grading
# worker process (math-verify and sympy, ~0.15 GiB).
HOST_BASELINE = 0.6 * GiB
GRADER_WORKER = 0.15 * GiB
HOST_HEADROOM_FIXED = 0.5 * GiB  # heap fragmentation between phases (grail_exp/compute/host.py returns what it can)


def host_capacity() -> tuple[Optional[float], Optional[float], str]:
    """(available, total, where from) of this machine's memory for a CPU run (``host.memory_bytes``)."""
    from grail_exp.compute.host import memory_bytes

    available, total = memory_bytes()
    if available is None:
        return None, None, "CPU run: the host's memory is unknown here (no /proc/meminfo): no verdict"
    # The verdict is against the machine's memory, not what other processes leave free at this instant (a busy
    # machine would refuse a run one minute and accept it the next); the table prints both.
    return float(total), float(total), f"host memory: {total / GiB:.1f} GiB ({available / GiB:.1f} GiB available now)"


def host_lines(cfg) -> list[Line]:
    """The lines a CPU run adds to its plan: the process's libraries, the grading workers (processes of their own, on
    the same machine) and, with vLLM's CPU build, the engine's copy of the weights and its KV cache."""
    lines = [Line("state", "libraries (host)", HOST_BASELINE, "torch, transformers, Lightning, Hydra, MLflow: measured"),
             Line("state", "grading workers (host)", GRADER_WORKER * int(cfg.reward.num_workers),
                  f"reward.num_workers {cfg.reward.num_workers} x {GRADER_WORKER / GiB:.2f} GiB (processes of their own)")]
    if str(cfg.rollout.engine) == "vllm":
        s = model_shape(cfg.model)
        vb = _dtype_bytes(cfg.rollout.vllm.get("dtype") or cfg.model.dtype)
        T = _prompt_tokens([cfg.data.name]) + few_shot_tokens(cfg.model) + int(cfg.rollout.max_completion_length)
        length = int(cfg.rollout.vllm.max_model_len or T)
        lines.append(Line("state", "vLLM engine (host)", s.params * vb + vllm_kv_cache_bytes(cfg, length),
                          f"its weights N x {vb} B + the KV cache of one rollout batch at {length} tokens"))
    return lines


# SLURM's --mem for a GPU job: the plan's host peak per node plus the planner's own error (PLAN_ERROR), in whole GiB.
HOST_MARGIN = PLAN_ERROR


def host_node_lines(cfg, z: Sizes) -> list[Line]:
    """A GPU layout's host memory on the node holding rank 0 (the busiest): what every rank keeps (phase ``host``),
    then one row per phase that passes weights or state through the host — ``host: load`` (the weights read from disk
    at the start), ``host: checkpoint`` (each rank's part of the state, staged to be written, plus one tensor's buffer;
    rank 0 streams the Hugging Face weights one tensor at a time), ``host: resume`` (the same parts read back, and the
    weights they do not carry). Loading and reading a training state are sequential in a run, so resume is the larger of
    its two halves. With R ranks per node, N parameters, L bytes per loaded policy element (fp32 under FSDP: its master
    weights), b bytes per model-dtype element, W ranks, and V x h (the embedding) the largest tensor."""
    from grail_exp.loss import needs_reference
    from grail_exp.world import devices_per_node

    B, n, b, W, s = z.backend, z.n, z.b, z.world, z.shape
    R = min(devices_per_node(cfg.trainer.devices), W)
    L = _dtype_bytes((B.policy_overrides(cfg).get("model") or {}).get("dtype", cfg.model.dtype))
    tensor = s.vocab * s.hidden
    ref = needs_reference(cfg)
    workers = int(cfg.reward.num_workers)
    lines = [Line("host", "libraries and grading workers", R * (HOST_BASELINE + GRADER_WORKER * workers),
                  f"R {R} ranks x ({HOST_BASELINE / GiB:.2f} GiB + reward.num_workers {workers} x "
                  f"{GRADER_WORKER / GiB:.2f} GiB)")]
    copies = 1 if B.weights_from_rank0(cfg) else R
    who = "rank 0 reads them, the other ranks receive them on their device" if copies == 1 else f"each of {R} ranks"
    shards = n * L / W if copies == 1 and B.shards_parameters else 0.0  # rank 0's CPU shards beside its full copy
    load = copies * (n * L + (n * b if ref else 0.0)) + shards
    how = (f"{who}: N {n:,} x L {L} B" + (" + the reference N x b" if ref else "")
           + (" + rank 0's shards N x L / W while its full copy lives" if shards else ""))
    lines.append(Line("host: load", "weights read from disk", load, how))
    parts = [B.planned_checkpoint_shard(cfg, n, b, W, r, tensor) for r in range(R)]
    staged = sum(p.bytes for p in parts)
    # Sharded weights: rank 0 streams the full Hugging Face export, one gathered fp32 tensor at a time.
    export = 4 * tensor if B.checkpoint_holds_weights(cfg) and cfg.trainer.get("export_hf_weights", True) else 0.0
    writers = f"{R} ranks" if parts[-1].bytes else "rank 0"
    lines.append(Line("host: checkpoint", "what the writing ranks hold at once", staged + export,
                      f"{writers}: {parts[0].how}" + (" (others: " + parts[-1].how + ")" if parts[-1].how != parts[0].how
                                                       else "") + (", + rank 0's export, one gathered 4 B x V x h "
                                                                   "tensor at a time" if export else "")))
    outside = ([] if B.checkpoint_holds_weights(cfg) else ["the policy N x L"]) + (["the reference N x b"] if ref else [])
    weights = (0.0 if B.checkpoint_holds_weights(cfg) else copies * n * L) + (copies * n * b if ref else 0.0)
    lines.append(Line("host: resume", "the parts read back, or the weights", max(staged, weights),
                      f"max(the parts read back (memory-mapped, placed one at a time) {staged / GiB:.2f} GiB, the "
                      f"weights read as at load that the parts do not carry ({' + '.join(outside) or 'none'}) "
                      f"{weights / GiB:.2f} GiB)"))
    return lines


def planned_mem_gb(cfg) -> Optional[int]:
    """SLURM's ``--mem`` (GB, as SLURM counts them: GiB) for the run ``cfg``: the plan's host memory per node plus
    ``HOST_MARGIN``, rounded up. A GPU layout's is ``MemoryPlan.host_peak``; a CPU run's, its per-process peak (planned in
    host memory) times the ranks on a node. None when no plan can be made (an architecture the planner does not know)."""
    from grail_exp.world import devices_per_node

    try:
        p = plan(cfg)
    except PlanError:
        return None
    per_node = p.host_peak if p.host_peak is not None else p.peak * devices_per_node(cfg.trainer.devices)
    return math.ceil(per_node * (1 + HOST_MARGIN) / GiB)


# ---------------------------------------------------------------------------------------------- what would fit
def _vllm_need(cfg, rows: int) -> float:
    """gpu_memory_utilization that holds the engine's weights, its profile and the KV cache of ``rows`` sequences."""
    s, m, r = model_shape(cfg.model), cfg.model, cfg.rollout
    _, total, _ = device_capacity(cfg)
    vb = _dtype_bytes(r.vllm.get("dtype") or m.dtype) if r.get("vllm") else _dtype_bytes(m.dtype)
    T = _prompt_tokens([cfg.data.name]) + int(r.max_completion_length)
    need = s.params * vb + vllm_profile_bytes(cfg, s)[0] + s.kv_bytes_per_token * vb * T * rows
    return math.ceil(need / total * 100) / 100 if total else 1.0


VLLM_SUGGESTED_SEQUENCES = 16  # a suggested vLLM fraction leaves KV room for this many sequences at once


def _families(cfg) -> tuple[list[list[list[str]]], list[list[str]]]:
    """(ways to shrink the plan on the same engine, each a list of override sets from the mildest to the strongest,
    cheapest first; switches of the engine)."""
    t, r = cfg.trainer, cfg.rollout
    fam: list[list[list[str]]] = []
    fam.append([[f"trainer.logprob_chunk_tokens={v}"] for v in (2048, 1024, 512) if v < int(t.logprob_chunk_tokens)])
    fam.append([[f"trainer.micro_batch_size={v}"] for v in (4, 2, 1) if v < int(t.micro_batch_size)])
    if not cfg.model.get("gradient_checkpointing"):
        fam.append([["model.gradient_checkpointing=true"]])
    engines: list[list[str]] = []
    if str(r.engine) != "vllm":
        G, n = int(r.num_generations), int(cfg.eval.n)
        fam.append([[f"rollout.generation_batch_size={v * G}"] for v in (16, 8, 4, 2, 1)
                    if v * G < int(r.generation_batch_size)])
        fam.append([[f"eval.batch_size={v * n}"] for v in (32, 16, 8, 4, 2, 1) if v * n < int(cfg.eval.batch_size)])
        if device_capacity(cfg)[1] and str(t.accelerator) != "cpu":
            engines.append(["rollout=vllm", f"rollout.vllm.gpu_memory_utilization="
                                            f"{_vllm_need(cfg, VLLM_SUGGESTED_SEQUENCES)}"])
    else:
        engines.append(["rollout=hf"])
    fam += backend_of(cfg).shard_options(cfg, _world(t))  # the strategy's own: shard more, or over more ranks
    return [f for f in fam if f], engines


def replan(cfg, overrides: list[str]):
    """``cfg`` with ``key=value`` and group overrides applied as on the run's command line, as a new config: a group
    switch offered by ``suggest`` (``trainer=fsdp_zero2``, ``rollout=hf``) is the option's file as Hydra composes it,
    under what the run set on top of its group (``grail_exp/recompose.py``)."""
    from grail_exp.recompose import apply_overrides

    return apply_overrides(cfg, overrides)


def _fits(cfg, overrides: list[str], margin: bool = False) -> bool:
    """The plan with ``overrides`` fits (``margin``: and is not tight)."""
    try:
        q = plan(replan(cfg, overrides))
        return bool(q.fits) and not (margin and q.tight)
    except Exception:  # noqa: BLE001 - a candidate the planner cannot evaluate does not fit
        return False


def suggest(cfg, p: MemoryPlan, max_options: int = 3, margin: bool = False) -> list[list[str]]:
    """Override sets that make the plan fit, mildest first. On the same engine: the vLLM fraction it needs (when the
    engine cannot hold its weights: room for 16 sequences), then each single change that fits alone, else the
    changes of every family combined, each at its mildest strength that fits (cheapest families first); then a
    switch of the engine, if that alone fits. [] when nothing found fits. ``margin``: options whose plan is not
    tight either (fits by at least the planner's error)."""
    base: list[str] = []
    if p.problems and str(cfg.rollout.engine) == "vllm":
        base = [f"rollout.vllm.gpu_memory_utilization={_vllm_need(cfg, VLLM_SUGGESTED_SEQUENCES)}"]
        if _fits(cfg, base, margin):
            return [base]
    fams, engines = _families(cfg)
    options: list[list[str]] = []
    for fam in fams:
        for o in fam:
            if _fits(cfg, base + o, margin):
                options.append(base + o)
                break
    if not options:
        combined = _combined(cfg, base, fams, margin)
        options += [combined] if combined else []
    options = options[: max_options - 1] if engines else options[:max_options]
    for e in engines:  # the engine switch replaces the vLLM fraction fix
        if _fits(cfg, e, margin):
            options.append(e)
    return options


def _combined(cfg, base: list[str], fams: list, margin: bool) -> Optional[list[str]]:
    """Each family at its strongest until the plan fits, then each relaxed back to its mildest strength (or none)
    that still fits, the costlier families (micro-batch) before the chunk size; None when even all together do not."""
    chosen: list[Optional[list[str]]] = []
    flat = lambda picks: base + [o for pick in picks if pick for o in pick]  # noqa: E731
    for fam in fams:
        chosen.append(fam[-1])
        if _fits(cfg, flat(chosen), margin):
            for i in reversed(range(len(chosen))):
                chosen[i] = next((o for o in [None, *fams[i]] if _fits(cfg, flat(chosen[:i] + [o] + chosen[i + 1:]), margin)),
                                 chosen[i])
            return flat(chosen)
    return None


def _same_hardware(option: list[str]) -> bool:
    return not any(o.startswith("trainer.devices=") for o in option)


# ---------------------------------------------------------------------------------------------- timeouts
def needed_dist_timeout(cfg) -> tuple[int, str]:
    """(seconds, how): the process-group timeout this run's planned checkpoint write needs (grail_exp/timeouts.py:
    max(1800 s, 2 x 16 B x N / 100 MB/s)); an architecture the planner does not know gets the 1800 s floor."""
    from grail_exp.timeouts import needed_dist_timeout as rule

    try:
        params = model_shape(cfg.model).params
    except PlanError:
        params = None
    return rule(params)


def timeout_lines(cfg) -> list[str]:
    """The plan's "timeouts needed" line: what the planned checkpoint needs against what the run sets."""
    need, how = needed_dist_timeout(cfg)
    configured = cfg.trainer.get("dist_timeout_s")
    now = f"null (= {need} s)" if configured is None else f"{configured} s" + (
        ", BELOW the need" if configured < need else "")
    return [f"timeouts needed: trainer.dist_timeout_s >= {need} s (set: {now}) = {how}"]


# ---------------------------------------------------------------------------------------------- output
def render(p: MemoryPlan) -> str:
    out = ["memory plan per device (GiB = 2^30 bytes)"]
    out += [f"  {k}: {v}" for k, v in p.facts.items()]
    out.append("")
    out.append("| phase | item | GiB | how |")
    out.append("|---|---|--:|---|")
    for x in p.lines:
        out.append(f"| {x.phase} | {x.what} | {x.bytes / GiB:.2f} | {x.how} |")
    out.append("")
    out.append("| phase | total GiB (state + phase + vLLM reserve) |")
    out.append("|---|--:|")
    for ph, v in p.phases.items():
        out.append(f"| {ph}{' (peak)' if ph == p.peak_phase else ''} | {v / GiB:.2f} |")
    out.append("")
    if p.capacity is None:
        out.append(f"device: {p.capacity_source}; no verdict")
    else:
        out.append(f"device: {p.capacity / GiB:.1f} GiB usable ({p.capacity_source}), headroom {p.headroom / GiB:.1f} GiB: "
                   f"peak {p.peak / GiB:.1f} GiB ({p.peak_phase}) {'fits' if p.fits else 'DOES NOT FIT'}")
    out += [f"problem: {x}" for x in p.problems]
    out += p.timeouts
    out += [f"note: {x}" for x in p.notes]
    if p.host:
        out += ["", "host memory per node (the node of rank 0)", "", "| phase | item | GiB | how |", "|---|---|--:|---|"]
        out += [f"| {x.phase} | {x.what} | {x.bytes / GiB:.2f} | {x.how} |" for x in p.host]
        out.append("")
        out.append(f"host per node: {p.host_peak / GiB:.1f} GiB (what every rank keeps + the largest phase); SLURM "
                   f"--mem = that + {HOST_MARGIN:.0%} = {math.ceil(p.host_peak * (1 + HOST_MARGIN) / GiB)} GB "
                   "(hydra.launcher.mem_gb, unless set)")
    return "\n".join(out)


def tight_warning(cfg, p: MemoryPlan) -> Optional[str]:
    """For a plan that fits by less than the planner's own error: one line saying so, with the mildest changes that
    leave that margin (None for other plans)."""
    if not p.tight:
        return None
    usable = p.capacity - p.headroom
    options = suggest(cfg, p, max_options=2, margin=True)
    if not any(_same_hardware(o) for o in options):  # also what buys the margin on the GPUs the run has
        combined = _combined(cfg, [], [f for f in _families(cfg)[0] if all(_same_hardware(o) for o in f)], True)
        options = ([combined] if combined else []) + options
    fix = (f"; a margin of {PLAN_ERROR:.0%} with: " + " | ".join(" ".join(o) for o in options)) if options else ""
    return (f"memory plan is tight: the peak {p.peak / GiB:.1f} GiB ({p.peak_phase}) fits the {usable / GiB:.1f} GiB "
            f"usable by {(usable - p.peak) / GiB:.1f} GiB, less than the planner's own error ({PLAN_ERROR:.0%} of the "
            f"peak, {PLAN_ERROR * p.peak / GiB:.1f} GiB; planned peaks were 0.91-1.05 of measured ones){fix}")


def refusal(cfg, p: MemoryPlan) -> str:
    """The one message validate() raises for a plan that does not fit: what, against what, and what would fit."""
    usable = p.capacity - p.headroom
    parts = list(p.problems)
    if p.peak > usable:
        parts.append(f"the peak per device is {p.peak / GiB:.1f} GiB ({p.peak_phase}) against {usable / GiB:.1f} GiB "
                     f"usable ({p.capacity_source}, less {p.headroom / GiB:.1f} GiB headroom)")
    options = suggest(cfg, p)
    if options:
        fix = " | ".join(" ".join(o) for o in options)
        tail = f". It would fit with {'one of: ' if len(options) > 1 else ''}{fix}"
    else:
        tail = (". No change of trainer.devices, trainer.micro_batch_size, trainer.logprob_chunk_tokens, "
                "model.gradient_checkpointing, rollout.generation_batch_size, eval.batch_size or rollout=vllm|hf fits "
                "this device")
    return "memory plan: " + "; ".join(parts) + tail + ". Details: python -m grail_exp.plan <the same overrides>"


def check(cfg) -> Optional[str]:
    """For validate(): the refusal message when the plan does not fit a known device, else None. Plans that cannot
    be made (an architecture the planner does not know) and devices it cannot see are not refused."""
    try:
        p = plan(cfg)
    except PlanError:
        return None
    if p.fits is False:
        return refusal(cfg, p)
    warning = tight_warning(cfg, p)
    if warning:
        import logging

        logging.getLogger("grail_exp").warning(warning)
    return None
