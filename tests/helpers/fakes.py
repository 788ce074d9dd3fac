"""Deterministic stand-ins for the rollout engine and the verifier, importable by child processes (PYTHONPATH=tests).

``ScriptedEngine`` answers each arithmetic prompt with scripted completions that depend only on the prompt text
and the sample index — never on an RNG or on which process generates them — so a 2-process DDP run and a
1-process run see exactly the same rollouts (``rollout.engine=helpers.fakes:ScriptedEngine``).
``OwnCopyEngine`` keeps a copy of its own that starts from dummy weights, as the vLLM engine does.
``AlternatingVerifier`` grades every third completion correct, whatever it says (tests monkeypatch it in for
``grail_exp.grading.rewards.MathVerifier``), so advantages are non-zero even for a random model.
"""

from __future__ import annotations

import re
import zlib

from grail_exp.rollout.base import Completion, SamplingParams


def _solve(expr: str) -> tuple[list[str], int]:
    tokens = re.findall(r"\d+|[+\-*]", expr)
    value, steps = int(tokens[0]), []
    for op, num in zip(tokens[1::2], tokens[2::2]):
        new = {"+": value + int(num), "-": value - int(num), "*": value * int(num)}[op]
        steps.append(f"{value}{op}{num}={new}.")
        value = new
    return steps, value


class ScriptedEngine:
    def __init__(self, model, tokenizer, batch_size: int = 256):
        self.tokenizer = tokenizer

    def sync_weights(self, model) -> None:
        pass

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p, skip_special_tokens=True)
            m = re.search(r"Compute ([0-9+\-* ]+)\.", text)
            steps, value = _solve(m.group(1)) if m else ([], 0)
            h = zlib.crc32(text.encode())
            for k in range(params.n):
                wrong = (h >> k) & 1  # about half the samples of a prompt are wrong: non-zero advantages
                answer = value + (1 + (h + k) % 7) * (1 if wrong else 0)
                body = " ".join(steps) + f" \\boxed{{{answer}}}" + (" ok" if k % 3 == 2 else "")
                ids = self.tokenizer(body, add_special_tokens=False)["input_ids"][: params.max_new_tokens - 1]
                out.append(Completion(list(p), ids + [self.tokenizer.eos_token_id], None, False))
        return out


class SleepRecordingEngine:
    """transformers ``generate`` on the policy, with vLLM's sleep-mode contract: ``sleep()`` releases the engine,
    ``generate`` refuses while asleep (as ``VLLMRolloutEngine`` does), ``sync_weights`` wakes it. Every call is appended
    to ``events`` and, when ``GRAIL_EXP_ENGINE_EVENTS`` names a file, written there (one per line) for a parent test."""

    def __init__(self, model, tokenizer, batch_size: int = 256):
        from grail_exp.rollout.hf import HFRolloutEngine

        self.inner = HFRolloutEngine(model, tokenizer, batch_size=batch_size)
        self.sleeping = False
        self.events: list[str] = []

    def _record(self, event: str) -> None:
        import os

        self.events.append(event)
        path = os.environ.get("GRAIL_EXP_ENGINE_EVENTS")
        if path:
            with open(path, "a") as f:
                f.write(event + "\n")

    def sync_weights(self, model) -> None:
        self._record("sync")
        self.sleeping = False
        self.inner.sync_weights(model)

    def generate(self, prompts, params):
        if self.sleeping:
            raise RuntimeError("generate() while the engine sleeps: sync_weights() must wake it first")
        self._record("generate")
        return self.inner.generate(prompts, params)

    def sleep(self) -> None:
        self._record("sleep")
        self.sleeping = True


class OwnCopyEngine:
    """transformers ``generate`` on a copy of the policy of its own, with the contract of ``VLLMRolloutEngine`` built
    with dummy weights: the copy starts from random weights (never the policy's), takes the policy's from the update
    backend's streamed chunks (``load_weights``, with ``dtype`` and ``sync_chunk_bytes``, so ``sync_engine`` streams to
    it as to vLLM), and ``generate`` refuses until the first load. Every call is appended to ``events`` and, when
    ``GRAIL_EXP_ENGINE_EVENTS`` names a file, written there (one per line)."""

    def __init__(self, model, tokenizer, batch_size: int = 256):
        import copy

        import torch

        from grail_exp.rollout.hf import HFRolloutEngine

        own = copy.deepcopy(model).eval()
        g = torch.Generator().manual_seed(12345)
        with torch.no_grad():  # vLLM's dummy load: random values, nothing read from the policy or its files
            for t in own.state_dict().values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g) * 0.02)
        self.own, self.inner = own, HFRolloutEngine(own, tokenizer, batch_size=batch_size)
        self.dtype, self.sync_chunk_bytes = next(own.parameters()).dtype, 2**16
        self.loaded, self.events = False, []

    _record = SleepRecordingEngine._record

    def load_weights(self, chunks) -> None:
        import torch

        names = set(self.own.state_dict())
        with torch.no_grad():
            mine = self.own.state_dict()
            for chunk in chunks:
                for name, t in chunk:
                    mine[name].copy_(t)
                    names.discard(name)
        assert not names, f"the sync left {sorted(names)} at their dummy values"
        self.loaded = True
        self._record("load")

    def sync_weights(self, model) -> None:
        self.load_weights([list(model.state_dict().items())])

    def generate(self, prompts, params):
        if not self.loaded:
            self._record("generate before any load")
            raise RuntimeError("OwnCopyEngine: generate() before the first load_weights (it holds dummy weights)")
        self._record("generate")
        return self.inner.generate(prompts, params)


class AlternatingVerifier:
    """Deterministic stand-in for MathVerifier: every third completion is 'correct', so advantages are non-zero."""

    def __init__(self, *args, **kwargs):
        self.counters = {"timeout": 0}

    def score(self, completions, golds, extraction=None):  # the evaluation passes the benchmark's extraction rule
        from grail_exp.grading.rewards import GradeResult

        return [GradeResult(i % 3 == 0, "x", "ok") for i in range(len(completions))]

    def close(self):
        pass


class OwnWeightsEngine(ScriptedEngine):
    """A plug-in engine that keeps its own copy of the weights (``load_weights``: full tensors streamed in chunks) and
    has no way to take a LoRA adapter: ``peft.sync=merged`` suits it, ``peft.sync=adapter`` is refused."""

    dtype = None
    sync_chunk_bytes = 1 << 20

    def load_weights(self, chunks) -> None:
        for _ in chunks:
            pass
