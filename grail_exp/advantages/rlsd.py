"""RLSD: Self-Distilled RLVR (Yang et al., arXiv 2604.03128; code iie-ycx/RLSD ``dp_opsd_actor._build_stgca_advantages``,
``opsd_trainer`` λ schedule; other-methods.md §4).

The teacher is the model itself conditioned on the gold answer (``grail_exp/teacher.py``); it scores the
student's sampled tokens. Per token of row i, in rollout batch k (``SchemeBatch.rollout_index()``: 1 for the run's
first rollout batch, the same for every optimiser step taken on it — the official trainer's ``global_step``):

    Δ_t    = sg( log P_T(o_t | x, answer, o_<t) − log P_S(o_t | x, o_<t) )
    e_t    = clip( exp(sign(A_i) · Δ_t), 1 − ε_w, 1 + ε_w )        (P_T / P_S)^{sign A}: never flips A's sign
    w_t    = (1 − λ(k)) + λ(k) · e_t                                Â_{i,t} = sg(w_t) · A_i
    λ(k)   = λ₀ · min(1, k / K_warm) · clamp(1 − (k − K_warm) / K_decay, 0, 1)      (a factor is 1 when its K is 0)

Defaults are the official script's (``rlsd_train.sh``): λ₀ = 0.5 decayed to 0 over 60 rollout batches (λ = 0.4917 in
the first, 0.0083 in the 59th, so RLSD is plain GRPO from the 60th on and the teacher forward is skipped), ε_w = 0.2,
teacher = a frozen copy of the actor (``teacher: frozen``, one more model in memory; under ``peft=lora`` one more adapter) re-synced after every 20th
rollout batch's updates: rollout batches 1-20 use the initial actor, 21-40 the actor after batch 20, ... ``teacher:
live`` scores with the live parameters in every
micro-batch (SDPG's re-implementation; no extra memory). ``student_logp``: ``live`` = the live actor's log-prob of
the same micro-batch, detached (official) | ``rollout`` = the log-prob under the parameters that generated the
rollout, computed once per rollout batch (SDPG's re-implementation uses the old log-prob). With μ = 1 inner
iteration the two coincide. ``negative_only``: only rows with A < 0 are reweighted (official switch, off).
Rows with A = 0 get w = 1 without a teacher forward (their Â is 0 whatever w is). λ = 0 gives GRPO exactly.

The schedule is the official ``opsd_trainer`` arithmetic: λ₀·k/K_warm while k < K_warm, then
λ₀·max(0, 1 − (k − K_warm)/K_decay) (the product above equals it); the teacher re-sync is ``dp_opsd_actor``'s
``global_step % rlsd_teacher_sync_interval == 0`` after the update. The frozen teacher is not checkpointed: after a
resume it restarts from the resumed actor.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from grail_exp.advantages.base import (
    AdvantageScheme,
    PolicyForward,
    SchemeBatch,
    SchemeConfig,
    SchemeOutput,
    check_common,
    register_scheme,
)
from grail_exp.advantages.gradient_probe import masked_mean_std
from grail_exp.teacher import build_teacher_batch, check_template, teacher_logprobs


@dataclass
class RlsdConfig(SchemeConfig):
    # Defaults: the official rlsd_train.sh (opsd.* keys), other-methods.md §4.2.
    name: str = "rlsd"
    lam: float = 0.5  # λ₀: mixing weight of the evidence term (official rlsd_lambda 0.5)
    lambda_warmup_steps: int = 0  # K_warm: linear warmup of λ from 0, in rollout batches (official 0)
    # K_decay: linear decay of λ to 0 after the warmup, in rollout batches; 0 = constant (official 60; SDPG's RLSD
    # baseline 50)
    lambda_decay_steps: int = 60
    clip: float = 0.2  # ε_w: e_t is clipped to [1 − ε_w, 1 + ε_w] (official rlsd_reweight_clip_range 0.2)
    negative_only: bool = False  # reweight only rows with A < 0 (official switch, default off)
    teacher: str = "frozen"  # frozen: a copy of the actor re-synced every teacher_sync_every steps (official; +1 model of memory) | live
    teacher_sync_every: int = 20  # frozen teacher: copy the actor's weights after every N-th rollout batch (official 20)
    student_logp: str = "live"  # live: the live actor's log-prob, detached (official) | rollout: the rollout params'
    template: str = "rlsd"  # teacher prompt: a name in teacher.py TEMPLATES or a literal with {answer}
    instruction: str | None = None  # appended via {instruction}; null = data.instruction (the student's)
    chunk_tokens: int = 4096  # rows of (chunk, V) logits alive at once in the log-prob passes


def rlsd_lambda(cfg, step: int) -> float:
    """λ(k) for the 1-based rollout-batch index k: linear warmup over ``lambda_warmup_steps``, then linear decay to 0
    over ``lambda_decay_steps``."""
    lam = float(cfg.lam)
    warm, decay = int(cfg.lambda_warmup_steps), int(cfg.lambda_decay_steps)
    if warm > 0:
        lam *= min(1.0, step / warm)
    if decay > 0:
        lam *= min(1.0, max(0.0, 1.0 - (step - warm) / decay))
    return lam


def rlsd_weights(teacher_logp: torch.Tensor, student_logp: torch.Tensor, advantages: torch.Tensor, lam: float,
                 clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, e) of the formula above for (B, C) log-probs and (B,) advantages (no masking)."""
    delta = (teacher_logp - student_logp).detach().float()
    e = torch.exp(torch.sign(advantages.float()).unsqueeze(1) * delta).clamp(1.0 - clip, 1.0 + clip)
    return (1.0 - lam) + lam * e, e


@register_scheme("rlsd", RlsdConfig)
class RlsdScheme(AdvantageScheme):
    @staticmethod
    def check_config(cfg) -> list[str]:
        e = check_common(cfg)
        if not 0.0 <= cfg.lam <= 1.0:
            e.append(f"lam = {cfg.lam}: must be in [0, 1] (w = (1 - lam) + lam * e must stay > 0)")
        if not 0.0 <= cfg.clip < 1.0:
            e.append(f"clip = {cfg.clip}: must be in [0, 1) (the lower clip 1 - clip must be > 0)")
        for key in ("lambda_warmup_steps", "lambda_decay_steps"):
            if cfg[key] < 0:
                e.append(f"{key} = {cfg[key]}: must be >= 0 (0 = off)")
        for key, valid in (("teacher", ("frozen", "live")), ("student_logp", ("live", "rollout"))):
            if cfg[key] not in valid:
                e.append(f"{key} = {cfg[key]!r}: must be one of {', '.join(valid)}")
        if cfg.teacher_sync_every < 1:
            e.append(f"teacher_sync_every = {cfg.teacher_sync_every}: must be >= 1")
        if cfg.chunk_tokens < 1:
            e.append(f"chunk_tokens = {cfg.chunk_tokens}: must be >= 1")
        e.extend(check_template("template", cfg.template))
        return e

    def __init__(self, cfg, tokenizer=None, context=None):
        super().__init__(cfg, tokenizer, context)
        self.frozen = None  # teacher: frozen — the synced copy
        self.synced_period: int | None = None  # (k − 1) // teacher_sync_every of the rollout batch k it was synced for

    # ------------------------------------------------------------------ pieces
    def _instruction(self) -> str:
        if self.cfg.instruction is not None:
            return self.cfg.instruction
        data = self.context.get("data")
        return (data.get("instruction", "") if data is not None else "") or ""

    def _rows(self, batch: SchemeBatch) -> torch.Tensor:
        """(B,) rows whose weights can change the loss: A != 0 (A < 0 with negative_only)."""
        A = batch.advantages.float()
        return A < 0 if self.cfg.negative_only else A != 0

    def rows_needing_model(self, batch: SchemeBatch) -> torch.Tensor:
        return self._rows(batch)

    @contextlib.contextmanager
    def _teacher_model(self, model, rollout_step: int):
        """The frozen teacher for rollout batch k (1-based), for the block: the actor as it was after rollout batch
        N·⌊(k − 1)/N⌋ (the initial actor for k ≤ N). The official code syncs after the update of every batch k with
        k % N == 0; syncing before the first update of batch k + 1 is the same copy. Under ``peft=lora`` an earlier
        actor is the same frozen base with an earlier adapter: only the adapter is copied, and swapped in for the
        teacher's no-grad pass (``grail_exp/models/lora.py`` ``AdapterSnapshot``)."""
        if self.cfg.teacher == "live":
            yield model
            return
        from grail_exp.models.lora import AdapterSnapshot, is_lora

        period = (rollout_step - 1) // self.cfg.teacher_sync_every
        adapter_only = is_lora(model)
        if self.frozen is None or period != self.synced_period:
            if self.frozen is None:
                self.frozen = AdapterSnapshot(model) if adapter_only else \
                    copy.deepcopy(model).requires_grad_(False).eval()
            elif adapter_only:
                self.frozen.update(model)
            else:
                self.frozen.load_state_dict(model.state_dict())
            self.synced_period = period
        if adapter_only:
            with self.frozen.swapped_in(model):
                yield model
        else:
            yield self.frozen

    def _logps(self, model, batch: SchemeBatch, rows: torch.Tensor, teacher: bool):
        """(b, C) teacher or student log-probs of the given rows, no grad."""
        sub = batch.rows(rows)
        if teacher:
            tb = build_teacher_batch(sub, self.tokenizer, self.context.get("model"), self.cfg.template,
                                     self._instruction())
            return teacher_logprobs(model, tb, sub.sampling_temperature, self.cfg.chunk_tokens,
                                    share_prompts=self.share_prompts)
        from grail_exp.compute.forward import policy_forward

        with torch.no_grad():
            logp, _, _ = policy_forward(model, sub.input_ids, sub.attention_mask, sub.position_ids,
                                        sub.completion_ids, sub.sampling_temperature,
                                        chunk_tokens=self.cfg.chunk_tokens, share_prompts=self.share_prompts)
        return logp

    # ------------------------------------------------------------------ contract
    def prepare(self, model, batch: SchemeBatch):
        """Once per rollout batch, with the parameters that generated it: the frozen teacher's log-probs (they do not
        change within the batch) and, for ``student_logp: rollout``, the rollout log-probs."""
        cfg = self.cfg
        lam = rlsd_lambda(cfg, batch.rollout_index())
        rows = self._rows(batch)
        out = {}
        if lam == 0.0 or not rows.any():
            return out
        idx = rows.nonzero().squeeze(1)
        B, C = batch.completion_ids.shape
        if cfg.teacher == "frozen":
            t = torch.zeros(B, C, device=batch.completion_ids.device)
            with self._teacher_model(model, batch.rollout_index()) as teacher:
                t[idx] = self._logps(teacher, batch, idx, teacher=True)
            out["teacher_logp"] = t
        if cfg.student_logp == "rollout":
            s = torch.zeros(B, C, device=batch.completion_ids.device)
            s[idx] = self._logps(model, batch, idx, teacher=False)
            out["student_logp"] = s
        return out

    def weights(self, model, batch: SchemeBatch) -> SchemeOutput:
        return self._weights(model, batch, None)

    def weights_from_forward(self, model, batch: SchemeBatch, forward: PolicyForward) -> SchemeOutput | None:
        """The live student log-prob from the trainer's policy forward (its hidden states, detached): one student
        forward fewer, the same numbers."""
        return self._weights(model, batch, forward)

    def _weights(self, model, batch: SchemeBatch, forward: PolicyForward | None) -> SchemeOutput:
        cfg = self.cfg
        lam = rlsd_lambda(cfg, batch.rollout_index())
        mask = batch.completion_mask.float()
        B, C = batch.completion_ids.shape
        w = torch.ones(B, C, device=mask.device)
        e = torch.ones(B, C, device=mask.device)
        rows = self._rows(batch)
        if lam > 0.0 and rows.any():
            idx = rows.nonzero().squeeze(1)
            prepared = batch.prepared if isinstance(batch.prepared, dict) else {}
            if cfg.teacher == "frozen" and "teacher_logp" in prepared:
                t = prepared["teacher_logp"][idx]
            else:
                with self._teacher_model(model, batch.rollout_index()) as teacher:
                    t = self._logps(teacher, batch, idx, teacher=True)
            if cfg.student_logp == "rollout" and "student_logp" in prepared:
                s = prepared["student_logp"][idx]
            elif forward is not None:
                s = self._student_from_forward(batch, forward, idx)
            else:
                s = self._logps(model, batch, idx, teacher=False)
            w_rows, e_rows = rlsd_weights(t, s, batch.advantages[idx], lam, cfg.clip)
            w[idx], e[idx] = w_rows, e_rows
        w = w * mask
        return SchemeOutput(w.detach(), self._diagnostics(w, e, mask, rows, batch.advantages, lam))

    def _student_from_forward(self, batch: SchemeBatch, forward: PolicyForward, idx: torch.Tensor) -> torch.Tensor:
        from grail_exp.compute.logprobs import linear_logprob

        with torch.no_grad():
            h = forward.predicting(forward.hidden.detach())[idx]
            bias = forward.head_bias.detach() if forward.head_bias is not None else None
            logp, _ = linear_logprob(h, forward.head_weight.detach(), bias, batch.completion_ids[idx],
                                     batch.sampling_temperature, self.cfg.chunk_tokens)
        return logp

    def _diagnostics(self, w, e, mask, rows, A, lam) -> dict[str, float]:
        valid = mask.bool() & (A != 0).unsqueeze(1)
        w_mean, w_std = masked_mean_std(w, valid)
        rew = mask.bool() & rows.unsqueeze(1)
        n = max(int(rew.sum()), 1)
        eps = self.cfg.clip
        return {
            "lambda": lam,
            "weight_mean": w_mean,
            "weight_std": w_std,
            # fractions of the reweighted tokens whose evidence ratio hit a clip bound
            "clip_low_frac": float(((e <= 1 - eps) & rew).sum()) / n if lam > 0 else 0.0,
            "clip_high_frac": float(((e >= 1 + eps) & rew).sum()) / n if lam > 0 else 0.0,
            "reweighted_rows": float(rows.sum()) if lam > 0 else 0.0,
        }
