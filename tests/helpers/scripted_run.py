"""``python -m grail_exp.run`` in a child process on the pinned step's tiny model with the scripted engine
(``helpers.fakes:ScriptedEngine``: completions depend only on the prompt), so that one process and N gloo ranks train
on identical rollouts; and what the comparisons of their parameters may differ by.

AdamW with eps = 1 and lr = 1 makes the first update ≈ the gradient itself, so a comparison after one step is of
gradients, not of Adam's sign-like first step. Runs are judged by the checkpoint rank 0 wrote (a gloo worker may abort
after finishing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.tolerances import HANG_TIMEOUT_S, MODEL_REORDER

TESTS = Path(__file__).resolve().parents[1]


def run_scripted(run_dir: Path, model_dir: Path, extra: list[str], probe_dir: Path | None = None,
                 probe: str = "helpers.card_probe:WorldProbe") -> subprocess.CompletedProcess:
    """One optimiser step (unless ``extra`` says otherwise) of 4 prompts x 4 rollouts, no evaluation, into
    ``run_dir``. ``probe_dir``: every rank records there what ``probe`` writes (by default its world)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    if probe_dir is not None:
        env.update(GRAIL_EXP_PROBE=probe, GRAIL_EXP_PROBE_DIR=str(probe_dir))
    args = ["logger=none", "rollout.engine=helpers.fakes:ScriptedEngine", f"model.name_or_path={model_dir}",
            "trainer.max_steps=1", "trainer.prompts_per_step=4", "rollout.num_generations=4",
            "trainer.micro_batch_size=8", "trainer.eval_before_training=false", "trainer.eval_at_end=false",
            "optim.lr=1.0", "optim.eps=1.0", "optim.max_grad_norm=null", f"paths.root_dir={run_dir.parent}",
            f"hydra.run.dir={run_dir}", *extra]
    return subprocess.run([sys.executable, "-m", "grail_exp.run", *args], env=env, capture_output=True, text=True,
                          timeout=HANG_TIMEOUT_S)


def rank_tolerance(moved: float) -> float:
    """Parameters after one step of ranks vs one process. The ranks sum the same per-token gradients in another
    order (their own micro-batches, then the all-reduce / reduce-scatter): each gradient entry moves by
    <= MODEL_REORDER of its terms' scale (x2 for cancellation). AdamW's first step with optim.lr=1, optim.eps=1 is
    g / (|g| + 1): it moves by at most as much as g, and that is <= the largest update. Measured (AVX-512 EPYC):
    7.5e-9 for an update of 0.025."""
    return 2 * MODEL_REORDER * moved


def step_weights(run_dir: Path, out: subprocess.CompletedProcess) -> dict:
    """The weights of the run's step-1 checkpoint (the run's output in the message when there is none)."""
    from safetensors.torch import load_file

    path = run_dir / "checkpoints" / "step-1" / "model.safetensors"
    assert path.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return load_file(path)
