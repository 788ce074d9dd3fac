"""What the module calls between optimiser steps and when (``training.module.StepHooks``, handed to it at
construction), and the job's hooks (``job.TrainingHooks``, built from the evaluator, the saver and the stop signals).
The expected orders are written out from the schedule the config states (``trainer.eval_every``,
``checkpoint_every``, ``save_weights_only_every``, ``max_steps``), step by step, by hand."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from grail_exp import world
from grail_exp.training.module import RLVRModule, StepHooks

PKG = Path(__file__).resolve().parents[1] / "grail_exp"


class Recorder(StepHooks):
    """Every call, in order; no stop requested."""

    def __init__(self):
        self.events: list = []

    def evaluate(self, module, step):
        self.events.append(("evaluate", step))

    def checkpoint(self, module, position):
        self.events.append(("checkpoint", position["round"]))

    def trajectory(self, module, step):
        self.events.append(("trajectory", step))

    def stop_requested(self, module):
        self.events.append("stop?")
        return 0


def test_the_module_calls_its_hooks_on_the_configured_steps(monkeypatch):
    """max_steps=4, eval_every=2, checkpoint_every=3, save_weights_only_every=2, one optimiser step per round:
    step 1 nothing but the stop question; step 2 evaluation, trajectory; step 3 checkpoint (of round 3's end);
    step 4 the trajectory only (the last step's evaluation is the closing's, not the module's)."""
    monkeypatch.setattr(world, "max_over_ranks", lambda sig: sig)  # one process
    cfg = OmegaConf.create({"trainer": {"log_every": 1, "max_steps": 4, "eval_every": 2, "checkpoint_every": 3,
                                        "save_weights_only_every": 2}, "advantage": {"name": "grpo"}})
    hooks = Recorder()
    quiet = SimpleNamespace(progress_line=lambda *a: None, log_sample_table=lambda *a: None,
                            log_weight_table=lambda *a: None)
    module = SimpleNamespace(cfg=cfg, rank=0, hooks=hooks, records=quiet,
                             rollout=SimpleNamespace(verifier=SimpleNamespace(counters={}), samples=[]),
                             update=SimpleNamespace(steps_per_rollout=1),
                             tracker=SimpleNamespace(log_metrics=lambda *a, **k: None), log_dict=lambda *a, **k: None)
    for step in (1, 2, 3, 4):
        RLVRModule._after_step(module, step, {"loss": 0.5}, None, {"reward/mean": 0.25}, round_index=step - 1, index=0)
    assert hooks.events == ["stop?",
                            ("evaluate", 2), "stop?", ("trajectory", 2),
                            "stop?", ("checkpoint", 3),
                            "stop?", ("trajectory", 4)]


def _job_hooks(state=None):
    from grail_exp.job import TrainingHooks
    from grail_exp.preemption import current

    events: list = []
    phase = lambda: current().phase if current() is not None else None  # noqa: E731

    def evaluator(module, tag, step):
        events.append(("evaluate", tag, step, phase()))
        return {"eval/acc": 0.5 if tag == "before" else 0.75}

    saver = SimpleNamespace(
        checkpoint=lambda module, position, final=False: events.append(("checkpoint", module.step, final, phase())),
        trajectory=lambda module, step: events.append(("trajectory", step, phase())))
    cfg = OmegaConf.create({"trainer": {"eval_before_training": True, "save_final_checkpoint": True,
                                        "save_weights_only_every": 2, "eval_at_end": True}})
    return TrainingHooks(cfg, evaluator, saver, {}, state), events


def test_the_jobs_hooks_evaluate_before_training_then_take_stop_requests_and_close_in_order():
    """start: the evaluation before training while a signal still ends the job at once ("starting"), then "training";
    end: "closing" first (a signal no longer stops the final writes), then the final checkpoint, the trajectory's last
    step and the final evaluation; both evaluations land in ``results``."""
    from grail_exp.preemption import StopSignals

    hooks, events = _job_hooks()
    module = SimpleNamespace(step=4, position={"round": 4, "buffer": None})
    stops = StopSignals().install()
    try:
        hooks.start(module)
        assert stops.phase == "training" and stops.on_request == hooks.request
        hooks.request(15)
        assert hooks.stop_requested(module) == 15
        hooks.end(module)
    finally:
        stops.uninstall()
    assert events == [("evaluate", "before", 0, "starting"), ("checkpoint", 4, True, "closing"),
                      ("trajectory", 4, "closing"), ("evaluate", "final", 4, "closing")]
    assert hooks.results == {"eval_before/acc": 0.5, "eval/acc": 0.75}


def test_a_resumed_run_does_not_evaluate_before_training_again():
    hooks, events = _job_hooks(state={"step": 2})
    hooks.start(SimpleNamespace())
    assert events == [] and hooks.results == {}


def test_the_module_is_built_whole():
    """Everything the module calls is handed to it at construction: at most 8 constructor parameters, and the job
    assigns no attribute of the module after building it; the job's body stays one screen (at most 50 lines)."""
    params = [p for p in inspect.signature(RLVRModule.__init__).parameters if p != "self"]
    assert len(params) <= 8, params
    job = ast.parse((PKG / "job.py").read_text())
    wired = [ast.unparse(t) for n in ast.walk(job) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("module", "m")]
    assert not wired, f"job.py wires the module after construction: {wired}"
    body = next(n for n in job.body if isinstance(n, ast.FunctionDef) and n.name == "_train")
    assert body.end_lineno - body.lineno + 1 <= 50
