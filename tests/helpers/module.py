"""The training module on a local tiny model, without the Lightning Trainer: build it, and take one optimiser step.

``small_config`` composes a short run (4 prompts x 4 rollouts, 12 new tokens); ``build_module`` assembles the run's
building blocks around it with the ``AlternatingVerifier`` (a random model solves nothing, so rewards alternate and
advantages are non-zero); ``train_step`` makes one rollout batch and runs ``module.update.step`` on it with a
``FakeOpt`` in place of Lightning's optimizer wrapper.
"""

from __future__ import annotations

import torch

from helpers.fakes import AlternatingVerifier


def small_config(compose_cfg, model_dir, extra=()):
    """The validated config of a short run on the model in ``model_dir``; ``compose_cfg`` is the fixture."""
    from grail_exp.validate import validate

    cfg = compose_cfg([f"model.name_or_path={model_dir}", "logger=none", "trainer.prompts_per_step=4",
                       "trainer.micro_batch_size=8", "rollout.num_generations=4", "rollout.max_completion_length=12",
                       # a random model rarely stops within 12 tokens: keep truncated rows in the loss here
                       "loss.mask_truncated_completions=false", *extra])
    return validate(cfg)


def build_module(cfg, model_dir, engine: str = "hf"):
    """The run's building blocks, on a local tiny model, without the Lightning Trainer (``engine``: a
    ``rollout.engine`` name, e.g. ``helpers.fakes:ScriptedEngine`` for rollouts that write boxed answers). Under
    ``peft=lora`` no reference model is loaded: the policy with its adapters off is the reference, as in a run."""
    from grail_exp.advantages import build_scheme
    from grail_exp.data import build_source
    from grail_exp.loss import build_terms, needs_reference
    from grail_exp.models import lora
    from grail_exp.models.loading import load_causal_lm, load_tokenizer
    from grail_exp.rollout import build_engine
    from grail_exp.tracking import NullTracker
    from grail_exp.training.module import Parts, RLVRModule

    tok = load_tokenizer(str(model_dir), cfg)
    policy = load_causal_lm(str(model_dir), cfg, trainable=True)
    terms = build_terms(cfg.loss.get("terms"), tok, cfg.model)
    ref = load_causal_lm(str(model_dir), cfg, trainable=False) \
        if needs_reference(cfg, terms) and not lora.enabled(cfg) else None
    scheme = build_scheme(cfg.advantage, tok, {"model": cfg.model, "seed": cfg.seed, "data": cfg.data})
    return RLVRModule(cfg, Parts(policy, tok, scheme, build_source(cfg.data), AlternatingVerifier(), ref, terms,
                                 engine=build_engine(engine, policy, tok)), NullTracker())


class FakeOpt:
    """Stands in for Lightning's optimizer wrapper: counts steps like trainer.global_step does."""

    def __init__(self, opt):
        self.opt, self.steps = opt, 0

    def step(self):
        self.opt.step()
        self.steps += 1

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def train_step(module, iteration=0, round_index=0):
    """One rollout batch (seeded by ``round_index``) and one AdamW step on it: returns (batch, step metrics)."""
    torch.manual_seed(round_index)
    batch, stats = module.rollout.make_batch(round_index, {})
    module.manual_backward = lambda loss: loss.backward()
    opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-3)
    fake = FakeOpt(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    if module.cfg.loss.num_iterations > 1:
        batch.old_logp = module.rollout.logps(module.policy, batch)
    if module.cfg.loss.beta > 0:
        batch.ref_logp = module.rollout.reference_logps(batch)
    return batch, module.update.step(batch, fake, sched, batch.loss_mask.sum().item(), {}, epoch=iteration)
