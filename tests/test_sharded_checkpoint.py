"""The per-rank checkpoint layout in one process: the streamed HF export, the refusals before any model loads, the
ranks' agreement on the resume point, older checkpoints, LOCAL_RANK under srun. The multi-rank halves are in
tests/e2e/test_sharded_checkpoint_runs.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grail_exp.checkpoint import CheckpointError, load_rank_state, load_training_state
from helpers.compose import compose
from helpers.fakes import AlternatingVerifier


def _cfg(run_dir: Path, model_dir, extra=()):
    return compose([f"model.name_or_path={model_dir}", f"paths.output_dir={run_dir}", "trainer.prompts_per_step=4",
                    "trainer.micro_batch_size=16", "rollout.num_generations=4", "rollout.max_completion_length=40",
                    "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                    "logger=none", "advantage=grpo", *extra], run_dir.parent)


def test_streamed_safetensors_equal_the_library_writer(tmp_path):
    """The header and bytes written one tensor at a time load, with safetensors' own reader, as the same tensors its
    own writer stores (dtypes, shapes, scalars and odd sizes included)."""
    from grail_exp.checkpoint import write_safetensors_streaming

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
               "c.scalar": torch.tensor(2.5, dtype=torch.float16), "d.ids": torch.arange(6).reshape(2, 3),
               "e.mask": torch.tensor([True, False, True])}
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_safetensors_streaming(tmp_path / "streamed.safetensors", specs, iter(tensors.items()))
    save_file(tensors, tmp_path / "reference.safetensors")
    got, want = load_file(tmp_path / "streamed.safetensors"), load_file(tmp_path / "reference.safetensors")
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_streamed_export_refuses_a_tensor_that_differs_from_its_header(tmp_path):
    from grail_exp.checkpoint import write_safetensors_streaming

    with pytest.raises(CheckpointError, match="does not match"):
        write_safetensors_streaming(tmp_path / "x.safetensors", [("w", torch.float32, (2,))],
                                    iter([("w", torch.zeros(3))]))


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory, tiny_model_dir):
    """A single-process run's step-1 checkpoint (its run directory; the tests only read it)."""
    import grail_exp.grading.rewards
    from grail_exp.run import run

    run_dir = tmp_path_factory.mktemp("one_rank") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
        run(_cfg(run_dir, tiny_model_dir, ["trainer.max_steps=1"]))
    return run_dir


@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_another_world_size_is_refused_before_any_model_loads(one_rank_checkpoint, tiny_model_dir, monkeypatch,
                                                              trainer):
    """A 1-rank checkpoint resumed by 2 ranks: one line naming trainer.devices, raised before the policy is loaded
    (before: an IndexError in the rank's part after the model had loaded). Under FSDP too: a checkpoint written by
    another strategy has no shards to reshard."""
    import grail_exp.models.loading
    from grail_exp.run import run

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the resume point was checked")

    monkeypatch.setattr(grail_exp.models.loading, "load_causal_lm", no_model)
    cfg = _cfg(one_rank_checkpoint, tiny_model_dir, ["trainer.max_steps=2", "resume=auto", f"trainer={trainer}",
                                                     "trainer.accelerator=cpu", "trainer.devices=2"])
    with pytest.raises(CheckpointError) as err:
        run(cfg)
    msg = str(err.value)
    assert "trainer.devices" in msg and "1 data-parallel rank" in msg and "\n" not in msg


def test_ranks_that_resolved_different_checkpoints_are_refused_naming_the_paths(monkeypatch):
    """resume=auto on nodes that do not share the run directory: every rank's resolved step is gathered; when they
    differ, one error lists each rank's checkpoint."""
    from grail_exp import world
    from grail_exp.training import state as run_state

    views = [(4, "/shared/run/checkpoints/step-4"), (None, None)]
    monkeypatch.setattr(world, "gather_to_all", lambda obj: views)
    with pytest.raises(CheckpointError, match=r"rank 0: /shared/run/checkpoints/step-4; rank 1: no checkpoint"):
        run_state.check_same_resume_point({"step": 4, "checkpoint_dir": "/shared/run/checkpoints/step-4"})
    same = [(4, "/a/checkpoints/step-4"), (4, "/mnt/a/checkpoints/step-4")]  # one filesystem, two mount points
    monkeypatch.setattr(world, "gather_to_all", lambda obj: same)
    run_state.check_same_resume_point({"step": 4, "checkpoint_dir": "/a/checkpoints/step-4"})


def _to_older_layout(ckpt: Path) -> None:
    """Rewrite a per-rank checkpoint of one process into the layout before it (every rank's part in the shared file)."""
    state = load_training_state(ckpt)
    state.pop("format")
    state["ranks"] = [load_rank_state(ckpt, 0)]
    (ckpt / "rank-0.pt").unlink()
    # A new file renamed over the old one: the loaded state is memory-mapped from it, and truncating a mapped file
    # in place would pull the pages from under it (SIGBUS).
    torch.save(state, ckpt / "training_state.pt.new")
    os.replace(ckpt / "training_state.pt.new", ckpt / "training_state.pt")


def test_a_checkpoint_of_the_older_layout_still_resumes_exactly(tmp_path, formatted_model_dir, monkeypatch):
    """2 steps, the checkpoint rewritten into the older layout, resume + 2 steps == 4 straight steps."""
    import grail_exp.grading.rewards
    from grail_exp.run import run

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    straight, split = tmp_path / "straight" / "run", tmp_path / "split" / "run"
    run(_cfg(straight, formatted_model_dir, ["trainer.max_steps=4"]))
    run(_cfg(split, formatted_model_dir, ["trainer.max_steps=2"]))
    _to_older_layout(split / "checkpoints" / "step-2")
    run(_cfg(split, formatted_model_dir, ["trainer.max_steps=4", "resume=auto"]))
    a = load_file(straight / "checkpoints" / "step-4" / "model.safetensors")
    b = load_file(split / "checkpoints" / "step-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def launcher_env(monkeypatch):
    """The launcher variables cleared for the test and restored after it (``export_local_rank`` sets LOCAL_RANK itself,
    which monkeypatch would not undo; a leaked one makes Lightning think the ranks were launched outside it)."""
    saved = {k: os.environ.get(k) for k in ("SLURM_LOCALID", "SLURM_NTASKS", "SLURM_PROCID", "LOCAL_RANK")}
    for k in saved:
        os.environ.pop(k, None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("env, want", [
    ({"SLURM_LOCALID": "3", "SLURM_NTASKS": "8"}, "3"),  # srun, one task per device
    ({"SLURM_LOCALID": "3", "SLURM_NTASKS": "8", "LOCAL_RANK": "1"}, "1"),  # torchrun / Lightning set it: kept
    ({"SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, None),  # one task: Lightning spawns the ranks and sets it
    ({}, None),
])
def test_local_rank_comes_from_the_launchers_environment(launcher_env, env, want):
    from grail_exp.distributed import export_local_rank

    os.environ.update(env)
    export_local_rank()
    assert os.environ.get("LOCAL_RANK") == want


def test_the_job_sets_local_rank_before_building_anything(tmp_path, tiny_model_dir, monkeypatch, launcher_env):
    """Under srun (SLURM_LOCALID, several tasks) LOCAL_RANK is set when the job builds its parts (DeepSpeed's engine
    and vLLM's external launcher read it later)."""
    import grail_exp.job as job
    from grail_exp.run import run

    seen = {}

    def stop(*a, **k):
        seen["LOCAL_RANK"] = os.environ.get("LOCAL_RANK")
        raise RuntimeError("stop here")

    os.environ.update(SLURM_LOCALID="0", SLURM_NTASKS="2", SLURM_PROCID="0")
    monkeypatch.setattr(job, "build_parts", stop)
    with pytest.raises(RuntimeError, match="stop here"):
        run(_cfg(tmp_path / "run", tiny_model_dir, ["trainer.max_steps=1"]))
    assert seen["LOCAL_RANK"] == "0"
