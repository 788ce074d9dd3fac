"""Memory plan of a run, per device, before anything is loaded (the CLI is ``grail_exp/plan.py``; the tensors' byte
arithmetic is ``memory/shapes.py``, the table, the refusal and the suggestions ``memory/advice.py``).

``validate.py`` calls ``check`` and refuses a run whose plan does not fit, naming keys and values that would;
``python -m grail_exp.plan <overrides>`` prints ``render`` of ``plan`` (docs/memory-planner.md).

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
from dataclasses import dataclass, field
from datetime import timedelta

from grail_exp.memory.shapes import (
    HEADROOM_FIXED,
    HEADROOM_FRACTION,
    PLAN_ERROR,
    SCORE_BYTES,
    GiB,
    PlanError,
    Shape,
    adapted_linear_parameters,
    benchmark_prompt_tokens,
    computed_positions,
    configured_world_size,
    dtype_bytes,
    few_shot_tokens,
    hf_engine_kv_bytes,
    layer_activation_bytes,
    logits_bytes,
    lora_layer_activation_bytes,
    lora_parameters,
    model_shape,
    positions_how,
    vllm_kv_cache_bytes,
    vllm_profile_bytes,
)


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
    capacity: float | None  # bytes usable per device; None = unknown (CPU, or no device and no device_memory_gb)
    capacity_source: str
    headroom: float
    problems: list[str] = field(default_factory=list)  # impossible independently of the sum (vLLM too small, ...)
    facts: dict = field(default_factory=dict)  # the inputs, for the table's header
    notes: list[str] = field(default_factory=list)  # what the totals leave out, said under the table
    timeouts: list[str] = field(default_factory=list)  # timeout_lines(): the process-group timeout the run needs
    host: list[Line] = field(default_factory=list)  # a GPU layout's host memory per node (host_node_lines)

    @property
    def host_peak(self) -> float | None:
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
    def fits(self) -> bool | None:
        if self.capacity is None:
            return None
        return not self.problems and self.peak <= self.capacity - self.headroom

    @property
    def tight(self) -> bool:
        """Fits, but by less than the planner's own error (``PLAN_ERROR`` of the peak): it may not on the GPU."""
        return bool(self.fits) and self.peak * (1 + PLAN_ERROR) > self.capacity - self.headroom


def device_capacity(cfg) -> tuple[float | None, float | None, str]:
    """(usable bytes, total bytes, where from) of one device; (None, None, why) when there is none to plan for."""
    t = cfg.trainer
    gb = t.get("device_memory_gb")
    if gb:
        return float(gb) * GiB, float(gb) * GiB, f"trainer.device_memory_gb={gb}"
    if str(t.accelerator) == "cpu":
        return host_capacity()
    try:
        import torch

        if torch.cuda.is_available():  # neither asks for a CUDA context (the device count comes from NVML)
            from grail_exp.memory.nvml import free_memory, local_device

            return free_memory(local_device() % torch.cuda.device_count())
    except Exception as exc:  # noqa: BLE001 - a broken driver is the run's problem, not the planner's
        return None, None, f"no CUDA device ({type(exc).__name__})"
    return None, None, "no CUDA device visible: set trainer.device_memory_gb to plan for one"


def scheme_of(cfg):
    """The scheme class ``advantage.name`` registers (it answers the plan's questions about its own memory), or None
    for an unregistered name (validate() reports it)."""
    from grail_exp.advantages import SCHEMES

    return SCHEMES.get(str(cfg.advantage.get("name", "")))


def _probes_between_forward_and_backward(cfg) -> bool:
    """The scheme needs the model (a probe gradient, extra forwards) or loss terms are on: the update backend then keeps
    a sharded policy gathered from a micro-batch's forward to its backward (training/backends/fsdp.py ``hold``)."""
    if cfg.loss.get("terms"):
        return True
    scheme = scheme_of(cfg)
    return True if scheme is None else bool(scheme.needs_model)  # an unknown scheme: plan the larger case


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
    capacity: float | None  # usable bytes of one device (None: no device to judge)
    total: float | None  # the device's bytes
    capacity_source: str
    cpu: bool
    lora_rank: int | None = None  # peft=lora: the adapters' rank (None: full fine-tuning)

    adapters_fp32: bool = False  # peft.adapter_dtype=float32 (else the adapters are held in model.dtype)

    @property
    def adapter_bytes(self) -> int:
        """Bytes per adapter element as held and computed: 4 (peft.adapter_dtype=float32) or b."""
        return 4 if self.adapters_fp32 else self.b

    @property
    def n_adapter(self) -> int:
        """Adapter elements under peft=lora (``shapes.lora_parameters``), 0 otherwise."""
        return lora_parameters(self.shape, self.lora_rank) if self.lora_rank else 0

    @property
    def T(self) -> int:
        return self.P + self.C

    @property
    def n(self) -> int:
        return self.shape.params


def sizes(cfg, prompt_tokens: int | None = None) -> Sizes:
    t, m = cfg.trainer, cfg.model
    s, W = model_shape(m), configured_world_size(t)
    local_rows = max(1, t.prompts_per_step * cfg.rollout.num_generations // W)
    mb = min(int(t.micro_batch_size), local_rows)
    C = int(cfg.rollout.max_completion_length)
    P = int(prompt_tokens) if prompt_tokens else benchmark_prompt_tokens([cfg.data.name]) + few_shot_tokens(m)
    cap, total, src = device_capacity(cfg)
    peft = cfg.get("peft") or {}
    rank = int(peft.get("rank")) if str(peft.get("name", "none")) == "lora" else None
    return Sizes(s, dtype_bytes(m.dtype), W, backend_of(cfg), mb, P, C, computed_positions(cfg, mb, P, C), cap, total,
                 src, str(t.accelerator) == "cpu", rank, str(peft.get("adapter_dtype") or "") == "float32")


def plan(cfg, prompt_tokens: int | None = None) -> MemoryPlan:
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
    (gradients, gathered parameters, the gradient sync), and the frozen reference model when one is loaded. Under
    peft=lora the backend lays out the adapters (n_a elements in model.dtype, or fp32 with peft.adapter_dtype=float32:
    masters where the strategy keeps them, Adam and gradients over them only) and the frozen base is held beside them
    in model.dtype (sharded where the strategy shards parameters); the reference is
    the base with the adapters off: no copy."""
    B, n, b, W = z.backend, z.n, z.b, z.world
    # the adapters through the strategy's own layout, like full fine-tuning's weights, at their own element size
    trained, tb, tag = (z.n_adapter, z.adapter_bytes, "adapter ") if z.lora_rank else (n, b, "")
    lines = []
    if z.lora_rank:
        shards = B.shards_parameters
        lines.append(Line("state", "frozen base", n * b / (W if shards else 1),
                          f"N {n:,} x {b} B" + (f" / W {W} (sharded)" if shards else "") + ", no masters, no Adam"))
        if str(cfg.rollout.engine) == "hf" and str(cfg.peft.get("sync", "adapter")) == "merged":
            m = adapted_linear_parameters(z.shape)
            lines.append(Line("state", "merged copy (HF engine)", m * b, f"peft.sync=merged: W + (alpha/r) B A of every "
                              f"adapted linear layer, {m:,} x {b} B"))
    lines += [Line("state", tag + item.what, item.bytes, item.how) for item in B.planned_state(cfg, trained, tb, W)]
    lines += [Line("update", tag + item.what, item.bytes, item.how)
              for item in B.planned_gradients(cfg, trained, tb, W)]
    gathered = B.planned_gathered(cfg, z.shape, b, _probes_between_forward_and_backward(cfg))
    lines += [Line("update", *gathered)] if gathered else []
    lines += [Line("step", *item) for item in B.planned_gradient_sync(cfg, trained, tb, W)]
    from grail_exp.loss import needs_reference

    if needs_reference(cfg):
        lines.append(Line("state", "reference model", 0.0, "the policy with its adapters off (peft=lora): no copy")
                     if z.lora_rank else
                     Line("state", "reference model", n * b, "a frozen copy, N x b (loss.beta > 0 / KL in reward / a "
                          "term needs it)"))
    return lines


def _saved_activations(cfg, z: Sizes) -> tuple[float, float, Line]:
    """(bytes autograd saves for one micro-batch, a recomputed layer's transients in backward, the table's line)."""
    s, b, tok, mb = z.shape, z.b, z.positions, z.rows
    if z.lora_rank:  # a frozen base keeps less, the adapters their fp32 inputs (shapes.lora_layer_activation_bytes)
        from grail_exp.models.loading import narrows_backward

        layer = lora_layer_activation_bytes(s, b, z.lora_rank, z.adapter_bytes, narrowed=z.cpu and narrows_backward(cfg))
    else:
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
                            f"({positions_how(cfg, mb, z.P, z.C)}) x {layer:,.0f} B + final norm, mask")


def update_lines(cfg, z: Sizes) -> list[Line]:
    """One micro-batch's update: the saved activations and the largest transient on top of them (the output layer's
    chunks, a layer recomputed in backward, or what the scheme adds: ``AdvantageScheme.planned_update_transient``,
    e.g. OAR-G's second graph)."""
    saved, recompute, activations = _saved_activations(cfg, z)
    lf, lb, lhow = logits_bytes(z.rows * z.C, int(cfg.trainer.logprob_chunk_tokens), z.shape, z.b)
    transient = {"output layer, forward": (lf, lhow), "output layer, backward": (lb, lhow),
                 "layer recomputed in backward": (recompute, "one decoder layer's saved set + gradients in flight")}
    scheme = scheme_of(cfg)
    extra = scheme.planned_update_transient(cfg, saved + recompute) if scheme is not None else None
    if extra is not None:
        transient[extra[0]] = (extra[1], extra[2])
    what, (worst, how) = max(transient.items(), key=lambda kv: kv[1][0])  # ties: the first listed
    return [activations, Line("update", f"peak transient: {what}", worst, how)]


def logp_lines(cfg, z: Sizes) -> list[Line]:
    """The no-grad forward of old / reference log-probs, when k x mu > 1, an IS correction or a reference needs them."""
    from grail_exp.loss import needs_old_logprobs, needs_reference

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
    vb = dtype_bytes(r.vllm.get("dtype") or cfg.model.dtype)
    kv = z.shape.kv_bytes_per_token * vb * z.T
    profile, how = vllm_profile_bytes(cfg, z.shape)
    slots, slots_how = vllm_lora_slot_bytes(cfg, z, vb)
    weights = z.n * vb + slots
    need = weights + profile + kv
    problems = [] if reserve >= need else [
        f"rollout.vllm.gpu_memory_utilization = {util:g}: {reserve / GiB:.1f} GiB of the {total / GiB:.1f} GiB device "
        f"cannot hold the engine's weights ({weights / GiB:.1f} GiB), its profile (~{profile / GiB:.1f} "
        f"GiB) and the KV cache of one {z.T:,}-token sequence ({kv / GiB:.2f} GiB); needs >= "
        f"{math.ceil(need / total * 100) / 100:.2f}"]
    lines = [Line("vllm", "profile run (inside the reserve)", profile, how)]  # a phase no total adds: in the reserve
    if slots:
        lines.append(Line("vllm", "LoRA slot (inside the reserve)", slots, slots_how))
    return reserve, lines, problems, [] if problems else [vllm_concurrency(cfg, z, reserve - weights - profile, kv)]


def vllm_lora_slot_bytes(cfg, z: Sizes, vb: int) -> tuple[float, str]:
    """(bytes, how) vLLM preallocates for adapters under peft.sync=adapter: one slot (max_loras 1) of max_lora_rank (the
    smallest allowed rank >= peft.rank) on every linear layer, A and B, in the engine's dtype (vLLM's LoRA layers'
    lora_a_stacked / lora_b_stacked); nothing without an adapter in the engine."""
    if not z.lora_rank or str((cfg.get("peft") or {}).get("sync", "adapter")) != "adapter":
        return 0.0, ""
    from grail_exp.models.lora import engine_max_rank

    r = engine_max_rank(z.lora_rank)
    n = lora_parameters(z.shape, r)
    return n * vb, f"max_loras 1 x max_lora_rank {r} x sum(in + out) of every linear layer = {n:,} x {vb} B"


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
        return _sync_lines(cfg, z, "rollout")
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
        return _sync_lines(cfg, z, "eval")
    ev = cfg.eval
    per_call = max(1, int(ev.batch_size) // int(ev.n))
    rows = per_call * int(ev.n)
    Pe = benchmark_prompt_tokens(cfg.benchmark.names)
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
    held = "fp32" if z.adapters_fp32 else f"{m.dtype}, fp32 masters where the strategy keeps them"
    peft = {"peft": f"lora, rank {z.lora_rank}: {z.n_adapter / 1e6:.1f} M adapter parameters ({held}) on a frozen base"} \
        if z.lora_rank else {}
    return {"model": f"{z.shape.name} ({z.n / 1e9:.2f} B parameters, {m.dtype})", **peft,
            "strategy": f"{z.backend.memory_layout(cfg, z.world)}, {z.world} device(s)",
            "micro-batch": f"{z.rows} rows x ({z.P} prompt + {z.C} completion) tokens", "engine": engine + sampling,
            "checkpointing": bool(m.get("gradient_checkpointing")),
            "logprob_chunk_tokens": int(cfg.trainer.logprob_chunk_tokens)}


_SYNC_HOW = ("rollout.vllm.sync_chunk_mb of full parameters gathered and cast to the engine's dtype (a larger tensor, "
             "the embedding, alone)")


def _sync_lines(cfg, z: Sizes, phase: str) -> list[Line]:
    """What a weight sync to vLLM holds beyond the model. Full fine-tuning: one chunk (``_sync_chunk_bytes``).
    peft=lora, sync=adapter: the adapter's copy handed to the engine (the base travels once, as a chunk);
    sync=merged: one targeted layer merged in fp32 (its base weight's fp32 copy, B A and their sum, the largest an
    MLP projection h x i) beside the chunk of merged tensors."""
    sync = _sync_chunk_bytes(cfg, z)
    if z.lora_rank and str(cfg.peft.get("sync", "adapter")) == "adapter":
        adapter = float(z.adapter_bytes * z.n_adapter)
        return [Line(phase, "weight sync: the adapter (the base once, a chunk)", max(adapter, sync),
                     f"max(the adapter's copy {z.adapter_bytes} B x {z.n_adapter:,}, one chunk of the base's one push)")]
    if z.lora_rank:
        layer = 3 * 4 * z.shape.hidden * z.shape.intermediate
        chunk = max(sync, float(cfg.rollout.vllm.get("sync_chunk_mb", 256) or 256) * 2**20)
        return [Line(phase, "weight sync: merging one layer + a chunk", layer + chunk,
                     f"3 x 4 B x h x i (W in fp32, B A, their sum) + {_SYNC_HOW}")]
    return [Line(phase, "weight sync: one chunk in flight", sync, _SYNC_HOW)] if sync else []


def _sync_chunk_bytes(cfg, z: Sizes) -> float:
    """Bytes a weight sync to vLLM holds beyond the model: one chunk (or the largest tensor, V x h) in the engine's
    dtype — when sharded parameters are gathered or the engine's dtype differs from the model's (else the live
    tensors are pushed as they are: 0)."""
    r, m = cfg.rollout, cfg.model
    vdtype = r.vllm.get("dtype") or m.dtype
    if not z.backend.shards_parameters and str(vdtype) == str(m.dtype):
        return 0.0
    chunk = float(r.vllm.get("sync_chunk_mb", 256) or 256) * 2**20
    return max(chunk, z.shape.vocab * z.shape.hidden * dtype_bytes(vdtype))


# Host memory of a CPU run beyond its tensors, measured on this project's machines (docs/memory-planner.md): the
# imported libraries (torch, transformers, Lightning, Hydra, MLflow: ~0.6 GiB of resident pages) and each grading
# worker process (math-verify and sympy, ~0.15 GiB).
HOST_BASELINE = 0.6 * GiB


GRADER_WORKER = 0.15 * GiB


HOST_HEADROOM_FIXED = 0.5 * GiB  # heap fragmentation between phases (grail_exp/compute/host.py returns what it can)


def host_capacity() -> tuple[float | None, float | None, str]:
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
        vb = dtype_bytes(cfg.rollout.vllm.get("dtype") or cfg.model.dtype)
        T = benchmark_prompt_tokens([cfg.data.name]) + few_shot_tokens(cfg.model) + int(cfg.rollout.max_completion_length)
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
    L = dtype_bytes((B.policy_overrides(cfg).get("model") or {}).get("dtype", cfg.model.dtype))
    tensor = s.vocab * s.hidden
    ref = needs_reference(cfg) and not z.lora_rank  # under peft=lora the reference is the policy's base
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
    if z.lora_rank:  # the checkpoint's parts hold the adapter's state (fp32, no masters); the base comes from the start
        parts = [p._replace(how=f"the adapter's state, {z.n_adapter:,} elements of {z.adapter_bytes} B in the strategy's "
                            "layout, + the optimiser's one storage at a time") if p.bytes else p
                 for p in (B.planned_checkpoint_shard(cfg, z.n_adapter, z.adapter_bytes, W, r, 0) for r in range(R))]
        holds = False
        export = 4 * tensor if cfg.peft.get("export_merged") else 0.0  # merged/: one merged fp32 tensor at a time
    else:
        parts = [B.planned_checkpoint_shard(cfg, n, b, W, r, tensor) for r in range(R)]
        holds = B.checkpoint_holds_weights(cfg)
        # Sharded weights: rank 0 streams the full Hugging Face export in the model's dtype, one gathered tensor at a
        # time, into the final checkpoint (every checkpoint with trainer.export_hf_weights=every): the row's peak.
        t = cfg.trainer
        exported = t.get("save_final_checkpoint", True) or t.get("export_hf_weights", "final") == "every"
        export = b * tensor if holds and exported else 0.0
    staged = sum(p.bytes for p in parts)
    writers = f"{R} ranks" if parts[-1].bytes else "rank 0"
    exported_as = "4 B (the merged fp32 tensor)" if z.lora_rank else f"b {b} B"
    lines.append(Line("host: checkpoint", "what the writing ranks hold at once", staged + export,
                      f"{writers}: {parts[0].how}" + (" (others: " + parts[-1].how + ")" if parts[-1].how != parts[0].how
                                                       else "") + (f", + rank 0's export, one gathered {exported_as} x V"
                                                                   " x h tensor at a time" if export else "")))
    ref = ref and not z.lora_rank  # under peft=lora the reference is the policy's base: nothing more to read
    outside = ([] if holds else ["the policy N x L"]) + (["the reference N x b"] if ref else [])
    weights = (0.0 if holds else copies * n * L) + (copies * n * b if ref else 0.0)
    lines.append(Line("host: resume", "the parts read back, or the weights", max(staged, weights),
                      f"max(the parts read back (memory-mapped, placed one at a time) {staged / GiB:.2f} GiB, the "
                      f"weights read as at load that the parts do not carry ({' + '.join(outside) or 'none'}) "
                      f"{weights / GiB:.2f} GiB)"))
    return lines


def planned_mem_gb(cfg) -> int | None:
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


def dist_timeout(cfg) -> timedelta:
    """The timeout of every process group the run creates: ``trainer.dist_timeout_s``, or (null) what the planned
    checkpoint write needs (``needed_dist_timeout``); handed to ``distributed.build_strategy`` by the job."""
    seconds = cfg.trainer.get("dist_timeout_s")
    if seconds is None:
        seconds, _ = needed_dist_timeout(cfg)
    return timedelta(seconds=int(seconds))


def planned_step_seconds(cfg) -> tuple[float, str]:
    """(seconds, how): the longest a stop request waits on one rank before the checkpoint — a round's rollout (the
    generation and the no-grad log-prob passes over every row of the rank at the full token budget) and then one
    optimiser step (forward and backward over its mini-batch, the forward again under gradient checkpointing) — each
    pass 2 x N FLOPs per token, at ``timeouts.PLANNED_STEP_FLOPS_PER_S`` of the accelerator."""
    from grail_exp.loss import needs_reference
    from grail_exp.timeouts import PLANNED_STEP_FLOPS_PER_S

    z, t = sizes(cfg), cfg.trainer
    rows = max(1, t.prompts_per_step * cfg.rollout.num_generations // z.world)
    tokens = rows * z.T
    rollout = 2 + (1 if needs_reference(cfg) else 0)  # generation, old log-probs, the reference's
    passes = 3 + (1 if cfg.model.get("gradient_checkpointing") else 0)  # forward + backward (+ the replayed forward)
    update = passes / max(1, int(t.get("mini_batches_per_rollout", 1)))  # one optimiser step: 1/k of the rows
    rate = PLANNED_STEP_FLOPS_PER_S["cpu" if z.cpu else "gpu"]
    seconds = 2 * z.n * tokens * (rollout + update) / rate
    return seconds, (f"2 x N {z.n:,} x {rows} rows x {z.T} tokens x ({rollout} rollout passes + {update:g} of an "
                     f"optimiser step's) / {rate / 1e12:g} TFLOP/s")


def stop_lead(cfg) -> tuple[int, str]:
    """(seconds, how): how long before a SLURM job's time limit its stop signal must come for the job to finish its
    step and write its checkpoint (grail_exp/timeouts.py ``stop_lead``); an architecture the planner does not know gets
    the floor."""
    from grail_exp.timeouts import STOP_LEAD_FLOOR_S
    from grail_exp.timeouts import stop_lead as rule

    try:
        step, how = planned_step_seconds(cfg)
        params = model_shape(cfg.model).params
    except PlanError:
        return STOP_LEAD_FLOOR_S, f"the floor {STOP_LEAD_FLOOR_S} s (the model's size is unknown)"
    seconds, lead = rule(step, params)
    return seconds, f"{lead}; step: {how}"


def timeout_lines(cfg) -> list[str]:
    """The plan's "timeouts needed" line: what the planned checkpoint needs against what the run sets."""
    need, how = needed_dist_timeout(cfg)
    configured = cfg.trainer.get("dist_timeout_s")
    now = f"null (= {need} s)" if configured is None else f"{configured} s" + (
        ", BELOW the need" if configured < need else "")
    return [f"timeouts needed: trainer.dist_timeout_s >= {need} s (set: {now}) = {how}"]
