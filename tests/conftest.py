"""Shared fixtures: composed configs with temp paths, and a tiny random model built in seconds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)  # tests must never write to a user's tracking server


# Tolerances (docs/notes/reliability.md). Two fp32 computations of one quantity that sum in another order (another
# batch shape or fast path, another CPU's GEMM blocking, another thread count) differ; exact equality only where the
# code path is bit-identical by construction. A length-n reduction in another order moves its result by at most
# n * eps relative to the sum of its terms' magnitudes; the longest reduction in the test models is their vocabulary.
FP32_EPS = 2.0 ** -23
REORDER = 320 * FP32_EPS  # 3.8e-5: one reordered reduction of length <= V = 320
# A model output (log-prob, hidden state, saliency, gradient entry) passes ~5 reductions in a row (attention and MLP
# of the layers, the head, the log-softmax), each moving it by <= REORDER relative to its terms' scale.
MODEL_REORDER = 5 * REORDER  # 1.9e-4

# Timeouts of subprocesses and waits in the tests only guard against a hang; they never measure speed: a command that
# takes 10 s on an idle 2-core machine takes minutes while other jobs load it. One generous bound for all of them.
HANG_TIMEOUT_S = 1200


def compose(overrides: list[str] | None = None, tmp: Path | None = None, config_name: str = "config"):
    """Compose the real config tree like `python -m grail_exp.run <overrides>` does, with temp paths."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.config import register_configs

    register_configs()
    if config_name in ("report", "extrapolate"):  # their schemas are stored by their own modules
        __import__(f"grail_exp.{config_name}")
    GlobalHydra.instance().clear()
    paths = []
    if tmp is not None:
        paths = [f"paths.root_dir={tmp}", f"paths.output_dir={tmp}/run", f"paths.cache_dir={tmp}/cache"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=paths + list(overrides or []))


@pytest.fixture
def compose_cfg(tmp_path):
    return lambda overrides=None: compose(overrides, tmp_path)


TINY_BUILD = dict(architecture="qwen3", tokenizer="qwen", vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.embedded import build_tokenizer

    return build_tokenizer("qwen", ArithmeticTask())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A randomly initialised (not warm-started) tiny Qwen3 saved as a Hugging Face directory."""
    from grail_exp.embedded import build_model

    d = tmp_path_factory.mktemp("tiny_model")
    model = build_model(TINY_BUILD, tiny_tokenizer, seed=0)
    model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.fixture
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    return m.train()


@pytest.fixture(scope="session")
def formatted_model_dir(tmp_path_factory):
    """The embedded tiny model after a 100-step warm start: it writes '\\boxed{}' answers (mostly wrong)."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.embedded import ensure_embedded_model

    build = dict(TINY_BUILD, hidden_size=128, intermediate_size=384, head_dim=32, seed=0)
    warm = dict(enabled=True, lr=3e-3, batch_size=32, warmup_steps=10, max_steps=100, eval_every=1000,
                eval_problems=8, target_accuracy=1.0)
    return ensure_embedded_model(build, warm, ArithmeticTask(), {"enable_thinking": False}, "",
                                 tmp_path_factory.mktemp("cache"))


class AlternatingVerifier:
    """Deterministic stand-in for MathVerifier: every third completion is 'correct', so advantages are non-zero."""

    def __init__(self, *args, **kwargs):
        self.counters = {"timeout": 0}

    def score(self, completions, golds):
        from grail_exp.rewards import GradeResult

        return [GradeResult(i % 3 == 0, "x", "ok") for i in range(len(completions))]

    def close(self):
        pass
