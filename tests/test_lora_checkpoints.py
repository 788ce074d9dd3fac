"""Checkpoints of ``peft=lora`` runs (grail_exp/training/lora_checkpoint.py): the adapter, its optimiser state and the
training state only; ``resume=auto`` exact; the adapter as a PEFT folder that ``peft.PeftModel.from_pretrained`` loads
and the merged model as a Hugging Face folder.

Expectations: an uninterrupted run (resume), the parameter counts and dtypes by hand (size), PEFT's own loading and
merge of the exported adapter (export)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grail_exp.checkpoint import complete_checkpoints, load_rank_state, load_training_state
from helpers.compose import compose
from helpers.fakes import AlternatingVerifier
from helpers.states import states_equal
from helpers.tolerances import MODEL_REORDER


def _cfg(run_dir: Path, model_dir, extra=()):
    return compose([f"model.name_or_path={model_dir}", f"paths.output_dir={run_dir}", "logger=none", "peft=lora",
                    "rollout.engine=helpers.fakes:ScriptedEngine", "trainer.prompts_per_step=4",
                    "trainer.micro_batch_size=16", "rollout.num_generations=4", "rollout.max_completion_length=40",
                    "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                    "optim.lr=1e-2", *extra], run_dir.parent)




@pytest.fixture
def alternating(monkeypatch):
    import grail_exp.grading.rewards

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)


@pytest.mark.parametrize("scheme, mu, first_leg, dtype", [("grpo", 1, 2, "float32"), ("grail", 2, 1, "float32"),
                                                          ("grpo", 1, 2, "bfloat16")])
def test_four_steps_equal_two_plus_resume_plus_two_under_lora(tmp_path, tiny_model_dir, alternating, scheme, mu,
                                                               first_leg, dtype):
    """Bit-identical adapter, optimiser and scheduler state and RNG after resume=auto (grail, mu=2, 1: resumed in the
    middle of a rollout batch; bf16: bf16 adapters whose fp32 masters the optimiser state carries); the adapter moved
    and the checkpoints carry no weights of the base."""
    from grail_exp.run import run

    common = [f"advantage={scheme}", f"loss.num_iterations={mu}", f"model.dtype={dtype}",
              "advantage.symmetry=both" if scheme == "grail" else "loss.beta=0.04"]
    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    run(_cfg(straight, tiny_model_dir, [*common, "trainer.max_steps=4"]))
    run(_cfg(split, tiny_model_dir, [*common, f"trainer.max_steps={first_leg}"]))
    run(_cfg(split, tiny_model_dir, [*common, "trainer.max_steps=4", "resume=auto"]))

    a, b = straight / "checkpoints" / "step-4", split / "checkpoints" / "step-4"
    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # diff 0
    assert any(wa[k].abs().max() > 0 for k in wa if ".lora_B." in k)  # B left zero: training moved the adapter
    sa, sb = load_training_state(a), load_training_state(b)
    assert states_equal(sa["optimizer"], sb["optimizer"]) and states_equal(sa["scheduler"], sb["scheduler"])
    assert sa["step"] == sb["step"] == 4
    assert states_equal(load_rank_state(a, 0)["rng"]["torch"], load_rank_state(b, 0)["rng"]["torch"])
    assert not (a / "model.safetensors").exists() and not (b / "model.safetensors").exists()


def test_a_lora_checkpoint_holds_the_adapter_its_optimiser_and_the_training_state_only(tmp_path, tiny_model_dir,
                                                                                       alternating):
    """Its size, by hand: the adapter in fp32 (4 B per element) and AdamW's two moments (8 B), plus the tokenizer's
    files, the configs and the counters — far below the base's 4 B per parameter."""
    from grail_exp.run import run

    run_dir = tmp_path / "r" / "run"
    run(_cfg(run_dir, tiny_model_dir, ["advantage=grpo", "peft.rank=1", "trainer.max_steps=1"]))
    (ckpt,) = complete_checkpoints(run_dir / "checkpoints")
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_rank = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)  # sum of (in + out) over 7 layers
    adapter = layers * 1 * per_rank  # r = 1
    base = sum(t.numel() for t in load_file(Path(tiny_model_dir) / "model.safetensors").values())
    assert sum(t.numel() for t in load_file(ckpt / "adapter_model.safetensors").values()) == adapter
    tokenizer = tmp_path / "tok"
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tokenizer)
    tok_bytes = sum(f.stat().st_size for f in tokenizer.iterdir())
    total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    # 12 B per adapter element; the tokenizer; 64 KiB for the configs, safetensors / torch.save headers, RNG states
    # and counters (the torch RNG state alone is 5 KB, numpy's 2.5 KB, the optimiser's index per tensor a few bytes)
    assert total <= 12 * adapter + tok_bytes + 64 * 1024, (total, adapter)
    assert 12 * adapter < 4 * base / 10  # the trainable state is a tenth of the base's weights or less
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "sharded").exists()


def test_the_export_loads_in_peft_and_the_merged_folder_in_transformers(tmp_path, tiny_model_dir, alternating):
    """The final checkpoint with peft.export_merged=true: its adapter folder loads with PeftModel.from_pretrained
    onto the base (its config names it), and its merged/ folder loads as a plain model equal to PEFT's own merge of
    that adapter; the weights-only trajectory holds the merged model too (step-0: the base). A checkpoint before the
    last holds the adapter alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grail_exp.run import run

    run_dir = tmp_path / "r" / "run"
    run(_cfg(run_dir, tiny_model_dir, ["advantage=grpo", "trainer.max_steps=2", "peft.export_merged=true",
                                       "trainer.save_weights_only_every=1", "trainer.checkpoint_every=1"]))
    ckpt = run_dir / "checkpoints" / "step-2"
    assert (run_dir / "checkpoints" / "step-1" / "adapter_config.json").is_file()
    assert not (run_dir / "checkpoints" / "step-1" / "merged").exists()  # the merged model: the final checkpoint only
    assert json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ckpt).eval()
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged").eval()
    pm = peft_model.merge_and_unload()  # PEFT's merge of the same adapter: the expectation
    for (n, a), (m, b) in zip(merged.state_dict().items(), pm.state_dict().items()):
        assert n == m
        # our fp32 W + s (B A) and PEFT's W + (B A) s: the same products, at most a rounding of the scaling apart
        assert (a - b).abs().max() <= MODEL_REORDER * b.abs().max(), n
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        assert (merged(ids).logits - pm(ids).logits).abs().max() <= MODEL_REORDER * pm(ids).logits.abs().max()
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    traj0 = load_file(run_dir / "trajectory" / "step-0" / "model.safetensors")
    assert traj0.keys() == start.keys() and all(torch.equal(traj0[k], start[k]) for k in start)  # B = 0: the base
    traj2 = load_file(run_dir / "trajectory" / "step-2" / "model.safetensors")
    final = load_file(ckpt / "merged" / "model.safetensors")
    assert all(torch.equal(traj2[k], final[k]) for k in final)
    assert any(not torch.equal(traj2[k], start[k]) for k in start)
