"""The end of a fit, measured (grail_exp/device_teardown.py; `bash sweeps/gpu_checks.sh cardchecks` on a GPU): one
short training job in this process, then the host's resident set before, at the end of the closing and after the fit,
and where the optimiser state and the policy are once the fit is over.

    python sweeps/teardown_check.py device|lightning <run overrides ...> paths.output_dir=<dir>

``device``: the project's teardown (nothing copied to the host: the optimiser state freed, the policy left on its
device). ``lightning``: Lightning's own teardown in its place (the mixin stepped over, as before it existed): the
optimiser state and the module copied to the CPU — on a GPU the resident set grows by the model state after the fit.
Prints one JSON line; writes it to ``$TEARDOWN_OUT`` too when set.
"""

from __future__ import annotations

import json
import os
import resource
import sys

GiB = 2**30


class Recorder:
    """The probe (``GRAIL_EXP_PROBE=__main__:Recorder``): what the job holds when its closing is done."""

    seen: dict = {}

    def started(self, module):
        from grail_exp.preflight.probe import resident_bytes

        Recorder.seen["rss_started_gib"] = resident_bytes() / GiB

    def closed(self, module):
        from grail_exp.preflight.probe import resident_bytes

        Recorder.seen.update(rss_closed_gib=resident_bytes() / GiB, cuda_closed_gib=_cuda_allocated() / GiB,
                             optimizer_state_devices_closed=_state_devices(module.trainer.strategy.optimizers))
        Recorder.optimizers, Recorder.policy = list(module.trainer.strategy.optimizers), module.policy


def _cuda_allocated() -> float:
    import torch

    return float(torch.cuda.memory_allocated()) if torch.cuda.is_available() and torch.cuda.is_initialized() else 0.0


def _state_devices(optimizers) -> list[str]:
    import torch

    return sorted({str(v.device) for o in optimizers for state in o.state.values() for k, v in state.items()
                   if isinstance(v, torch.Tensor) and k != "step"})


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def main(argv: list[str]) -> dict:
    mode, overrides = argv[0], argv[1:]
    if mode not in ("device", "lightning"):
        raise SystemExit("usage: python sweeps/teardown_check.py device|lightning <run overrides ...>")
    if mode == "lightning":
        from grail_exp.device_teardown import DeviceResidentTeardown

        DeviceResidentTeardown.teardown = lambda self: super(DeviceResidentTeardown, self).teardown()
    os.environ["GRAIL_EXP_PROBE"] = "__main__:Recorder"
    from grail_exp.job import run
    from grail_exp.preflight.probe import resident_bytes

    cfg = compose(overrides)
    before = resident_bytes()
    run(cfg)
    opts = Recorder.optimizers
    out = {"mode": mode, "rss_before_fit_gib": before / GiB, **Recorder.seen,
           "rss_after_fit_gib": resident_bytes() / GiB,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB,
           "cuda_after_fit_gib": _cuda_allocated() / GiB,
           "optimizer_state_entries_after_fit": sum(len(o.state) for o in opts),
           "optimizer_state_devices_after_fit": _state_devices(opts),
           "policy_device_after_fit": str(next(Recorder.policy.parameters()).device)}
    line = json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()})
    print(line, flush=True)
    if os.environ.get("TEARDOWN_OUT"):
        with open(os.environ["TEARDOWN_OUT"], "a") as f:
            f.write(line + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
