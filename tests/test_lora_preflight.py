"""The preflight under ``peft=lora``: the check that the adapter reached the engine (``lora_adapter``) on hand-made
evidence (it must fail on each way an adapter goes missing: verl #7495), and the rehearsal end to end on 2 gloo ranks
(HF generation; the card's layout with vLLM's CPU build under `-m vllm`)."""

from __future__ import annotations

import importlib.util

import pytest

from grail_exp.preflight.checks import Evidence, RunOutcome, run_checks
from helpers.preflight_run import VLLM, check_rehearsal, run_preflight

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _evidence(sync: str = "adapter", engine: str = "VLLMRolloutEngine", versions=((1, 2), (1, 2)),
              listed=None) -> Evidence:
    """Two ranks of a LoRA run; rank r's syncs used adapter versions ``versions[r]`` with the engine listing
    ``listed[r][i]`` (default: exactly the version in use)."""
    records = {}
    for r, ids in enumerate(versions):
        recs = [{"point": "setup", "rank": r, "world_size": 2, "backend": "gloo", "host": "n", "device": "cpu",
                 "engine": engine, "peft": "lora", "peft_sync": sync}]
        for i, v in enumerate(ids):
            s = {"point": "synced", "tokens": [5], "engine": [-1.0], "trainer": [-1.0]}
            if engine == "VLLMRolloutEngine" and sync == "adapter" and v is not None:
                s.update(adapter=f"policy-v{v}", adapter_id=v,
                         engine_adapters=listed[r][i] if listed is not None else [v])
            recs.append(s)
        records[r] = recs
    return Evidence(world=2, ranks_per_node=2, layers_run=1, layers_full=2, params_run=1, params_full=2, steps_train=1,
                    train=RunOutcome(records, 0, 1.0), resume=None, stop={}, logprob_tolerance=1e-3)


def _verdict(ev: Evidence):
    return {r.check: r for r in run_checks(ev, ["lora_adapter"])}["lora_adapter"]


def test_the_adapter_check_passes_when_every_sync_brings_a_new_version_the_engine_holds():
    v = _verdict(_evidence())
    assert v.ok is True and v.measured.startswith("4 syncs")


@pytest.mark.parametrize("fault, evidence", [
    ("a version reused (stale prefix cache)", dict(versions=((1, 1), (1, 2)))),
    ("the engine holds another adapter", dict(listed=(([1], [1]), ([1], [2])))),
    ("the engine holds two", dict(listed=(([1], [1, 2]), ([1], [2])))),
    ("a sync left no adapter in the engine", dict(versions=((1, None), (1, 2)))),
])
def test_the_adapter_check_fails_naming_peft_sync(fault, evidence):
    v = _verdict(_evidence(**evidence))
    assert v.ok is False and v.key == "peft.sync", fault


def test_the_adapter_check_is_not_judged_where_no_adapter_travels():
    assert _verdict(_evidence(sync="merged")).ok is None  # full weights: weight_sync judges them
    assert _verdict(_evidence(engine="HFRolloutEngine")).ok is None  # the engine samples the policy itself
    ev = _evidence()
    for recs in ev.train.records.values():
        recs[0]["peft"] = "none"
    assert _verdict(ev).ok is None


@pytest.mark.e2e
@pytest.mark.slow  # ~35-65 s; make test-vllm rehearses LoRA in the card's layout (FSDP + vLLM), lora_adapter included
def test_the_preflight_rehearses_lora_on_two_gloo_ranks_with_hf_generation(tmp_path):
    out, rows = run_preflight(tmp_path, ["trainer=ddp", "rollout=hf", "peft=lora", "peft.rank=4"])
    check_rehearsal(out, rows)  # lora_adapter n/a: the HF engine samples the live adapters


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_the_preflight_rehearses_lora_in_the_cards_layout_with_vllm(tmp_path):
    out, rows = run_preflight(tmp_path, ["trainer=fsdp_zero2", "rollout=vllm_paper", *VLLM, "peft=lora",
                                         "peft.rank=8"])
    check_rehearsal(out, rows, not_judged=())  # every check, the adapter's arrival in the engine included


@pytest.mark.e2e
def test_the_gpu_checks_lora_mode_composes_and_fits_one_card(tmp_path):
    """`bash sweeps/gpu_checks.sh lora1gpu` (one GPU, when one is lent) runs the LoRA recipe at Qwen3-8B's full depth
    with random weights; here only its composition and plan (LORA1GPU_DRY=1): LoRA on one device, 36 layers, and a
    plan that fits 79 GiB."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, LORA1GPU_DRY="1", PY=sys.executable,
               PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(["bash", str(repo / "sweeps" / "gpu_checks.sh"), "lora1gpu", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    job = OmegaConf.load(tmp_path / "lora1gpu_job.yaml")
    assert (job.peft.name, job.trainer.devices, job.trainer.strategy, job.rollout.engine) == ("lora", 1, "auto", "hf")
    assert job.model.random_init and not job.model.random_init_overrides  # the full depth
    assert " fits" in (tmp_path / "lora1gpu_plan.txt").read_text()
