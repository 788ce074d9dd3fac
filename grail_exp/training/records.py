"""What a training step leaves behind besides the update: per-token weight tables (the report's positional profile and
weight-vs-entropy plots), sample tables (problem, completion, grade, advantage) and one-line progress logs.

In: the batch and the weights the update used (``collect_weights``, the update phase's ``on_weights`` hook), the
rollout phase's samples, the step's metrics. Out: files under ``<run dir>/weights``, MLflow artifacts, log lines.
Rank 0 only.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from grail_exp.spans import answer_spans

log = logging.getLogger("grail_exp.module")  # the name users filter on in their logging config


class StepRecords:
    def __init__(self, cfg, tokenizer, tracker, rank: int = 0):
        self.cfg, self.tokenizer, self.tracker, self.rank = cfg, tokenizer, tracker, rank
        self.weight_tables: list = []  # per-token weights of this step's first rows, written by ``log_weight_table``
        self._progress_origin: tuple[int, float] | None = None

    def collect_weights(self, step: int, batch, s: int, e: int, w: torch.Tensor, entropy: torch.Tensor) -> None:
        """Keep the per-token weights the loss used (first ``trainer.weights_table_rows`` rows of the step) for the
        report's positional profile and weight-vs-entropy plots; written by ``log_weight_table``."""
        every = self.cfg.trainer.weights_table_every
        if not every or not (step == 1 or step % every == 0) or self.rank:
            return
        budget = self.cfg.trainer.weights_table_rows - sum(len(set(t["row"])) for t in self.weight_tables)
        n_rows = min(e - s, budget)
        if n_rows <= 0:
            return
        prepared = batch.prepared
        if isinstance(prepared, dict) and "spans" in prepared:
            spans = prepared["spans"].select(torch.arange(s, s + n_rows))
        else:
            spans = answer_spans(batch.completion_ids[s:s + n_rows], batch.loss_mask[s:s + n_rows], self.tokenizer,
                                 span_mapping="exact", texts=batch.texts[s:s + n_rows])
        mask = batch.loss_mask[s:s + n_rows].bool().cpu()
        w, ent = w[:n_rows].float().cpu(), entropy[:n_rows].detach().float().cpu()
        answer, post = spans.span.cpu(), spans.post.cpu()
        ids = batch.completion_ids[s:s + n_rows].cpu()  # the tokens themselves: heatmaps with their text
        rows: dict[str, list] = {k: [] for k in ("step", "row", "correct", "advantage", "position", "length", "region",
                                                 "weight", "entropy", "token_id")}
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
                rows["token_id"].append(int(ids[i, t]))
        self.weight_tables.append(rows)

    def log_weight_table(self, step: int) -> None:
        """``weights/step_<N>.parquet`` in the run directory and as an MLflow artifact (see grail_exp/reporting/figures.py)."""
        if not self.weight_tables:
            return
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

    def log_sample_table(self, step: int, samples: list) -> None:
        """The first ``trainer.num_logged_samples`` rollouts of the step (every ``trainer.sample_table_every`` steps)."""
        every = self.cfg.trainer.sample_table_every
        if not every or not samples or not (step == 1 or step % every == 0):
            return
        import pandas as pd

        k = self.cfg.trainer.num_logged_samples
        rows = [{"step": step, "question": p.question, "gold": p.answer, "completion": text, "extracted": g.extracted,
                 "reward": rew, "advantage": adv} for p, text, g, rew, adv in samples[:k]]
        self.tracker.log_table(pd.DataFrame(rows), artifact_file=f"samples/step_{step:06d}.json")

    def progress_line(self, step: int, m: dict[str, float]) -> None:
        """One INFO line every trainer.progress_log_every steps: what a redirected log (SLURM, CI, nohup) shows of
        the run, where the progress bar does not reach. Rank 0 only; the ETA extrapolates this session's pace."""
        every, total = self.cfg.trainer.progress_log_every, self.cfg.trainer.max_steps
        if not every or self.rank != 0 or not (step % every == 0 or step == total):
            return
        now = time.perf_counter()
        if self._progress_origin is None:  # the first step of this session (a resumed run starts mid-way)
            self._progress_origin = (step - 1, now - m["timing/step_s"])
        first = self._progress_origin
        pace = (now - first[1]) / max(1, step - first[0])
        log.info("step %d/%d  reward %.3f  loss %+.4f  length %.0f  %.2f s/step  ETA %s", step, total,
                 m["reward/mean"], m["loss"], m.get("completions/mean_length", math.nan), pace,
                 time.strftime("%H:%M:%S", time.gmtime(pace * (total - step))))
