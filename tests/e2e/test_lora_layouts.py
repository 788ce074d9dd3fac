"""``peft=lora`` in every multi-rank layout, rehearsed on 2 gloo ranks as the card's layout is (tests/test_card_layout.py):
DDP, FSDP2 (FULL_SHARD and SHARD_GRAD_OP) with a frozen base and fp32 adapters in one unit, DeepSpeed ZeRO-2.

Each layout's step is compared with one process on the same scripted rollouts (``helpers.scripted_run``: AdamW with
eps = lr = 1, so the comparison is of gradients) through the adapters the checkpoints hold; the probe
(``helpers.lora:LoraProbe``) shows on every rank that the frozen base never changed, the adapter did, and the ranks agree.
One layout runs with a bf16 base (the card's dtype), where the FSDP units hold bf16 and fp32 tensors together."""

from __future__ import annotations

import pytest
import torch

from helpers.scripted_run import rank_tolerance, run_scripted

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)

LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "advantage=grail", "advantage.symmetry=both",
        "loss.loss_type=dr_grpo", "trainer.max_steps=2", "trainer.checkpoint_every=1"]


def _adapter(run_dir, out, step: int) -> dict:
    from safetensors.torch import load_file

    path = run_dir / "checkpoints" / f"step-{step}" / "adapter_model.safetensors"
    assert path.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    assert not (path.parent / "model.safetensors").exists()  # the adapter is the checkpoint's model part
    return load_file(path)


def _probe_says_only_the_adapter_moved(probe_dir, ranks: int) -> None:
    from helpers.card_probe import read

    probe = read(probe_dir)
    assert sorted(probe) == list(range(ranks)), probe
    for r in range(ranks):
        setup = [x for x in probe[r] if x["point"] == "setup"]
        assert [(x["world_size"], x["rank"]) for x in setup] == [(ranks, r)]
        assert all(".lora_" in n for n in setup[0]["trainable"])
        seq = [x for x in probe[r] if x["point"] in ("started", "step")]
        assert [x.get("step") for x in seq] == [None, 1, 2]
        assert len({x["base"] for x in seq}) == 1, "the frozen base changed"
        assert len({x["adapter"] for x in seq}) == 3, "the adapter did not move at every step"
    assert [[x for x in probe[r] if x["point"] == "step"] for r in range(ranks)] == \
        [[x for x in probe[0] if x["point"] == "step"]] * ranks  # the ranks agree


# fsdp in the default suite (FSDP2 with a frozen base: the layout LoRA changes most); the others ~40-120 s each
@pytest.mark.parametrize("trainer", ["fsdp", pytest.param("deepspeed_zero2", marks=pytest.mark.slow),
                                     pytest.param("ddp", marks=pytest.mark.slow),
                                     pytest.param("fsdp_zero2", marks=pytest.mark.slow)])
def test_two_ranks_under_lora_equal_one_process(tmp_path, pinned_model_dir, trainer):
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    out1 = run_scripted(one, pinned_model_dir, LORA, probe_dir=tmp_path / "probe1", probe="helpers.lora:LoraProbe")
    out2 = run_scripted(two, pinned_model_dir, [*LORA, f"trainer={trainer}", "trainer.accelerator=cpu",
                                                "trainer.devices=2"], probe_dir=tmp_path / "probe2",
                        probe="helpers.lora:LoraProbe")
    _probe_says_only_the_adapter_moved(tmp_path / "probe1", 1)
    _probe_says_only_the_adapter_moved(tmp_path / "probe2", 2)
    a1, a2 = _adapter(one, out1, 1), _adapter(two, out2, 1)
    assert a1.keys() == a2.keys() and len(a1) == 2 * 7 * 2
    b = {k: v for k, v in a1.items() if ".lora_B." in k}
    moved = max(v.abs().max().item() for v in b.values())  # B starts at 0: its values are the first update
    assert moved > 1e-3
    assert max((a1[k] - a2[k]).abs().max().item() for k in a1) < rank_tolerance(moved)


def test_fsdp_with_a_bf16_base_and_fp32_adapters(tmp_path, pinned_model_dir):
    """The card's dtype: FSDP units of bf16 frozen base tensors and fp32 adapters (the masters: cast to bf16 for
    compute like full fine-tuning's weights; the trainable tensors, all fp32, reduce in fp32); the probe's checks on
    both ranks, and the adapters the checkpoint holds are the fp32 shards' values."""
    run = tmp_path / "run"
    out = run_scripted(run, pinned_model_dir, [*LORA, "model.dtype=bfloat16", "trainer=fsdp", "trainer.accelerator=cpu",
                                               "trainer.devices=2"], probe_dir=tmp_path / "probe",
                       probe="helpers.lora:LoraProbe")
    _probe_says_only_the_adapter_moved(tmp_path / "probe", 2)
    assert all(t.dtype == torch.float32 for t in _adapter(run, out, 2).values())


@pytest.mark.slow  # three 2-rank runs, ~4 min on the 2-core machine
def test_fsdp_lora_resume_is_exact(tmp_path, pinned_model_dir):
    """trainer=fsdp under LoRA: the sharded state holds the adapter and its optimiser only (the frozen base is the
    start's); two steps equal one step, resume=auto, one step — bit for bit, same world size."""
    from grail_exp.checkpoint import load_training_state

    fsdp = [*LORA, "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    out = run_scripted(straight, pinned_model_dir, fsdp)
    run_scripted(split, pinned_model_dir, [*fsdp, "trainer.max_steps=1"])
    out2 = run_scripted(split, pinned_model_dir, [*fsdp, "trainer.max_steps=2", "resume=auto"])
    a, b = _adapter(straight, out, 2), _adapter(split, out2, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    shards = split / "checkpoints" / "step-2" / "sharded"
    assert shards.is_dir() and sum(f.stat().st_size for f in shards.rglob("*")) < \
        3 * 4 * sum(t.numel() for t in a.values()) + 256 * 1024  # adapter + Adam moments (+ DCP metadata), no base
    assert load_training_state(split / "checkpoints" / "step-2")["step"] == 2
