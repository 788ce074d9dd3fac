"""The probe of the teardown test (``GRAIL_EXP_PROBE=helpers.teardown_probe:DeviceStandIn``, ``PYTHONPATH=tests``):
once the run's closing is done (``closed``), the policy's parameters and every optimiser-state tensor move to the
``meta`` device, standing in for a GPU's memory: a tensor there cannot be copied to the host
(``NotImplementedError: Cannot copy out of meta tensor``), as the host has no room for a GPU node's model state. A
teardown that copies the model or the optimiser state to the CPU then fails the job exactly where the copy would
exhaust a GPU node's host memory: after the final checkpoint and evaluation, before ``metrics.json``."""

from __future__ import annotations

import torch

from helpers.probe_writer import JsonlProbe


def to_meta(value):
    return torch.empty_like(value, device="meta") if isinstance(value, torch.Tensor) else value


class DeviceStandIn(JsonlProbe):
    def closed(self, module):
        optimizers = module.trainer.strategy.optimizers
        moved = 0
        for opt in optimizers:
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = to_meta(value)
                        moved += 1
        module.policy.to("meta")
        self._write("closed", optimizer_tensors_on_meta=moved,
                    policy_device=str(next(module.policy.parameters()).device))
