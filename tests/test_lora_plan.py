"""The memory planner under ``peft=lora`` (grail_exp/memory/): the LoRA recipe's plan by hand, the adapters' saved
activations against the real PEFT layers, one 80 GB card, the host plan and SLURM's --mem.

Expected numbers are computed here from the architecture file with this file's own arithmetic (tests/helpers/
architectures.py counts the parameters), never with the planner's helpers; the activations' coefficients against
saved-tensor hooks on PEFT-wrapped Hugging Face layers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grail_exp.config import ConfigError
from grail_exp.validate import validate
from helpers.architectures import architecture, parameter_count
from helpers.compose import compose

GiB = 2**30


def _cfg(*overrides: str):
    return compose(list(overrides), Path("/nonexistent"))


def _adapter_count(c: dict, r: int) -> int:
    """r x (in + out) of q, k, v, o, gate, up, down, per layer."""
    h, i, q, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"]
    return r * c["num_hidden_layers"] * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))


def test_the_lora_recipes_plan_by_hand_fits_one_80_gb_card():
    """experiment=paper/qwen3_8b_grail_lora on one 80 GB device: bf16 frozen base (no masters, no Adam), bf16
    adapters with fp32 masters, Adam and fp32 gradients, no reference copy, the engine's share with its LoRA slot, the
    update's activations with the frozen layers' and the adapters' saved tensors (gradient checkpointing: one layer
    recomputed)."""
    from grail_exp.memory import plan

    c = architecture("qwen3_8b")
    N, L, h, i, V = parameter_count(c), c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    n_a = _adapter_count(c, 32)
    assert n_a == 2_727_936 * 32  # docs/lora.md's count for Qwen3-8B
    b, mb, T = 2, 8, 512 + 4096
    tok = mb * T
    state = 2 * N + 2 * n_a + 4 * n_a + 8 * n_a  # frozen base, bf16 adapters, their fp32 masters, Adam moments
    grads = 4 * n_a  # accumulated in fp32 (the masters' gradients)
    saved = L * tok * h * b + tok * h * 6 + mb * 4096 * h * b + mb * T * T  # checkpointed: each layer's input, as full
    frozen = 8 * h + b * (2 * q + 2 * kv) + 4 * (q + kv) + 3 * b * i  # a frozen Qwen3 layer per token
    adapters = 2 * (h + q + i) + 2 * 7 * 32  # each distinct input the adapters read + their r-wide middles, bf16
    recompute = tok * (frozen + adapters) + tok * b * (2 * h + 2 * i)
    unit = 4096 * V * 4
    logits = max(4.1 * unit, max(3.3 * unit, 1.65 * unit + 6 * V * h) + 4 * V * h)
    reserve = 0.3 * 80 * GiB
    want_update = state + grads + saved + max(logits, recompute) + reserve
    p = plan(_cfg("experiment=paper/qwen3_8b_grail_lora", "trainer.device_memory_gb=80"))
    assert p.phases["update"] == pytest.approx(want_update, rel=1e-9)
    assert p.phases["state"] == pytest.approx(state + reserve, rel=1e-9)
    assert p.peak_phase == "update" and p.fits and not p.tight
    lines = {x.what: x.bytes for x in p.lines}
    assert lines["LoRA slot (inside the reserve)"] == 2 * _adapter_count(c, 32)  # max_lora_rank 32, bf16
    assert "reference model" not in lines or lines["reference model"] == 0
    # the engine's share holds its weights, the slot, the profile and a sequence's KV cache
    assert not p.problems


def test_the_hf_engines_merged_copy_adds_every_adapted_weight_in_model_dtype_to_the_state():
    """rollout=hf with peft.sync=merged holds W + (alpha/r) B A of every adapted linear layer in bf16 through every
    phase: the state grows by 2 B x sum(in x out) over q, k, v, o, gate, up, down of the 36 layers; with
    peft.sync=adapter (the live adapters) by nothing."""
    from grail_exp.memory import plan

    c = architecture("qwen3_8b")
    h, i = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * q + h * kv + h * kv + q * h + h * i + h * i + i * h
    assert per_layer == 192_937_984
    common = ("experiment=paper/qwen3_8b_grail_lora", "trainer.device_memory_gb=80", "rollout=hf")
    live, merged = plan(_cfg(*common, "peft.sync=adapter")), plan(_cfg(*common, "peft.sync=merged"))
    assert merged.phases["state"] - live.phases["state"] == pytest.approx(2 * 36 * per_layer, rel=1e-12)
    assert {x.what: x.bytes for x in merged.lines}["merged copy (HF engine)"] == 2 * 36 * per_layer
    assert "merged copy (HF engine)" not in {x.what for x in live.lines}


def test_lora_recipes_validate_on_one_card_and_full_fine_tuning_is_refused():
    for scheme in ("grail", "grpo"):
        cfg = validate(_cfg(f"experiment=paper/qwen3_8b_{scheme}_lora", "trainer.device_memory_gb=80"))
        assert cfg.peft.name == "lora" and cfg.trainer.devices == 1 and cfg.optim.lr == 1e-5
    with pytest.raises(ConfigError, match="does not fit|DOES NOT FIT|the peak per device"):
        validate(_cfg("experiment=paper/qwen3_8b_grail_lora", "trainer.device_memory_gb=80", "peft=none",
                      "optim.lr=1e-6"))


def test_the_planner_suggests_lora_when_one_card_cannot_hold_full_fine_tuning():
    from grail_exp.memory import plan, suggest

    cfg = _cfg("model=qwen3_8b", "advantage=grail", "trainer=gpu", "trainer.device_memory_gb=80")
    assert any("peft=lora" in o for o in suggest(cfg, plan(cfg)))


def test_the_lora_host_plan_and_slurm_memory_by_hand():
    """One rank reads the bf16 base from disk (15.3 GiB) beside the libraries and two grading workers; a checkpoint
    stages the adapter's 4 B per element; resume reads the base again: SLURM's --mem = ceil(1.1 x the peak)."""
    from grail_exp.memory import plan, planned_mem_gb

    c = architecture("qwen3_8b")
    N, n_a = parameter_count(c), _adapter_count(c, 32)
    cfg = _cfg("experiment=paper/qwen3_8b_grail_lora", "trainer.device_memory_gb=80")
    host = {x.phase: x.bytes for x in plan(cfg).host}
    steady = 0.6 * GiB + 2 * 0.15 * GiB
    assert host["host"] == pytest.approx(steady)
    assert host["host: load"] == 2 * N
    assert host["host: checkpoint"] == pytest.approx(2 * n_a)  # the bf16 adapters (the masters in the optimiser state)
    assert host["host: resume"] == 2 * N  # the base, read as at the start (the checkpoint holds the adapter only)
    assert planned_mem_gb(cfg) == math.ceil((steady + 2 * N) * 1.1 / GiB)


SAVED = r"""
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
mt, L, dtype, r, narrow, fp32 = (sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1",
                                 sys.argv[6] == "1")
c = dict(model_type=mt, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
         head_dim=64, num_hidden_layers=L, vocab_size=128, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**c), dtype=getattr(torch, dtype), attn_implementation="sdpa")
if narrow:
    from grail_exp.compute.leading_rows import narrow_backward
    narrow_backward(model, model.model)
if r:
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                   "o_proj", "gate_proj", "up_proj",
                                                                                   "down_proj"]),
                           autocast_adapter_dtype=fp32)
else:
    model.requires_grad_(False)
model.enable_input_require_grads()
model.train()
ids = torch.randint(128, (2, 128))
seen = {}
def pack(t):
    st = t.untyped_storage()
    seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    model.get_decoder()(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=torch.ones_like(ids),
                        use_cache=False)
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
print(sum(v for (ptr, n), v in seen.items() if ptr not in params))
"""


@pytest.mark.e2e
@pytest.mark.parametrize("model_type, dtype, rank, narrow, fp32", [
    ("qwen3", "bfloat16", 8, False, False), ("llama", "bfloat16", 0, False, False),
    ("qwen3", "bfloat16", 8, False, True),
    pytest.param("qwen3", "bfloat16", 16, False, False, marks=pytest.mark.slow),
    pytest.param("llama", "bfloat16", 8, False, False, marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 8, True, False, marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 16, False, True, marks=pytest.mark.slow),
    pytest.param("qwen3", "float32", 8, False, True, marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 8, True, True, marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 0, False, False, marks=pytest.mark.slow)])
def test_frozen_and_lora_layer_activations_match_the_saved_tensors(model_type, dtype, rank, narrow, fp32):
    """Bytes autograd saves per token for one more decoder layer with frozen weights (rank 0) or LoRA adapters on all
    seven linear layers (PEFT on the real HF model, adapters in the model's dtype or ``fp32`` as PEFT's autocast holds
    them; saved-tensor hooks deduplicated by storage), against frozen_layer_activation_bytes /
    lora_layer_activation_bytes."""
    from grail_exp.memory.shapes import Shape, frozen_layer_activation_bytes, lora_layer_activation_bytes

    root = Path(__file__).resolve().parents[1]

    def saved(layers):
        proc = subprocess.run([sys.executable, "-c", SAVED, model_type, str(layers), dtype, str(rank), str(int(narrow)),
                               str(int(fp32))],
                              capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    per_token = (saved(2) - saved(1)) / (2 * 128)
    s = Shape("t", 0, 2, 256, 768, 4, 2, 64, 128, False, model_type == "qwen3")
    b = 2 if dtype == "bfloat16" else 4
    a = 4 if fp32 else b
    expected = lora_layer_activation_bytes(s, b, rank, a, narrowed=narrow) if rank else frozen_layer_activation_bytes(s, b)
    # 1 %: the formulas count no per-token scalars (the norms' rsqrt, attention's log-sum-exp: ~48 B of ~10-20 kB)
    assert per_token == pytest.approx(expected, rel=0.01), (per_token, expected)
