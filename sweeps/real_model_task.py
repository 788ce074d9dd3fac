"""Choosing the chain task for SmolLM2-135M-Instruct (results/real_model_study.md, section 1): the start reward and
completion lengths of candidate task designs, measured on the packaged model itself before any training.

    python sweeps/real_model_task.py                                  # every candidate below, 32 problems x 4
    python sweeps/real_model_task.py --only words3_ops24_le10 --problems 64
    python sweeps/real_model_task.py --table                          # the Markdown table of what was measured

A candidate is a set of Hydra overrides on top of ``experiment=real/smollm2_grpo`` (the model, its chat template and
default system turn) plus worked examples written by the task's own generator (``data.solution_style``), shown as
earlier chat turns, or (``sft`` candidates) a supervised cold start instead: ``sft_steps`` AdamW steps on the
generator's chain-formatted solutions of fresh training problems, zero-shot prompts, loss on the solution (a
prototype to measure the design, bf16 autocast over float32 weights; its time is reported). Each is sampled as training
samples it (T 1.0, top_p 1, no top-k; ``--n`` completions per
problem) on the first ``--problems`` problems of the task's *validation* split (never the test split), and graded
by the training reward (math-verify on the last ``\\boxed{}``). One JSON line per finished candidate goes to
``--out``; a candidate already there is skipped, so an interrupted measurement continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from grail_exp.compute.host import peak_resident_bytes

# name -> (data overrides, solution style of the worked examples, number of worked examples)
CANDIDATES: dict[str, tuple[list[str], str, int]] = {
    "words3_ops23_le10": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=10"], "words", 3),
    "steps3_ops23_le10": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=10"], "steps", 3),
    "compact3_ops23_le10": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=10"], "compact", 3),
    "words3_ops24_le10": (["data.min_steps=2", "data.max_steps=4", "data.max_operand=10"], "words", 3),
    "words3_add_ops24_le10": (["data.min_steps=2", "data.max_steps=4", "data.max_operand=10", "data.operators=+"],
                              "words", 3),
    "words3_ops23_le5": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=5"], "words", 3),
    "words2_ops23_le10": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=10"], "words", 2),
    "sft40_words_ops23_le10": (["data.min_steps=2", "data.max_steps=3", "data.max_operand=10"], "words", 0),
    "sft40_words_ops24_le10": (["data.min_steps=2", "data.max_steps=4", "data.max_operand=10"], "words", 0),
    "sft40_words_ops34_le20": (["data.min_steps=3", "data.max_steps=4", "data.max_operand=20"], "words", 0),
}
SFT = {name: {"steps": 40, "batch": 8, "lr": 1e-4} for name in CANDIDATES if name.startswith("sft")}  # their SFT
SHOT_INDEX = 9_000_000  # worked examples come from this far into the training stream (runs use the start of it)


def worked_examples(task, k: int) -> list[dict]:
    """``k`` examples of the task written by its generator, the longest chain first, then shorter ones in turn
    (a 2-4 operation task shows 4, 2, 3 operations): every chain length the task asks for is shown."""
    counts = list(range(task.max_steps, task.min_steps - 1, -1))
    out, i = [], SHOT_INDEX
    while len(out) < k:
        p = task.train_problem(i)
        i += 1
        if p.question.count("+") + p.question.count("-") + p.question.count("*") == counts[len(out) % len(counts)]:
            out.append({"question": p.question, "answer": p.solution})
    return out


def cold_start(path: str, cfg, task, spec: dict):
    """The packaged model fine-tuned on ``spec['steps']`` batches of the task's chain solutions (zero-shot prompts);
    returns (bf16 model, seconds, CPU seconds)."""
    import torch

    from grail_exp.models.embedded import _encode_sft_batch
    from grail_exp.models.loading import load_causal_lm, load_tokenizer

    t, c = time.perf_counter(), time.process_time()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(path, cfg)
    model = load_causal_lm(path, OmegaConf.merge(cfg, {"model": {"dtype": "float32"}}), trainable=True)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    model.train()
    for step in range(spec["steps"]):
        problems = task.train_problems(20_000_000 + step * spec["batch"], spec["batch"])
        ids, attn, lab = _encode_sft_batch(tokenizer, problems, {}, cfg.data.instruction)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=attn, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"sft step {step + 1}/{spec['steps']} loss {loss.item():.3f}", flush=True)
    model.eval()
    return model.to(torch.bfloat16), time.perf_counter() - t, time.process_time() - c


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=False)


def candidate_config(name: str, problems: int, n: int, max_tokens: int, extra: list[str]):
    from omegaconf import OmegaConf, open_dict

    from grail_exp.data import arithmetic_task

    data_overrides, style, shots = CANDIDATES[name]
    cfg = compose(["experiment=real/smollm2_grpo", "benchmark=arithmetic_val", f"benchmark.limit={problems}",
                   f"data.num_validation={max(problems, 32)}", f"eval.n={n}", "eval.temperature=1.0",
                   "eval.top_p=1.0", "eval.top_k=0", f"eval.max_tokens={max_tokens}", "paths.output_dir=/tmp",
                   *data_overrides, *extra])
    task = arithmetic_task(OmegaConf.merge(cfg.data, {"solution_style": style}))
    with open_dict(cfg):
        cfg.model.few_shot = worked_examples(task, shots) if shots else []
    return cfg


def measure(name: str, cfg, model, tokenizer, engine, verifier) -> dict:
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.evaluation import evaluate_benchmarks

    t, c = time.perf_counter(), time.process_time()
    res = evaluate_benchmarks(model, tokenizer, engine, verifier, cfg, desc=name)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    s = res.samples
    correct = np.array([x["correct"] for x in s], dtype=float)
    tokens = np.array([x["n_tokens"] for x in s], dtype=float)
    boxed = np.array([x["extracted"] is not None for x in s], dtype=float)
    truncated = np.array([x["truncated"] for x in s], dtype=float)
    per_problem = correct.reshape(-1, cfg.eval.n)
    mixed = float(np.mean((per_problem.min(1) == 0) & (per_problem.max(1) == 1)))
    prompt = encode_prompts(["Compute 1+2+3."], tokenizer, cfg.model, cfg.data.instruction)[0]
    rng = np.random.default_rng(0)  # bootstrap over problems for the start reward's interval
    boot = per_problem.mean(1)[rng.integers(0, len(per_problem), (2000, len(per_problem)))].mean(1)
    return {
        "candidate": name, "data": {k: cfg.data[k] for k in ("min_steps", "max_steps", "max_operand", "operators")},
        "few_shot": [dict(x) for x in cfg.model.few_shot], "problems": len(per_problem), "n": int(cfg.eval.n),
        "temperature": float(cfg.eval.temperature), "max_tokens": int(cfg.eval.max_tokens),
        "reward": float(correct.mean()), "reward_ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
        "boxed": float(boxed.mean()), "mixed_groups": mixed, "truncated": float(truncated.mean()),
        "tokens_mean": float(tokens.mean()),
        "tokens_correct_mean": float(tokens[correct == 1].mean()) if correct.any() else None,
        "tokens_correct_min": int(tokens[correct == 1].min()) if correct.any() else None,
        "correct_ge40": float((tokens[correct == 1] >= 40).mean()) if correct.any() else None,
        "prompt_tokens": len(prompt), "wall_s": wall, "cpu_s": cpu,
        "examples": [x["completion"] for x in s[:: cfg.eval.n][:3]],
    }


def table(rows: list[dict]) -> str:
    head = ("| candidate | ops | operands | shots (style) | prompt tokens | start reward [95 % CI] | boxed | mixed groups "
            "| tokens (all) | tokens (correct: mean, min) | correct ≥ 40 tokens | truncated | wall / CPU s |")
    lines = [head, "|" + "|".join(["---"] + ["--:"] * 12) + "|"]
    for r in rows:
        d = r["data"]
        style = r["few_shot"][0]["answer"].split(" ")[0] if r["few_shot"] else "-"
        style = {"We": "words", "Step": "steps"}.get(style, "compact")
        shots = f"{len(r['few_shot'])} ({style})"
        if "sft" in r:
            sft = r["sft"]
            shots = f"0 + SFT {sft['steps']} × {sft['batch']} ({sft['style']}; {sft['wall_s'] / 60:.0f} min)"
        tc = "—" if r["tokens_correct_mean"] is None else f"{r['tokens_correct_mean']:.0f}, {r['tokens_correct_min']}"
        ge = "—" if r["correct_ge40"] is None else f"{100 * r['correct_ge40']:.0f} %"
        lines.append(
            f"| {r['candidate']} | {d['min_steps']}–{d['max_steps']} | ≤ {d['max_operand']} | {shots} "
            f"| {r['prompt_tokens']} | **{100 * r['reward']:.1f} %** [{100 * r['reward_ci95'][0]:.1f}, "
            f"{100 * r['reward_ci95'][1]:.1f}] | {100 * r['boxed']:.0f} % | {100 * r['mixed_groups']:.0f} % | "
            f"{r['tokens_mean']:.0f} | {tc} | {ge} | {100 * r['truncated']:.0f} % | {r['wall_s']:.0f} / {r['cpu_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("results/real_model_study/task_candidates.jsonl"))
    ap.add_argument("--table", action="store_true", help="print the table of --out and exit")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every candidate")
    args = ap.parse_args()
    done = [json.loads(x) for x in args.out.read_text().splitlines()] if args.out.exists() else []
    if args.table:
        print(table(done))
        return
    names = [x for x in args.only.split(",") if x] or list(CANDIDATES)
    unknown = set(names) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"--only: unknown candidate(s) {sorted(unknown)}; known: {', '.join(CANDIDATES)}")
    key = lambda r: (r["candidate"], r["problems"], r["n"], r["max_tokens"])  # noqa: E731
    have = {key(r) for r in done}

    from grail_exp.grading.extraction import reward_rule
    from grail_exp.grading.rewards import MathVerifier
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.rollout import build_engine

    cfg0 = candidate_config(names[0], args.problems, args.n, args.max_tokens, args.overrides)
    path = resolve_model_path(cfg0)
    tokenizer = load_tokenizer(path, cfg0)
    model = load_causal_lm(path, cfg0, trainable=False)
    engine = build_engine("hf", model, tokenizer, cfg0.eval.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with MathVerifier(num_workers=1, extraction=reward_rule(cfg0.reward.extraction)) as verifier:
        for name in names:
            cfg = candidate_config(name, args.problems, args.n, args.max_tokens, args.overrides)
            if (name, args.problems, args.n, args.max_tokens) in have:
                print(f"{name}: already measured in {args.out}")
                continue
            if name in SFT:  # a cold start: measure its own weights, then go back to the packaged model's
                from grail_exp.data import arithmetic_task

                task = arithmetic_task(OmegaConf.merge(cfg.data, {"solution_style": CANDIDATES[name][1]}))
                tuned, sft_wall, sft_cpu = cold_start(path, cfg, task, SFT[name])
                row = measure(name, cfg, tuned, tokenizer, build_engine("hf", tuned, tokenizer, cfg0.eval.batch_size),
                              verifier)
                row.update(sft={**SFT[name], "style": CANDIDATES[name][1], "wall_s": sft_wall, "cpu_s": sft_cpu})
                del tuned
            else:
                row = measure(name, cfg, model, tokenizer, engine, verifier)
            row["peak_rss_gb"] = peak_resident_bytes() / 1e9
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(table([row]).splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
