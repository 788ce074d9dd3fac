"""The shipped warm-started default model (grail_exp/data/embedded/tiny): intact, current, accurate, and used only
for exactly its own build."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from helpers.compose import compose

REBUILD = "rebuild it: `PYTHONPATH=. python sweeps/build_shipped_model.py` and commit grail_exp/data/embedded/tiny"


@pytest.fixture(scope="module")
def shipped():
    from grail_exp.models.embedded import SHIPPED_DIR, read_manifest

    d = SHIPPED_DIR / "tiny"
    manifest = read_manifest(d)
    assert manifest is not None, f"no shipped model at {d}; {REBUILD}"
    return d, manifest


def _default_key(overrides=()):
    from grail_exp.models.embedded import cache_key, embedded_spec
    from grail_exp.models.loading import embedded_build_args

    spec = embedded_spec(**embedded_build_args(compose(list(overrides))))
    return cache_key(spec), spec


def _no_build(monkeypatch):
    import grail_exp.models.embedded as embedded

    def refuse(*args, **kwargs):
        raise AssertionError("the builder ran")

    for name in ("build_tokenizer", "build_model", "warm_start"):
        monkeypatch.setattr(embedded, name, refuse)


def _count_builds(monkeypatch) -> list:
    """Replace the (minutes-long) warm start by a recorder: the tokenizer and model are still built for real."""
    import grail_exp.models.embedded as embedded

    calls = []

    def fake_warm_start(model, tokenizer, task, ws, chat, instruction, seed):
        calls.append(seed)
        return {"steps": 0, "greedy_val_accuracy": 0.0, "seconds": 0.0, "history": [], "reached_target": False}

    monkeypatch.setattr(embedded, "warm_start", fake_warm_start)
    return calls


# ---------------------------------------------------------------------------------------------- provenance
def test_shipped_files_match_the_manifest(shipped):
    from grail_exp.models.embedded import BUILD_VERSION, file_sha256, read_build_report, shipped_mismatches

    d, manifest = shipped
    assert shipped_mismatches(d, manifest) == [], REBUILD
    assert {"model.safetensors", "config.json", "tokenizer.json", "grail_exp_build.json"} <= set(manifest["files"])
    assert manifest["weights_sha256"] == manifest["files"]["model.safetensors"] == file_sha256(d / "model.safetensors")
    assert manifest["build_version"] == BUILD_VERSION, f"BUILD_VERSION changed since the shipped build; {REBUILD}"
    assert re.fullmatch(r"[0-9a-f]{40}", manifest["git_commit"]) and manifest["git_dirty"] is False
    report = read_build_report(d)  # what the builder wrote, as a cached build carries it
    assert report["spec"] == manifest["spec"] and report["warm_start"]["steps"] == manifest["warm_start"]["steps"]
    assert report["warm_start"]["greedy_val_accuracy"] == manifest["warm_start"]["greedy_val_accuracy"]
    assert manifest["warm_start"]["greedy_val_accuracy"] >= manifest["warm_start"]["target_accuracy"]


def test_manifest_key_is_the_key_of_the_default_config(shipped):
    _, manifest = shipped
    key, spec = _default_key()
    assert manifest["cache_key"] == key, (
        f"the default config (model=tiny, data=arithmetic) now computes embedded-model key {key}, but the shipped "
        f"model was built for {manifest['cache_key']}: a change to model.build / model.warm_start / the task / "
        f"BUILD_VERSION invalidates it, and runs would silently build instead; {REBUILD}")
    assert manifest["spec"] == json.loads(json.dumps(spec, default=str))
    assert manifest["cache_directory"] == f"{spec['build']['architecture']}-{key}"


def test_shipped_weights_load_and_meet_the_warm_start_target(shipped):
    """Graded as the warm start graded itself: greedy, on the first eval_problems of the validation split."""
    from grail_exp.models.embedded import greedy_accuracy
    from grail_exp.models.loading import count_parameters, embedded_build_args, load_causal_lm, load_tokenizer

    d, manifest = shipped
    cfg = compose([])
    tok = load_tokenizer(str(d), cfg)
    model = load_causal_lm(str(d), cfg, trainable=False)
    assert count_parameters(model) == manifest["parameters"]
    args = embedded_build_args(cfg)
    ws = cfg.model.warm_start
    val = list(args["task"].split("validation"))[: ws.eval_problems]
    acc = greedy_accuracy(model, tok, val, args["chat_template_kwargs"], args["instruction"])
    # No tolerance: the target is a count of exactly graded problems (>= 45 of 128). A different CPU may flip a
    # greedy argmax only where two logits tie to ~1e-6, which the manifest's accuracy would then show.
    assert acc >= ws.target_accuracy, f"greedy accuracy {acc} < target {ws.target_accuracy}; {REBUILD}"


# ---------------------------------------------------------------------------------------------- resolution
def test_default_run_resolves_to_the_shipped_model_without_building(tmp_path, monkeypatch, shipped, caplog):
    from grail_exp.models.loading import resolve_model_path

    _no_build(monkeypatch)
    with caplog.at_level("INFO", logger="grail_exp.models.embedded"):
        path = resolve_model_path(compose([], tmp_path))
    assert path == str(shipped[0])
    assert not (tmp_path / "cache" / "embedded").exists() or not any((tmp_path / "cache" / "embedded").iterdir())
    assert "shipped warm-started weights" in caplog.text  # the log says which source was used


@pytest.mark.parametrize("overrides", [["model.build.seed=1"], ["model.shipped_weights=false"],
                                       ["model.warm_start.target_accuracy=0.4"], ["data.max_operand=50"]])
def test_any_other_build_goes_through_the_builder(tmp_path, monkeypatch, shipped, overrides):
    from grail_exp.models.embedded import read_build_report
    from grail_exp.models.loading import resolve_model_path

    calls = _count_builds(monkeypatch)
    cfg = compose(overrides, tmp_path)
    path = resolve_model_path(cfg)
    assert len(calls) == 1 and calls[0] == cfg.model.build.seed
    assert path.startswith(str(tmp_path / "cache" / "embedded"))
    assert read_build_report(path)["spec"]["build"]["seed"] == cfg.model.build.seed
    assert resolve_model_path(cfg) == path and len(calls) == 1  # cached afterwards, as before


def test_no_shipped_model_for_tiny_llama(shipped):
    from grail_exp.models.embedded import find_shipped_model

    key, _ = _default_key(["model=tiny_llama"])
    assert key != shipped[1]["cache_key"] and find_shipped_model(key) is None
    assert find_shipped_model(shipped[1]["cache_key"]) == shipped[0]


def test_a_damaged_shipped_file_is_not_used(tmp_path, monkeypatch, shipped, caplog):
    import grail_exp.models.embedded as embedded

    d, manifest = shipped
    copy = tmp_path / "shipped" / "tiny"
    shutil.copytree(d, copy)
    assert embedded.find_shipped_model(manifest["cache_key"], copy.parent) == copy
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    (copy / "model.safetensors").write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="grail_exp.models.embedded"):
        assert embedded.find_shipped_model(manifest["cache_key"], copy.parent) is None
    assert "model.safetensors" in caplog.text and "building instead" in caplog.text


# ---------------------------------------------------------------------------------------------- rebuild
@pytest.mark.slow
def test_a_rebuild_from_scratch_reaches_the_target(tmp_path, shipped):
    """The builder still produces the shipped model's build: same key, and it reaches the same target (the weights
    are not compared: fp32 reductions in another order on another CPU change the trajectory)."""
    from grail_exp.models.embedded import ensure_embedded_model, greedy_accuracy, read_build_report
    from grail_exp.models.loading import embedded_build_args, load_causal_lm, load_tokenizer

    cfg = compose([], tmp_path)
    args = embedded_build_args(cfg)
    path = ensure_embedded_model(**args, cache_dir=tmp_path / "cache", use_shipped=False)
    assert path.name == shipped[1]["cache_directory"]
    ws = read_build_report(path)["warm_start"]
    assert ws["reached_target"] and ws["greedy_val_accuracy"] >= cfg.model.warm_start.target_accuracy
    val = list(args["task"].split("validation"))[: cfg.model.warm_start.eval_problems]
    acc = greedy_accuracy(load_causal_lm(str(path), cfg, trainable=False), load_tokenizer(str(path), cfg), val,
                          args["chat_template_kwargs"], args["instruction"])
    assert acc == ws["greedy_val_accuracy"]  # same machine, same weights, same code path: bit-identical
