"""The process-group timeout a run needs (``trainer.dist_timeout_s``), from its parameter count alone.

A rank that waits in a collective longer than the group's timeout aborts the run (NCCL's watchdog, gloo's wait). The
longest wait a run plans is a checkpoint: its state is gathered and written while the other ranks wait in the next
collective. So the timeout is what writing the planned checkpoint takes on slow shared storage, with a margin, and
never less than torch's and Lightning's default of 30 minutes:

    timeout = max(1800 s, 2 x checkpoint bytes / 100 MB/s), rounded up to a whole minute
    checkpoint bytes = 16 B x N  (weights as if fp32 4 B + fp32 master weights 4 B + Adam's two moments 8 B)

Qwen3-8B (N = 8.19 B): 131.1 GB, 2 x 1311 s -> 2640 s. Every model under ~5.6 B parameters gets the 1800 s floor.

The same write, after the longest optimiser step a stop waits for, sets how long before a SLURM job's time limit its
stop signal comes (``stop_lead``; the step planned by ``memory.planned_step_seconds``, the lead by the launcher in
hydra_plugins/grail_exp_launchers).

This module imports nothing of the package, so the memory planner (which prints the rule: ``memory.timeout_lines``),
the Lightning strategy (``distributed.build_strategy``) and the update backends (DeepSpeed's own group) share it.
"""

from __future__ import annotations

import math
from datetime import timedelta

# torch's default process-group timeout (gloo; NCCL's own is 10 minutes) and Lightning's: a run never waits less.
DIST_TIMEOUT_FLOOR_S = 1800
# A conservative write bandwidth: NFS over 1 Gb/s Ethernet (~110 MB/s), the slowest shared storage a cluster commonly
# has; parallel filesystems (Lustre, GPFS) and local NVMe write one to two orders of magnitude faster.
CHECKPOINT_WRITE_BYTES_PER_S = 100e6
# Serialising and fsync, the gather before the write, a filesystem shared with other jobs.
CHECKPOINT_WRITE_MARGIN = 2
CHECKPOINT_BYTES_PER_PARAMETER = 16  # weights <= 4 B + fp32 master weights 4 B + Adam moments 8 B


# SLURM's stop signal (USR2, hydra/launcher=submitit_slurm) comes this long before the time limit: at least
# STOP_LEAD_FLOOR_S (what the launcher gave every job before the lead followed the plan), else
# CHECKPOINT_WRITE_MARGIN x (the longest step a stop waits for + the planned checkpoint write), in whole minutes.
STOP_LEAD_FLOOR_S = 600
# The compute rate the stop lead plans a step at, per rank: a quarter of a dense rate measured in this project, because
# generation decodes far below it and the schemes add passes of their own. GPU: one H100 ran the no-grad log-prob
# forward at Qwen3-8B width at ~450 TFLOP/s (bf16; results/gpu.md, 2026-11-27: 2 x 2.79 B x 69,632 tokens in 0.868 s);
# CPU: the 2-core machine's matmul floor, 402-428 GFLOP/s at 2 threads (results/bench_real_model.md).
PLANNED_STEP_FLOPS_PER_S = {"gpu": 100e12, "cpu": 100e9}


def stop_lead(step_seconds: float, params: int | None) -> tuple[int, str]:
    """(seconds, how): how long before its time limit a job must get its stop signal to finish the step it is in
    (``step_seconds``, planned) and write its checkpoint at the conservative bandwidth (``planned_checkpoint_bytes``),
    with the write's margin, never under ``STOP_LEAD_FLOOR_S``."""
    size, _ = planned_checkpoint_bytes(params) if params is not None else (0.0, "")
    write = size / CHECKPOINT_WRITE_BYTES_PER_S
    need = CHECKPOINT_WRITE_MARGIN * (step_seconds + write)
    seconds = max(STOP_LEAD_FLOOR_S, 60 * math.ceil(need / 60))
    return seconds, (f"max({STOP_LEAD_FLOOR_S} s, {CHECKPOINT_WRITE_MARGIN} x (a step {step_seconds:.0f} s + the "
                     f"checkpoint's {size / 1e9:.1f} GB / {CHECKPOINT_WRITE_BYTES_PER_S / 1e6:g} MB/s = {write:.0f} s)"
                     ") in whole minutes")


def planned_checkpoint_bytes(params: int) -> tuple[float, str]:
    """(bytes, how) of one checkpoint of a model with ``params`` parameters: an upper bound, the policy's weights
    counted as fp32 (bf16 ones are half), the fp32 master weights (none for an fp32 model) and Adam's two fp32 moments."""
    return (float(CHECKPOINT_BYTES_PER_PARAMETER * params),
            f"{CHECKPOINT_BYTES_PER_PARAMETER} B x N {params:,} (weights <= 4 B + fp32 masters 4 B + Adam moments 8 B "
            "per parameter)")


def needed_dist_timeout(params: int | None) -> tuple[int, str]:
    """(seconds, how): the process-group timeout that the planned checkpoint write of a ``params``-parameter model
    needs (the module's rule); ``params`` None (a model whose size is unknown) gets the floor."""
    if params is None:
        return DIST_TIMEOUT_FLOOR_S, f"the floor {DIST_TIMEOUT_FLOOR_S} s (the model's size is unknown)"
    size, how = planned_checkpoint_bytes(params)
    write = CHECKPOINT_WRITE_MARGIN * size / CHECKPOINT_WRITE_BYTES_PER_S
    seconds = max(DIST_TIMEOUT_FLOOR_S, 60 * math.ceil(write / 60))
    bandwidth = f"{CHECKPOINT_WRITE_BYTES_PER_S / 1e6:g} MB/s"
    return seconds, (f"max({DIST_TIMEOUT_FLOOR_S} s, {CHECKPOINT_WRITE_MARGIN} x the checkpoint's {size / 1e9:.1f} GB"
                     f" / {bandwidth} = {write:.0f} s) in whole minutes; checkpoint: {how}")


def dist_timeout(configured: int | None, params: int | None) -> timedelta:
    """The timeout of a process group the run creates: ``trainer.dist_timeout_s`` (``configured``), or, when null,
    what the planned checkpoint of a ``params``-parameter model needs."""
    seconds = configured if configured is not None else needed_dist_timeout(params)[0]
    return timedelta(seconds=int(seconds))
