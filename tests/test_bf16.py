"""bf16 numerics (issue 9 §1): fp32 master weights, exact token counts, probe dtypes, float32 advantages."""

from __future__ import annotations

import pytest
import torch

from helpers.pinned_step import pinned_module


def _train(dtype, steps: int, lr: float, master_weights=None):
    """``steps`` optimiser steps on the fixed batch; returns per-step losses and the trained fp32 parameters."""
    from grail_exp.optim import MasterWeightAdamW, build_optimizer

    module, batch = pinned_module(dtype)
    cfg = module.cfg
    cfg.optim.lr = lr
    master = (dtype != torch.float32) if master_weights is None else master_weights
    opt = build_optimizer(module.policy, cfg.optim, master_weights=master)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    start = [p.detach().float().clone() for p in module.policy.parameters()]
    losses = []
    for _ in range(steps):
        losses.append(module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, 0)["loss"])
    params = opt.masters if isinstance(opt, MasterWeightAdamW) else [p.detach().float() for p in module.policy.parameters()]
    return losses, start, params, module.policy


def test_bf16_with_master_weights_really_trains_at_lr_1e6():
    """At lr 1e-6 an Adam step is far below bf16's spacing: in-place bf16 AdamW leaves almost every weight unchanged,
    the fp32 masters move (> 90 % of them) — the defect issue 9 describes, and its fix."""
    _, start, masters, _ = _train(torch.bfloat16, steps=3, lr=1e-6)
    moved = torch.cat([(m != s).flatten() for m, s in zip(masters, start)]).float().mean().item()
    assert moved > 0.9, f"only {moved:.1%} of the master weights moved"
    _, start_b, plain, _ = _train(torch.bfloat16, steps=3, lr=1e-6, master_weights=False)
    moved_plain = torch.cat([(p != s).flatten() for p, s in zip(plain, start_b)]).float().mean().item()
    assert moved_plain < 0.1, f"in-place bf16 AdamW moved {moved_plain:.1%} of the weights at lr 1e-6"


def test_bf16_run_tracks_fp32_run():
    """Same data, same init: losses within 2 % and the update direction within 10 % (relative L2) over 4 steps at
    lr 1e-3; the bf16 model's own weights are the masters rounded."""
    l32, s32, p32, _ = _train(torch.float32, steps=4, lr=1e-3)
    l16, s16, p16, model16 = _train(torch.bfloat16, steps=4, lr=1e-3)
    for a, b in zip(l32, l16):
        assert abs(a - b) <= 0.02 * abs(a) + 1e-3, (l32, l16)
    d32 = torch.cat([(p - s).flatten() for p, s in zip(p32, s32)])
    d16 = torch.cat([(p - s).flatten() for p, s in zip(p16, s16)])
    rel = ((d16 - d32).norm() / d32.norm()).item()
    assert rel < 0.1, f"bf16 update differs from fp32 by {rel:.3f} (relative L2)"
    for p, m in zip(model16.parameters(), p16):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))


def test_master_weights_survive_a_checkpoint_round_trip():
    from grail_exp.optim import build_optimizer

    losses, _, masters, model = _train(torch.bfloat16, steps=2, lr=1e-3)
    module, _ = pinned_module(torch.bfloat16)
    opt = build_optimizer(model, module.cfg.optim, master_weights=True)
    sd = opt.state_dict()
    sd["master_weights"] = [m.clone() for m in masters]
    opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, masters))


def test_validate_rejects_bf16_without_master_weights(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match=r"model.dtype = 'bfloat16' with optim.master_weights = false"):
        validate(compose_cfg(["model.dtype=bfloat16", "optim.master_weights=false"]))
    validate(compose_cfg(["model.dtype=bfloat16"]))  # null = masters on for half precision


def test_validate_refuses_lightning_deepspeed_and_unknown_sharding(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match=r"trainer.strategy = 'deepspeed_stage_2'.*trainer=deepspeed_zero2"):
        validate(compose_cfg(["trainer=fsdp", "trainer.strategy=deepspeed_stage_2"]))
    # DeepSpeed keeps the fp32 masters itself: bf16 without the trainer's master-weight AdamW is fine there
    validate(compose_cfg(["trainer=deepspeed_zero2", "model.dtype=bfloat16", "optim.master_weights=false"]))
    with pytest.raises(ConfigError, match=r"trainer.sharding_strategy = 'HYBRID_SHARD'"):
        validate(compose_cfg(["trainer=fsdp", "trainer.sharding_strategy=HYBRID_SHARD"]))
    cfg = validate(compose_cfg(["trainer=fsdp_zero2", "model.dtype=bfloat16", "optim.master_weights=false"]))
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.sharding_strategy == "SHARD_GRAD_OP"


def test_token_counts_are_exact_in_bf16():
    """4,095 valid tokens: a bf16 mask sum rounds to 4,096; the aggregations and masked means count in float32."""
    from grail_exp.loss import AGGREGATIONS, AggregationContext, masked_mean

    mask = torch.zeros(1, 4100, dtype=torch.bfloat16)
    mask[0, :4095] = 1
    assert mask.sum().item() == 4096  # the trap
    per_token = torch.ones(1, 4100, dtype=torch.bfloat16)
    ctx = AggregationContext(max_completion_length=4100, global_num_tokens=None)
    assert AGGREGATIONS["bnpo"](per_token, mask, ctx).item() == 1.0
    assert AGGREGATIONS["grpo"](per_token, mask, ctx).item() == 1.0
    assert masked_mean(per_token, mask).item() == 1.0


def test_oar_g_teacher_mean_stays_in_the_logits_dtype():
    """The reference divides the bf16 span sum by an integer count: the mean stays bf16, bit for bit."""
    from grail_exp.advantages.oar import span_mean_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g).bfloat16()
    span = torch.zeros(2, 7, dtype=torch.bool)
    span[0, 2:5] = True
    span[1, 6] = True
    out = span_mean_logits(logits, span)
    assert out.dtype == torch.bfloat16
    n = span.long().sum(1, keepdim=True)  # the reference's integer count
    assert torch.equal(out, (logits * span.unsqueeze(-1).to(logits.dtype)).sum(1) / n)


def test_oar_g_gathered_span_sum_accumulates_in_float32_and_rounds_once():
    """The gathered teacher sums a row's span logits in float32 and rounds to bf16 once, bit for bit what the reference's
    dense (B, C, V) bf16 ``sum(1)`` gives; the old bf16 ``index_add_`` rounded after every add. Logits are multiples
    of 1/8 in [-4, 4] (exact in bf16) so every float32 partial sum here is exact and the once-rounded value is known."""
    from grail_exp.advantages.oar import span_mean_logits, span_sum_rows

    g = torch.Generator().manual_seed(0)
    B, C, V = 2, 400, 64
    dense = (torch.randint(-32, 33, (B, C, V), generator=g).double() / 8).bfloat16()
    span = torch.zeros(B, C, dtype=torch.bool)
    span[0, :300] = True  # many adds: partial sums reach ~100, where bf16's spacing is 0.5
    span[1, 350:380] = True
    rows, slots = span.nonzero(as_tuple=True)
    gathered = dense[rows, slots]  # (n_span, V), row-major as the scheme gathers them
    counts = span.long().sum(1)
    got = span_sum_rows(gathered, counts)
    exact = torch.stack([dense[b][span[b]].double().sum(0) for b in range(B)])  # exact: ≤ 300 multiples of 1/8
    assert got.dtype == torch.bfloat16 and torch.equal(got, exact.bfloat16())
    n = counts.unsqueeze(1)
    assert torch.equal(got / n, span_mean_logits(dense, span))  # = the reference's dense bf16 mean
    # The previous code, ``index_add_`` into a bf16 buffer: on CUDA each add is an atomic bf16 add, rounded to bf16
    # (in whatever order the threads run). Emulated here in row order (CPU's own bf16 index_add_ happens to accumulate
    # more precisely, so it cannot show the CUDA rounding):
    old = torch.zeros(B, V, dtype=torch.bfloat16)
    for r, x in zip(rows.tolist(), gathered):
        old[r] = old[r] + x  # bf16 + bf16 -> rounded to bf16
    assert not torch.equal(old, exact.bfloat16())
    assert (old.double() - exact).abs().max().item() >= 0.5  # errors of many roundings, not one
    # another order of the same adds gives yet another result: the CUDA sum is not even reproducible
    rev = torch.zeros(B, V, dtype=torch.bfloat16)
    for r, x in zip(reversed(rows.tolist()), gathered.flip(0)):
        rev[r] = rev[r] + x
    assert not torch.equal(rev, old)


def test_scheme_weights_multiply_the_advantage_in_float32(monkeypatch):
    """bf16 weights (1 + 2^-7, a bf16 number) times A are formed in float32: w·A = -0.755859375 for A = -0.75, which a
    bf16 product would round to -0.7578125."""
    import grail_exp.training.update as mod

    module, batch = pinned_module(torch.bfloat16)
    seen = {}
    real = mod.compose_objective

    def spy(loss, ctx, logp, old, token_adv, mask, **kw):
        seen["dtype"], seen["adv"] = token_adv.dtype, token_adv
        return real(loss, ctx, logp, old, token_adv, mask, **kw)

    monkeypatch.setattr(mod, "compose_objective", spy)
    w = torch.full(batch.loss_mask.shape, 1.0078125, dtype=torch.bfloat16)  # exactly representable in bf16
    module.update.weights = lambda b, s, e, it, fwd: (w[s:e], {}, True)
    from grail_exp.optim import build_optimizer

    opt = build_optimizer(module.policy, module.cfg.optim, master_weights=True)
    module.update.step(batch, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       batch.loss_mask.sum().item(), {}, 0)
    assert seen["dtype"] == torch.float32
    a = batch.advantages[-4:].float().unsqueeze(1) * 1.0078125  # float32 product, not rounded to bf16
    assert torch.equal(seen["adv"], a.expand_as(seen["adv"]))
    assert not torch.equal(seen["adv"], (batch.advantages[-4:].bfloat16().unsqueeze(1) * w[:1, :1]).float()
                           .expand_as(seen["adv"]))


def test_grail_probe_in_bf16_shared_forward_equals_separate_probe():
    """In bf16 the probe keeps the reference's dtypes (log-softmax in the logits' dtype) on both paths."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import policy_forward

    module, batch = pinned_module(torch.bfloat16, ["advantage=grail", "advantage.symmetry=both"])
    module.scheme = build_scheme(module.cfg.advantage, module.tokenizer)
    module.rollout.prepare(batch, {})
    sb = batch.scheme_view(module.scheme_ctx, 0, 4)
    with torch.enable_grad():
        _, _, fwd = policy_forward(module.policy, batch.input_ids[:4], batch.attention_mask[:4],
                                   batch.position_ids[:4], batch.completion_ids[:4], 1.0)
        shared = module.scheme.weights_from_forward(module.policy, sb, fwd).weights
    separate = module.scheme.weights(module.policy, sb).weights
    # Exact in practice, not by construction: both paths reduce each row over the hidden size in the same blocking
    # whatever the number of rows, and were bit-identical with the AVX-512, AVX2 and generic kernels. A bf16
    # reordering bound (2^-8 relative per reduction) would be too loose to test anything; if another CPU's bf16
    # kernels ever differ here, compare in float32 instead.
    assert torch.allclose(shared, separate, atol=1e-6)


# ---------------------------------------------------------------------------------------------- trainer.logprob_dtype
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_dtype_model_is_the_references_bf16_log_softmax(temperature):
    """``trainer.logprob_dtype: model`` on a bf16 policy = TRL's computation, written independently: the model's own
    bf16 logits (its forward, lm_head included), ``/ T`` in bf16, ``log_softmax`` in bf16, the sampled token's value —
    bit for bit. ``float32`` (the default) is the float32 softmax of the same bf16 logits, unchanged by the option."""
    from grail_exp.compute.forward import policy_forward

    module, batch = pinned_module(torch.bfloat16)
    model, C = module.policy, batch.completion_ids.shape[1]
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, temperature)
    with torch.no_grad():
        model_lp, model_ent, _ = policy_forward(*args, logprob_dtype="model")
        f32_lp, f32_ent, _ = policy_forward(*args, logprob_dtype="float32")
        default_lp, _, _ = policy_forward(*args)
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    use_cache=False)
    logits = out.logits[:, batch.prompt_length - 1:batch.prompt_length + C - 1]  # bf16, the model's own head
    assert logits.dtype == torch.bfloat16
    scaled = logits / temperature if temperature != 1.0 else logits  # TRL: logits /= temperature, in bf16
    want = torch.stack([torch.log_softmax(row, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # TRL's row loop
                        for row, ids in zip(scaled, batch.completion_ids)])
    assert want.dtype == torch.bfloat16 and model_lp.dtype == torch.float32
    real = batch.attention_mask[:, batch.prompt_length:].bool()  # the completions' tokens (the padding reads 0)
    assert not bool(real.all())
    assert torch.equal(model_lp[real], want.float()[real])
    assert bool((model_lp[~real] == 0).all()) and bool((f32_lp[~real] == 0).all())
    assert torch.equal(f32_lp, default_lp)  # the default path is the float32 one, untouched
    f32_want = torch.log_softmax(logits.float() / temperature, -1).gather(-1, batch.completion_ids.unsqueeze(-1))
    assert torch.allclose(f32_lp[real], f32_want.squeeze(-1)[real], atol=1e-5)  # fp32 softmax of the same bf16 logits
    assert not torch.equal(f32_lp[real], model_lp[real])  # the float32 values are not bf16-rounded
    assert torch.equal(f32_ent, model_ent)  # entropies stay float32 either way


def test_logprob_dtype_model_gives_exact_ratio_one_after_a_small_update():
    """What the reference's bf16 log-probs do to the PPO ratio: after a tiny change of the weights most tokens' bf16
    log-probs are unchanged, so ρ = exp(logp − logp_old) is exactly 1 for them; in float32 almost none are."""
    from grail_exp.compute.forward import policy_forward

    module, batch = pinned_module(torch.bfloat16)
    model = module.policy
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids, 1.0)
    with torch.no_grad():
        old = {d: policy_forward(model, *args, logprob_dtype=d)[0] for d in ("model", "float32")}
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():  # one bf16 ulp on 2 % of the weights: a small optimiser step
            bump = (torch.rand(p.shape, generator=g) < 0.02).to(torch.int16)
            p.copy_((p.view(torch.int16) + bump).view(torch.bfloat16))  # +1 in the bit pattern: the next bf16
        new = {d: policy_forward(model, *args, logprob_dtype=d)[0] for d in ("model", "float32")}
    m = batch.loss_mask.bool()
    exact = {d: (torch.exp(new[d] - old[d])[m] == 1.0).float().mean().item() for d in new}
    assert exact["model"] > 0.5 and exact["float32"] < 0.1, exact


def test_logprob_dtype_is_validated(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    assert validate(compose_cfg([])).trainer.logprob_dtype == "float32"
    assert validate(compose_cfg(["trainer.logprob_dtype=model"])).trainer.logprob_dtype == "model"
    with pytest.raises(ConfigError, match=r"trainer\.logprob_dtype"):
        validate(compose_cfg(["trainer.logprob_dtype=bfloat16"]))


# ---------------------------------------------------------------------------------------------- optim.grad_accum_dtype
@pytest.mark.parametrize("acc", ["fp32", "bf16"])
def test_grad_accum_dtype_sums_the_micro_batches_as_named(acc):
    """A bf16 model, one step over 4 micro-batches: ``fp32`` (our default) hands the optimiser the float32 sum of the
    four bf16 micro-batch gradients; ``bf16`` (ZeRO's bf16 default) their sum in bf16, rounded after every add, then
    converted once. Both computed here from the gradients recorded per backward, bit for bit."""
    from grail_exp.optim import MasterWeightAdamW
    from grail_exp.training.backends.local import LocalBackend

    module, batch = pinned_module(torch.bfloat16, ["trainer.micro_batch_size=2", f"optim.grad_accum_dtype={acc}"])
    assert batch.num_rows // 2 == 4
    opt = LocalBackend(module.cfg, module).build_optimizer(module.policy)
    assert isinstance(opt, MasterWeightAdamW)
    params = list(module.policy.parameters())
    seen = [[] for _ in params]
    for i, p in enumerate(params):  # each backward's incoming bf16 gradient, before any accumulation
        p.register_hook(lambda g, i=i: seen[i].append(g.detach().clone()))
    got = {}

    def capture(closure=None):
        got["grads"] = [m.grad.clone() for m in opt.masters]  # what AdamW steps with

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    opt.step = capture
    module.update.step(batch, opt, sched, batch.loss_mask.sum().item(), {}, 0)
    for i in range(len(params)):
        gs = seen[i]
        assert len(gs) == 4 and all(g.dtype == torch.bfloat16 for g in gs)
        if acc == "fp32":
            want = gs[0].float() + gs[1].float() + gs[2].float() + gs[3].float()
        else:
            total = gs[0]
            for g in gs[1:]:
                total = total + g  # bf16 + bf16: rounded each time
            want = total.float()
        assert torch.equal(got["grads"][i], want), (acc, i)
    if acc == "bf16":  # and the two differ somewhere: bf16 accumulation is not the fp32 sum
        fp32 = [sum(g.float() for g in gs) for gs in seen]
        assert any(not torch.equal(a, b) for a, b in zip(got["grads"], fp32))


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_master_gradients_are_the_float32_sum_while_the_first_is_held_in_bf16(micro_batches):
    """fp32 accumulation holds the first micro-batch's bf16 gradient as it came (half the bytes through the second
    backward) and widens it when the second arrives or at the step: what AdamW steps with is still the float32 sum of
    the bf16 gradients, bit for bit, for 1, 2 or 3 micro-batches; between the first and second backward no float32
    gradient exists yet."""
    from grail_exp.optim import MasterWeightAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    seen = [[] for _ in params]
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: seen[i].append(g.detach().clone()))
    for k in range(micro_batches):
        model(torch.randn(4, 7, dtype=torch.bfloat16)).square().sum().backward()
        assert all(p.grad is None for p in params)  # nothing left on the bf16 parameters
        if k == 0:
            assert all(m.grad is None for m in opt.masters)  # no float32 buffer while only one gradient exists
    got = [g.grad.clone() for g in opt.grad_params()]  # what clipping and AdamW see
    for i in range(len(params)):
        want = seen[i][0].float()
        for g in seen[i][1:]:
            want = want + g.float()  # float32 sums, in micro-batch order
        assert got[i].dtype == torch.float32 and torch.equal(got[i], want), i
    opt.step()
    opt.zero_grad()
    model(torch.randn(4, 7, dtype=torch.bfloat16)).sum().backward()  # a fresh step starts from nothing held
    assert all(m.grad is None for m in opt.masters)
    assert torch.equal(opt.grad_params()[0].grad, seen[0][-1].float())


def test_grad_accum_dtype_is_validated(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    assert validate(compose_cfg([])).optim.grad_accum_dtype is None
    with pytest.raises(ConfigError, match=r"optim\.grad_accum_dtype"):
        validate(compose_cfg(["optim.grad_accum_dtype=fp16"]))
    with pytest.raises(ConfigError, match=r"optim\.grad_accum_dtype.*trainer=ddp"):
        validate(compose_cfg(["trainer=ddp", "optim.grad_accum_dtype=bf16"]))
    with pytest.raises(ConfigError, match=r"optim\.grad_accum_dtype.*FSDP"):
        validate(compose_cfg(["trainer=fsdp", "optim.grad_accum_dtype=fp32"]))
