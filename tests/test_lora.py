"""``peft=lora`` (grail_exp/models/lora.py, docs/lora.md): the config, the policy and its reference, the probes, every
scheme and loss of the registries, the CPU fast paths.

Where each expectation comes from: the base model loaded separately (the first policy, the reference), PEFT's own
merged model (``merge_and_unload``: the probes' token weights), the straightforward forward (the fast paths), the
rule each config key states (validation)."""

from __future__ import annotations

import copy

import pytest
import torch

from grail_exp.config import ConfigError
from grail_exp.validate import validate
from helpers.lora import base_snapshot, lora_one_step, move_adapters, peft_node
from helpers.tolerances import MODEL_REORDER


# ---------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize("overrides, key", [
    (["peft.rank=0"], "peft.rank"),
    (["peft.rank=-4"], "peft.rank"),
    (["peft.alpha=0"], "peft.alpha"),
    (["peft.dropout=1.0"], "peft.dropout"),
    (["peft.target_modules=[q_proj,lm_head]"], "peft.target_modules"),
    (["peft.target_modules=[]"], "peft.target_modules"),
    (["peft.sync=full"], "peft.sync"),
    (["rollout=vllm", "peft.rank=1024"], "peft.rank"),  # above vLLM's largest max_lora_rank (512)
    (["rollout=vllm", "peft.rank=16", "+rollout.vllm.kwargs.max_lora_rank=8"], "peft.rank"),
    (["rollout=vllm", "+rollout.vllm.kwargs.enable_lora=false"], "rollout.vllm.kwargs.enable_lora"),
    # a plug-in engine with its own copy of the weights but no way to take an adapter
    (["rollout.engine=helpers.fakes:OwnWeightsEngine"], "peft.sync"),
])
def test_each_bad_peft_value_is_one_line_naming_its_key(compose_cfg, overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["peft=lora", *overrides]))
    lines = [ln for ln in str(err.value).splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 1 and lines[0].strip()[2:].startswith(key), str(err.value)


def test_lora_without_peft_installed_is_one_line_naming_the_install(compose_cfg, monkeypatch):
    """A machine installed without the `lora` extra: validation says what to install, before anything loads."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["peft=lora"]))
    lines = [ln for ln in str(err.value).splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 1 and "peft==0.21.2" in lines[0] and "peft=lora" in lines[0], str(err.value)


def test_lora_composes_with_its_defaults_and_none_is_the_default(compose_cfg):
    assert validate(compose_cfg([])).peft.name == "none"
    cfg = validate(compose_cfg(["peft=lora"]))
    p = cfg.peft
    assert (p.name, p.rank, p.alpha, p.dropout, p.sync) == ("lora", 32, 32.0, 0.0, "adapter")
    assert list(p.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # a merged sync and the plug-in engine that takes full weights only are fine together
    validate(compose_cfg(["peft=lora", "peft.sync=merged", "rollout.engine=helpers.fakes:OwnWeightsEngine"]))


def test_the_engine_rank_is_the_smallest_vllm_allows():
    from grail_exp.models.lora import engine_max_rank

    assert [engine_max_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 512)] == [1, 8, 8, 16, 32, 64, 320, 512]


# ---------------------------------------------------------------------------------------------- the policy
def _load(compose_cfg, model_dir, extra=()):
    from grail_exp.models.loading import load_causal_lm

    cfg = validate(compose_cfg([f"model.name_or_path={model_dir}", "peft=lora", "peft.rank=4", *extra]))
    return cfg, load_causal_lm(str(model_dir), cfg, trainable=True), load_causal_lm(str(model_dir), cfg,
                                                                                     trainable=False)


def _rows_batch(tok):
    from helpers.batches import interleaved_training_batch

    return interleaved_training_batch(tok)


def _logps(model, batch):
    from grail_exp.compute.forward import policy_forward

    with torch.no_grad():
        return policy_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids,
                              1.0)[0]


def test_the_first_policy_is_the_separately_loaded_base_exactly(compose_cfg, tiny_model_dir, tiny_tokenizer):
    cfg, policy, base = _load(compose_cfg, tiny_model_dir)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of attention and MLP of both decoder layers carries an adapter
    assert len(trainable) == 2 * 7 * 2
    batch = _rows_batch(tiny_tokenizer)
    # B = 0: x + 0 is x, so the same forward of the same base weights, bit for bit
    assert torch.equal(_logps(policy, batch), _logps(base, batch))


def test_adapters_train_like_weights_in_model_dtype_with_fp32_masters_or_in_fp32(compose_cfg, tiny_model_dir):
    """bf16 model: the adapters are bf16 and the optimiser keeps their fp32 masters (as full fine-tuning keeps the
    weights'); peft.adapter_dtype=float32: fp32 adapters (PEFT's autocast), a plain AdamW over them. The frozen base is
    bf16 either way."""
    import types

    from grail_exp.models.lora import adapter_parameters
    from grail_exp.optim import MasterWeightAdamW
    from grail_exp.training.backends.local import LocalBackend

    for extra, adapter_dtype, masters in (([], torch.bfloat16, True),
                                          (["peft.adapter_dtype=float32"], torch.float32, False)):
        cfg, policy, _ = _load(compose_cfg, tiny_model_dir, ["model.dtype=bfloat16", *extra])
        assert {p.dtype for _, p in adapter_parameters(policy)} == {adapter_dtype}
        assert {p.dtype for n, p in policy.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
        opt = LocalBackend(cfg, types.SimpleNamespace(policy=policy, cfg=cfg)).build_optimizer(policy)
        assert isinstance(opt, MasterWeightAdamW) == masters
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
            sum(p.numel() for _, p in adapter_parameters(policy))  # the adapters only


def test_the_reference_is_the_policy_with_adapters_off_and_equals_the_base(compose_cfg, tiny_model_dir):
    from helpers.module import build_module

    cfg = validate(compose_cfg([f"model.name_or_path={tiny_model_dir}", "logger=none", "peft=lora", "peft.rank=4",
                                "loss.beta=0.04", "trainer.prompts_per_step=2", "rollout.num_generations=4",
                                "rollout.max_completion_length=12", "loss.mask_truncated_completions=false"]))
    module = build_module(cfg, tiny_model_dir)
    assert module.ref_model is None  # no second copy of the weights
    move_adapters(module.policy)  # the trained policy differs from its start
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    from grail_exp.models.loading import load_causal_lm

    base = load_causal_lm(str(tiny_model_dir), cfg, trainable=False)  # loaded on its own, as a reference copy would be
    ref = module.rollout.reference_logps(batch)
    live = module.rollout.logps(module.policy, batch)
    m = batch.loss_mask.bool()
    assert torch.equal(ref[m], module.rollout.logps(base, batch)[m])  # the same base forward, bit for bit
    assert (live[m] - ref[m]).abs().max() > 1e-2  # and the adapters are back on after it


def test_an_adapter_snapshot_runs_the_policy_as_it_was(tiny_tokenizer):
    """RLSD's frozen teacher under peft=lora: the earlier adapter swapped into the live policy gives what a full copy
    of the policy taken at that moment gives (the old way: copy.deepcopy), and the live adapter is back after."""
    from grail_exp.models import lora
    from helpers.pinned_step import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer()
    policy = lora.apply(model, peft_node())
    move_adapters(policy, seed=1)
    full_copy = copy.deepcopy(policy)
    snapshot = lora.AdapterSnapshot(policy)
    move_adapters(policy, seed=2)  # training goes on
    batch = _rows_batch(tok)
    live = _logps(policy, batch)
    with snapshot.swapped_in(policy):
        earlier = _logps(policy, batch)
    assert torch.equal(earlier, _logps(full_copy, batch))
    assert torch.equal(_logps(policy, batch), live) and not torch.equal(live, earlier)
    snapshot.update(policy)  # the next sync: the snapshot follows the live adapter
    with snapshot.swapped_in(policy):
        assert torch.equal(_logps(policy, batch), live)


# ---------------------------------------------------------------------------------------------- the probes
ITEMS = [("Compute 7+5-3.", "7+5=12. 12-3=9. \\boxed{9}", -0.5),
         ("Compute 2+2+2.", "2+2=4. 4+2=6. \\boxed{6}", 0.5),
         ("Compute 9-4.", "9-4=5. so the answer is 5", -0.5),
         ("Compute 8+1+1.", "8+1=9. 9+1=10. \\boxed{10}. Let me double check: 8+1=9, 9+1=10.", -0.25)]


def _probe_weights(model, tok, rows, name: str, shared: bool):
    """A scheme's token weights on ``model``: from the trainer's policy forward (``shared``) or its own probe."""
    from omegaconf import OmegaConf

    from grail_exp.advantages import build_scheme, scheme_config_class
    from grail_exp.compute.forward import policy_forward
    from helpers.batches import batch_of

    extra = {"symmetry": "both"} if name == "grail" else {"log_compression": "log1p"}
    scheme = build_scheme(OmegaConf.merge(OmegaConf.structured(scheme_config_class(name)), extra), tok)
    b = batch_of(tok, rows)
    b.generator = torch.Generator().manual_seed(0)  # OAR-G: the same noise for both models
    if not shared:
        return scheme.weights(model, b).weights
    with torch.enable_grad():
        fwd = policy_forward(model, b.input_ids, b.attention_mask, b.position_ids, b.completion_ids, 1.0)[2]
        return scheme.weights_from_forward(model, b, fwd).weights


def _compare_with_merged(policy, tok):
    from helpers.batches import rows_of

    rows = rows_of(tok, ITEMS)
    merged = copy.deepcopy(policy).merge_and_unload().train()  # PEFT's merged model: W + (alpha/r) B A, a plain model
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    for name in ("grail", "oar_g"):
        for shared in (True, False):
            w_lora = _probe_weights(policy, tok, rows, name, shared)
            w_merged = _probe_weights(merged, tok, rows, name, shared)
            assert w_lora.std() > 0.1  # the probe ran: the weights spread
            # The merged model computes x(W + sBA)^T where the adapter computes xW^T + s(xA^T)B^T: the same function
            # in another float order, a reordered reduction per stage (MODEL_REORDER relative). GRAIL: w = 1 +
            # 0.5 z, z = (log s - mu)/sigma moves by <= 2 x that / sigma_log-s, sigma >= 0.5 on these rows -> 4 x;
            # OAR-G's min-max reshaping amplifies by <= 2 x 50 x 1.1 (tests/test_fast_path.py's derivation) -> ~110 x.
            tol = (4 if name == "grail" else 110) * MODEL_REORDER
            diff = (w_lora - w_merged).abs().max().item()
            assert diff <= tol, f"{name} (shared forward {shared}): {diff:.3g} > {tol:.3g}"


def test_probe_weights_under_lora_equal_the_merged_models_on_the_tiny_model(tiny_tokenizer):
    from grail_exp.models import lora
    from helpers.pinned_step import build_model_and_tokenizer

    model, tok = build_model_and_tokenizer()
    policy = lora.apply(model, peft_node())
    move_adapters(policy)
    assert not policy.get_input_embeddings().weight.requires_grad  # frozen embeddings, yet the probes' leaf exists
    _compare_with_merged(policy, tok)


@pytest.mark.slow  # ~80 s on the 2-core machine (SmolLM2's 49k vocabulary, eight probe passes)
def test_probe_weights_under_lora_equal_the_merged_models_on_smollm2(compose_cfg, smollm2_dir):
    from grail_exp.models.loading import load_causal_lm, load_tokenizer

    cfg = validate(compose_cfg(["model=smollm2_135m", f"model.name_or_path={smollm2_dir}", "peft=lora",
                                "peft.rank=8", "peft.alpha=16", "model.dtype=float32"]))
    tok = load_tokenizer(str(smollm2_dir), cfg)
    policy = load_causal_lm(str(smollm2_dir), cfg, trainable=True)
    move_adapters(policy, scale=0.02)
    _compare_with_merged(policy, tok)


# ---------------------------------------------------------------------------------------------- every scheme and loss
def _smoke(compose_cfg, model_dir, overrides):
    """One rollout batch (scripted completions with boxed answers, alternating rewards) and one AdamW step under
    ``peft=lora``: the step's metrics, and whether only the adapters moved."""
    from grail_exp.models import lora
    from helpers.module import build_module

    cfg = validate(compose_cfg([f"model.name_or_path={model_dir}", "logger=none", "peft=lora", "peft.rank=4",
                                "trainer.prompts_per_step=4", "trainer.micro_batch_size=8", "rollout.num_generations=4",
                                "rollout.max_completion_length=64", *overrides]))
    module = build_module(cfg, model_dir, engine="helpers.fakes:ScriptedEngine")
    module.manual_backward = lambda loss: loss.backward()
    base = base_snapshot(module.policy)
    adapters = {n: p.detach().clone() for n, p in lora.adapter_parameters(module.policy)}
    torch.manual_seed(0)
    batch, _ = module.rollout.collect(0, {})
    opt = torch.optim.AdamW([p for _, p in lora.adapter_parameters(module.policy)], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = module.update.step(batch, opt, sched, float(batch.loss_mask.sum()), {}, epoch=0)
    after = module.policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items()), "a frozen tensor moved"
    moved = [n for n, p in lora.adapter_parameters(module.policy) if not torch.equal(p, adapters[n])]
    return metrics, moved


def _registry_cases():
    from pathlib import Path

    from grail_exp.advantages import SCHEMES
    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.loss import LOSS_TERMS, POLICY_LOSSES

    cases = [pytest.param([f"advantage={s}"], id=f"scheme-{s}") for s in sorted(SCHEMES)]
    cases += [pytest.param([f"advantage={s}", "model.gradient_checkpointing=true"], id=f"scheme-{s}-checkpointed")
              for s in sorted(SCHEMES)]
    cases += [pytest.param(["advantage=grpo", f"loss.policy_loss={p}"], id=f"loss-{p}") for p in sorted(POLICY_LOSSES)]
    for t in sorted(LOSS_TERMS):
        on = f"+loss_term={t}" if (Path(CONFIG_DIR) / "loss_term" / f"{t}.yaml").exists() else \
            f"+loss.terms.{t}.enabled=true"
        cases.append(pytest.param(["advantage=grpo", on], id=f"term-{t}"))
    cases.append(pytest.param(["advantage=grpo", "loss.beta=0.04"], id="kl-to-the-reference"))
    return cases


@pytest.mark.parametrize("overrides", _registry_cases())
def test_every_scheme_and_loss_of_the_registries_trains_the_adapters_only(compose_cfg, tiny_model_dir, overrides):
    metrics, moved = _smoke(compose_cfg, tiny_model_dir, overrides)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    assert moved  # the step reached the adapters (and, _smoke checks, nothing else)
    if overrides[0] in ("advantage=grail", "advantage=oar_g"):
        assert metrics["weights/mean"] != 1.0 or metrics.get(f"{overrides[0][10:]}/weight_std", 0) > 0  # probe ran


# ---------------------------------------------------------------------------------------------- the CPU fast paths
FAST_PATH_SCHEMES = {"grpo": ["advantage=grpo"], "grail": ["advantage=grail", "advantage.symmetry=both"],
                     "grail_wrong_rows": ["advantage=grail"], "oar_g": ["advantage=oar_g"]}


@pytest.mark.parametrize("name", list(FAST_PATH_SCHEMES))
@pytest.mark.parametrize("attn", ["eager", "sdpa_gqa"])
def test_the_cpu_fast_paths_under_peft_equal_the_straightforward_step(name, attn):
    """Each distinct prompt once and the leading-rows backward (narrowed base layers and adapters) against every row's
    whole sequence with nothing narrowed, under PEFT's wrapped layers: the same loss, weights and adapter gradients
    up to reordered reductions (tests/test_share_prompts.py's tolerances)."""
    overrides = FAST_PATH_SCHEMES[name]
    fast = lora_one_step(overrides, share=True, narrow=True, attn=attn)
    plain = lora_one_step(overrides, share=False, narrow=False)
    assert not fast["frozen_grads"] and not plain["frozen_grads"]
    assert torch.equal(fast["mask"], plain["mask"])
    weight_tol = 110 * MODEL_REORDER if name == "oar_g" else 0.0  # OAR-G's reshaping amplification (above)
    tol = MODEL_REORDER
    assert (fast["weights"] - plain["weights"]).abs().max() <= weight_tol + tol * plain["weights"].abs().max()
    scale = max(g.abs().max() for g in plain["grads"])
    diff = max((a - b).abs().max() for a, b in zip(fast["grads"], plain["grads"]))
    assert scale > 0 and diff <= (tol + weight_tol / 0.1) * scale, f"adapter gradients differ by {diff:.3g}"


# ---------------------------------------------------------------------------------------------- the HF engine
def _hf_engine_setup(compose_cfg, tiny_model_dir, sync):
    import types

    from grail_exp.models.loading import load_tokenizer
    from grail_exp.rollout import build_engine
    from grail_exp.training.backends.local import LocalBackend

    cfg, policy, _ = _load(compose_cfg, tiny_model_dir, [f"peft.sync={sync}"])
    tok = load_tokenizer(str(tiny_model_dir), cfg)
    engine = build_engine("hf", policy, tok, cfg=cfg, push_policy=False)  # as the training job builds it
    backend = LocalBackend(cfg, types.SimpleNamespace(policy=policy, cfg=cfg))
    batch = _rows_batch(tok)
    prompts = [batch.input_ids[i][batch.attention_mask[i][:batch.prompt_length].bool().nonzero().min():
                                  batch.prompt_length].tolist() for i in (0, 1, 3)]
    return cfg, policy, tok, engine, backend, batch, prompts


def _engine_logps_against_the_trainer(engine, policy, tok, prompts, seed):
    """|engine log-prob − trainer log-prob| of freshly sampled tokens, and the trainer's |log p| (both per token)."""
    from grail_exp.compute.forward import policy_forward, position_ids_from_mask
    from grail_exp.rollout import SamplingParams, pad_completions

    torch.manual_seed(seed)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, logprobs=True))
    rb = pad_completions(out, tok.pad_token_id)
    mask = rb.attention_mask
    with torch.no_grad():
        lp = policy_forward(policy, rb.input_ids, mask, position_ids_from_mask(mask), rb.completion_ids, 1.0)[0]
    m = rb.completion_mask.bool()
    return (rb.sampling_logprobs[m] - lp[m]).abs(), lp[m].abs()


def test_the_hf_engine_samples_the_live_adapters_under_adapter_sync(compose_cfg, tiny_model_dir):
    """rollout=hf with peft.sync=adapter samples from the policy object itself: after each AdamW step and the
    backend's sync (a no-op handover) its log-probs are the trainer's forward of the same tokens (the preflight's
    float32 tolerance, 1e-3 x (1 + |log p|)), and the base never moves."""
    from grail_exp.models.lora import adapter_parameters

    cfg, policy, tok, engine, backend, batch, prompts = _hf_engine_setup(compose_cfg, tiny_model_dir, "adapter")
    assert engine.model is policy and not hasattr(engine, "load_weights")
    base = base_snapshot(policy)
    opt = torch.optim.AdamW([p for _, p in adapter_parameters(policy)], lr=2e-2)
    for step in range(2):
        opt.zero_grad()
        (-_logps_grad(policy, batch).sum()).backward()
        opt.step()
        backend.sync_engine(engine)
        d, size = _engine_logps_against_the_trainer(engine, policy, tok, prompts, step)
        assert bool((d <= 1e-3 * (1 + size)).all())
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())


def test_the_hf_engine_under_merged_sync_samples_its_own_merged_copy(compose_cfg, tiny_model_dir):
    """rollout=hf with peft.sync=merged samples from its own copy of the adapted layers, W + (alpha/r) B A computed in
    fp32 from the unchanged base (here written out from the policy's named tensors, not through the code's merge):
    it refuses to generate before its first sync; after each AdamW step and sync its log-probs are the trainer's
    forward of the same tokens (the preflight's tolerance) and no adapter product runs while it decodes; between a
    step and the next sync it still samples the previous policy; the trainer's base is bit-identical throughout."""
    from grail_exp.models.lora import adapter_parameters

    cfg, policy, tok, engine, backend, batch, prompts = _hf_engine_setup(compose_cfg, tiny_model_dir, "merged")
    assert type(engine).__name__ == "HFMergedLoraEngine"
    assert len(engine.wrappers) == len(engine.targets) == 7 * policy.config.num_hidden_layers
    with pytest.raises(RuntimeError, match="no merged weights yet"):
        engine.generate(prompts, __import__("grail_exp.rollout", fromlist=["SamplingParams"]).SamplingParams(n=1))
    base = base_snapshot(policy)
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for n, m in policy.named_modules()
             if n.endswith(".lora_A.default")]
    during_generation, generate = [], engine.generate

    def counted(*args, **kwargs):
        calls.clear()
        out = generate(*args, **kwargs)
        during_generation.append(len(calls))
        return out

    engine.generate = counted
    opt = torch.optim.AdamW([p for _, p in adapter_parameters(policy)], lr=2e-2)
    scale = cfg.peft.alpha / cfg.peft.rank
    for step in range(2):
        opt.zero_grad()
        (-_logps_grad(policy, batch).sum()).backward()
        opt.step()
        backend.sync_engine(engine)
        named = dict(policy.named_parameters())
        for hf_name, merged in engine.merged.items():
            prefix = "base_model.model." + hf_name[: -len(".weight")]
            W, A, B = (named[f"{prefix}.base_layer.weight"], named[f"{prefix}.lora_A.default.weight"],
                       named[f"{prefix}.lora_B.default.weight"])
            expected = (W.double() + scale * (B.double() @ A.double())).float()
            assert merged.dtype == W.dtype and (merged - expected).abs().max() <= 1e-6 * (1 + expected.abs().max())
        calls.clear()
        d, size = _engine_logps_against_the_trainer(engine, policy, tok, prompts, step)
        assert during_generation == [0], "an adapter ran inside the merged engine's decoding"
        assert calls, "the hooks see the adapters (the trainer's forward after the generation ran them)"
        during_generation.clear()
        assert bool((d <= 1e-3 * (1 + size)).all())
        assert all(p.data_ptr() != m.data_ptr() for p, m in zip(engine.targets.values(), engine.merged.values()))
    for h in hooks:
        h.remove()
    # one more step without a sync: the engine still samples the synced policy, not the live one
    synced = _logps(policy, batch)
    opt.zero_grad()
    (-_logps_grad(policy, batch).sum()).backward()
    opt.step()
    assert (_logps(policy, batch) - synced).abs().max() > 1e-3  # the step moved the live policy
    from grail_exp.models.lora import adapters_disabled

    with adapters_disabled(policy), engine._merged_in():
        assert (_logps(policy, batch) - synced).abs().max() <= 1e-4 * (1 + synced.abs().max())
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())


@pytest.mark.parametrize("trainer, refused", [("fsdp", True), ("fsdp_zero2", True), ("ddp", False),
                                             ("deepspeed_zero2", False)])
def test_the_hf_engines_merged_copy_is_refused_beside_sharded_parameters(compose_cfg, trainer, refused):
    from grail_exp.validate import peft

    cfg = compose_cfg(["peft=lora", "peft.sync=merged", f"trainer={trainer}", "trainer.accelerator=cpu"])
    lines = [x for x in peft(cfg) if x.startswith("peft.sync")]
    assert bool(lines) == refused and (not refused or "trainer.strategy = fsdp" in lines[0])


def _logps_grad(model, batch):
    from grail_exp.compute.forward import policy_forward

    return (policy_forward(model, batch.input_ids, batch.attention_mask, batch.position_ids, batch.completion_ids,
                           1.0)[0] * batch.loss_mask)


def test_a_run_with_the_hf_engine_under_merged_sync_trains_and_evaluates(tmp_path, tiny_model_dir, monkeypatch):
    """`python -m grail_exp.run peft=lora peft.sync=merged` (HF generation from the merged copy) end to end: two steps
    (rewards alternating within each group and the random model's truncated completions kept in the loss, so every
    step has a gradient), the evaluation after them, the adapter moved."""
    from safetensors.torch import load_file

    import grail_exp.grading.rewards
    from grail_exp.run import run
    from helpers.compose import compose
    from helpers.fakes import AlternatingVerifier

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    run_dir = tmp_path / "run"
    run(compose([f"model.name_or_path={tiny_model_dir}", f"paths.output_dir={run_dir}", "logger=none", "peft=lora",
                 "peft.sync=merged", "peft.rank=4", "loss.mask_truncated_completions=false",
                 "trainer.prompts_per_step=2", "trainer.micro_batch_size=8", "rollout.num_generations=4",
                 "rollout.max_completion_length=16", "trainer.max_steps=2",
                 "trainer.eval_before_training=false", "trainer.eval_at_end=true", "benchmark.limit=4", "eval.n=2",
                 "trainer.sample_table_every=0", "optim.lr=1e-2"], tmp_path))
    adapter = load_file(run_dir / "checkpoints" / "step-2" / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapter.items() if ".lora_B." in k)
    assert any(run_dir.rglob("*eval*")), "no evaluation was written"
