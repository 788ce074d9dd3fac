"""rollout=vllm against the trainer and the HF engine, on vLLM's CPU build (`make test-vllm` builds .venv-vllm).

Tests marked ``vllm`` are skipped where vLLM is not importable (the main .venv); the config checks at the top run
everywhere. One engine is started per module (a few seconds) and every test pushes the weights it samples from.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grail_exp.config import ConfigError, validate
from grail_exp.rollout import SamplingParams, build_engine

from conftest import HANG_TIMEOUT_S

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine (vLLM's default: 4)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4  # |logp_vllm - logp_trainer| in fp32 (measured max ~1e-6; different kernels, same math)


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
    from grail_exp.loss import selective_log_softmax
    from grail_exp.module import completion_logits
    from grail_exp.rollout import pad_completions

    rb = pad_completions(completions, pad_id)
    mask = rb.attention_mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = completion_logits(model, rb.input_ids, mask, pos, rb.completion_ids.shape[1], temperature)
        lp = selective_log_softmax(logits.float(), rb.completion_ids)
    return lp, rb


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
        assert [c.token_ids for c in twice] == [c.token_ids for c in ours for _ in range(2)]  # prompt-major
        assert [c.token_ids for c in ours] == [c.token_ids for c in hf]
        assert [c.truncated for c in ours] == [c.truncated for c in hf]
        assert sum(len(c.token_ids) for c in ours) > 20  # a real comparison, not empty strings

    @pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 20, 0.8)])
    def test_logprobs_match_the_trainer(self, engine, tokenizer, hf_model, temperature, top_k, top_p):
        model = _perturb(hf_model, seed=2)
        engine.sync_weights(model)
        torch.manual_seed(3)
        out = engine.generate(_prompts(tokenizer, 3), SamplingParams(
            n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=24, logprobs=True))
        want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, temperature)
        m = rb.completion_mask.bool()
        diff = (rb.sampling_logprobs - want).abs()[m]
        assert diff.max().item() < TOL, diff.max().item()
        if top_k or top_p < 1:
            # The renormalised top-k/top-p log-prob (vLLM's processed_logprobs) differs: the check can fail.
            assert (rb.sampling_logprobs[m] - want[m]).abs().max().item() < TOL
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
        assert (rb.sampling_logprobs - want).abs()[m].max().item() < TOL

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
        assert (rb.sampling_logprobs - want).abs()[m].mean().item() > 100 * TOL

    def test_push_through_a_safetensors_directory(self, engine, tokenizer, hf_model):
        """The multiprocess fallback (weights written to disk, read by the worker) gives the same engine."""
        model = _perturb(hf_model, seed=5)
        engine._push_via_path(model.state_dict())
        engine.llm.reset_prefix_cache()
        out = engine.generate(_prompts(tokenizer, 2), SamplingParams(n=1, temperature=0.0, max_new_tokens=16,
                                                                    logprobs=True))
        want, rb = _trainer_logprobs(model, out, tokenizer.pad_token_id, 1.0)
        assert (rb.sampling_logprobs - want).abs()[rb.completion_mask.bool()].max().item() < TOL

    def test_seeds_come_from_torch_rng(self, engine, tokenizer, hf_model):
        engine.sync_weights(hf_model)
        prompts, params = _prompts(tokenizer, 2), SamplingParams(n=4, temperature=1.0, max_new_tokens=12)
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

    def test_build_engine_from_config_syncs_the_live_policy(self, engine, compose_cfg, model_dir, tokenizer, hf_model):
        """build_engine('vllm') starts from the directory, then pushes the (here: changed) policy."""
        engine.close()  # one CPU engine at a time keeps memory low; the fixture's engine is not used after this
        model = _perturb(hf_model, seed=6)
        cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256", f"model.name_or_path={model_dir}"])
        e = build_engine("vllm", model, tokenizer, 8, cfg=cfg, model_path=model_dir)
        try:
            prompts = _prompts(tokenizer, 2)
            params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
            from grail_exp.rollout.hf import HFRolloutEngine

            assert [c.token_ids for c in e.generate(prompts, params)] == \
                   [c.token_ids for c in HFRolloutEngine(model, tokenizer).generate(prompts, params)]
        finally:
            e.close()


# ---------------------------------------------------------------------------------------------- end to end
def _run(args, tmp_path, timeout=HANG_TIMEOUT_S):
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", *args, f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


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


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_two_training_steps_with_vllm(tmp_path, model_dir):
    done = _run(["grail_exp.run", "rollout=vllm", "debug=fast", "logger=none", f"model.name_or_path={model_dir}",
                 "rollout.vllm.max_model_len=256", "rollout.max_completion_length=24", "eval.max_tokens=24",
                 "benchmark.limit=2", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    m = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    # rollout=vllm turns the IS correction on: its ratio exp(logp_trainer - logp_vllm) is 1 when the sync is right
    assert abs(m["train/is/ratio_min"] - 1) < 1e-3 and abs(m["train/is/ratio_max"] - 1) < 1e-3, m
    assert m["train/timing/weight_sync_s"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()
