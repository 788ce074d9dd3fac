"""The rehearsal: the user's run, shrunk in depth, run twice in its real layout, watched through the probe.

1. **training run**: ``python -m grail_exp.run <the overrides> <shrunk depth>`` for ``preflight.rounds`` rollout
   batches, its final checkpoint and its final evaluation on a slice of each benchmark that gives every rank work
   (``eval_slice``; every sync, step, evaluation and collective recorded);
2. **resumed run**: the same command with ``resume=auto`` and three more rollout batches; once rank
   ``preflight.stop_rank`` reports the first resumed step, the preflight sends that process SIGTERM (the pid its probe
   recorded) and waits at most ``preflight.stop_timeout_s`` for the whole job to end.

Both run as ``python -m grail_exp.run`` does on this node (Lightning starts the node's ranks); the preflight reads the
probe files, the checkpoints and the exit codes into ``checks.Evidence``, with what the run itself would use: its
process-group backend and device type, its process-group timeout (``memory.dist_timeout``: the key, or the
planned checkpoint's rule when it is null). A config of several nodes is refused: the rehearsal runs one node.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from grail_exp.errors import ConfigError
from grail_exp.preflight.checks import Evidence, RunOutcome
from grail_exp.preflight.probe import SIGNAL_FILE, STOP_RANK, STOP_STEP

PROBE = "grail_exp.preflight.probe:PreflightProbe"
POLL_S = 0.2
# Keys the rehearsal sets itself; the same keys among the user's overrides are dropped (and said so).
FORCED = ("trainer.max_steps", "trainer.checkpoint_every", "trainer.save_final_checkpoint", "trainer.eval_at_end",
          "trainer.eval_before_training", "trainer.eval_every", "trainer.save_weights_only_every", "resume",
          "hydra.run.dir", "benchmark.limit", "model.random_init", "model.random_init_overrides")


def override_key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+~")


def compose(overrides: list[str], hydra: bool = False):
    """The run's config as ``python -m grail_exp.run <overrides>`` composes it (``hydra``: with the hydra node, for
    the launcher's settings)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[*overrides, "paths.output_dir=."],
                             return_hydra_config=hydra)


def shrink_overrides(cfg, layers: int | None) -> list[str]:
    """Overrides that keep the model's architecture at ``layers`` decoder layers with random weights (none when
    ``layers`` is null or not below the model's depth)."""
    from grail_exp.memory import model_shape
    from grail_exp.models.architectures import ArchitectureError, architecture_of

    m = cfg.model
    try:
        architecture_of(m)
    except ArchitectureError:  # the embedded model (built from model.build): small already, run as configured
        return []
    full = model_shape(cfg.model).layers
    if layers is None or layers >= full:
        return []
    extra = m.get("random_init_overrides") if m.get("random_init") else None
    keys = dict(OmegaConf.to_container(extra, resolve=True) if OmegaConf.is_config(extra) else (extra or {}))
    keys["num_hidden_layers"] = int(layers)
    per_layer = architecture_of(m)[1].get("layer_types")
    if per_layer and "layer_types" not in keys:  # a per-layer list must keep one entry per layer
        keys["layer_types"] = list(per_layer)[:int(layers)]
    out = ["model.random_init=true", "model.random_init_overrides={" + ", ".join(
        f"{k}: {json.dumps(v)}" for k, v in keys.items()) + "}"]
    name = m.get("name_or_path")
    if not m.get("tokenizer_name_or_path") and name and Path(str(name)).expanduser().is_dir():
        out.append(f"model.tokenizer_name_or_path={name}")  # a local model's tokenizer (no packaged one to fall back on)
    return out


EVAL_PROBLEMS = 4  # problems per benchmark the final evaluation wants at least (more when ranks would sit idle)


def eval_slice(sizes: list[int], per_call: int, world: int) -> int:
    """Problems per benchmark (``benchmark.limit``) of the rehearsal's final evaluation: the fewest, at least
    ``EVAL_PROBLEMS``, that cut the benchmarks (``sizes`` problems each) into at least ``world`` chunks of
    ``per_call`` problems, so that the evaluation's whole-chunk assignment gives every rank one; all of them when even
    that leaves ranks without a chunk. The chunks stay the run's own (``eval.batch_size / eval.n`` problems)."""

    def chunks(limit: int) -> int:
        return sum(-(-min(limit, s) // per_call) for s in sizes)

    limit, most = EVAL_PROBLEMS, max(sizes, default=0)
    while chunks(limit) < world and limit < most:
        # one problem into the next chunk of every benchmark that has one more
        limit = min(per_call * -(-limit // per_call) + 1, most)
    return limit


def run_layout(cfg) -> tuple[str, str]:
    """(process-group backend, device type) the run itself will use: Lightning's strategy as the run builds it —
    ``trainer.process_group_backend``, else NCCL on CUDA and gloo on the CPU; "none" for one process without a
    group."""
    from lightning.pytorch.strategies import ParallelStrategy

    from grail_exp.device_teardown import device_type
    from grail_exp.distributed import build_strategy
    from grail_exp.memory import dist_timeout

    device = device_type(cfg.trainer.accelerator)
    strategy = build_strategy(cfg, dist_timeout(cfg))
    if not isinstance(strategy, ParallelStrategy):
        return "none", device
    return str(strategy.process_group_backend or ("nccl" if device == "cuda" else "gloo")), device


def steps_per_round(cfg) -> int:
    return int(cfg.loss.num_iterations) * int(cfg.trainer.get("mini_batches_per_rollout", 1) or 1)


def checkpoints(root: Path) -> dict[int, dict]:
    """step -> {"bytes": size of the directory, "complete_at": its completion marker's mtime} of complete ones."""
    from grail_exp.checkpoint import MARKER, complete_checkpoints

    out = {}
    for d in complete_checkpoints(root):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out[int(d.name.removeprefix("step-"))] = {"bytes": size, "complete_at": (d / MARKER).stat().st_mtime}
    return out


def read_probe(probe_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for f in sorted(Path(probe_dir).glob("rank*.jsonl")):
        lines = [line for line in f.read_text().splitlines() if line.strip()]
        recs = []
        for line in lines:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                break
        out[int(f.stem.removeprefix("rank"))] = recs
    return out


class Rehearsal:
    """Runs the two runs of the rehearsal in ``dir`` and returns the ``Evidence``."""

    def __init__(self, overrides: list[str], opts, dir_: Path):
        self.opts, self.dir = opts, dir_
        self.dropped = [o for o in overrides if override_key(o) in FORCED]
        self.user = [o for o in overrides if override_key(o) not in FORCED]
        self.full = compose(overrides)
        nodes = int(self.full.trainer.get("num_nodes", 1) or 1)
        if nodes > 1:
            raise ConfigError(f"trainer.num_nodes={nodes}: the preflight rehearses one node; run it on each node with "
                              "trainer.num_nodes=1 (the same trainer.devices)")
        self.shrink = shrink_overrides(self.full, opts.layers)
        self.small = compose([*self.user, *self.shrink])
        from grail_exp.validate import validate

        validate(copy.deepcopy(self.small))  # a config the run would refuse is refused here, before anything starts
        self.per_round = steps_per_round(self.small)
        self.steps_train = int(opts.rounds) * self.per_round
        from grail_exp.world import configured_world_size, devices_per_node

        self.world = configured_world_size(self.full.trainer)
        self.ranks_per_node = devices_per_node(self.full.trainer.devices)
        self.stop_rank = min(int(opts.stop_rank), self.world - 1)
        self.eval_limit = int(opts.eval_limit) if opts.eval_limit is not None else self.auto_eval_limit()
        self.run_backend, self.run_device = run_layout(self.full)

    def auto_eval_limit(self) -> int:
        """``eval_slice`` of the run's benchmarks (as its own ``benchmark.limit`` cuts them) and chunking."""
        from grail_exp.data.benchmarks import load_benchmark

        ev = self.small.eval
        sizes = [len(load_benchmark(name, self.small)) for name in self.small.benchmark.names]
        return eval_slice(sizes, max(1, int(ev.batch_size) // int(ev.n)), self.world)

    def command(self, extra: list[str]) -> list[str]:
        common = ["trainer.checkpoint_every=0", "trainer.save_final_checkpoint=true", "trainer.eval_at_end=true",
                  "trainer.eval_before_training=false", "trainer.eval_every=0", "trainer.save_weights_only_every=0",
                  f"hydra.run.dir={self.dir / 'run'}", f"benchmark.limit={self.eval_limit}"]
        return [sys.executable, "-m", "grail_exp.run", *self.user, *self.shrink, *common, *extra]

    def run(self) -> Evidence:
        self.dir.mkdir(parents=True, exist_ok=True)
        ckpt_root = self.dir / "run" / "checkpoints"
        train = self.launch("train", [f"trainer.max_steps={self.steps_train}", "resume=null"], ckpt_root)
        stop: dict = {}
        resume = None
        if train.checkpoints.get(self.steps_train):
            stop = {"rank": self.stop_rank, "step": self.steps_train + 1, "bound_s": float(self.opts.stop_timeout_s)}
            # three more rounds: neither the signal's step nor the next is the last one (the job must stop, not
            # finish), whichever fixed point of the step the ranks agree to stop at
            resume = self.launch("resume", [f"trainer.max_steps={self.steps_train + 3 * self.per_round}", "resume=auto"],
                                 ckpt_root, stop)
        return self.evidence(train, resume, stop)

    def launch(self, name: str, extra: list[str], ckpt_root: Path, stop: dict | None = None) -> RunOutcome:
        """One run as a child process group; with ``stop``, SIGTERM to that rank's pid once it reports that step."""
        from grail_exp.preemption import DIE_WITH_PID

        probe_dir = self.dir / f"probe_{name}"
        probe_dir.mkdir(parents=True, exist_ok=True)
        # The run dies with the preflight however it ends (SIGKILL included: preemption.follow_parent), and its ranks
        # and workers with the run; a preflight that ends by itself ends the run's process group (_end_group).
        env = dict(os.environ, GRAIL_EXP_PROBE=PROBE, GRAIL_EXP_PROBE_DIR=str(probe_dir))
        env[DIE_WITH_PID] = str(os.getpid())
        if stop:
            env.update({STOP_RANK: str(stop["rank"]), STOP_STEP: str(stop["step"])})
        before = checkpoints(ckpt_root)
        cmd = self.command(extra)
        (self.dir / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        log = open(self.dir / f"{name}.log", "w")
        t0 = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + float(self.opts.run_timeout_s)
        rc = None
        try:
            while True:
                rc = proc.poll()
                if rc is not None:
                    break
                now = time.time()
                if stop and "sent_at" not in stop:
                    self._maybe_signal(probe_dir, stop, t0)
                if now > deadline or (stop and "sent_at" in stop and now > stop["sent_at"] + stop["bound_s"]):
                    break
                time.sleep(POLL_S)
        finally:
            self._end_group(proc)
            log.close()
        after = checkpoints(ckpt_root)
        new = {s: v for s, v in after.items() if s not in before or v["complete_at"] != before[s]["complete_at"]}
        tail = (self.dir / f"{name}.log").read_text(errors="replace")[-3000:]
        return RunOutcome(read_probe(probe_dir), rc, time.time() - t0, new, tail)

    @staticmethod
    def _maybe_signal(probe_dir: Path, stop: dict, t0: float) -> None:
        f = probe_dir / f"rank{stop['rank']}.jsonl"
        if not f.exists():
            return
        recs = read_probe(probe_dir).get(stop["rank"], [])
        if not any(r["point"] == "step" and r["step"] == stop["step"] for r in recs):
            return
        pid = next(r["pid"] for r in recs if r["point"] == "setup")
        os.kill(pid, signal.SIGTERM)
        stop.update(pid=pid, sent_at=time.time(), started_at=t0)
        (probe_dir / SIGNAL_FILE).write_text(str(stop["sent_at"]))  # releases the rank's probe

    @staticmethod
    def _end_group(proc: subprocess.Popen) -> None:
        """The run's process group (its ranks, its grading workers) ends with it: SIGKILL whatever is left."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    # ------------------------------------------------------------------------------------------ evidence
    def evidence(self, train: RunOutcome, resume: RunOutcome | None, stop: dict) -> Evidence:
        from grail_exp.memory import model_shape

        cuda = any("peak_cuda_bytes" in r for recs in train.records.values() for r in recs)
        ev = Evidence(world=self.world, ranks_per_node=self.ranks_per_node,
                      layers_run=model_shape(self.small.model).layers, layers_full=model_shape(self.full.model).layers,
                      params_run=model_shape(self.small.model).params, params_full=model_shape(self.full.model).params,
                      steps_train=self.steps_train, train=train, resume=resume, stop=stop,
                      logprob_tolerance=self.tolerance(), cuda=cuda, run_backend=self.run_backend,
                      run_device=self.run_device)
        self.planned(ev)
        ev.dist_timeout_s, ev.dist_timeout_how = self.dist_timeout()
        ev.launcher_mem_gb = self.launcher_mem_gb()
        return ev

    def tolerance(self) -> float:
        """``preflight.logprob_tolerance``, else by the coarser of the trainer's and the engine's dtypes: float32
        1e-3 (reduction order over a few layers at a large vocabulary), 16-bit 2^-6 (four roundings at 2^-8)."""
        if self.opts.logprob_tolerance is not None:
            return float(self.opts.logprob_tolerance)
        dtypes = {str(self.full.model.dtype)}
        if str(self.full.rollout.engine) == "vllm":
            dtypes.add(str(self.full.rollout.vllm.get("dtype") or self.full.model.dtype))
        return 1e-3 if dtypes <= {"float32"} else 2.0 ** -6

    def planned(self, ev: Evidence) -> None:
        """The planner's peak per device and host per node for the full-depth run (grail_exp/memory/)."""
        from grail_exp.memory import PlanError, plan

        try:
            p = plan(self.full)
        except PlanError:
            return
        ev.planned_device_bytes, ev.planned_peak_phase = p.peak, p.peak_phase
        if p.capacity is not None:
            ev.device_usable_bytes = p.capacity - p.headroom
        if str(self.full.trainer.accelerator) == "cpu":  # a CPU run is planned in host memory per rank
            ev.planned_host_node_bytes = p.peak * self.ranks_per_node
            ev.planned_host_how = f"{self.ranks_per_node} x the plan's peak per rank"
        else:  # the planner's host rows, where it has them: the largest
            host = [x for x in p.lines if "host" in f"{x.phase} {x.what}".lower()]
            if host:
                top = max(host, key=lambda x: x.bytes)
                ev.planned_host_node_bytes, ev.planned_host_how = top.bytes, f"the planner's largest host row: {top.what}"

    def dist_timeout(self) -> tuple[float, str]:
        """(seconds, where from) of the run's process-group timeout, by the run's own rule
        (``memory.dist_timeout``): ``trainer.dist_timeout_s``, or when null what the full-depth model's planned
        checkpoint needs (grail_exp/timeouts.py)."""
        from grail_exp.memory import dist_timeout

        seconds = dist_timeout(self.full).total_seconds()
        if self.full.trainer.get("dist_timeout_s") is not None:
            return seconds, ""
        return seconds, "null: the planned checkpoint's rule, grail_exp/timeouts.py"

    def launcher_mem_gb(self) -> float | None:
        try:
            h = compose(self.user, hydra=True).hydra.launcher
            return float(h.mem_gb) if h.get("mem_gb") else None
        except Exception:  # noqa: BLE001 - a launcher whose settings do not resolve here has no mem_gb to judge
            return None
