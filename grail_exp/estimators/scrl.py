"""SCRL: subproblem rewards and per-span token advantages (Jiang et al., arXiv 2605.22074 §3; other-methods.md §2).

Per problem, ``G_c`` rollouts answer the curriculum prompt t_K(x) (K subproblems, answers in ``<p1>…</p1> …
<pK>…</pK>``) and ``G_o = G − G_c`` answer x itself (paper: G/2 + G/2). For curriculum rollout i:

    r_i = (r_i⁽¹⁾ … r_i⁽ᴷ⁾) ∈ {0,1}ᴷ            each span's answer verified against its gold; bad format → r_i = 0
    k_i = max{j : r_i⁽¹⁾ = … = r_i⁽ʲ⁾ = 1}       progress: the longest consecutively solved prefix (0 if none)
    R_i⁽ʲ⁾ = r_i⁽ʲ⁾ · [j ≤ k_i]                  progress-aware correction: [1,1,0,1] → [1,1,0,0]
    A_i⁽ʲ⁾ = (R_i⁽ʲ⁾ − mean_i R⁽ʲ⁾) / std_i R⁽ʲ⁾  per position j over the group's curriculum rollouts (§3.3)
    A_{i,t} = A_i⁽ʲ⁾ for t in span j,  0 elsewhere (and everywhere in a badly formatted rollout)

Original rollouts get the usual outcome advantage A_i = r_i − mean(r) (÷ std per ``loss.scale_rewards``) over the
group's G_o original rows, broadcast over their completion. Both halves go into one token-mean loss (Eq. 5).

std is the unbiased estimate with a 1e-4 guard, as ``group_advantages`` (a position every rollout solved, or none
did, gives A = 0). "Bad format" (INFERRED from "a bad format gives r_i = 0"): the completion's ``<pj>`` / ``</pj>``
tags are not exactly ``<p1></p1> … <pK></pK>`` in this order. Which tokens form span j (the paper says "tokens
inside <pj>…</pj>"): ``span_tokens: tagged`` (default, the tags and the answer) or ``content`` (only the answer).

A rollout-batch's rows are laid out group by group, curriculum rows first: ``[c, c, …, o, o, …]`` per problem.
The estimator asks the trainer (``needs``) for the completion texts and token ids, the tokenizer, the verifier and
``rollout_variants`` (per row: None for an original row, its ``Curriculum`` for a curriculum row); the prompts are
planned by ``prompt_variants`` below (``EstimatorSpec.prompt_variants``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from grail_exp.estimators.base import EstimatorInput, EstimatorOutput, PromptVariant, register_estimator
from grail_exp.estimators.group import group_advantages

SPAN_TOKENS = ("tagged", "content")
VERIFY = ("math_verify", "exact")
_TAG = re.compile(r"<(/?)p(\d+)>")

DEFAULT_PROMPT = "Solve the subproblems in order; put the answer to subproblem j in <pj></pj>.\n{subproblems}"


@dataclass
class SCRLConfig:
    name: str = "scrl"
    curriculum_rollouts: int | None = None  # G_c per problem; null = G/2 (paper); the rest answer x itself
    progress_correction: bool = True  # R⁽ʲ⁾ = r⁽ʲ⁾·[j ≤ k] (paper §3.2); false = raw span rewards (ablation)
    normalize_std: bool = True  # divide by the per-position std (paper §3.3); false = mean-centred only
    span_tokens: str = "tagged"  # tagged: <pj>answer</pj> tokens carry A⁽ʲ⁾ | content: only the answer's tokens (INFERRED)
    verify: str = "math_verify"  # math_verify: the run's verifier on each span's answer | exact: stripped string equality
    prompt_template: str = DEFAULT_PROMPT  # the curriculum prompt t_K(x); {subproblems} = the lines below, {K}
    subproblem_template: str = "{j}. {question}"  # one line per subproblem
    instruction: bool = False  # also append data.instruction (usually "...put your final answer within \\boxed{}") to t_K(x)


def _check(cfg) -> list[str]:
    e = []
    if cfg.span_tokens not in SPAN_TOKENS:
        e.append(f"span_tokens = {cfg.span_tokens!r}: must be one of {', '.join(SPAN_TOKENS)}")
    if cfg.verify not in VERIFY:
        e.append(f"verify = {cfg.verify!r}: must be one of {', '.join(VERIFY)}")
    if "{subproblems}" not in cfg.prompt_template:
        e.append("prompt_template must contain {subproblems}")
    return e


def _check_run(est, cfg) -> list[str]:
    """Combinations with the rest of the run that cannot work (key-named messages)."""
    from grail_exp.data.curriculum import CURRICULUM_DATASETS

    e = []
    G = cfg.rollout.num_generations
    Gc = curriculum_count(est, G)
    Go = G - Gc
    if not 0 <= Gc <= G:
        e.append(f"estimator.curriculum_rollouts = {est.curriculum_rollouts}: must be in "
                 f"[0, rollout.num_generations={G}]")
    elif Gc == 1 or Go == 1:
        e.append(f"estimator.curriculum_rollouts = {Gc} of rollout.num_generations = {G}: each half (curriculum "
                 f"{Gc}, original {Go}) needs 0 or >= 2 rollouts (a lone rollout has no baseline)")
    if cfg.data.name not in CURRICULUM_DATASETS:
        e.append(f"data.name = {cfg.data.name!r}: estimator=scrl needs curricula; use one of "
                 f"{', '.join(CURRICULUM_DATASETS)}")
    return e


def curriculum_count(cfg, G: int) -> int:
    return G // 2 if cfg.curriculum_rollouts is None else int(cfg.curriculum_rollouts)


def prompt_variants(cfg, problems, G: int, data_cfg) -> list[list[PromptVariant]]:
    """Per problem: G_c rollouts of the curriculum prompt t_K(x), then G − G_c of x (rows in this order)."""
    from grail_exp.data.curriculum import curriculum_for, render_curriculum

    Gc = curriculum_count(cfg, G)
    out = []
    for p in problems:
        c = curriculum_for(p, data_cfg.name)
        variants = []
        if Gc:
            variants.append(PromptVariant(render_curriculum(c, cfg.prompt_template, cfg.subproblem_template), Gc,
                                          cfg.instruction, c))
        if G - Gc:
            variants.append(PromptVariant(p.question, G - Gc, True, None))
        out.append(variants)
    return out


# ---------------------------------------------------------------------------------------------- the pieces
def parse_spans(text: str, K: int) -> list[tuple[int, int, int, int]] | None:
    """``[(tag_start, content_start, content_end, tag_end)]`` per subproblem, or None when the format is bad:
    the tags must be exactly ``<p1> </p1> … <pK> </pK>`` in this order."""
    tags = [(m.start(), m.end(), m.group(1) == "/", int(m.group(2))) for m in _TAG.finditer(text)]
    if len(tags) != 2 * K:
        return None
    spans = []
    for j in range(K):
        (s0, e0, close0, n0), (s1, e1, close1, n1) = tags[2 * j], tags[2 * j + 1]
        if close0 or not close1 or n0 != j + 1 or n1 != j + 1:
            return None
        spans.append((s0, e0, s1, e1))
    return spans


def progress_rewards(r: torch.Tensor, correction: bool = True) -> torch.Tensor:
    """R⁽ʲ⁾ = r⁽ʲ⁾·[j ≤ k] with k the longest solved prefix; r (N, K) in {0, 1}."""
    if not correction:
        return r.float()
    return torch.cumprod(r.float(), dim=1)  # 1 exactly while every earlier position was solved


def position_advantages(R: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    """A⁽ʲ⁾ = (R⁽ʲ⁾ − mean_i R⁽ʲ⁾) / (std_i R⁽ʲ⁾ + 1e-4) over the rows of R (one group's curriculum rollouts)."""
    A = R - R.mean(0, keepdim=True)
    if normalize_std and R.shape[0] > 1:
        A = A / (R.std(0, keepdim=True) + 1e-4)
    return A


def token_positions(tokenizer, ids: list[int], text: str, char_spans: list[tuple[int, int]], C: int) -> list[list[int]]:
    """Token indices overlapping each char span ``[s, e)`` of ``text = decode(ids, skip_special_tokens=True)``."""
    from grail_exp.spans import RowOffsets, lower_bound

    off = RowOffsets(tokenizer, ids, text)
    n = min(len(ids), C)
    out = []
    for s, e in char_spans:
        first = lower_bound(0, n, lambda i, s=s: off.ceil(i + 1) > s)
        after = lower_bound(first, n, lambda i, e=e: off.floor(i) >= e)
        out.append([i for i in range(first, after) if off.floor(i) < off.ceil(i + 1)])
    return out


def _verify(cfg, verifier, preds: list[str], golds: list[str]) -> list[bool]:
    if not preds:
        return []
    if cfg.verify == "exact" or verifier is None:
        return [p.strip() == g.strip() for p, g in zip(preds, golds)]
    return [g.correct for g in verifier.grade(preds, golds)]


# The paper's objective (Eq. 5): GRPO's std-normalised advantages on the original half (the curriculum half's scale)
# and one token mean over the whole batch.
REQUIRES = {"loss.scale_rewards": "group", "loss.loss_type": "dapo"}


@register_estimator("scrl", SCRLConfig, needs=("completion_texts", "completion_token_ids", "tokenizer", "verifier",
                                                "rollout_variants"), check=_check,
                    prompt_variants=prompt_variants, check_run=_check_run, requires=REQUIRES)
def scrl(inp: EstimatorInput, cfg) -> EstimatorOutput:
    x = inp.extras
    texts, ids, variants = x["completion_texts"], x["completion_token_ids"], x["rollout_variants"]
    N, C = inp.completion_mask.shape
    G = inp.num_generations
    adv = torch.zeros(N, C)
    zero_std = torch.zeros(N, dtype=torch.bool)
    rewards = inp.rewards.clone().float()
    curr = torch.tensor([v is not None for v in variants], dtype=torch.bool)

    # Verify every span of every well-formatted curriculum rollout in one verifier call.
    spans = {i: parse_spans(texts[i], variants[i].K) for i in range(N) if curr[i]}
    jobs = [(i, j) for i, sp in spans.items() if sp is not None for j in range(len(sp))]
    ok = _verify(cfg, x.get("verifier"), [texts[i][spans[i][j][1]:spans[i][j][2]] for i, j in jobs],
                 [variants[i].answers[j] for i, j in jobs])
    r = {i: torch.zeros(variants[i].K) for i in spans}
    for (i, j), good in zip(jobs, ok):
        r[i][j] = float(good)

    metrics = {"curriculum/format_ok": [], "curriculum/progress": [], "curriculum/full_solve": [],
               "original/accuracy": []}
    for g in range(N // G):
        rows = torch.arange(g * G, (g + 1) * G)
        c_rows, o_rows = rows[curr[rows]], rows[~curr[rows]]
        if len(o_rows):
            a, z = group_advantages(inp.rewards[o_rows].float(), len(o_rows), inp.scale_rewards)
            adv[o_rows] = a.unsqueeze(1).expand(-1, C).clone()
            zero_std[o_rows] = z
            metrics["original/accuracy"] += inp.rewards[o_rows].tolist()
        if not len(c_rows):
            continue
        R = progress_rewards(torch.stack([r[int(i)] for i in c_rows]), cfg.progress_correction)
        A = position_advantages(R, cfg.normalize_std)  # (G_c, K)
        zero_std[c_rows] = bool((R.std(0) < 1e-6).all()) if len(c_rows) > 1 else True
        for row, a_row, R_row in zip(c_rows.tolist(), A, R):
            K = len(R_row)
            progress = int(R_row.sum()) if cfg.progress_correction else int(torch.cumprod(r[row], 0).sum())
            rewards[row] = float(progress == K)  # the row's scalar reward: the original problem solved in order
            metrics["curriculum/progress"].append(progress / K)
            metrics["curriculum/full_solve"].append(float(progress == K))
            metrics["curriculum/format_ok"].append(float(spans[row] is not None))
            if spans[row] is None:
                continue  # bad format: every token gets 0
            pick = (lambda s: (s[0], s[3])) if cfg.span_tokens == "tagged" else (lambda s: (s[1], s[2]))
            for j, toks in enumerate(token_positions(x["tokenizer"], ids[row], texts[row],
                                                     [pick(s) for s in spans[row]], C)):
                adv[row, toks] = float(a_row[j])
    adv = adv * (inp.completion_mask > 0)
    out_metrics = {k: sum(v) / len(v) for k, v in metrics.items() if v}
    out_metrics["curriculum/rows"] = float(curr.float().mean())
    return EstimatorOutput(adv, zero_std, out_metrics, rewards=rewards)
