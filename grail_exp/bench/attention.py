"""``python -m grail_exp.bench bench.mode=attention``: the fused CPU attention kernel against the explicit one, per shape.

    python -m grail_exp.bench bench.mode=attention markdown=results/bench_attention.md

One attention layer's forward + backward at each ``bench.attention.shapes`` entry (query positions, key positions),
with the heads of ``bench.attention`` (default SmolLM2-135M's: 9 query heads sharing 3 key/value heads of 64, 16 rows,
bfloat16), a causal mask aligned to the last key and a few left-padded rows: PyTorch's fused
``scaled_dot_product_attention`` (grouped-query heads in the kernel) and ``grail_exp.compute.attention`` (two products and
a float32 softmax). Medians of ``bench.repeats`` timed calls after ``bench.warmup``, alternating the two so drift of a
shared machine hits both. The table says which one ``model.cpu_explicit_attention_max_scores`` (query × key positions)
picks for each shape: the crossover on this machine is where the ratio passes 1. Each row also checks that both give
the same output (within float32 rounding and the bfloat16 result's half ulp).

    python -m grail_exp.bench bench.mode=attention experiment=real/smollm2_grpo bench.prompt_length=131 \
        bench.completion_length=20 bench.num_generations=8 bench.micro_batch_size=16

With run overrides, it also times the run's policy forward + backward (the trainer's ``policy_forward``, its
``trainer.share_prompts``, micro-batches of ``bench.micro_batch_size``) over the synthetic batch of ``bench.prompts`` ×
``bench.num_generations`` rows of ``bench.prompt_length`` + ``bench.completion_length`` tokens, in one process,
alternating the fused kernel (``model.cpu_explicit_attention_max_scores=0``) and the run's setting batch by batch, so
the machine's drift hits both.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

log = logging.getLogger("grail_exp.bench")


def _inputs(rows: int, heads: int, kv_heads: int, head_dim: int, lq: int, lk: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, lq, head_dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(rows, kv_heads, lk, head_dim, generator=g).to(dtype).requires_grad_()
    v = torch.randn(rows, kv_heads, lk, head_dim, generator=g).to(dtype).requires_grad_()
    mask = torch.ones(rows, 1, lq, lk, dtype=torch.bool).tril(lk - lq)
    mask[: rows // 4, :, :, : min(lk - lq, lk // 8)] = False  # a quarter of the rows left-padded
    grad = torch.randn(rows, heads, lq, head_dim, generator=g).to(dtype)
    return q, k, v, mask, grad


def time_shape(a: DictConfig, lq: int, lk: int, warmup: int, repeats: int, seed: int) -> dict:
    from grail_exp.compute.attention import explicit_attention

    dtype = getattr(torch, a.dtype)
    q, k, v, mask, grad = _inputs(a.rows, a.heads, a.kv_heads, a.head_dim, lq, lk, dtype, seed)
    scale = a.head_dim ** -0.5
    paths = {
        "fused": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                          enable_gqa=True),
        "explicit": lambda: explicit_attention(q, k, v, mask, scale),
    }
    times = {name: [] for name in paths}
    outs = {}
    for i in range(warmup + repeats):
        for name in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
            t0 = time.perf_counter()
            out = paths[name]()
            out.backward(grad)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            outs[name] = out.detach()
            q.grad = k.grad = v.grad = None
    fused, explicit = (statistics.median(times[n]) * 1e3 for n in ("fused", "explicit"))
    real = mask.any(-1, keepdim=True).expand_as(outs["fused"])  # rows with a key to attend to
    diff = (outs["explicit"] - outs["fused"])[real].float().abs().max().item()
    scale_out = outs["fused"][real].float().abs().max().item()
    return {"queries": lq, "keys": lk, "scores": lq * lk, "fused_ms": round(fused, 3),
            "explicit_ms": round(explicit, 3), "ratio": round(explicit / fused, 3),
            "max_abs_diff": diff, "same_output": diff <= (2.0 ** -7 + 1e-4) * scale_out}


def time_policy(cfg: DictConfig, policy, batch, bench: DictConfig) -> dict:
    """The policy's forward + backward over the batch, fused kernel vs the run's setting, alternating per batch."""
    from grail_exp.compute.forward import policy_forward, share_prompts_of
    from grail_exp.compute.model_attention import use_kernel_gqa

    setting = int(cfg.model.cpu_explicit_attention_max_scores)
    share, micro, rows = share_prompts_of(cfg), int(bench.micro_batch_size), batch.input_ids.shape[0]

    def forward_backward():
        policy.zero_grad(set_to_none=True)
        for lo in range(0, rows, micro):
            s = slice(lo, lo + micro)
            logp, _, _ = policy_forward(policy, batch.input_ids[s], batch.attention_mask[s], batch.position_ids[s],
                                        batch.completion_ids[s], 1.0, share_prompts=share)
            (logp * batch.loss_mask[s]).sum().backward()

    times = {0: [], setting: []}
    for i in range(int(bench.warmup) + int(bench.repeats)):
        for value in ((0, setting) if i % 2 == 0 else (setting, 0)):
            use_kernel_gqa(policy, value)
            t0 = time.perf_counter()
            forward_backward()
            if i >= int(bench.warmup):
                times[value].append(time.perf_counter() - t0)
    use_kernel_gqa(policy, setting)
    fused, explicit = statistics.median(times[0]), statistics.median(times[setting])
    return {"model": cfg.model.name, "rows": rows, "prompt_length": int(bench.prompt_length),
            "completion_length": int(bench.completion_length), "micro_batch_size": micro, "share_prompts": share,
            "max_scores": setting, "fused_s": round(fused, 3), "explicit_s": round(explicit, 3),
            "ratio": round(explicit / fused, 3)}


def shapes_table(rows: list[dict], threshold: int, a: DictConfig, threads: int) -> str:
    from grail_exp.bench.real import table_markdown

    head = (f"{a.rows} rows, {a.heads} query heads / {a.kv_heads} key-value heads of {a.head_dim}, {a.dtype}, "
            f"{threads} thread(s); forward + backward of one layer, median ms. `model.cpu_explicit_attention_max_scores"
            f"` = {threshold} picks the explicit path up to that many query × key positions.\n\n")
    cells = [[r["queries"], r["keys"], f"{r['fused_ms']:.2f}", f"{r['explicit_ms']:.2f}", f"{r['ratio']:.2f}",
              "explicit" if r["scores"] <= threshold else "fused"] for r in rows]
    columns = ["queries", "keys", "fused ms", "explicit ms", "explicit / fused", "picked at the default"]
    return head + table_markdown(columns, "rrrrrl", cells) + "\n"


def main(bench: DictConfig, argv: list[str], policy: tuple | None = None) -> dict:
    """``policy``: (run config, its policy model, a synthetic batch) to time the whole forward + backward as well."""
    from grail_exp.config import ModelConfig

    a = bench.attention
    threads = int(bench.threads) if bench.threads else torch.get_num_threads()
    torch.set_num_threads(threads)
    threshold = ModelConfig.cpu_explicit_attention_max_scores
    rows = []
    for lq, lk in a.shapes:
        if lq > lk:
            raise ValueError(f"bench.attention.shapes: ({lq}, {lk}) has more query than key positions")
        r = time_shape(a, int(lq), int(lk), int(bench.warmup), int(bench.repeats), int(bench.seed))
        if not r["same_output"]:
            raise AssertionError(f"explicit and fused attention differ by {r['max_abs_diff']:.3g} at {lq} x {lk}")
        log.info("%4d x %4d: fused %.2f ms, explicit %.2f ms (%.2fx)", lq, lk, r["fused_ms"], r["explicit_ms"],
                 r["ratio"])
        rows.append(r)
    md = shapes_table(rows, threshold, a, threads)
    out = {"shapes": rows, "threads": threads, "default_max_scores": threshold, "argv": argv}
    if policy is not None:
        p = out["policy"] = time_policy(*policy, bench)
        md += (f"\n{p['model']}'s policy forward + backward, {p['rows']} rows of {p['prompt_length']} + "
               f"{p['completion_length']} tokens in micro-batches of {p['micro_batch_size']} (share_prompts "
               f"{p['share_prompts']}), median s over {bench.repeats} alternating batches: fused {p['fused_s']:.2f}, "
               f"`max_scores` = {p['max_scores']}: {p['explicit_s']:.2f} ({p['ratio']:.2f}x).\n")
    print(md)
    from grail_exp.analysis.portable import portable_text

    if bench.json:  # committed records: paths relative to the project (grail_exp/analysis/portable.py)
        Path(bench.json).write_text(portable_text(json.dumps(out, indent=2) + "\n"))
    if bench.markdown:
        Path(bench.markdown).write_text(portable_text(f"`python -m grail_exp.bench {' '.join(argv)}`\n\n{md}"))
    return out
