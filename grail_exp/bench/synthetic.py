"""``python -m grail_exp.bench``: the cost of each scheme's optimiser step, side by side, in one process.

    python -m grail_exp.bench                                    # embedded tiny model: grpo, grail, oar_g
    python -m grail_exp.bench bench.mode=attention                # fused vs explicit CPU attention per shape
    python -m grail_exp.bench model=qwen3_8b model.random_init=true model.tokenizer_name_or_path=pkg:qwen3 \\
        'model.random_init_overrides={num_hidden_layers: 1}' bench.completion_length=256 json=bench.json

Every scheme trains the same model (the same starting weights, restored before each scheme) on the same
synthetic rollout batch: ``bench.prompts`` groups of ``bench.num_generations`` completions of fixed length, a
``\\boxed{answer}`` at ``bench.answer_position``, rewards alternating 1/0 within a group except in the first
``zero_advantage_fraction`` of the groups, whose rewards are all equal (A = 0). A rollout batch is trained for
``bench.iterations`` optimiser steps through the trainer's own code (``RolloutPhase.prepare``,
``logps``, ``UpdatePhase.step``), so what is timed is what a run executes. Per scheme, after
``bench.warmup`` untimed batches, ``bench.repeats`` timed batches, in ``bench.passes`` passes that alternate the
scheme order (ABC, CBA: drift of a shared machine cancels); medians over all timed batches of

- ``old_logp_s``: the no-grad log-prob pass over the rollout batch (needed when μ > 1), once per rollout batch;
- ``scheme_s``: the scheme's own work per optimiser step (``prepare`` + weight computation; with a shared forward
  this is the probe's extra backward only — the forward is counted in the update);
- ``update_s``: forward + backward + optimiser step, per optimiser step, without the scheme's work;
- ``step_s``: scheme_s + update_s, the whole update phase of one optimiser step;
- ``step_per_old_logp``: step_s / old_logp_s of the same rollout batch (median of the per-batch ratios). The old-logp
  pass is the same work for every scheme and runs moments before the step, so on a shared, noisy machine the ratio of
  this column to GRPO's ("load-normalised step / grpo") compares schemes at equal machine speed;
- ``peak_mem_mb``: on CUDA the peak allocated memory during the steps above the memory held before them; on CPU
  the peak resident-set growth during them (sampled every 2 ms; freed heap is returned to the OS before each
  batch so earlier schemes' freed memory does not hide a later scheme's growth).

A scheme with ``advantage.recompute=per_rollout`` is its own entry (``<name>_per_rollout``). Ratios against grpo are
printed; ``json=`` and ``markdown=`` write the table. CUDA times are synchronised at batch boundaries only, so the
scheme / update split there is approximate (kernels run asynchronously); ``step_s`` is exact.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from grail_exp.conf_path import CONFIG_DIR

log = logging.getLogger("grail_exp.bench")


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: list[str]) -> tuple[DictConfig, list[str]]:
    """``bench.<key>=v`` / ``json=`` / ``markdown=`` into the bench config; everything else is a run override."""
    bench = OmegaConf.load(Path(CONFIG_DIR) / "bench.yaml")
    mine, overrides = [], []
    for a in argv:
        key = a.split("=", 1)[0]
        if key.startswith("bench."):
            mine.append(a[len("bench."):])
        elif key in ("json", "markdown"):
            mine.append(a)
        else:
            overrides.append(a)
    OmegaConf.set_struct(bench, True)
    OmegaConf.set_struct(bench.variants, False)  # real mode's variants: names of the user's choosing
    try:
        bench = OmegaConf.merge(bench, OmegaConf.from_dotlist(mine))
    except Exception as exc:  # an unknown key names itself in the message
        raise SystemExit(f"grail_exp.bench: {exc} (valid keys: conf/bench.yaml)") from None
    return bench, overrides


def compose_run_config(overrides: list[str], scheme: str, bench: DictConfig, out_dir: str) -> DictConfig:
    from hydra import compose, initialize_config_dir

    from grail_exp.config import register_configs
    from grail_exp.validate import validate

    register_configs()
    fixed = [f"advantage={scheme.removesuffix('_per_rollout')}", f"paths.output_dir={out_dir}",
             f"rollout.num_generations={bench.num_generations}", f"trainer.prompts_per_step={bench.prompts}",
             f"trainer.micro_batch_size={bench.micro_batch_size}", f"loss.num_iterations={bench.iterations}",
             f"rollout.max_completion_length={bench.completion_length}", "trainer.weights_table_every=0",
             "logger=none"]
    if scheme.endswith("_per_rollout"):
        fixed.append("advantage.recompute=per_rollout")
    # One process's update step is what is timed: a paper model's own recipe (4 GPUs under FSDP, vLLM) is not.
    if not any(o.lstrip("+~").split("=", 1)[0] == "recipe" for o in overrides):
        fixed.insert(0, "recipe=demo")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, *fixed])
    return validate(cfg)


def scheme_names(bench: DictConfig) -> list[str]:
    from grail_exp.advantages import SCHEMES

    names = list(bench.schemes)
    if names == ["all"]:
        names = [n for n in sorted(SCHEMES) if (Path(CONFIG_DIR) / "advantage" / f"{n}.yaml").is_file()]
        names.sort(key=lambda n: n != bench.baseline)  # the baseline first
    unknown = [n for n in [*names, *bench.per_rollout] if n not in SCHEMES]
    if unknown:
        raise SystemExit(f"bench.schemes / bench.per_rollout: unknown scheme(s) {unknown}; valid: {sorted(SCHEMES)}")
    out = []
    for n in names:
        out.append(n)
        if n in bench.per_rollout:
            out.append(f"{n}_per_rollout")
    return out


# ------------------------------------------------------------------------------------------------ the batch
def synthetic_batch(tokenizer, bench: DictConfig, cfg: DictConfig, device):
    """A rollout batch of fixed shape: random ordinary tokens, a boxed answer, alternating or constant rewards."""
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.estimators import EstimatorInput, estimate
    from grail_exp.training.batch import TrainingBatch

    g = torch.Generator().manual_seed(int(bench.seed))
    P, G, Tp, C = int(bench.prompts), int(bench.num_generations), int(bench.prompt_length), int(bench.completion_length)
    N = P * G
    special = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    ordinary = torch.tensor([i for i in range(min(vocab, 50_000)) if i not in special])
    pick = lambda *shape: ordinary[torch.randint(len(ordinary), shape, generator=g)]  # noqa: E731
    prompts = pick(P, Tp).repeat_interleave(G, 0)
    completions = pick(N, C)
    answers = [str(7 + i % 5) for i in range(N)]
    for i in range(N):
        box = tokenizer(f" \\boxed{{{answers[i]}}}.", add_special_tokens=False)["input_ids"]
        start = min(int(float(bench.answer_position) * C), C - len(box))
        completions[i, start:start + len(box)] = torch.tensor(box)
    texts = tokenizer.batch_decode(completions.tolist(), skip_special_tokens=True)
    n_zero = round(float(bench.zero_advantage_fraction) * P)
    rewards = torch.tensor([float(grp >= n_zero and j % 2 == 0) for grp in range(P) for j in range(G)])
    mask = torch.ones(N, C)
    est = estimate(cfg.estimator, EstimatorInput(rewards, G, mask, scale_rewards=cfg.loss.scale_rewards))
    input_ids = torch.cat([prompts, completions], 1)
    attn = torch.ones_like(input_ids)
    return TrainingBatch(
        input_ids=input_ids.to(device), attention_mask=attn.to(device),
        position_ids=position_ids_from_mask(attn).to(device), prompt_length=Tp, completion_ids=completions.to(device),
        loss_mask=mask.to(device), advantages=est.sequence_advantages.to(device), rewards=rewards.to(device),
        texts=texts, sampler_logp=None,
        token_advantages=est.advantages.to(device) if est.advantages.dim() == 2 else None,
        group_ids=torch.arange(P).repeat_interleave(G).to(device), problems=[f"problem {i // G}" for i in range(N)],
        golds=[answers[i] if rewards[i] > 0 else "0" for i in range(N)], order=torch.arange(N, device=device))


# ------------------------------------------------------------------------------------------------ memory
class PeakMemory:
    """Peak memory growth over a ``with`` block: CUDA allocator statistics, or sampled RSS on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.peak_mb = 0.0

    @staticmethod
    def _rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        _malloc_trim()
        self.base = self._rss_mb()
        self._max = self.base
        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.002):
                self._max = max(self._max, self._rss_mb())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = (torch.cuda.max_memory_allocated() - self.base) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self._max, self._rss_mb()) - self.base
        return False


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


# ------------------------------------------------------------------------------------------------ timing
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_scheme(name: str, cfg: DictConfig, policy, initial_state: dict, tokenizer, bench: DictConfig,
                 device) -> list[dict]:
    """Per-step phase times of one scheme for each of ``bench.repeats`` timed rollout batches (after the warm-up)."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import share_prompts_of
    from grail_exp.tracking import NullTracker
    from grail_exp.training.module import Parts, RLVRModule

    with torch.no_grad():
        for k, v in policy.state_dict().items():
            v.copy_(initial_state[k])
    scheme = build_scheme(cfg.advantage, tokenizer, {"model": cfg.model, "seed": cfg.seed, "data": cfg.data,
                                                     "share_prompts": share_prompts_of(cfg)})
    module = RLVRModule(cfg, Parts(policy, tokenizer, scheme), NullTracker())
    module.manual_backward = lambda loss: loss.backward()  # no Lightning trainer here
    (opt,), (sched,) = module.configure_optimizers()
    sched = sched["scheduler"]
    template = synthetic_batch(tokenizer, bench, cfg, device)
    mu = int(bench.iterations)
    rows: list[dict] = []
    for r in range(int(bench.warmup) + int(bench.repeats)):
        batch = copy.copy(template)  # fields are replaced (permute, caches), never mutated in place
        batch.old_logp = batch.ref_logp = batch.cached_weights = batch.weights_ready = batch.prepared = None
        timings: dict[str, float] = {}
        _sync(device)
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            module.rollout.prepare(batch, timings)
            t1 = time.perf_counter()
            if module.rollout.needs_old_logp():
                batch.old_logp = module.rollout.logps(policy, batch)
            _sync(device)
            t2 = time.perf_counter()
            tokens = float(batch.loss_mask.sum())
            for it in range(mu):
                module.update.step(batch, opt, sched, tokens, timings, epoch=it)
                module.progress.step += 1
            _sync(device)
            t3 = time.perf_counter()
        steps_s = (t1 - t0) + (t3 - t2)  # prepare + the μ optimiser steps; the old-logp pass is reported apart
        scheme_s = (t1 - t0 + timings.get("scheme", 0.0)) / mu
        if r >= int(bench.warmup):
            rows.append({"old_logp_s": t2 - t1, "scheme_s": scheme_s, "update_s": steps_s / mu - scheme_s,
                         "step_s": steps_s / mu, "peak_mem_mb": mem.peak_mb,
                         # the same no-grad pass for every scheme, timed moments before: a speed reference that
                         # cancels how busy a shared machine was during this batch
                         "step_per_old_logp": (steps_s / mu) / max(t2 - t1, 1e-9)})
    if hasattr(opt, "remove_hooks"):  # fp32-master hooks on the shared policy's parameters
        opt.remove_hooks()
    del module, opt, sched
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


# ------------------------------------------------------------------------------------------------ the table
def schemes_table(results: dict, baseline: str = "grpo") -> str:
    from grail_exp.bench.real import table_markdown

    base = results.get(baseline)
    columns = ["scheme", "old_logp_s", "scheme_s", "update_s", "step_s", f"step / {baseline}",
               f"load-normalised step / {baseline}", "peak_mem_mb", f"mem / {baseline}"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, f"error: {r['error']}"] + [""] * 6)
            continue
        ratio = f"{r['step_s'] / base['step_s']:.2f}×" if base and "step_s" in base else "—"
        mem = f"{r['peak_mem_mb'] / base['peak_mem_mb']:.2f}×" if base and base.get("peak_mem_mb", 0) > 0 else "—"
        norm = (f"{r['step_per_old_logp'] / base['step_per_old_logp']:.2f}×"
                if base and base.get("step_per_old_logp") else "—")
        rows.append([name, f"{r['old_logp_s']:.3f}", f"{r['scheme_s']:.3f}", f"{r['update_s']:.3f}",
                     f"{r['step_s']:.3f}", ratio, norm, f"{r['peak_mem_mb']:.0f}", mem])
    return table_markdown(columns, "l" + "r" * 8, rows)


def describe(cfg: DictConfig, policy, bench: DictConfig, device) -> dict:
    from grail_exp.models.loading import count_parameters

    c = policy.config
    return {"model": cfg.model.name, "random_init": bool(cfg.model.get("random_init")),
            "parameters": count_parameters(policy), "vocab_size": int(c.vocab_size),
            "layers": int(c.num_hidden_layers), "hidden_size": int(c.hidden_size), "dtype": str(cfg.model.dtype),
            "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "loss_type": cfg.loss.loss_type,
            "logprob_chunk_tokens": cfg.trainer.logprob_chunk_tokens,
            "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
            **{f"bench.{k}": v for k, v in OmegaConf.to_container(bench).items() if k not in ("json", "markdown")}}


def _attention(bench, overrides: list[str], argv: list[str]) -> dict:
    """``bench.mode=attention``: one attention layer per shape; with run overrides also the run's policy forward and
    backward on the synthetic batch."""
    from grail_exp.bench.attention import main as attention_main

    if not overrides:
        return attention_main(bench, argv)
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_run_config(overrides, bench.baseline, bench, tmp)
        path = resolve_model_path(cfg)
        tokenizer = load_tokenizer(path, cfg)
        policy = load_causal_lm(path, cfg, trainable=True)
        batch = synthetic_batch(tokenizer, bench, cfg, torch.device("cpu"))
        return attention_main(bench, argv, policy=(cfg, policy, batch))


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):  # the other entry points get Hydra's help; this one composes by hand
        print(__doc__ + "\nKnobs: conf/bench.yaml (bench.*, json=, markdown=); any run override (model=..., advantage.*).")
        return {}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bench, overrides = parse_args(argv)
    if bench.mode == "real":  # real training steps of an experiment (grail_exp/bench/real.py)
        from grail_exp.bench.real import main as real_main

        return real_main(bench, overrides, argv)
    if bench.mode == "attention":  # the fused CPU attention kernel against the explicit one (bench/attention.py)
        return _attention(bench, overrides, argv)
    device = torch.device("cuda" if bench.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if bench.device == "auto" else bench.device))
    torch.manual_seed(int(bench.seed))
    names = scheme_names(bench)
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base_cfg = compose_run_config(overrides, names[0], bench, tmp)
        path = resolve_model_path(base_cfg)
        tokenizer = load_tokenizer(path, base_cfg)
        policy = load_causal_lm(path, base_cfg, trainable=True).to(device)
        initial = {k: v.detach().to("cpu", copy=True) for k, v in policy.state_dict().items()}  # off the GPU
        config = describe(base_cfg, policy, bench, device)
        log.info("bench: %s", json.dumps(config))
        rows: dict[str, list] = {n: [] for n in names}
        errors: dict[str, str] = {}
        cfgs = {name: compose_run_config(overrides, name, bench, tmp) for name in names}
        # Passes alternate the scheme order (ABC, CBA, ...) so drift in a shared machine's speed cancels in the medians
        # instead of favouring whichever scheme ran when the machine was quiet.
        for p in range(int(bench.passes)):
            for name in (names if p % 2 == 0 else names[::-1]):
                if name in errors:
                    continue
                try:
                    rows[name] += bench_scheme(name, cfgs[name], policy, initial, tokenizer, bench, device)
                except Exception as exc:  # one scheme's failure (e.g. it needs data the synthetic batch lacks)
                    log.exception("bench: scheme %s failed", name)
                    errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                log.info("pass %d, %s: %s", p + 1, name, errors.get(name) or medians(rows[name]))
        results = {n: ({"error": errors[n]} if n in errors else medians(rows[n])) for n in names}
    table = schemes_table(results, bench.baseline)
    print(table, flush=True)
    payload = {"schemes": results, "config": config, "command": "python -m grail_exp.bench " + " ".join(argv)}
    from grail_exp.bench.real import write_outputs

    write_outputs(bench, payload, json.dumps(config), table)
    return payload


if __name__ == "__main__":
    main()
