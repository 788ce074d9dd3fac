"""The GRPO family's token masks (issue 23 §1) against hand computations of TRL's and verl's formulas.

TRL's GRPOTrainer: per_token = (policy term) · off_policy_mask · entropy_mask, then + β·KL on every token, then the
loss type's aggregation over the *unmasked* completion mask; the entropy quantile is taken over the completion mask
before the off-policy mask. TRL's GMPOTrainer drops masked tokens from the geometric mean; verl's geo_mean folds the
rollout IS weights into a per-sequence geometric mean. Every expected number below is worked out by hand in the
comments from those formulas, not from our implementation.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from grail_exp.loss import AggregationContext, compose_objective
from grail_exp.loss.masks import family_token_masks

# The issue's 2 × 4 example: every token valid, A = (+1, −1), entropies chosen so that ρ = 0.2 keeps 4 tokens.
# torch.quantile(·, 0.8) over the 8 entropies sorted [0.1, 0.1, 0.2, 0.3, 2, 2, 2, 2]: position 0.8·7 = 5.6 lies
# between two 2.0s, so the threshold is 2.0 and the kept tokens are row 0's last and row 1's first three.
ENTROPY = torch.tensor([[0.1, 0.2, 0.3, 2.0], [2.0, 2.0, 2.0, 0.1]])
KEPT = torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
A = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 4)
# At μ = 1 (old = sg(logp), ratio 1) ppo_clip's per-token loss is −A·ρ, so ∂ℓ_{i,t}/∂logp_{i,t} = −A_i.
# TRL grpo: L = (1/B) Σ_i (1/|o_i|) Σ_t f·ℓ  →  −A_i·f/(4·2) = ∓0.125 on kept tokens.
TRL_GRPO = torch.tensor([[0, 0, 0, -0.125], [0.125, 0.125, 0.125, 0]])
# TRL bnpo: L = Σ f·ℓ / Σ mask = Σ f·ℓ / 8  →  ∓0.125.  dapo: Σ f·ℓ / N_global with N_global = 8 → ∓0.125.
TRL_BNPO = TRL_GRPO
# Normalising by the kept tokens instead (loss.family_mask_normaliser: kept, before issue 23):
# grpo: row 0 has 1 kept token: −1/(1·2) = −0.5; row 1 has 3: +1/(3·2) = +1/6.   bnpo: ∓1/4.
KEPT_GRPO = torch.tensor([[0, 0, 0, -0.5], [1 / 6, 1 / 6, 1 / 6, 0]])
KEPT_BNPO = torch.tensor([[0, 0, 0, -0.25], [0.25, 0.25, 0.25, 0]])

# fp32 gradients of sums of ≤ 8 terms of size ≤ 1: a few ulps of 1 (≈ 1e-7 each); 1e-6 leaves room.
TOL = 1e-6


def _cfg(**kw):
    base = dict(epsilon=0.2, epsilon_high=0.28, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
                family_mask_normaliser="unmasked", top_entropy_population="all", gmpo_is_mean="geometric",
                sapo_tau_pos=1.0, sapo_tau_neg=1.05, kl_bias_correction=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _grad(cfg, loss_type="grpo", name="ppo_clip", policy_mask=KEPT, beta=0.0, logp0=None, ref=None, is_weight=None,
          adv=A):
    logp = (torch.full((2, 4), math.log(0.5)) if logp0 is None else logp0.clone()).requires_grad_(True)
    loss = SimpleNamespace(**vars(cfg), loss_type=loss_type, policy_loss=name, beta=beta, kl_estimator="k3")
    ctx = AggregationContext(max_completion_length=4, global_num_tokens=float(MASK.sum()))
    out = compose_objective(loss, ctx, logp, logp.detach(), adv.unsqueeze(1).expand(2, 4), MASK, ref_logp=ref,
                            is_weight=is_weight, policy_mask=policy_mask)
    out.loss.backward()
    return logp.grad, out


def test_the_masks_of_the_issue_example():
    fam = family_token_masks(ENTROPY, torch.zeros(2, 4), torch.zeros(2, 4), A, MASK, _cfg(top_entropy_quantile=0.2))
    assert torch.equal(fam.policy, KEPT) and torch.equal(fam.top_entropy, KEPT)
    assert fam.metrics["top_entropy/kept_token_frac"] == 0.5 and fam.metrics["family/policy_token_frac"] == 0.5
    off = family_token_masks(ENTROPY, torch.zeros(2, 4), torch.zeros(2, 4), A, MASK, _cfg())
    assert off.policy is None and off.metrics == {}
    assert torch.equal(off.term_mask(MASK, _cfg()), MASK)


@pytest.mark.parametrize("loss_type, trl, kept", [("grpo", TRL_GRPO, KEPT_GRPO), ("bnpo", TRL_BNPO, KEPT_BNPO),
                                                  ("dapo", TRL_GRPO, TRL_GRPO)])
def test_family_masks_keep_the_unmasked_normaliser_as_trl(loss_type, trl, kept):
    g, _ = _grad(_cfg(), loss_type)
    assert torch.allclose(g, trl, atol=TOL), g
    g, _ = _grad(_cfg(family_mask_normaliser="kept"), loss_type)
    assert torch.allclose(g, kept, atol=TOL), g


def test_kl_term_stays_on_masked_tokens_at_beta_004():
    # logp = log 0.5, ref = log 0.25: k3 = e^δ − δ − 1 with δ = ref − logp, ∂k3/∂logp = 1 − e^δ = 1 − 0.5 = 0.5.
    # TRL grpo: + β·0.5/(|o|·B) = 0.04·0.5/8 = 0.0025 on every token, kept or not.
    ref = torch.full((2, 4), math.log(0.25))
    g, out = _grad(_cfg(), "grpo", beta=0.04, ref=ref)
    assert torch.allclose(g, TRL_GRPO + 0.0025, atol=TOL), g
    # the logged KL is over every loss token: k3 = 0.5 + log 2 − 1
    assert out.metrics["kl"].item() == pytest.approx(0.5 + math.log(2.0) - 1.0, rel=1e-6)
    # kept: the KL goes with the mask: 0 on masked tokens; row 0: −0.5 + 0.04·0.5/(1·2) = −0.49;
    # row 1: 1/6 + 0.04·0.5/(3·2) = 1/6 + 1/300
    g, _ = _grad(_cfg(family_mask_normaliser="kept"), "grpo", beta=0.04, ref=ref)
    expected = torch.tensor([[0, 0, 0, -0.49], [1 / 6 + 1 / 300] * 3 + [0]])
    assert torch.allclose(g, expected, atol=TOL), g


def test_sequence_mean_losses_under_the_family_masks():
    # sapo (forced grpo aggregation): at ρ = 1 the gate's slope is 1, so ∂ℓ/∂logp = −A: the same as ppo_clip/grpo.
    g, _ = _grad(_cfg(), "dapo", name="sapo")
    assert torch.allclose(g, TRL_GRPO, atol=TOL), g
    g, _ = _grad(_cfg(family_mask_normaliser="kept"), "dapo", name="sapo")
    assert torch.allclose(g, KEPT_GRPO, atol=TOL), g
    # gspo (TRL importance_sampling_level="sequence", grpo): s_i = exp(mean over the 4 loss tokens of log ρ), so
    # L = (1/B) Σ_i (k_i/4)·(−A_i·s_i) with k_i kept tokens, and ∂s_i/∂logp_{i,t} = 1/4 on *every* token of row i:
    # row 0: −1·(1/4)(1/4)/2 = −1/32 ; row 1: +1·(3/4)(1/4)/2 = +3/32.
    g, _ = _grad(_cfg(), "dapo", name="gspo")
    assert torch.allclose(g, torch.tensor([[-1 / 32] * 4, [3 / 32] * 4]), atol=TOL), g
    # gmpo (TRL's GMPOTrainer): the masked tokens leave the geometric mean: coef_i = exp(mean over kept of l),
    # L = mean_i(−A_i·coef_i): ∂/∂logp on a kept token = −A_i/(k_i·B): −1/2 and +1/6; masked tokens 0.
    g, _ = _grad(_cfg(), "dapo", name="gmpo")
    assert torch.allclose(g, KEPT_GRPO, atol=TOL), g
    # and its KL: TRL adds β·mean_t(k3) per sequence, mean over sequences: 0.04·0.5/(4·2) = 0.0025 per token
    g, _ = _grad(_cfg(), "dapo", name="gmpo", beta=0.04, ref=torch.full((2, 4), math.log(0.25)))
    assert torch.allclose(g, KEPT_GRPO + 0.0025, atol=TOL), g


def test_gmpo_folds_rollout_is_weights_into_a_geometric_mean_as_verl():
    # verl geo_mean: pg_loss = mean_i( −A_i · s_i · exp(mean_t log w_{i,t}) ). At ratio 1, s_i = 1.
    w = torch.tensor([[0.5, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 4.0]])
    # geometric means: (0.5·2·1·1)^(1/4) = 1 and 4^(1/4) = √2; arithmetic: 1.125 and 1.75.
    g, out = _grad(_cfg(), "dapo", name="gmpo", policy_mask=None, is_weight=w)
    assert out.loss.item() == pytest.approx((-1.0 + math.sqrt(2.0)) / 2, rel=1e-6)
    # ∂/∂logp_{i,t} = −A_i · c_i · (1/4) / 2: −1/8 on row 0, +√2/8 on row 1
    assert torch.allclose(g, torch.tensor([[-1 / 8] * 4, [math.sqrt(2.0) / 8] * 4]), atol=TOL), g
    g, out = _grad(_cfg(gmpo_is_mean="arithmetic"), "dapo", name="gmpo", policy_mask=None, is_weight=w)
    assert out.loss.item() == pytest.approx((-1.125 + 1.75) / 2, rel=1e-6)
    # with the family mask the means run over the kept tokens: row 0 keeps w = 1 (t3), row 1 keeps (1, 1, 1) -> 1
    g, out = _grad(_cfg(), "dapo", name="gmpo", is_weight=w)
    assert out.loss.item() == pytest.approx((-1.0 + 1.0) / 2, abs=1e-7)
    assert torch.allclose(g, KEPT_GRPO, atol=TOL), g


def test_top_entropy_quantile_is_taken_before_the_off_policy_mask():
    # Row 1 (A < 0) is far off-policy: its mean log π_b − log π_θ = 1 > δ = 0.5, so OPSM drops it.
    behaviour = torch.tensor([[0.0] * 4, [1.0] * 4])
    ent = torch.tensor([[0.1, 0.2, 1.5, 2.0], [2.0, 2.0, 2.0, 0.1]])
    cfg = _cfg(top_entropy_quantile=0.5, off_policy_mask_threshold=0.5)
    # TRL: quantile 0.5 of all 8 sorted [0.1, 0.1, 0.2, 1.5, 2, 2, 2, 2]: position 3.5 -> (1.5 + 2)/2 = 1.75, so the
    # entropy mask keeps row 0's t3 and row 1's t0-t2; times OPSM: row 0's t3 alone.
    fam = family_token_masks(ent, torch.zeros(2, 4), behaviour, A, MASK, cfg)
    assert torch.equal(fam.policy, torch.tensor([[0.0, 0, 0, 1], [0, 0, 0, 0]]))
    assert torch.equal(fam.top_entropy, torch.tensor([[0.0, 0, 0, 1], [1, 1, 1, 0]]))
    assert fam.metrics["opsm/masked_token_frac"] == 0.5 and fam.metrics["family/policy_token_frac"] == 1 / 8
    # before issue 23 (off_policy_kept): the quantile over row 0's 4 tokens [0.1, 0.2, 1.5, 2.0]: position 1.5 ->
    # (0.2 + 1.5)/2 = 0.85, so t2 and t3 are kept.
    fam = family_token_masks(ent, torch.zeros(2, 4), behaviour, A, MASK,
                             _cfg(top_entropy_quantile=0.5, off_policy_mask_threshold=0.5,
                                  top_entropy_population="off_policy_kept"))
    assert torch.equal(fam.policy, torch.tensor([[0.0, 0, 1, 1], [0, 0, 0, 0]]))
    # OPSM alone: the row mask, no entropy mask
    fam = family_token_masks(ent, torch.zeros(2, 4), behaviour, A, MASK, _cfg(off_policy_mask_threshold=0.5))
    assert fam.top_entropy is None and torch.equal(fam.policy, torch.tensor([[1.0] * 4, [0.0] * 4]))
    # kept normaliser: terms see mask · f
    assert torch.equal(fam.term_mask(MASK, _cfg(family_mask_normaliser="kept")), fam.policy)
    assert torch.equal(fam.term_mask(MASK, _cfg()), MASK)


def test_entropy_bonus_covers_the_top_entropy_tokens_only():
    from grail_exp.loss.entropy_bonus import EntropyBonus, EntropyBonusConfig
    from grail_exp.loss.terms import TermContext

    term = EntropyBonus(EntropyBonusConfig(coef=0.5))

    def value(top):
        ctx = TermContext(model=None, batch=None, hidden=None, head_weight=None, head_bias=None, logp=None,
                          entropy=ENTROPY, mask=MASK, token_advantages=None, old_logp=None, ref_logp=None,
                          sampler_logp=None, temperature=1.0, step=0,
                          aggregate=lambda x, m: (x * m).sum() / m.sum(), top_entropy_mask=top)
        return term(ctx)[0].item()

    assert value(None) == pytest.approx(-0.5 * ENTROPY.mean().item(), rel=1e-6)
    # TRL: the mean entropy over mask × entropy mask = the four kept tokens, all 2.0
    assert value(KEPT) == pytest.approx(-0.5 * 2.0, rel=1e-6)


def test_new_keys_are_validated(compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["logger=none", "loss.family_mask_normaliser=tokens", "loss.top_entropy_population=x",
                              "loss.gmpo_is_mean=harmonic"]))
    for key in ("loss.family_mask_normaliser", "loss.top_entropy_population", "loss.gmpo_is_mean"):
        assert key in str(err.value), key
    cfg = compose_cfg(["logger=none"])
    assert (cfg.loss.family_mask_normaliser, cfg.loss.top_entropy_population, cfg.loss.gmpo_is_mean) == \
        ("unmasked", "all", "geometric")


@pytest.mark.parametrize("loss_type", ["dr_grpo", "bnpo"])
def test_family_masks_through_the_update_step_equal_trls_loss(compose_cfg, formatted_model_dir, loss_type):
    """The trainer's own step (UpdatePhase.step: forward, masks, aggregation, backward over two micro-batches) with the
    top-entropy mask (ρ = 0.5) and OPSM (δ = 0.5) on, against TRL's loss written out here from grpo_trainer.py
    (get_high_entropy_mask, get_off_policy_mask, _compute_loss) on a frozen copy of the model: the gradients agree."""
    import copy

    from helpers.module import FakeOpt, build_module, small_config
    from helpers.tolerances import MODEL_REORDER

    delta = 0.5
    cfg = small_config(compose_cfg, formatted_model_dir, ["advantage=grpo", f"loss.loss_type={loss_type}",
                                                          "loss.top_entropy_quantile=0.5",  # ρ: chosen below
                                                          f"loss.off_policy_mask_threshold={delta}",
                                                          "optim.max_grad_norm=null"])
    module = build_module(cfg, formatted_model_dir)  # the warm-started model: entropies spread out
    module.manual_backward = lambda loss: loss.backward()
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})  # 4 prompts x 4 rollouts; micro-batches of 8 rows
    frozen = copy.deepcopy(module.policy)
    P, C, T, L = batch.prompt_length, batch.completion_ids.shape[1], cfg.rollout.temperature, \
        cfg.rollout.max_completion_length

    def forward(rows):  # (logp, entropy) of the completion tokens, written out
        z = frozen(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                   position_ids=batch.position_ids[rows]).logits[:, P - 1:P - 1 + C].float() / T
        lsm = torch.log_softmax(z, -1)
        return lsm.gather(-1, batch.completion_ids[rows].unsqueeze(-1)).squeeze(-1), -(lsm.exp() * lsm).sum(-1)

    # The sampler's log-probs: the rollout-time ones, lifted by 1 nat on every other row, so OPSM drops the rows with
    # A < 0 among those (their mean log π_sampler − log π_θ = 1 > δ) and keeps the rest.
    with torch.no_grad():
        logp0, _ = forward(slice(None))
    lifted = (torch.arange(batch.num_rows) % 2 == 1).float().unsqueeze(1)
    batch.sampler_logp = logp0 + lifted
    dropped = ((batch.advantages < 0) & (lifted.squeeze(1) > 0))
    assert 0 < int(dropped.sum()) < int((batch.advantages < 0).sum())  # the mask acts, and not on every A < 0 row

    # ρ: the threshold is a quantile of the sampled tokens' entropies, and what the warm-started model samples differs
    # from CPU to CPU (its warm start does). A token whose entropy lies within rounding of the threshold may fall on
    # either side in the trainer's forward and in the reference's (fp32 in another order: an entropy <= log V moves by
    # <= MODEL_REORDER log V, the interpolated threshold by as much): the first ρ whose threshold is clear of every
    # other token's entropy in both micro-batches, so that the two masks are one mask whatever was sampled.
    clear = 2 * MODEL_REORDER * math.log(module.policy.config.vocab_size)

    def stable(rho: float) -> bool:
        for s in (0, 8):
            ent = entropies[s // 8][batch.loss_mask[s:s + 8].bool()]
            gap = (ent - torch.quantile(ent, 1 - rho)).abs()  # TRL: threshold = 1 − top_entropy_quantile
            if not bool(((gap == 0) | (gap > clear)).all()):  # 0: the token(s) the threshold is taken from
                return False
        return True

    with torch.no_grad():
        entropies = [forward(slice(s, s + 8))[1] for s in (0, 8)]
    rho = next((r for r in (0.5, 0.45, 0.55, 0.4, 0.6, 0.35, 0.65, 0.3, 0.7) if stable(r)), None)
    assert rho is not None, "no candidate ρ has its threshold clear of the sampled entropies"
    module.cfg.loss.top_entropy_quantile = rho  # read at every step (grail_exp/loss/masks.py)

    captured = {}
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)
    fake = FakeOpt(opt)
    fake.step = lambda: captured.setdefault("g", torch.cat([p.grad.flatten() for p in module.policy.parameters()]))
    module.update.step(batch, fake, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       float(batch.loss_mask.sum()), {}, epoch=0)

    K = 2  # micro-batches of the step
    for s in (0, 8):
        rows = slice(s, s + 8)
        logp, ent = forward(rows)
        m, adv = batch.loss_mask[rows], batch.advantages[rows].unsqueeze(1)
        thr = torch.quantile(ent.detach()[m.bool()], 1 - rho)  # TRL: threshold = 1 − top_entropy_quantile
        entropy_mask = ((ent.detach() >= thr) & m.bool()).float()
        kl = ((batch.sampler_logp[rows] - logp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        off_policy_mask = ((adv >= 0) | (kl <= delta)).float()
        ratio = torch.exp(logp - logp.detach())  # μ = 1: π_old = sg(π_θ)
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.loss.epsilon, 1 + cfg.loss.epsilon_high) * adv)
        per_token = per_token * off_policy_mask * entropy_mask
        if loss_type == "dr_grpo":  # TRL: Σ ℓ·m / (B · L_max), / gradient-accumulation steps
            loss = (per_token * m).sum() / (8 * L) / K
        else:  # bnpo: Σ ℓ·m / Σ m over the micro-batch (the unmasked count), / gradient-accumulation steps
            loss = (per_token * m).sum() / m.sum().clamp(min=1) / K
        loss.backward()
    expected = torch.cat([p.grad.flatten() for p in frozen.parameters()])
    assert expected.abs().sum() > 0
    # Two fp32 computations of one gradient in another reduction order: <= MODEL_REORDER of its scale, x2 for
    # cancellation (as tests/test_module.py's accumulation check).
    assert torch.allclose(captured["g"], expected, rtol=0, atol=2 * MODEL_REORDER * expected.abs().max().item())
