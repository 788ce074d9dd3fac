"""The rollout phase: prompts → G completions each → rewards → sequence advantages → ``TrainingBatch``.

    this rank's prompts of the round (or dynamic sampling's informative groups, DAPO §3.2)
      ──engine.generate──▶ completions + the sampler's log-probs        (weights synced from the policy first)
      ──verifier─────────▶ r_i ∈ {0,1}  (last \\boxed{} → math-verify)  (+ DAPO's overlong penalty, KL-in-reward)
      ──estimator────────▶ A_i or A_{i,t}                              (estimator=grpo: group-relative)
      ──scheme.prepare───▶ answer spans, batch-level weights            (probe rows grouped first)
      ──no-grad forwards─▶ old log-probs (μ > 1 or IS), reference log-probs (β > 0), sampler check

In: the round index (which prompts) and the live policy. Out: a ``TrainingBatch`` whose tensors are on the policy's
device, and the rollout statistics logged with each of the round's optimiser steps. State kept across rounds (and
checkpointed): dynamic sampling's prompt cursor, the KL-in-reward controller, the sampler-mismatch history.
"""

from __future__ import annotations

import time

import torch

from grail_exp import world
from grail_exp.compute.forward import position_ids_from_mask
from grail_exp.compute.logprobs import kept_log_mass
from grail_exp.data.prompting import encode_prompts
from grail_exp.estimators import ESTIMATORS, EstimatorInput, estimate
from grail_exp.grading.extraction import strip_think
from grail_exp.loss import needs_old_logprobs, needs_reference
from grail_exp.rollout import SamplingParams, pad_completions
from grail_exp.rollout.base import release
from grail_exp.rollout.variants import sample_variants
from grail_exp.training.batch import SchemeContext, TrainingBatch, micro_batch_rows
from grail_exp.training.row_order import update_order
from grail_exp.training.timing import timed


class SamplerMismatchError(RuntimeError):
    """The rollout engine's log-probs disagree with the trainer's: its weights are stale or wrong."""


class RolloutPhase:
    def __init__(self, cfg, policy, tokenizer, scheme, engine, source, verifier, backend, scheme_ctx: SchemeContext,
                 ref_model=None, terms=()):
        self.cfg, self.policy, self.tokenizer, self.scheme = cfg, policy, tokenizer, scheme
        self.engine, self.source, self.verifier, self.backend = engine, source, verifier, backend
        self.scheme_ctx, self.ref_model, self.terms = scheme_ctx, ref_model, list(terms)
        self.prompt_cursor = 0  # dynamic sampling's data position
        self.kl_controller = None  # KL-in-reward's β (adaptive controller)
        self.logp_diff_history: list[float] = []  # sampler-vs-trainer mismatch of recent rounds
        self.samples: list = []  # (problem, text, grade, reward, advantage) of the last batch, for the sample table
        self.last_prompt_indices: list[int] = []  # the data-source indices this rank drew in its last round

    # ------------------------------------------------------------------ the phase
    def collect(self, round_index: int, timings: dict) -> tuple[TrainingBatch, dict]:
        """The round's scored, prepared batch and its statistics."""
        cfg = self.cfg
        batch, stats = self.make_batch(round_index, timings)
        with timed(timings, "engine_sleep"):
            release(self.engine)  # every generation of the round is done: free the engine's memory for the update
            self.backend.after_generation()
        self.prepare(batch, timings)
        with timed(timings, "old_logp"):
            if self.needs_old_logp() and batch.old_logp is None:
                self.old_logps(batch)
            if needs_reference(cfg, self.terms) and batch.ref_logp is None:
                batch.ref_logp = self.reference_logps(batch)
        if batch.old_logp is not None and batch.sampler_logp is not None:
            stats.update(self.check_sampler(batch))
        if batch.sampler_log_mass is not None:
            stats.update(self.log_mass_stats(batch.loss_mask, batch.sampler_log_mass))
        return batch, stats

    @torch.no_grad()
    def make_batch(self, round_index: int, timings: dict) -> tuple[TrainingBatch, dict]:
        """Sample, grade and score this rank's prompts of the round: the batch before the scheme's ``prepare``."""
        cfg, r = self.cfg, self.cfg.rollout
        P = cfg.trainer.prompts_per_step // world.world_size()
        with timed(timings, "rollout"):
            t = time.perf_counter()
            self.backend.sync_engine(self.engine)  # vLLM: the full weights streamed in chunks (gathered when sharded)
            timings["weight_sync"] = time.perf_counter() - t
        # Dynamic sampling (DAPO §3.2, rollout.dynamic_sampling) draws whole groups until P are informative.
        problems, completions, texts, graded, variant_infos, family_stats = self._sample_groups(round_index, P, timings)
        rb = pad_completions(completions, self.tokenizer.pad_token_id)
        golds = [p.answer for p in problems for _ in range(r.num_generations)]
        rewards = torch.tensor([float(g.correct) for g in graded])
        ob = cfg.reward.get("overlong_buffer")
        if ob is not None and ob.enabled:  # DAPO soft overlong punishment (a reward transform)
            from grail_exp.training.reward_shaping import overlong_penalty

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
        # What the estimator asks for (greedy rewards, Σπ²) and KL-in-reward, before the advantages.
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
        stats = round_stats(rewards, graded, est, rb, family_stats)
        self.samples = [(problems[i // r.num_generations], texts[i], graded[i], rewards[i].item(), seq_adv[i].item())
                        for i in range(len(texts))]
        return batch, stats

    def prepare(self, batch: TrainingBatch, timings: dict) -> None:
        """Once per rollout batch: the scheme's ``prepare`` on the whole batch, then the order in which the update
        runs its rows (``training/row_order.py``: probe rows first, groups of similar length together)."""
        with timed(timings, "scheme_prepare"), self.backend.full_parameters():
            batch.prepared = self.scheme.prepare(self.policy, batch.scheme_view(self.scheme_ctx))
            order = update_order(batch, self.scheme, self.scheme_ctx, self.cfg, self.policy)
            if order is not None:
                batch.permute(order)

    @torch.no_grad()
    def logps(self, model, batch: TrainingBatch) -> torch.Tensor:
        """(N, C) log-probs of the batch's completions under ``model``, one no-grad forward per micro-batch."""
        out = []
        for s, e in batch.micro_batches(micro_batch_rows(self.cfg)):
            logp, _, _ = self.backend.forward(model, batch.input_ids[s:e], batch.attention_mask[s:e],
                                              batch.position_ids[s:e], batch.completion_ids[s:e])
            out.append(logp)
        return torch.cat(out)

    def reference_logps(self, batch: TrainingBatch) -> torch.Tensor:
        """(N, C) log-probs under the frozen reference π_ref: the loaded reference model, or, under ``peft=lora``
        (no reference loaded), the policy with its adapters off, which is the base it started from."""
        if self.ref_model is not None:
            return self.logps(self.ref_model, batch)
        from grail_exp.models.lora import adapters_disabled

        with torch.no_grad(), adapters_disabled(self.policy):
            return self.logps(self.policy, batch)

    def sampler_filter(self) -> tuple[int, float] | None:
        """(top_k, top_p) when the engine reports log-probs renormalised over the tokens top-k / top-p keep (vLLM's
        ``processed_logprobs``, ``rollout=vllm_paper``) and a filter is on; else None. Then the old-log-prob forward
        also measures the mass M_t the sampler's log-probs drop."""
        r = self.cfg.rollout
        processed = getattr(self.engine, "logprobs_mode", "raw_logprobs") == "processed_logprobs"
        return (int(r.top_k), float(r.top_p)) if processed and (r.top_k > 0 or r.top_p < 1) else None

    @torch.no_grad()
    def old_logps(self, batch: TrainingBatch) -> None:
        """``batch.old_logp`` under the policy; with a ``sampler_filter()`` also ``batch.sampler_log_mass``: the (N, C)
        log M_t = log Σ_{kept} softmax(z_t / T) from the same forward (``logprobs.kept_log_mass``)."""
        kp = self.sampler_filter()
        if kp is None:
            batch.old_logp = self.logps(self.policy, batch)
            return
        logps, masses = [], []
        with self.backend.full_parameters():  # the output layer is read outside the forward
            for s, e in batch.micro_batches(micro_batch_rows(self.cfg)):
                logp, _, fwd = self.backend.forward(self.policy, batch.input_ids[s:e], batch.attention_mask[s:e],
                                                    batch.position_ids[s:e], batch.completion_ids[s:e])
                logps.append(logp)
                masses.append(kept_log_mass(fwd.predicting(fwd.hidden), fwd.head_weight, fwd.head_bias, *kp,
                                            self.cfg.rollout.temperature, self.cfg.trainer.logprob_chunk_tokens))
        batch.old_logp, batch.sampler_log_mass = torch.cat(logps), torch.cat(masses)

    @staticmethod
    def log_mass_stats(mask: torch.Tensor, log_mass: torch.Tensor) -> dict[str, float]:
        """The mass the processed log-probs drop, over the tokens that carry loss: ``sampling/seq_log_kept_mass``
        = mean over sequences (with a loss token) of Σ_t log M_{i,t} — the log of the factor Π_t M_t by which a
        sequence-level IS ratio on processed log-probs scales that sequence's loss — and
        ``sampling/token_log_kept_mass`` = its mean per token. Both ≤ 0, summed over ranks."""
        m = mask.float()
        per_seq = (log_mass.float() * m).sum(1)
        rows = m.sum(1) > 0
        sums = torch.stack([per_seq[rows].sum(), rows.sum(), m.sum()]).double()
        seq_sum, n_seq, n_tok = world.all_reduce_sum(sums).tolist()
        return {"sampling/seq_log_kept_mass": seq_sum / max(n_seq, 1),
                "sampling/token_log_kept_mass": seq_sum / max(n_tok, 1)}

    def needs_old_logp(self) -> bool:
        return needs_old_logprobs(self.cfg)

    def check_sampler(self, batch: TrainingBatch) -> dict[str, float]:
        """Sampler-vs-trainer agreement on the sampled tokens: ~0 for rollout=hf (same weights, same distribution);
        for vLLM the mismatch the IS correction handles — and the alarm for a stale weight sync. With processed
        (top-k-renormalised) sampler log-probs, ``batch.sampler_log_mass`` (log M_t) puts them back on the full
        vocabulary first (raw = processed + log M_t), so the check measures the weights, not the top-k truncation."""
        m = batch.loss_mask
        mass = batch.sampler_log_mass
        sampler = batch.sampler_logp if mass is None else batch.sampler_logp + mass
        diff = ((batch.old_logp - sampler).abs() * m).sum() / m.sum().clamp(min=1)
        value = float(world.all_reduce_sum(diff.detach().double()) / world.world_size())
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

    # ------------------------------------------------------------------ sampling and grading
    def generate_and_grade(self, problems: list, n: int, temperature: float, timings: dict, plan=None):
        """Sample ``n`` completions per problem (temperature 0 = greedy) and grade them. With a ``plan`` (an
        estimator's ``prompt_variants``, e.g. SCRL) each problem's n rollouts come from its variants, in plan order;
        returns (completions, texts, graded, per-row variant infos or None)."""
        cfg, r = self.cfg, self.cfg.rollout
        params = SamplingParams(n=n, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_completion_length, repetition_penalty=r.repetition_penalty,
                                logprobs=True)
        with timed(timings, "rollout"), self.backend.generation(self.engine):
            if plan is None:
                prompts = encode_prompts([p.question for p in problems], self.tokenizer, cfg.model, cfg.data.instruction)
                completions, variant_infos = self.engine.generate(prompts, params), None
            else:
                completions, variant_infos = sample_variants(self.engine, self.tokenizer, cfg.model,
                                                             cfg.data.instruction, plan, params)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        with timed(timings, "scoring"):
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
            first = round_index * cfg.trainer.prompts_per_step + world.rank() * P  # this rank's slice of the prompts
            self.last_prompt_indices = list(range(first, first + P))
            problems = [self.source[i] for i in self.last_prompt_indices]
            spec = ESTIMATORS[cfg.estimator.name]
            # Estimators that sample from several prompts per problem (SCRL) plan them; the others get G of the problem.
            plan = spec.prompt_variants(cfg.estimator, problems, G, cfg.data) if spec.prompt_variants else None
            completions, texts, graded, variant_infos = self.generate_and_grade(
                problems, G, cfg.rollout.temperature, timings, plan)
            return problems, completions, texts, graded, variant_infos, {}
        kept, dropped, rounds = [], [], 0
        self.last_prompt_indices = []
        while len(kept) < P and rounds <= ds.max_extra_rounds:
            drawn = list(range(self.prompt_cursor, self.prompt_cursor + P))  # one process (validate() refuses more)
            self.last_prompt_indices += drawn
            problems = [self.source[i] for i in drawn]
            self.prompt_cursor += P
            rounds += 1
            completions, texts, graded, _ = self.generate_and_grade(problems, G, cfg.rollout.temperature, timings)
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
            graded = self.generate_and_grade(problems, 1, 0.0, timings)[2]
            return {"greedy_rewards": torch.tensor([float(g.correct) for g in graded])}

        def sum_pi_squared():  # OTB: π(o_t) and Σπ² of the rollout policy, chunked over the vocabulary
            from grail_exp.estimators.otb import sum_pi_squared_from_hidden

            logps, spps = [], []
            with timed(timings, "sum_pi_squared"), torch.no_grad(), self.backend.full_parameters():
                for s, e in batch.micro_batches(micro_batch_rows(cfg)):
                    logp, _, fwd = self.backend.forward(self.policy, batch.input_ids[s:e], batch.attention_mask[s:e],
                                                        batch.position_ids[s:e], batch.completion_ids[s:e])
                    h = fwd.predicting(fwd.hidden)
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
            from grail_exp.loss import KL_ESTIMATORS
            from grail_exp.training.reward_shaping import KLInRewardController

            if self.kl_controller is None:
                self.kl_controller = KLInRewardController(kir)
            with timed(timings, "old_logp"):
                if batch.old_logp is None:
                    self.old_logps(batch)
                batch.ref_logp = self.reference_logps(batch)
            kl = KL_ESTIMATORS[kir.estimator](batch.old_logp, batch.ref_logp).cpu()
            rewards, m = self.kl_controller.penalise(rewards, kl, batch.loss_mask.cpu())
            stats.update(m)
        return extras, rewards

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"prompt_cursor": self.prompt_cursor, "logp_diff_history": list(self.logp_diff_history),
                "kl_controller": self.kl_controller.state_dict() if self.kl_controller is not None else None}

    def load_state_dict(self, st: dict) -> None:
        self.prompt_cursor = int(st.get("prompt_cursor", 0))
        self.logp_diff_history = list(st.get("logp_diff_history", []))
        if st.get("kl_controller") is not None:
            from grail_exp.training.reward_shaping import KLInRewardController

            self.kl_controller = KLInRewardController(self.cfg.loss.kl_in_reward)
            self.kl_controller.load_state_dict(st["kl_controller"])


def informative_groups(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """(P,) bool: the group's rewards are not all equal; dynamic sampling's filter (DAPO §3.2 keeps the groups with
    0 < #correct < G)."""
    r = rewards.view(-1, G)
    return (r.max(1).values - r.min(1).values) > 1e-6


def round_stats(rewards: torch.Tensor, graded: list, est, rb, family_stats: dict) -> dict:
    """The round's logged statistics: rewards, grading outcomes, advantages, completion lengths, the estimator's and the
    loss family's own metrics."""
    lengths = rb.completion_mask.sum(1).float()
    term = lengths[~rb.is_truncated]
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "accuracy": sum(g.correct for g in graded) / len(graded),
        "frac_reward_zero_std": est.zero_std.float().mean().item(),
        "reward/no_answer_rate": sum(g.status == "no_answer" for g in graded) / len(graded),
        "reward/timeouts": float(sum(g.status == "timeout" for g in graded)),
        "reward/errors": float(sum(g.status == "error" for g in graded)),
        "advantage/abs_mean": est.sequence_advantages.abs().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/mean_terminated_length": term.mean().item() if term.numel() else 0.0,
        "completions/truncated_rate": rb.is_truncated.float().mean().item(),
        **{f"estimator/{k}": v for k, v in est.metrics.items()},
        **family_stats,
    }
