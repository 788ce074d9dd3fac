"""Host memory on a node: the weights are loaded once per node, not once per rank (2 gloo ranks, real processes).

Rank 0 reads the weights; every other rank builds its policy on the meta device (``job.build_parts``) and receives its
FSDP shards from rank 0 in the backend's ``configure_model``. Rank 1's peak resident memory during the load therefore
stays near its shard (4 B x N / 2 fp32), not the whole fp32 model (4 B x N) that it loaded before.

Slow (a 117 M-parameter tree, so that the shard and the full model are far apart in resident memory); the main suite's
cheap variant checks the mechanism on the tiny model (tests/test_rank_agreement.py: rank 1 holds a meta skeleton after
``build_parts`` and receives rank 0's weights, under FSDP and DDP).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tolerances import HANG_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
MiB = 2**20
# A Qwen3 tree of ~117 M parameters whose largest tensor (an MLP projection, 256 x 12,288) is 1/37 of the model: full
# and shard (447 MiB and 224 MiB in fp32) are far apart, and the one tensor in flight is small beside either.
ARCH = ["model=qwen3_4b", "recipe=demo", "model.random_init=true",
        "model.random_init_overrides={num_hidden_layers: 12, hidden_size: 256, intermediate_size: 12288, "
        "vocab_size: 4096, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 64}"]
# What a rank allocates beside its tensors while it loads: gloo's buffers and the process group's store, the state
# dict's metadata broadcast as a pickle, the skeleton's Python objects, allocator slack (glibc keeps freed arenas).
# Measured on rank 1 with 8 such layers: 41-45 MiB above its shard, the tensors in flight included.
LOAD_SLACK = 64 * MiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_on_two_ranks(tmp_path: Path, trainer: list[str]) -> dict[int, dict]:
    overrides = [*ARCH, *trainer, "trainer.accelerator=cpu", "trainer.devices=2", "reward.num_workers=0",
                 f"paths.root_dir={tmp_path}", f"paths.cache_dir={tmp_path}/cache", "paths.output_dir=."]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    script = str(TESTS / "helpers" / "load_rank.py")
    # Rank 0 first writes the random-init directory both ranks read (as a shared cache would hold it).
    subprocess.run([sys.executable, "-c", "import sys; from hydra import compose, initialize_config_dir; "
                    "from grail_exp.conf_path import CONFIG_DIR; from grail_exp.config import register_configs; "
                    "from grail_exp.models.loading import resolve_model_path; register_configs(); "
                    "initialize_config_dir(config_dir=CONFIG_DIR, version_base='1.3'); "
                    "resolve_model_path(compose(config_name='config', overrides=sys.argv[1:]))", *overrides],
                   env=env, check=True, timeout=HANG_TIMEOUT_S, cwd=tmp_path)
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / f"rank{r}.json"), *overrides],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    logs = [p.communicate(timeout=HANG_TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.e2e
@pytest.mark.slow
def test_rank1_loads_its_fsdp_shard_not_the_model(tmp_path):
    ranks = _load_on_two_ranks(tmp_path, ["trainer=fsdp"])
    r1 = ranks[1]
    full = 4 * r1["params"]  # the fp32 policy FSDP trains (its master weights)
    shard = full / 2
    # Its shard, one full tensor received from rank 0 and its slice being copied, and the slack of a process.
    bound = shard + 2 * r1["largest"] + LOAD_SLACK
    print(f"rank 1: load grew the resident set by {r1['growth'] / MiB:.1f} MiB; shard {shard / MiB:.1f} MiB, full "
          f"{full / MiB:.1f} MiB, bound {bound / MiB:.1f} MiB; rank 0: {ranks[0]['growth'] / MiB:.1f} MiB")
    assert bound < full  # the test can tell the two apart
    assert r1["growth"] <= bound, (f"rank 1 grew by {r1['growth'] / MiB:.0f} MiB while loading; its shard is "
                                   f"{shard / MiB:.0f} MiB, the full model {full / MiB:.0f} MiB")
    # and the shards it received are rank 0's weights
    assert ranks[0]["start_sha256"] and ranks[0]["placed_sha256"] == ranks[0]["start_sha256"]
    assert r1["placed_sha256"] == ranks[0]["start_sha256"]
    assert r1["placed_buffers_sha256"] == ranks[0]["placed_buffers_sha256"] == ranks[0]["start_buffers_sha256"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_replicated_policy_reaches_every_rank_from_rank0(tmp_path):
    """trainer=ddp: rank 1 holds one copy, in the model's dtype, equal to the weights rank 0 loaded."""
    ranks = _load_on_two_ranks(tmp_path, ["trainer=ddp"])
    r1 = ranks[1]
    assert r1["placed_sha256"] == ranks[0]["start_sha256"] == ranks[0]["placed_sha256"]
    assert r1["placed_buffers_sha256"] == ranks[0]["placed_buffers_sha256"] == ranks[0]["start_buffers_sha256"]
    assert r1["growth"] <= 2 * r1["params"] + 2 * r1["largest"] + LOAD_SLACK  # bf16: one copy, no fp32 detour
