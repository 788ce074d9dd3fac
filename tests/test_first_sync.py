"""Nothing samples from an engine with its own copy of the weights before the policy's weights reached it.

The vLLM engine is built with vLLM's dummy weights (it reads no weights file) and the first sync fills them. The job
must sync before everything that samples: the evaluation before training, the first rollout, the evaluations during
and after training — and, on resume, before the first sampling of the resumed process, which may come after a half-used
rollout batch is finished without any rollout. ``helpers.fakes:OwnCopyEngine`` has that contract without vLLM: a
copy of the policy that starts from random weights, takes the streamed chunks of ``load_weights`` (as the update
backend streams them to vLLM) and refuses to generate before the first. A job that sampled before syncing fails here;
the order of its calls is read from the engine's event file.
"""

from __future__ import annotations

from helpers.compose import compose


def _run(run_dir, model_dir, events, monkeypatch, extra):
    from grail_exp.run import run

    monkeypatch.setenv("GRAIL_EXP_ENGINE_EVENTS", str(events))
    cfg = compose([f"model.name_or_path={model_dir}", f"paths.output_dir={run_dir}", "logger=none",
                   "rollout.engine=helpers.fakes:OwnCopyEngine", "trainer.prompts_per_step=2",
                   "rollout.num_generations=2", "trainer.micro_batch_size=4", "rollout.max_completion_length=6",
                   "loss.num_iterations=2", "trainer.eval_every=1", "benchmark.limit=2", "eval.n=1",
                   "eval.max_tokens=6", "trainer.sample_table_every=0", "reward.num_workers=0", *extra],
                  run_dir.parent)
    run(cfg)
    return events.read_text().split("\n")[:-1]


def test_the_engine_is_synced_before_anything_samples_from_it_fresh_and_resumed(tmp_path, tiny_model_dir, monkeypatch):
    run_dir = tmp_path / "run"
    # Fresh: the evaluation before training, the first rollout (round 0 of two optimiser steps, mu = 2), an evaluation
    # after step 1, and the run stops there (max_steps=1) inside the rollout batch: its final checkpoint keeps the
    # half-used batch.
    first = _run(run_dir, tiny_model_dir, tmp_path / "fresh.txt", monkeypatch, ["trainer.max_steps=1"])
    assert first[0] == "load" and "generate before any load" not in first, first
    assert first.count("load") >= 3  # before: the evaluation before training, the rollout, the final evaluation
    # Resumed: step 2 comes from the saved half-used batch (no rollout), then the final evaluation samples.
    second = _run(run_dir, tiny_model_dir, tmp_path / "resumed.txt", monkeypatch, ["trainer.max_steps=2",
                                                                                  "resume=auto"])
    assert second[0] == "load" and "generate before any load" not in second and "generate" in second, second
