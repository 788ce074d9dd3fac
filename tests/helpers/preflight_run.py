"""`python -m grail_exp.preflight` end to end on the shipped tiny model, shrunk to one decoder layer on 2 gloo ranks
(tests/test_preflight.py, tests/test_lora_preflight.py): the command, and the table's verdicts as the tests read them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "grail_exp" / "data" / "embedded" / "tiny"
CHECK_NAMES = {"world", "collective_devices", "weight_sync", "checkpoint_roundtrip", "resume", "stop_signal",
               "eval_sharded", "device_memory", "host_memory", "checkpoint_time", "lora_adapter"}
# Every check must pass on the CPU rehearsal (the stop signal too: the ranks agree on it at every step; before they did,
# the job hung after a SIGTERM to one rank and the preflight ended it after preflight.stop_timeout_s).
PENDING: set[str] = set()
RUN = ["trainer.accelerator=cpu", "trainer.devices=2", f"model.name_or_path={MODEL}", "preflight.layers=1",
       "loss.num_iterations=1", "trainer.prompts_per_step=4", "rollout.num_generations=4", "trainer.micro_batch_size=8",
       "rollout.max_completion_length=32", "eval.n=2", "eval.batch_size=4", "eval.max_tokens=32", "reward.num_workers=0",
       "trainer.sample_table_every=0", "logger=none", "preflight.stop_timeout_s=60"]
VLLM = ["rollout.vllm.max_model_len=256", "rollout.top_k=5", "rollout.vllm.sync_chunk_mb=1"]


def run_preflight(tmp_path: Path, extra: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """The rehearsal of ``RUN`` + ``extra``: its output and {check: PASS | FAIL | n/a} from its table."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-m", "grail_exp.preflight", *RUN, *extra, f"paths.root_dir={tmp_path}",
                          f"preflight.dir={tmp_path}/pf"], env=env, capture_output=True, text=True, timeout=1200,
                         cwd=tmp_path)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w+) \| (PASS|FAIL|n/a) \|", out.stdout, re.M)}
    return out, rows


def check_rehearsal(out: subprocess.CompletedProcess, rows: dict, not_judged=("lora_adapter",)) -> None:
    """Every check passes but those ``not_judged`` in this layout (n/a; lora_adapter without peft=lora)."""
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert set(rows) == CHECK_NAMES, tail
    assert all(rows[k] == "n/a" for k in not_judged), tail
    assert {k for k, v in rows.items() if v != "PASS"} <= PENDING | set(not_judged), tail
    assert out.returncode == (1 if "FAIL" in rows.values() else 0), tail
    assert "1 of 2 decoder layers" in out.stdout and "gloo" in out.stdout
