"""SmolLM2-135M-Instruct, a real pretrained model shipped by a package (``pkg:smollm2``): conversion, prompt,
generation, GRAIL / OAR-G on its own completions, and one RL step per scheme (docs/real-model.md).

The GGUF file is de-quantised once per test session into a cache shared by the pytest-xdist workers (the
conversion's file lock makes the second worker wait for the first and reuse its directory).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers.compose import compose

EOS = "<|im_end|>"  # SmolLM2's ChatML end of turn: its EOS and pad token (id 2)


def _cfg(cache: Path, tmp: Path, overrides=(), scheme: str = "grpo"):
    from grail_exp.validate import validate

    return validate(compose([f"experiment=real/smollm2_{scheme}", f"paths.root_dir={tmp}",
                             f"paths.output_dir={tmp}/run", f"paths.cache_dir={cache}", *overrides]))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir, smollm2_cache, tmp_path_factory):
    """(config, tokenizer, float32 model) loaded through grail_exp.models.loading from ``model=smollm2_135m``."""
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    cfg = _cfg(smollm2_cache, tmp_path_factory.mktemp("smollm2_cfg"), ["model.dtype=float32"])
    path = resolve_model_path(cfg)
    assert Path(path) == smollm2_dir
    return cfg, load_tokenizer(path, cfg), load_causal_lm(path, cfg, trainable=True)


def test_converted_once_into_a_plain_safetensors_directory(smollm2_dir, smollm2_cache):
    from grail_exp.models.packaged import PACKAGED_MODELS, file_sha256, read_source, resolve, source_file

    src = read_source(smollm2_dir)
    gguf = source_file("pkg:smollm2")
    assert src["sha256"] == file_sha256(gguf) and src["package_version"] == "0.1.2"
    assert src["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and src["parameters"] == 134_515_008
    assert smollm2_dir.name.startswith(f"smollm2-0.1.2-{src['sha256'][:12]}-")  # keyed by version and file hash
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve("pkg:smollm2", smollm2_cache) == str(smollm2_dir)  # cached: not converted again
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((smollm2_dir / "config.json").read_text())
    # no GGUF quantisation marker: a later load must not go through transformers' (untrainable) GGUF quantizer
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert PACKAGED_MODELS["smollm2"].hub_revision in (Path(__file__).parents[1] / "conf/model/smollm2_135m.yaml"
                                                       ).read_text()


def test_loads_as_an_ordinary_trainable_llama(smollm2):
    _, _, model = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as released
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_unknown_packaged_model_is_one_line_naming_the_key(tmp_path):
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match=r"model.name_or_path='pkg:nope': unknown packaged model; valid: pkg:smollm2"):
        validate(compose(["model=smollm2_135m", "model.name_or_path=pkg:nope"], tmp_path))


def test_chat_template_system_turn_few_shot_and_eos_are_the_tokenizers(smollm2):
    from grail_exp.data.prompting import render_prompt
    from grail_exp.rollout import build_engine

    cfg, tok, model = smollm2
    assert tok.eos_token == EOS and tok.eos_token_id == 2 == model.config.eos_token_id
    assert tok.pad_token_id == 2 and tok.padding_side == "left"
    assert tok.encode("Compute 7+5.", add_special_tokens=False) == tok("Compute 7+5.")["input_ids"]  # no BOS added
    assert build_engine("hf", model, tok).stop_token_ids == [2]  # generation stops at the end of the turn
    text = render_prompt("Compute 1+2.", tok, cfg.model)
    # the model's own template, its default system turn kept (model.system_prompt: null), then the worked examples
    expected = tok.apply_chat_template(
        [m for ex in cfg.model.few_shot for m in ({"role": "user", "content": ex.question},
                                                   {"role": "assistant", "content": ex.answer})]
        + [{"role": "user", "content": "Compute 1+2."}], add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                           "<|im_end|>\n<|im_start|>user\nCompute 7+5.<|im_end|>\n<|im_start|>assistant\n7+5=12. ")
    assert text.endswith("<|im_start|>user\nCompute 1+2.<|im_end|>\n<|im_start|>assistant\n")
    from omegaconf import OmegaConf

    mine = OmegaConf.merge(cfg.model, {"system_prompt": "Be brief.", "few_shot": []})
    own = render_prompt("Compute 1+2.", tok, mine, "!")
    assert own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompute 1+2.!<|im_end|>\n" \
                  "<|im_start|>assistant\n"


def _generate(smollm2, questions, n, temperature, max_new_tokens, seed=0):
    from grail_exp.data.prompting import encode_prompts
    from grail_exp.rollout import build_engine
    from grail_exp.rollout.base import SamplingParams

    cfg, tok, model = smollm2
    prompts = encode_prompts(questions, tok, cfg.model, cfg.data.instruction)
    torch.manual_seed(seed)
    comps = build_engine("hf", model, tok).generate(prompts, SamplingParams(
        n=n, temperature=temperature, max_new_tokens=max_new_tokens, logprobs=True))
    return comps, [tok.decode(c.token_ids, skip_special_tokens=True) for c in comps]


def test_greedy_answers_in_the_worked_examples_form_and_stops_at_eos(smollm2):
    from grail_exp.grading.boxed import extract_last_boxed

    comps, texts = _generate(smollm2, ["Compute 4+3.", "Compute 12-5."], n=1, temperature=0, max_new_tokens=20)
    for c, text in zip(comps, texts):
        assert not c.truncated and c.token_ids[-1] == 2, text  # ended its turn with <|im_end|>
        assert extract_last_boxed(text) is not None, text  # the few-shot answer form: "a+b=c. \boxed{c}"
        assert all(lp <= 0 and lp == lp for lp in c.logprobs)


@pytest.fixture(scope="session")
def sampled_batch(smollm2):
    """8 real completions (2 problems x 4, T 1.0) as a SchemeBatch, advantages alternating -1 / +1."""
    from grail_exp.weights import scheme_batch

    cfg, tok, model = smollm2
    comps, texts = _generate(smollm2, ["Compute 16+9.", "Compute 18-12."], n=4, temperature=1.0, max_new_tokens=20)
    rows = [{"prompt_ids": c.prompt_ids, "completion_ids": c.token_ids, "advantage": (-1.0) ** (i + 1)}
            for i, c in enumerate(comps)]
    batch = scheme_batch(rows, tok.pad_token_id, "cpu", 1.0, torch.Generator().manual_seed(0))
    batch.completion_texts = texts
    return batch


def _scheme(name: str, tok, tmp: Path, cache: Path):
    from omegaconf import OmegaConf

    from grail_exp.advantages import build_scheme, scheme_config_class

    cfg = _cfg(cache, tmp, scheme=name)
    return build_scheme(OmegaConf.merge(OmegaConf.structured(scheme_config_class(name)), cfg.advantage), tok,
                        {"model": cfg.model, "seed": 0, "data": cfg.data})


def test_answer_spans_cover_the_boxed_answer_of_real_completions(smollm2, sampled_batch, tmp_path, smollm2_cache):
    """span_mapping=exact covers the box exactly; the default (the reference's re-encoding) lands one token right
    of it when a space precedes the box (the documented quirk of grail_exp/spans.py, seen here on
    SmolLM2's own completions: 'Ġ\\' is one live token, but "a" + text[:s] re-encodes with a bare 'Ġ')."""
    from omegaconf import OmegaConf

    from grail_exp.grading.boxed import find_first_boxed_span

    _, tok, _ = smollm2
    b = sampled_batch
    reference = _scheme("grail", tok, tmp_path, smollm2_cache)
    assert reference.cfg.span_mapping == "reference"
    exact_scheme = _scheme("grail", tok, tmp_path, smollm2_cache)
    exact_scheme.cfg = OmegaConf.merge(exact_scheme.cfg, {"span_mapping": "exact"})
    ref, exact = reference.spans(b), exact_scheme.spans(b)
    boxed = [find_first_boxed_span(t) is not None for t in b.completion_texts]
    assert sum(boxed) >= 4, b.completion_texts  # the few-shot form boxes ~95 % of sampled answers
    assert ref.has_box.tolist() == boxed == exact.has_box.tolist()
    for i, text in enumerate(b.completion_texts):
        if not boxed[i]:
            continue
        s, e = find_first_boxed_span(text)
        ids, valid = b.completion_ids[i], b.completion_mask[i].bool()
        span = exact.marker[i] | exact.content[i] | exact.closing[i]
        assert tok.decode(ids[span]).strip() == text[s:e], text  # marker + content + "}": the first box exactly
        assert tok.decode(ids[exact.content[i]]) == text[s + len("\\boxed{"):e - 1]
        assert exact.post[i].nonzero().min() > span.nonzero().max()  # what follows (the EOS) comes after the box
        ref_span = (ref.marker[i] | ref.content[i] | ref.closing[i]) & valid
        shift = 1 if text[s - 1:s] == " " else 0
        assert ref_span.tolist() == (torch.roll(span, shift) & valid).tolist(), text


def test_grail_weights_on_real_completions(smollm2, sampled_batch, tmp_path, smollm2_cache):
    from grail_exp.weights import scheme_weights

    cfg, tok, model = smollm2
    scheme = _scheme("grail", tok, tmp_path, smollm2_cache)
    a = scheme.cfg
    w = scheme_weights(scheme, model, sampled_batch, micro_batch_size=8)
    b, spans, valid = sampled_batch, scheme.spans(sampled_batch), sampled_batch.completion_mask.bool()
    assert torch.isfinite(w).all() and (w[valid] > 0).all() and (w[~valid] == 0).all()
    for i in range(w.shape[0]):
        if not spans.has_box[i]:  # no answer to probe: GRPO's weight 1
            assert (w[i][valid[i]] == 1).all()
            continue
        # the overrides apply to every boxed row (reference order, spec 11.4): content -> w_max, the rest -> w_mean
        content, fixed = spans.content[i] & valid[i], (spans.marker[i] | spans.closing[i] | spans.post[i]) & valid[i]
        assert (w[i][content] == a.w_max).all() and (w[i][fixed] == a.mean).all()
        pre = valid[i] & ~(spans.content[i] | fixed)
        if b.advantages[i] > 0:  # symmetry "wrong": correct-side rows are not reweighted
            assert (w[i][pre] == 1).all()
        else:
            assert ((w[i][pre] >= a.w_min) & (w[i][pre] <= a.w_max)).all()
            assert w[i][pre].unique().numel() > 1  # the saliency of a real model differs between tokens


def test_oar_g_weights_on_real_completions_preserve_the_mean(smollm2, sampled_batch, tmp_path, smollm2_cache):
    from grail_exp.weights import scheme_weights

    cfg, tok, model = smollm2
    scheme = _scheme("oar_g", tok, tmp_path, smollm2_cache)
    w = scheme_weights(scheme, model, sampled_batch, micro_batch_size=8)
    valid, spans = sampled_batch.completion_mask.bool(), scheme.spans(sampled_batch)
    assert torch.isfinite(w).all() and (w[valid] > 0).all()
    for i in range(w.shape[0]):
        n = int(valid[i].sum())
        # w = omega * T / sum(omega): mean 1 up to float32 rounding of a <= 20-term sum of O(1) values (~20 * 6e-8)
        assert float(w[i][valid[i]].mean()) == pytest.approx(1.0, abs=1e-5), n
        if spans.has_box[i]:
            assert w[i][valid[i]].max() > 1 > w[i][valid[i]].min()  # boosted and suppressed tokens


@pytest.mark.parametrize("scheme", ["grpo", "grail", "oar_g"])
def test_one_rl_step_of_the_real_model_per_scheme(scheme, smollm2_dir, smollm2_cache, tmp_path):
    """experiment=real/smollm2_<scheme> as shipped (bfloat16, few-shot prompt), cut to one short step."""
    from grail_exp.run import run

    cfg = _cfg(smollm2_cache, tmp_path, scheme=scheme, overrides=[
        "logger=none", "trainer.max_steps=1", "trainer.prompts_per_step=1",
        "rollout.num_generations=4", "rollout.max_completion_length=12", "trainer.micro_batch_size=4",
        "trainer.eval_before_training=false", "trainer.eval_at_end=false", "reward.num_workers=0",
        "trainer.weights_table_every=0",
        # one group of 4 may have equal rewards (A = 0): probe every row anyway, so GRAIL's path always runs
        *(["advantage.skip_zero_advantage=false"] if scheme == "grail" else [])])
    assert cfg.advantage.name == scheme and cfg.model.dtype == "bfloat16"
    run(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["metrics"]
    assert metrics["train/steps"] == 1
    assert all(v == v for k, v in metrics.items() if k.startswith("train/") and isinstance(v, float))  # no NaN
    assert 0.0 <= metrics["train/reward/mean"] <= 1.0 and metrics["train/completions/mean_length"] > 0


@pytest.mark.e2e
def test_hub_id_at_the_pinned_revision_loads_through_the_hub_path(smollm2_dir, tmp_path):
    """model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct (the released weights' hub id, model.revision pinned) goes
    through transformers' hub resolution: here from an offline hub cache laid out as a download at that revision
    leaves it, holding the converted files (the hub itself is unreachable from CI)."""
    import subprocess
    import sys

    from grail_exp.models.packaged import PACKAGED_MODELS

    entry = PACKAGED_MODELS["smollm2"]
    repo = tmp_path / "hub" / ("models--" + entry.hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / entry.hub_revision
    snapshot.mkdir(parents=True)
    for f in smollm2_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)  # "main" points elsewhere: only the pinned revision can resolve
    code = (
        "import sys; from tests.helpers.compose import compose; from grail_exp.validate import validate\n"
        "from grail_exp.models.loading import resolve_model_path, load_tokenizer, load_causal_lm\n"
        f"cfg = validate(compose(['model=smollm2_135m', 'model.name_or_path={entry.hub_id}'], __import__('pathlib')"
        f".Path(sys.argv[1])))\n"
        "path = resolve_model_path(cfg); tok = load_tokenizer(path, cfg)\n"
        "m = load_causal_lm(path, cfg, trainable=False)\n"
        "print(path, cfg.model.revision, tok.eos_token, sum(p.numel() for p in m.parameters()))\n")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == [entry.hub_id, entry.hub_revision, EOS, "134515008"]
