"""One rank of the multi-rank load test (tests/test_host_memory.py): ``python load_rank.py <out.json> <overrides...>``
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, as a launcher sets them.

The rank loads the run's policy the way the job does (``job.build_parts``, before any process group), joins a gloo
process group, and lets the update backend place it (``configure_model``, as Lightning calls it in fit). It writes:

- ``growth``: the peak resident set of the load above the resident set just before it (``VmHWM`` reset through
  ``/proc/self/clear_refs`` after every import, the tokenizer loaded beforehand), bytes;
- ``params``, ``largest``: the policy's parameter count and its largest tensor in bytes of the loaded dtype;
- ``start_sha256`` (rank 0): the weights it loaded, hashed before placement; ``placed_sha256``: the full weights after
  placement (gathered from the shards under FSDP), hashed — the same on every rank when placement is right;
- ``start_buffers_sha256`` / ``placed_buffers_sha256``: the same for the buffers (non-persistent RoPE tables included).
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def weights_sha256(pairs) -> str:
    h = hashlib.sha256()
    for name, t in pairs:
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out: str, overrides: list[str]) -> None:
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir

    import grail_exp.models.loading as models
    from grail_exp import job
    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.distributed import launch_rank
    from grail_exp.tracking import NullTracker
    from grail_exp.training.backends import BACKENDS

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    rank = launch_rank()
    path = models.resolve_model_path(cfg)  # rank 0 wrote the random-init directory before the others started
    tokenizer = models.load_tokenizer(path, cfg)
    models.load_tokenizer = lambda *a, **k: tokenizer  # loaded above, outside the measured span
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS") * 1024

    parts = job.build_parts(cfg, None, None, NullTracker(), {}, time.perf_counter())
    policy = parts.policy
    start = weights_sha256(policy.state_dict().items()) if rank == 0 else None
    start_buffers = weights_sha256(policy.named_buffers()) if rank == 0 else None  # the RoPE tables are not in it
    if rank == 0:  # the hash's own buffers are not the load's
        gc.collect()
    dist.init_process_group("gloo")
    backend = BACKENDS[str(cfg.trainer.strategy)](cfg, SimpleNamespace(policy=policy))
    backend.configure_model(policy)
    gc.collect()
    growth = status_kib("VmHWM") * 1024 - before
    placed = weights_sha256(backend.full_tensors())
    placed_buffers = weights_sha256(policy.named_buffers())
    params = sum(p.numel() for p in policy.parameters())
    largest = max(t.numel() * t.element_size() for t in policy.state_dict().values())
    Path(out).write_text(json.dumps({"rank": rank, "growth": growth, "params": params, "largest": largest,
                                     "start_sha256": start, "placed_sha256": placed,
                                     "start_buffers_sha256": start_buffers, "placed_buffers_sha256": placed_buffers}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
