"""Every config option composes; impossible values are rejected naming the key; wrong options list the valid ones."""

import subprocess
import sys
from pathlib import Path

import pytest

from grail_exp.config import ConfigError
from grail_exp.validate import validate
from helpers.tolerances import HANG_TIMEOUT_S

CONF = Path(__file__).parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "advantage", "data", "benchmark", "rollout", "trainer", "logger", "eval"])
def test_every_group_option_composes_and_validates(compose_cfg, group):
    assert options(group), f"no options in conf/{group}"
    for opt in options(group):
        cfg = compose_cfg([f"{group}={opt}"])
        validate(cfg)  # hub models validate too: nothing is loaded here


def test_every_experiment_composes(compose_cfg):
    experiments = sorted(str(p.relative_to(CONF / "experiment").with_suffix("")) for p in (CONF / "experiment").rglob("*.yaml"))
    assert experiments, "no experiment files"
    for opt in experiments:
        validate(compose_cfg([f"experiment={opt}"]))


def test_paper_recipe_reproduces_the_reference_prompt_bytes(compose_cfg):
    cfg = validate(compose_cfg(["experiment=paper/qwen3_4b_grail"]))
    assert cfg.data.instruction.endswith("within \x08oxed{}.")  # the reference's backspace (spec §11.13)
    assert cfg.benchmark.olympiad_gold == "str" and cfg.loss.num_iterations == 4 and cfg.optim.lr == 1e-6
    assert cfg.model.name_or_path == "Qwen/Qwen3-4B" and cfg.advantage.symmetry == "wrong"
    assert cfg.optimized_metric == "eval/avg/acc"


def test_debug_fast_composes(compose_cfg):
    cfg = validate(compose_cfg(["debug=fast"]))
    assert cfg.trainer.max_steps == 2


@pytest.mark.parametrize("override, key", [
    ("rollout.num_generations=1", "rollout.num_generations"),
    ("loss.epsilon=-0.1", "loss.epsilon"),
    ("loss.epsilon_high=-1", "loss.epsilon_high"),
    ("rollout.max_completion_length=0", "rollout.max_completion_length"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("rollout.top_k=-1", "rollout.top_k"),
    ("loss.scale_rewards=std", "loss.scale_rewards"),
    ("loss.loss_type=ppo", "loss.loss_type"),
    ("loss.beta=-0.01", "loss.beta"),
    ("loss.num_iterations=0", "loss.num_iterations"),
    ("optim.lr=0", "optim.lr"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("optim.max_grad_norm=0", "optim.max_grad_norm"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("trainer.prompts_per_step=0", "trainer.prompts_per_step"),
    ("trainer.micro_batch_size=0", "trainer.micro_batch_size"),
    ("trainer.micro_batch_size=48", "trainer.micro_batch_size"),  # does not divide 16 x 8
    ("trainer.max_nonfinite_in_a_row=0", "trainer.max_nonfinite_in_a_row"),
    ("eval.n=0", "eval.n"),
    ("eval.temperature=-1", "eval.temperature"),
    ("eval.temperature=0", "eval.n"),  # greedy needs n = 1
    ("eval.max_tokens=0", "eval.max_tokens"),
    ("eval.top_p=0", "eval.top_p"),
    ("benchmark.limit=0", "benchmark.limit"),
    ("model.dtype=float8", "model.dtype"),
    ("model.prompt_style=fancy", "model.prompt_style"),
    ("model.cpu_explicit_attention_max_scores=-1", "model.cpu_explicit_attention_max_scores"),
    ("reward.hard_timeout_s=0", "reward.hard_timeout_s"),
    ("reward.num_workers=-1", "reward.num_workers"),
    ("data.name=nope", "data.name"),
    ("benchmark.names=[nope]", "benchmark.names"),
    ("advantage.name=nope", "advantage.name"),
])
def test_impossible_values_name_the_key(compose_cfg, override, key):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg([override]))
    assert key in str(err.value)


def test_all_errors_reported_at_once(compose_cfg):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["rollout.num_generations=1", "loss.epsilon=-1"]))
    assert "rollout.num_generations" in str(err.value) and "loss.epsilon" in str(err.value)


def test_wrong_type_fails_at_compose_naming_the_key(compose_cfg):
    with pytest.raises(Exception) as err:
        compose_cfg(["rollout.num_generations=eight"])
    assert "num_generations" in str(err.value)


def test_unknown_key_fails_at_compose(compose_cfg):
    with pytest.raises(Exception) as err:
        compose_cfg(["loss.epsilonn=0.1"])
    assert "epsilonn" in str(err.value)


def test_wrong_group_option_lists_valid_options(compose_cfg):
    with pytest.raises(Exception) as err:
        compose_cfg(["advantage=nope"])
    assert "grpo" in str(err.value)


@pytest.mark.e2e
def test_cli_wrong_scheme_exits_nonzero_and_lists_schemes(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", "advantage=nope", f"paths.root_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "advantage" in out and "grpo" in out


@pytest.mark.e2e
def test_cli_invalid_value_is_one_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", "rollout.num_generations=1",
                           f"paths.root_dir={tmp_path}"], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 2
    assert "rollout.num_generations = 1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_cli_two_steps_leaves_an_mlflow_run_with_params_metrics_and_eval_table(tmp_path):
    """`python -m grail_exp.run trainer.max_steps=2` (warm start shortened so the test stays fast)."""
    from mlflow.tracking import MlflowClient

    proc = subprocess.run([sys.executable, "-m", "grail_exp.run", "trainer.max_steps=2", f"paths.root_dir={tmp_path}",
                           f"paths.cache_dir={tmp_path}/cache", "model.warm_start.max_steps=20",
                           "model.warm_start.eval_every=10", "benchmark.limit=8"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/results/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("grail_exp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.max_steps"] == "2"
    assert run.data.params["recipe.name"] == "demo"  # the logged config says which recipe composed the run
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    assert "eval/arithmetic/acc" in run.data.metrics
    assert "eval/final/pass_at_k.json" in {a.path for a in client.list_artifacts(run.info.run_id, "eval/final")}
    assert "eval/arithmetic/acc" in proc.stdout
