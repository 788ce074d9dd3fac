"""End to end: advantage=rlsd and the SDPG terms train through grail_exp.run (2 steps), with their metrics logged."""

import subprocess
import sys

import pytest

from helpers.compose import compose
from helpers.fakes import AlternatingVerifier
from helpers.tolerances import HANG_TIMEOUT_S


def _run(tmp_path, model_dir, extra, monkeypatch):
    import grail_exp.grading.rewards
    import grail_exp.tracking
    from grail_exp.run import run

    logged = []
    monkeypatch.setattr(grail_exp.grading.rewards, "MathVerifier", AlternatingVerifier)
    monkeypatch.setattr(grail_exp.tracking.NullTracker, "log_metrics", lambda self, m, step: logged.append(dict(m)))
    run_dir = tmp_path / "run"
    cfg = compose([f"model.name_or_path={model_dir}", f"paths.output_dir={run_dir}", "logger=none",
                   "trainer.prompts_per_step=2", "trainer.micro_batch_size=4", "rollout.num_generations=4",
                   "rollout.max_completion_length=12", "loss.mask_truncated_completions=false",
                   "trainer.eval_at_end=false", "trainer.eval_before_training=false", "trainer.sample_table_every=0",
                   "trainer.max_steps=2", "trainer.log_every=1", *extra], tmp_path)
    run(cfg)
    assert (run_dir / "checkpoints" / "step-2").is_dir()
    return [m for m in logged if "loss" in m]  # the step metrics (not the final phase timings)


def test_rlsd_with_both_sdpg_terms_trains_two_steps(tmp_path, tiny_model_dir, monkeypatch):
    logged = _run(tmp_path, tiny_model_dir, ["advantage=rlsd", "advantage.lambda_decay_steps=3",
                                             "+loss_term=[sdpg_opd,sdpg_ref_kl]"], monkeypatch)
    # λ_k = λ (1 − k / T_decay) at rollout batch k = 1, 2 (the official counter starts at 1): 0.5·2/3, 0.5·1/3
    assert [m["rlsd/lambda"] for m in logged] == pytest.approx([1 / 3, 1 / 6])
    for m in logged:
        assert m["sdpg_opd/beta"] == pytest.approx(1e-3) and m["sdpg_opd/kl_mean"] > 0
        assert "sdpg_ref_kl/loss" in m and "sdpg_opd/loss" in m
    assert logged[0]["sdpg_ref_kl/log_ratio_mean"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 0
    assert any(m["rlsd/weight_std"] > 0 for m in logged)


def test_rlsd_live_teacher_rollout_student_trains(tmp_path, tiny_model_dir, monkeypatch):
    logged = _run(tmp_path, tiny_model_dir, ["advantage=rlsd", "advantage.teacher=live",
                                             "advantage.student_logp=rollout", "loss.num_iterations=2"], monkeypatch)
    assert len(logged) == 2 and all(m["rlsd/lambda"] > 0 for m in logged)


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_on_the_embedded_default(tmp_path):
    """The commands of docs/self-distillation.md, on the embedded default (built into the cache when missing)."""
    for extra in (["advantage=rlsd"], ["advantage=grpo", "+loss_term=[sdpg_opd,sdpg_ref_kl]"]):
        proc = subprocess.run([sys.executable, "-m", "grail_exp.run", *extra, "debug=fast", "logger=none",
                               f"paths.root_dir={tmp_path}", "trainer.eval_before_training=false"],
                              capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "eval/arithmetic/acc" in proc.stdout + proc.stderr


@pytest.mark.parametrize("experiment", ["rlsd/official", "rlsd/cpu", "sdpg/qwen3_4b", "sdpg/cpu"])
def test_recipes_compose_and_validate(experiment):
    from grail_exp.validate import validate

    cfg = validate(compose([f"experiment={experiment}"]))
    if experiment.startswith("rlsd"):
        assert cfg.advantage.name == "rlsd" and cfg.advantage.lambda_decay_steps == 60
        assert cfg.advantage.teacher == "frozen" and cfg.advantage.teacher_sync_every == 20
    else:
        assert cfg.advantage.name == "grpo" and set(cfg.loss.terms) == {"sdpg_opd", "sdpg_ref_kl"}
        assert cfg.loss.terms.sdpg_opd.beta == cfg.loss.terms.sdpg_ref_kl.alpha == 1e-3
        t = cfg.trainer  # T counts rollout batches: max_steps / (mu x k) (interpolation)
        assert cfg.loss.terms.sdpg_opd.total_steps * cfg.loss.num_iterations * t.mini_batches_per_rollout == t.max_steps
