"""What the vLLM engine decides before vLLM runs: the arguments it builds ``vllm.LLM`` with, the order of its sleep-mode
calls, the seeds of its requests, the device checks and its shutdown — on a fake ``vllm`` module that records every
call, so they are checked where CUDA vLLM cannot run (sleep mode, CUDA graphs and device placement exist only on a
GPU). The real engine is tested in tests/test_vllm.py (vLLM's CPU build).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from grail_exp.errors import ConfigError, LayoutError
from grail_exp.rollout import SamplingParams


class _Tokenizer:
    eos_token_id, pad_token_id = 2, 0


class _Output:
    def __init__(self, ids):
        self.token_ids = ids
        self.logprobs = [{t: types.SimpleNamespace(logprob=-1.0)} for t in ids]


class _Result:
    def __init__(self, ids):
        self.outputs = [_Output(ids)]


class InprocClient:  # vLLM's in-process engine-core client (vllm.v1.engine.core_client)
    def __init__(self, calls: list):
        self.calls = calls

    def shutdown(self):
        self.calls.append(("shutdown",))


class MPClient:  # the multiprocess one: not an InprocClient
    def shutdown(self):
        pass


def _fake_vllm(calls: list, *, cpu: bool, on_build=None):
    """A ``vllm`` module whose ``LLM`` records its arguments and every method call into ``calls``. ``on_build`` runs
    inside the constructor and may return "multiprocess" to make the engine core a multiprocess client."""

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("LLM", kwargs))
            mode = on_build() if on_build is not None else None
            core = MPClient() if mode == "multiprocess" else InprocClient(calls)
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=64),
                                                    engine_core=core)

        def sleep(self, level=1):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tuple(tags or ())))

        def collective_rpc(self, method, args=(), kwargs=None):
            if kwargs and "weights_iterator" in kwargs:
                list(kwargs["weights_iterator"])
            calls.append(("rpc", method if isinstance(method, str) else method.__name__))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

        def apply_model(self, fn):
            calls.append(("apply_model",))

        def generate(self, requests, sampling, use_tqdm=False, **kwargs):
            calls.append(("generate", [s.seed for s in sampling], *list(kwargs.items())))
            return [_Result([5, 2]) for _ in requests]

    class VSamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class LoRARequest:
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = LLM, VSamplingParams
    mod.lora_request = types.ModuleType("vllm.lora.request")
    mod.lora_request.LoRARequest = LoRARequest
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: cpu)
    mod.platforms = platforms
    core_client = types.ModuleType("vllm.v1.engine.core_client")
    core_client.InprocClient = InprocClient
    return mod, platforms, core_client


@pytest.fixture
def fake_vllm(monkeypatch):
    """install(cpu=..., on_build=...) puts a recording fake vLLM in place of the real one; returns the call list."""
    calls: list = []

    def install(cpu: bool = False, on_build=None):
        mod, platforms, core_client = _fake_vllm(calls, cpu=cpu, on_build=on_build)
        for name, m in (("vllm", mod), ("vllm.platforms", platforms), ("vllm.v1", types.ModuleType("vllm.v1")),
                        ("vllm.v1.engine", types.ModuleType("vllm.v1.engine")),
                        ("vllm.v1.engine.core_client", core_client), ("vllm.lora", types.ModuleType("vllm.lora")),
                        ("vllm.lora.request", mod.lora_request)):
            monkeypatch.setitem(sys.modules, name, m)
        return calls

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return install


def _engine(**kwargs):
    from grail_exp.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine("/models/m", _Tokenizer(), max_model_len=64, **kwargs)


def _record_cuda(monkeypatch, calls: list) -> None:
    """A CUDA build as the engine sees it after its start: empty_cache and gc.collect recorded in ``calls``."""
    import gc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(("gc",)) or 0)


# ---------------------------------------------------------------------------------------------- sleep mode
def test_cached_blocks_are_freed_before_each_wake_up(fake_vllm, monkeypatch):
    """Sleep mode on a GPU: before the weights wake, and again before the KV cache wakes (after the sync's chunks were
    pushed), unreferenced objects are collected and torch's cached blocks go back to the device; then vLLM wakes."""
    calls = fake_vllm(cpu=False)
    e = _engine(sleep_mode=True)
    _record_cuda(monkeypatch, calls)
    e.sleep()
    calls.clear()
    e.load_weights([[("w", torch.zeros(2))]])
    assert calls == [("gc",), ("empty_cache",), ("wake_up", ("weights",)), ("rpc", "reload_weights"),
                     ("gc",), ("empty_cache",), ("wake_up", ("kv_cache", "scheduling")), ("reset_prefix_cache",)]
    e.sleep()
    calls.clear()
    e.wake_up()
    assert calls == [("gc",), ("empty_cache",), ("wake_up", ())]


def test_a_lora_engine_has_one_adapter_slot_and_sleeps_keeping_its_base(fake_vllm, monkeypatch):
    """peft.sync=adapter: one LoRA slot of the smallest rank vLLM allows over peft.rank; sleep at level 1, which keeps
    the base (pushed once) in host memory where level 2 would drop it (verl PR #4470: it was reloaded every step);
    a sync wakes the engine, hands the adapter over under the next version's name and drops the prefix cache; every
    generation names that version."""
    calls = fake_vllm(cpu=False)
    e = _engine(sleep_mode=True, lora_rank=12)
    (kwargs,) = [c[1] for c in calls if c[0] == "LLM"]
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"], kwargs["max_cpu_loras"]) == \
        (True, 16, 1, 1)
    _record_cuda(monkeypatch, calls)
    e.sleep()
    assert calls[-1] == ("sleep", 1)
    calls.clear()
    e.load_adapter({"m.q_proj.lora_A.weight": torch.zeros(12, 4)}, {"r": 12})
    assert calls == [("gc",), ("empty_cache",), ("wake_up", ()), ("rpc", "register_in_worker"),
                     ("reset_prefix_cache",)]
    first = e.adapter_request
    e.load_adapter({"m.q_proj.lora_A.weight": torch.zeros(12, 4)}, {"r": 12})
    assert (first.lora_name, e.adapter_request.lora_name) == ("policy-v1", "policy-v2")
    calls.clear()
    e.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2))
    assert [c for c in calls if c[0] == "generate"][0][-1] == ("lora_request", e.adapter_request)

def test_without_an_adapter_the_engine_sleeps_at_level_2_and_names_none(fake_vllm):
    calls = fake_vllm(cpu=False)
    plain = _engine(sleep_mode=True)
    plain.sleep()
    assert calls[-1] == ("sleep", 2) and plain.adapter_request is None
    plain.sleeping = False
    plain.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2))
    assert len([c for c in calls if c[0] == "generate"][0]) == 2  # no lora_request argument


# ---------------------------------------------------------------------------------------------- arguments
def _built(fake_vllm, compose_cfg, overrides, *, cpu: bool, model_path=None, rank: int = 0, monkeypatch=None):
    from grail_exp import world
    from grail_exp.rollout.vllm import build_vllm_engine

    calls = fake_vllm(cpu=cpu)
    calls.clear()
    if monkeypatch is not None:
        monkeypatch.setattr(world, "rank", lambda: rank)
    cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256", "model.name_or_path=Org/Model",
                       "model.revision=0123abc", *overrides])
    build_vllm_engine(model_path or "Org/Model", _Tokenizer(), cfg)
    (kwargs,) = [c[1] for c in calls if c[0] == "LLM"]
    return cfg, kwargs


def test_gpu_engine_has_cuda_graphs_sizes_and_the_models_revision(fake_vllm, compose_cfg):
    cfg, kw = _built(fake_vllm, compose_cfg, [], cpu=False)
    assert kw["enforce_eager"] is False  # CUDA graphs on a GPU: the recipe gives no reason to turn them off
    assert kw["max_num_batched_tokens"] == 4096 and kw["max_num_seqs"] == 256
    assert kw["revision"] == "0123abc" and kw["tokenizer_revision"] == "0123abc"
    assert kw["seed"] == cfg.seed
    # vLLM's CPU build has no graphs (it would compile the model instead): eager there; a value set by hand wins
    assert _built(fake_vllm, compose_cfg, [], cpu=True)[1]["enforce_eager"] is True
    assert _built(fake_vllm, compose_cfg, ["rollout.vllm.enforce_eager=true"], cpu=False)[1]["enforce_eager"] is True


def test_the_engine_reads_no_weights_and_refuses_to_sample_before_the_first_sync(fake_vllm, compose_cfg):
    """build_vllm_engine: vLLM builds the model with its dummy weights (load_format=dummy: no rank reads the checkpoint,
    which the first sync would overwrite) and generate() refuses until load_weights has run — a rollout or an
    evaluation sampled before the first sync is an error, not random text. read_weights=True, or load_format in
    rollout.vllm.kwargs, has vLLM read the files."""
    _, kw = _built(fake_vllm, compose_cfg, [], cpu=False)
    assert kw["load_format"] == "dummy"
    from grail_exp.rollout.vllm import build_vllm_engine

    calls = fake_vllm(cpu=False)
    calls.clear()
    cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256"])
    e = build_vllm_engine("/models/m", _Tokenizer(), cfg)
    with pytest.raises(RuntimeError, match="dummy weights"):
        e.generate([[1, 3]], SamplingParams(n=1, max_new_tokens=4))
    assert not [c for c in calls if c[0] == "generate"]
    e.load_weights([[("w", torch.zeros(2))]])
    e.generate([[1, 3]], SamplingParams(n=1, max_new_tokens=4))
    assert [c[0] for c in calls] == ["LLM", "rpc", "reset_prefix_cache", "generate"]
    calls.clear()
    build_vllm_engine("/models/m", _Tokenizer(), cfg, read_weights=True)
    assert "load_format" not in calls[0][1]
    _, kw = _built(fake_vllm, compose_cfg, ["+rollout.vllm.kwargs.load_format=safetensors"], cpu=False)
    assert kw["load_format"] == "safetensors"


def test_a_checkpoint_is_loaded_without_the_hub_revision(fake_vllm, compose_cfg, tmp_path):
    """On resume the engine starts from the run's checkpoint, a directory of its own: no hub revision applies."""
    kw = _built(fake_vllm, compose_cfg, [], cpu=False, model_path=str(tmp_path / "checkpoints" / "step-4"))[1]
    assert kw["revision"] is None and kw["tokenizer_revision"] is None


def test_each_rank_has_its_own_engine_seed(fake_vllm, compose_cfg, monkeypatch):
    cfg, kw = _built(fake_vllm, compose_cfg, ["seed=7"], cpu=False, rank=3, monkeypatch=monkeypatch)
    assert kw["seed"] == 7 + 3000
    assert _built(fake_vllm, compose_cfg, ["seed=7", "rollout.vllm.seed=11"], cpu=False, rank=1,
                  monkeypatch=monkeypatch)[1]["seed"] == 11 + 1000


def test_in_process_is_read_after_vllm_decided_it(fake_vllm, monkeypatch):
    """The environment asked for a multiprocess engine; vLLM's external launcher turns it off while building (as vLLM
    0.32's ParallelConfig does): the engine must push tensors in process, not write files. And the other way round:
    an engine vLLM built multiprocess (its CPU platform does so for a uniprocess executor when the variable is 1)
    gets files even though the variable said 0 before the build."""
    import os

    fake_vllm(cpu=False, on_build=lambda: os.environ.__setitem__("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert _engine().in_process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    fake_vllm(cpu=True, on_build=lambda: "multiprocess")
    assert not _engine().in_process


# ---------------------------------------------------------------------------------------------- seeds
def test_training_rollouts_carry_no_request_seeds_and_evaluation_does(fake_vllm):
    """Training rollouts (per_request_seeds unset) leave vLLM's batched sampler on its fast path: no seed on any
    request. Evaluation asks for per-request seeds: base (from torch's RNG) + row, the same again under the same seed."""
    calls = fake_vllm(cpu=False)
    e = _engine()
    prompts = [[1, 3], [1, 4]]
    e.generate(prompts, SamplingParams(n=2, max_new_tokens=4, logprobs=True))
    assert calls[-1] == ("generate", [None] * 4)
    seeded = []
    for s in (5, 5):
        torch.manual_seed(s)
        base = int(torch.randint(0, 2**62, (1,)).item())  # what the engine draws first, computed here
        torch.manual_seed(s)
        e.generate(prompts, SamplingParams(n=2, max_new_tokens=4, per_request_seeds=True))
        seeded.append(calls[-1][1])
        assert seeded[-1] == [base, base + 1, base + 2, base + 3]
    assert seeded[0] == seeded[1]


def test_seeded_rollouts_seed_training_requests_too(fake_vllm, compose_cfg):
    from grail_exp.rollout.vllm import build_vllm_engine

    calls = fake_vllm(cpu=False)
    cfg = compose_cfg(["rollout=vllm", "rollout.vllm.max_model_len=256", "rollout.vllm.seeded_rollouts=true"])
    e = build_vllm_engine("/models/m", _Tokenizer(), cfg)
    e.load_weights([[("w", torch.zeros(2))]])  # built with dummy weights: the first sync comes before any rollout
    e.generate([[1, 3]], SamplingParams(n=3, max_new_tokens=4, logprobs=True))
    assert None not in calls[-1][1] and len(set(calls[-1][1])) == 3
    e.generate([[1, 3]], SamplingParams(n=3, max_new_tokens=4, per_request_seeds=False))
    assert calls[-1][1] == [None] * 3  # an explicit choice of the caller wins


def test_evaluation_asks_for_per_request_seeds(monkeypatch):
    """evaluate_benchmarks' sampling parameters: the common random numbers of its chunks need per-request seeds."""
    import grail_exp.evaluation as ev

    seen = []

    class Stop(Exception):
        pass

    def capture(name, tokenizer, cfg, per_call, cache_dir, model_key, rank, size):
        raise Stop

    monkeypatch.setattr(ev, "_benchmark", capture)
    monkeypatch.setattr(ev, "SamplingParams", lambda **k: seen.append(k) or SamplingParams(**k))
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"eval": {"n": 2, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 8,
                                     "batch_size": 4}, "benchmark": {"names": ["arithmetic"]}})
    with pytest.raises(Stop):
        ev.evaluate_benchmarks(None, None, None, None, cfg)
    assert seen and seen[0]["per_request_seeds"] is True


# ---------------------------------------------------------------------------------------------- devices
def test_check_engine_device_names_the_fix():
    from grail_exp.rollout.vllm import check_engine_device

    check_engine_device(1, 1, built=False)
    check_engine_device(0, 0, built=True)
    with pytest.raises(LayoutError, match=r"cuda:0 .*trains on cuda:2.*trainer\.devices.*CUDA_VISIBLE_DEVICES"):
        check_engine_device(2, 0, built=False)
    with pytest.raises(LayoutError, match=r"moved this rank's current CUDA device from cuda:1 to cuda:0"):
        check_engine_device(1, 0, built=True)


def _cuda_devices(monkeypatch, current: dict) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA RNG to keep on this CPU build
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])


def test_engine_refuses_another_device_than_the_ranks(fake_vllm, monkeypatch):
    """A single process on cuda:2 (trainer.devices=[2]): vLLM's uniprocess worker would take cuda:0 — refused before
    vLLM is built. On the right device, a build that moves the current device is refused after it."""
    current = {"device": 2}
    calls = fake_vllm(cpu=False, on_build=lambda: current.__setitem__("device", 0))
    _cuda_devices(monkeypatch, current)
    with pytest.raises(LayoutError, match="trains on cuda:2"):
        _engine()
    assert not [c for c in calls if c[0] == "LLM"]
    current["device"] = 0
    fake_vllm(cpu=False, on_build=lambda: current.__setitem__("device", 1))
    with pytest.raises(LayoutError, match="from cuda:0 to cuda:1"):
        _engine()
    current["device"] = 0
    fake_vllm(cpu=False)
    assert _engine().llm is not None  # same device before and after: built


@pytest.mark.parametrize("devices, ok", [("[1,2]", False), ("[1]", False), ("[0,1]", True), ("2", True),
                                         ("'1,0'", False)])
def test_validate_refuses_a_device_list_the_engine_cannot_follow(compose_cfg, devices, ok):
    from grail_exp.validate import engine_devices

    cfg = compose_cfg(["rollout=vllm", "trainer=ddp", "trainer.accelerator=gpu", f"trainer.devices={devices}"])
    errors = engine_devices(cfg)
    assert (errors == []) == ok, errors
    if not ok:
        assert errors[0].startswith("trainer.devices = ") and "CUDA_VISIBLE_DEVICES=" in errors[0]
    cfg = compose_cfg(["rollout=hf", "trainer=ddp", "trainer.accelerator=gpu", f"trainer.devices={devices}"])
    assert engine_devices(cfg) == []  # the HF engine samples with the policy, on the rank's device


def test_validate_reports_the_device_list(compose_cfg):
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match=r"trainer\.devices = \[1, 2\]: with rollout.engine=vllm"):
        validate(compose_cfg(["rollout=vllm", "trainer=ddp", "trainer.accelerator=gpu", "trainer.devices=[1,2]"]))


@pytest.mark.parametrize("override, key", [
    ("rollout.vllm.max_num_batched_tokens=128", "rollout.vllm.max_num_batched_tokens"),  # < max_num_seqs 256
    ("rollout.vllm.max_num_seqs=0", "rollout.vllm.max_num_seqs"),
    ("+rollout.vllm.kwargs.max_num_seqs=8", "rollout.vllm.kwargs.max_num_seqs"),
    ("+rollout.vllm.kwargs.revision=main", "rollout.vllm.kwargs.revision"),
])
def test_engine_sizes_are_checked(compose_cfg, override, key):
    from grail_exp.validate import vllm

    assert vllm(compose_cfg(["rollout=vllm", "rollout.vllm.max_num_seqs=512"])) == []  # 512 <= 4096 tokens
    errors = vllm(compose_cfg(["rollout=vllm", override]))
    assert any(e.startswith(key + " = ") for e in errors), errors


# ---------------------------------------------------------------------------------------------- shutdown
def test_close_shuts_the_engine_down_once(fake_vllm):
    calls = fake_vllm(cpu=True)
    e = _engine()
    e.close()
    e.close()
    assert [c for c in calls if c[0] == "shutdown"] == [("shutdown",)] and e.llm is None
