"""Extra cost of RLSD's teacher forward and of SDPG's terms vs the policy update, on the embedded CPU default.

    PYTHONPATH=. OMP_NUM_THREADS=1 python sweeps/cost_rlsd_sdpg.py [rows] [completion_len] [reps]

One micro-batch of `rows` arithmetic prompts with random completions of `completion_len` tokens. Times (median of
`reps`, seconds): the update (policy forward + dr_grpo loss + backward), RLSD's weights with a live teacher (teacher
forward + student log-probs from the update's forward), SDPG's L_OPD (teacher forward + chunked full-vocabulary KL,
forward and backward) and L_K (the term; its reference forward is timed separately, once per rollout batch in the
trainer). The embedded model's vocabulary is 318 tokens, so the (n, V) logits work is tiny here: on a 150k-vocab
model L_OPD's two (chunk, V) projections per chunk weigh far more. CPU only; GPU cost is UNMEASURED.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from omegaconf import OmegaConf


def main(rows: int = 64, completion_len: int = 48, reps: int = 5) -> None:
    sys.path.insert(0, "tests")
    from grail_exp.advantages import SchemeBatch
    from grail_exp.advantages.gradient_probe import predicting_window
    from grail_exp.advantages.rlsd import RlsdConfig, RlsdScheme
    from grail_exp.compute.forward import policy_forward, position_ids_from_mask
    from grail_exp.config import LossConfig
    from grail_exp.data import build_source
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.loss import AggregationContext, TermContext, compose_objective
    from grail_exp.loss.sdpg import SdpgOpdConfig, SdpgOpdTerm, SdpgRefKlConfig, SdpgRefKlTerm
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.rollout import Completion, pad_completions
    from helpers.compose import compose

    torch.manual_seed(0)
    cfg = compose(["logger=none"])
    path = resolve_model_path(cfg)
    tok = load_tokenizer(path, cfg)
    model = load_causal_lm(path, cfg, trainable=True)
    ref = load_causal_lm(path, cfg, trainable=False)
    src = build_source(cfg.data)
    problems = [src[i] for i in range(rows)]
    prompts = encode_prompts([p.question for p in problems], tok, cfg.model, cfg.data.instruction)
    comps = [torch.randint(5, len(tok), (completion_len,)).tolist() for _ in range(rows)]
    rb = pad_completions([Completion(p, c, None, False) for p, c in zip(prompts, comps)], tok.pad_token_id)
    attn = torch.cat([rb.prompt_mask, rb.completion_mask], 1)
    adv = torch.randn(rows)
    b = SchemeBatch(input_ids=torch.cat([rb.prompt_ids, rb.completion_ids], 1), attention_mask=attn,
                    position_ids=position_ids_from_mask(attn), prompt_length=rb.prompt_ids.shape[1],
                    completion_ids=rb.completion_ids, completion_mask=rb.completion_mask.float(), advantages=adv,
                    rewards=(adv > 0).float(), problems=[p.question for p in problems],
                    gold_answers=[p.answer for p in problems], step=0)
    mask = b.completion_mask
    rlsd = RlsdScheme(OmegaConf.structured(RlsdConfig(teacher="live")), tok, {"model": cfg.model, "data": cfg.data})
    opd = SdpgOpdTerm(OmegaConf.structured(SdpgOpdConfig()), tok, cfg.model)
    refkl = SdpgRefKlTerm(OmegaConf.structured(SdpgRefKlConfig()), tok, cfg.model)

    def fwd():
        return policy_forward(model, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids, 1.0)

    def loss_of(logp):
        return compose_objective(LossConfig(loss_type="dr_grpo", epsilon=0.2, epsilon_high=0.28),
                                 AggregationContext(completion_len), logp, logp.detach(),
                                 adv.unsqueeze(1).expand_as(logp), mask).loss

    def ctx(logp, entropy, f, ref_logp=None):
        return TermContext(model=model, batch=b, hidden=predicting_window(f.hidden, b.prompt_length, completion_len),
                           head_weight=f.head_weight, head_bias=f.head_bias, logp=logp, entropy=entropy, mask=mask,
                           token_advantages=adv.unsqueeze(1) * mask, old_logp=logp.detach(), ref_logp=ref_logp,
                           sampler_logp=None, temperature=1.0, step=0,
                           aggregate=lambda x, m: (x * m).sum() / m.sum().clamp(min=1), tokenizer=tok)

    def timed(fn):
        out = []
        for _ in range(reps + 1):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out[1:])  # the first call warms up

    def update():
        logp, _, _ = fwd()
        loss_of(logp).backward()

    def rlsd_weights():
        logp, _, f = fwd()
        with torch.no_grad():
            rlsd.weights_from_forward(model, b, f)

    def opd_term():
        logp, ent, f = fwd()
        h = f.hidden.detach().requires_grad_(True)  # time the term alone: backward stops at the hidden states
        c = ctx(logp, ent, f)
        c.hidden = predicting_window(h, b.prompt_length, completion_len)
        opd(c)[0].backward()

    def ref_forward():
        with torch.no_grad():
            policy_forward(ref, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids, 1.0)

    ref_logp = policy_forward(ref, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids, 1.0)[0].detach()

    def refkl_term():
        logp = torch.randn(rows, completion_len, requires_grad=True)
        refkl(ctx(logp, logp, type("F", (), {"hidden": torch.zeros(rows, b.input_ids.shape[1], 1),
                                             "head_weight": None, "head_bias": None})(), ref_logp))[0].backward()

    def forward_only():
        with torch.no_grad():
            fwd()

    from grail_exp.teacher import build_teacher_batch

    p_rlsd = build_teacher_batch(b, tok, cfg.model, "rlsd").prompt_length
    p_sdpg = build_teacher_batch(b, tok, cfg.model, "sdpg").prompt_length
    t_up = timed(update)
    t_fwd = timed(forward_only)
    t_rlsd = timed(rlsd_weights) - t_fwd  # minus the policy forward it shares with the update
    t_opd = timed(opd_term) - t_fwd
    t_ref = timed(ref_forward)
    t_refkl = timed(refkl_term)
    print(f"embedded default: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, V = {len(tok)}, "
          f"{rows} rows x (P = {b.prompt_length} + C = {completion_len}), median of {reps}, "
          f"{torch.get_num_threads()} thread(s); teacher prompt width P' = {p_rlsd} (rlsd) / {p_sdpg} (sdpg)")
    print(f"update (fwd + loss + bwd)          {t_up * 1e3:8.1f} ms")
    print(f"RLSD teacher + student log-probs   {t_rlsd * 1e3:8.1f} ms  (+{100 * t_rlsd / t_up:.0f}% of the update)")
    print(f"SDPG L_OPD (teacher + KL fwd/bwd)   {t_opd * 1e3:8.1f} ms  (+{100 * t_opd / t_up:.0f}%)")
    print(f"SDPG reference forward (per batch) {t_ref * 1e3:8.1f} ms  (+{100 * t_ref / t_up:.0f}%)")
    print(f"SDPG L_K term                      {t_refkl * 1e3:8.1f} ms  (+{100 * t_refkl / t_up:.0f}%)")


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
