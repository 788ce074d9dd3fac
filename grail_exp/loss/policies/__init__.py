"""The GRPO family's policy losses (TRL, verl, OpenRLHF), one file each; importing this package registers them.

Every loss here has the ``grail_exp.loss.policy`` signature fn(logp, old_logp, adv, mask, cfg) -> PolicyLossOutput
with Â = sg(w)·A (B, T), so it composes with every token-weight scheme (GRAIL, OAR, ...). With μ = 1 (ratio 1,
old = sg(logp)) every loss except ``kl_cov``'s extra penalty and ``clip_cov``'s detached tokens has the gradient
of −Â·logp (tested in tests/test_family_losses.py).
"""

from __future__ import annotations

from grail_exp.registry import import_modules

import_modules(__name__, __path__)  # every surrogate module here registers itself


def check_family_config(cfg) -> list[str]:
    """Validation of the family's ``loss.*`` knobs (called from grail_exp/validate.py)."""
    L, e = cfg.loss, []

    def check(ok, key, why):
        if not ok:
            e.append(f"loss.{key} = {L.get(key)!r}: {why}")

    check(L.get("clip_ratio_c") is None or L.clip_ratio_c > 1.0, "clip_ratio_c", "must be > 1 or null (dual-clip)")
    check(L.get("delta") is None or L.delta > 1.0, "delta", "must be > 1 or null (two-sided clipping)")
    for k in ("sapo_tau_pos", "sapo_tau_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
              "kl_cov_coef"):
        check(L.get(k, 1.0) > 0, k, "must be > 0")
    for k in ("clip_cov_ratio", "kl_cov_ratio"):
        check(0 < L.get(k, 1e-4) <= 1, k, "must be in (0, 1]")
    check(L.get("clip_cov_lb", 1.0) <= L.get("clip_cov_ub", 5.0), "clip_cov_lb", "must be <= loss.clip_cov_ub")
    check(0 < L.get("top_entropy_quantile", 1.0) <= 1, "top_entropy_quantile", "must be in (0, 1] (1 = off)")
    check(L.get("off_policy_mask_threshold") is None or L.off_policy_mask_threshold >= 0, "off_policy_mask_threshold",
          "must be >= 0 or null")
    from grail_exp.loss.masks import NORMALISERS, POPULATIONS
    from grail_exp.loss.policies.gmpo import IS_MEANS

    for key, valid, default in (("family_mask_normaliser", NORMALISERS, "unmasked"),
                                ("top_entropy_population", POPULATIONS, "all"), ("gmpo_is_mean", IS_MEANS, "geometric")):
        check(L.get(key, default) in valid, key, f"must be one of {', '.join(valid)}")
    e += _reward_shaping_problems(cfg) + _dynamic_sampling_problems(cfg) + _term_problems(L)
    if L.policy_loss == "cispo":
        check(L.epsilon <= 1.0, "epsilon", "cispo clips the weight to [1 - epsilon, 1 + epsilon_high]: must be <= 1")
    return e


def _reward_shaping_problems(cfg) -> list[str]:
    """``loss.kl_in_reward`` and ``reward.overlong_buffer`` when enabled."""
    e, kir = [], cfg.loss.get("kl_in_reward")
    if kir is not None and kir.enabled:
        from grail_exp.loss.kl import KL_ESTIMATORS

        if kir.estimator not in KL_ESTIMATORS:
            e.append(f"loss.kl_in_reward.estimator = {kir.estimator!r}: must be one of: {', '.join(sorted(KL_ESTIMATORS))}")
        if kir.controller not in ("fixed", "adaptive"):
            e.append(f"loss.kl_in_reward.controller = {kir.controller!r}: must be fixed or adaptive")
        if kir.coef < 0 or kir.target <= 0 or kir.horizon < 1:
            e.append(f"loss.kl_in_reward: coef = {kir.coef} must be >= 0, target = {kir.target} > 0, "
                     f"horizon = {kir.horizon} >= 1")
    ob = cfg.get("reward", {}).get("overlong_buffer") if hasattr(cfg, "get") else None
    if ob is not None and ob.enabled:
        L_max = cfg.rollout.max_completion_length
        if not 0 < ob.length <= L_max:
            e.append(f"reward.overlong_buffer.length = {ob.length!r}: must be in (0, rollout.max_completion_length = {L_max}]")
        if ob.penalty_factor < 0:
            e.append(f"reward.overlong_buffer.penalty_factor = {ob.penalty_factor!r}: must be >= 0")
    return e


def _dynamic_sampling_problems(cfg) -> list[str]:
    """``rollout.dynamic_sampling`` when enabled: one process only."""
    e, ds = [], cfg.get("rollout", {}).get("dynamic_sampling") if hasattr(cfg, "get") else None
    if ds is not None and ds.enabled:
        t = cfg.trainer
        from grail_exp.world import configured_world_size

        world = configured_world_size(t)
        if ds.max_extra_rounds < 0:
            e.append(f"rollout.dynamic_sampling.max_extra_rounds = {ds.max_extra_rounds!r}: must be >= 0")
        if world != 1:
            e.append("rollout.dynamic_sampling.enabled = true: only implemented for one process (world size "
                     f"{world}); every rank would need to agree on the kept groups")
    return e


def _term_problems(L) -> list[str]:
    """Each ``loss.terms`` entry's own checks (e.g. entropy_bonus's bounds), on its typed config."""
    from omegaconf import OmegaConf

    from grail_exp.loss.terms import LOSS_TERMS

    e = []
    for name, node in (L.get("terms") or {}).items():
        if name in LOSS_TERMS and node is not None:
            try:
                typed = OmegaConf.merge(OmegaConf.structured(LOSS_TERMS[name].config_class), node)
            except Exception as exc:  # omegaconf names the offending key
                e.append(f"loss.terms.{name}: {exc}".split("\n")[0])
                continue
            e.extend(f"loss.terms.{name}.{msg}" for msg in LOSS_TERMS[name].check_config(typed))
    return e
