"""Launching data-parallel training: the Lightning strategy behind ``trainer.strategy`` and the launch-time rank.

Lightning launches the ranks (its subprocess launcher, torchrun, SLURM) and creates the process group; what happens to
the gradients is the update backend's business (``grail_exp/training/backends``), one per strategy.

``trainer=ddp`` uses ``GradSyncDDPStrategy``: Lightning's DDP process launching and process group (gloo on CPU,
NCCL on GPU; multi-node through the same cluster environments, SLURM included), **without** wrapping the model in
``DistributedDataParallel``. One training step runs several forwards and backwards per optimiser step (micro-batches,
and GRAIL's probe gradient inside the policy forward), which DDP's reducer does not expect inside a single
``training_step``; the local backend instead sums the gradients across ranks with one flat all-reduce per optimiser
step (``training/backends/local.py``) — what DDP with ``no_sync`` on every micro-batch but the last computes.

``trainer=fsdp`` shards the policy with FSDP2 under the same launcher (``training/backends/fsdp.py``).

``trainer=deepspeed_zero2`` is the paper's own setup, DeepSpeed ZeRO-2, launched the same way: the backend builds the
engine itself in DeepSpeed's unmanaged accumulation mode (``training/backends/deepspeed.py``), because Lightning's
DeepSpeedStrategy owns backward, accumulation and the step in a way this trainer's multi-backward step does not fit
(on an H100 it rejected the configuration before training; results/gpu.md). ``trainer=fsdp_zero2`` (FSDP2 with
``reshard_after_forward=False``) is the same memory layout without DeepSpeed.

Forming the world and its processes' lifetime (docs/reliability.md, "Every stop, by signal and phase"): the process
group forms over a store on which every rank announces itself (``rendezvous``), within ``trainer.rendezvous_timeout_s``
(minutes), not the process-group timeout sized for a checkpoint (``trainer.dist_timeout_s``); a world that cannot form
ends in one line naming who arrived and the keys to check. The ranks Lightning starts beside this process die with it
(``RankLauncher``: a parent-death signal, ``preemption.follow_parent``), and it watches them (``RankObserver``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from grail_exp.device_teardown import DeviceResidentSingleDeviceStrategy, DeviceResidentTeardown, single_device

log = logging.getLogger(__name__)

# Seconds between two looks at the rendezvous: each look is one request to rank 0's store, and a stop signal is handled
# between two (the wait itself never blocks in native code for long).
RENDEZVOUS_POLL_S = 0.5
RENDEZVOUS_KEY = "grail_exp/rendezvous"


def launch_rank() -> int:
    """The global rank of this process as the launcher set it, before any process group exists: torchrun / SLURM
    environment variables, or what Lightning's own launcher gives: its global rank is node rank x ranks per node + local
    rank (``LightningEnvironment``), where the node rank is ``NODE_RANK`` (or ``GROUP_RANK``), the ranks per node
    ``GRAIL_EXP_DEVICES_PER_NODE`` (``job.export_devices_per_node``, from ``trainer.devices``) and the local rank
    ``LOCAL_RANK`` — unset in the process that launches a node's ranks, which is its node's local rank 0 (rank 0 only
    on node 0: on node k it is rank k x ranks per node, and must not read the weights, open an MLflow run or write the
    files rank 0 writes). ``check_launch_rank`` compares it with the process group's rank once that exists."""
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            if var == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
                continue  # a single SLURM task launches its ranks itself
            return int(os.environ[var])
    devices = int(os.environ.get("GRAIL_EXP_DEVICES_PER_NODE", "1"))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return node * devices + int(os.environ.get("LOCAL_RANK", "0") or 0)


def check_launch_rank(launched: int, rank: int) -> None:
    """Every rank once the process group exists: the rank it took itself for at launch (``launch_rank``, which decided
    who read the weights and who opened the MLflow run) is its rank in the group; else one ``LayoutError`` line."""
    from grail_exp.errors import LayoutError

    if launched == rank:
        return
    env = ", ".join(f"{k}={os.environ[k]}" for k in ("RANK", "SLURM_PROCID", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK",
                                                      "GRAIL_EXP_DEVICES_PER_NODE") if k in os.environ)
    raise LayoutError(f"this process took itself for rank {launched} when it started ({env or 'no launcher variables'})"
                      f" but is rank {rank} of the process group: the launcher's variables disagree with trainer.devices "
                      "(ranks per node) and trainer.num_nodes; set NODE_RANK on each node and trainer.devices to the "
                      "node's ranks")


def export_local_rank() -> None:
    """Set ``LOCAL_RANK`` from the launcher's environment where none is set, once, before anything reads it.

    torchrun and Lightning's own subprocess launcher set it; ``srun`` with one task per device sets only
    ``SLURM_LOCALID``, while DeepSpeed (its device and ``init_distributed``) and vLLM's external launcher read
    ``LOCAL_RANK``. A single SLURM task launches its ranks itself (Lightning would take a ``LOCAL_RANK`` in its own
    environment to mean the processes were created outside it), so it is left alone, as ``launch_rank`` does."""
    if os.environ.get("LOCAL_RANK"):
        return
    local = os.environ.get("SLURM_LOCALID")
    if local and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        os.environ["LOCAL_RANK"] = local


class GradSyncDDPStrategy(DeviceResidentTeardown, DDPStrategy):
    """DDP's launching, process group and device placement; the update backend reduces the gradients itself. The
    group forms within ``rendezvous_timeout_s`` (``rendezvous``); the ranks it launches die with this process. Its
    teardown leaves the model and the optimiser state on the device (grail_exp/device_teardown.py)."""

    strategy_name = "grail_ddp"

    def __init__(self, *args, rendezvous_timeout_s: float = 600, **kwargs):
        super().__init__(*args, **kwargs)
        self.rendezvous_timeout_s = float(rendezvous_timeout_s)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            self._launcher = RankLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_distributed(self) -> None:
        """The process group over ``rendezvous``'s store. Under torchrun, whose agent formed the world with its own
        bounded rendezvous and hosts the store itself, Lightning's own setup."""
        env = self.cluster_environment
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return super().setup_distributed()
        from lightning.fabric.utilities.distributed import _init_dist_connection
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        timeout = self._timeout or timedelta(minutes=30)
        store = rendezvous(env.main_address, env.main_port, self.global_rank, self.world_size, self.num_processes,
                           self.num_nodes, self.rendezvous_timeout_s, timeout)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(env, self._process_group_backend, timeout=timeout, device_id=device_id, store=store)

    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: start every rank from rank 0's parameters instead (unless the backend's
        # own initialisation gives every rank the same weights: FSDP shards what each rank built).
        from lightning.pytorch.strategies.ddp import _sync_module_states

        backend = getattr(self.model, "backend", None)
        if backend is None or backend.broadcast_initial_weights:
            _sync_module_states(self.model)


def build_strategy(cfg, timeout: timedelta):
    """The Lightning strategy for ``trainer.strategy``: ``auto`` (one process) as Lightning's own single-device
    strategy on the device it would pick; every other update backend's name launches its ranks as DDP does (the backend
    then shards, wraps or reduces by itself), its process group created with ``timeout`` (the caller's
    ``memory.dist_timeout``: the key, or what the planned checkpoint needs). Neither copies the model
    or the optimiser state to the host at the end of the fit (grail_exp/device_teardown.py)."""
    t = cfg.trainer
    name = str(t.strategy)
    if name == "auto":
        return DeviceResidentSingleDeviceStrategy(device=single_device(t.accelerator, t.devices))
    return GradSyncDDPStrategy(process_group_backend=t.get("process_group_backend"), timeout=timeout,
                               rendezvous_timeout_s=t.get("rendezvous_timeout_s", 600))


# ---------------------------------------------------------------------------------------------- forming the world
def rendezvous(address: str, port: int, rank: int, world_size: int, ranks_per_node: int, num_nodes: int,
               timeout_s: float, group_timeout: timedelta):
    """The store the process group forms over, once every rank has arrived: rank 0 hosts it at the master address,
    every rank adds itself and waits for the others at most ``timeout_s`` (``trainer.rendezvous_timeout_s``), looking
    every ``RENDEZVOUS_POLL_S`` (so that a stop signal ends the wait at once). The store then takes the process group's
    timeout. A world that does not form raises ``LayoutError``: who arrived, who did not, and the keys to check."""
    from torch.distributed import TCPStore

    from grail_exp import faults
    from grail_exp.errors import LayoutError
    from grail_exp.preemption import set_stage

    set_stage("the rendezvous (waiting for every rank)")
    faults.ready_at("rendezvous", rank)
    deadline = time.monotonic() + timeout_s
    where = f"{address}:{port}"
    keys = (f"trainer.num_nodes={num_nodes} (is every node's job started?), trainer.devices={ranks_per_node} (ranks "
            f"per node) and the master address {where} (MASTER_ADDR, MASTER_PORT), which every node must reach")
    if rank == 0:
        store = TCPStore(address, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)
    else:
        store = None
        while store is None:  # rank 0 may not listen yet: try in short slices until the deadline
            left = deadline - time.monotonic()
            if left <= 0:
                raise LayoutError(f"rank {rank} (node {rank // ranks_per_node}) could not reach rank 0's store at "
                                  f"{where} within {timeout_s:g} s (trainer.rendezvous_timeout_s): check {keys}")
            try:
                store = TCPStore(address, port, world_size, is_master=False,
                                 timeout=timedelta(seconds=max(0.1, min(2.0, left))))
            except (RuntimeError, OSError):  # torch's DistNetworkError / DistStoreError: not yet
                time.sleep(min(RENDEZVOUS_POLL_S, max(0.0, deadline - time.monotonic())))
    store.set(f"{RENDEZVOUS_KEY}/rank{rank}", socket.gethostname())
    store.add(f"{RENDEZVOUS_KEY}/arrived", 1)
    while True:
        try:
            arrived = store.add(f"{RENDEZVOUS_KEY}/arrived", 0)
        except (RuntimeError, OSError) as exc:  # rank 0 gave up or stopped: its store went with it
            raise LayoutError(f"rank {rank}: rank 0's store at {where} went away during the rendezvous (rank 0 gave up "
                              f"or was stopped: its log says which); check {keys}") from exc
        if arrived >= world_size:
            break
        if time.monotonic() >= deadline:
            raise LayoutError(_not_formed(store, world_size, ranks_per_node, timeout_s, keys))
        time.sleep(RENDEZVOUS_POLL_S)
    store.set_timeout(group_timeout)
    return store


def _not_formed(store, world_size: int, ranks_per_node: int, timeout_s: float, keys: str) -> str:
    """The line of a world that did not form: the ranks that arrived (by node and host) and those that did not."""
    arrived = {r: store.get(f"{RENDEZVOUS_KEY}/rank{r}").decode() for r in range(world_size)
               if store.check([f"{RENDEZVOUS_KEY}/rank{r}"])}
    missing = [r for r in range(world_size) if r not in arrived]

    def by_node(ranks: list[int], hosts: dict[int, str]) -> str:
        nodes: dict[int, list[int]] = {}
        for r in ranks:
            nodes.setdefault(r // ranks_per_node, []).append(r)
        return ", ".join(f"node {n}" + (f" ({hosts[rs[0]]})" if rs[0] in hosts else "") + " rank" +
                         ("s " if len(rs) > 1 else " ") + ",".join(map(str, rs)) for n, rs in sorted(nodes.items()))

    return (f"the process group did not form within {timeout_s:g} s (trainer.rendezvous_timeout_s): {len(arrived)} of "
            f"{world_size} ranks arrived ({by_node(sorted(arrived), arrived)}); missing: {by_node(missing, {})}. "
            f"Check {keys}")


# ---------------------------------------------------------------------------------------------- the launched ranks
class RankLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher of this node's other ranks (each re-runs the command with its ``LOCAL_RANK``), with their
    lifetime tied to this process: they are started with ``DIE_WITH_PID`` naming it (each asks for a parent-death
    signal: ``preemption.follow_parent``), and watched by ``RankObserver`` in place of Lightning's observer, which
    SIGKILLs this process as soon as a rank exits non-zero, a rank that stopped on a signal included (racing this
    process's own orderly stop)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

        from grail_exp.preemption import DIE_WITH_PID

        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[DIE_WITH_PID] = str(os.getpid())  # copied into each rank's environment
            self._call_children_scripts()
            RankObserver(self.procs).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class RankObserver(threading.Thread):
    """Watches the ranks this process launched. One that exited on a stop signal (128 + its number, or killed by it)
    before training stops this process the same way (``preemption.peer_stopped``); after the first step the ranks
    agree on a stop themselves. One that failed otherwise takes this node down at once, as Lightning's observer does:
    a rank left alone would wait in its next collective until the process group's timeout."""

    POLL_S = 1.0

    def __init__(self, procs: list):
        super().__init__(daemon=True, name="rank-observer")
        self.procs = procs

    def run(self) -> None:
        from grail_exp.preemption import peer_stopped, stop_signals

        stops = {int(s) for s in stop_signals()}
        seen: set[int] = set()
        while True:
            time.sleep(self.POLL_S)
            codes = [p.poll() for p in self.procs]
            if all(c == 0 for c in codes):
                return
            for i, (p, code) in enumerate(zip(self.procs, codes)):
                if code in (None, 0) or i in seen:
                    continue
                seen.add(i)
                signum = code - 128 if code > 128 else -code
                if signum in stops:
                    peer_stopped(signum)
                    continue
                log.error("local rank %d (pid %d) exited with %d: ending this node's ranks", i + 1, p.pid, code)
                for q in self.procs:
                    if q.poll() is None:
                        q.kill()
                os.kill(os.getpid(), signal.SIGKILL)
