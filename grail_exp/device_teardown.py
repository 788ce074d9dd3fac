"""The end of a fit on the device: Lightning's strategy teardown without its copy to the host.

Lightning's ``Strategy.teardown`` (2.6: ``lightning/pytorch/strategies/strategy.py``, reached from the DDP and
single-device strategies alike) moves every optimiser-state tensor and then the whole LightningModule to the CPU, on
every rank, at the end of every fit — a finished one, a stopped one (the stop signal's checkpoint) and a failed one.
On the CPU that is a no-op; on a GPU node it copies the full model state of every rank into host memory at once:
for Qwen3-8B under ``trainer=fsdp_zero2`` on 4 ranks about 92 GiB per node (about 122 GiB with DeepSpeed), against
the ~46 GB ``--mem`` the plan asks SLURM for, so the job is killed after its final checkpoint and evaluation but
before ``metrics.json``, the plots and the study's arm record, and a stopped job dies before it hands itself back
for requeue. Nothing of this project reads the model after the fit: the closing (final checkpoint, trajectory,
evaluation) runs inside it (``RLVRModule.on_train_end``), and what follows (``job.finish``) reads only numbers.

So the teardown here keeps every tensor where it is and frees what the fit no longer needs: each optimiser's state
(the Adam moments: 8 bytes per trained parameter, sharded or not) and the gradients, then Lightning's own accelerator
teardown, which on CUDA empties the caching allocator (``torch.cuda.empty_cache``). The parameters stay on the device
until the job's process ends (or, in one process running several trials, until the module is collected).
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

log = logging.getLogger("grail_exp.distributed")


def release_optimizers(optimizers) -> None:
    """Free each optimiser's state and the gradients of its parameters, on whatever device they are."""
    for opt in optimizers:
        opt.state.clear()
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None


class DeviceResidentTeardown:
    """Mixin for a Lightning strategy (before the strategy in the bases): ``teardown`` as Lightning's, without
    ``_optimizers_to_device(..., cpu)`` and ``lightning_module.cpu()``; the optimisers' state and the gradients are
    freed instead.

    What Lightning's teardown chain does besides the copy is kept: the DDP strategy's unwrapping of a
    ``DistributedDataParallel`` wrapper and revert of a sync-batchnorm layer conversion (``DDPStrategy.teardown``; this
    project wraps nothing and converts no layer, but the code stays correct if one day it does), the cluster
    environment's teardown (``ParallelStrategy.teardown``), then the precision plugin's, the accelerator's (on CUDA:
    the cache emptied) and the checkpoint IO's (``Strategy.teardown``)."""

    def teardown(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = module
        layer_sync = getattr(self, "_layer_sync", None)
        if layer_sync is not None and module is not None and module._trainer is not None \
                and module._trainer.state.fn == "fit":
            self.model = layer_sync.revert(self.model)
        release_optimizers(self.optimizers)
        log.debug("%s: teardown on the device (optimiser state freed, nothing copied to the host)",
                  type(self).__name__)
        if getattr(self, "cluster_environment", None) is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()


class DeviceResidentSingleDeviceStrategy(DeviceResidentTeardown, SingleDeviceStrategy):
    """Lightning's single-process strategy (what ``strategy="auto"`` picks for one device) with the teardown above."""

    strategy_name = "grail_single_device"


def single_device(accelerator: str, devices) -> torch.device:
    """The device Lightning's ``strategy="auto"`` runs one process on, for ``trainer.accelerator`` and
    ``trainer.devices``: the first device Lightning's accelerator parses from ``devices`` (``cuda:0`` for
    ``devices=1``, ``cuda:2`` for ``devices=[2]``), or the CPU. ``gpu`` means CUDA here (NCCL, vLLM); ``auto`` is
    CUDA when a CUDA device is visible. Asks no CUDA context into being (the device count comes from NVML)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    name = device_type(accelerator)
    if name == "cpu":
        return torch.device("cpu")
    acc = AcceleratorRegistry.get(name)
    return acc.get_parallel_devices(acc.parse_devices(devices))[0]


def device_type(accelerator: str) -> str:
    """The device type ``trainer.accelerator`` trains on: ``cpu``, ``cuda`` for ``gpu`` / ``cuda``, and for ``auto``
    CUDA when a CUDA device is visible (counted through NVML: no context), else the CPU."""
    from lightning.pytorch.accelerators import CUDAAccelerator

    name = str(accelerator)
    if name == "auto":
        return "cuda" if CUDAAccelerator.is_available() else "cpu"
    return {"gpu": "cuda"}.get(name, name)
