"""``python -m grail_exp.bench bench.mode=real``: N real training steps of an experiment, phase by phase, against this
machine's arithmetic floor.

    python -m grail_exp.bench bench.mode=real experiment=real/smollm2_grpo bench.steps=5 bench.schemes=[grpo,grail,oar_g]
    python -m grail_exp.bench bench.mode=real experiment=real/smollm2_grpo rollout=vllm      # vLLM's CPU build: .venv-vllm
    python -m grail_exp.bench bench.mode=real experiment=real/smollm2_grpo 'bench.variants={lora: [peft=lora]}'  # + LoRA rows

``bench.variants`` (name -> overrides) adds each scheme once more per variant, as the row ``<scheme>+<variant>``: the
same experiment with those overrides (``{lora: [peft=lora]}``: LoRA adapters on the frozen base against full
fine-tuning, the same batch, micro-batches and sampling).

Each scheme runs in a fresh process (so its peak memory is its own): the experiment's own parts (model, engine,
verifier, data) and trainer code (``RolloutPhase.collect``, ``UpdatePhase.optimizer_steps``), ``bench.steps``
optimiser steps from the experiment's start, with no evaluation and no logging. Per step it records the wall and CPU
time of each phase (``rollout`` = generation, ``scoring``, ``old_logp``, ``scheme``, ``update`` = forward + backward +
optimiser), the tokens (distinct prompts' tokens, completion tokens), the token efficiency (real tokens / positions the
update's forwards computed), the reward and loss. Medians are over the steps after ``bench.skip`` (the first pays for
allocator and kernel warm-up); peak RSS (or CUDA memory) is the process's over all steps.

The floor: this machine's matmul throughput, measured in the process at the run's thread count and the model's dtype
(best of 5 products of two 2048² matrices, before and again after the steps), times the step's matmul FLOPs with each distinct prompt counted once —
generation (prefill of the distinct prompts, one forward per generated token), the update (forward + backward = 3x
the forward over the distinct prompts and the completions, plus the output layer), the old-log-prob forward, GRAIL's
probe (one input-gradient backward over the completions) and OAR-G's noisy pass (a forward and an input-gradient
backward); attention scores counted for the positions each token attends to. ``floor_ratio`` = step time / floor.

``bench.profile=<dir>``: after the timed steps, one more step per scheme under the torch profiler, the generation and
the update apart (its overhead slows it, so it is not a timed step): ``<row>_<phase>_ops.txt`` (ops by self time)
and ``<row>_<phase>_matmuls.txt`` (each matrix-product shape: calls, time, achieved GFLOP/s), and under the table
the share of each phase's op time spent in matrix products and their throughput — what separates "the products are
slow at these shapes" from "the time is outside the products".

This file drives any checkout's trainer: ``PYTHONPATH=<checkout> python <this file> ...`` times that checkout's code with
this driver (the before / after tables of results/bench_real_model.md); trainer metrics a checkout lacks (computed
positions) are counted from the batch instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("grail_exp.bench")
PHASES = ("rollout", "weight_sync", "scoring", "scheme_prepare", "old_logp", "scheme", "update")


# ------------------------------------------------------------------------------------------------ one scheme
def rows_of(schemes: list[str], variants: dict | None) -> dict[str, tuple[str, list[str]]]:
    """The table's rows: each scheme as the experiment composes it, then each scheme under each of ``bench.variants``
    (name -> extra overrides, e.g. ``{lora: [peft=lora]}``) as ``<scheme>+<variant>``: row -> (scheme, overrides)."""
    rows = {name: (name, []) for name in schemes}
    for variant, extra in (variants or {}).items():
        rows.update({f"{name}+{variant}": (name, [str(o) for o in extra]) for name in schemes})
    return rows


def run_scheme(overrides: list[str], scheme: str, steps: int, threads: int | None, profile: str | None = None,
               row: str | None = None) -> dict:
    """``steps`` real training steps of ``scheme`` (in this process): per-step records, the floor and the peak; with
    ``profile`` (a directory), one more step under the torch profiler, phase by phase (``profile_step``), its files
    named after the table's ``row`` (``grpo+lora``; default the scheme)."""
    _set_threads(threads)
    cfg, module, parts, (opt, sched) = _build(overrides, scheme)
    shape = _shape(parts.policy)
    gflops = matmul_gflops(parts.policy)
    records = []
    try:
        for r in range(steps):
            records.append(_one_step(module, opt, sched, r, shape, scheme))
            _log_step(scheme, r, records[-1])
        peak = _peak_bytes()  # the timed steps' (the profiler holds its events in memory)
        # the machine's rate is what it can do: on a shared host one measurement can land in another tenant's burst
        # (2x lower seen here), so the best of one before and one after the steps
        gflops = max(gflops, matmul_gflops(parts.policy))
        profiled = profile_step(module, opt, sched, steps, shape, scheme, Path(profile), row) if profile else None
    finally:
        parts.verifier.close()
        shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)  # the run's folder: nothing in it is kept
    return _result(cfg, parts, shape, records, gflops, peak_memory_gb=peak / 1e9, profile=profiled)


def run_paired(overrides: list[str], schemes, steps: int, threads: int | None) -> dict:
    """``bench.paired``: every scheme built in this one process, their steps taken in turn, round by round, the order
    rotating each round (ABC, BCA, CAB, ...): scheme k's step r runs minutes, not a process apart, from the others'
    step r, so a ratio of the two sees the same machine (this host drifts ±20 % between processes). Per scheme the
    records of ``run_scheme``; the peak memory is the process's, of all schemes together (``None`` per scheme).
    ``schemes``: names, or ``rows_of``'s row -> (scheme, extra overrides)."""
    _set_threads(threads)
    rows = schemes if isinstance(schemes, dict) else {name: (name, []) for name in schemes}
    schemes = list(rows)
    built = {name: _build([*overrides, *rows[name][1]], rows[name][0]) for name in schemes}
    shapes = {name: _shape(b[2].policy) for name, b in built.items()}
    first = built[schemes[0]][2].policy
    gflops = matmul_gflops(first)
    records: dict[str, list] = {name: [] for name in schemes}
    try:
        for r in range(steps):
            for name in schemes[r % len(schemes):] + schemes[:r % len(schemes)]:
                cfg, module, parts, (opt, sched) = built[name]
                records[name].append(_one_step(module, opt, sched, r, shapes[name], rows[name][0]))
                _log_step(name, r, records[name][-1])
        gflops = max(gflops, matmul_gflops(first))
    finally:
        for cfg, _, parts, _ in built.values():
            parts.verifier.close()
            shutil.rmtree(cfg.paths.output_dir, ignore_errors=True)
    peak = _peak_bytes()
    return {name: _result(cfg, parts, shapes[name], records[name], gflops, peak_memory_gb=None,
                          process_peak_memory_gb=peak / 1e9)
            for name, (cfg, _, parts, _) in built.items()}


def _result(cfg, parts, shape: dict, records: list, gflops: float, **extra) -> dict:
    """One scheme's result: its step records with the floor added, and what the run ran on."""
    import torch

    _add_floor(records, gflops)
    return {"records": records, "matmul_gflops": gflops, "threads": torch.get_num_threads(),
            "device": str(parts.policy.device), "model": dict(shape), "engine": str(cfg.rollout.engine),
            "micro_batch_size": int(cfg.trainer.micro_batch_size), "profile": None, **extra}


def paired_ratios(results: dict, skip: int, baseline: str) -> dict:
    """Per scheme, its step time over the baseline's in the same round, for the rounds after ``skip``: the median and
    the range of those ratios (``run_paired``'s rounds), and of the update's (update + scheme) alone."""
    if baseline not in results:
        return {}
    base = results[baseline]["records"]
    out = {}
    for name, res in results.items():
        pairs = list(zip(res["records"], base))[skip:] or list(zip(res["records"], base))
        step = [a["step_s"] / b["step_s"] for a, b in pairs]
        update = [(a["update_s"] + a["scheme_s"]) / (b["update_s"] + b["scheme_s"]) for a, b in pairs]
        out[name] = {"step_ratio": statistics.median(step), "step_ratio_range": [min(step), max(step)],
                     "update_ratio": statistics.median(update), "update_ratio_range": [min(update), max(update)]}
    return out


def _set_threads(threads: int | None) -> None:
    import torch

    if threads:
        os.environ["GRAIL_EXP_BENCH_THREADS"] = str(threads)  # bench.threads wins over trainer.num_threads
        torch.set_num_threads(int(threads))


def _log_step(scheme: str, r: int, record: dict) -> None:
    log.info("bench real %s step %d: %s", scheme, r + 1, {k: round(v, 3) for k, v in record.items()
                                                          if isinstance(v, float)})


def _add_floor(records: list, gflops: float) -> None:
    for rec in records:
        rec["floor_s"] = rec["flops"] / (gflops * 1e9)
        rec["floor_ratio"] = rec["step_s"] / rec["floor_s"]


def _build(overrides: list[str], scheme: str):
    """The experiment's parts and an ``RLVRModule`` driven without Lightning (as ``bench`` does)."""
    import lightning as L
    import torch
    from hydra import compose, initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.job import build_parts
    from grail_exp.tracking import NullTracker
    from grail_exp.training.module import RLVRModule
    from grail_exp.validate import validate

    register_configs()
    out_dir = tempfile.mkdtemp(prefix="bench_real_")
    fixed = [f"advantage={scheme}", "logger=none", f"paths.output_dir={out_dir}", "trainer.weights_table_every=0",
             "trainer.sample_table_every=0", "trainer.eval_before_training=false", "trainer.eval_at_end=false"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = validate(compose(config_name="config", overrides=[*overrides, *fixed]))
    if cfg.trainer.get("num_threads") and not os.environ.get("GRAIL_EXP_BENCH_THREADS"):
        torch.set_num_threads(int(cfg.trainer.num_threads))
    L.seed_everything(cfg.seed, verbose=False)
    parts = build_parts(cfg, None, None, NullTracker(), {}, time.perf_counter())
    if str(cfg.trainer.accelerator) == "gpu" and torch.cuda.is_available():  # where Lightning would put them
        parts.policy.to("cuda")
        if parts.ref_model is not None:
            parts.ref_model.to("cuda")
    engine = parts.engine_factory()  # one process, no process group: the engine is built here, as setup() would
    parts.engine = engine
    module = RLVRModule(cfg, parts, NullTracker())
    module.manual_backward = lambda loss: loss.backward()  # no Lightning trainer here
    module.backend.configure_model(parts.policy)
    (opt,), (sched,) = module.configure_optimizers()
    return cfg, module, parts, (opt, sched["scheduler"])


def _one_step(module, opt, sched, round_index: int, shape: dict, scheme: str, phase=None) -> dict:
    """One rollout batch and its optimiser steps: phase times, tokens, reward, loss. ``phase(name)``: a context
    manager around the generation ("generation") and the update ("update"), e.g. a profiler."""
    phase = phase or (lambda name: contextlib.nullcontext())
    timings: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    module.progress.rollouts = round_index + 1
    with phase("generation"):
        batch, stats = module.rollout.collect(round_index, timings)
    losses, metrics = [], {}
    with phase("update"):
        for _, metrics in module.update.optimizer_steps(batch, opt, sched, 0, timings):
            module.progress.step += 1
            losses.append(metrics["loss"])
    rec = {"step_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    rec.update({f"{k}_s": float(timings.get(k, 0.0)) for k in PHASES})
    tokens = batch_tokens(batch)
    rec.update(tokens)
    rows, width = batch.input_ids.shape
    computed = metrics.get("tokens/computed_positions", float(rows * width))  # a checkout without it: every column
    rec["computed_positions"] = float(computed)
    rec["token_efficiency"] = tokens["update_tokens"] / max(computed, 1.0)
    rec["reward"] = float(stats["reward/mean"])
    rec["loss"] = float(losses[-1]) if losses else float("nan")
    rec["losses"] = [float(x) for x in losses]
    from grail_exp.models import lora

    rec["flops"] = step_flops(shape, batch, scheme, old_logp=batch.old_logp is not None,
                              frozen_base=lora.enabled(module.cfg))
    return rec


def batch_tokens(batch) -> dict:
    """Real tokens of a rollout batch: each distinct prompt once, every completion token."""
    import torch

    P = batch.prompt_length
    prompts = torch.unique(torch.where(batch.attention_mask[:, :P].bool(), batch.input_ids[:, :P], -1), dim=0)
    prompt_tokens = float((prompts >= 0).sum())
    completion_tokens = float(batch.attention_mask[:, P:].sum())
    return {"prompts": float(prompts.shape[0]), "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "update_tokens": prompt_tokens + completion_tokens}


# ------------------------------------------------------------------------------------------------ the profile
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def matmul_flops(op: str, shapes: list) -> float:
    """FLOPs of one call of a matrix-product op from its input shapes (2 per multiply-add); 0 for anything else:
    mm [[M, K], [K, N]], addmm [[bias], [M, K], [K, N]], bmm [[b, M, K], [b, K, N]], baddbmm [[..], [b, M, K], [b, K, N]]."""
    if op not in MATMUL_OPS:
        return 0.0
    a, b = (shapes[1], shapes[2]) if op in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    if len(a) < 2 or len(b) < 2:
        return 0.0
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def profile_step(module, opt, sched, round_index: int, shape: dict, scheme: str, out_dir: Path,
                 row: str | None = None) -> dict:
    """One more step under the torch profiler (CPU op times; its own overhead makes it slower, so it is not one of the
    timed steps), generation and update profiled apart. Writes ``<row>_<phase>_ops.txt`` (ops by self time) and
    ``<row>_<phase>_matmuls.txt`` (each product shape: calls, time, achieved GFLOP/s) into ``out_dir`` (``row``: the
    table's row, ``grpo+lora``; default the scheme); returns per phase the ops' self time, the products' time and share,
    and their achieved throughput."""
    from torch.profiler import ProfilerActivity, profile

    profilers = {}

    @contextlib.contextmanager
    def phase(name):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            yield
        profilers[name] = p

    rec = _one_step(module, opt, sched, round_index, shape, scheme, phase=phase)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"step_s": rec["step_s"]}
    for name, p in profilers.items():
        events = p.key_averages(group_by_input_shape=True)
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        rows = sorted(((e.key, e.input_shapes, e.count, e.self_cpu_time_total / 1e6,
                        matmul_flops(e.key, e.input_shapes) * e.count) for e in events if e.key in MATMUL_OPS),
                      key=lambda r: -r[3])
        mm_s, mm_flops = sum(r[3] for r in rows), sum(r[4] for r in rows)
        summary[name] = {"ops_s": total, "matmul_s": mm_s, "matmul_share": mm_s / total if total else 0.0,
                         "matmul_gflops": mm_flops / mm_s / 1e9 if mm_s else 0.0}
        (out_dir / f"{row or scheme}_{name}_ops.txt").write_text(
            p.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        (out_dir / f"{row or scheme}_{name}_matmuls.txt").write_text("\n".join(
            ["| op | input shapes | calls | self s | GFLOP/s |", "|---|---|--:|--:|--:|"]
            + [f"| {k} | {s} | {n} | {t:.3f} | {f / t / 1e9 if t else 0:.0f} |" for k, s, n, t, f in rows[:40]]) + "\n")
        log.info("bench real %s profile, %s: ops %.2f s, matrix products %.2f s (%.0f %%) at %.0f GFLOP/s", row or scheme,
                 name, total, mm_s, 100 * summary[name]["matmul_share"], summary[name]["matmul_gflops"])
    return summary


# ------------------------------------------------------------------------------------------------ the floor
def _shape(policy) -> dict:
    c = policy.config
    heads = int(c.num_attention_heads)
    d = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    return {"layers": int(c.num_hidden_layers), "hidden": int(c.hidden_size), "intermediate": int(c.intermediate_size),
            "heads": heads, "kv_heads": int(getattr(c, "num_key_value_heads", heads)), "head_dim": d,
            "vocab": int(c.vocab_size)}


def step_flops(s: dict, batch, scheme: str, old_logp: bool, frozen_base: bool = False) -> float:
    """Matmul FLOPs of one step with each distinct prompt counted once (module docstring); the scheme's own passes over
    the completions are its ``planned_completion_passes`` (``grail_exp/advantages/base.py``). ``frozen_base``
    (peft=lora): the update's backward computes the input gradients only (2x the forward instead of 3x: the adapters'
    own products are < 1 % of the decoder's at rank 32 and left out)."""
    import torch

    h, i, L, H, kv, d, V = (s[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"))
    per_token = 2 * L * (h * H * d + 2 * h * kv * d + H * d * h + 3 * h * i)  # the decoder's weight matmuls
    attend = 4 * L * H * d  # per (query, key) pair: the score and the weighted value
    P = batch.prompt_length
    pm = batch.attention_mask[:, :P].bool()
    _, first = torch.unique(torch.where(pm, batch.input_ids[:, :P], -1), dim=0, return_inverse=True)
    reps = torch.zeros(int(first.max()) + 1, dtype=torch.long).scatter_(0, first.cpu(), torch.arange(first.numel()))
    p_len = pm.sum(1).cpu().double()
    c_len = batch.attention_mask[:, P:].sum(1).cpu().double()
    prompt_fwd = float(sum(p_len[r] * per_token + p_len[r] ** 2 / 2 * attend for r in reps.tolist()))
    comp_fwd = float((c_len * per_token + (c_len * p_len + c_len ** 2 / 2) * attend + 2 * c_len * V * h).sum())
    generation = prompt_fwd + comp_fwd + 2 * V * h * len(reps)
    forward = prompt_fwd + comp_fwd
    total = generation + (2 if frozen_base else 3) * forward + (forward if old_logp else 0.0)
    from grail_exp.advantages import SCHEMES

    # what the scheme adds over the completions (a probe's backward, a second pass); 0 where a checkout lacks the answer
    return total + getattr(SCHEMES.get(scheme), "planned_completion_passes", 0) * comp_fwd


def matmul_gflops(policy, n: int = 2048, repeats: int = 5) -> float:
    """This process's matmul throughput (GFLOP/s) in the model's dtype on its device: the best of ``repeats``
    products of two n x n matrices after one warm-up."""
    import torch

    p = next(policy.parameters())
    a = torch.randn(n, n, dtype=p.dtype, device=p.device)
    b = torch.randn(n, n, dtype=p.dtype, device=p.device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        if p.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if p.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def _peak_bytes() -> float:
    import torch

    from grail_exp.compute.host import peak_resident_bytes

    if torch.cuda.is_available():
        return float(torch.cuda.max_memory_allocated())
    return float(peak_resident_bytes())


# ------------------------------------------------------------------------------------------------ the table
def summarize(result: dict, skip: int) -> dict:
    """Medians over the steps after the first ``skip`` (all of them when there are no others)."""
    recs = result["records"][skip:] or result["records"]
    keys = [k for k, v in recs[0].items() if isinstance(v, float)]
    out = {k: statistics.median(r[k] for r in recs) for k in keys}
    out.update({k: result[k] for k in ("matmul_gflops", "peak_memory_gb", "threads", "engine", "micro_batch_size")})
    out["rewards"] = [r["reward"] for r in result["records"]]
    out["losses"] = [r["loss"] for r in result["records"]]
    return out


def table_markdown(columns: list[str], aligns: str, rows: list[list]) -> str:
    """The bench's Markdown tables: a heading per column, ``aligns`` one letter per column (``l`` left, ``r`` right:
    numbers), then ``rows``, each a list of cells (``""`` an empty cell; an error row may stop early)."""
    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    rule = "|" + "|".join("--:" if a == "r" else "---" for a in aligns) + "|"
    return "\n".join([line(columns), rule, *(line(r) for r in rows)])


def steps_table(summaries: dict, baseline: str = "grpo", paired: dict | None = None) -> str:
    """The table of ``bench.mode=real``; ``paired`` (``paired_ratios``): the last column is the median of the per-round
    ratios with their range, and an update column of the same kind follows."""
    base = summaries.get(baseline, {})
    columns = ["scheme", "engine", "step s", "generation s", "update s", "scoring s", "tokens / step", "token eff.",
               "peak GB", "floor s", "step / floor", f"step / {baseline}"] + ([f"update / {baseline}"] if paired else [])
    rows = []
    for name, r in summaries.items():
        if "error" in r:
            rows.append([name, f"error: {r['error']}"] + [""] * (len(columns) - 2))
            continue
        update = r["update_s"] + r["scheme_s"] + r["old_logp_s"] + r["scheme_prepare_s"]
        if paired and name in paired:
            q = paired[name]
            ratios = [f"{q['step_ratio']:.2f}x ({q['step_ratio_range'][0]:.2f}–{q['step_ratio_range'][1]:.2f})",
                      f"{q['update_ratio']:.2f}x ({q['update_ratio_range'][0]:.2f}–{q['update_ratio_range'][1]:.2f})"]
        else:
            ratios = [f"{r['step_s'] / base['step_s']:.2f}x" if base.get("step_s") else "—"]
        peak = f"{r['peak_memory_gb']:.2f}" if r.get("peak_memory_gb") is not None else "—"
        rows.append([name, r["engine"], f"{r['step_s']:.2f}", f"{r['rollout_s']:.2f}", f"{update:.2f}",
                     f"{r['scoring_s']:.2f}", f"{r['update_tokens']:.0f}", f"{r['token_efficiency']:.2f}", peak,
                     f"{r['floor_s']:.2f}", f"{r['floor_ratio']:.1f}x", *ratios])
    return table_markdown(columns, "ll" + "r" * (len(columns) - 2), rows)


def profile_lines(results: dict) -> str:
    """The profiled step of each scheme (``bench.profile``), a line per phase under the table."""
    lines = []
    for name, res in results.items():
        for phase, p in ((res.get("profile") or {}).items()):
            if isinstance(p, dict):
                lines.append(f"- {name}, {phase} (profiled step): ops {p['ops_s']:.2f} s, matrix products "
                             f"{p['matmul_s']:.2f} s ({100 * p['matmul_share']:.0f} %) at {p['matmul_gflops']:.0f} GFLOP/s")
    return ("\n\n" + "\n".join(lines)) if lines else ""


def main(bench, overrides: list[str], argv: list[str]) -> dict:
    """Every scheme of ``bench.schemes`` in its own process, one after the other; ``bench.paired``: all in one process,
    step by step in turn (``run_paired``)."""
    results, summaries, paired = {}, {}, None
    rows = rows_of(list(bench.schemes), _variants(bench))
    if bench.get("paired"):
        results = in_own_process(_run_paired_logged, overrides, rows, int(bench.steps), bench.get("threads"))
        summaries = {name: summarize(res, int(bench.skip)) for name, res in results.items()}
        paired = paired_ratios(results, int(bench.skip), bench.baseline)
        for name, q in paired.items():
            summaries[name].update(q)
    else:
        for name, (scheme, extra) in rows.items():
            try:
                results[name] = in_own_process(_run_scheme_logged, [*overrides, *extra], scheme, int(bench.steps),
                                               bench.get("threads"), bench.get("profile"), name)
                summaries[name] = summarize(results[name], int(bench.skip))
            except Exception as exc:  # one scheme's failure is a row of the table, not the end of the run
                log.exception("bench real: scheme %s failed", name)
                summaries[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            log.info("bench real %s: %s", name, summaries[name])
    table = steps_table(summaries, bench.baseline, paired=paired) + profile_lines(results)
    if paired:
        peak = next(iter(results.values()))["process_peak_memory_gb"]
        table += (f"\n\nPaired: all schemes in one process (peak RSS {peak:.2f} GB for all of them together), step r of "
                  "each taken in turn; the ratios are medians (ranges) over the rounds after the first.")
    print(table, flush=True)
    payload = {"schemes": summaries, "steps": results, "command": "python -m grail_exp.bench " + " ".join(argv),
               "load": _load()}
    write_outputs(bench, payload, f"load: {payload['load']}", table)
    return payload


def _variants(bench) -> dict:
    from omegaconf import OmegaConf

    v = bench.get("variants")
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else dict(v or {})


def write_outputs(bench, payload: dict, context: str, table: str) -> None:
    """``json=``: the whole payload; ``markdown=``: the command line, one line of context and the table. Both are
    records that get committed: every absolute path in them (the command's ``json=/tmp/...``, a model directory) is
    written relative to the project or with its machine-specific head named (grail_exp/analysis/portable.py)."""
    from grail_exp.analysis.portable import portable_text

    if bench.json:
        Path(bench.json).parent.mkdir(parents=True, exist_ok=True)
        Path(bench.json).write_text(portable_text(json.dumps(payload, indent=2)))
    if bench.markdown:
        Path(bench.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(bench.markdown).write_text(portable_text(f"`{payload['command']}`\n\n{context}\n\n{table}\n"))


def in_own_process(fn, *args):
    """``fn(*args)`` in a fresh spawned process (its peak memory is its own); ``fn`` importable at module level. A
    plain, non-daemonic process: a run starts processes of its own (the grading workers), which a pool's daemonic
    workers may not."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, fn, args))
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        ok, value = False, f"the process ended without a result (exit code {child.join() or child.exitcode})"
    child.join()
    if not ok:
        raise RuntimeError(value)
    return value


def _run_scheme_logged(overrides, name, steps, threads, profile=None, row=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine (its own process is this one)
    return run_scheme(list(overrides), name, steps, threads, profile, row)


def _run_paired_logged(overrides, rows, steps, threads):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return run_paired(list(overrides), dict(rows), steps, threads)


def _child(send, fn, args):
    try:
        send.send((True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as this scheme's row
        import traceback

        traceback.print_exc()
        send.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        send.close()


def _load() -> str:
    """The machine's 1-minute load average when the table was written (a shared machine slows every column)."""
    try:
        return f"{os.getloadavg()[0]:.2f} (1-min load average, {os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def cli(argv: list[str]) -> dict:
    """``PYTHONPATH=<checkout> python <this file> ...``: this driver's keys (conf/bench.yaml beside it) over another
    checkout's trainer. The same arguments as ``python -m grail_exp.bench bench.mode=real``."""
    from omegaconf import OmegaConf

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bench = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "bench.yaml")
    mine = [a[len("bench."):] if a.startswith("bench.") else a for a in argv
            if a.split("=", 1)[0].startswith("bench.") or a.split("=", 1)[0] in ("json", "markdown")]
    overrides = [a for a in argv if not (a.split("=", 1)[0].startswith("bench.") or a.split("=", 1)[0] in ("json", "markdown"))]
    bench = OmegaConf.merge(bench, OmegaConf.from_dotlist(mine))
    return main(bench, overrides, argv)


if __name__ == "__main__":
    # Run as a file, this directory would shadow top-level modules (``models``, ``metrics``, ...): drop it, so that
    # ``grail_exp`` is the checkout on PYTHONPATH (spawned children inherit this path).
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != here]
    cli(sys.argv[1:])
