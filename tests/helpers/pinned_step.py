"""A fixed rollout batch and the numbers one optimiser step produced on it before the trainer refactor.

``tests/data/pinned_step.json`` was written by ``python tests/pinned_step.py --write`` (this file, then at
tests/pinned_step.py) at commit 2d87701 (the straightforward implementation: separate probe forwards,
full-vocabulary logits). tests/test_pinned_step.py checks that today's trainer still gives the same loss, token
weights and gradient on that batch, for the default GRPO objective and the GRAIL / OAR-G schemes: the default's
numbers are unchanged, and the fast paths are exactly equivalent to the straightforward one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
PINNED = TESTS / "data" / "pinned_step.json"
CASES = {  # name -> overrides of the composed default config
    "grpo_dr_grpo": ["advantage=grpo"],
    "grpo_dapo_mu2": ["advantage=grpo", "loss.loss_type=dapo", "loss.num_iterations=2"],
    "grpo_grpo_beta": ["advantage=grpo", "loss.loss_type=grpo", "loss.beta=0.04", "loss.num_iterations=2"],
    "grpo_bnpo": ["advantage=grpo", "loss.loss_type=bnpo"],
    "grail": ["advantage=grail"],
    "grail_mu2": ["advantage=grail", "loss.num_iterations=2"],
    "grail_both_exact": ["advantage=grail", "advantage.symmetry=both", "advantage.span_mapping=exact"],
    "oar_g": ["advantage=oar_g"],
}
# (question, completion text, reward): prompts and completions of the fixed batch, two groups of four.
ROWS = [
    ("Compute 12+7-5.", "12+7=19. 19-5=14. \\boxed{14}", 1.0),
    ("Compute 12+7-5.", "12+7=19. 19-5=13. \\boxed{13}", 0.0),
    ("Compute 12+7-5.", "12+7=18. 18-5=13. \\boxed{13} ok", 0.0),
    ("Compute 12+7-5.", "12+7=19. 19-5=14.", 0.0),
    ("Compute 40-8+3.", "40-8=32. 32+3=35. \\boxed{35}", 1.0),
    ("Compute 40-8+3.", "40-8=32. 32+3=35. \\boxed{35}", 1.0),
    ("Compute 40-8+3.", "40-8=33. 33+3=36. \\boxed{36}", 0.0),
    ("Compute 40-8+3.", "40-8=32. \\boxed{32} 32+3=35. \\boxed{35}", 1.0),
]
TINY = dict(architecture="qwen3", tokenizer="qwen", vocab_size=320, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=True)


def pinned_config(overrides):
    """The validated default config of the pinned step (2 prompts x 4 rollouts, one micro-batch of 4, no gradient
    clipping) with ``overrides``."""
    from grail_exp.validate import validate
    from helpers.compose import compose

    return validate(compose(["logger=none", "trainer.prompts_per_step=2", "trainer.micro_batch_size=4",
                             "rollout.num_generations=4", "rollout.max_completion_length=32", "optim.max_grad_norm=null",
                             *overrides]))


def build_model_and_tokenizer():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_model, build_tokenizer

    tok = build_tokenizer("qwen", ArithmeticTask())
    model = build_model(TINY, tok, seed=0).float()
    model.config._attn_implementation = "eager"
    return model.train(), tok


def rollout_batch(tok):
    """Prompts left-padded, completions right-padded and ending in EOS, as the engine returns them."""
    from grail_exp.rollout import Completion, pad_completions

    comps = []
    for q, text, _ in ROWS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        comps.append(Completion(p, c, None, False))
    return pad_completions(comps, tok.pad_token_id), [t for _, t, _ in ROWS], torch.tensor([r for *_, r in ROWS])


def projections(n_params: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(8, n_params, generator=g, dtype=torch.float64)


def summarise(loss: float, grad: torch.Tensor, weights: torch.Tensor) -> dict:
    grad = grad.double()
    return {"loss": loss, "grad_norm": grad.norm().item(), "grad_sum": grad.sum().item(),
            "grad_proj": (projections(grad.numel()) @ grad).tolist(),
            "weights": weights.double().tolist()}


def pinned_module(dtype, overrides=()):
    """The training module around the pinned step's model in ``dtype`` (no rollout engine, data or verifier) and
    the pinned batch with its group advantages, for ``advantage=grpo`` plus ``overrides``."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.estimators.group import group_advantages
    from grail_exp.training.module import Parts, RLVRModule, TrainingBatch

    cfg = pinned_config(["advantage=grpo", *overrides])
    torch.manual_seed(0)
    model, tok = build_model_and_tokenizer()
    model = model.to(dtype)
    rb, texts, rewards = rollout_batch(tok)
    adv, _ = group_advantages(rewards, 4, "none")
    module = RLVRModule(cfg, Parts(model, tok, build_scheme(cfg.advantage, tok)))
    attn = rb.attention_mask
    batch = TrainingBatch(rb.input_ids, attn, position_ids_from_mask(attn), rb.prompt_ids.shape[1], rb.completion_ids,
                          rb.completion_mask.float(), adv, rewards, texts, order=torch.arange(len(texts)))
    module.manual_backward = lambda loss: loss.backward()
    return module, batch


def step_recording_gradient(module, model, batch, captured: dict) -> dict:
    """One optimiser step of the update phase whose optimiser only records the flat gradient in ``captured["g"]``
    (the parameters stay as they are); returns the step's metrics."""

    class Opt:
        def step(self):
            captured["g"] = torch.cat([p.grad.flatten() for p in model.parameters()])

        def zero_grad(self, set_to_none=True):
            model.zero_grad(set_to_none=True)

    sched = type("S", (), {"step": lambda self: None, "get_last_lr": lambda self: [0.0]})()
    return module.update.step(batch, Opt(), sched, batch.loss_mask.sum().item(), {}, epoch=0)


def run_case_legacy(overrides):
    """The pre-refactor trainer API (commit 2d87701): used once to write the pinned file."""
    from grail_exp.advantages import build_scheme
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.estimators.group import group_advantages
    from grail_exp.training.module import Parts, RLVRModule, TrainingBatch

    cfg = pinned_config(overrides)
    torch.manual_seed(0)
    model, tok = build_model_and_tokenizer()
    rb, texts, rewards = rollout_batch(tok)
    adv, _ = group_advantages(rewards, 4, cfg.loss.scale_rewards)
    scheme = build_scheme(cfg.advantage, tok)  # before the reference model: the order the RNG was drawn in
    ref = build_model_and_tokenizer()[0].eval() if cfg.loss.beta > 0 else None
    module = RLVRModule(cfg, Parts(model, tok, scheme, ref_model=ref))
    attn = rb.attention_mask
    batch = TrainingBatch(rb.input_ids, attn, position_ids_from_mask(attn), rb.prompt_ids.shape[1], rb.completion_ids,
                          rb.completion_mask.float(), adv, rewards, texts)
    if cfg.loss.num_iterations > 1:
        batch.old_logp = module.rollout.logps(model, batch) - 0.05 * torch.arange(batch.completion_ids.shape[1])
    if cfg.loss.beta > 0:
        batch.ref_logp = module.rollout.logps(module.ref_model, batch)
    module.manual_backward = lambda loss: loss.backward()
    captured = {}
    real = module.scheme.weights

    def spy(m, b):
        out = real(m, b)
        captured.setdefault("w", []).append(out.weights)
        return out

    module.scheme.weights = spy

    metrics = step_recording_gradient(module, model, batch, captured)
    return summarise(metrics["loss"], captured["g"], torch.cat(captured["w"]))


if __name__ == "__main__" and "--write" in sys.argv:
    sys.path.insert(0, str(TESTS))
    out = {name: run_case_legacy(over) for name, over in CASES.items()}
    PINNED.write_text(json.dumps(out, indent=1))
    print("wrote", PINNED)
