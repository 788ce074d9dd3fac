"""Checkpoints written and read per rank (grail_exp/training/checkpoint_writer.py), on 2 gloo ranks.

- Host memory: an FSDP rank's checkpoint write adds less host memory than its own parameter shard, never the full
  model (before, rank 0 gathered the full model and optimiser state into its host memory).
- Another world size: an FSDP checkpoint of 2 ranks resumes on 1 with the same full model and optimiser state, through
  the whole job (slow; the main suite reshards 1 -> 2 and 2 -> 1 with the backend's own calls: test_rank_agreement.py).
ZeRO-2's per-rank partitions and its exact resume are in e2e/test_ddp.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.scripted_run import run_scripted

pytestmark = pytest.mark.e2e  # every test here runs a child process (tests/test_suite_rules.py)

# ~100 M parameters (24 layers of 4.2 M at hidden 512, intermediate 2048): the full fp32 model (385 MiB) is 2x a rank's
# parameter shard (193 MiB) and far above any single tensor (1 M entries, 4 MiB), which is what a streamed write holds
# at once; the shard is also well above the write's fixed costs (pickled metadata, write buffers: tens of MiB).
WIDE = dict(architecture="qwen3", tokenizer="qwen", hidden_size=512, intermediate_size=2048, num_layers=24,
            num_heads=8, num_kv_heads=8, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_model, build_tokenizer

    d = tmp_path_factory.mktemp("wide_model")
    tok = build_tokenizer("qwen", ArithmeticTask())
    model = build_model(WIDE, tok, seed=0).float()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _probe_lines(probe_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (probe_dir / f"rank{rank}.jsonl").read_text().splitlines()]


def _run(run_dir, model_dir, extra, probe, probe_dir):
    import os

    old = {k: os.environ.get(k) for k in ("GRAIL_EXP_PROBE", "GRAIL_EXP_PROBE_DIR")}
    os.environ.update(GRAIL_EXP_PROBE=f"helpers.checkpoint_probe:{probe}", GRAIL_EXP_PROBE_DIR=str(probe_dir))
    try:
        return run_scripted(run_dir, model_dir, extra)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.slow
def test_fsdp_checkpoint_write_adds_about_a_shard_of_host_memory_not_the_full_model(tmp_path, wide_model_dir):
    """Each rank's peak RSS growth across the checkpoint write (the kernel's peak mark reset just before it) stays
    below its fp32 parameter shard 4 N / W: gathering the full model (4 N) or the full optimiser state (8 N) on any rank
    exceeds it (before: rank 0 grew by about 3.5 x the full model: the model and both Adam moments gathered, then pickled)."""
    run_dir, probe_dir = tmp_path / "run", tmp_path / "probe"
    out = _run(run_dir, wide_model_dir, ["advantage=grpo", "trainer=fsdp", "trainer.accelerator=cpu",
                                         "trainer.devices=2", "trainer.checkpoint_every=1",
                                         "rollout.max_completion_length=16"], "HostMemoryProbe", probe_dir)
    assert (run_dir / "checkpoints" / "step-1" / "COMPLETE").exists(), out.stderr[-3000:]
    for rank in (0, 1):
        lines = _probe_lines(probe_dir, rank)
        before = next(x for x in lines if x["point"] == "step")
        after = next(x for x in lines if x["point"] == "checkpointed")
        growth = (after["hwm_kb"] - before["rss_kb"]) * 1024
        param_shard = before["full_param_bytes"] / 2  # 4 N / W: this rank's fp32 parameters
        print(f"rank {rank}: checkpoint peak growth {growth / 2**20:.1f} MiB; parameter shard "
              f"{param_shard / 2**20:.1f} MiB, full model {before['full_param_bytes'] / 2**20:.1f} MiB, shard state "
              f"{before['shard_bytes'] / 2**20:.1f} MiB")
        assert growth < param_shard, (f"rank {rank}'s checkpoint write grew its host memory by "
                                      f"{growth / 2**20:.0f} MiB (its fp32 parameter shard is "
                                      f"{param_shard / 2**20:.0f} MiB)")


@pytest.mark.slow
def test_fsdp_checkpoint_of_two_ranks_resumes_on_one_with_the_same_state(tmp_path, pinned_model_dir):
    """2 ranks write step 1 (at the end of a rollout batch, without the HF export: resume reads the shards); 1 rank
    resumes it: torch's full state dicts (by name) of the model and the optimiser after the restore equal those the
    2 ranks held when they wrote it; then it trains on and finishes."""
    common = ["advantage=grpo", "trainer=fsdp", "trainer.accelerator=cpu", "optim.lr=1e-3", "optim.eps=1e-8",
              "trainer.export_hf_weights=final", "trainer.save_final_checkpoint=false"]
    run_dir, probe_dir = tmp_path / "run", tmp_path / "probe"
    out = _run(run_dir, pinned_model_dir, [*common, "trainer.devices=2", "trainer.max_steps=2",
                                           "trainer.checkpoint_every=1", "trainer.keep_last_checkpoints=null"],
               "StateDigestProbe", probe_dir)
    ckpt = run_dir / "checkpoints" / "step-1"
    assert (ckpt / "COMPLETE").exists(), out.stderr[-3000:]
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "sharded").is_dir()
    assert sorted(p.name for p in ckpt.glob("rank-*.pt")) == ["rank-0.pt", "rank-1.pt"]
    written = [x for x in _probe_lines(probe_dir, 0) if x["point"] == "checkpointed" and x["step"] == 1][0]
    probe_dir2 = tmp_path / "probe2"
    out = _run(run_dir, pinned_model_dir, [*common, "trainer.devices=1", "trainer.max_steps=3",
                                           f"resume={ckpt}", "trainer.save_final_checkpoint=true"],
               "StateDigestProbe", probe_dir2)
    assert out.returncode == 0, out.stderr[-3000:]
    restored = next(x for x in _probe_lines(probe_dir2, 0) if x["point"] == "restored")
    assert restored["step"] == 1
    assert (restored["model"], restored["optimizer"]) == (written["model"], written["optimizer"])
    from transformers import AutoModelForCausalLM

    final = run_dir / "checkpoints" / "step-3"  # the final checkpoint carries the export, streamed tensor by tensor
    model = AutoModelForCausalLM.from_pretrained(final, use_safetensors=True)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
