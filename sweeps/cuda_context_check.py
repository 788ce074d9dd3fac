"""No CUDA context before training (grail_exp/memory/nvml.py; `bash sweeps/gpu_checks.sh cardchecks` on a GPU).

    python sweeps/cuda_context_check.py nvml|cuda <run overrides ...>

Runs as task 1 of a 2-task srun step would start (``SLURM_LOCALID=1``, ``SLURM_NTASKS=2``, no ``LOCAL_RANK``): the
job's own start (``grail_exp.job.run``: the local rank exported, then ``validate()`` with its memory plan), with the
training replaced by the check, which records ``LOCAL_RANK``, whether torch initialised CUDA, the devices on which
``nvidia-smi`` lists this process (a context), and where the plan's free memory came from. ``nvml``: as the job runs
(nvidia-ml-py asked, no context anywhere); ``cuda``: nvidia-ml-py hidden, so the plan falls back on
``torch.cuda.mem_get_info`` of the rank's device, which opens a context there — the contrast that shows the check sees
a context when there is one. Prints one JSON line; writes it to ``$CONTEXT_OUT`` too when set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


def contexts_of_this_process() -> list[str] | None:
    """The GPUs (index) on which ``nvidia-smi`` lists this process as a compute app; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                           text=True).stdout
    index = {u.strip(): i.strip() for i, u in (line.split(",") for line in uuids.splitlines() if "," in line)}
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    return sorted(index.get(u.strip(), u.strip()) for p, u in (line.split(",") for line in apps.splitlines()
                                                                if "," in line) if int(p) == os.getpid())


def main(argv: list[str]) -> dict:
    mode, overrides = argv[0], argv[1:]
    if mode not in ("nvml", "cuda"):
        raise SystemExit("usage: python sweeps/cuda_context_check.py nvml|cuda <run overrides ...>")
    os.environ.pop("LOCAL_RANK", None)
    os.environ.update(SLURM_LOCALID="1", SLURM_NTASKS="2")
    if mode == "cuda":
        sys.modules["pynvml"] = None  # `import pynvml` raises ImportError: the plan's fallback
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from teardown_check import compose

    from grail_exp import job

    seen: dict = {"mode": mode}

    def check_instead_of_training(cfg, on_eval=None):
        import torch

        from grail_exp.memory.plan import device_capacity

        seen.update(local_rank=os.environ.get("LOCAL_RANK"), cuda_initialized=torch.cuda.is_initialized(),
                    contexts_on_gpus=contexts_of_this_process())
        seen["plan_source"] = device_capacity(cfg)[2]  # the same question validate() asked (no context with NVML)
        return {}

    job.train = check_instead_of_training
    job.run(compose(overrides))
    line = json.dumps(seen)
    print(line, flush=True)
    if os.environ.get("CONTEXT_OUT"):
        with open(os.environ["CONTEXT_OUT"], "a") as f:
            f.write(line + "\n")
    return seen


if __name__ == "__main__":
    main(sys.argv[1:])
