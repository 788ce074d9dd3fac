"""Probes of the checkpoint tests (``GRAIL_EXP_PROBE=helpers.checkpoint_probe:<Name>``, ``PYTHONPATH=tests``); each
rank writes one JSON line per point to ``$GRAIL_EXP_PROBE_DIR/rank<r>.jsonl``.

- ``HostMemoryProbe``: the host memory a checkpoint write adds on each rank. At the optimiser step just before the
  checkpoint it resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` 5: VmHWM := VmRSS) and records VmRSS and
  the bytes of this rank's shards (parameters + optimiser state); after the checkpoint it records VmHWM. The growth
  ``VmHWM - VmRSS`` is the peak the write itself added.
- ``StateDigestProbe``: a digest of the full model and optimiser state (gathered through torch's own full state dict
  API, keyed by parameter name: the same on any world size) when a checkpoint is written and once a resumed run has
  restored one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from helpers.load_rank import status_kib
from helpers.probe_writer import JsonlProbe


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


_Probe = JsonlProbe


class HostMemoryProbe(_Probe):
    def step(self, module, step):
        import gc

        opt = module.optimizers()
        opt = getattr(opt, "optimizer", opt)
        shard = sum(_local_bytes(p) for p in module.policy.parameters())
        shard += sum(_local_bytes(v) for s in opt.state.values() for v in s.values())
        full_params = sum(p.numel() * 4 for p in module.policy.parameters())  # fp32 (FSDP's master weights)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        self._write("step", step=step, rss_kb=status_kib("VmRSS"), hwm_kb=status_kib("VmHWM"), shard_bytes=shard,
                    full_param_bytes=full_params)

    def checkpointed(self, module, path):
        self._write("checkpointed", hwm_kb=status_kib("VmHWM"), rss_kb=status_kib("VmRSS"))


def _digest(module) -> dict:
    """sha256 of the full parameters and of the full optimiser state, by name (collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opt = module.optimizers()
    opt = getattr(opt, "optimizer", opt)
    policy = module.policy
    full = StateDictOptions(full_state_dict=True)
    model_sd = get_model_state_dict(policy, options=full)
    optim_sd = get_optimizer_state_dict(policy, opt, options=full)
    h_model, h_optim = hashlib.sha256(), hashlib.sha256()
    for name in sorted(model_sd):
        h_model.update(name.encode() + model_sd[name].detach().float().contiguous().numpy().tobytes())
    for name in sorted(optim_sd["state"]):
        for key in sorted(optim_sd["state"][name]):
            v = optim_sd["state"][name][key]
            v = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            h_optim.update(f"{name}/{key}".encode() + v.detach().float().contiguous().numpy().tobytes())
    return {"model": h_model.hexdigest(), "optimizer": h_optim.hexdigest()}


class StateDigestProbe(_Probe):
    def checkpointed(self, module, path):
        self._write("checkpointed", step=module.step, path=str(path), **_digest(module))

    def restored(self, module):
        self._write("restored", step=module.step, **_digest(module))
