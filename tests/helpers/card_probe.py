"""The probe of the card's dress rehearsal (``GRAIL_EXP_PROBE=helpers.card_probe:CardProbe``, ``PYTHONPATH=tests``):
every rank writes what it did, one JSON line per probe point, to ``$GRAIL_EXP_PROBE_DIR/rank<r>.jsonl``
(grail_exp/training/probe_points.py lists the points). The tests judge the run by these files, not by its log or exit code.

- ``setup``: the world this rank runs in (torch.distributed's size, rank, backend) and its engine;
- ``rollout``: the data indices and questions of the prompts this rank sampled;
- ``synced``: after every weight sync (rollouts and evaluations), the engine's log-probs of a fixed completion — its
  greedy continuation of a fixed prompt — against the trainer's forward on the same tokens;
- ``step``: a sha256 of the full weights after every optimiser step (gathered under FSDP, the replica otherwise);
- ``evaluated``: the gathered evaluation (its metrics, every sample's completion, which rank generated each chunk).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from helpers.probe_writer import JsonlProbe


class CardProbe(JsonlProbe):

    def setup(self, module):
        import torch.distributed as dist

        engine = module.rollout.engine
        vllm = {}
        if hasattr(engine, "llm"):  # the rank and device index vLLM's own world gave this engine, and its executor
            from vllm.distributed.parallel_state import get_world_group

            group = get_world_group()
            vllm = {"vllm_rank": group.rank, "vllm_local_rank": group.local_rank,
                    "vllm_executor": engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend}
        self._write("setup", world_size=dist.get_world_size() if dist.is_initialized() else 1,
                    rank=dist.get_rank() if dist.is_initialized() else 0,
                    backend=str(dist.get_backend()) if dist.is_initialized() else "none",
                    engine=type(engine).__name__, local_rank=os.environ.get("LOCAL_RANK"), **vllm)

    def rollout(self, module, round_index):
        r = module.rollout
        self._write("rollout", round=round_index, indices=list(r.last_prompt_indices),
                    questions=sorted({s[0].question for s in r.samples}))

    def synced(self, backend, engine):
        from grail_exp.preflight.probe import engine_and_trainer_logprobs

        assert backend.module.cfg.rollout.temperature == 1.0  # greedy log-probs are log softmax(z) = the trainer's at T = 1
        tokens, engine_lp, trainer_lp = engine_and_trainer_logprobs(backend, engine)
        self._write("synced", tokens=tokens, engine=engine_lp.tolist(), trainer=trainer_lp.tolist(),
                    max_abs_diff=float((engine_lp - trainer_lp).abs().max()))

    def step(self, module, step):
        h = hashlib.sha256()
        for name, t in module.backend.full_tensors():
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        self._write("step", step=step, weights_sha256=h.hexdigest())

    def evaluated(self, module, tag, result):
        self._write("evaluated", tag=tag, metrics=result.flat_metrics(), generated_by=result.generated_by,
                    completions=[s["completion"] for s in result.samples])


def read(probe_dir: Path) -> dict[int, list[dict]]:
    """rank -> its probe records, in order."""
    out = {}
    for f in sorted(Path(probe_dir).glob("rank*.jsonl")):
        out[int(f.stem.removeprefix("rank"))] = [json.loads(line) for line in f.read_text().splitlines()]
    return out


class WorldProbe(CardProbe):
    """Only the ``setup`` point: the world each rank ran in (for runs whose engine gives no log-probs to compare)."""

    synced = rollout = step = evaluated = None
