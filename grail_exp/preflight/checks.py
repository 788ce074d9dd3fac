"""The preflight's checks: one function per check, registered by name, each reading the ``Evidence`` of the
rehearsal (what every rank's probe wrote, the processes' exit codes, the checkpoints on disk, the planner's numbers)
and returning one ``Result``: a verdict, what was measured, what was expected or planned, and on failure one line
naming the config key that fixes it. ``report.py`` renders them as one table.

Full-depth extrapolation (``Evidence.scale``): the rehearsal keeps the real width and vocabulary and runs L_run of the
L decoder layers, so what grows with the parameters is multiplied by N(L) / N(L_run), N = embedding + output layer
+ L x one decoder layer (``memory.model_shape``): the decoder part scales with the layers, the embedding and output
layer stay as they are. What does not grow with the depth is kept as measured: the colocated engine's device memory
(vLLM sizes its weights and KV cache by ``gpu_memory_utilization``: measured once the engine is built), and on the
host the libraries' resident pages (``memory.HOST_BASELINE`` per CPU process; on a GPU rank, its resident set once the
weights are on the device: the CUDA, NCCL and engine libraries' part).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

GiB = 2**30


@dataclass
class Result:
    check: str
    ok: bool | None  # None: not judged (no evidence for it in this layout), said in ``measured``
    measured: str
    expected: str
    key: str = ""  # the config key that fixes a failure ("" when no key does: the line says what does)
    why: str = ""  # on failure: what went wrong, one line


@dataclass
class RunOutcome:
    """One rehearsal run: its probe records, the launching process's exit code, and timing."""

    records: dict[int, list[dict]]  # rank -> probe records in order
    returncode: int | None  # None: killed by the preflight after its bound
    elapsed_s: float
    checkpoints: dict[int, dict] = field(default_factory=dict)  # step -> {"bytes", "complete_at"} of new complete ones
    log_tail: str = ""

    def at(self, rank: int, point: str) -> list[dict]:
        return [r for r in self.records.get(rank, []) if r["point"] == point]


@dataclass
class Evidence:
    world: int  # ranks the config asks for
    ranks_per_node: int
    layers_run: int
    layers_full: int
    params_run: int
    params_full: int
    steps_train: int  # optimiser steps of the training run
    train: RunOutcome
    resume: RunOutcome | None  # resumed from the training run's checkpoint, stopped by the signal
    stop: dict  # {"rank", "step", "pid", "sent_at", "bound_s"}: the signal the preflight delivered (empty: none)
    logprob_tolerance: float
    planned_device_bytes: float | None = None
    planned_peak_phase: str = ""
    device_usable_bytes: float | None = None  # capacity less headroom, where known
    planned_host_node_bytes: float | None = None
    planned_host_how: str = "no host row in the plan"
    launcher_mem_gb: float | None = None
    dist_timeout_s: float = 1800.0
    dist_timeout_key: str = "trainer.dist_timeout_s"
    dist_timeout_how: str = ""  # where the timeout comes from (the key's value, or the run's rule when it is null)
    host_baseline_bytes: float = 0.6 * GiB
    cuda: bool = False  # the run's devices are CUDA devices (device memory = the CUDA allocator's peak)
    # The process group and devices the run itself will use (None: not known, not judged): "nccl", "gloo", a device
    # map, or "none" (one process without a group); "cuda" or "cpu".
    run_backend: str | None = None
    run_device: str | None = None

    @property
    def scale(self) -> float:
        return self.params_full / max(1, self.params_run)

    @property
    def formula(self) -> str:
        if self.layers_run == self.layers_full:
            return f"{self.layers_run} layers (full depth, no extrapolation)"
        return (f"x N({self.layers_full})/N({self.layers_run}) = {_count(self.params_full)}/{_count(self.params_run)} "
                f"= {self.scale:.2f} (N = embedding + output + layers x decoder layer)")


CHECKS: dict[str, Callable[[Evidence], Result]] = {}


def check(name: str):
    """Register a check under ``name`` (the table lists them in registration order)."""

    def wrap(fn):
        CHECKS[name] = fn
        fn.check_name = name
        return fn

    return wrap


def run_checks(ev: Evidence, names: list[str] | None = None) -> list[Result]:
    """Every registered check (or those named), in order; a check that raises is a failure naming its error."""
    out = []
    for name in names or list(CHECKS):
        try:
            out.append(CHECKS[name](ev))
        except Exception as exc:  # noqa: BLE001 - missing evidence is a finding, not a crash of the preflight
            out.append(Result(name, False, f"no evidence ({type(exc).__name__}: {exc})", "", why=f"{exc}"))
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _gib(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / GiB:.2f} GiB" if x >= 0.1 * GiB else f"{x / 2**20:.1f} MiB"


def _ranks(run: RunOutcome) -> list[int]:
    return sorted(run.records)


# ---------------------------------------------------------------------------------------------- the layout
@check("world")
def world(ev: Evidence) -> Result:
    """Every rank ran in the configured world: one setup per rank, the configured size, one backend, its own device
    (or its own device index on CPU)."""
    setups = {r: ev.train.at(r, "setup") for r in range(ev.world)}
    seen = [(r, s[0]["world_size"], s[0]["backend"]) for r, s in setups.items() if len(s) == 1]
    backends = sorted({b for _, _, b in seen})
    measured = f"{len(seen)} rank(s) reported, sizes {sorted({w for _, w, _ in seen})}, backend {'/'.join(backends)}"
    expected = f"{ev.world} ranks, each in a world of {ev.world}"
    if len(seen) != ev.world or any(w != ev.world for _, w, _ in seen) or len(backends) != 1:
        return Result("world", False, measured, expected, "trainer.devices",
                      "the ranks did not all run in one world of trainer.devices x trainer.num_nodes")
    if ev.run_backend is not None:
        expected += f", backend {ev.run_backend} on {ev.run_device}"
        devices = sorted({str(s[0]["device"]).split(":")[0] for s in setups.values()})
        measured += f" on {'/'.join(devices)}"
        if backends != [ev.run_backend] or devices != [ev.run_device]:
            return Result("world", False, measured, expected, "trainer.accelerator",
                          f"the rehearsal ran {'/'.join(backends)} on {'/'.join(devices)} but the run will use "
                          f"{ev.run_backend} on {ev.run_device}: what it judged is not the run's layout (is the "
                          "device visible to the preflight's processes?)")
    places = [(s[0]["host"], s[0]["device"] if ev.cuda else s[0].get("local_rank")) for s in setups.values()]
    if len(set(places)) != len(places):
        return Result("world", False, measured + f"; devices {places}", expected + " on distinct devices",
                      "trainer.devices", "two ranks share one device")
    return Result("world", True, measured, expected)


@check("collective_devices")
def collective_devices(ev: Evidence) -> Result:
    """Every collective every rank issued ran on its process group's device: CUDA on NCCL, CPU on gloo (either with
    a device map naming both); with a process group, at least one was issued (none skipped at world size 1)."""
    bad, total, where = [], 0, set()
    for run in (ev.train, ev.resume):
        for r in _ranks(run) if run else []:
            setup = run.at(r, "setup")
            backend = setup[0]["backend"] if setup else "?"
            allowed = backend_devices(backend)
            last = run.records[r][-1].get("collectives", {})
            for op, n in last.items():
                dev = op.rsplit("@", 1)[1]
                total += n
                where.add(op)
                if dev not in allowed:
                    bad.append(f"rank {r}: {n} x {op} on a {backend} group")
    backends = {s["backend"] for run in (ev.train, ev.resume) if run for r in _ranks(run) for s in run.at(r, "setup")}
    if backends == {"none"}:
        return Result("collective_devices", None, "no process group (one plain process)", "")
    measured = f"{total} calls: " + ", ".join(sorted(where)) if where else "none recorded"
    expected = "every call on the group's device (nccl: cuda, gloo: cpu)"
    if bad:
        return Result("collective_devices", False, measured, expected, "",
                      "; ".join(bad) + ": a collective handed a tensor its group cannot carry (grail_exp/training/"
                      "world.py must move it to the group's device)")
    if total == 0:
        return Result("collective_devices", False, measured, expected + ", at least one", "",
                      "no collective recorded with a process group: the helpers skipped them (world size 1?)")
    return Result("collective_devices", True, measured, expected)


def backend_devices(backend: str) -> set[str]:
    """Device types a process group of this backend string carries: 'nccl' -> cuda, 'gloo' / 'mpi' -> cpu, a device
    map ('cpu:gloo,cuda:nccl') -> the devices it names."""
    out = set()
    for entry in str(backend).lower().split(","):
        entry = entry.strip()
        if ":" in entry:
            out.add(entry.split(":", 1)[0])
        elif entry == "nccl":
            out.add("cuda")
        elif entry in ("gloo", "mpi"):
            out.add("cpu")
    return out


# ---------------------------------------------------------------------------------------------- weights
@check("weight_sync")
def weight_sync(ev: Evidence) -> Result:
    """After every weight sync of every rank, the engine's log-probs of a fixed completion equal the trainer's
    forward on the same tokens within the tolerance (abs(d) <= tol x (1 + abs(log p))), and every rank saw the
    same."""
    worst, syncs, bad = 0.0, 0, []
    for run in (ev.train, ev.resume):
        for r in _ranks(run) if run else []:
            for i, s in enumerate(run.at(r, "synced")):
                syncs += 1
                if not s["engine"]:
                    bad.append(f"rank {r} sync {i}: no tokens")
                    continue
                ratio = max(abs(a - b) / (1 + abs(b)) for a, b in zip(s["engine"], s["trainer"]))
                worst = max(worst, ratio)
                if ratio > ev.logprob_tolerance:
                    bad.append(f"rank {r} sync {i}: {ratio:.2e}")
    firsts = [[s["tokens"] for s in ev.train.at(r, "synced")] for r in _ranks(ev.train)]
    if len({str(f) for f in firsts}) > 1:
        bad.append("the ranks' engines continued the fixed prompt differently")
    measured = f"{syncs} syncs, worst abs(d) / (1 + abs(log p)) = {worst:.2e}"
    expected = f"<= {ev.logprob_tolerance:.1e}, same on every rank"
    if syncs == 0:
        return Result("weight_sync", False, measured, expected, "rollout.engine", "no weight sync was recorded")
    if bad:
        return Result("weight_sync", False, measured, expected, "rollout.vllm.sync_chunk_mb",
                      "the engine does not sample from the trainer's weights: " + "; ".join(bad[:4]))
    return Result("weight_sync", True, measured, expected)


@check("checkpoint_roundtrip")
def checkpoint_roundtrip(ev: Evidence) -> Result:
    """The training run's final checkpoint was written complete, and the resumed run started from exactly the weights
    the trainer held at that step (a fingerprint of the full weights on every rank)."""
    step = ev.steps_train
    written = ev.train.checkpoints.get(step)
    before = {r: [x["weights"] for x in ev.train.at(r, "step") if x["step"] == step] for r in _ranks(ev.train)}
    after = {r: [x["weights"] for x in ev.resume.at(r, "started")] for r in _ranks(ev.resume)} if ev.resume else {}
    measured = f"step-{step} {'written, ' + _gib(written['bytes']) if written else 'missing'}"
    expected = "written, read back: the resumed weights = the saved ones on every rank"
    if not written:
        return Result("checkpoint_roundtrip", False, measured, expected, "trainer.save_final_checkpoint",
                      f"no complete checkpoint step-{step} after the training run")
    same = [r for r in after if after[r] and before.get(r) and after[r][0] == before[r][-1]]
    measured += f"; {len(same)}/{len(before)} rank(s) resumed the same weights"
    if not after or len(same) != len(before):
        return Result("checkpoint_roundtrip", False, measured, expected, "resume",
                      "the weights read back from the checkpoint differ from those written (or no rank resumed)")
    return Result("checkpoint_roundtrip", True, measured, expected)


@check("resume")
def resume(ev: Evidence) -> Result:
    """The resumed run started at the checkpoint's step and went on training: its first step is the next one, on
    every rank."""
    if ev.resume is None:
        return Result("resume", False, "not run", "", "resume", "the resumed run did not start")
    firsts = {r: [x["step"] for x in ev.resume.at(r, "step")][:1] for r in range(ev.world)}
    started = {r: [x["step"] for x in ev.resume.at(r, "started")][:1] for r in range(ev.world)}
    measured = f"started at {sorted({s[0] for s in started.values() if s})}, first step {sorted({s[0] for s in firsts.values() if s})}"
    expected = f"started at {ev.steps_train}, first step {ev.steps_train + 1} on all {ev.world} ranks"
    ok = all(started[r] == [ev.steps_train] and firsts[r] == [ev.steps_train + 1] for r in range(ev.world))
    if not ok:
        return Result("resume", False, measured, expected, "resume",
                      "the run did not continue from its checkpoint (resume=auto and the same hydra.run.dir)")
    return Result("resume", True, measured, expected)


# ---------------------------------------------------------------------------------------------- stop signal
@check("stop_signal")
def stop_signal(ev: Evidence) -> Result:
    """A SIGTERM delivered to one rank only, during one step: every rank stopped after the same step, one
    checkpoint of that step was written, the job exited as a single-rank SIGTERM does (143), within the bound."""
    run, s = ev.resume, ev.stop
    if run is None or not s:
        return Result("stop_signal", None, "not delivered (no resumed run)", "", why="")
    lasts = {r: max([x["step"] for x in run.at(r, "step")], default=None) for r in range(ev.world)}
    stopped = sorted({v for v in lasts.values() if v is not None})
    new = sorted(run.checkpoints)
    measured = (f"SIGTERM to rank {s['rank']} at step {s['step']}: last steps {lasts}, new checkpoints {new}, "
                f"exit {run.returncode}, {run.elapsed_s - (s['sent_at'] - s['started_at']):.0f} s after the signal")
    expected = f"one step on all ranks, one checkpoint of it, exit 143, <= {s['bound_s']:.0f} s"
    problems = []
    if run.returncode is None:
        problems.append(f"the job did not end within {s['bound_s']:.0f} s of the signal (killed): the ranks disagree "
                        "on stopping and wait in different collectives")
    if len(stopped) != 1 or None in lasts.values():
        problems.append(f"the ranks stopped after different steps {lasts}")
    elif new != stopped:
        problems.append(f"checkpoints {new} instead of exactly step-{stopped[0]}")
    if run.returncode not in (None, 143):
        problems.append(f"exit code {run.returncode}, not 143")
    if problems:
        return Result("stop_signal", False, measured, expected, "",
                      "; ".join(problems) + " (the stop flag must be reduced over all ranks at a fixed point of the "
                      "step; trainer.dist_timeout_s bounds the hang)")
    return Result("stop_signal", True, measured, expected)


# ---------------------------------------------------------------------------------------------- evaluation
@check("eval_sharded")
def eval_sharded(ev: Evidence) -> Result:
    """The final evaluation was generated by every rank, and split as the chunking guarantees: the evaluation assigns
    whole chunks (``eval.batch_size / eval.n`` problems each) by Graham's rule (``evaluation.chunk_owners``), so with
    at least as many chunks as ranks every rank generates, and the ranks' problem counts differ by at most the largest
    chunk; every rank holds the same gathered result."""
    evals = {r: [e for e in ev.train.at(r, "evaluated") if e["tag"] == "final"] for r in _ranks(ev.train)}
    if not evals or any(len(v) != 1 for v in evals.values()):
        return Result("eval_sharded", False, f"final evaluations per rank: { {r: len(v) for r, v in evals.items()} }",
                      "one per rank", "trainer.eval_at_end", "the final evaluation did not run once on every rank")
    first = evals[min(evals)][0]
    counts = {int(r): n for r, n in first["problems_by_rank"].items() if r != "?"}
    counts.update({r: counts.get(r, 0) for r in range(ev.world)})
    chunks = first["chunk_problems"]
    largest = max(chunks.values(), default=0)
    busy = min(len(chunks), ev.world)
    measured = (f"problems per rank {dict(sorted(counts.items()))} in {len(chunks)} chunks of <= {largest}, "
                f"{first['samples']} samples")
    expected = (f"{busy} of {ev.world} ranks generate, counts within one chunk ({largest}), the same result on every "
                "rank")
    if len({e[0]["digest"] for e in evals.values()}) != 1:
        return Result("eval_sharded", False, measured, expected, "", "the ranks hold different gathered evaluations")
    if sum(1 for n in counts.values() if n > 0) < busy:
        return Result("eval_sharded", False, measured, expected, "",
                      f"a rank generated nothing although there are {len(chunks)} chunks for {ev.world} ranks "
                      "(grail_exp/evaluation.py chunk_owners)")
    if max(counts.values()) - min(counts.values()) > largest:
        return Result("eval_sharded", False, measured, expected, "",
                      f"the ranks' problem counts differ by more than one chunk of {largest}: the slowest rank sets the "
                      "evaluation's time (grail_exp/evaluation.py chunk_owners)")
    if len(chunks) < ev.world:
        measured += f"; {ev.world - len(chunks)} rank(s) without a chunk (preflight.eval_limit)"
    return Result("eval_sharded", True, measured, expected)


# ---------------------------------------------------------------------------------------------- memory and time
def _peak(ev: Evidence, field_: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for run in (ev.train, ev.resume):
        for r in _ranks(run) if run else []:
            vals = [x.get(field_) for x in run.records[r] if x.get(field_) is not None]
            if vals:
                out[r] = max(out.get(r, 0.0), max(vals))
    return out


def _setup_field(ev: Evidence, rank: int, name: str) -> float:
    setup = ev.train.at(rank, "setup")
    return float(setup[0].get(name) or 0.0) if setup else 0.0


@check("device_memory")
def device_memory(ev: Evidence) -> Result:
    """The peak memory per device (the CUDA allocator's; a CPU rank's resident set), extrapolated to the full depth,
    next to the planner's peak, against the device's usable memory. What does not grow with the depth is kept as
    measured: the engine's share once built (CUDA; vLLM sizes it by ``gpu_memory_utilization``), a CPU rank's
    libraries."""
    peaks = _peak(ev, "peak_cuda_bytes" if ev.cuda else "peak_rss_bytes")
    if not peaks:
        return Result("device_memory", None, "no memory recorded", "")
    full_by_rank, kept_by_rank = {}, {}
    for r, peak in peaks.items():
        # the engine's share on a CUDA rank; a CPU rank's resident set holds the libraries, which do not grow either
        kept = _setup_field(ev, r, "engine_cuda_bytes") if ev.cuda else ev.host_baseline_bytes
        kept = min(kept, peak)
        kept_by_rank[r], full_by_rank[r] = kept, kept + (peak - kept) * ev.scale
    top = max(full_by_rank, key=full_by_rank.get)
    full, measured_b, kept = full_by_rank[top], peaks[top], kept_by_rank[top]
    what = "engine as built" if ev.cuda else "libraries"
    measured = (f"{_gib(measured_b)} at {ev.layers_run} layers ({what} {_gib(kept)}, kept) -> {_gib(full)} at "
                f"{ev.layers_full} ({ev.formula})")
    expected = f"planned {_gib(ev.planned_device_bytes)} ({ev.planned_peak_phase}); usable {_gib(ev.device_usable_bytes)}"
    if ev.device_usable_bytes is not None and full > ev.device_usable_bytes:
        return Result("device_memory", False, measured, expected, "trainer.micro_batch_size",
                      f"the extrapolated peak {_gib(full)} exceeds the usable {_gib(ev.device_usable_bytes)} per device "
                      "(python -m grail_exp.plan <overrides> lists what fits)")
    return Result("device_memory", True, measured, expected)


@check("host_memory")
def host_memory(ev: Evidence) -> Result:
    """The host memory per node: the sum of the ranks' peak resident sets on each host, the part above the libraries
    extrapolated to the full depth, against the planner's host row and the launcher's mem_gb."""
    peaks = _peak(ev, "peak_rss_bytes")
    hosts: dict[str, list[int]] = {}
    for r in _ranks(ev.train):
        setup = ev.train.at(r, "setup")
        hosts.setdefault(setup[0]["host"] if setup else "?", []).append(r)
    if not peaks:
        return Result("host_memory", None, "no memory recorded", "")
    base = {r: min(_host_base(ev, r), peaks.get(r, 0.0)) for r in peaks}
    full_by_node = {h: sum(base.get(r, 0.0) + (peaks.get(r, 0.0) - base.get(r, 0.0)) * ev.scale for r in rs)
                    for h, rs in hosts.items()}
    host = max(full_by_node, key=full_by_node.get)
    full, rs = full_by_node[host], hosts[host]
    per_node, kept = sum(peaks.get(r, 0.0) for r in rs), sum(base.get(r, 0.0) for r in rs)
    what = "CUDA, NCCL and engine libraries" if ev.cuda else "libraries"
    measured = (f"{_gib(per_node)} per node ({len(rs)} ranks; {what} {_gib(kept)}, kept) -> {_gib(full)} at full "
                "depth")
    limit = ev.launcher_mem_gb * 1e9 if ev.launcher_mem_gb else None
    expected = (f"planned {_gib(ev.planned_host_node_bytes)} ({ev.planned_host_how}); launcher mem_gb "
                f"{ev.launcher_mem_gb if ev.launcher_mem_gb else 'unset'}")
    if limit is not None and full > limit:
        return Result("host_memory", False, measured, expected, "hydra.launcher.mem_gb",
                      f"the extrapolated host memory per node {full / 1e9:.0f} GB exceeds hydra.launcher.mem_gb = "
                      f"{ev.launcher_mem_gb:g}")
    return Result("host_memory", True, measured, expected)


def _host_base(ev: Evidence, rank: int) -> float:
    """What of a rank's resident set does not grow with the depth: on a CUDA rank its resident set once training
    started (the weights on the device: the CUDA, NCCL and engine libraries, which take several GiB); on a CPU rank
    the libraries' measured ``host_baseline_bytes`` (its weights live on the host)."""
    if not ev.cuda:
        return ev.host_baseline_bytes
    started = [x.get("rss_bytes") for x in ev.train.at(rank, "started") if x.get("rss_bytes")]
    return float(started[0]) if started else ev.host_baseline_bytes


@check("checkpoint_time")
def checkpoint_time(ev: Evidence) -> Result:
    """The final checkpoint's size and write time (from the last rank's last step to its completion marker),
    extrapolated to the full depth; the process-group timeout must exceed twice that write (the other ranks wait in
    a collective while it is written)."""
    step = ev.steps_train
    ck = ev.train.checkpoints.get(step)
    lasts = [x["time"] for r in _ranks(ev.train) for x in ev.train.at(r, "step") if x["step"] == step]
    if not ck or not lasts:
        return Result("checkpoint_time", None, "no final checkpoint to time", "")
    write_s = max(0.0, ck["complete_at"] - max(lasts))
    size_full, time_full = ck["bytes"] * ev.scale, write_s * ev.scale
    need = 2 * time_full
    measured = (f"{_gib(ck['bytes'])} in {write_s:.1f} s -> {_gib(size_full)} in {time_full:.0f} s at full depth")
    how = f" ({ev.dist_timeout_how})" if ev.dist_timeout_how else ""
    expected = f"{ev.dist_timeout_key} = {ev.dist_timeout_s:.0f} s{how} >= {need:.0f} s (2 x the write)"
    if ev.dist_timeout_s < need:
        return Result("checkpoint_time", False, measured, expected, ev.dist_timeout_key,
                      f"the process-group timeout {ev.dist_timeout_s:.0f} s is shorter than twice the full-depth "
                      f"checkpoint write ({need:.0f} s): set {ev.dist_timeout_key} >= {need:.0f}")
    return Result("checkpoint_time", True, measured, expected)


# ---------------------------------------------------------------------------------------------- LoRA
@check("lora_adapter")
def lora_adapter(ev: Evidence) -> Result:
    """peft=lora with an engine that keeps its own weights and takes the adapter (``peft.sync=adapter``): at every
    sync of every rank the engine generated with a new adapter version, the one it lists as loaded, and no other (an
    adapter that never reaches the engine leaves it sampling the first policy: verl #7495). weight_sync judges what
    the engine computes with it. Not judged without LoRA, under peft.sync=merged (full weights: weight_sync) or with
    an engine that samples the policy itself (rollout=hf)."""
    setups = [s[0] for r in _ranks(ev.train) for s in [ev.train.at(r, "setup")] if s]
    if not setups or all(s.get("peft", "none") != "lora" for s in setups):
        return Result("lora_adapter", None, "full fine-tuning (peft=none)", "")
    if any(s.get("peft_sync") != "adapter" for s in setups):
        return Result("lora_adapter", None, "peft.sync=merged: full weights, judged by weight_sync", "")
    runs = [run for run in (ev.train, ev.resume) if run]
    syncs = {(i, r): run.at(r, "synced") for i, run in enumerate(runs) for r in _ranks(run)}
    if not any("adapter" in s for v in syncs.values() for s in v):
        return Result("lora_adapter", None, f"the engine ({setups[0].get('engine')}) samples the policy itself: "
                      "nothing to push", "")
    bad, count = [], 0
    for (i, r), recs in syncs.items():
        ids = [s.get("adapter_id") for s in recs]
        count += len(recs)
        if any(x is None for x in ids):
            bad.append(f"run {i} rank {r}: a sync without an adapter in the engine")
            continue
        if ids != sorted(set(ids)):
            bad.append(f"run {i} rank {r}: versions {ids} (a version reused)")
        for s in recs:
            if s["engine_adapters"] != [s["adapter_id"]]:
                bad.append(f"run {i} rank {r}: generated with {s['adapter']} while the engine lists "
                           f"{s['engine_adapters']}")
    measured = f"{count} syncs, each with a new adapter version the engine lists alone"
    expected = "a new version at every sync, loaded in the engine, on every rank"
    if bad:
        return Result("lora_adapter", False, measured, expected, "peft.sync",
                      "the adapter did not reach the engine as the trainer holds it: " + "; ".join(bad[:3]))
    return Result("lora_adapter", True, measured, expected)
