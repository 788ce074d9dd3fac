"""`python -m grail_exp.preflight`: the checks, the table and the exit code on hand-made evidence (each check must fail
when its fault is in the records), and the rehearsal end to end on 2 gloo ranks (HF generation; vLLM's CPU build
under `-m vllm`)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grail_exp.preflight.checks import Evidence, RunOutcome, backend_devices, run_checks
from grail_exp.preflight.probe import fingerprint, problems_by_rank
from grail_exp.preflight.report import exit_code, failure_lines, render

from helpers.preflight_run import VLLM, check_rehearsal as _check_rehearsal, run_preflight

GiB = 2**30
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "grail_exp" / "data" / "embedded" / "tiny"


# ---------------------------------------------------------------------------------------------- hand-made evidence
def _rank_records(r: int, backend: str, device_op: str, steps: list[int], started: int, weights: dict, t0: float,
                  evaluated: bool) -> list[dict]:
    base = {"rank": r, "peak_rss_bytes": 3 * GiB, "peak_cuda_bytes": 10 * GiB,
            "collectives": {f"all_reduce_sum@{device_op}": 4, f"barrier@{device_op}": 1}}
    recs = [dict(base, point="setup", time=t0, world_size=2, backend=backend, pid=100 + r, host="node0",
                 device=f"cuda:{r}", local_rank=str(r), engine="HFRolloutEngine"),
            dict(base, point="started", time=t0 + 1, step=started, weights=weights[started]),
            dict(base, point="synced", time=t0 + 2, tokens=[5, 6, 7], engine=[-1.0, -2.0, -0.5],
                 trainer=[-1.0002, -2.0, -0.5])]
    recs += [dict(base, point="step", time=t0 + 10 * s, step=s, weights=weights[s]) for s in steps]
    if evaluated:
        recs.append(dict(base, point="evaluated", time=t0 + 100, tag="final", generated_by={"b/0": 0, "b/1": 1},
                         samples=8, digest="abc", problems_by_rank={"0": 2, "1": 2}))
    return recs


def healthy() -> Evidence:
    """Two CUDA ranks on one node under NCCL; the training run (2 steps) and the resumed run stopped at step 3."""
    weights = {0: "w0", 1: "w1", 2: "w2", 3: "w3"}
    train = RunOutcome({r: _rank_records(r, "nccl", "cuda", [1, 2], 0, weights, 1000.0, True) for r in (0, 1)}, 0,
                       60.0, {2: {"bytes": 1 * GiB, "complete_at": 1000.0 + 20 + 30}})  # 30 s after the last step
    resume = RunOutcome({r: _rank_records(r, "nccl", "cuda", [3], 2, weights, 2000.0, False) for r in (0, 1)}, 143,
                        40.0, {3: {"bytes": 1 * GiB, "complete_at": 2035.0}})
    stop = {"rank": 1, "step": 3, "pid": 101, "sent_at": 2030.0, "started_at": 2000.0, "bound_s": 60.0}
    return Evidence(world=2, ranks_per_node=2, layers_run=2, layers_full=8, params_run=2_000_000_000,
                    params_full=8_000_000_000, steps_train=2, train=train, resume=resume, stop=stop,
                    logprob_tolerance=1e-3, planned_device_bytes=38 * GiB, planned_peak_phase="update",
                    device_usable_bytes=70 * GiB, planned_host_node_bytes=20 * GiB, launcher_mem_gb=64.0,
                    dist_timeout_s=1800.0, host_baseline_bytes=0.5 * GiB, cuda=True)


def _verdicts(ev: Evidence) -> dict:
    return {r.check: r for r in run_checks(ev)}


def test_a_healthy_rehearsal_passes_every_check_and_exits_0():
    results = run_checks(healthy())
    assert [r.check for r in results] == ["world", "collective_devices", "weight_sync", "checkpoint_roundtrip", "resume",
                                          "stop_signal", "eval_sharded", "device_memory", "host_memory",
                                          "checkpoint_time", "lora_adapter"]
    assert [r.check for r in results if r.ok is not True] == ["lora_adapter"]  # n/a: full fine-tuning
    assert exit_code(results) == 0
    text = render(results)
    assert text.splitlines()[0] == "| check | result | measured | expected / planned |"
    assert len([x for x in text.splitlines() if x.startswith("| ") and "| PASS |" in x]) == 10
    assert text.endswith("preflight: every check passed")


def test_the_extrapolation_to_full_depth_by_hand():
    """N(8) / N(2) = 8 B / 2 B = 4: device 10 GiB -> 40 GiB; host: 2 ranks x 3 GiB = 6 GiB per node, the libraries'
    2 x 0.5 GiB as is, the rest x 4: 1 + 5 x 4 = 21 GiB; checkpoint 1 GiB in 30 s -> 4 GiB in 120 s, needs 240 s."""
    v = _verdicts(healthy())
    assert "10.00 GiB at 2 layers -> 40.00 GiB at 8" in v["device_memory"].measured
    assert "planned 38.00 GiB (update); usable 70.00 GiB" == v["device_memory"].expected
    assert "6.00 GiB per node (2 ranks) -> 21.00 GiB at full depth" == v["host_memory"].measured
    assert v["checkpoint_time"].measured == "1.00 GiB in 30.0 s -> 4.00 GiB in 120 s at full depth"
    assert ">= 240 s" in v["checkpoint_time"].expected
    cpu = healthy()
    cpu.cuda = False  # a CPU rank: its resident set, the libraries' 0.5 GiB as is: 0.5 + 2.5 x 4 = 10.5 GiB
    assert "3.00 GiB at 2 layers -> 10.50 GiB at 8" in _verdicts(cpu)["device_memory"].measured


def _fault(name: str):
    """Each fault, written into the healthy evidence: (evidence, the check that must fail, the key it must name)."""
    ev = healthy()
    if name == "cpu_collective_on_nccl":
        ev.train.records[1][-1]["collectives"] = {"all_reduce_sum@cpu": 1, "barrier@cuda": 1}
        return ev, "collective_devices", ""
    if name == "no_collective":
        for run in (ev.train, ev.resume):
            for recs in run.records.values():
                for x in recs:
                    x["collectives"] = {}
        return ev, "collective_devices", ""
    if name == "stale_engine":
        ev.train.at(0, "synced")[0]["engine"] = [-1.0, -2.1, -0.5]  # 0.1 / 3 = 3e-2 > 1e-3
        return ev, "weight_sync", "rollout.vllm.sync_chunk_mb"
    if name == "checkpoint_differs":
        ev.resume.at(1, "started")[0]["weights"] = "other"
        return ev, "checkpoint_roundtrip", "resume"
    if name == "no_checkpoint":
        ev.train.checkpoints = {}
        return ev, "checkpoint_roundtrip", "trainer.save_final_checkpoint"
    if name == "resumed_from_scratch":
        for r in (0, 1):
            ev.resume.at(r, "started")[0]["step"] = 0
        return ev, "resume", "resume"
    if name == "stop_hangs":
        ev.resume.returncode, ev.resume.checkpoints = None, {}
        return ev, "stop_signal", ""
    if name == "stop_on_different_steps":
        ev.resume.records[0].append(dict(ev.resume.at(0, "step")[0], step=4))
        return ev, "stop_signal", ""
    if name == "uneven_evaluation":
        for r in (0, 1):
            ev.train.at(r, "evaluated")[0]["problems_by_rank"] = {"0": 3, "1": 1}
        return ev, "eval_sharded", "eval.batch_size"
    if name == "ranks_disagree_on_evaluation":
        ev.train.at(1, "evaluated")[0]["digest"] = "xyz"
        return ev, "eval_sharded", ""
    if name == "device_too_small":
        ev.device_usable_bytes = 39 * GiB  # 40 GiB at full depth
        return ev, "device_memory", "trainer.micro_batch_size"
    if name == "launcher_mem_too_small":
        ev.launcher_mem_gb = 20.0  # 21 GiB = 22.5 GB at full depth
        return ev, "host_memory", "hydra.launcher.mem_gb"
    if name == "timeout_too_short":
        ev.dist_timeout_s = 239.0  # needs 240 s
        return ev, "checkpoint_time", "trainer.dist_timeout_s"
    if name == "two_ranks_one_device":
        ev.train.at(1, "setup")[0]["device"] = "cuda:0"
        return ev, "world", "trainer.devices"
    raise KeyError(name)


FAULTS = ["cpu_collective_on_nccl", "no_collective", "stale_engine", "checkpoint_differs", "no_checkpoint",
          "resumed_from_scratch", "stop_hangs", "stop_on_different_steps", "uneven_evaluation",
          "ranks_disagree_on_evaluation", "device_too_small", "launcher_mem_too_small", "timeout_too_short",
          "two_ranks_one_device"]


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_fails_its_check_and_names_the_key(fault):
    ev, check, key = _fault(fault)
    results = run_checks(ev)
    failed = [r.check for r in results if r.ok is False]
    assert failed == [check], failed
    assert exit_code(results) == 1
    (line,) = failure_lines(results)
    assert line.startswith(f"FAIL {check}: ")
    assert line.endswith(f"fix: set {key}" if key else "fix: no config key (a fault of the code or the cluster)")
    assert f"| {check} | FAIL |" in render(results)


def test_a_check_without_its_evidence_fails_instead_of_crashing():
    ev = healthy()
    ev.train.records[0] = [x for x in ev.train.records[0] if x["point"] != "setup"]
    v = _verdicts(ev)
    assert v["world"].ok is False


def test_the_backends_devices():
    assert backend_devices("nccl") == {"cuda"} and backend_devices("gloo") == {"cpu"}
    assert backend_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}


def test_problems_per_rank_from_the_chunks():
    """2 problems per chunk (eval.batch_size 4 / n 2): problems 0-1 chunk 0 (rank 0), 2-3 chunk 1 (rank 1), 4 chunk 2
    (rank 0); two samples each."""
    samples = [{"benchmark": "b", "problem_index": i, "sample_index": j} for i in range(5) for j in range(2)]
    assert problems_by_rank(samples, {"b/0": 0, "b/1": 1, "b/2": 0}, 2) == {"0": 3, "1": 2}


def test_the_weights_fingerprint_sees_one_changed_value():
    a = [("w", torch.arange(10, dtype=torch.float32).reshape(2, 5)), ("b", torch.ones(3))]
    b = copy.deepcopy(a)
    assert fingerprint(a) == fingerprint(b)
    b[0][1][1, 2] += 2.0**-20
    assert fingerprint(a) != fingerprint(b)
    swapped = [("w", a[0][1].flip(1)), a[1]]  # the same values in another order
    assert fingerprint(a) != fingerprint(swapped)


# ---------------------------------------------------------------------------------------------- options and shrinking
def test_the_preflight_options_and_the_shrunk_command(compose_cfg):
    from grail_exp.errors import ConfigError
    from grail_exp.preflight.cli import options, split_argv
    from grail_exp.preflight.rehearsal import shrink_overrides

    run, mine = split_argv(["model=qwen3_8b", "preflight.layers=3", "advantage=grail"])
    assert run == ["model=qwen3_8b", "advantage=grail"] and options(mine).layers == 3
    with pytest.raises(ConfigError, match=r"preflight\.rounds"):
        options(["preflight.rounds=0"])
    assert shrink_overrides(compose_cfg(["model=qwen3_8b"]), 3) == [
        "model.random_init=true", "model.random_init_overrides={num_hidden_layers: 3}"]
    assert shrink_overrides(compose_cfg(["model=qwen3_8b"]), None) == []
    assert shrink_overrides(compose_cfg([]), 1) == []  # the embedded model (model.build) runs as configured
    tiny = shrink_overrides(compose_cfg([f"model.name_or_path={MODEL}"]), 1)  # per-layer lists keep one per layer
    assert tiny == ["model.random_init=true", 'model.random_init_overrides={num_hidden_layers: 1, layer_types: '
                    '["full_attention"]}', f"model.tokenizer_name_or_path={MODEL}"]


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_the_preflight_rehearses_two_gloo_ranks_with_hf_generation(tmp_path):
    _check_rehearsal(*run_preflight(tmp_path, ["trainer=ddp", "rollout=hf"]))


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here: `make test-vllm` runs these in .venv-vllm")
def test_the_preflight_rehearses_the_cards_layout_with_vllm(tmp_path):
    _check_rehearsal(*run_preflight(tmp_path, ["trainer=fsdp_zero2", "rollout=vllm_paper", *VLLM]))


def test_one_process_without_a_group_has_no_collectives_to_judge():
    ev = healthy()
    for run in (ev.train, ev.resume):
        for recs in run.records.values():
            for x in recs:
                x["collectives"] = {}
                if x["point"] == "setup":
                    x["backend"] = "none"
    assert _verdicts(ev)["collective_devices"].ok is None


@pytest.mark.e2e
def test_the_gpu_checks_preflight_mode_composes(tmp_path):
    """`bash sweeps/gpu_checks.sh preflight` (on one GPU) runs the card's command through the preflight under
    trainer=fsdp_zero2 and trainer=ddp at one device with HF generation; here only its compositions
    (PREFLIGHT_DRY=1)."""
    from omegaconf import OmegaConf

    env = dict(os.environ, PREFLIGHT_DRY="1", PY=sys.executable,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(["bash", str(REPO / "sweeps" / "gpu_checks.sh"), "preflight", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for trainer, strategy in (("fsdp_zero2", "fsdp"), ("ddp", "ddp")):
        job = OmegaConf.load(tmp_path / f"preflight_{trainer}_job.yaml")
        assert (job.trainer.strategy, job.trainer.devices, job.trainer.accelerator) == (strategy, 1, "gpu")
        assert job.rollout.engine == "hf" and job.model.name == "qwen3_8b" and job.advantage.name == "grail"


@pytest.mark.e2e
def test_a_wrong_option_is_refused_before_anything_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "grail_exp.preflight", "preflight.rounds=0", f"preflight.dir={tmp_path}/pf"],
                         env=env, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "preflight.rounds" in out.stderr, out.stderr
    assert not (tmp_path / "pf").exists()


def test_a_run_config_the_run_would_refuse_is_refused_before_anything_runs(tmp_path):
    from grail_exp.errors import ConfigError
    from grail_exp.preflight.cli import main

    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_size"):
        main(["trainer.micro_batch_size=0", f"preflight.dir={tmp_path}/pf"])
    assert not (tmp_path / "pf").exists()
