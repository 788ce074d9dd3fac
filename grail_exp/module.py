"""The LightningModule: one training step = one rollout batch and μ optimiser steps (design.md data flow).

    prompts ──rollout──▶ G completions each (+ the sampler's log-probs, truncation flags)
            ──reward───▶ r_i ∈ {0,1} (last \\boxed{} → math-verify)
            ──estimator▶ A_i, or A_{i,t} (estimator=grpo: group-relative)
            ──scheme.prepare(model, rollout batch)      (answer spans; batch-level schemes' weights)
    for each of μ inner iterations:                       (loss.num_iterations)
        for each micro-batch:                             (gradient accumulation)
            policy forward → logp (B, C), entropy         (chunked over the vocabulary: no (B, C, V) float32 copy)
            scheme → w (B, C)                             (GRPO: ones; GRAIL/OAR: from that same forward, live model)
            Â = sg(w)·A → policy loss × ρ^IS (+ β·KL) → aggregate (+ auxiliary terms) → backward
        gradients (fp32 masters; all-reduced across ranks) → clip → optimiser step → scheduler step → metrics

Manual optimisation (``automatic_optimization = False``) because one Lightning "batch" (a rollout batch) yields
μ optimiser steps, each over several micro-batches, exactly as TRL's GRPOTrainer with
``steps_per_generation == gradient_accumulation_steps``. ``self.step`` counts optimiser steps (it survives
resume, unlike Lightning's loop counters).

Data parallelism (trainer=ddp): every rank draws its own slice of the step's prompts (all G rollouts of a prompt
stay on one rank, so group statistics are exact), gradients are summed across ranks by one all-reduce per optimiser
step (equivalently DDP with ``no_sync`` on every micro-batch but the last), the dapo normaliser is the global
token count, metrics are averaged over ranks, and only rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import lightning as L
import torch

from grail_exp.advantages import SchemeBatch
from grail_exp.errors import UserError
from grail_exp.advantages.base import PolicyForward, slice_prepared
from grail_exp.advantages.probe import decoder_body, predicting_window
from grail_exp.data.prompting import encode_prompts
from grail_exp.estimators import ESTIMATORS, EstimatorInput, estimate
from grail_exp.loss import TermContext, is_weights, linear_logprob, policy_loss, selective_log_softmax
from grail_exp.loss.aggregation import AggregationContext, AGGREGATIONS
from grail_exp.optim import build_optimizer, grad_params
from grail_exp.rewards import strip_think
from grail_exp.rollout import SamplingParams, pad_completions
from grail_exp.rollout.variants import sample_variants

log = logging.getLogger(__name__)

# Aggregations whose value does not depend on how rows are split into micro-batches: rows may be reordered.
SPLIT_INVARIANT = ("grpo", "dr_grpo", "dapo", "token_sum", "seq_mean_token_sum")


class NonFiniteLossError(UserError, RuntimeError):
    """The loss went non-finite too often in a row: a config problem (lr, dtype); one line on the CLI."""


class Preempted(RuntimeError):
    """Raised after SIGTERM once the current optimiser step is done and a checkpoint is written."""


class SamplerMismatchError(RuntimeError):
    """The rollout engine's log-probs disagree with the trainer's: its weights are stale or wrong."""


@dataclass
class TrainingBatch:
    """A scored rollout batch, ready for the update (all tensors on the policy's device)."""

    input_ids: torch.Tensor  # (N, P+C)
    attention_mask: torch.Tensor  # (N, P+C)
    position_ids: torch.Tensor  # (N, P+C)
    prompt_length: int
    completion_ids: torch.Tensor  # (N, C)
    loss_mask: torch.Tensor  # (N, C) float
    advantages: torch.Tensor  # (N,) sequence advantages (the schemes' polarity); or the row summary of token ones
    rewards: torch.Tensor  # (N,)
    texts: list[str]
    old_logp: torch.Tensor | None = None  # (N, C) trainer log-probs at the rollout parameters (μ > 1 or IS)
    ref_logp: torch.Tensor | None = None  # (N, C) when beta > 0
    sampler_logp: torch.Tensor | None = None  # (N, C) the rollout engine's log-probs
    token_advantages: torch.Tensor | None = None  # (N, C) token-level estimators
    group_ids: torch.Tensor | None = None  # (N,) prompt index within the rank's batch
    problems: list[str] | None = None
    golds: list[str] | None = None
    cached_weights: torch.Tensor | None = None  # (N, C) recompute=per_rollout: weights of the first iteration
    order: torch.Tensor | None = None  # (N,) rollout row of each row (after grouping probe rows)

    _TENSORS = ("input_ids", "attention_mask", "position_ids", "completion_ids", "loss_mask", "advantages", "rewards",
                "old_logp", "ref_logp", "sampler_logp", "token_advantages", "group_ids", "cached_weights", "order")

    def micro_batches(self, size: int):
        n = self.input_ids.shape[0]
        for s in range(0, n, size):
            yield s, min(s + size, n)

    def permute(self, perm: torch.Tensor) -> None:
        """Reorder the rows in place (tensors and lists)."""
        for k in self._TENSORS:
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, v[perm.to(v.device)])
        for k in ("texts", "problems", "golds"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, [v[i] for i in perm.tolist()])

    def to_state(self) -> dict:
        return {"prompt_length": self.prompt_length, "texts": list(self.texts), "problems": self.problems,
                "golds": self.golds,
                "tensors": {k: getattr(self, k).detach().cpu() for k in self._TENSORS if getattr(self, k) is not None}}

    @classmethod
    def from_state(cls, st: dict, device) -> "TrainingBatch":
        t = {k: v.to(device) for k, v in st["tensors"].items()}
        return cls(prompt_length=st["prompt_length"], texts=st["texts"], problems=st.get("problems"),
                   golds=st.get("golds"), **t)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` used for a left-padded batch (cumsum − 1), so ratios are exact."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logits(model, input_ids, attention_mask, position_ids, completion_len: int, temperature: float):
    """Logits at the C positions that predict the completion tokens: (B, C, V), divided by the temperature.

    The straightforward path (the model's own forward); the trainer uses ``policy_forward`` instead.
    ``logits_to_keep = C + 1`` keeps only the completion window, never the prompt's (B, P, V) logits.
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=completion_len + 1, use_cache=False)
    logits = out.logits[:, :-1, :]
    return logits / temperature if temperature != 1.0 else logits


def policy_forward(model, input_ids, attention_mask, position_ids, completion_ids, temperature: float, *,
                   chunk_tokens: int = 4096, hidden_states: bool = False):
    """The trainer's policy forward of a micro-batch: token log-probs and entropies (B, C) in float32, and the
    forward's embeddings / hidden states for schemes that reuse it (``PolicyForward``).

    Runs the decoder body on the embeddings (so GRAIL can take gradients w.r.t. them) and the output layer through
    ``linear_logprob`` (chunks of ``chunk_tokens`` rows; no (B, C, V) float32 logits). For causal LMs whose head
    is a plain linear layer (Qwen3, Llama, Mistral, ...) this is the model's own forward, computed differently.
    """
    P, C = input_ids.shape[1] - completion_ids.shape[1], completion_ids.shape[1]
    embeds = model.get_input_embeddings()(input_ids)
    out = decoder_body(model)(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, output_hidden_states=hidden_states)
    h = out.last_hidden_state
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    bias = bias if bias is not None and bias.numel() else None
    logp, entropy = linear_logprob(predicting_window(h, P, C), head.weight, bias, completion_ids, temperature,
                                   chunk_tokens)
    fwd = PolicyForward(embeds, h, out.hidden_states if hidden_states else None, head.weight, bias)
    return logp, entropy, fwd


class GRPOModule(L.LightningModule):
    def __init__(self, cfg, policy, tokenizer, scheme, engine, source, verifier, tracker, ref_model=None,
                 evaluate_fn=None, resume_state: dict | None = None, terms: list | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.policy = policy
        self.ref_model = ref_model
        self.tokenizer = tokenizer
        self.scheme = scheme
        self.engine = engine
        self.source = source
        self.verifier = verifier
        self.tracker = tracker
        self.terms = terms or []
        self.evaluate_fn = evaluate_fn  # called every trainer.eval_every optimiser steps
        self.checkpoint_fn = None  # position -> None; set by run.py
        self.weights_fn = None  # step -> None: weights-only trajectory save; set by run.py
        self.stop_requested = False  # set by the SIGTERM handler
        # Resume: optimiser steps done so far, the checkpoint's state (loaded in on_train_start) and any
        # half-used rollout batch (num_iterations > 1).
        self.resume_state = resume_state
        self.step = int(resume_state["step"]) if resume_state else 0
        # The process group does not exist yet (Lightning creates it later): the launcher's rank picks this rank's
        # half-used rollout batch, not rank 0's.
        from grail_exp.distributed import launch_rank

        rank_state = _rank_state(resume_state, launch_rank())
        self.resume_buffer = rank_state.get("buffer") if rank_state else None
        self.position = {"round": int(resume_state["round"]) if resume_state else 0, "buffer": self.resume_buffer}
        # GRPO family (issue 15): dynamic sampling's data position and the KL-in-reward controller (both checkpointed).
        self.prompt_cursor = int(resume_state.get("prompt_cursor", 0)) if resume_state else 0
        self.kl_controller = None
        G = cfg.rollout.num_generations
        self.completions_per_step = cfg.trainer.prompts_per_step * G  # over all ranks
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.last_metrics: dict[str, float] = {}
        self.logp_diff_history: list[float] = []
        self.weight_tables: list = []  # per-token weights logged for the report's plots
        # Stochastic schemes (OAR-G's noise) draw from their own seeded stream: reproducible, and
        # independent of the sampling RNG. Saved and restored with checkpoints.
        self.scheme_generator = torch.Generator(device="cpu").manual_seed(int(cfg.seed) + 7919)
        self.fsdp = str(cfg.trainer.strategy) == "fsdp"
        self.core = None  # trainer=fsdp: the sharded root unit running policy_forward (configure_model)
        self.zero = None  # trainer=deepspeed_zero2: the DeepSpeed ZeRO engine around the policy (configure_optimizers)

    # ------------------------------------------------------------------ distributed
    @property
    def world_size(self) -> int:
        d = torch.distributed
        return d.get_world_size() if d.is_available() and d.is_initialized() else 1

    @property
    def rank(self) -> int:
        d = torch.distributed
        return d.get_rank() if d.is_available() and d.is_initialized() else 0

    @property
    def local_completions(self) -> int:
        return self.completions_per_step // self.world_size

    @property
    def micro_batch_size(self) -> int:
        return min(self.cfg.trainer.micro_batch_size, self.local_completions)

    @property
    def accumulation_steps(self) -> int:
        return self.local_completions // self.micro_batch_size

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(x)
        return x

    def setup(self, stage: str) -> None:
        if self.world_size > 1:
            # Different sampling / noise streams per rank (rank 0 keeps the single-process streams).
            self.scheme_generator.manual_seed(int(self.cfg.seed) + 7919 + 1000 * self.rank)
            if self.rank:
                L.seed_everything(int(self.cfg.seed) + 1000 * self.rank, verbose=False)

    def configure_model(self) -> None:
        if self.fsdp and self.core is None:
            from grail_exp.distributed import shard_policy

            self.core = shard_policy(self.policy, self.cfg)

    def forward_policy(self, model, input_ids, attention_mask, position_ids, completion_ids, *, hidden_states=False):
        """``policy_forward`` of the policy (through the FSDP root unit when sharded) or of another model."""
        args = (input_ids, attention_mask, position_ids, completion_ids, self.cfg.rollout.temperature)
        if self.core is not None and model is self.policy:
            return self.core(*args, self.cfg.trainer.logprob_chunk_tokens, hidden_states)
        return policy_forward(model, *args, chunk_tokens=self.cfg.trainer.logprob_chunk_tokens,
                              hidden_states=hidden_states)

    def full_parameters(self):
        from grail_exp.distributed import full_parameters

        return full_parameters(self.core)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        o = self.cfg.optim
        half = next(self.policy.parameters()).dtype in (torch.bfloat16, torch.float16)
        master = o.master_weights if o.master_weights is not None else half
        if self.fsdp:
            master = False  # FSDP's fp32 sharded parameters are the master weights
        # fp32 gradient accumulation hooks move gradients off the parameters during backward: fine on one
        # process; under data parallelism the all-reduce needs them on the parameters first.
        if str(self.cfg.trainer.strategy) == "deepspeed":
            from grail_exp import deepspeed_zero

            # ZeRO keeps the fp32 master partition and Adam state; the client AdamW it steps is plain.
            opt = build_optimizer(self.policy, o, master_weights=False)
            self.zero = deepspeed_zero.initialize(self.policy, opt, self.cfg)
        else:
            opt = build_optimizer(self.policy, o, master_weights=bool(master), accumulate_fp32=self.world_size == 1)
        warmup = o.warmup_steps

        def constant_with_warmup(step: int) -> float:  # transformers' get_constant_schedule_with_warmup
            return step / max(1, warmup) if step < warmup else 1.0

        sched = torch.optim.lr_scheduler.LambdaLR(opt, constant_with_warmup)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    # ------------------------------------------------------------------ rollout + scoring
    @torch.no_grad()
    def make_batch(self, round_index: int, timings: dict) -> tuple[TrainingBatch, dict]:
        cfg, r = self.cfg, self.cfg.rollout
        P_total = cfg.trainer.prompts_per_step
        P = P_total // self.world_size
        with _timer(timings, "rollout"):
            t = time.perf_counter()
            with self.full_parameters():
                self.engine.sync_weights(self.policy)
                timings["weight_sync"] = time.perf_counter() - t
        # --- GRPO family hook (issue 15): dynamic sampling draws whole groups until P are informative.
        problems, completions, texts, graded, variant_infos, family_stats = self._sample_groups(round_index, P, timings)
        rb = pad_completions(completions, self.tokenizer.pad_token_id)
        golds = [p.answer for p in problems for _ in range(r.num_generations)]
        rewards = torch.tensor([float(g.correct) for g in graded])
        ob = cfg.reward.get("overlong_buffer")
        if ob is not None and ob.enabled:  # GRPO family hook: DAPO soft overlong punishment (a reward transform)
            from grail_exp.family import overlong_penalty

            penalty = overlong_penalty(rb.completion_mask.sum(1), r.max_completion_length, ob.length, ob.penalty_factor)
            rewards = rewards + penalty
            family_stats["reward/overlong_penalty_mean"] = penalty.mean().item()

        loss_mask = rb.completion_mask.float()
        if cfg.loss.mask_truncated_completions:
            loss_mask = loss_mask * (~rb.is_truncated).float().unsqueeze(1)
        attn = rb.attention_mask
        dev = self.policy.device
        batch = TrainingBatch(
            input_ids=rb.input_ids.to(dev), attention_mask=attn.to(dev),
            position_ids=position_ids_from_mask(attn).to(dev), prompt_length=rb.prompt_ids.shape[1],
            completion_ids=rb.completion_ids.to(dev), loss_mask=loss_mask.to(dev),
            advantages=torch.zeros(len(texts), device=dev), rewards=rewards.to(dev), texts=texts,
            sampler_logp=rb.sampling_logprobs.to(dev) if rb.sampling_logprobs is not None else None,
            group_ids=torch.arange(P).repeat_interleave(r.num_generations).to(dev),
            problems=[p.question for p in problems for _ in range(r.num_generations)], golds=golds,
            order=torch.arange(len(texts), device=dev),
        )
        # GRPO family hook: what the estimator asks for (greedy rewards, Σπ²) and KL-in-reward, before the advantages.
        extras, rewards = self._estimator_extras(batch, problems, completions, texts, variant_infos, rewards,
                                                 family_stats, timings)
        est = estimate(cfg.estimator, EstimatorInput(rewards, r.num_generations, loss_mask,
                                                     scale_rewards=cfg.loss.scale_rewards, extras=extras))
        if est.rewards is not None:  # e.g. SCRL: a curriculum row's reward is its subproblem progress
            rewards = est.rewards.float()
        seq_adv = est.sequence_advantages
        batch.advantages = seq_adv.to(dev)
        batch.rewards = rewards.to(dev)
        batch.token_advantages = est.advantages.to(dev) if est.advantages.dim() == 2 else None
        lengths = rb.completion_mask.sum(1).float()
        term = lengths[~rb.is_truncated]
        stats = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
            "accuracy": sum(g.correct for g in graded) / len(graded),
            "frac_reward_zero_std": est.zero_std.float().mean().item(),
            "reward/no_answer_rate": sum(g.status == "no_answer" for g in graded) / len(graded),
            "reward/timeouts": float(sum(g.status == "timeout" for g in graded)),
            "reward/errors": float(sum(g.status == "error" for g in graded)),
            "advantage/abs_mean": seq_adv.abs().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/mean_terminated_length": term.mean().item() if term.numel() else 0.0,
            "completions/truncated_rate": rb.is_truncated.float().mean().item(),
            **{f"estimator/{k}": v for k, v in est.metrics.items()},
            **family_stats,
        }
        self._samples = [(problems[i // r.num_generations], texts[i], graded[i], rewards[i].item(),
                          seq_adv[i].item()) for i in range(len(texts))]
        return batch, stats

    # ------------------------------------------------------------------ GRPO family hooks (issue 15)
    def _generate_and_grade(self, problems: list, n: int, temperature: float, timings: dict, plan=None):
        """Sample ``n`` completions per problem (temperature 0 = greedy) and grade them. With a ``plan`` (an
        estimator's ``prompt_variants``, e.g. SCRL) each problem's n rollouts come from its variants, in plan order;
        returns (completions, texts, graded, per-row variant infos or None)."""
        cfg, r = self.cfg, self.cfg.rollout
        params = SamplingParams(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_completion_length, repetition_penalty=r.repetition_penalty,
                                logprobs=True)
        with _timer(timings, "rollout"), self.full_parameters():
            if plan is None:
                prompts = encode_prompts([p.question for p in problems], self.tokenizer, cfg.model, cfg.data.instruction)
                completions, variant_infos = self.engine.generate(prompts, params), None
            else:
                completions, variant_infos = sample_variants(self.engine, self.tokenizer, cfg.model,
                                                             cfg.data.instruction, plan, params)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        with _timer(timings, "scoring"):
            golds = [p.answer for p in problems for _ in range(n)]
            graded = self.verifier.score([strip_think(t) if cfg.model.strip_think else t for t in texts], golds)
        return completions, texts, graded, variant_infos

    def _sample_groups(self, round_index: int, P: int, timings: dict):
        """The step's P groups of G completions. Without dynamic sampling: prompts round·P_total + rank·P onwards
        (through the estimator's prompt plan when it has one, e.g. SCRL).
        With ``rollout.dynamic_sampling`` (DAPO §3.2): draw P prompts at a time from ``self.prompt_cursor``, keep the
        groups whose rewards differ, at most ``max_extra_rounds`` extra rounds, then top up with dropped groups
        (validate() rejects it with an estimator that plans its prompts)."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        ds = cfg.rollout.get("dynamic_sampling")
        if ds is None or not ds.enabled:
            first = round_index * cfg.trainer.prompts_per_step + self.rank * P  # this rank's slice of the step's prompts
            problems = [self.source[i] for i in range(first, first + P)]
            spec = ESTIMATORS[cfg.estimator.name]
            # Estimators that sample from several prompts per problem (SCRL) plan them; the others get G of the problem.
            plan = spec.prompt_variants(cfg.estimator, problems, G, cfg.data) if spec.prompt_variants else None
            completions, texts, graded, variant_infos = self._generate_and_grade(
                problems, G, cfg.rollout.temperature, timings, plan)
            return problems, completions, texts, graded, variant_infos, {}
        from grail_exp.family import informative_groups

        kept, dropped, rounds = [], [], 0
        while len(kept) < P and rounds <= ds.max_extra_rounds:
            problems = [self.source[i] for i in range(self.prompt_cursor, self.prompt_cursor + P)]
            self.prompt_cursor += P
            rounds += 1
            completions, texts, graded, _ = self._generate_and_grade(problems, G, cfg.rollout.temperature, timings)
            good = informative_groups(torch.tensor([float(g.correct) for g in graded]), G).tolist()
            for j, p in enumerate(problems):
                group = (p, completions[j * G:(j + 1) * G], texts[j * G:(j + 1) * G], graded[j * G:(j + 1) * G])
                (kept if good[j] else dropped).append(group)
        n_kept = min(len(kept), P)
        groups = (kept + dropped)[:P]  # verl raises when the bound is hit; we train on a full batch and log it
        stats = {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": float(n_kept),
                 "dynamic_sampling/dropped_groups": float(len(dropped)),
                 "dynamic_sampling/filled_with_dropped": float(P - n_kept),
                 "dynamic_sampling/prompt_cursor": float(self.prompt_cursor)}
        return ([g[0] for g in groups], [c for g in groups for c in g[1]], [t for g in groups for t in g[2]],
                [x for g in groups for x in g[3]], None, stats)

    def _estimator_extras(self, batch: TrainingBatch, problems: list, completions, texts, variant_infos,
                          rewards: torch.Tensor, stats: dict, timings: dict):
        """What the estimator's ``needs`` asks for (grail_exp/estimators/__init__.py lists the names), computed only
        when asked, and the KL-in-reward penalty; returns (extras, rewards)."""
        cfg = self.cfg

        def greedy_rewards():  # ReMax: one greedy completion per prompt, graded
            graded = self._generate_and_grade(problems, 1, 0.0, timings)[2]
            return {"greedy_rewards": torch.tensor([float(g.correct) for g in graded])}

        def sum_pi_squared():  # OTB: π(o_t) and Σπ² of the rollout policy, chunked over the vocabulary
            from grail_exp.estimators.otb import sum_pi_squared_from_hidden

            logps, spps = [], []
            with _timer(timings, "sum_pi_squared"), torch.no_grad(), self.full_parameters():
                for s, e in batch.micro_batches(self.micro_batch_size):
                    logp, _, fwd = self.forward_policy(self.policy, batch.input_ids[s:e], batch.attention_mask[s:e],
                                                       batch.position_ids[s:e], batch.completion_ids[s:e])
                    h = predicting_window(fwd.hidden, batch.prompt_length, batch.completion_ids.shape[1])
                    spps.append(sum_pi_squared_from_hidden(h, fwd.head_weight, fwd.head_bias,
                                                           cfg.rollout.temperature, cfg.trainer.logprob_chunk_tokens))
                    logps.append(logp)
            return {"logp": torch.cat(logps).cpu(), "sum_pi_squared": torch.cat(spps).cpu()}

        available = {"completion_texts": lambda: {"completion_texts": texts},
                     "completion_token_ids": lambda: {"completion_token_ids": [c.token_ids for c in completions]},
                     "tokenizer": lambda: {"tokenizer": self.tokenizer}, "verifier": lambda: {"verifier": self.verifier},
                     "rollout_variants": lambda: {"rollout_variants": variant_infos or [None] * len(texts)},
                     "greedy_rewards": greedy_rewards, "sum_pi_squared": sum_pi_squared}
        extras: dict = {}
        for k in ESTIMATORS[cfg.estimator.name].needs:
            if k in available:
                extras.update(available[k]())
        kir = cfg.loss.get("kl_in_reward")
        if kir is not None and kir.enabled:  # r_i <- r_i - β Σ_t KL_t (needs the reference before the advantages)
            from grail_exp.family import KLInRewardController
            from grail_exp.loss import KL_ESTIMATORS

            if self.kl_controller is None:
                self.kl_controller = KLInRewardController(kir)
            with _timer(timings, "old_logp"):
                if batch.old_logp is None:
                    batch.old_logp = self._logps_no_grad(self.policy, batch)
                batch.ref_logp = self._logps_no_grad(self.ref_model, batch)
            kl = KL_ESTIMATORS[kir.estimator](batch.old_logp, batch.ref_logp).cpu()
            rewards, m = self.kl_controller.penalise(rewards, kl, batch.loss_mask.cpu())
            stats.update(m)
        return extras, rewards

    def scheme_batch(self, batch: TrainingBatch, s: int | None = None, e: int | None = None) -> SchemeBatch:
        """The scheme's view of rows s:e (all rows when None), with the rollout-batch context."""
        sl = slice(s, e)
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)[sl]
        return SchemeBatch(
            input_ids=batch.input_ids[sl], attention_mask=batch.attention_mask[sl],
            position_ids=batch.position_ids[sl], prompt_length=batch.prompt_length,
            completion_ids=batch.completion_ids[sl], completion_mask=batch.loss_mask[sl],
            advantages=batch.advantages[sl], rewards=batch.rewards[sl], completion_texts=batch.texts[sl],
            sampling_temperature=self.cfg.rollout.temperature, generator=self.scheme_generator, row_index=rows,
            group_ids=batch.group_ids[sl] if batch.group_ids is not None else None,
            num_generations=self.cfg.rollout.num_generations,
            problems=batch.problems[sl] if batch.problems else None,
            gold_answers=batch.golds[sl] if batch.golds else None,
            token_advantages=batch.token_advantages[sl] if batch.token_advantages is not None else None,
            step=self.step, prepared=slice_prepared(getattr(batch, "prepared", None), rows) if s is not None else None,
        )

    def prepare_batch(self, batch: TrainingBatch, timings: dict) -> None:
        """Once per rollout batch: the scheme's ``prepare`` on the whole batch, then (when the loss allows it) group the
        rows whose weights need the model into the first micro-batches, so the others skip the probe."""
        with _timer(timings, "scheme_prepare"), self.full_parameters():
            batch.prepared = self.scheme.prepare(self.policy, self.scheme_batch(batch))
            needs = None
            if self.cfg.loss.loss_type in SPLIT_INVARIANT:
                whole = self.scheme_batch(batch)
                whole.prepared = batch.prepared
                needs = self.scheme.rows_needing_model(whole)
            if needs is not None and 0 < int(needs.sum()) < needs.numel():
                perm = torch.cat([needs.nonzero().squeeze(1), (~needs).nonzero().squeeze(1)])  # stable within each part
                batch.permute(perm)
                batch.prepared = slice_prepared(batch.prepared, perm)

    @torch.no_grad()
    def _logps_no_grad(self, model, batch: TrainingBatch) -> torch.Tensor:
        out = []
        for s, e in batch.micro_batches(self.micro_batch_size):
            logp, _, _ = self.forward_policy(model, batch.input_ids[s:e], batch.attention_mask[s:e],
                                             batch.position_ids[s:e], batch.completion_ids[s:e])
            out.append(logp)
        return torch.cat(out)

    def _needs_old_logp(self) -> bool:
        return self.cfg.loss.num_iterations > 1 or self.cfg.rollout.is_correction.mode != "none"

    # ------------------------------------------------------------------ the step
    def training_step(self, round_index, batch_idx):
        cfg = self.cfg
        timings: dict[str, float] = {}
        t_step = time.perf_counter()
        round_index = int(round_index)
        first_iteration = 0
        if self.resume_buffer is not None and self.resume_buffer["round"] == round_index:
            # Resumed mid-round: continue the saved rollout batch instead of sampling a new one.
            batch, stats, first_iteration = self._unpack_buffer(self.resume_buffer)
            self.resume_buffer = None
        else:
            batch, stats = self.make_batch(round_index, timings)
            self.prepare_batch(batch, timings)
            with _timer(timings, "old_logp"):
                if self._needs_old_logp() and batch.old_logp is None:
                    batch.old_logp = self._logps_no_grad(self.policy, batch)
                if (cfg.loss.beta > 0 or any(t.needs_reference for t in self.terms)) and batch.ref_logp is None:
                    batch.ref_logp = self._logps_no_grad(self.ref_model, batch)
            if batch.old_logp is not None and batch.sampler_logp is not None:
                stats.update(self._check_sampler(batch))
        local_tokens = torch.tensor(float(batch.loss_mask.sum()), dtype=torch.float64)
        global_tokens = float(self._all_reduce_sum(local_tokens))
        opt = self.optimizers()
        sched = self.lr_schedulers()

        for iteration in range(first_iteration, cfg.loss.num_iterations):
            if self.step >= cfg.trainer.max_steps:
                break
            step_metrics = self._optimizer_step(batch, opt, sched, global_tokens, timings, iteration)
            self.step += 1
            step = self.step
            step_metrics.update(stats)
            step_metrics.update({f"timing/{k}_s": v for k, v in timings.items()})
            step_metrics["timing/step_s"] = time.perf_counter() - t_step
            step_metrics["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            if torch.cuda.is_available():
                step_metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
            step_metrics["grading/timeouts_total"] = float(self.verifier.counters.get("timeout", 0))
            step_metrics = self._reduce_metrics(step_metrics)
            self.last_metrics = step_metrics
            if step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps:
                self.tracker.log_metrics(step_metrics, step=step)
            self._progress_line(step, step_metrics)
            self.log_dict({"reward": stats["reward/mean"], "loss": step_metrics["loss"]},
                          prog_bar=True, logger=False, on_step=True, batch_size=1)
            if cfg.trainer.sample_table_every and getattr(self, "_samples", None) \
                    and (step == 1 or step % cfg.trainer.sample_table_every == 0):
                self._log_sample_table(step)
            self._log_weight_table(step)
            if self.evaluate_fn and cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 \
                    and step < cfg.trainer.max_steps:
                self.evaluate_fn(step)
            # The data position after this step: the same round (with its buffer) until its last iteration.
            done_round = iteration == cfg.loss.num_iterations - 1
            position = {"round": round_index + 1 if done_round else round_index,
                        "buffer": None if done_round else self._pack_buffer(batch, stats, round_index, iteration + 1)}
            self.position = position
            every = cfg.trainer.checkpoint_every
            if self.checkpoint_fn and (self.stop_requested or (every and step % every == 0)):
                self.checkpoint_fn(position)
            every = cfg.trainer.save_weights_only_every
            if self.weights_fn and every and step % every == 0:
                self.weights_fn(step)
            if self.stop_requested:
                raise Preempted(f"stopped by signal after step {step}; checkpoint written")
            timings = {}
            t_step = time.perf_counter()

    def _progress_line(self, step: int, m: dict[str, float]) -> None:
        """One INFO line every trainer.progress_log_every steps: what a redirected log (SLURM, CI, nohup) shows of
        the run, where the progress bar does not reach. Rank 0 only; the ETA extrapolates this session's pace."""
        every, total = self.cfg.trainer.progress_log_every, self.cfg.trainer.max_steps
        if not every or self.rank != 0 or not (step % every == 0 or step == total):
            return
        now = time.perf_counter()
        first = getattr(self, "_progress_origin", None)
        if first is None:  # the first step of this session (a resumed run starts mid-way)
            first = self._progress_origin = (step - 1, now - m["timing/step_s"])
        pace = (now - first[1]) / max(1, step - first[0])
        log.info("step %d/%d  reward %.3f  loss %+.4f  length %.0f  %.2f s/step  ETA %s", step, total,
                 m["reward/mean"], m["loss"], m.get("completions/mean_length", math.nan), pace,
                 time.strftime("%H:%M:%S", time.gmtime(pace * (total - step))))

    def _check_sampler(self, batch: TrainingBatch) -> dict[str, float]:
        """Sampler-vs-trainer agreement on the sampled tokens: ~0 for rollout=hf (same weights, same distribution);
        for vLLM the mismatch the IS correction handles — and the alarm for a stale weight sync."""
        m = batch.loss_mask
        diff = ((batch.old_logp - batch.sampler_logp).abs() * m).sum() / m.sum().clamp(min=1)
        value = float(self._all_reduce_sum(diff.detach().double().cpu()) / self.world_size)
        chk = self.cfg.rollout.sampler_check
        history = self.logp_diff_history
        if chk.max_abs_diff is not None and value > chk.max_abs_diff:
            raise SamplerMismatchError(
                f"mean |logp_trainer - logp_sampler| = {value:.4f} > rollout.sampler_check.max_abs_diff = "
                f"{chk.max_abs_diff}: the rollout engine is not sampling from the trained weights (stale weight sync?).")
        if chk.jump_factor and len(history) >= chk.warmup_steps:
            typical = sorted(history)[len(history) // 2]
            if value > chk.jump_factor * max(typical, chk.min_diff):
                raise SamplerMismatchError(
                    f"mean |logp_trainer - logp_sampler| jumped to {value:.4f} from a median of {typical:.4f} "
                    f"(> rollout.sampler_check.jump_factor = {chk.jump_factor}x): the engine's weights are out of sync "
                    "(e.g. sleep mode reloading the initial weights after a sync).")
        history.append(value)
        del history[:-100]
        return {"sampling/logp_abs_diff_mean": value}

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average every metric over ranks (rank 0 logs them)."""
        if self.world_size == 1:
            return metrics
        gathered: list = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, metrics)
        keys = set().union(*(g.keys() for g in gathered))
        return {k: sum(g[k] for g in gathered if k in g) / sum(k in g for g in gathered) for k in keys}

    # ------------------------------------------------------------------ checkpoint state
    def _pack_buffer(self, batch: TrainingBatch, stats: dict, round_index: int, next_iteration: int) -> dict:
        return {"round": round_index, "next_iteration": next_iteration, "stats": dict(stats),
                "batch": batch.to_state(), "prepared": getattr(batch, "prepared", None)}

    def _unpack_buffer(self, buf: dict):
        batch = TrainingBatch.from_state(buf["batch"], self.policy.device)
        batch.prepared = buf.get("prepared")
        return batch, buf["stats"], buf["next_iteration"]

    def rank_state(self, position: dict) -> dict:
        """What differs between data-parallel ranks: RNG streams and the half-used rollout batch."""
        from grail_exp.checkpoint import rng_state

        return {"rng": rng_state(), "scheme_generator": self.scheme_generator.get_state(), "buffer": position["buffer"]}

    def _optimizer_state(self) -> dict | list:
        if self.zero is not None:  # a collective: every rank's ZeRO partition, gathered to rank 0
            from grail_exp import deepspeed_zero

            return deepspeed_zero.optimizer_state(self.zero, self.world_size, self.rank)
        if self.fsdp:  # a collective: the full (unsharded) state, gathered to CPU
            from grail_exp.distributed import full_optimizer_state

            return full_optimizer_state(self.core, self.optimizers().optimizer)
        return self.optimizers().optimizer.state_dict()

    def model_state_for_checkpoint(self) -> dict | None:
        """The policy's full state dict when it is sharded (a collective), else None (save_pretrained reads it)."""
        if self.fsdp:
            from grail_exp.distributed import full_state_dict

            return full_state_dict(self.core)
        return None

    def state_for_checkpoint(self, position: dict) -> dict:
        """Everything exact resume needs besides the weights (tensors and plain containers only); every rank's
        RNG streams and buffer are gathered into rank 0's file."""
        mine = self.rank_state(position)
        ranks = [mine]
        if self.world_size > 1:
            ranks = [None] * self.world_size
            torch.distributed.all_gather_object(ranks, mine)
        return {
            "step": self.step,
            "round": position["round"],
            "world_size": self.world_size,
            "ranks": ranks,
            "optimizer": self._optimizer_state(),
            "scheduler": self.lr_schedulers().state_dict(),
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "logp_diff_history": list(self.logp_diff_history),
            "mlflow_run_id": getattr(self.tracker, "run_id", None),
            # GRPO family (issue 15): data cursor of dynamic sampling, KL-in-reward β, stateful loss terms.
            "prompt_cursor": self.prompt_cursor,
            "kl_controller": self.kl_controller.state_dict() if self.kl_controller is not None else None,
            "terms": {t.name: t.state_dict() for t in self.terms},
        }

    def on_train_start(self) -> None:
        if self.resume_state is None:
            return
        from grail_exp.checkpoint import CheckpointError, set_rng_state

        st = self.resume_state
        saved_world = int(st.get("world_size", 1))
        if saved_world != self.world_size:
            raise CheckpointError(f"the checkpoint was written by {saved_world} data-parallel ranks; resume with the "
                               f"same trainer.devices x trainer.num_nodes (now {self.world_size})")
        if self.fsdp:
            from grail_exp.distributed import load_full_optimizer_state

            load_full_optimizer_state(self.core, self.optimizers().optimizer, st["optimizer"])
        elif self.zero is not None:
            from grail_exp import deepspeed_zero

            deepspeed_zero.load_optimizer_state(self.zero, st["optimizer"])
        else:
            self.optimizers().optimizer.load_state_dict(st["optimizer"])
        self.lr_schedulers().load_state_dict(st["scheduler"])
        mine = _rank_state(st, self.rank)
        set_rng_state(mine["rng"])
        self.scheme_generator.set_state(mine["scheme_generator"])
        self.nonfinite_total, self.nonfinite_in_a_row = st["nonfinite_total"], st["nonfinite_in_a_row"]
        self.logp_diff_history = list(st.get("logp_diff_history", []))
        if st.get("kl_controller") is not None:  # GRPO family (issue 15)
            from grail_exp.family import KLInRewardController

            self.kl_controller = KLInRewardController(self.cfg.loss.kl_in_reward)
            self.kl_controller.load_state_dict(st["kl_controller"])
        for term in self.terms:
            if term.name in st.get("terms", {}):
                term.load_state_dict(st["terms"][term.name])

    # ------------------------------------------------------------------ one optimiser step
    def _weights(self, batch: TrainingBatch, s: int, e: int, iteration: int, fwd: PolicyForward):
        """The scheme's weights of rows s:e (per_rollout: computed at the first iteration, then reused)."""
        per_rollout = self.scheme.cfg.get("recompute", "per_update") == "per_rollout"
        if per_rollout and batch.cached_weights is not None and iteration > 0:
            return batch.cached_weights[s:e], {}, False
        sb = self.scheme_batch(batch, s, e)
        out = None
        if self.scheme.needs_model:
            out = self.scheme.weights_from_forward(self.policy, sb, fwd)
        if out is None:
            out = self.scheme.weights(self.policy, sb)
        w = out.weights.detach()
        if per_rollout:
            if batch.cached_weights is None:
                batch.cached_weights = torch.zeros_like(batch.loss_mask)
            batch.cached_weights[s:e] = w.to(batch.cached_weights.dtype)
        return w, out.metrics, True

    def _optimizer_step(self, batch: TrainingBatch, opt, sched, global_tokens: float, timings: dict,
                        iteration: int) -> dict[str, float]:
        cfg = self.cfg
        sums: dict[str, float] = {}  # token-weighted sums of per-micro-batch masked means
        counts: dict[str, float] = {}
        t_scheme = 0.0
        t0 = time.perf_counter()
        loss_total = 0.0
        need_states = "hidden_states" in getattr(self.scheme, "forward_outputs", ())
        agg_ctx = AggregationContext(cfg.rollout.max_completion_length, self.accumulation_steps, global_tokens,
                                     self.world_size)
        for s, e in batch.micro_batches(self.micro_batch_size):
            mask = batch.loss_mask[s:e]
            logp, entropy, fwd = self.forward_policy(
                self.policy, batch.input_ids[s:e], batch.attention_mask[s:e], batch.position_ids[s:e],
                batch.completion_ids[s:e], hidden_states=need_states)

            mask, mask_metrics = self._family_token_mask(batch, s, e, mask, logp, entropy)  # GRPO family hook

            ts = time.perf_counter()
            w, scheme_metrics, fresh = self._weights(batch, s, e, iteration, fwd)
            t_scheme += time.perf_counter() - ts
            adv = batch.token_advantages[s:e] if batch.token_advantages is not None \
                else batch.advantages[s:e].unsqueeze(1)
            token_adv = w.float() * adv.float()  # Â = sg(w)·A in float32, (B, C)

            old = batch.old_logp[s:e] if batch.old_logp is not None else logp.detach()
            isw, is_metrics = None, {}
            ic = cfg.rollout.is_correction
            if ic.mode != "none" and batch.sampler_logp is not None:
                isw, is_metrics = is_weights(old, batch.sampler_logp[s:e], mask, ic.mode, ic.clip_min, ic.clip_max)
            out = policy_loss(
                logp, old, token_adv, mask, loss_type=cfg.loss.loss_type, epsilon=cfg.loss.epsilon,
                epsilon_high=cfg.loss.epsilon_high, max_completion_length=cfg.rollout.max_completion_length,
                accumulation_steps=self.accumulation_steps, global_num_tokens=global_tokens,
                ref_logp=batch.ref_logp[s:e] if batch.ref_logp is not None else None, beta=cfg.loss.beta,
                kl_estimator=cfg.loss.kl_estimator, name=cfg.loss.policy_loss, loss_cfg=cfg.loss, is_weight=isw,
                world_size=self.world_size)
            loss = out.loss
            metrics = {k: v.item() for k, v in out.metrics.items()}
            metrics.update(is_metrics)
            metrics.update(mask_metrics)
            if self.terms:
                loss, term_metrics = self._add_terms(loss, batch, s, e, logp, entropy, fwd, mask, token_adv, old,
                                                     agg_ctx)
                metrics.update(term_metrics)
            if self.zero is not None:
                self.zero.backward(loss, scale_wrt_gas=False)  # reduce-scatter into this rank's ZeRO partition
            else:
                self.manual_backward(loss)
            loss_total += loss.item()
            with torch.no_grad():
                m = mask.float()
                denom = m.sum().clamp(min=1)
                metrics["weights/mean"] = ((w.float() * m).sum() / denom).item()
                a_abs = adv.float().abs()
                if a_abs.mean() > 0:
                    metrics["weights/advantage_scale_ratio"] = \
                        ((token_adv.abs() * m).sum() / denom / (a_abs * m).sum().div(denom)).item()
                metrics["entropy"] = ((entropy * m).sum() / denom).item()
            for k, v in scheme_metrics.items():
                metrics[f"{self.scheme.name}/{k}"] = float(v)
            if iteration == 0:
                self._collect_weights(batch, s, e, w, entropy)
            n_tok = float(mask.sum())
            for k, v in metrics.items():
                if math.isfinite(v):  # e.g. a scheme statistic over no rows is NaN in that micro-batch
                    sums[k] = sums.get(k, 0.0) + v * n_tok
                    counts[k] = counts.get(k, 0.0) + n_tok
        avg = {k: v / counts[k] for k, v in sums.items() if counts[k] > 0}
        avg.pop("loss_tokens", None)

        if self.zero is not None:
            from grail_exp import deepspeed_zero

            # DeepSpeed's step: norm, clipping, the fp32 master update; it skips the update itself when the norm is
            # inf / NaN, which the bookkeeping below counts like any other skipped step.
            grad_norm = deepspeed_zero.step(self.zero)
        else:
            params = self._sync_gradients(opt)
            grad_norm = _grad_norm(params) if not self.fsdp else _sharded_grad_norm(params)
        finite = math.isfinite(loss_total) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_in_a_row = 0
            if self.zero is None:
                if cfg.optim.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
                opt.step()
        else:
            # A NaN/inf update would poison the weights: skip it, count it, abort after too many in a row.
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning("non-finite loss/gradient at step %d (loss=%s, grad_norm=%s): update skipped",
                        self.step + 1, loss_total, grad_norm)
            limit = cfg.trainer.get("max_nonfinite_in_a_row", 3)
            if self.nonfinite_in_a_row >= limit:
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} non-finite losses/gradients in a row (trainer.max_nonfinite_in_a_row"
                    f"={limit}); aborting. Lower optim.lr, check model.dtype, or inspect the last sample table.")
            if self.zero is None:
                # With every grad None, AdamW leaves parameters and state untouched; the call still advances
                # Lightning's optimiser-step counter, so the skipped step is counted like any other.
                opt.zero_grad(set_to_none=True)
                opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        timings["scheme"] = timings.get("scheme", 0.0) + t_scheme
        timings["update"] = timings.get("update", 0.0) + (time.perf_counter() - t0 - t_scheme)
        avg.update({"loss": loss_total, "grad_norm": grad_norm, "lr": sched.get_last_lr()[0],
                    "iteration": float(iteration), "nonfinite_steps_total": float(self.nonfinite_total),
                    "scheme/recompute_per_rollout": float(self.scheme.cfg.get("recompute") == "per_rollout")})
        return avg

    def _family_token_mask(self, batch, s, e, mask, logp, entropy):
        """GRPO family (issue 15): top-entropy token mask (``loss.top_entropy_quantile``) and OPSM
        (``loss.off_policy_mask_threshold``) applied to the micro-batch's loss mask. Normalisers keep the unmasked
        token counts (dapo's global count, dr_grpo's constant), as TRL does."""
        L = self.cfg.loss
        rho, delta = L.get("top_entropy_quantile", 1.0), L.get("off_policy_mask_threshold")
        if rho >= 1.0 and delta is None:
            return mask, {}
        from grail_exp.family import off_policy_sequence_mask, top_entropy_mask

        n0 = mask.float().sum().clamp(min=1.0)
        metrics = {}
        if delta is not None:
            behaviour = batch.sampler_logp[s:e] if batch.sampler_logp is not None else (
                batch.old_logp[s:e] if batch.old_logp is not None else logp.detach())
            mask = off_policy_sequence_mask(batch.advantages[s:e], logp, behaviour, mask, delta)
            metrics["opsm/masked_token_frac"] = 1.0 - float(mask.float().sum() / n0)
        if rho < 1.0:
            mask = top_entropy_mask(entropy, mask, rho)
            metrics["top_entropy/kept_token_frac"] = float(mask.float().sum() / n0)
        return mask, metrics

    def _add_terms(self, loss, batch, s, e, logp, entropy, fwd, mask, token_adv, old, agg_ctx):
        cfg = self.cfg
        aggregate = lambda per_token, m: AGGREGATIONS[cfg.loss.loss_type](per_token, m, agg_ctx)  # noqa: E731
        ctx = TermContext(
            model=self.policy, batch=self.scheme_batch(batch, s, e), hidden=predicting_window(
                fwd.hidden, batch.prompt_length, batch.completion_ids.shape[1]),
            head_weight=fwd.head_weight, head_bias=fwd.head_bias, logp=logp, entropy=entropy, mask=mask,
            token_advantages=token_adv, old_logp=old,
            ref_logp=batch.ref_logp[s:e] if batch.ref_logp is not None else None,
            sampler_logp=batch.sampler_logp[s:e] if batch.sampler_logp is not None else None,
            temperature=cfg.rollout.temperature, step=self.step, aggregate=aggregate, tokenizer=self.tokenizer)
        metrics = {}
        for term in self.terms:
            value, m = term(ctx)
            loss = loss + value
            metrics[f"{term.name}/loss"] = float(value.detach())
            metrics.update({f"{term.name}/{k}": float(v) for k, v in m.items()})
        return loss, metrics

    def _sync_gradients(self, opt) -> list[torch.Tensor]:
        """The step's gradient tensors; under data parallelism summed across ranks first (one flat all-reduce).
        The loss normalisers already count every rank's rows (``world_size`` in the aggregation), so the sum is the
        gradient of one process on the whole batch."""
        params = grad_params(opt, self.policy)
        if self.world_size > 1 and not self.fsdp:  # FSDP reduce-scatters gradients in its backward hooks
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            torch.distributed.all_reduce(flat)
            flat /= self.world_size  # DDP's convention: the mean over ranks (the normalisers include R)
            offset = 0
            for p, g in zip(params, grads):
                n = g.numel()
                p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
                offset += n
        return params

    # ------------------------------------------------------------------ logging helpers
    def _collect_weights(self, batch: TrainingBatch, s: int, e: int, w: torch.Tensor, entropy: torch.Tensor) -> None:
        """Keep the per-token weights the loss used (first ``trainer.weights_table_rows`` rows of the step) for the
        report's positional profile and weight-vs-entropy plots; written by ``_log_weight_table``."""
        every = self.cfg.trainer.weights_table_every
        step = self.step + 1
        if not every or not (step == 1 or step % every == 0) or self.rank:
            return
        budget = self.cfg.trainer.weights_table_rows - sum(len(set(t["row"])) for t in self.weight_tables)
        n_rows = min(e - s, budget)
        if n_rows <= 0:
            return
        from grail_exp.advantages.spans import answer_spans

        prepared = getattr(batch, "prepared", None)
        if isinstance(prepared, dict) and "spans" in prepared:
            spans = prepared["spans"].select(torch.arange(s, s + n_rows))
        else:
            spans = answer_spans(batch.completion_ids[s:s + n_rows], batch.loss_mask[s:s + n_rows], self.tokenizer,
                                 span_mapping="exact", texts=batch.texts[s:s + n_rows])
        mask = batch.loss_mask[s:s + n_rows].bool().cpu()
        w, ent = w[:n_rows].float().cpu(), entropy[:n_rows].detach().float().cpu()
        answer, post = spans.span.cpu(), spans.post.cpu()
        rows: dict[str, list] = {k: [] for k in ("step", "row", "correct", "advantage", "position", "length", "region",
                                                 "weight", "entropy")}
        for i in range(n_rows):
            n = int(mask[i].sum())
            gi = s + i
            for t in range(n):
                rows["step"].append(step)
                rows["row"].append(int(batch.order[gi]) if batch.order is not None else gi)
                rows["correct"].append(bool(batch.rewards[gi] > 0))
                rows["advantage"].append(float(batch.advantages[gi]))
                rows["position"].append(t)
                rows["length"].append(n)
                rows["region"].append("answer" if answer[i, t] else ("post" if post[i, t] else "pre"))
                rows["weight"].append(float(w[i, t]))
                rows["entropy"].append(float(ent[i, t]))
        self.weight_tables.append(rows)

    def _log_weight_table(self, step: int) -> None:
        """``weights/step_<N>.parquet`` in the run directory and as an MLflow artifact (see grail_exp/report.py)."""
        if not self.weight_tables:
            return
        from pathlib import Path

        import pandas as pd

        frames = [pd.DataFrame(t) for t in self.weight_tables if t["row"]]
        self.weight_tables = []
        if not frames:
            return
        out = Path(self.cfg.paths.output_dir) / "weights"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"step_{step:06d}.parquet"
        pd.concat(frames, ignore_index=True).to_parquet(path, index=False)
        self.tracker.log_artifact(str(path), "weights")

    def _log_sample_table(self, step: int) -> None:
        import pandas as pd

        k = self.cfg.trainer.num_logged_samples
        rows = [{"step": step, "question": p.question, "gold": p.answer, "completion": text, "extracted": g.extracted,
                 "reward": rew, "advantage": adv} for p, text, g, rew, adv in self._samples[:k]]
        self.tracker.log_table(pd.DataFrame(rows), artifact_file=f"samples/step_{step:06d}.json")


def _grad_norm(params: list[torch.Tensor]) -> float:
    norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0


def _sharded_grad_norm(params: list[torch.Tensor]) -> float:
    """The global gradient norm of DTensor (FSDP-sharded) gradients."""
    norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _rank_state(state: dict | None, rank: int | None = None) -> dict | None:
    """This rank's part of a training state (older single-process states kept it at the top level)."""
    if state is None:
        return None
    if "ranks" in state:
        if rank is None:
            d = torch.distributed
            rank = d.get_rank() if d.is_available() and d.is_initialized() else 0
        return state["ranks"][rank]
    return {"rng": state["rng"], "scheme_generator": state["scheme_generator"], "buffer": state.get("buffer")}


@contextmanager
def _timer(timings: dict, key: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
