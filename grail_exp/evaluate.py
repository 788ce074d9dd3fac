"""Evaluation: sample n completions per benchmark problem, grade them, Pass@k tables with CIs.

Used at the end of every ``run`` (and every ``trainer.eval_every`` steps) through ``evaluate_benchmarks``;
the same code will back ``python -m grail_exp.evaluate`` for checkpoints and hub models.

Protocol (GRAIL paper, method spec §7.1): one user turn ``problem + instruction`` with the model's chat
template; ``eval.n`` samples at ``eval.temperature`` / ``top_p`` / ``top_k``; the **last** ``\\boxed{}`` is
graded with math-verify; acc@n (the paper's "accuracy"), unbiased pass@k for k = 1..n, maj@n,
extraction failures, truncation rate, mean tokens — each with a percentile-bootstrap 95 % CI over problems.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from grail_exp import metrics as M
from grail_exp.data import load_benchmark
from grail_exp.data.prompting import encode_prompts
from grail_exp.rewards import strip_think
from grail_exp.rollout import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    summaries: dict[str, dict]  # benchmark -> metrics.summarize_benchmark(...)
    average: dict | None  # metrics.average_over_benchmarks(...) when there are several benchmarks
    samples: list[dict] = field(default_factory=list)  # one row per sample

    def flat_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``eval/<benchmark>/acc``, ``eval/<benchmark>/pass@k``, ... (and ``eval/avg/...``) as floats."""
        out: dict[str, float] = {}
        rows = dict(self.summaries)
        if self.average:
            rows["avg"] = self.average["unweighted"]
            rows["avg_weighted"] = self.average["weighted"]
        for name, s in rows.items():
            out[f"{prefix}/{name}/acc"] = s["acc"].value
            for k, m in s["pass_at_k"].items():
                out[f"{prefix}/{name}/pass_at_{k}"] = m.value  # MLflow keys cannot contain "@"
            if s.get("maj") is not None:
                out[f"{prefix}/{name}/maj"] = s["maj"].value
            for key in ("nulls", "truncation_rate", "mean_tokens"):
                if s.get(key) is not None:
                    out[f"{prefix}/{name}/{key}"] = float(s[key])
        return out

    def table(self) -> str:
        return M.format_table(self.summaries, self.average)


def evaluate_benchmarks(model, tokenizer, engine, verifier, cfg, benchmarks: list[str] | None = None,
                        desc: str = "eval") -> EvalResult:
    """Evaluate ``model`` on ``cfg.benchmark.names`` with ``cfg.eval`` sampling."""
    from tqdm.auto import tqdm

    ev = cfg.eval
    names = list(benchmarks or cfg.benchmark.names)
    params = SamplingParams(n=ev.n, temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k,
                            max_new_tokens=ev.max_tokens)
    summaries, samples = {}, []
    per_call = max(1, ev.batch_size // ev.n)  # prompts per generate() call
    for name in names:
        problems = load_benchmark(name, cfg)
        instruction = cfg.data.instruction if name == "arithmetic" else cfg.benchmark.get("instruction", "")
        prompts = encode_prompts([p.question for p in problems], tokenizer, cfg.model, instruction)
        completions = []
        # A fixed evaluation seed, without disturbing the training RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ev.seed)
            with tqdm(total=len(prompts), desc=f"{desc} {name}", unit="problem", dynamic_ncols=True, leave=False) as bar:
                for s in range(0, len(prompts), per_call):
                    completions.extend(engine.generate(prompts[s:s + per_call], params))
                    bar.update(len(prompts[s:s + per_call]))
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        graded = verifier.score([strip_think(t) if cfg.model.strip_think else t for t in texts],
                                [p.answer for p in problems for _ in range(ev.n)])
        n = ev.n
        correct = [[graded[i * n + j].correct for j in range(n)] for i in range(len(problems))]
        answers = [[graded[i * n + j].extracted for j in range(n)] for i in range(len(problems))]
        truncated = [[completions[i * n + j].truncated for j in range(n)] for i in range(len(problems))]
        n_tokens = [[len(completions[i * n + j].token_ids) for j in range(n)] for i in range(len(problems))]
        summaries[name] = M.summarize_benchmark(correct, answers=answers, truncated=truncated, n_tokens=n_tokens,
                                                n_boot=ev.n_boot, seed=ev.seed)
        for i, p in enumerate(problems):
            for j in range(n):
                g = graded[i * n + j]
                samples.append({"benchmark": name, "problem_index": i, "sample_index": j,
                                "completion": texts[i * n + j], "extracted": g.extracted, "gold": p.answer,
                                "correct": bool(g.correct), "status": g.status,
                                "truncated": bool(completions[i * n + j].truncated),
                                "n_tokens": len(completions[i * n + j].token_ids)})
    average = M.average_over_benchmarks(summaries, n_boot=ev.n_boot, seed=ev.seed) if len(summaries) > 1 else None
    return EvalResult(summaries, average, samples)


def log_eval_result(tracker, result: EvalResult, tag: str, step: int) -> None:
    """Metrics at ``step``, the Pass@k table (MLflow table + Markdown) and the per-sample rows."""
    import pandas as pd

    tracker.log_metrics(result.flat_metrics(f"eval_{tag}" if tag != "final" else "eval"), step=step)
    tracker.log_table(M.to_dataframe(result.summaries, result.average), artifact_file=f"eval/{tag}/pass_at_k.json")
    tracker.log_text(result.table(), artifact_file=f"eval/{tag}/pass_at_k.md")
    tracker.log_dict(M.to_jsonable({"summaries": result.summaries, "average": result.average}),
                     artifact_file=f"eval/{tag}/summary.json")
    if result.samples:
        tracker.log_table(pd.DataFrame(result.samples), artifact_file=f"eval/{tag}/samples.json")
