"""grail_exp/validate.py: the checks by config group, the files a config names (checked before anything loads), one
world size, and the line a run logs before it builds a warm start.

Every expected message is written out here; the bad files are hand-written into tmp_path."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.compose import compose
from helpers.models import TINY_BUILD
from helpers.tolerances import HANG_TIMEOUT_S

VALIDATE_PY = Path(__file__).resolve().parent.parent / "grail_exp" / "validate.py"


def _problems(overrides: list[str], tmp_path) -> list[str]:
    """validate()'s problems, one per line (empty: the config is valid)."""
    from grail_exp.errors import ConfigError
    from grail_exp.validate import validate

    try:
        validate(compose(overrides, tmp_path))
    except ConfigError as exc:
        head, *lines = str(exc).splitlines()
        assert head == "invalid configuration:"
        return [line.removeprefix("  - ") for line in lines]
    return []


# ---------------------------------------------------------------------------------------------- the table of contents
def test_validate_is_a_table_of_contents_of_short_group_checks():
    """One function per group, none over 40 lines; validate() itself only lists them."""
    tree = ast.parse(VALIDATE_PY.read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"rollout", "loss", "precision", "trainer", "optim", "reward_and_data", "batch_tiling", "estimator",
            "scheme", "memory_plan", "files"} <= set(lengths)
    assert not {name: n for name, n in lengths.items() if n > 40}
    assert lengths["validate"] <= 15


def test_the_checks_are_imported_from_their_own_module_only():
    """The schemas (config.py) do not re-export the checks (validate.py): one import path for each."""
    from grail_exp import config

    assert not {"validate", "validate_eval", "validate_weights"} & set(vars(config))


def test_every_problem_of_several_groups_is_reported_at_once(tmp_path):
    problems = _problems(["rollout.num_generations=1", "loss.beta=-1", "optim.lr=0", "trainer.max_steps=0",
                          "reward.num_workers=-1"], tmp_path)
    assert problems[:5] == [
        "rollout.num_generations = 1: must be >= 2 (the group mean is the baseline; one sample has no baseline)",
        "loss.beta = -1.0: must be >= 0",
        "trainer.max_steps = 0: must be >= 1",
        "optim.lr = 0.0: must be > 0",
        "reward.num_workers = -1: must be >= 0",
    ]


# ---------------------------------------------------------------------------------------------- one world size
def test_the_world_size_of_a_device_list_is_its_length():
    from omegaconf import OmegaConf

    from grail_exp.world import configured_world_size

    def world(devices, nodes):
        return configured_world_size(OmegaConf.create({"devices": devices, "num_nodes": nodes}))

    assert (world([0, 1], 2), world(3, 1), world([5], 1), world(2, 3)) == (4, 3, 1, 6)


@pytest.mark.parametrize("devices", ["2", "[0,1]"])
def test_batch_tiling_counts_a_device_list_as_its_ranks(tmp_path, devices):
    """trainer.devices=[0,1] is two ranks, like trainer.devices=2: 3 prompts cannot be split between them."""
    problems = _problems(["trainer=ddp", "trainer.accelerator=cpu", f"trainer.devices={devices}",
                          "trainer.prompts_per_step=3"], tmp_path)
    assert problems[0] == ("trainer.prompts_per_step = 3: must be divisible by the data-parallel world size "
                           "trainer.devices x trainer.num_nodes = 2 (every rank samples whole groups)")


def test_a_spawned_rank_of_a_device_list_knows_its_global_rank(monkeypatch):
    """Lightning's launcher gives a spawned rank NODE_RANK and LOCAL_RANK; with devices [0, 1] per node, node 1's
    second rank is global rank 1 x 2 + 1 = 3."""
    from omegaconf import OmegaConf

    from grail_exp.distributed import launch_rank
    from grail_exp.job import export_devices_per_node

    for var in ("RANK", "SLURM_PROCID", "GRAIL_EXP_DEVICES_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    export_devices_per_node(OmegaConf.create({"devices": [0, 1], "num_nodes": 2}))
    assert launch_rank() == 3


def test_the_launching_process_of_node_k_knows_it_is_not_rank_0(monkeypatch):
    """Lightning's own launcher on several nodes: the process started on node 1 (NODE_RANK=1, no LOCAL_RANK: it is the
    one that spawns the node's other ranks) is its node's first rank, 1 x 4 = 4 with 4 devices per node — not rank 0,
    which reads the weights, opens the MLflow run and writes the files. Lightning's own rule: node rank x processes
    per node + local rank (LightningEnvironment), GROUP_RANK when NODE_RANK is unset."""
    from omegaconf import OmegaConf

    from grail_exp.distributed import launch_rank
    from grail_exp.job import export_devices_per_node

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GRAIL_EXP_DEVICES_PER_NODE", "1")  # restored after the test; export_devices_per_node sets it
    export_devices_per_node(OmegaConf.create({"devices": 4, "num_nodes": 2}))
    assert launch_rank() == 0  # node 0's launching process
    monkeypatch.setenv("NODE_RANK", "1")
    assert launch_rank() == 4
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launch_rank() == 7  # the last rank it spawned
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert launch_rank() == 7
    monkeypatch.setenv("RANK", "5")  # torchrun / srun state it: their word
    assert launch_rank() == 5


def test_a_launch_rank_that_is_not_the_groups_rank_is_one_error(monkeypatch):
    from grail_exp.distributed import check_launch_rank
    from grail_exp.errors import LayoutError

    monkeypatch.setenv("NODE_RANK", "1")
    check_launch_rank(4, 4)
    with pytest.raises(LayoutError, match=r"took itself for rank 0 .*NODE_RANK=1.* but is rank 4 of the process group"):
        check_launch_rank(0, 4)


def test_the_job_knows_its_node_before_it_opens_the_mlflow_run(tmp_path, tiny_model_dir, monkeypatch):
    """train() on the launching process of node 1 (NODE_RANK=1, trainer.devices=2): its launch rank is 2, so it opens no
    MLflow run (rank 0 alone tracks). Before, a process without LOCAL_RANK took itself for rank 0 (and the job read the
    ranks per node before exporting them)."""
    import grail_exp.job as job
    import grail_exp.tracking as tracking
    from helpers.compose import compose

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GRAIL_EXP_DEVICES_PER_NODE", "1")  # restored after the test; train() exports the real count
    monkeypatch.setenv("NODE_RANK", "1")
    opened, ranks = [], []
    monkeypatch.setattr(tracking, "build_tracker", lambda *a, **k: opened.append(a) or tracking.NullTracker())

    def stop(*a, **k):
        from grail_exp.distributed import launch_rank

        ranks.append(launch_rank())
        raise RuntimeError("stop here")

    monkeypatch.setattr(job, "build_parts", stop)
    cfg = compose([f"model.name_or_path={tiny_model_dir}", "trainer=ddp", "trainer.accelerator=cpu",
                   "trainer.devices=2", "trainer.num_nodes=2", "logger=none"], tmp_path)
    with pytest.raises(RuntimeError, match="stop here"):
        job.train(cfg)
    assert ranks == [2] and opened == []


@pytest.mark.parametrize("env, engine, accelerator, warned", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "vllm", "gpu", True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}, "vllm", "gpu", True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "vllm", "gpu", False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     "vllm", "gpu", False),  # torch reads PYTORCH_ALLOC_CONF first
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "hf", "gpu", False),  # no engine beside the trainer
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "vllm", "cpu", False),  # no CUDA allocator
])
def test_expandable_segments_beside_a_colocated_vllm_engine_are_warned(compose_cfg, caplog, monkeypatch, env, engine,
                                                                        accelerator, warned):
    import logging

    from grail_exp import validate as v

    for name in v.ALLOC_CONF_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = compose_cfg([f"rollout={engine}", f"trainer.accelerator={accelerator}"])
    with caplog.at_level(logging.WARNING, logger="grail_exp"):
        assert v.rollout(cfg) == []  # warned, never refused
    lines = [r.getMessage() for r in caplog.records if "expandable_segments" in r.getMessage()]
    assert len(lines) == warned, lines
    if warned:
        assert "rollout.engine=vllm" in lines[0] and next(iter(env)) in lines[0]


@pytest.mark.parametrize("value, ok", [("final", True), ("every", True), ("False", False), ("all", False)])
def test_export_hf_weights_is_final_or_every(compose_cfg, value, ok):
    from grail_exp.validate import trainer

    problems = [p for p in trainer(compose_cfg([f"trainer.export_hf_weights={value}"]))
                if p.startswith("trainer.export_hf_weights")]
    assert (problems == []) == ok, problems
    if not ok:
        assert problems[0].startswith(f"trainer.export_hf_weights = '{value}': must be final") and "every" in \
            problems[0]


# ---------------------------------------------------------------------------------------------- files: training data
SCRL = ["data=scrl_jsonl", "estimator=scrl"]


def _curriculum_row(k: int = 4) -> dict:
    subs = [{"question": f"Compute {j}+1.", "answer": str(j + 1)} for j in range(1, k)]
    subs.append({"question": "Compute 9+1.", "answer": "10"})
    return {"problem": "Compute 9+1.", "answer": "10", "subproblems": subs}


def test_a_missing_curriculum_file_is_one_line(tmp_path):
    assert _problems([*SCRL, "data.path=/nonexistent"], tmp_path) == [
        "data.path = '/nonexistent': no such curriculum file (one JSON object per line: problem, answer, subproblems)"]


def test_a_malformed_curriculum_line_names_the_file_and_line(tmp_path):
    bad = tmp_path / "curriculum.jsonl"
    bad.write_text(json.dumps(_curriculum_row()) + "\n{oops}\n")
    assert _problems([*SCRL, f"data.path={bad}"], tmp_path) == [
        f"data.path = '{bad}': {bad}:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"]


def test_a_curriculum_line_with_another_k_names_its_line(tmp_path):
    bad = tmp_path / "curriculum.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in (_curriculum_row(4), _curriculum_row(4), _curriculum_row(3))))
    (problem,) = _problems([*SCRL, f"data.path={bad}"], tmp_path)
    assert problem.startswith(f"data.path = '{bad}': {bad}:3: 'subproblems' has 3 entries; data.num_subproblems=4")


def test_a_good_curriculum_file_passes(tmp_path):
    good = tmp_path / "curriculum.jsonl"
    good.write_text(json.dumps(_curriculum_row()) + "\n\n" + json.dumps(_curriculum_row()) + "\n")
    assert _problems([*SCRL, f"data.path={good}"], tmp_path) == []


@pytest.mark.e2e
def test_a_missing_data_file_stops_the_run_before_the_warm_start_is_built(tmp_path):
    """As a new user: `data=scrl_jsonl data.path=<missing> estimator=scrl` needs an embedded model of its own (its
    key includes the data), which takes minutes to build; the run stops at once, before creating the cache. (The
    warm start is cut to 2 steps so that, were the check gone, this test would fail in seconds, not minutes.)"""
    proc = subprocess.run(
        [sys.executable, "-m", "grail_exp.run", *SCRL, "data.path=/nonexistent/curriculum.jsonl", "logger=none",
         f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", "model.warm_start.max_steps=2",
         "model.warm_start.eval_every=1"],
        capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GRAIL_EXP_TRACEBACK": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-2:] == [
        "error: invalid configuration:",
        "  - data.path = '/nonexistent/curriculum.jsonl': no such curriculum file (one JSON object per line: "
        "problem, answer, subproblems)"]
    assert not (tmp_path / "cache" / "embedded").exists()


def test_a_curriculum_run_on_the_embedded_model_gets_its_warm_start_spec(tmp_path):
    """Training on other data than the arithmetic task, the embedded model's warm start uses the task's defaults
    (this used to stop with AttributeError: 'DataConfigLike' object has no attribute 'get')."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.loading import embedded_build_args

    args = embedded_build_args(compose(SCRL, tmp_path))
    assert (args["task"], args["instruction"]) == (ArithmeticTask(), "")


HUB = ["data=deepmath", "data.problem_field=prompt", "data.answer_field=solution"]


def test_a_missing_local_dataset_file_is_one_line(tmp_path):
    assert _problems([*HUB, f"data.path={tmp_path}/train.jsonl"], tmp_path) == [
        f"data.path = '{tmp_path}/train.jsonl': no such file"]
    assert _problems([*HUB, f"data.path={tmp_path}/no_dir"], tmp_path) == [
        f"data.path = '{tmp_path}/no_dir': no such directory"]


def test_a_dataset_row_without_its_field_names_the_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "Compute 1+1.", "solution": "2"}\n'
                 '{"prompt": "Compute 1+2.", "solution": "3"}\n'
                 '{"prompt": "Compute 1+3.", "answer": "4"}\n')
    assert _problems([*HUB, f"data.path={f}"], tmp_path) == [
        f"data.path = '{f}': {f}:3: no field 'solution' (data.problem_field / data.answer_field)"]


def test_a_malformed_dataset_line_names_the_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text('{"prompt": "Compute 1+1.", "solution": "2"}\n["a list"]\n')
    assert _problems([*HUB, f"data.path={f}"], tmp_path) == [
        f"data.path = '{f}': {f}:2: expected a JSON object, got list"]


def test_a_json_array_dataset_passes_and_a_broken_one_names_its_line(tmp_path):
    good = tmp_path / "train.json"
    good.write_text('[{"prompt": "Compute 1+1.", "solution": "2"},\n {"prompt": "Compute 1+2.", "solution": "3"}]\n')
    assert _problems([*HUB, f"data.path={good}"], tmp_path) == []
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "Compute 1+1.", "solution": "2"},\n {"prompt": "Compute 1+2." "solution": "3"}]\n')
    assert _problems([*HUB, f"data.path={bad}"], tmp_path) == [
        f"data.path = '{bad}': {bad}:2: not valid JSON (Expecting ',' delimiter at column 28)"]


def test_a_dataset_that_is_not_parquet_or_lacks_a_csv_column_is_one_line(tmp_path):
    fake = tmp_path / "train.parquet"
    fake.write_text("not parquet at all\n")
    (problem,) = _problems([*HUB, f"data.path={fake}"], tmp_path)
    assert problem.startswith(f"data.path = '{fake}': {fake}: not a readable Parquet file (")
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\nCompute 1+1.,2\n")
    assert _problems([*HUB, f"data.path={csv}"], tmp_path) == [
        f"data.path = '{csv}': {csv}:1: no field 'solution' (data.problem_field / data.answer_field)"]


# ---------------------------------------------------------------------------------------------- files: model, benchmark, resume
def test_a_local_model_directory_without_a_config_or_with_a_broken_one(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    assert _problems([f"model.name_or_path={empty}"], tmp_path) == [
        f"model.name_or_path = '{empty}': no Hugging Face model there (expected {empty}/config.json); point it at a "
        "directory written by save_pretrained (e.g. a run's checkpoints/step-N/)"]
    (empty / "config.json").write_text('{\n  "model_type": "qwen3",\n  "hidden_size": 64,,\n}\n')
    assert _problems([f"model.name_or_path={empty}"], tmp_path) == [
        f"model.name_or_path = '{empty}': {empty}/config.json:3: invalid JSON: Expecting property name enclosed in "
        "double quotes"]


def test_a_missing_tokenizer_directory_and_architecture_file(tmp_path):
    assert _problems([f"model.tokenizer_name_or_path={tmp_path}/tok"], tmp_path) == [
        f"model.tokenizer_name_or_path = '{tmp_path}/tok': no such directory"]
    (problem,) = _problems([f"model.architecture={tmp_path}/arch.json"], tmp_path)
    assert problem.startswith(f"model.architecture='{tmp_path}/arch.json': not a shipped architecture (")


def test_a_malformed_benchmark_file_names_the_file_and_line(tmp_path, monkeypatch):
    import dataclasses

    from grail_exp.data import benchmarks

    spec = dataclasses.replace(benchmarks.PAPER_BENCHMARKS["aime24"], data_dir=tmp_path)
    rows = [json.dumps({"problem": f"Compute {i}+1.", "answer": str(i + 1)}) for i in range(30)]
    rows[6] = '{"problem": "Compute 6+1.", "answer": 7'  # 39 characters, cut short: ',' or '}' expected at column 40
    (tmp_path / "aime24.jsonl").write_text("\n".join(rows) + "\n")
    monkeypatch.setitem(benchmarks.PAPER_BENCHMARKS, "aime24", spec)
    assert _problems(["benchmark=aime24"], tmp_path) == [
        f"benchmark.names = 'aime24': {tmp_path}/aime24.jsonl:7: not valid JSON (Expecting ',' delimiter at column 40)"]


def test_a_resume_directory_that_is_not_a_checkpoint(tmp_path):
    assert _problems([f"resume={tmp_path}/step-5"], tmp_path) == [
        f"resume = '{tmp_path}/step-5': not a complete checkpoint directory (expected {tmp_path}/step-5/COMPLETE); "
        "use resume=auto or a checkpoints/step-N directory"]


def test_each_bad_file_is_its_own_line(tmp_path):
    assert _problems([*SCRL, "data.path=/nonexistent", f"resume={tmp_path}/nope"], tmp_path) == [
        "data.path = '/nonexistent': no such curriculum file (one JSON object per line: problem, answer, subproblems)",
        f"resume = '{tmp_path}/nope': not a complete checkpoint directory (expected {tmp_path}/nope/COMPLETE); "
        "use resume=auto or a checkpoints/step-N directory"]


def test_the_weights_entry_point_checks_its_rollouts_file_before_the_model(tmp_path):
    from grail_exp.errors import ConfigError
    from grail_exp.validate import validate_weights

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "Compute 1+1.", "completion": "2", "advantage": 1.0}\n{"prompt": \n')
    cfg = compose([f"input={rows}", f"output={tmp_path}/w.json"], tmp_path, config_name="weights")
    with pytest.raises(ConfigError) as info:
        validate_weights(cfg)
    assert str(info.value) == (f"invalid configuration:\n  - input = '{rows}': {rows}:2: not valid JSON "
                               "(Expecting value at column 12)")


# ---------------------------------------------------------------------------------------------- warm starts announced
def test_a_warm_start_build_is_announced_with_its_expected_duration(tmp_path, monkeypatch, caplog):
    """Logged before the warm start begins. Expected durations by hand from the shipped build's record (434,688
    parameters, 950 steps of 64 in 673.65 s: 0.70911 s per step): the same model and batch, stopping after 950
    steps = 674 s (~11 min), at most 3000 steps = 2127 s (~35 min); batch 32 halves a step, up to 100 steps = 35 s."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models import embedded

    shipped = json.loads((embedded.SHIPPED_DIR / "tiny" / "grail_exp_build.json").read_text())
    assert (shipped["parameters"], shipped["warm_start"]["steps"], round(shipped["warm_start"]["seconds"], 2),
            shipped["spec"]["warm_start"]["batch_size"]) == (434_688, 950, 673.65, 64)
    announced = []

    def no_training(*args, **kwargs):  # the line must already be there when the warm start begins
        announced.extend(r.getMessage() for r in caplog.records if "first builds it" in r.getMessage())
        return {}

    monkeypatch.setattr(embedded, "warm_start", no_training)
    build = json.loads((embedded.SHIPPED_DIR / "tiny" / "grail_exp_manifest.json").read_text())["spec"]["build"]
    warm = dict(enabled=True, lr=3e-3, batch_size=64, warmup_steps=20, max_steps=3000, eval_every=50,
                eval_problems=128, target_accuracy=0.35)
    with caplog.at_level(logging.INFO, logger="grail_exp.models.embedded"):
        embedded.ensure_embedded_model(build, warm, ArithmeticTask(), {"enable_thinking": False}, "",
                                       tmp_path / "cache", use_shipped=False)
    (line,) = announced
    assert "a warm start of up to 3000 SFT steps of 64 problems (until greedy validation accuracy 0.35), expected " \
           "~11 min, at most ~35 min (the shipped build of 434,688 parameters: 950 steps of 64 in 674 s" in line
    assert ", expected ~35 s, at most ~35 s (" in embedded.warm_start_estimate(
        434_688, {**warm, "batch_size": 32, "max_steps": 100})


def test_a_cold_start_build_is_announced_with_its_expected_duration(tmp_path, tiny_model_dir, monkeypatch, caplog):
    """The tiny test model has 94,464 parameters (2 layers x (attention 12,288 + MLP 24,576 + norms 160) + embedding
    318 tokens x 64 = 20,352 + final norm 64, tied head); 4,000 steps x 64 problems from SmolLM2-135M's measured
    15.75 s per step of 8 (134,515,008 parameters): 4000 x 15.75 x 94,464 / 134,515,008 x 64 / 8 = 354 s (~6 min)."""
    from grail_exp.models import cold_start
    from grail_exp.models.loading import load_causal_lm, load_tokenizer

    assert TINY_BUILD["hidden_size"] == 64 and TINY_BUILD["num_layers"] == 2  # the count above
    announced = []

    def no_training(base_dir, cfg, tokenizer, out, load_causal_lm):
        announced.extend(r.getMessage() for r in caplog.records if "first builds it" in r.getMessage())
        Path(out).mkdir(parents=True)
        return {"seconds": 0.0, "losses": [1.0]}

    monkeypatch.setattr(cold_start, "train", no_training)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = compose([f"model.name_or_path={tiny_model_dir}", "model.cold_start.enabled=true",
                   "model.cold_start.steps=4000", "model.cold_start.batch_size=64"], tmp_path)
    with caplog.at_level(logging.INFO, logger="grail_exp.models.cold_start"):
        cold_start.ensure_cold_start(str(tiny_model_dir), cfg, load_tokenizer, load_causal_lm)
    (line,) = announced
    assert "4000 AdamW steps x 64 problems on the CPU, expected ~6 min (94,464 parameters; " in line
