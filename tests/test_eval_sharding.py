"""The final evaluation over data-parallel ranks (grail_exp/evaluate.py): every rank gets about the same work, the
results do not depend on the number of ranks, and an evaluation leaves the training run's random streams (CPU, every
CUDA device, Python, NumPy) exactly where it found them.

The ranks are simulated in one process: ``world`` answers rank r of W, and ``gather_to_all`` hands back the shares
the other ranks computed in earlier calls (each rank's share depends on its own chunks and their seeds alone, which is
what these tests pin)."""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass

import numpy as np
import torch

from grail_exp.rollout.base import Completion

PAPER = ["benchmark=paper", "eval=paper", "eval.n_boot=10"]
# The shipped sizes of eval=paper's six benchmarks (grail_exp/data/benchmark_files, `wc -l`) and its chunk of
# batch_size 255 / n 3 = 85 problems.
PAPER_SIZES = {"math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "college_math_200": 200,
               "olympiadbench_200": 200}
PER_CALL = 85


class Tok:
    """The chat template is the message itself; a prompt's ids are its first characters' code points (mod 1000);
    decoding prints the ids."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        return messages[-1]["content"]

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(ch) % 1000 for ch in t[:8]] for t in texts]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]

    bos_token_id = None
    chat_template = "the message itself"


@dataclass
class Grade:
    correct: bool
    extracted: str | None
    status: str = "ok"


class Verifier:
    """A sample is correct when its first token is even: results move with every drawn token."""

    def score(self, texts, golds, extraction=None):
        return [Grade(int(t.split()[0]) % 2 == 0, t.split()[0]) for t in texts]


class RandomEngine:
    """Samples 1-4 tokens per completion from torch's global stream (as ``generate`` draws from it) and touches
    Python's and NumPy's global streams too; counts the problems it was given."""

    def __init__(self):
        self.problems = 0

    def generate(self, prompts, params):
        self.problems += len(prompts)
        random.random()
        np.random.rand()
        out = []
        for p in prompts:
            for _ in range(params.n):
                k = int(torch.randint(1, 5, ()))
                out.append(Completion(p, torch.randint(0, 1000, (k,)).tolist(), None, False))
        return out


class _Share(Exception):
    def __init__(self, share):
        self.share = share


def evaluate_on_ranks(cfg, world_size: int, monkeypatch) -> tuple[object, list[int]]:
    """``evaluate_benchmarks`` as rank 0 of ``world_size`` ranks sees it, and the problems each rank generated."""
    from grail_exp import world
    from grail_exp.evaluation import evaluate_benchmarks

    shares, problems = {}, []
    for r in [*range(1, world_size), 0]:
        engine = RandomEngine()
        monkeypatch.setattr(world, "rank", lambda r=r: r)
        monkeypatch.setattr(world, "world_size", lambda: world_size)

        def gather(share, r=r):
            if r != 0:
                raise _Share(share)
            return [share, *(shares[k] for k in range(1, world_size))]

        monkeypatch.setattr(world, "gather_to_all", gather)
        try:
            result = evaluate_benchmarks(None, Tok(), engine, Verifier(), cfg)
        except _Share as s:
            shares[r] = s.share
        problems.append(engine.problems)
    return result, [problems[-1], *problems[:-1]]


def round_robin_problems(world_size: int) -> list[int]:
    """The old assignment, written out: the g-th chunk over all benchmarks to rank g % W."""
    sizes = [min(PER_CALL, n - c * PER_CALL) for n in PAPER_SIZES.values() for c in range(-(-n // PER_CALL))]
    return [sum(s for g, s in enumerate(sizes) if g % world_size == r) for r in range(world_size)]


def test_paper_evaluation_splits_evenly_over_4_ranks_with_the_same_results_on_1_2_and_4(compose_cfg, monkeypatch):
    from grail_exp.data import load_benchmark

    cfg = compose_cfg(PAPER)
    assert {n: len(load_benchmark(n, cfg)) for n in cfg.benchmark.names} == PAPER_SIZES
    assert cfg.eval.batch_size // cfg.eval.n == PER_CALL
    assert round_robin_problems(4) == [425, 360, 230, 227]  # the starting point: a spread of 198 problems

    one, (all_problems,) = evaluate_on_ranks(cfg, 1, monkeypatch)
    assert all_problems == sum(PAPER_SIZES.values()) == 1242
    two, per_rank_2 = evaluate_on_ranks(cfg, 2, monkeypatch)
    four, per_rank_4 = evaluate_on_ranks(cfg, 4, monkeypatch)
    assert sum(per_rank_2) == sum(per_rank_4) == 1242  # every problem generated once
    # The stated bound: the busiest rank has at most one chunk (85 problems x n) more than the idlest. With these
    # sizes no assignment of whole chunks has a busiest rank under 330 (12 chunks of 85 and one of 75 over 4 ranks).
    assert max(per_rank_4) - min(per_rank_4) <= PER_CALL, per_rank_4
    assert max(per_rank_4) == 330, per_rank_4
    assert max(per_rank_2) - min(per_rank_2) <= PER_CALL, per_rank_2
    for other in (two, four):  # bit for bit: every metric, array and per-sample row
        assert pickle.dumps((other.summaries, other.average)) == pickle.dumps((one.summaries, one.average))
        assert other.samples == one.samples
    assert set(four.generated_by.values()) == {0, 1, 2, 3}


class FakeCuda:
    """torch.cuda of a machine with ``n`` initialized devices, each generator's state a tensor of (seed, draws)."""

    def __init__(self, n: int):
        self.states = [torch.tensor([1000 + d, 0]) for d in range(n)]
        self.seeded: list[int] = []

    def install(self, monkeypatch, initialized: bool = True) -> None:
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: initialized,
                         "device_count": lambda: len(self.states), "get_rng_state": self.get_rng_state,
                         "set_rng_state": self.set_rng_state, "manual_seed_all": self.manual_seed_all,
                         "_is_in_bad_fork": lambda: False}.items():
            monkeypatch.setattr(torch.cuda, name, fn, raising=False)

    def get_rng_state(self, device="cuda"):
        return self.states[_index(device)].clone()

    def set_rng_state(self, state, device="cuda"):
        self.states[_index(device)] = state.clone()

    def manual_seed_all(self, seed):
        self.seeded.append(int(seed))
        self.states = [torch.tensor([int(seed), 0]) for _ in self.states]

    def draw(self, device: int) -> None:
        self.states[device][1] += 1


def _index(device) -> int:
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return d.index or 0


def _small_cfg(compose_cfg):
    return compose_cfg(PAPER + ["benchmark.names=[aime24,amc23]", "eval.batch_size=30"])  # 30 / n 3: 3 + 4 chunks of 10


def _streams() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_evaluation_leaves_the_training_streams_where_they_were(compose_cfg, monkeypatch):
    """A training stream (torch CPU, Python, NumPy) after an evaluation draws what it draws without one."""
    from grail_exp.evaluation import evaluate_benchmarks

    cfg = _small_cfg(compose_cfg)

    def stream(evaluate: bool):
        torch.manual_seed(3), random.seed(3), np.random.seed(3)
        first = _streams()
        if evaluate:
            evaluate_benchmarks(None, Tok(), RandomEngine(), Verifier(), cfg)
        return first, _streams()

    assert stream(True) == stream(False)


def test_evaluation_restores_every_cuda_devices_generator(compose_cfg, monkeypatch):
    """Each chunk reseeds every CUDA device (torch.manual_seed) and the engine draws on them; afterwards each
    device's generator holds its state from before the evaluation."""
    from grail_exp.evaluation import evaluate_benchmarks

    cuda = FakeCuda(3)
    cuda.install(monkeypatch)

    class CudaEngine(RandomEngine):
        def generate(self, prompts, params):
            for d in range(len(cuda.states)):
                cuda.draw(d)
            return super().generate(prompts, params)

    cuda.draw(1)
    before = [s.tolist() for s in cuda.states]
    evaluate_benchmarks(None, Tok(), CudaEngine(), Verifier(), _small_cfg(compose_cfg))
    assert len(cuda.seeded) == 7  # one seed per chunk reached the devices: the engine sampled on seeded generators
    assert [s.tolist() for s in cuda.states] == before


def test_evaluation_before_cuda_is_initialized_queues_no_cuda_seed(compose_cfg, monkeypatch):
    """Without an initialized CUDA nothing samples on it: seeding it would queue a seed that CUDA's initialization
    applies later, to the training stream."""
    from grail_exp.evaluation import evaluate_benchmarks

    cuda = FakeCuda(2)
    cuda.install(monkeypatch, initialized=False)
    evaluate_benchmarks(None, Tok(), RandomEngine(), Verifier(), _small_cfg(compose_cfg))
    assert cuda.seeded == []
