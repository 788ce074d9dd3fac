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
from grail_exp.preflight.probe import fingerprint, problems_by_chunk, problems_by_rank
from grail_exp.preflight.report import exit_code, failure_lines, render
from helpers.preflight_run import VLLM, run_preflight
from helpers.preflight_run import check_rehearsal as _check_rehearsal

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
                         samples=8, digest="abc", problems_by_rank={"0": 2, "1": 2},
                         chunk_problems={"b/0": 2, "b/1": 2}))
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
                    dist_timeout_s=1800.0, host_baseline_bytes=0.5 * GiB, cuda=True, run_backend="nccl",
                    run_device="cuda")


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
    assert "10.00 GiB at 2 layers (engine as built 0.0 MiB, kept) -> 40.00 GiB at 8" in v["device_memory"].measured
    assert "planned 38.00 GiB (update); usable 70.00 GiB" == v["device_memory"].expected
    assert v["host_memory"].measured == ("6.00 GiB per node (2 ranks; CUDA, NCCL and engine libraries 1.00 GiB, kept) "
                                         "-> 21.00 GiB at full depth")
    assert v["checkpoint_time"].measured == "1.00 GiB in 30.0 s -> 4.00 GiB in 120 s at full depth"
    assert ">= 240 s" in v["checkpoint_time"].expected
    cpu = healthy()
    cpu.cuda = False  # a CPU rank: its resident set, the libraries' 0.5 GiB as is: 0.5 + 2.5 x 4 = 10.5 GiB
    assert "3.00 GiB at 2 layers (libraries 0.50 GiB, kept) -> 10.50 GiB at 8" in _verdicts(cpu)["device_memory"].measured


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
    if name == "uneven_evaluation":  # four chunks of one problem, three on rank 0: more than one chunk apart
        for r in (0, 1):
            rec = ev.train.at(r, "evaluated")[0]
            rec["problems_by_rank"], rec["chunk_problems"] = {"0": 3, "1": 1}, {f"b/{i}": 1 for i in range(4)}
        return ev, "eval_sharded", ""
    if name == "idle_rank_in_evaluation":  # two chunks for two ranks, both on rank 0
        for r in (0, 1):
            ev.train.at(r, "evaluated")[0]["problems_by_rank"] = {"0": 4}
        return ev, "eval_sharded", ""
    if name == "cuda_rehearsed_on_gloo":  # the run will use NCCL on CUDA; the rehearsal ran gloo on the CPU
        for run in (ev.train, ev.resume):
            for recs in run.records.values():
                for x in recs:
                    x["collectives"] = {k.replace("@cuda", "@cpu"): v for k, v in x["collectives"].items()}
                    if x["point"] == "setup":
                        x["backend"], x["device"] = "gloo", "cpu"
        return ev, "world", "trainer.accelerator"
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
          "idle_rank_in_evaluation", "cuda_rehearsed_on_gloo", "ranks_disagree_on_evaluation",
          "device_too_small", "launcher_mem_too_small", "timeout_too_short",
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
    assert problems_by_chunk(samples, 2) == {"b/0": 2, "b/1": 2, "b/2": 1}


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
@pytest.mark.slow  # ~50 s; CI keeps the same rehearsal on 2 gloo ranks with vLLM (make test-vllm, below)
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


# ---------------------------------------------------------------------------------------------- the card's numbers
# Qwen3-8B: N = 8,190,735,360 parameters, N(2 layers) = 1,630,556,672 (docs/recipes-card.md: 8.191 B / 1.631 B).
CARD_N, CARD_N2 = 8_190_735_360, 1_630_556_672
CARD_SCALE = CARD_N / CARD_N2  # 5.0233
# The paper's six benchmarks (1,242 problems) and its chunking: eval.batch_size 255 / eval.n 3 = 85 problems a chunk.
PAPER_SIZES, PAPER_PER_CALL = [500, 30, 40, 272, 200, 200], 85
PAPER = ["math500", "aime24", "amc23", "minerva_math", "college_math_200", "olympiadbench_200"]


def _card(world: int = 4) -> Evidence:
    """The card's rehearsal on one node of ``world`` H200s under NCCL, at 2 of its 36 layers (no run records)."""
    return Evidence(world=world, ranks_per_node=world, layers_run=2, layers_full=36, params_run=CARD_N2,
                    params_full=CARD_N, steps_train=2, train=RunOutcome({}, 0, 60.0), resume=None, stop={},
                    logprob_tolerance=2.0**-6, cuda=True, run_backend="nccl", run_device="cuda")


def test_the_slice_gives_every_rank_a_chunk():
    """Four problems a benchmark unless that leaves ranks without a chunk; then one problem into each benchmark's next
    chunk until there are as many chunks as ranks (or every problem is in)."""
    from grail_exp.preflight.rehearsal import eval_slice

    assert eval_slice(PAPER_SIZES, PAPER_PER_CALL, 4) == 4  # six chunks of 4 for 4 ranks
    assert eval_slice(PAPER_SIZES, PAPER_PER_CALL, 8) == 86  # 4 -> 6 chunks; 86 -> math500, minerva, college,
    # olympiad get a second chunk: 10 >= 8
    assert eval_slice([256], 128, 2) == 129  # the embedded default (eval=quick: 512 / 4): chunks of 128 and 1
    assert eval_slice([256], 2, 2) == 4  # CI's (eval.batch_size 4 / eval.n 2): two chunks of 2
    assert eval_slice([256], 128, 8) == 256  # two chunks at most: all of it


def _evaluated(world: int, owners: dict[str, int], chunk_problems: dict[str, int]) -> Evidence:
    ev = _card(world)
    by_rank: dict[str, int] = {}
    for chunk, r in owners.items():
        by_rank[str(r)] = by_rank.get(str(r), 0) + chunk_problems[chunk]
    rec = {"point": "evaluated", "tag": "final", "generated_by": owners, "samples": 3 * sum(chunk_problems.values()),
           "digest": "d", "problems_by_rank": by_rank, "chunk_problems": chunk_problems}
    ev.train.records = {r: [dict(rec, rank=r)] for r in range(world)}
    return ev


def test_the_cards_evaluation_on_4_ranks_passes():
    """The card's 4 ranks with the paper's chunking and 4 problems a benchmark: six chunks of 4, assigned by the
    longest-processing-time rule (by hand: all equal, so in order to the least loaded rank, lowest first) -> ranks
    0, 1, 2, 3, 0, 1 -> 8 / 8 / 4 / 4 problems: within one chunk. (Before, the check demanded counts within 1 and
    failed this healthy node.)"""
    from grail_exp.preflight.checks import CHECKS

    owners = {f"{b}/0": r for b, r in zip(PAPER, [0, 1, 2, 3, 0, 1])}
    result = CHECKS["eval_sharded"](_evaluated(4, owners, {f"{b}/0": 4 for b in PAPER}))
    assert result.ok is True, result
    assert result.measured.startswith("problems per rank {0: 8, 1: 8, 2: 4, 3: 4} in 6 chunks of <= 4")


def test_an_explicit_slice_with_fewer_chunks_than_ranks_is_judged_on_the_ranks_it_can_reach():
    from grail_exp.preflight.checks import CHECKS

    result = CHECKS["eval_sharded"](_evaluated(4, {"arithmetic/0": 0, "arithmetic/1": 1},
                                               {"arithmetic/0": 2, "arithmetic/1": 2}))
    assert result.ok is True and "2 rank(s) without a chunk (preflight.eval_limit)" in result.measured


def test_the_engine_share_is_kept_as_built():
    """vLLM at gpu_memory_utilization 0.2 of an H200 (141 GiB: 28.2 GiB, whatever the depth) beside 13 GiB of training
    at 2 layers: 28.2 + 13 x 5.0233 = 93.50 GiB at 36 layers, under the 131.95 GiB the planner calls usable on a 141
    GiB device. (Before, the whole 41.2 GiB was scaled: 207 GiB, and the check blamed trainer.micro_batch_size.)"""
    from grail_exp.memory import plan
    from grail_exp.preflight.checks import CHECKS
    from helpers.compose import compose

    usable = plan(compose(["model=qwen3_8b", "advantage=grail", "trainer.device_memory_gb=141"]))
    ev = _card()
    ev.device_usable_bytes = usable.capacity - usable.headroom
    assert round(ev.device_usable_bytes / GiB, 2) == 131.95
    engine = 0.2 * 141 * GiB
    ev.train.records = {r: [{"point": "setup", "rank": r, "engine_cuda_bytes": engine},
                            {"point": "step", "rank": r, "peak_cuda_bytes": engine + 13 * GiB}] for r in range(4)}
    result = CHECKS["device_memory"](ev)
    assert result.ok is True, result
    assert "41.20 GiB at 2 layers (engine as built 28.20 GiB, kept) -> 93.50 GiB at 36" in result.measured
    assert abs((28.2 + 13 * CARD_SCALE) - 93.50) < 0.005  # the hand computation above


def test_the_gpu_libraries_host_memory_is_kept_as_measured():
    """4 CUDA ranks whose resident set is 6 GiB once the weights are on the device (CUDA, NCCL, engine libraries) and
    peaks at 7 GiB: (6 + 1 x 5.0233) x 4 = 44.09 GiB = 47.3 GB per node, under a 100 GB mem_gb. (Before, only 0.6 GiB
    a rank was kept: (0.6 + 6.4 x 5.0233) x 4 = 131 GiB = 140.7 GB, over it.)"""
    from grail_exp.preflight.checks import CHECKS

    ev = _card()
    ev.launcher_mem_gb, ev.host_baseline_bytes = 100.0, 0.6 * GiB
    ev.train.records = {r: [{"point": "setup", "rank": r, "host": "node0", "peak_rss_bytes": 3 * GiB},
                            {"point": "started", "rank": r, "rss_bytes": 6 * GiB, "peak_rss_bytes": 6.5 * GiB},
                            {"point": "step", "rank": r, "rss_bytes": 6.2 * GiB, "peak_rss_bytes": 7 * GiB}]
                        for r in range(4)}
    result = CHECKS["host_memory"](ev)
    assert result.ok is True, result
    assert result.measured.endswith("-> 44.09 GiB at full depth") and "libraries 24.00 GiB, kept" in result.measured


def test_the_checkpoint_time_is_judged_against_the_runs_own_timeout(compose_cfg):
    """With trainer.dist_timeout_s null the card's run sets 2,640 s (grail_exp/timeouts.py's rule, by hand: 16 B x
    8,190,735,360 = 131.05 GB, x 2 / 100 MB/s = 2,621 s, in whole minutes 2,640 s), not torch's 1,800 s; a
    full-depth write of 1,000 s (needing 2,000 s) passes."""
    from grail_exp.preflight.checks import CHECKS
    from grail_exp.preflight.rehearsal import Rehearsal

    rehearsal = object.__new__(Rehearsal)
    rehearsal.full = compose_cfg(["model=qwen3_8b"])
    assert rehearsal.full.trainer.get("dist_timeout_s") is None
    seconds, how = rehearsal.dist_timeout()
    assert seconds == 2640 and "planned checkpoint's rule" in how
    rehearsal.full = compose_cfg(["model=qwen3_8b", "trainer.dist_timeout_s=900"])
    assert rehearsal.dist_timeout() == (900, "")
    ev = _card()
    ev.dist_timeout_s, ev.dist_timeout_how = seconds, how
    write_s = 1000 / CARD_SCALE
    ev.train.records = {r: [{"point": "step", "rank": r, "step": 2, "time": 100.0}] for r in range(4)}
    ev.train.checkpoints = {2: {"bytes": GiB, "complete_at": 100.0 + write_s}}
    result = CHECKS["checkpoint_time"](ev)
    assert result.ok is True and "= 2640 s (null: the planned checkpoint's rule" in result.expected, result


def test_the_runs_backend_and_device(compose_cfg):
    """What the run will use, from the strategy it builds: NCCL on CUDA, gloo on the CPU, the configured backend, and
    no group for one process."""
    from grail_exp.preflight.rehearsal import run_layout

    assert run_layout(compose_cfg(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"])) == ("gloo", "cpu")
    assert run_layout(compose_cfg(["trainer=fsdp_zero2"])) == ("nccl", "cuda")
    assert run_layout(compose_cfg(["trainer=ddp", "trainer.process_group_backend=gloo"])) == ("gloo", "cuda")
    assert run_layout(compose_cfg([])) == ("none", "cpu")


def test_several_nodes_are_refused_with_one_line(tmp_path):
    from grail_exp.errors import ConfigError
    from grail_exp.preflight.cli import options
    from grail_exp.preflight.rehearsal import Rehearsal

    with pytest.raises(ConfigError) as err:
        Rehearsal(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=2"], options([]),
                  tmp_path / "pf")
    assert str(err.value) == ("trainer.num_nodes=2: the preflight rehearses one node; run it on each node with "
                              "trainer.num_nodes=1 (the same trainer.devices)")
    assert not (tmp_path / "pf").exists()
