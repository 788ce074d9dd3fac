"""User errors raised deep in the code are one clear message naming the key on the command line (issue 21 §4):
``error: <message>`` on stderr, exit 2, no traceback, for every entry point (``grail_exp.errors``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.tolerances import HANG_TIMEOUT_S


def _cli(module: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, f"paths.root_dir={tmp_path}",
                           f"paths.cache_dir={tmp_path}/cache", "logger=none", *args],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "GRAIL_EXP_TRACEBACK": ""})


def _assert_one_clear_error(proc, *needles: str) -> str:
    """Exit 2, stderr ends with `error: ...` naming ``needles``, one line per cause, and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.rindex("error: "):].strip()
    for needle in needles:
        assert needle in message, message
    lines = message.splitlines()
    # One line; a configuration with several bad values lists them, one line each.
    assert len(lines) == 1 or (lines[0] == "error: invalid configuration:" and all(
        line.startswith("  - ") for line in lines[1:])), message
    return message


@pytest.mark.e2e
def test_arithmetic_knobs_that_cannot_fill_the_splits_name_the_keys_before_any_model_is_built(tmp_path):
    proc = _cli("grail_exp.run", ["data.min_steps=1", "data.max_steps=1", "data.max_operand=9", "data.operators=+"],
                tmp_path)
    _assert_one_clear_error(proc, "data.num_validation=256", "only 81 distinct validation problems",
                            "data.max_operand=9")
    assert not (tmp_path / "cache").exists()  # validation said it before the embedded model was built


@pytest.mark.e2e
def test_a_training_dataset_that_cannot_be_loaded_is_one_line_naming_data_path(tmp_path, tiny_model_dir):
    """Raised deep in the run (building the prompt source, after the model is loaded), still one line. validate()
    reads a CSV's header only (a missing or headless file never gets here): a ragged row fails in the loader."""
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("prompt,solution\nCompute 1+2.,3\nCompute 2+2.,4,extra,fields\n")
    proc = _cli("grail_exp.run", [f"model.name_or_path={tiny_model_dir}", "data=deepmath", f"data.path={ragged}",
                                  "trainer.eval_before_training=false", "benchmark.limit=2"], tmp_path)
    _assert_one_clear_error(proc, f"data.path={str(ragged)!r}", "cannot load the dataset")


@pytest.mark.e2e
def test_an_unusable_tune_storage_is_one_line_naming_tune_storage(tmp_path):
    proc = _cli("grail_exp.tune", ["tune.storage=nosuchdb://host/db"], tmp_path)
    _assert_one_clear_error(proc, "tune.storage='nosuchdb://host/db'", "cannot open the Optuna storage")


# ---------------------------------------------------------------------------------------------- in process
def test_every_user_error_type_is_a_user_error():
    """The CLI catches ``UserError``: each error type the code raises for bad input must be one."""
    from grail_exp.checkpoint import CheckpointError
    from grail_exp.config import ConfigError
    from grail_exp.data.benchmarks import BenchmarkDataError
    from grail_exp.data.curriculum import CurriculumError
    from grail_exp.errors import DataError, MissingDependencyError, UserError
    from grail_exp.extrapolate import ExtrapolateError
    from grail_exp.models.architectures import ArchitectureError
    from grail_exp.models.loading import ModelLoadError
    from grail_exp.models.tokenizers import PackagedTokenizerError
    from grail_exp.tracking import TrackingError
    from grail_exp.training.module import NonFiniteLossError
    from grail_exp.weights import InputError

    for cls in (ArchitectureError, CheckpointError, ConfigError, BenchmarkDataError, CurriculumError, DataError,
                MissingDependencyError, ExtrapolateError, ModelLoadError, NonFiniteLossError, PackagedTokenizerError,
                TrackingError, InputError):
        assert issubclass(cls, UserError), cls


@pytest.mark.parametrize("raise_it, needle", [
    (lambda: __import__("grail_exp.data.benchmarks", fromlist=["x"]).load_benchmark("nope", None),
     "benchmark.names: unknown benchmark 'nope'"),
    (lambda: __import__("grail_exp.data.arithmetic", fromlist=["x"]).ArithmeticTask(
        min_steps=1, max_steps=1, max_operand=3, operators="+", num_validation=6, num_test=4).split("test"),
     "data.num_test=4: only 3 distinct test problems besides the validation split"),
    (lambda: __import__("grail_exp.rollout", fromlist=["x"]).build_engine("nope", None, None, 1),
     "rollout.engine"),
    (lambda: __import__("grail_exp.grading.extraction", fromlist=["x"]).reward_rule("nope"), "reward.extraction"),
])
def test_deep_raise_sites_are_user_errors_naming_the_key(raise_it, needle, capsys):
    from grail_exp.errors import exit_on_user_error

    with pytest.raises(SystemExit) as stop:
        with exit_on_user_error():
            raise_it()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1, err


def test_bugs_keep_their_traceback():
    from grail_exp.errors import exit_on_user_error

    with pytest.raises(ZeroDivisionError):
        with exit_on_user_error():
            _ = 1 / 0
