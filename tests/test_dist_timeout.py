"""``trainer.dist_timeout_s``: the timeout of every process group the run creates (Lightning's strategy, DeepSpeed's
one-process group), by default long enough for the planned checkpoint write (grail_exp/memory/
``needed_dist_timeout``), printed by the planner, refused when not positive and warned about when below the need."""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import pytest
import torch

from grail_exp.config import ConfigError
from grail_exp.validate import validate

# Qwen3-8B's parameters from its config.json (hidden 4096, 36 layers, MLP 12288, 32 query / 8 KV heads of 128,
# vocabulary 151936, untied output layer): per layer q, k, v, o, the SwiGLU MLP, two RMSNorms, the q/k norms; the
# embedding and the output layer; the final norm. 8.2B on its model card.
_LAYER = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
QWEN3_8B_PARAMS = 36 * _LAYER + 2 * 151936 * 4096 + 4096
assert QWEN3_8B_PARAMS == 8_190_735_360
# The rule written out: 16 bytes per parameter written at 100 MB/s, twice, in whole minutes, never under 30 minutes.
QWEN3_8B_TIMEOUT = max(1800, 60 * math.ceil(2 * 16 * QWEN3_8B_PARAMS / 100e6 / 60))  # 2 x 1310.5 s -> 2640 s


class _Recorded(Exception):
    pass


def _record_init(monkeypatch) -> list[dict]:
    """torch.distributed with no group yet whose init_process_group records its arguments (and creates nothing)."""
    calls: list[dict] = []

    def init_process_group(backend=None, **kwargs):
        calls.append({"backend": backend, **kwargs})

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for var, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(var, value)  # restored after the test, whatever the code under test sets
    return calls


@pytest.mark.parametrize("overrides, seconds", [
    (["trainer.dist_timeout_s=4321"], 4321),
    (["model=qwen3_8b"], QWEN3_8B_TIMEOUT),  # null: what its checkpoint needs
])
def test_lightnings_process_group_is_created_with_the_timeout(compose_cfg, monkeypatch, overrides, seconds):
    from lightning.fabric.plugins.environments import LightningEnvironment

    from grail_exp.distributed import build_strategy
    from grail_exp.memory import dist_timeout

    cfg = compose_cfg(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1", *overrides])
    calls = _record_init(monkeypatch)
    strategy = build_strategy(cfg, dist_timeout(cfg))
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.setup_distributed()
    assert len(calls) == 1 and calls[0]["backend"] == "gloo"
    assert calls[0]["timeout"] == timedelta(seconds=seconds)


@pytest.mark.parametrize("overrides, seconds", [
    (["trainer.dist_timeout_s=4321"], 4321),
    ([], 1800),  # null: what a 6-parameter policy's checkpoint needs, the floor (NCCL's own default is 600 s)
])
def test_deepspeeds_own_process_group_is_created_with_the_timeout(compose_cfg, monkeypatch, overrides, seconds):
    deepspeed = pytest.importorskip("deepspeed")
    from grail_exp.training.backends import deepspeed as backend

    cfg = compose_cfg(["trainer=deepspeed_zero2", "trainer.accelerator=cpu", "trainer.devices=1", *overrides])
    calls = _record_init(monkeypatch)

    def initialize(**kwargs):  # the group is what is tested; no engine is built
        raise _Recorded()

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    with pytest.raises(_Recorded):
        backend.initialize(torch.nn.Linear(2, 2), None, cfg)
    assert len(calls) == 1 and calls[0].get("timeout") == timedelta(seconds=seconds)


def test_the_planner_prints_the_timeout_the_checkpoint_needs(compose_cfg):
    from grail_exp.memory import needed_dist_timeout, plan, render
    from grail_exp.timeouts import needed_dist_timeout as rule

    cfg = compose_cfg(["model=qwen3_8b", "trainer.device_memory_gb=141"])
    seconds, how = needed_dist_timeout(cfg)
    assert seconds == QWEN3_8B_TIMEOUT == 2640
    assert f"{16 * QWEN3_8B_PARAMS / 1e9:.1f} GB" in how  # 131.1 GB
    lines = [x for x in render(plan(cfg)).splitlines() if x.startswith("timeouts needed:")]
    assert lines == [f"timeouts needed: trainer.dist_timeout_s >= 2640 s (set: null (= 2640 s)) = {how}"]
    assert needed_dist_timeout(compose_cfg())[0] == 1800  # the tiny model's checkpoint is 7 MB: the floor
    assert rule(5_625_000_000)[0] == 1800 and rule(5_625_000_001)[0] == 1860  # 2 x 16 B x N / 100 MB/s crosses 1800 s
    assert rule(None)[0] == 1800  # an architecture the planner does not know


def test_a_timeout_below_the_planned_checkpoint_write_is_warned_about_and_a_non_positive_one_refused(
        compose_cfg, caplog):
    base = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    with caplog.at_level(logging.WARNING, logger="grail_exp"):
        validate(compose_cfg([*base, "trainer.dist_timeout_s=600"]))
    warned = [r.getMessage() for r in caplog.records if "trainer.dist_timeout_s" in r.getMessage()]
    assert len(warned) == 1 and "600" in warned[0] and "1800 s" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grail_exp"):
        validate(compose_cfg([*base, "trainer.dist_timeout_s=1800"]))
        validate(compose_cfg(["trainer.dist_timeout_s=60"]))  # one process, no process group: no timeout applies
    assert not [r for r in caplog.records if "trainer.dist_timeout_s" in r.getMessage()]
    with pytest.raises(ConfigError, match=r"trainer\.dist_timeout_s = 0: must be > 0"):
        validate(compose_cfg([*base, "trainer.dist_timeout_s=0"]))


def test_a_non_positive_rendezvous_timeout_is_refused_naming_the_key(compose_cfg):
    with pytest.raises(ConfigError, match=r"trainer\.rendezvous_timeout_s = 0: must be > 0"):
        validate(compose_cfg(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                              "trainer.rendezvous_timeout_s=0"]))


def test_the_line_of_a_world_that_did_not_form_names_who_arrived_by_node():
    """8 ranks, 2 per node; ranks 0, 1 (host a) and 4 (host c) arrived. Written out by hand: node n holds ranks 2n and
    2n + 1."""
    from grail_exp.distributed import RENDEZVOUS_KEY, _not_formed

    hosts = {0: "a", 1: "a", 4: "c"}

    class Store:  # what _not_formed reads of the rendezvous store
        def check(self, keys):
            return int(keys[0].rsplit("rank", 1)[1]) in hosts

        def get(self, key):
            assert key.startswith(RENDEZVOUS_KEY)
            return hosts[int(key.rsplit("rank", 1)[1])].encode()

    line = _not_formed(Store(), world_size=8, ranks_per_node=2, timeout_s=600, keys="KEYS")
    assert line == ("the process group did not form within 600 s (trainer.rendezvous_timeout_s): 3 of 8 ranks arrived "
                    "(node 0 (a) ranks 0,1, node 2 (c) rank 4); missing: node 1 ranks 2,3, node 2 rank 5, node 3 "
                    "ranks 6,7. Check KEYS")
