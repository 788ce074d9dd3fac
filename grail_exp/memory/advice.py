"""What the memory planner says about a plan: the table (``render``), the warning when it is tight, the refusal and
the overrides that would fit (``suggest``: each family of strategy and size changes tried mildest first, recomposed by
``replan`` from the run's config as Hydra would), and ``check``, which ``validate.py`` calls. docs/memory-planner.md.
"""

from __future__ import annotations

import math

from grail_exp.memory.plan import HOST_MARGIN, MemoryPlan, backend_of, device_capacity, plan
from grail_exp.memory.shapes import (
    PLAN_ERROR,
    GiB,
    PlanError,
    benchmark_prompt_tokens,
    configured_world_size,
    dtype_bytes,
    model_shape,
    vllm_profile_bytes,
)


# ---------------------------------------------------------------------------------------------- what would fit
def _vllm_need(cfg, rows: int) -> float:
    """gpu_memory_utilization that holds the engine's weights, its profile and the KV cache of ``rows`` sequences."""
    s, m, r = model_shape(cfg.model), cfg.model, cfg.rollout
    _, total, _ = device_capacity(cfg)
    vb = dtype_bytes(r.vllm.get("dtype") or m.dtype) if r.get("vllm") else dtype_bytes(m.dtype)
    T = benchmark_prompt_tokens([cfg.data.name]) + int(r.max_completion_length)
    need = s.params * vb + vllm_profile_bytes(cfg, s)[0] + s.kv_bytes_per_token * vb * T * rows
    return math.ceil(need / total * 100) / 100 if total else 1.0


VLLM_SUGGESTED_SEQUENCES = 16  # a suggested vLLM fraction leaves KV room for this many sequences at once


def _families(cfg) -> tuple[list[list[list[str]]], list[list[str]]]:
    """(ways to shrink the plan on the same engine, each a list of override sets from the mildest to the strongest,
    cheapest first; switches of the engine, and of full fine-tuning to LoRA adapters)."""
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
    fam += backend_of(cfg).shard_options(cfg, configured_world_size(t))  # the strategy's own: shard more, or over more ranks
    if str((cfg.get("peft") or {}).get("name", "none")) != "lora" and str(t.accelerator) != "cpu":
        engines.append(["peft=lora"])  # train adapters on the frozen base: another method, said as a last switch
    return [f for f in fam if f], engines


def replan(cfg, overrides: list[str]):
    """``cfg`` with ``key=value`` and group overrides applied as on the run's command line, as a new config: where
    Hydra composed this process's config, the run's recorded overrides and these composed by Hydra from scratch;
    elsewhere, a group switch offered by ``suggest`` (``trainer=fsdp_zero2``, ``rollout=hf``) is the option's file as
    Hydra composes it, under what the run set on top of its group (``grail_exp/memory/recompose.py``)."""
    from grail_exp.memory.recompose import apply_overrides, recompose, recorded_overrides

    recorded = recorded_overrides()
    if recorded is not None:
        try:
            return recompose(recorded, overrides)
        except Exception:  # noqa: BLE001  (an override Hydra cannot compose from scratch: the composed config's way)
            pass
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
    for e in engines:  # the engine switch replaces the vLLM fraction fix; the switch to LoRA keeps it
        e = base + e if e == ["peft=lora"] else e
        if _fits(cfg, e, margin):
            options.append(e)
    return options


def _combined(cfg, base: list[str], fams: list, margin: bool) -> list[str] | None:
    """Each family at its strongest until the plan fits, then each relaxed back to its mildest strength (or none)
    that still fits, the costlier families (micro-batch) before the chunk size; None when even all together do not."""
    chosen: list[list[str] | None] = []
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


def tight_warning(cfg, p: MemoryPlan) -> str | None:
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


def check(cfg) -> str | None:
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
