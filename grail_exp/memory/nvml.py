"""A CUDA device's free and total memory without creating a CUDA context on it.

``torch.cuda.mem_get_info(k)`` initialises CUDA and opens a context on device k (~0.5 GiB of that device, for the life
of the process). The plan asks for free memory before training, in every task of a job (``validate``) and in the
preflight's launching process; a context there sits on the device for the whole run, and when the local rank is not
known yet, all of a node's tasks open theirs on device 0. NVML (the library behind ``nvidia-smi``, through the
``nvidia-ml-py`` package of the ``gpu`` extra) reads the same counters without any context. Imported only on a CUDA
path: a CPU run never loads it.
"""

from __future__ import annotations

import os


def local_device() -> int:
    """The CUDA device index this process trains on: ``LOCAL_RANK`` (torchrun, Lightning's launcher, or
    ``distributed.export_local_rank`` under srun), else ``SLURM_LOCALID`` of a multi-task SLURM step, else 0."""
    if os.environ.get("LOCAL_RANK"):
        return int(os.environ["LOCAL_RANK"])
    if os.environ.get("SLURM_LOCALID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_LOCALID"])
    return 0


def nvml_index(cuda_index: int) -> int:
    """NVML numbers the node's devices physically; CUDA numbers those ``CUDA_VISIBLE_DEVICES`` lists (indices or
    UUIDs). torch's own translation (``torch.cuda._get_nvml_device_index``, what ``torch.cuda.device_memory_used``
    uses) for an explicit index, which needs no context."""
    import torch

    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return cuda_index
    return int(torch.cuda._get_nvml_device_index(cuda_index))


def free_memory(cuda_index: int) -> tuple[float, float, str]:
    """(free bytes, total bytes, where from) of CUDA device ``cuda_index``: NVML when ``nvidia-ml-py`` is installed
    and answers; otherwise ``torch.cuda.mem_get_info``, which opens a context on that device (said in the source)."""
    import torch

    GiB = 2**30
    try:
        import pynvml
    except ImportError:
        pynvml, why = None, "nvidia-ml-py is not installed (pip install -e '.[gpu]')"
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(nvml_index(cuda_index)))
                free, total = float(info.free), float(info.total)
            finally:
                pynvml.nvmlShutdown()
            return free, total, f"NVML, cuda:{cuda_index}: {free / GiB:.1f} of {total / GiB:.1f} GiB free"
        except Exception as exc:  # noqa: BLE001 - no driver library, MIG, an unknown UUID: CUDA's own count below
            why = f"NVML failed ({type(exc).__name__}: {exc})"
    free, total = torch.cuda.mem_get_info(cuda_index)
    return float(free), float(total), (f"torch.cuda.mem_get_info({cuda_index}): {free / GiB:.1f} of {total / GiB:.1f} "
                                       f"GiB free; {why}, so this opened a CUDA context on device {cuda_index}")
