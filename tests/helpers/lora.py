"""LoRA policies built in a test (``peft=lora``, grail_exp/models/lora.py): the tiny model wrapped with adapters whose
B is moved off zero (so the adapters change the model and every adapter tensor gets a gradient), and one optimiser
step of the fixed interleaved batch (``helpers.batches``) under a given fast-path setting."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf


def peft_node(rank: int = 8, alpha: float = 16.0, **kw):
    """A config carrying ``peft=lora`` (what ``lora.apply`` reads: ``peft.*`` and ``seed``)."""
    from grail_exp.config import PeftConfig

    return OmegaConf.create({"seed": 0, "peft": OmegaConf.structured(PeftConfig(name="lora", rank=rank, alpha=alpha,
                                                                                 **kw))})


@torch.no_grad()
def move_adapters(policy, scale: float = 0.3, seed: int = 1) -> None:
    """Every adapter tensor set to seeded normal values x ``scale`` (A's start is random already; B's is zero)."""
    from grail_exp.models.lora import adapter_parameters

    g = torch.Generator().manual_seed(seed)
    for _, p in adapter_parameters(policy):
        p.copy_(torch.randn(p.shape, generator=g) * scale)


def base_snapshot(policy) -> dict[str, torch.Tensor]:
    """Copies of every frozen (non-adapter) tensor of the policy's state dict."""
    return {k: v.detach().clone() for k, v in policy.state_dict().items() if ".lora_" not in k}


def lora_one_step(overrides: list[str], share: bool, narrow: bool, attn: str = "eager") -> dict:
    """Loss, token weights and the adapters' gradients of one optimiser step on the fixed interleaved batch, with the
    tiny model under ``peft=lora`` (adapters moved off their start), each distinct prompt once (``share``) or not,
    the leading-rows backward narrowed (``narrow``) or not, in the attention ``attn`` (``eager`` | ``sdpa_gqa``)."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.attention import DEFAULT_MAX_SCORES
    from grail_exp.compute.forward import share_prompts_of
    from grail_exp.compute.model_attention import use_kernel_gqa
    from grail_exp.loss import build_terms
    from grail_exp.models import lora
    from grail_exp.models.loading import narrow_if_configured
    from grail_exp.training.module import Parts, RLVRModule
    from helpers.batches import interleaved_training_batch
    from helpers.pinned_step import build_model_and_tokenizer, pinned_config

    cfg = pinned_config(["peft=lora", "peft.rank=8", "peft.alpha=16", *overrides,
                         f"trainer.share_prompts={str(share).lower()}", f"trainer.narrow_backward={str(narrow).lower()}"])
    torch.manual_seed(0)
    model, tok = build_model_and_tokenizer()
    model.config._attn_implementation = "sdpa" if attn == "sdpa_gqa" else attn
    if attn == "sdpa_gqa":
        use_kernel_gqa(model, DEFAULT_MAX_SCORES)
    narrow_if_configured(model, cfg)  # model building's order: narrow, then wrap
    policy = lora.apply(model, cfg)
    move_adapters(policy)
    ctx = {"model": cfg.model, "seed": cfg.seed, "data": cfg.data, "share_prompts": share_prompts_of(cfg)}
    module = RLVRModule(cfg, Parts(policy, tok, build_scheme(cfg.advantage, tok, ctx),
                                   terms=build_terms(cfg.loss.get("terms"), tok, cfg.model)))
    module.manual_backward = lambda loss: loss.backward()
    batch = interleaved_training_batch(tok)
    module.rollout.prepare(batch, {})
    batch.old_logp = module.rollout.logps(policy, batch)
    weights, grads = torch.zeros_like(batch.loss_mask), []
    module.update.on_weights = lambda b, s, e, w, ent: weights[s:e].copy_(w)
    adapters = [p for _, p in lora.adapter_parameters(policy)]
    opt = torch.optim.SGD(adapters, lr=0.0)
    opt.register_step_pre_hook(lambda *_: grads.extend(p.grad.detach().clone() for p in adapters))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = module.update.step(batch, opt, sched, float(batch.loss_mask.sum()), {}, epoch=0)
    order = batch.order.argsort()
    frozen_grads = [n for n, p in policy.named_parameters() if ".lora_" not in n and p.grad is not None]
    return {"loss": metrics["loss"], "weights": weights[order], "grads": grads, "mask": batch.loss_mask[order].bool(),
            "frozen_grads": frozen_grads, "metrics": metrics}


def _sha(pairs) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in pairs:
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


try:  # the probe a child process loads (GRAIL_EXP_PROBE=helpers.lora:LoraProbe, PYTHONPATH=tests)
    from helpers.probe_writer import JsonlProbe
except ImportError:  # pragma: no cover - imported from the tests' own package path only
    JsonlProbe = object


class LoraProbe(JsonlProbe):
    """Every rank of a ``peft=lora`` run writes its world at setup and, after every optimiser step, a sha256 of the
    frozen base and one of the adapter (gathered under FSDP): the base must never change, the adapter must, and the
    ranks must agree on both."""

    def setup(self, module):
        from grail_exp import world

        self._write("setup", world_size=world.world_size(), rank=world.rank(),
                    trainable=sorted(n for n, p in module.policy.named_parameters() if p.requires_grad)[:2])

    def _hashes(self, module) -> dict:
        base = _sha(module.backend.full_tensors(keep=lambda n: ".lora_" not in n))
        adapter = _sha(module.backend.full_tensors(keep=lambda n: ".lora_" in n))
        return {"base": base, "adapter": adapter}

    def started(self, module):
        self._write("started", **self._hashes(module))

    def step(self, module, step):
        self._write("step", step=step, **self._hashes(module))
