"""Shared fixtures: composed configs with temp paths, and a tiny random model built in seconds. Everything else the
tests share (compose, tolerances, fakes, the tiny build) is in tests/helpers/, which tests import as ``helpers.*``."""

from __future__ import annotations

import os

import pytest

from helpers.compose import compose
from helpers.models import TINY_BUILD

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)  # tests must never write to a user's tracking server


@pytest.fixture
def compose_cfg(tmp_path):
    return lambda overrides=None: compose(overrides, tmp_path)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_tokenizer

    return build_tokenizer("qwen", ArithmeticTask())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A randomly initialised (not warm-started) tiny Qwen3 saved as a Hugging Face directory."""
    from grail_exp.models.embedded import build_model

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
def pinned_model_dir(tmp_path_factory):
    """The pinned step's tiny model (helpers.pinned_step) saved as a Hugging Face directory, for runs in a child
    process (helpers.scripted_run)."""
    from helpers.pinned_step import build_model_and_tokenizer

    d = tmp_path_factory.mktemp("pinned_model")
    model, tok = build_model_and_tokenizer()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def formatted_model_dir(tmp_path_factory):
    """The embedded tiny model after a 100-step warm start: it writes '\\boxed{}' answers (mostly wrong)."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import ensure_embedded_model

    build = dict(TINY_BUILD, hidden_size=128, intermediate_size=384, head_dim=32, seed=0)
    warm = dict(enabled=True, lr=3e-3, batch_size=32, warmup_steps=10, max_steps=100, eval_every=1000,
                eval_problems=8, target_accuracy=1.0)
    return ensure_embedded_model(build, warm, ArithmeticTask(), {"enable_thinking": False}, "",
                                 tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """The model cache SmolLM2-135M-Instruct (``pkg:smollm2``) is de-quantised into once per test session."""
    base = tmp_path_factory.getbasetemp()
    # xdist workers have sibling basetemps (popen-gw0, popen-gw1) under one session folder: share the cache there
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "smollm2_cache"


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache):
    """SmolLM2-135M-Instruct as a Hugging Face directory (converted from the packaged GGUF file on first use)."""
    from pathlib import Path

    from grail_exp.models.packaged import resolve

    return Path(resolve("pkg:smollm2", smollm2_cache))
