"""Evaluation, the library: sample n completions per benchmark problem, grade them, Pass@k tables with CIs.

``python -m grail_exp.evaluate`` (grail_exp/evaluate.py) evaluates a model or checkpoint with it; the same
``evaluate_benchmarks`` runs at the end of every ``python -m grail_exp.run`` (and every
``trainer.eval_every`` steps), there on every rank: each generates and grades its share of the chunks.

Protocol (GRAIL paper, method spec §7.1): one user turn ``problem + instruction`` with the model's chat
template (``enable_thinking: false`` for Qwen3); ``eval.n`` samples at ``eval.temperature`` / ``top_p`` /
``top_k``; the **last** ``\\boxed{}`` is graded with math-verify; acc@n (the paper's "accuracy"), unbiased
pass@k for k = 1..n, maj@n, extraction failures, truncation rate, mean tokens — each with a
percentile-bootstrap 95 % CI over problems — per benchmark, plus the unweighted (paper) and
problem-weighted averages.

**Resumable.** Generation goes in fixed chunks of problems, each sampled from its own seed
(``eval.seed``, benchmark, chunk index), and every finished chunk is appended to a JSONL cache keyed by
the model, the exact prompts and the sampling settings. An interrupted evaluation continues where it
stopped and produces exactly what an uninterrupted one would; a repeated one generates nothing.
Grading is redone from the cached completions (it is cheap and its rules may change).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from grail_exp import faults
from grail_exp.analysis import metrics as M
from grail_exp.checkpoint import random_streams_kept, seed_started_streams
from grail_exp.config import register_configs
from grail_exp.data import load_benchmark
from grail_exp.data.prompting import bos_prefix, encode_prompt_texts, prompt_bos, render_prompt
from grail_exp.grading.extraction import strip_think
from grail_exp.rollout import Completion, SamplingParams

log = logging.getLogger("grail_exp.evaluate")
register_configs()


@dataclass
class EvalResult:
    summaries: dict[str, dict]  # benchmark -> metrics.summarize_benchmark(...)
    average: dict | None  # metrics.average_over_benchmarks(...) when there are several benchmarks
    samples: list[dict] = field(default_factory=list)  # one row per sample
    generated: int = 0  # completions generated in this call (0 when everything came from the cache)
    protocol: dict = field(default_factory=dict)  # evaluation_params(): how the table was made, shown with it
    generated_by: dict = field(default_factory=dict)  # "<benchmark>/<chunk>" -> the rank that generated it

    def flat_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """``eval/<benchmark>/acc``, ``eval/<benchmark>/pass_at_k``, ... (and ``eval/avg/...``) as floats."""
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
        """The Pass@k table, followed by the protocol it depends on (extraction, gold rule, prompt, sampling)."""
        table = M.format_table(self.summaries, self.average)
        return table + "\n\n" + protocol_note(self.protocol) if self.protocol else table

    def summary_json(self) -> dict:
        return M.to_jsonable({**self.summaries, "average_unweighted": (self.average or {}).get("unweighted"),
                              "average_weighted": (self.average or {}).get("weighted"), "protocol": self.protocol})


# ----------------------------------------------------------------------------------------------- cache
class CompletionCache:
    """Append-only JSONL of finished generation chunks: ``{"chunk": i, "prompt_sha": [...], "completions": [...]}``.

    ``writer``: where this process appends (a data-parallel evaluation: one file per rank, ``<path stem>.rank<r>.jsonl``,
    so ranks never write into one file); reading takes ``path`` and every rank's file beside it."""

    def __init__(self, path: Path | None, writer: Path | None = None):
        self.path = writer or path
        self.chunks: dict[int, dict] = {}
        files = [path, *sorted(path.parent.glob(path.stem + ".rank*.jsonl"))] if path is not None else []
        for f in files:
            if not f.exists():
                continue
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill mid-write: that chunk is redone
                    continue
                self.chunks[rec["chunk"]] = rec

    def get(self, chunk: int, prompt_shas: list[str]) -> list[Completion] | None:
        rec = self.chunks.get(chunk)
        if rec is None or rec["prompt_sha"] != prompt_shas:
            return None
        return [Completion(c["p"], c["t"], None, c["x"]) for c in rec["completions"]]

    def put(self, chunk: int, prompt_shas: list[str], completions: list[Completion]) -> None:
        if self.path is None:
            return
        rec = {"chunk": chunk, "prompt_sha": prompt_shas,
               "completions": [{"p": c.prompt_ids, "t": c.token_ids, "x": c.truncated} for c in completions]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one line per chunk, flushed: a kill loses at most this chunk
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.chunks[chunk] = rec
        faults.kill_eval_after_chunks()  # test-only (GRAIL_EXP_FAULT)


def model_fingerprint(path: str, revision: str | None) -> str:
    """Identity of a model for the cache: hub id + revision, or a local directory's weight files (name, size, mtime)."""
    p = Path(path)
    if not p.is_dir():
        return f"hub:{path}@{revision}"
    parts = [str(p.resolve())]
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("config.json")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
    return "|".join(parts)


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------- evaluation
@dataclass
class _Benchmark:
    """One benchmark's prompts, cut into chunks of ``per_call`` prompts (one ``generate`` call and cache line each)."""

    name: str
    problems: list
    prompts: list  # token ids per problem
    shas: list  # sha of each rendered prompt (the cache checks them)
    cache: CompletionCache
    per_call: int

    @property
    def chunks(self) -> range:
        return range(-(-len(self.prompts) // self.per_call))

    def span(self, chunk: int) -> slice:
        return slice(chunk * self.per_call, (chunk + 1) * self.per_call)


def _benchmark(name: str, tokenizer, cfg, per_call: int, cache_dir, model_key, rank: int, world: int) -> _Benchmark:
    problems = load_benchmark(name, cfg)
    instruction = cfg.data.instruction if name in ("arithmetic", "arithmetic_val") else cfg.benchmark.get("instruction", "")
    texts = [render_prompt(p.question, tokenizer, cfg.model, instruction) for p in problems]
    prompts = encode_prompt_texts(texts, tokenizer)  # + BOS where the tokenizer adds one (Llama 3 plain)
    shas = [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]
    cache = CompletionCache(None)
    if cache_dir is not None:
        what = {"model": model_key, "benchmark": name, "sampling": OmegaConf.to_container(cfg.eval, resolve=True),
                "per_call": per_call}
        # Prompts start with BOS where the tokenizer adds one (as vLLM encodes them): completions cached from prompts
        # without it are other completions, so the key names the BOS (tokenizers without one keep their old keys).
        if bos_prefix(tokenizer):
            what["bos"] = bos_prefix(tokenizer)
        if cfg.rollout.engine != "hf":  # another engine samples other completions (hf keys stay as they were)
            what["engine"] = str(cfg.rollout.engine)
        elif cfg.rollout.get("draw", "multinomial") != "multinomial":  # another draw, other completions
            what["draw"] = str(cfg.rollout.draw)
        path = Path(cache_dir) / f"{name}-{_sha(what)}.jsonl"
        cache = CompletionCache(path, writer=path.with_suffix(f".rank{rank}.jsonl") if world > 1 else None)
    return _Benchmark(name, problems, prompts, shas, cache, per_call)


def chunk_seed(seed: int, benchmark: str, chunk: int) -> int:
    """The sampling seed of one chunk: a function of (eval.seed, benchmark, chunk index) alone, so a resumed, a
    one-process and a data-parallel evaluation sample exactly the same completions."""
    return int(_sha([seed, benchmark, chunk]), 16) % (2**31)


def chunk_owners(benchmarks: list[_Benchmark], world: int) -> dict[tuple[str, int], int]:
    """The rank that generates each chunk, {(benchmark, chunk): rank}: chunks by descending work (completions to
    sample: problems x ``eval.n``, the same n for all, so problems), ties in benchmark and chunk order, each to the rank
    with the least work so far (the lowest among equals): Graham's longest-processing-time rule. A function of the
    chunk sizes and the world size alone, so every rank computes the same owners without communicating; the busiest
    rank's work exceeds the idlest's by at most one chunk (its last chunk went to the then idlest rank). A chunk's
    samples depend on its own seed only (``chunk_seed``), never on its owner."""
    chunks = [(b.name, c, len(b.prompts[b.span(c)])) for b in benchmarks for c in b.chunks]
    order = sorted(range(len(chunks)), key=lambda i: (-chunks[i][2], i))
    load, owners = [0] * world, {}
    for i in order:
        name, c, size = chunks[i]
        r = min(range(world), key=lambda k: (load[k], k))
        owners[(name, c)] = r
        load[r] += size
    return owners


def _my_share(benchmarks: list[_Benchmark], engine, params, tokenizer, verifier, cfg, rule, rank: int, world: int,
              desc: str) -> dict:
    """This rank's chunks (``chunk_owners``), in benchmark and chunk order: generated (or read from the cache), decoded
    and graded here. {(benchmark, chunk): (completions, decoded, graded, newly generated)}."""
    from tqdm.auto import tqdm

    ev, out = cfg.eval, {}
    owners = chunk_owners(benchmarks, world)
    mine = [(b, c) for b in benchmarks for c in b.chunks if owners[(b.name, c)] == rank]
    with tqdm(total=sum(len(b.prompts[b.span(c)]) for b, c in mine), desc=desc, unit="problem", dynamic_ncols=True,
              leave=False, disable=rank != 0) as bar:
        for b, c in mine:
            shas = b.shas[b.span(c)]
            got = b.cache.get(c, shas)
            fresh = got is None
            if fresh:
                # Each chunk has its own seed (common random numbers across world sizes and resumes); every stream it
                # moves is put back, so the training stream is left untouched.
                with random_streams_kept():
                    seed_started_streams(chunk_seed(ev.seed, b.name, c))
                    got = engine.generate(b.prompts[b.span(c)], params)
                b.cache.put(c, shas, got)
            out[(b.name, c)] = [got, fresh]
            bar.update(len(shas))
    for b in benchmarks:  # one grading call per benchmark over this rank's chunks
        keys = [k for k in out if k[0] == b.name]
        comps = [x for k in keys for x in out[k][0]]
        if not comps:
            continue
        decoded = tokenizer.batch_decode([x.token_ids for x in comps], skip_special_tokens=True)
        golds = [b.problems[b.span(k[1])][i // ev.n].answer for k in keys for i in range(len(out[k][0]))]
        graded = verifier.score([strip_think(t) if cfg.model.strip_think else t for t in decoded], golds,
                                extraction=rule)
        at = 0
        for k in keys:
            n = len(out[k][0])
            out[k] = (out[k][0], decoded[at:at + n], graded[at:at + n], out[k][1])
            at += n
    return out


def evaluate_benchmarks(model, tokenizer, engine, verifier, cfg, benchmarks: list[str] | None = None,
                        desc: str = "eval", cache_dir: str | Path | None = None,
                        model_key: str | None = None) -> EvalResult:
    """Evaluate ``model`` on ``cfg.benchmark.names`` with ``cfg.eval`` sampling (optionally resumable).

    Data parallel when a process group exists (a collective: every rank calls it): each rank generates and grades
    its share of the chunks (``chunk_owners``: about the same number of problems on every rank), every rank receives
    them all and returns the same result, which equals a one-process evaluation with the same seeds (each chunk is
    seeded on its own: ``chunk_seed``). Every random stream the sampling moves is restored afterwards.

    ``benchmark.extraction`` picks the graded answer (``grail_exp.grading.extraction``); with ``paper`` the samples
    whose text is empty leave their problem's denominator and tokens are averaged over the samples with an
    extracted answer, as the reference evaluation does (``metrics.summarize_benchmark(protocol="paper")``).
    """
    from grail_exp import world
    from grail_exp.grading.extraction import benchmark_rule

    ev = cfg.eval
    extraction = cfg.benchmark.get("extraction", "last_balanced")
    rule = benchmark_rule(extraction)
    params = SamplingParams(n=ev.n, temperature=ev.temperature, top_p=ev.top_p, top_k=ev.top_k,
                            max_new_tokens=ev.max_tokens,
                            per_request_seeds=True)  # a chunk's completions from its seed alone (chunk_seed)
    per_call = max(1, ev.batch_size // ev.n)  # prompts per generate() call = one cached chunk
    rank, size = world.rank(), world.world_size()
    jobs = [_benchmark(name, tokenizer, cfg, per_call, cache_dir, model_key, rank, size)
            for name in (benchmarks or cfg.benchmark.names)]
    done, by = {}, {}
    shares = world.gather_to_all(_my_share(jobs, engine, params, tokenizer, verifier, cfg, rule, rank, size, desc))
    for r, share in enumerate(shares):
        done.update(share)
        by.update({f"{name}/{chunk}": r for name, chunk in share})
    summaries, samples = {}, []
    for b in jobs:
        parts = [done[(b.name, c)] for c in b.chunks]
        summaries[b.name] = _summarize(b, [x for p in parts for x in p[0]], [x for p in parts for x in p[1]],
                                       [x for p in parts for x in p[2]], ev, extraction == "paper", samples)
    average = M.average_over_benchmarks(summaries, n_boot=ev.n_boot, seed=ev.seed) if len(summaries) > 1 else None
    generated = sum(len(v[0]) for v in done.values() if v[3])
    return EvalResult(summaries, average, samples, generated, evaluation_params(cfg, tokenizer), by)


def _summarize(b: _Benchmark, completions: list, decoded: list, graded: list, ev, paper: bool, samples: list) -> dict:
    """One benchmark's metrics (``metrics.summarize_benchmark``); its per-sample rows are appended to ``samples``."""
    # paper: the reference keeps a sample only if its text is non-empty (run_eval.py: `if content:`)
    counted = [not paper or text != "" for text in decoded]
    n = ev.n

    def grid(f):
        return [[f(i * n + j) for j in range(n) if counted[i * n + j]] for i in range(len(b.problems))]

    summary = M.summarize_benchmark(
        grid(lambda k: graded[k].correct), answers=grid(lambda k: graded[k].extracted),
        truncated=grid(lambda k: completions[k].truncated), n_tokens=grid(lambda k: len(completions[k].token_ids)),
        n_boot=ev.n_boot, seed=ev.seed, protocol="paper" if paper else "standard",
        ks=range(1, n + 1) if paper else None)
    for i, p in enumerate(b.problems):
        for j in range(n):
            k, g = i * n + j, graded[i * n + j]
            samples.append({"benchmark": b.name, "problem_index": i, "sample_index": j, "completion": decoded[k],
                            "extracted": g.extracted, "gold": p.answer, "correct": bool(g.correct),
                            "status": g.status, "truncated": bool(completions[k].truncated),
                            "n_tokens": len(completions[k].token_ids), "counted": counted[k]})
    return summary


def evaluation_params(cfg, tokenizer) -> dict:
    """What a table depends on, recorded with every table: prompt template, chat kwargs, sampling, grading."""
    from grail_exp.grading.extraction import DESCRIPTIONS

    example = render_prompt("{problem}", tokenizer, cfg.model, cfg.benchmark.get("instruction", "") or "")
    extraction = cfg.benchmark.get("extraction", "last_balanced")
    r = cfg.reward
    return {
        "eval.prompt_template": example,
        "eval.prompt_style": cfg.model.prompt_style,
        "eval.prompt_bos": prompt_bos(tokenizer, cfg.model, cfg.benchmark.get("instruction", "") or ""),
        "eval.chat_template_kwargs": json.dumps(OmegaConf.to_container(cfg.model.chat_template_kwargs, resolve=True)),
        "eval.strip_think": cfg.model.strip_think,
        "eval.sampling": json.dumps(OmegaConf.to_container(cfg.eval, resolve=True)),
        "eval.verifier": json.dumps({"hard_timeout_s": r.hard_timeout_s, "parse_timeout": r.parse_timeout,
                                     "verify_timeout": r.verify_timeout}) + " math-verify",
        "eval.extraction": f"{extraction}: {DESCRIPTIONS[extraction]['benchmark']}",
        "eval.olympiad_gold": cfg.benchmark.get("olympiad_gold", "first"),
        "eval.benchmarks": ",".join(cfg.benchmark.names),
    }


def protocol_note(protocol: dict) -> str:
    """The protocol of a table in a few Markdown lines (printed and saved under every table)."""
    p = {k.removeprefix("eval."): v for k, v in protocol.items()}
    sampling = json.loads(p["sampling"]) if "sampling" in p else {}
    return "\n".join([
        f"- extraction: {p.get('extraction')}",
        f"- OlympiadBench gold: {p.get('olympiad_gold')}; grading: {p.get('verifier')}",
        f"- prompt: {p.get('prompt_style')} {p.get('chat_template_kwargs')}, BOS {p.get('prompt_bos')}, "
        f"strip_think {p.get('strip_think')}, template {p.get('prompt_template')!r}",
        "- sampling: " + ", ".join(f"{k} {sampling[k]}" for k in ("n", "temperature", "top_p", "top_k", "max_tokens")
                                   if k in sampling),
    ])


def pass_at_k_plot(result: EvalResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    rows = dict(result.summaries)
    if result.average:
        rows["average"] = result.average["unweighted"]
    for name, s in rows.items():
        ks = sorted(s["pass_at_k"])
        v = [100 * s["pass_at_k"][k].value for k in ks]
        lo = [100 * s["pass_at_k"][k].lo for k in ks]
        hi = [100 * s["pass_at_k"][k].hi for k in ks]
        ax.plot(ks, v, marker="o", label=name, lw=2.5 if name == "average" else 1.2)
        ax.fill_between(ks, lo, hi, alpha=0.12)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_xticks(sorted({k for s in rows.values() for k in s["pass_at_k"]}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_eval_result(tracker, result: EvalResult, tag: str, step: int, out_dir: str | Path | None = None) -> None:
    """Metrics at ``step``, the Pass@k table (MLflow table + Markdown), summary, samples (parquet) and a plot."""
    import tempfile

    import pandas as pd

    tracker.log_metrics(result.flat_metrics(f"eval_{tag}" if tag not in ("final", "eval") else "eval"), step=step)
    tracker.log_table(M.to_dataframe(result.summaries, result.average), artifact_file=f"eval/{tag}/pass_at_k.json")
    tracker.log_text(result.table(), artifact_file=f"eval/{tag}/pass_at_k.md")
    tracker.log_dict(result.summary_json(), artifact_file=f"eval/{tag}/summary.json")
    if getattr(tracker, "run_id", None) and result.samples:
        with tempfile.TemporaryDirectory() as tmp:
            pq = Path(tmp) / "samples.parquet"
            pd.DataFrame(result.samples).to_parquet(pq, index=False)
            tracker.log_artifact(str(pq), f"eval/{tag}")
            tracker.log_artifact(str(pass_at_k_plot(result, Path(tmp) / "pass_at_k.png")), f"eval/{tag}")


def write_run_files(result: EvalResult, out_dir: str | Path) -> None:
    """``samples.jsonl`` and ``summary.json`` in the run directory: usable without MLflow."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "w") as f:
        for s in result.samples:
            f.write(json.dumps({k: s[k] for k in ("benchmark", "problem_index", "sample_index", "completion",
                                                   "extracted", "gold", "correct")}) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary_json(), indent=2))
    (out / "pass_at_k.md").write_text(result.table())


# ----------------------------------------------------------------------------------------------- CLI
