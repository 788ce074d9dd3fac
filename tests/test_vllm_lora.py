"""``peft=lora`` with ``rollout=vllm`` on vLLM's CPU build (`make test-vllm`): after every sync the engine samples
from exactly the trainer's policy, for both ``peft.sync`` modes, and the trainer's base weights never move.

Each test trains the adapters of a tiny model for a few AdamW steps and syncs the engine after each, through the
update backend as a run does (``UpdateBackend.sync_engine``). Expectations: the trainer's own forward on the tokens
the engine sampled (the preflight's tolerance: |d| <= 1e-3 x (1 + |log p|) in float32), the engine's log-probs before
the sync (they must change: the adapter reached the engine), and a copy of the base taken before training (bit for
bit). One engine per test: a LoRA engine and a merged one are built differently."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
PREFLIGHT_TOL = 1e-3  # grail_exp/preflight/rehearsal.py: float32 engine and trainer, |d| <= tol x (1 + |log p|)

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make "
                                                   "test-vllm` runs these in .venv-vllm")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    """A random tiny Qwen3 whose head_dim (32) vLLM's CPU attention supports."""
    from grail_exp.models.embedded import build_model
    from helpers.models import TINY_BUILD

    d = tmp_path_factory.mktemp("tiny32")
    build_model(dict(TINY_BUILD, hidden_size=128, intermediate_size=384, head_dim=32), tiny_tokenizer,
                seed=0).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


def _setup(compose_cfg, model_dir, sync: str, extra=()):
    from grail_exp.models.loading import load_causal_lm, load_tokenizer
    from grail_exp.rollout.vllm import build_vllm_engine
    from grail_exp.training.backends.local import LocalBackend
    from grail_exp.validate import validate

    # block_size 32: the prompts fill a block, so the prefix cache has something to serve
    cfg = validate(compose_cfg([f"model.name_or_path={model_dir}", "logger=none", "rollout=vllm", "peft=lora",
                                "peft.rank=8", "peft.alpha=16", f"peft.sync={sync}", "rollout.vllm.max_model_len=256",
                                "+rollout.vllm.kwargs.block_size=32", "trainer.eval_before_training=false",
                                "trainer.eval_at_end=false", *extra]))
    tok = load_tokenizer(str(model_dir), cfg)
    policy = load_causal_lm(str(model_dir), cfg, trainable=True)
    engine = build_vllm_engine(str(model_dir), tok, cfg, batch_size=64)
    backend = LocalBackend(cfg, types.SimpleNamespace(policy=policy, cfg=cfg, tokenizer=tok))
    return cfg, tok, policy, engine, backend


def _prompts(tok, k=3):
    from grail_exp.data.prompting import encode_prompts

    system = "You are a careful calculator. Work step by step and put the final answer in a box."
    qs = [f"{system} Compute {a}+{b}-{c}." for a, b, c in ((12, 7, 5), (40, 8, 3), (3, 4, 1))][:k]
    from omegaconf import OmegaConf

    return encode_prompts(qs, tok, OmegaConf.create({"prompt_style": "chat", "system_prompt": None, "chat_template": None,
                                                     "chat_template_kwargs": {"enable_thinking": False}}), "")


def _engine_vs_trainer(engine, policy, tok, prompts, seed=0):
    """(engine log-probs, trainer log-probs) of the tokens the engine samples for ``prompts``, on the loss mask."""
    from grail_exp.compute.forward import policy_forward, position_ids_from_mask
    from grail_exp.rollout import SamplingParams, pad_completions

    torch.manual_seed(seed)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=16, logprobs=True,
                                                  per_request_seeds=True))
    rb = pad_completions(out, tok.pad_token_id)
    mask = rb.attention_mask
    with torch.no_grad():
        lp = policy_forward(policy, rb.input_ids, mask, position_ids_from_mask(mask), rb.completion_ids, 1.0)[0]
    m = rb.completion_mask.bool()
    return rb.sampling_logprobs[m], lp[m], out


def _train_a_step(policy, opt, tok, prompts):
    """One AdamW step on the adapters that raises the log-probability of a fixed answer (moves the policy by O(1))."""
    from grail_exp.compute.forward import policy_forward, position_ids_from_mask
    from grail_exp.rollout import Completion, pad_completions

    answer = tok("\\boxed{14}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rb = pad_completions([Completion(p, answer, None, False) for p in prompts], tok.pad_token_id)
    mask = rb.attention_mask
    lp = policy_forward(policy, rb.input_ids, mask, position_ids_from_mask(mask), rb.completion_ids, 1.0)[0]
    opt.zero_grad()
    (-(lp * rb.completion_mask).sum()).backward()
    opt.step()


def _assert_matches(engine_lp, trainer_lp):
    d = (engine_lp - trainer_lp).abs()
    assert d.numel() > 0 and bool((d <= PREFLIGHT_TOL * (1 + trainer_lp.abs())).all()), f"max |d| {d.max():.3g}"


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_after_every_sync_the_engine_samples_the_trainers_policy_and_the_base_stays(compose_cfg, model_dir, sync):
    from grail_exp.models.lora import adapter_parameters
    from helpers.lora import base_snapshot

    cfg, tok, policy, engine, backend = _setup(compose_cfg, model_dir, sync)
    try:
        prompts = _prompts(tok)
        base = base_snapshot(policy)
        opt = torch.optim.AdamW([p for _, p in adapter_parameters(policy)], lr=2e-2)
        backend.sync_engine(engine)
        before, trainer, _ = _engine_vs_trainer(engine, policy, tok, prompts)
        _assert_matches(before, trainer)  # v0: the base itself (B = 0)
        seen = set()
        for step in range(3):
            _train_a_step(policy, opt, tok, prompts)
            with torch.no_grad():  # what the engine would say of the same tokens if the sync had not happened
                _, stale, _ = _engine_vs_trainer(engine, policy, tok, prompts, seed=step + 1)
            trained = {n: p.detach().clone() for n, p in adapter_parameters(policy)}
            backend.sync_engine(engine)
            # the sync only reads the trainer's tensors (vLLM scales what it is handed in place: it gets copies)
            assert all(torch.equal(p, trained[n]) for n, p in adapter_parameters(policy))
            engine_lp, trainer_lp, _ = _engine_vs_trainer(engine, policy, tok, prompts, seed=step + 1)
            _assert_matches(engine_lp, trainer_lp)
            if sync == "adapter":
                req = engine.adapter_request
                assert engine.adapters.loaded() == {req.lora_int_id}  # one adapter in the engine: this version's
                assert req.lora_name not in seen
                seen.add(req.lora_name)
        assert (stale - engine_lp).abs().max() > 1e-2 or stale.shape != engine_lp.shape  # the sync changed it
        after = policy.state_dict()
        assert all(torch.equal(after[k], v) for k, v in base.items())  # the trainer's base: bit for bit
    finally:
        engine.close()


def test_base_weights_travel_once_and_the_adapter_at_every_sync(compose_cfg, model_dir, monkeypatch):
    cfg, tok, policy, engine, backend = _setup(compose_cfg, model_dir, "adapter")
    try:
        pushes, adapters = [], []
        real_load, real_adapter = engine.load_weights, engine.load_adapter
        monkeypatch.setattr(engine, "load_weights", lambda chunks: (pushes.append(1), real_load(chunks)))
        monkeypatch.setattr(engine, "load_adapter", lambda t, c: (adapters.append(sorted(t)), real_adapter(t, c)))
        for _ in range(3):
            backend.sync_engine(engine)
        assert len(pushes) == 1 and len(adapters) == 3
        assert all(".lora_A." in n or ".lora_B." in n for n in adapters[0])
        assert len(adapters[0]) == 2 * 7 * 2  # two decoder layers x seven linear layers x (A, B)
    finally:
        engine.close()


def test_a_new_adapter_name_per_version_keeps_the_prefix_cache_from_serving_stale_kv(compose_cfg, model_dir,
                                                                                     monkeypatch):
    """Without the prefix-cache reset after a sync, the engine still matches the trainer: the new version's name
    keys new cache entries. The same adapter name reused (the failure TRL's versioned names prevent) serves the
    prompts' KV computed under the previous adapter, and the engine stops matching the trainer."""
    from grail_exp.models.lora import adapter_parameters

    cfg, tok, policy, engine, backend = _setup(compose_cfg, model_dir, "adapter")
    try:
        prompts = _prompts(tok)
        monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
        opt = torch.optim.AdamW([p for _, p in adapter_parameters(policy)], lr=2e-2)
        backend.sync_engine(engine)
        _engine_vs_trainer(engine, policy, tok, prompts)  # fills the cache under v1
        _train_a_step(policy, opt, tok, prompts)
        backend.sync_engine(engine)  # v2, its own name
        _assert_matches(*_engine_vs_trainer(engine, policy, tok, prompts, seed=1)[:2])
        _train_a_step(policy, opt, tok, prompts)
        engine.adapters.version -= 1  # the fault: v3's tensors under v2's name and id
        backend.sync_engine(engine)
        engine_lp, trainer_lp, _ = _engine_vs_trainer(engine, policy, tok, prompts, seed=2)
        d = (engine_lp - trainer_lp).abs()
        assert not bool((d <= PREFLIGHT_TOL * (1 + trainer_lp.abs())).all())  # stale KV served
    finally:
        engine.close()


def test_the_folder_route_gives_the_same_engine_as_the_in_memory_one(compose_cfg, model_dir):
    """An engine in another process gets the adapter as a PEFT folder (``add_lora``); forced here in process: the
    engine matches the trainer the same way, and the folder is what PeftModel would load."""
    from grail_exp.models.lora import adapter_parameters

    cfg, tok, policy, engine, backend = _setup(compose_cfg, model_dir, "adapter")
    try:
        engine.adapters.in_memory = False
        prompts = _prompts(tok)
        opt = torch.optim.AdamW([p for _, p in adapter_parameters(policy)], lr=2e-2)
        for step in range(2):
            _train_a_step(policy, opt, tok, prompts)
            backend.sync_engine(engine)
            _assert_matches(*_engine_vs_trainer(engine, policy, tok, prompts, seed=step)[:2])
            assert engine.adapter_request.lora_path.endswith(engine.adapter_request.lora_name)
            assert engine.adapters.loaded() == {engine.adapter_request.lora_int_id}
    finally:
        engine.close()
