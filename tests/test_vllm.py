"""rollout=vllm against the trainer and the HF engine, on vLLM's CPU build (`make test-vllm` builds .venv-vllm).

Tests marked ``vllm`` are skipped where vLLM is not importable (the main .venv); the config checks at the top run
everywhere. One engine is started per module (a few seconds) and every test pushes the weights it samples from.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grail_exp.config import ConfigError
from grail_exp.rollout import SamplingParams, build_engine
from grail_exp.validate import validate
from helpers.greedy import assert_same_greedy
from helpers.tolerances import HANG_TIMEOUT_S, MODEL_REORDER

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine (vLLM's default: 4)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- config (no vLLM)
@pytest.mark.parametrize("override, key", [
    ("rollout.vllm.gpu_memory_utilization=0", "rollout.vllm.gpu_memory_utilization"),
    ("rollout.vllm.gpu_memory_utilization=1.5", "rollout.vllm.gpu_memory_utilization"),
    ("rollout.vllm.max_model_len=0", "rollout.vllm.max_model_len"),
    ("rollout.vllm.max_model_len=32", "rollout.vllm.max_model_len"),  # <= max_completion_length (64)
    ("rollout.vllm.dtype=int8", "rollout.vllm.dtype"),
    ("rollout.vllm.logprobs_mode=raw_logits", "rollout.vllm.logprobs_mode"),
])
def test_bad_vllm_values_name_the_key(compose_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg(["rollout=vllm", override]))


def test_vllm_config_composes_with_is_correction_on(compose_cfg):
    cfg = validate(compose_cfg(["rollout=vllm"]))
    assert cfg.rollout.engine == "vllm" and cfg.rollout.is_correction.mode == "token_truncate"
    assert validate(compose_cfg(["rollout.vllm.dtype=int8"])).rollout.engine == "hf"  # ignored by other engines


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(request):
    """The warm-started tiny model (writes \\boxed{} answers and stops). GRAIL_EXP_VLLM_TEST_MODEL=<dir> reuses a
    built one while iterating on these tests (the warm start takes ~100 s on a busy 2-core machine)."""
    return os.environ.get("GRAIL_EXP_VLLM_TEST_MODEL") or str(request.getfixturevalue("formatted_model_dir"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    from grail_exp.rollout.vllm import VLLMRolloutEngine

    e = VLLMRolloutEngine(model_dir, tokenizer, dtype="float32", max_model_len=256, seed=0, batch_size=64)
    yield e
    e.close()


@pytest.fixture
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(tokenizer, k=3):
    """Chat-formatted arithmetic questions, as the run renders them (prompt_style=chat, thinking off)."""
    import random

    from grail_exp.data.arithmetic import ArithmeticTask

    task, rng = ArithmeticTask(), random.Random(0)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": task.sample(rng).question}],
                                           add_generation_prompt=True, tokenize=False, enable_thinking=False)
             for _ in range(k)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _perturb(model, scale=0.02, seed=0):
    """Move every parameter (the tied embedding = output layer included) so stale engine weights would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def _trainer_logprobs(model, completions, pad_id, temperature):
    """The trainer's quantity: log softmax(z/T)[token] from the HF forward (positions = cumsum(mask) - 1)."""
    from grail_exp.compute.forward import completion_logits
    from grail_exp.loss import selective_log_softmax
    from grail_exp.rollout import pad_completions

    rb = pad_completions(completions, pad_id)
    mask = rb.attention_mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = completion_logits(model, rb.input_ids, mask, pos, rb.completion_ids.shape[1], temperature)
        lp = selective_log_softmax(logits.float(), rb.completion_ids)
    return lp, rb


def _excess(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of its bound, on the masked tokens. fp32 on both sides in different kernels (vLLM's CPU
    build, the HF forward): a log-prob moves by <= MODEL_REORDER of its scale (tests/helpers/tolerances.py), the bound
    of the card's rehearsal too. Measured with the AVX-512 and the AVX2 kernels: |got - want| <= 8e-6."""
    return ((got - want).abs() / (MODEL_REORDER * (1 + want.abs())))[mask]


# ---------------------------------------------------------------------------------------------- engine
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
class TestEngine:
    def test_layout_stop_tokens_truncation_no_logprobs(self, engine, tokenizer, hf_model):
        engine.sync_weights(hf_model)
        prompts = _prompts(tokenizer, 3)
        torch.manual_seed(0)
        short = engine.generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=2))
        assert all(c.truncated and len(c.token_ids) == 2 for c in short)
        out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=48))
        assert len(out) == 12
        stops = set(engine.stop_token_ids)
        assert tokenizer.eos_token_id in stops and tokenizer.pad_token_id in stops
        for r, c in enumerate(out):
            assert c.prompt_ids == prompts[r // 4]  # prompt-major
            assert c.logprobs is None
            assert 1 <= len(c.token_ids) <= 48
            assert not stops & set(c.token_ids[:-1])  # nothing after a stop token
            assert c.truncated == (c.token_ids[-1] not in stops)
            assert not c.truncated or len(c.token_ids) == 48
        assert any(not c.truncated for c in out)  # the warm-started model stops
        with_lp = engine.generate(prompts[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, logprobs=True))
        assert all(len(c.logprobs) == len(c.token_ids) for c in with_lp)

    def test_greedy_equals_hf_after_weight_update(self, engine, tokenizer, hf_model):
        from grail_exp.rollout.hf import HFRolloutEngine

        model = _perturb(hf_model, seed=1)
        engine.sync_weights(model)
        prompts = _prompts(tokenizer, 4)
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=40)
        ours = engine.generate(prompts, params)
        hf = HFRolloutEngine(model, tokenizer).generate(prompts, params)
        twice = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=40))
        # token for token, up to a near-tie of the argmax (helpers/greedy.py: which of two tied tokens an engine
        # picks depends on the processor); > 20 tokens compared, not empty strings
        assert_same_greedy(model, twice, [c for c in ours for _ in range(2)])  # prompt-major
        assert_same_greedy(model, ours, hf)

    @pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 20, 0.8)])
    def test_logprobs_match_the_trainer(self, engine, tokenizer, hf_model, temperature, top_k, top_p):
        model = _perturb(hf_model, seed=2)
        engine.sync_weights(model)
        torch.manual_seed(3)
        out = engine.generate(_prompts(tokenizer, 3), SamplingParams(
            n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24, logprobs=True))
        want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, temperature)
        m = rb.completion_mask.bool()
        excess = _excess(rb.sampling_logprobs, want, m)
        assert excess.max().item() <= 1, (rb.sampling_logprobs - want).abs()[m].max().item()
        if top_k or top_p < 1:
            # The renormalised top-k/top-p log-prob (vLLM's processed_logprobs) differs: the check can fail.
            assert not torch.allclose(want[m], torch.zeros_like(want[m]), atol=1e-3)

    def test_tied_lm_head_is_synced(self, engine, tokenizer, hf_model):
        """Only the tied embedding / output layer moves: pushing named_parameters() would leave vLLM's stale."""
        assert hf_model.config.tie_word_embeddings
        assert "lm_head.weight" in hf_model.state_dict() and "lm_head.weight" not in dict(hf_model.named_parameters())
        engine.sync_weights(hf_model)
        with torch.no_grad():
            hf_model.get_input_embeddings().weight.mul_(3.0)  # sharper output distribution, different inputs
        engine.sync_weights(hf_model)
        torch.manual_seed(4)
        out = engine.generate(_prompts(tokenizer, 2), SamplingParams(n=3, temperature=1.0, max_new_tokens=16,
                                                                    logprobs=True))
        want, rb = _trainer_logprobs(hf_model, out, tokenizer.pad_token_id, 1.0)
        m = rb.completion_mask.bool()
        assert _excess(rb.sampling_logprobs, want, m).max().item() <= 1

    def test_named_parameters_push_leaves_a_stale_output_layer(self, engine, tokenizer, hf_model):
        """The negative control of the test above: vLLM 0.32 does not re-tie lm_head on reload."""
        engine.sync_weights(hf_model)
        with torch.no_grad():
            hf_model.get_input_embeddings().weight.mul_(3.0)
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(hf_model.named_parameters())})
        engine.llm.reset_prefix_cache()
        torch.manual_seed(4)
        out = engine.generate(_prompts(tokenizer, 2), SamplingParams(n=3, temperature=1.0, max_new_tokens=16,
                                                                    logprobs=True))
        want, rb = _trainer_logprobs(hf_model, out, tokenizer.pad_token_id, 1.0)
        m = rb.completion_mask.bool()
        assert (_excess(rb.sampling_logprobs, want, m) > 1).float().mean().item() > 0.5  # the check fails on most

    def test_push_through_a_safetensors_directory(self, engine, tokenizer, hf_model):
        """The multiprocess fallback (weights written to disk, one file per chunk, read by the worker) gives the same
        engine."""
        from grail_exp.compute.chunks import chunked

        model = _perturb(hf_model, seed=5)
        engine._push_via_path(chunked(model.state_dict().items(), 200_000))  # several files: the tiny model is ~1.7 MB
        engine.llm.reset_prefix_cache()
        out = engine.generate(_prompts(tokenizer, 2), SamplingParams(n=1, temperature=0.0, max_new_tokens=16,
                                                                    logprobs=True))
        want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, 1.0)
        assert _excess(rb.sampling_logprobs, want, rb.completion_mask.bool()).max().item() <= 1

    @pytest.mark.parametrize("per_request_seeds", [True, None])
    def test_seeds_come_from_torch_rng(self, engine, tokenizer, hf_model, per_request_seeds):
        """Evaluation's per-request seeds (True) and the training rollouts' engine stream (None: unseeded requests,
        which vLLM's in-process CPU sampler draws from torch's global generator) both repeat under torch's seed."""
        engine.sync_weights(hf_model)
        prompts = _prompts(tokenizer, 2)
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, per_request_seeds=per_request_seeds)
        runs = []
        for seed in (7, 7, 8):
            torch.manual_seed(seed)
            runs.append([c.token_ids for c in engine.generate(prompts, params)])
        assert runs[0] == runs[1] and runs[0] != runs[2]
        assert len({tuple(t) for t in runs[0][:4]}) > 1  # the G samples of a prompt differ

    def test_sleep_mode_is_an_error_on_cpu(self, model_dir, tokenizer):
        from grail_exp.rollout.vllm import VLLMRolloutEngine

        with pytest.raises(ValueError, match="rollout.vllm.sleep_mode"):
            VLLMRolloutEngine(model_dir, tokenizer, sleep_mode=True)

    def test_sleep_then_sync_wakes_and_samples_the_updated_weights(self, engine, tokenizer, hf_model, monkeypatch):
        """The GPU-only sleep / wake calls, driven on the CPU engine with vLLM's own sleep and wake_up recorded
        (the CPU platform refuses real sleep mode): sleep() = level 2; generate refuses while asleep; sync_weights wakes
        the weights, pushes the policy, then wakes the KV cache and scheduler; the next rollout samples the updated
        weights. The memory freed by level 2 can only be measured on a GPU."""
        calls = []
        monkeypatch.setattr(engine, "sleep_mode", True)
        monkeypatch.setattr(engine.llm, "sleep", lambda level=1: calls.append(("sleep", level)), raising=False)
        monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: calls.append(("wake_up", tuple(tags or ()))),
                            raising=False)
        rpc = engine.llm.collective_rpc
        monkeypatch.setattr(engine.llm, "collective_rpc",
                            lambda method, *a, **k: (calls.append(("rpc", method)), rpc(method, *a, **k))[1],
                            raising=False)
        engine.sync_weights(hf_model)
        calls.clear()
        engine.sleep()
        assert engine.sleeping and calls == [("sleep", 2)]
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(_prompts(tokenizer, 1), SamplingParams(n=1, temperature=1.0, max_new_tokens=4))
        model = _perturb(hf_model, seed=9)
        engine.sync_weights(model)
        assert calls[1:] == [("wake_up", ("weights",)), ("rpc", "reload_weights"),
                             ("wake_up", ("kv_cache", "scheduling"))]
        assert not engine.sleeping
        torch.manual_seed(10)
        out = engine.generate(_prompts(tokenizer, 2), SamplingParams(n=2, temperature=1.0, max_new_tokens=16,
                                                                    logprobs=True))
        want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, 1.0)
        assert _excess(rb.sampling_logprobs, want, rb.completion_mask.bool()).max().item() <= 1

    def test_build_engine_from_config_syncs_the_live_policy(self, engine, compose_cfg, model_dir, tokenizer, hf_model):
        """build_engine('vllm') starts from the directory, then pushes the (here: changed) policy."""
        engine.close()  # one CPU engine at a time keeps memory low; the fixture's engine is not used after this
        import random

        model = _perturb(hf_model, seed=6)
        cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256", f"model.name_or_path={model_dir}"])
        torch.manual_seed(123)
        random.seed(123)
        want = (torch.rand(3), random.random())
        torch.manual_seed(123)
        random.seed(123)
        e = build_engine("vllm", model, tokenizer, 8, cfg=cfg, model_path=model_dir)
        # vLLM seeds the global RNGs with its own seed while starting: the engine restores the run's streams
        got = (torch.rand(3), random.random())
        assert torch.equal(got[0], want[0]) and got[1] == want[1]
        try:
            prompts = _prompts(tokenizer, 2)
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
            from grail_exp.rollout.hf import HFRolloutEngine

            hf = HFRolloutEngine(model, tokenizer).generate(prompts, params)
            assert_same_greedy(model, e.generate(prompts, params), hf)
        finally:
            e.close()


    def test_an_engine_built_with_dummy_weights_samples_the_policy_after_its_first_sync(self, compose_cfg, model_dir,
                                                                                          tokenizer, hf_model):
        """The training job's engine (build_engine with push_policy=False) reads no weights file: vLLM's own embedding
        is not the directory's, and generate() refuses until the first sync; once synced, its log-probs are the
        trainer's (the same tolerance as every other engine here)."""
        from safetensors.torch import load_file

        model = _perturb(hf_model, seed=7)
        cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256", f"model.name_or_path={model_dir}"])
        e = build_engine("vllm", model, tokenizer, 8, cfg=cfg, model_path=model_dir, push_policy=False)
        try:
            held = e.llm.apply_model(lambda m: m.model.embed_tokens.weight[:8, :8].detach().clone())[0]
            on_disk = load_file(Path(model_dir) / "model.safetensors")["model.embed_tokens.weight"][:8, :8]
            assert not torch.allclose(held.float(), on_disk.float(), atol=1e-3)  # vLLM's dummy values, not the file's
            with pytest.raises(RuntimeError, match="dummy weights"):
                e.generate(_prompts(tokenizer, 1), SamplingParams(n=1, temperature=1.0, max_new_tokens=4))
            e.sync_weights(model)
            for temperature, top_k in ((1.0, 0), (0.7, 5)):
                torch.manual_seed(11)
                out = e.generate(_prompts(tokenizer, 3), SamplingParams(n=2, temperature=temperature, top_k=top_k,
                                                                        max_new_tokens=16, logprobs=True))
                want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, temperature)
                m = rb.completion_mask.bool()
                assert _excess(rb.sampling_logprobs, want, m).max().item() <= 1
        finally:
            e.close()


# ---------------------------------------------------------------------------------------------- rollout=vllm_paper
@pytest.fixture(scope="module")
def processed_engine(model_dir, tokenizer):
    """An engine reporting vLLM's processed log-probs (renormalised over what top-k / top-p keep), as vllm_paper."""
    from grail_exp.rollout.vllm import VLLMRolloutEngine

    e = VLLMRolloutEngine(model_dir, tokenizer, dtype="float32", max_model_len=256, seed=0, batch_size=64,
                          logprobs_mode="processed_logprobs")
    yield e
    e.close()


def _kept_logsoftmax(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log softmax over the tokens vLLM's sampler keeps, written out independently of grail_exp.compute.logprobs: top-k keeps
    logits >= the k-th largest; top-p then drops, in ascending order, tokens while the renormalised cumulative mass
    is <= 1 - p (the largest always stays). (..., V) -> (..., V) with -inf on dropped tokens."""
    z = z.clone()
    if top_k:
        kth = z.sort(-1, descending=True).values[..., top_k - 1:top_k]
        z[z < kth] = float("-inf")
    if top_p < 1:
        srt, idx = z.sort(-1)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        srt[drop] = float("-inf")
        z = torch.full_like(z, float("-inf")).scatter(-1, idx, srt)
    return torch.log_softmax(z, -1)


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
@pytest.mark.parametrize("top_k, top_p, temperature", [(5, 1.0, 1.0), (50, 1.0, 0.7), (0, 0.9, 1.3), (20, 0.8, 1.0)])
def test_kept_log_mass_uses_vllms_own_filter(top_k, top_p, temperature):
    """log M_t of grail_exp.compute.logprobs.kept_log_mass = log of the mass vLLM's own top-k / top-p filter keeps."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from grail_exp.compute.logprobs import kept_log_mass

    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(37, 16, generator=g), torch.randn(300, 16, generator=g)
    z = (h @ W.T) / temperature
    n = z.shape[0]
    kept = apply_top_k_top_p_pytorch(z.clone(), torch.full((n,), top_k) if top_k else None,
                                     torch.full((n,), top_p) if top_p < 1 else None)
    want = torch.logsumexp(kept, -1) - torch.logsumexp(z, -1)
    got = kept_log_mass(h, W, None, top_k, top_p, temperature, chunk_tokens=8)
    assert (got - want).abs().max().item() < 1e-5  # fp32 logsumexp of |z| ≲ 30 over 300 logits
    assert want.min().item() < -1e-3  # the filter drops mass: a real comparison


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
class TestProcessedLogprobs:
    @pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, 1.0), (0.7, 20, 0.9)])
    def test_processed_logprobs_are_the_renormalised_kept_set(self, processed_engine, tokenizer, hf_model,
                                                             temperature, top_k, top_p):
        """vLLM's processed log-probs = log softmax over the kept top-k (/ top-p) of the HF model's z/T; the trainer's
        full-vocabulary log-prob minus them is log M_t (grail_exp.compute.logprobs.kept_log_mass, from the policy forward)."""
        from grail_exp.compute.forward import completion_logits, policy_forward, predicting_window
        from grail_exp.compute.logprobs import kept_log_mass

        model = _perturb(hf_model, seed=11)
        processed_engine.sync_weights(model)
        torch.manual_seed(12)
        out = processed_engine.generate(_prompts(tokenizer, 3), SamplingParams(
            n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24, logprobs=True))
        raw, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, temperature)
        m = rb.completion_mask.bool()
        pos = (rb.attention_mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            z = completion_logits(model, rb.input_ids, rb.attention_mask, pos, rb.completion_ids.shape[1], temperature)
        want = _kept_logsoftmax(z.float(), top_k, top_p).gather(-1, rb.completion_ids.unsqueeze(-1)).squeeze(-1)
        got = rb.sampling_logprobs
        assert _excess(got, want, m).max().item() <= 1
        drop = (got - raw)[m]  # = -log M_t >= 0: the renormalisation is visible, not a no-op
        assert (drop >= -MODEL_REORDER * (1 + raw[m].abs())).all() and drop.max().item() > 1e-2
        with torch.no_grad():
            _, _, fwd = policy_forward(model, rb.input_ids, rb.attention_mask, pos, rb.completion_ids, temperature)
            log_mass = kept_log_mass(predicting_window(fwd.hidden, rb.prompt_ids.shape[1], rb.completion_ids.shape[1]),
                                     fwd.head_weight, fwd.head_bias, top_k, top_p, temperature)
        # old - processed = log M_t; three fp32 computations (HF, vLLM, the chunked kept mass), each within its bound
        bound = MODEL_REORDER * (3 + raw.abs() + got.abs() + log_mass.abs())
        assert (((raw - got) - log_mass).abs() <= bound)[m].all()

    def test_sequence_ratio_by_hand_and_masked_above_3(self, processed_engine, tokenizer, hf_model):
        """rollout=vllm_paper's correction on real processed log-probs: w_i = exp(Σ_t (old − sampler)) on every token
        of sequence i, 0 when above 3 (TRL's sequence_mask, clip_max 3). Same weights: w_i = Π_t M_t <= 1.

        A policy that moved since sampling, constructed so that its ratios fall on both sides of 3 whatever tokens
        this CPU's vLLM build samples: on every other sequence it adds C to the logit of the sampled token at each
        position (the moved policy puts ~all its mass on what was sampled there), so that sequence's ratio is
        ~1 / p_sampler(sequence), > 3 for any sequence the sampler drew with probability < 1/3; every other sequence
        keeps the sampler's weights (ratio Π_t M_t <= 1). Any policy's ratio is <= 1 / p_sampler (old <= 1 per
        token), so a sequence drawn with probability >= 1/3 can never cross 3: the boosted ones are chosen below it."""
        import math

        from grail_exp.compute.forward import completion_logits
        from grail_exp.loss import is_weights

        sampler_model = hf_model
        processed_engine.sync_weights(sampler_model)
        torch.manual_seed(14)
        out = processed_engine.generate(_prompts(tokenizer, 4), SamplingParams(
            n=4, temperature=1.0, top_k=5, max_new_tokens=24, logprobs=True, per_request_seeds=True))
        same, rb = _trainer_logprobs(sampler_model, out, tokenizer.pad_token_id, 1.0)
        mask = rb.completion_mask.float()
        sampler = rb.sampling_logprobs
        sequence_logp = [sum(sampler[i, t].item() for t in range(len(out[i].token_ids))) for i in range(len(out))]
        # boosted: every other sequence whose sampled probability is below 1/(3e): its ratio lands above 3 by a margin
        boost = [i % 2 == 0 and lp < -math.log(3.0) - 1.0 for i, lp in enumerate(sequence_logp)]
        assert any(boost), ("no even-indexed sequence was drawn with probability < 1/(3e): nothing can cross 3",
                            sequence_logp)
        C = 50.0  # logit boost: 1 - softmax mass on the sampled token <= V · e^(-C + logit range) ~ 0 in fp32
        pos = (rb.attention_mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            z = completion_logits(sampler_model, rb.input_ids, rb.attention_mask, pos, rb.completion_ids.shape[1],
                                  1.0).float()
        bias = torch.zeros_like(z).scatter_(-1, rb.completion_ids.unsqueeze(-1), C)
        bias *= torch.tensor(boost, dtype=z.dtype)[:, None, None]
        moved = torch.log_softmax(z + bias, -1).gather(-1, rb.completion_ids.unsqueeze(-1)).squeeze(-1)
        for old, expect_masked in ((same, False), (moved, True)):
            w, _ = is_weights(old, sampler, mask, "sequence_mask", None, 3.0)
            ratios = []
            for i in range(len(out)):
                n = len(out[i].token_ids)
                ratio = math.exp(sum(old[i, t].item() - sampler[i, t].item() for t in range(n)))
                ratios.append(ratio)
                want = 0.0 if ratio > 3.0 else ratio
                assert torch.allclose(w[i, :n], torch.full((n,), want), rtol=1e-4, atol=1e-6), (i, ratio, w[i, :n])
            if expect_masked:
                for i, r in enumerate(ratios):  # by construction: 1/p_sampler > 3e when boosted, Π_t M_t otherwise
                    if boost[i]:
                        assert r > 3.0 and math.isclose(r, math.exp(-sequence_logp[i]), rel_tol=1e-3), (i, r)
                    else:
                        assert r <= 1 + 1e-3, (i, r)
                assert not all(boost), boost  # both sides of 3 are present
            else:
                assert max(ratios) <= 1 + 1e-3 and min(ratios) < 0.99, ratios  # Π_t M_t: top-5 drops mass


# ---------------------------------------------------------------------------------------------- end to end
def _run(args, tmp_path, timeout=HANG_TIMEOUT_S):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args, f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_evaluate_through_vllm(tmp_path, model_dir):
    done = _run(["grail_exp.evaluate", "rollout=vllm", "rollout.vllm.max_model_len=256", f"model.name_or_path={model_dir}",
                 "benchmark=arithmetic", "eval=quick", "benchmark.limit=4", "eval.n=2", "eval.max_tokens=24",
                 "logger=none", f"hydra.run.dir={tmp_path}/eval"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert "arithmetic" in json.dumps(summary)
    lines = (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 * 2


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_two_training_steps_with_vllm(tmp_path, model_dir):
    done = _run(["grail_exp.run", "rollout=vllm", "debug=fast", "logger=none", f"model.name_or_path={model_dir}",
                 "rollout.vllm.max_model_len=256", "rollout.max_completion_length=24", "eval.max_tokens=24",
                 "benchmark.limit=2",
                 # every row carries loss: at 24 tokens ~95 % of this model's completions are cut off, and a round
                 # whose rows are all masked has no IS ratio to check
                 "loss.mask_truncated_completions=false", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    m = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    # rollout=vllm turns the IS correction on: its ratio exp(logp_trainer - logp_vllm) is 1 when the sync is right
    assert abs(m["train/is/ratio_min"] - 1) < 1e-3 and abs(m["train/is/ratio_max"] - 1) < 1e-3, m
    assert m["train/timing/weight_sync_s"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_two_training_steps_with_vllm_paper(tmp_path, model_dir):
    """rollout=vllm_paper end to end: processed log-probs, the sequence mask at 3, the kept mass logged. With the
    sampler in sync, every sequence ratio is Π_t M_t <= 1 and its log is Σ_t log M_t (logged); the sampler check,
    which adds log M_t back, sees no mismatch."""
    done = _run(["grail_exp.run", "rollout=vllm_paper", "rollout.top_k=5", "debug=fast", "logger=none",
                 f"model.name_or_path={model_dir}", "rollout.vllm.max_model_len=256",
                 "rollout.max_completion_length=24", "eval.max_tokens=24", "benchmark.limit=2",
                 "loss.mask_truncated_completions=false",  # every row carries loss
                 f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    m = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert m["train/is/ratio_max"] <= 1 + 1e-3 and m["train/is/ratio_min"] < 0.99, m
    assert m["train/sampling/seq_log_kept_mass"] < -1e-2 and m["train/sampling/token_log_kept_mass"] < 0, m
    assert m["train/sampling/logp_abs_diff_mean"] < 1e-4, m


# ---------------------------------------------------------------------------------------------- sizing (issue 29)
def test_rotary_reload_notice_is_dropped_and_nothing_else():
    """vLLM logs "<layer>: Failed to load weights" for a layer that received no tensor at a weight push. A rotary
    embedding's cos/sin table is derived from the config, never pushed: its line is dropped; any other layer's stays."""
    import logging

    from grail_exp.rollout.vllm import _rotary_reload_notice

    rec = lambda name: logging.LogRecord("vllm.x", logging.WARNING, "f", 1, "%s: Failed to load weights", (name,), None)  # noqa: E731
    assert not _rotary_reload_notice(rec("RotaryEmbedding"))
    assert not _rotary_reload_notice(rec("Llama3RotaryEmbedding"))
    assert _rotary_reload_notice(rec("QKVParallelLinear"))
    other = logging.LogRecord("vllm.x", logging.WARNING, "f", 1, "%s: Delayed processing", ("RotaryEmbedding",), None)
    assert _rotary_reload_notice(other)


def test_max_model_len_and_kv_cache_come_from_the_run(compose_cfg, tiny_tokenizer):
    """rollout.vllm.max_model_len=null: the longest prompt the run renders (training sample and the benchmark) + the
    longer of max_completion_length and eval.max_tokens, in 16-token pages — counted here from the prompts; the CPU
    KV cache: every rollout row at that length x the planner's page factor, in the model's dtype."""
    from grail_exp.data import build_source, load_benchmark
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.memory import VLLM_CPU_PAGE_FACTOR, model_shape, vllm_kv_cache_bytes
    from grail_exp.rollout.vllm import run_max_model_len

    cfg = compose_cfg(["rollout=vllm", "rollout.max_completion_length=40", "eval.max_tokens=72"])
    src = build_source(cfg.data, seed=cfg.seed, prompts_per_step=cfg.trainer.prompts_per_step)
    qs = [src[i].question for i in range(256)] + [p.question for b in cfg.benchmark.names for p in load_benchmark(b, cfg)]
    longest = max(len(p) for p in encode_prompts(qs, tiny_tokenizer, cfg.model, cfg.data.instruction))
    expected = (longest + 72 + 15) // 16 * 16
    assert run_max_model_len(cfg, tiny_tokenizer) == expected
    s = model_shape(cfg.model)
    rows = min(cfg.rollout.generation_batch_size, cfg.trainer.prompts_per_step * cfg.rollout.num_generations)
    per_token = 2 * s.layers * s.kv_heads * s.head_dim * (4 if cfg.model.dtype == "float32" else 2)
    assert vllm_kv_cache_bytes(cfg, expected) == int(VLLM_CPU_PAGE_FACTOR * rows * expected * per_token)
