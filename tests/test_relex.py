"""RELEX (grail_exp.extrapolate) against brute force, streaming bounds, tied heads, errors, the trainer's
trajectory, and the written directory through transformers and grail_exp.evaluate."""

import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from grail_exp import extrapolate as X
from grail_exp.config import ConfigError
from helpers.compose import compose
from helpers.fakes import AlternatingVerifier
from helpers.models import TINY_BUILD
from helpers.tolerances import HANG_TIMEOUT_S


# ------------------------------------------------------------------------------------------- helpers
def write_ckpt(d: Path, tensors: dict, tie: bool = False) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": tie, "dtype": "float32"}))
    return d


def trajectory(root: Path, theta0: dict, direction: dict, coef, steps, tie=False) -> Path:
    """θ_s = θ_0 + coef(s)·D per tensor: an exactly rank-1 trajectory (linear in s when coef is)."""
    traj = root / "trajectory"
    write_ckpt(traj / "step-0", theta0, tie)
    for s in steps:
        write_ckpt(traj / f"step-{s}", {k: theta0[k] + coef(s) * direction[k] for k in theta0}, tie)
    return traj


def cfg_for(tmp: Path, traj: Path, *overrides):
    return compose([f"trajectory={traj}", f"output={tmp}/out", "progress=false", *overrides], tmp,
                   config_name="extrapolate")


def random_tensors(gen, shapes: dict, dtype=torch.float32) -> dict:
    return {k: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for k, s in shapes.items()}


SHAPES = {"model.embed_tokens.weight": (11, 6), "model.layers.0.mlp.up_proj.weight": (8, 6),
          "model.norm.weight": (6,)}


# ------------------------------------------------------------------------------------------- the math
def test_gram_svd_equals_direct_svd_of_the_stacked_deltas():
    gen = torch.Generator().manual_seed(0)
    T, d, r = 7, 40, 3
    M = torch.randn(T, d, generator=gen, dtype=torch.float64)
    U, S, explained = X.gram_svd(M @ M.T, r)
    Ud, Sd, Vh = torch.linalg.svd(M, full_matrices=False)
    assert torch.allclose(S, Sd[:r], rtol=1e-10)
    assert torch.allclose(U.abs(), Ud[:, :r].abs(), atol=1e-10)  # equal up to each column's sign
    assert explained == pytest.approx(float((Sd[:r] ** 2).sum() / (Sd ** 2).sum()), rel=1e-12)
    # V_r = Mᵀ U_r / S_r is the direct SVD's right singular vectors (up to the same signs)
    V = M.T @ U / S
    assert torch.allclose(V.abs(), Vh[:r].T.abs(), atol=1e-10)


def test_fit_and_reconstruct_weights_match_the_brute_force_formulas():
    """α @ M equals c(s*) V_rᵀ computed from numpy's SVD and polyfit, for fit/extrapolate and reconstruct."""
    rng = np.random.default_rng(1)
    T, d, r = 6, 30, 2
    M = rng.standard_normal((T, d))
    steps = np.array([2, 4, 6, 8, 10, 12], dtype=float)
    _, Sd, Vh = np.linalg.svd(M, full_matrices=False)
    Vr = Vh[:r].T
    C = M @ Vr
    G = torch.from_numpy(M @ M.T)
    for window in (None, 3):
        w = T if window is None else window
        fit = X.solve(G, torch.from_numpy(steps), r, "extrapolate", 50, window)
        c_star = np.array([np.polyval(np.polyfit(steps[-w:], C[-w:, k], 1), 50) for k in range(r)])
        assert np.allclose(fit.alpha.numpy() @ M, c_star @ Vr.T, atol=1e-9)
    delta = rng.standard_normal(d)  # a checkpoint outside the observed ones: projected on span(V_r)
    fit = X.solve(G, torch.from_numpy(steps), r, "reconstruct", 0, None, g_target=torch.from_numpy(M @ delta))
    assert np.allclose(fit.alpha.numpy() @ M, (delta @ Vr) @ Vr.T, atol=1e-9)


def test_an_unchanged_tensor_predicts_theta0():
    fit = X.solve(torch.zeros(4, 4, dtype=torch.float64), torch.arange(1.0, 5.0), 1, "extrapolate", 10, None)
    assert torch.equal(fit.alpha, torch.zeros(4, dtype=torch.float64)) and fit.explained_variance == 0.0


# ------------------------------------------------------------------------------------------- end to end on files
@pytest.mark.parametrize("every, compute_dtype, tol", [(1, "float64", 1e-10), (2, "float64", 1e-10),
                                                       (1, "float32", 1e-4)])
def test_a_rank1_linear_trajectory_is_extrapolated_exactly(tmp_path, every, compute_dtype, tol):
    """θ_s = θ_0 + (0.3 s + 0.1)·D; observing steps <= 10 (every `every` steps) predicts step 40 exactly.
    every=2 checks the fit is against the step number, not the checkpoint's position."""
    gen = torch.Generator().manual_seed(2)
    theta0 = random_tensors(gen, SHAPES, torch.float64)
    D = random_tensors(gen, SHAPES, torch.float64)
    traj = trajectory(tmp_path, theta0, D, lambda s: 0.3 * s + 0.1, range(every, 11, every))
    report = X.extrapolate(cfg_for(tmp_path, traj, "observe.max_step=10", "target_step=40",
                                   f"compute_dtype={compute_dtype}"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    for k in SHAPES:
        expected = theta0[k] + (0.3 * 40 + 0.1) * D[k]
        assert out[k].dtype == torch.float64  # dtype=auto keeps θ_0's
        assert torch.allclose(out[k], expected, atol=tol * expected.abs().max(), rtol=0), k
    assert report["observed_steps"] == list(range(every, 11, every))
    assert report["explained_variance"]["min"] == pytest.approx(1.0, abs=1e-6)
    saved = json.loads((tmp_path / "out" / "relex.json").read_text())
    assert len(saved["tensors"]) == len(SHAPES) and saved["mode"] == "extrapolate"


def test_fit_window_uses_only_the_last_checkpoints(tmp_path):
    """A trajectory that bends at step 5: the last-3 window follows the new slope, the full fit does not."""
    gen = torch.Generator().manual_seed(3)
    theta0 = random_tensors(gen, SHAPES, torch.float64)
    D = random_tensors(gen, SHAPES, torch.float64)
    traj = trajectory(tmp_path, theta0, D, lambda s: s if s <= 5 else 5 + 2 * (s - 5), range(1, 9))
    X.extrapolate(cfg_for(tmp_path, traj, "target_step=20", "fit_window=3", "compute_dtype=float64"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    k = "model.layers.0.mlp.up_proj.weight"
    assert torch.allclose(out[k], theta0[k] + 35 * D[k], atol=1e-9)  # 5 + 2·15


def test_excluded_tensors_keep_theta0(tmp_path):
    gen = torch.Generator().manual_seed(9)
    theta0 = random_tensors(gen, SHAPES)
    traj = trajectory(tmp_path, theta0, random_tensors(gen, SHAPES), lambda s: s, range(1, 4))
    report = X.extrapolate(cfg_for(tmp_path, traj, "target_step=8", "exclude=norm"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(out["model.norm.weight"], theta0["model.norm.weight"])
    assert not torch.equal(out["model.embed_tokens.weight"], theta0["model.embed_tokens.weight"])
    assert report["tensors_kept_at_base"] == 1 and report["tensors_fitted"] == 2


def test_reconstruct_with_full_rank_returns_the_checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(4)
    theta0 = random_tensors(gen, SHAPES)
    traj = tmp_path / "trajectory"
    write_ckpt(traj / "step-0", theta0)
    ckpts = {s: random_tensors(gen, SHAPES) for s in (1, 2, 3)}
    for s, t in ckpts.items():
        write_ckpt(traj / f"step-{s}", t)
    X.extrapolate(cfg_for(tmp_path, traj, "mode=reconstruct", "target_step=2", "rank=3"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.allclose(out[k], ckpts[2][k], atol=1e-5) for k in SHAPES)


def test_row_chunked_streaming_equals_one_chunk(tmp_path):
    """A tensor larger than chunk_mb is processed in row-chunks (two passes); the result is the same."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"big.weight": (600, 200), "small.weight": (5, 3)}  # (T+1)·600·200·4 B = 2.4 MB > 1 MiB
    assert len(X.row_chunks([600, 200], 5, 4, 2**20)) > 1
    theta0 = random_tensors(gen, shapes)
    traj = tmp_path / "trajectory"
    write_ckpt(traj / "step-0", theta0)
    for s in range(1, 5):
        write_ckpt(traj / f"step-{s}", {k: v + s * 0.01 * torch.randn(v.shape, generator=gen) for k, v in theta0.items()})
    X.extrapolate(cfg_for(tmp_path / "a", traj, "target_step=9", "chunk_mb=1"))
    X.extrapolate(cfg_for(tmp_path / "b", traj, "target_step=9", "chunk_mb=64"))
    a, b = load_file(tmp_path / "a" / "out" / "model.safetensors"), load_file(tmp_path / "b" / "out" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in shapes)


def test_row_chunks_respect_the_budget():
    for shape, held, budget in [([1000, 64], 11, 2**20), ([7, 3, 5], 4, 100), ([50], 3, 64)]:
        chunks = X.row_chunks(shape, held, 4, budget)
        rows = [(0, shape[0])] if chunks == [None] else chunks
        assert rows[0][0] == 0 and rows[-1][1] == shape[0] and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
        row_bytes = math.prod(shape[1:]) * 4 * held
        assert all((b - a) * row_bytes <= max(budget, row_bytes) for a, b in rows)
    assert X.row_chunks([], 5, 4, 10) == [None]


def test_streaming_holds_a_bounded_number_of_loaded_tensors(tmp_path, monkeypatch):
    """Count tensors handed out by the reader that are still alive: the peak does not grow with the number of
    tensors (3 vs 30) — one tensor's row-chunks at a time, never whole checkpoints."""
    live = {"now": 0, "peak": 0}
    original = X.CheckpointReader.read

    def counting_read(self, name, rows=None):
        t = original(self, name, rows)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(t, lambda: live.__setitem__("now", live["now"] - 1))
        return t

    monkeypatch.setattr(X.CheckpointReader, "read", counting_read)
    peaks = []
    for n_tensors in (3, 30):
        gen = torch.Generator().manual_seed(n_tensors)
        shapes = {f"layer.{i}.weight": (4, 3) for i in range(n_tensors)}
        theta0 = random_tensors(gen, shapes)
        traj = trajectory(tmp_path / str(n_tensors), theta0, random_tensors(gen, shapes), lambda s: s, range(1, 7))
        live.update(now=0, peak=0)
        X.extrapolate(cfg_for(tmp_path / str(n_tensors), traj, "observe.max_step=5", "target_step=6"))
        peaks.append(live["peak"])
    assert peaks[0] == peaks[1] <= 3, peaks  # θ_0's chunk, one observed chunk, the target's chunk


def test_shard_writer_buffers_one_shard_and_writes_an_index(tmp_path):
    sizes = [(f"t{i}", 400) for i in range(5)]  # 1000-byte shards hold two tensors each
    w = X.ShardWriter(tmp_path, sizes, 1000)
    assert w.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i in range(5):
        w.add(f"t{i}", torch.zeros(100))
        if i == 1:
            assert (tmp_path / w.files[0]).exists() and not w.buffer  # flushed as soon as complete
    w.finish()
    assert w.max_buffered_bytes <= 1000
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == w.files[2] and index["metadata"]["total_size"] == 2000


# ------------------------------------------------------------------------------------------- tied heads
def test_tied_head_reuses_the_embedding_delta_and_untied_is_fitted(tmp_path):
    gen = torch.Generator().manual_seed(6)
    shapes = {**SHAPES, "lm_head.weight": SHAPES["model.embed_tokens.weight"]}
    theta0 = random_tensors(gen, shapes, torch.float64)
    D = random_tensors(gen, shapes, torch.float64)
    theta0["lm_head.weight"] = theta0["model.embed_tokens.weight"].clone()
    D["lm_head.weight"] = 5 * D["model.embed_tokens.weight"]  # a different trajectory, only used when untied
    for tie in (True, False):
        root = tmp_path / f"tie{tie}"
        traj = trajectory(root, theta0, D, lambda s: 2.0 * s, range(1, 5), tie=tie)
        report = X.extrapolate(cfg_for(root, traj, "target_step=10", "compute_dtype=float64"))
        out = load_file(root / "out" / "model.safetensors")
        if tie:  # not fitted, not written: transformers re-ties it to the predicted embedding
            assert "lm_head.weight" not in out and report["tied_head"] == "lm_head.weight"
        else:
            assert torch.allclose(out["lm_head.weight"], theta0["lm_head.weight"] + 20 * D["lm_head.weight"])
        assert torch.allclose(out["model.embed_tokens.weight"],
                              theta0["model.embed_tokens.weight"] + 20 * D["model.embed_tokens.weight"])


# ------------------------------------------------------------------------------------------- errors
def test_bad_inputs_are_one_clear_error_each(tmp_path):
    gen = torch.Generator().manual_seed(7)
    theta0 = random_tensors(gen, SHAPES)
    traj = trajectory(tmp_path, theta0, random_tensors(gen, SHAPES), lambda s: s, range(1, 6))

    def err(*overrides, sub="x"):
        with pytest.raises((X.ExtrapolateError, ConfigError)) as info:
            X.extrapolate(cfg_for(tmp_path / sub, traj, *overrides))
        return str(info.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(X.ExtrapolateError, match="no step-<N>/ checkpoint"):
        X.extrapolate(cfg_for(tmp_path, empty, "target_step=9"))
    assert "θ_0 missing" in err("target_step=9", f"base={tmp_path}/nope")
    msg = err("target_step=3", "observe.max_step=5")
    assert "inside the observed range (last observed step 5)" in msg and "mode=fit" in msg
    assert "needs >= 2" in err("target_step=9", "observe.max_step=1")
    assert "needs a checkpoint at target_step" in err("mode=reconstruct", "target_step=99")
    msg = err("target_step=9", "rank=0", "mode=nope", "observe.fraction=0.5", "observe.max_step=3")
    assert all(k in msg for k in ("rank = 0", "mode = 'nope'", "set one of them"))  # all problems at once
    write_ckpt(traj / "step-9", {**theta0, "extra.weight": torch.zeros(2)})
    assert "step-9 does not hold the same tensors as θ_0 (" in err("mode=fit", "target_step=9", sub="y") \
        and "extra [extra.weight]." in err("mode=fit", "target_step=9", sub="y")
    write_ckpt(traj / "step-9", {**theta0, "model.norm.weight": torch.zeros(7)})
    assert "model.norm.weight: shape [7]" in err("mode=fit", "target_step=9", sub="z")
    X.extrapolate(cfg_for(tmp_path / "ok", traj, "target_step=20", "observe.max_step=5"))
    assert "exists and is not empty" in err("target_step=20", "observe.max_step=5", sub="ok")
    X.extrapolate(cfg_for(tmp_path / "ok", traj, "target_step=20", "observe.max_step=5", "overwrite=true"))
    assert not list((tmp_path / "ok").glob("*.tmp-*"))


# ------------------------------------------------------------------------------------------- with the framework
def test_training_writes_the_trajectory_and_relex_reads_it(tmp_path, tiny_model_dir, monkeypatch):
    """trainer.save_weights_only_every=2 over 5 steps: step-0 (= the start), 2, 4 and the last (5); weights
    only; never pruned by keep_last_checkpoints. RELEX then extrapolates steps 1..4 (every=1 run) to step 5."""
    import grail_exp.grading.rewards
    from grail_exp.run import run

    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    run_dir = tmp_path / "r" / "run"
    common = [f"model.name_or_path={tiny_model_dir}", f"paths.output_dir={run_dir}", "trainer.prompts_per_step=2",
              "trainer.micro_batch_size=8", "rollout.num_generations=4", "rollout.max_completion_length=16",
              "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
              "logger=none", "advantage=grpo", "loss.mask_truncated_completions=false", "trainer.max_steps=5",
              "trainer.checkpoint_every=1", "trainer.keep_last_checkpoints=1"]
    run(compose([*common, "trainer.save_weights_only_every=2"], run_dir.parent))
    traj = run_dir / "trajectory"
    assert sorted(p.name for p in traj.iterdir()) == ["step-0", "step-2", "step-4", "step-5"]
    assert all((traj / s / "COMPLETE").exists() and not (traj / s / "training_state.pt").exists()
               for s in ("step-0", "step-5"))
    start, first = load_file(Path(tiny_model_dir) / "model.safetensors"), load_file(traj / "step-0" / "model.safetensors")
    assert all(torch.equal(start[k], first[k]) for k in start)
    last, ckpt = load_file(traj / "step-5" / "model.safetensors"), load_file(run_dir / "checkpoints" / "step-5" / "model.safetensors")
    assert all(torch.equal(last[k], ckpt[k]) for k in last) and any(not torch.equal(start[k], last[k]) for k in start)

    report = X.extrapolate(cfg_for(tmp_path, traj, "target_step=5"))  # observes 2, 4; compares with the real 5
    assert report["observed_steps"] == [2, 4] and report["vs_actual"]["relative_error"] >= 0


@pytest.fixture(scope="module")
def relex_of_a_real_model(tmp_path_factory):
    """A tiny Qwen3 (hidden 128, ~1.7 MB) on a synthetic linear trajectory, extrapolated into two shards."""
    from grail_exp.data.arithmetic import ArithmeticTask
    from grail_exp.models.embedded import build_model, build_tokenizer

    tmp = tmp_path_factory.mktemp("relex_real")
    tok = build_tokenizer("qwen", ArithmeticTask())
    model = build_model(dict(TINY_BUILD, hidden_size=128, intermediate_size=384, head_dim=32), tok, seed=0)
    traj = tmp / "trajectory"
    model.save_pretrained(traj / "step-0")
    tok.save_pretrained(traj / "step-0")
    theta0 = load_file(traj / "step-0" / "model.safetensors")
    gen = torch.Generator().manual_seed(8)
    D = {k: 1e-3 * torch.randn(v.shape, generator=gen) for k, v in theta0.items()}
    for s in (1, 2, 3):
        write_ckpt(traj / f"step-{s}", {k: theta0[k] + s * D[k] for k in theta0}, tie=True)
    return tmp, traj, theta0, D


def test_the_written_directory_loads_with_transformers_sharded_and_tied(relex_of_a_real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, traj, theta0, D = relex_of_a_real_model
    out = tmp / "sharded"
    X.extrapolate(cfg_for(tmp, traj, f"output={out}", "target_step=6", "max_shard_mb=1"))  # 1.7 MB in float32
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) == 2
    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    sd = model.state_dict()
    for k in theta0:
        assert torch.allclose(sd[k], theta0[k] + 6 * D[k], atol=1e-5), k
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])  # re-tied to the prediction


@pytest.mark.e2e
def test_cli_extrapolate_then_evaluate(relex_of_a_real_model):
    """The CLI writes a bfloat16 directory that grail_exp.evaluate scores; a user error exits 2 with one line."""
    from grail_exp.evaluate import evaluate_job

    tmp, traj, _, _ = relex_of_a_real_model
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp / "cli"
    p = subprocess.run([sys.executable, "-m", "grail_exp.extrapolate", f"trajectory={traj}", "target_step=6",
                        f"output={out}", f"hydra.run.dir={tmp}/h1", "progress=false", "dtype=bfloat16"],
                       capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "explained variance of rank 1" in p.stdout and f"model.name_or_path={out}" in p.stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    result = evaluate_job(compose([f"model.name_or_path={out}", "benchmark.limit=4", "eval.n=2", "logger=none",
                                   "reward.num_workers=0"], tmp / "eval", config_name="evaluate"))
    assert result.summaries["arithmetic"]["n_problems"] == 4 and result.generated == 8
    p = subprocess.run([sys.executable, "-m", "grail_exp.extrapolate", f"trajectory={traj}", "target_step=2",
                        "observe.max_step=3", f"output={tmp}/cli2", f"hydra.run.dir={tmp}/h3"],
                       capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: target_step = 2 is inside the observed range"), p.stderr


def test_negative_trajectory_cadence_names_the_key(compose_cfg):
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match="trainer.save_weights_only_every"):
        validate(compose_cfg(["trainer.save_weights_only_every=-1"]))
    assert compose_cfg([]).trainer.save_weights_only_every == 0  # off by default: no extra disk use
