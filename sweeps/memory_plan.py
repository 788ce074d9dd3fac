"""The memory plan against the GPU peaks recorded in results/gpu.md: ``python sweeps/memory_plan.py [out.md]``.

Every CUDA peak the project measured (``results/gpu/``: the benchmark's JSON files and ``make test-gpu``'s log) is a
peak *above the memory held before the measured work* (weights, fp32 masters, Adam state), so it is compared with the
plan's phase minus its model state: the update (and the no-grad log-prob pass inside the same window) for the
optimiser steps, the rollout lines for generation. The table goes to ``results/memory_plan.md`` together with the
plans of the paper recipes on one node of H100 80GB and of H200 GPUs; tests/test_plan.py holds every row within
±20 % of its measurement.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from grail_exp.memory import GiB, plan

ROOT = Path(__file__).resolve().parent.parent  # the checkout (this script lives in sweeps/)
RESULTS = ROOT / "results" / "gpu"
# tests/gpu/test_cuda.py QWEN3_2L: Qwen3-8B's vocabulary, 2 layers of width 1024, bf16, no checkpointing
QWEN3_2L = ["model.random_init_overrides={num_hidden_layers: 2, hidden_size: 1024, intermediate_size: 3072, "
            "num_attention_heads: 16, num_key_value_heads: 8}", "model.gradient_checkpointing=false"]
BASE = ["recipe=demo", "model=qwen3_8b", "model.random_init=true", "model.dtype=bfloat16", "trainer=gpu"]


@dataclass
class Case:
    name: str
    overrides: list[str]
    prompt_tokens: int
    measured_mib: float
    phase: str  # update (optimiser steps) | rollout (generation)
    source: str


def _bench_case(path: Path, scheme: str) -> Case:
    d = json.loads(path.read_text())
    c, cmd = d["config"], d["command"]
    overrides = re.findall(r"model\.random_init_overrides=\{[^}]*\}", cmd)
    overrides += [t for t in re.sub(r"model\.random_init_overrides=\{[^}]*\}", "", cmd).split()
                  if t.startswith("model.gradient_checkpointing=")]
    overrides += [f"advantage={scheme.removesuffix('_per_rollout')}",
                  f"trainer.prompts_per_step={c['bench.prompts']}", f"rollout.num_generations={c['bench.num_generations']}",
                  f"trainer.micro_batch_size={c['bench.micro_batch_size']}",
                  f"rollout.max_completion_length={c['bench.completion_length']}",
                  f"loss.num_iterations={c['bench.iterations']}", f"trainer.logprob_chunk_tokens={c['logprob_chunk_tokens']}"]
    rows = c["bench.prompts"] * c["bench.num_generations"]
    T = c["bench.prompt_length"] + c["bench.completion_length"]
    return Case(f"bench {c['layers']} layers x {c['hidden_size']}, {scheme}, {c['bench.micro_batch_size']} of {rows} rows "
                f"x {T} tokens{', checkpointing' if c['gradient_checkpointing'] else ''}", BASE + overrides,
                c["bench.prompt_length"], d["schemes"][scheme]["peak_mem_mb"], "update", f"results/gpu/{path.name}")


def recorded_cases(results: Path = RESULTS) -> list[Case]:
    """The CUDA peaks of results/gpu.md with the configuration each was measured under."""
    cases = []
    for name in ("bench_qwen3_2l.json", "bench_qwen3_8b_width.json"):
        for scheme in json.loads((results / name).read_text())["schemes"]:
            cases.append(_bench_case(results / name, scheme))
    log = (results / "tests_final.log").read_text()
    steps = ast.literal_eval(re.search(r"peak step memory above the resident state \(MiB\): (\{.*?\})", log).group(1))
    for scheme, mib in steps.items():  # test_grail_step_peak_memory_within_1_15x_of_grpo: 2 prompts x 4, 64 + 512 tokens
        cases.append(Case(f"make test-gpu: one {scheme} step, 2 layers x 1024, 2 micro-batches of 4 rows x 576 tokens",
                          BASE + QWEN3_2L + [f"advantage={scheme}", "trainer.prompts_per_step=2", "rollout.num_generations=4",
                                             "trainer.micro_batch_size=4", "rollout.max_completion_length=512",
                                             "loss.num_iterations=1"], 64, mib, "update", "results/gpu/tests_final.log"))
    gen = ast.literal_eval(re.search(r"generation peaks \(MiB\): (\{.*?\})", log).group(1))
    for new, mib in gen.items():  # test_sampling_memory...: 2 prompts "What is 2+2?" (7 tokens) x n 4, batch 8
        cases.append(Case(f"make test-gpu: HF generation, 8 rows x (7 + {new}) tokens, 2 layers x 1024",
                          BASE + QWEN3_2L + ["trainer.prompts_per_step=2", "rollout.num_generations=4",
                                             "rollout.generation_batch_size=8", f"rollout.max_completion_length={new}"],
                          7, mib, "rollout", "results/gpu/tests_final.log"))
    return cases


def planned_mib(case: Case, compose) -> float:
    """The plan's bytes above the model state for the case's phase, in MiB (``compose``: overrides -> config)."""
    p = plan(compose(case.overrides), prompt_tokens=case.prompt_tokens)
    if case.phase == "rollout":
        return sum(x.bytes for x in p.lines if x.phase == "rollout") / 2**20
    return (max(p.phases["update"], p.phases.get("logp", 0.0)) - p.phases["state"]) / 2**20


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, "paths.output_dir=."])


PAPER_MODELS = ("qwen3_4b", "qwen3_8b", "r1_distill_llama_8b", "octothinker_3b", "octothinker_8b")
HARDWARE = {"4 x H100 80GB": 79.0, "4 x H200": 139.0}


def markdown() -> str:
    from grail_exp.memory import suggest

    out = ["# The memory plan against measured GPU peaks, and the paper recipes' plans", "",
           "Generated by `python sweeps/memory_plan.py results/memory_plan.md` (grail_exp/memory/; docs/memory-planner.md).",
           "Measured: the",
           "CUDA peaks recorded in results/gpu.md (one H100 80GB, 2026-11-23; above the memory held before the measured",
           "work), against the plan's phase minus its model state. No GPU was lent to the session that wrote this",
           "table, so nothing new was measured: the rows are the existing measurements.", "",
           "| measurement | phase | measured MiB | planned MiB | plan / measured | source |", "|---|---|--:|--:|--:|---|"]
    for c in recorded_cases():
        planned = planned_mib(c, _compose)
        out.append(f"| {c.name} | {c.phase} | {c.measured_mib:,.0f} | {planned:,.0f} | {planned / c.measured_mib:.2f} | "
                   f"{c.source} |")
    out += ["", "## The paper recipes (`model=<model> advantage=<scheme>`), per GPU", "",
            "Peak phase and GiB per GPU; `fits` against the device less the headroom (2 GiB + 5 %). vLLM: the recipe "
            "(colocated at 0.2); HF: `rollout=hf` (its per-rank batches: 32 rollout rows, 24 evaluation rows).", "",
            "| model | scheme | hardware | engine | peak phase | peak GiB | fits | what would fit |",
            "|---|---|---|---|---|--:|---|---|"]
    for m in PAPER_MODELS:
        for scheme in ("grpo", "grail", "oar_g"):
            for hw, gb in HARDWARE.items():
                for engine in ("vllm", "hf"):
                    cfg = _compose([f"model={m}", f"advantage={scheme}", f"trainer.device_memory_gb={gb}"]
                                   + (["rollout=hf"] if engine == "hf" else []))
                    p = plan(cfg)
                    fix = "" if p.fits else " / ".join(" ".join(o) for o in suggest(cfg, p))
                    out.append(f"| {m} | {scheme} | {hw} | {engine} | {p.peak_phase} | {p.peak / GiB:.1f} | "
                               f"{'yes' if p.fits else 'no'} | {fix} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    text = markdown()
    if argv:
        Path(argv[0]).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
