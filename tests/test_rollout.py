"""The HF rollout engine: shapes, stop tokens, truncation flags, sampling log-probs."""

import subprocess
import sys

import pytest
import torch

from grail_exp.compute.forward import completion_logits, position_ids_from_mask
from grail_exp.loss import selective_log_softmax
from grail_exp.rollout import SamplingParams, build_engine, pad_completions
from helpers.tolerances import HANG_TIMEOUT_S, MODEL_REORDER


def _prompts(tok, n=3):
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Compute {i}+{i * 7}."}], add_generation_prompt=True,
                                     tokenize=False, enable_thinking=False) for i in range(n)]
    return tok(texts, add_special_tokens=False)["input_ids"]


def test_generate_layout_and_truncation(tiny_model, tiny_tokenizer):
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer)
    torch.manual_seed(0)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, logprobs=True))
    assert len(out) == 12
    stops = {tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id}
    for i, c in enumerate(out):
        assert c.prompt_ids == prompts[i // 4]  # prompt-major order
        assert len(c.logprobs) == len(c.token_ids) <= 12
        if c.truncated:
            assert len(c.token_ids) == 12 and not (set(c.token_ids) & stops)
        else:
            assert c.token_ids[-1] in stops and not (set(c.token_ids[:-1]) & stops)
    assert tiny_model.training  # engine restores the mode


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.9)])
def test_sampling_logprobs_match_trainer_forward(tiny_model, tiny_tokenizer, top_k, top_p):
    """Sampler-vs-trainer log-probs agree (same positions, temperature-scaled logits), also under top-k / top-p:
    the engine reports the untruncated log softmax(z/T), the distribution the trainer computes."""
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    torch.manual_seed(1)
    out = engine.generate(_prompts(tiny_tokenizer), SamplingParams(n=2, temperature=0.7, max_new_tokens=10,
                                                                   top_k=top_k, top_p=top_p, logprobs=True))
    rb = pad_completions(out, tiny_tokenizer.pad_token_id)
    attn = rb.attention_mask
    with torch.no_grad():
        logits = completion_logits(tiny_model.eval(), rb.input_ids, attn, position_ids_from_mask(attn),
                                   rb.completion_ids.shape[1], 0.7)
    logp = selective_log_softmax(logits, rb.completion_ids)
    m = rb.completion_mask.bool()
    # The engine's incremental forward (KV cache, one position at a time) sums in another order than the trainer's
    # full-sequence forward: log softmax(z/T) moves by <= MODEL_REORDER of the logits' scale (measured: < 2e-6).
    assert torch.allclose(logp[m], rb.sampling_logprobs[m], rtol=0, atol=MODEL_REORDER * logits.abs().max().item())


def test_no_logprobs_unless_asked(tiny_model, tiny_tokenizer):
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    out = engine.generate(_prompts(tiny_tokenizer, 1), SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
    assert all(c.logprobs is None for c in out)


_PEAK_SCRIPT = r"""
import resource, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from grail_exp.rollout.base import SamplingParams
from grail_exp.rollout.hf import HFRolloutEngine
torch.manual_seed(0); torch.set_num_threads(1)
V = 151936
cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512)
model = Qwen3ForCausalLM(cfg).eval()
class Tok: eos_token_id = V - 1; pad_token_id = V - 2
engine = HFRolloutEngine(model, Tok(), batch_size=64)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
for tokens in (8, 64):
    out = engine.generate([[1, 2, 3, 4]] * 2, SamplingParams(n=16, max_new_tokens=tokens, top_k=50, logprobs=True))
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)
    print(tokens, peak())
"""


@pytest.mark.e2e
def test_generation_memory_does_not_grow_with_vocab_times_length():
    """32 completions at V = 151,936: keeping every step's float32 scores (what ``output_scores`` did) would add
    1.2 GB between 8 and 64 generated tokens; the engine keeps one step's (N, V) log-softmax (19 MB). Peak RSS is
    read in a fresh process with a fixed malloc mmap threshold: glibc's adaptive threshold otherwise serves the
    freed 19 MB blocks from a fragmenting heap and the high-water mark measures the allocator, not our tensors."""
    import os

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = dict(line.split() for line in out.stdout.strip().splitlines())
    growth_mb = float(peaks["64"]) - float(peaks["8"])
    all_scores_mb = 32 * (64 - 8) * 151936 * 4 / 2**20
    assert growth_mb < 100, f"peak RSS grew {growth_mb:.0f} MB from 8 to 64 tokens (all scores: {all_scores_mb:.0f} MB)"


def test_greedy_is_deterministic(tiny_model, tiny_tokenizer):
    engine = build_engine("hf", tiny_model, tiny_tokenizer)
    p = _prompts(tiny_tokenizer, 2)
    a = engine.generate(p, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    b = engine.generate(p, SamplingParams(n=1, temperature=0, max_new_tokens=8))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_pad_completions_layout():
    from grail_exp.rollout import Completion

    rb = pad_completions([Completion([5, 6], [1, 2, 3], [-.1, -.2, -.3], False),
                          Completion([7], [4], [-.4], True)], pad_id=0)
    assert rb.prompt_ids.tolist() == [[5, 6], [0, 7]] and rb.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert rb.completion_ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert rb.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert rb.is_truncated.tolist() == [False, True]
    assert rb.input_ids.shape == (2, 5)


def test_vllm_engine_is_a_clear_error(tiny_model, tiny_tokenizer, tiny_model_dir, compose_cfg):
    """Without vLLM installed, rollout=vllm says how to install it (with it, tests/test_vllm.py covers the engine)."""
    import importlib.util

    with pytest.raises(ValueError, match="model_path"):
        build_engine("vllm", tiny_model, tiny_tokenizer)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the missing-package error cannot be observed")
    cfg = compose_cfg(["rollout=vllm"])
    with pytest.raises(ImportError, match=r"pip install -e \"\.\[gpu\]\".*make test-vllm"):
        build_engine("vllm", tiny_model, tiny_tokenizer, cfg=cfg, model_path=str(tiny_model_dir))


# ---------------------------------------------------------------------------------------------- sleep mode
def test_engine_sleeps_after_the_rounds_generation_and_wakes_in_the_sync(compose_cfg, tiny_model_dir):
    """rollout.vllm.sleep_mode: the rollout phase puts the engine to sleep once all of the round's generation and
    scoring is done — before the old-log-prob forward and the update — and the next round's sync wakes it. (vLLM's
    CPU build refuses sleep mode, so the order is checked on an engine with its contract; tests/test_vllm.py drives
    VLLMRolloutEngine's own sleep / wake calls.)"""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from helpers.fakes import SleepRecordingEngine
    from helpers.module import FakeOpt, build_module, small_config

    cfg = small_config(compose_cfg, tiny_model_dir, ["loss.num_iterations=2"])  # μ = 2: an old-log-prob forward
    module = build_module(cfg, tiny_model_dir)
    engine = SleepRecordingEngine(module.policy, module.tokenizer)
    module.rollout.engine = engine
    forward = module.backend.forward

    def recording_forward(*args, **kwargs):
        engine.events.append("forward:" + ("asleep" if engine.sleeping else "awake"))
        return forward(*args, **kwargs)

    module.backend.forward = recording_forward
    module.manual_backward = lambda loss: loss.backward()
    opt = torch.optim.AdamW(module.policy.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for r in range(2):
        torch.manual_seed(r)
        batch, _ = module.rollout.collect(r, {})
        module.update.step(batch, FakeOpt(opt), sched, batch.loss_mask.sum().item(), {}, epoch=0)
    rounds = "|".join(engine.events).split("|sync|")
    assert engine.events[0] == "sync" and len(rounds) == 2
    for r in rounds:
        ev = r.removeprefix("sync|").split("|")
        assert ev[0] == "generate" and ev[1] == "sleep", ev  # one generate call per round here, then sleep
        assert ev[2:] and all(e == "forward:asleep" for e in ev[2:]), ev  # old log-probs + update: engine asleep


@pytest.mark.e2e
def test_a_run_sleeps_the_engine_between_rounds_and_evaluations(tmp_path, tiny_model_dir):
    """End to end (``python -m grail_exp.run`` with a plug-in engine that refuses to generate while asleep): every
    evaluation and every round syncs (waking the engine) before generating and puts it to sleep afterwards."""
    import os
    from pathlib import Path

    events = tmp_path / "events.txt"
    tests = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", GRAIL_EXP_ENGINE_EVENTS=str(events))
    args = ["logger=none", "rollout.engine=helpers.fakes:SleepRecordingEngine", f"model.name_or_path={tiny_model_dir}",
            "debug=fast", "rollout.max_completion_length=8", "eval.max_tokens=8", "benchmark.limit=2",
            f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path}/run"]
    done = subprocess.run([sys.executable, "-m", "grail_exp.run", *args], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ev = events.read_text().split()
    # before-training evaluation, 2 rounds (debug=fast: 2 steps, μ = 1), final evaluation: each sync…generate…sleep
    phases = " ".join(ev).split("sync")[1:]
    assert len(phases) == 4, ev
    for p in phases:
        calls = p.split()
        assert calls[-1] == "sleep" and set(calls[:-1]) == {"generate"}, ev


# ---------------------------------------------------------------------------------------------- the lean decoder
SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9), dict(temperature=1.0, repetition_penalty=1.3),
             dict(temperature=0.0)]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kw", SAMPLINGS, ids=["plain", "top_k_top_p", "repetition", "greedy"])
def test_lean_decoder_samples_what_generate_samples(tiny_model, tiny_tokenizer, kw, attn):
    """The engine's own loop against transformers ``generate`` (``decode="transformers"``) under one seed: the same
    tokens, stop flags and log-probs, and the random stream left where ``generate`` leaves it. The loop computes the
    same logits in another order (each prompt prefilled once, the decode attention grouped by prompt), so the
    log-probs agree to a reordered reduction of the logits' scale; a token can differ only where a draw falls within
    that rounding of a category boundary (none does for this seed)."""
    from grail_exp.rollout.hf import HFRolloutEngine

    tiny_model.config._attn_implementation = attn
    n = 1 if kw["temperature"] == 0 else 4  # generate refuses n > 1 without sampling
    params = SamplingParams(n=n, max_new_tokens=16, logprobs=True, **kw)
    out, after = {}, {}
    for decode in ("transformers", "lean"):
        torch.manual_seed(3)
        out[decode] = HFRolloutEngine(tiny_model, tiny_tokenizer, decode=decode).generate(_prompts(tiny_tokenizer), params)
        after[decode] = torch.rand(4)
    ref, lean = out["transformers"], out["lean"]
    assert [c.token_ids for c in lean] == [c.token_ids for c in ref]
    assert [c.truncated for c in lean] == [c.truncated for c in ref]
    assert torch.equal(after["lean"], after["transformers"])
    with torch.no_grad():
        scale = tiny_model.get_output_embeddings().weight.abs().max().item() * 10  # |logit| bound: ‖h‖·max|W| ≲ 10 max|W|
    diff = max(abs(a - b) for x, y in zip(lean, ref) for a, b in zip(x.logprobs, y.logprobs))
    assert diff <= MODEL_REORDER * scale
    if kw == SAMPLINGS[0]:
        assert 1 <= sum(not c.truncated for c in lean) < len(lean)  # rows stopped early and rows ran to the budget


def test_lean_decoder_prefills_a_common_prompt_prefix_once(tiny_model, tiny_tokenizer, monkeypatch):
    """Prompts that start with one system turn: the lean decoder prefills it once (a pass of its c tokens, then the
    prompts' tails), and samples what ``generate`` samples under the same seed — the same tokens and stop flags,
    log-probs within a reordered reduction of the logits' scale."""
    import grail_exp.rollout.hf as hf
    from grail_exp.rollout.hf import HFRolloutEngine

    system = [{"role": "system", "content": "Answer with one number in a box. Be brief, exact and careful."}]
    texts = [tiny_tokenizer.apply_chat_template([*system, {"role": "user", "content": f"Compute {i}+{i * 7}."}],
                                                add_generation_prompt=True, tokenize=False, enable_thinking=False)
             for i in range(3)]
    prompts = tiny_tokenizer(texts, add_special_tokens=False)["input_ids"]
    c = 0
    while all(len(p) > c and p[c] == prompts[0][c] for p in prompts):
        c += 1
    passes = []
    real = hf.prompts_once
    monkeypatch.setattr(hf, "prompts_once", lambda *a, **k: passes.append(real(*a, **k)) or passes[-1])
    params = SamplingParams(n=4, max_new_tokens=16, logprobs=True, temperature=1.0)
    out = {}
    for decode in ("transformers", "lean"):
        torch.manual_seed(3)
        out[decode] = HFRolloutEngine(tiny_model, tiny_tokenizer, decode=decode, common_prefix=True).generate(prompts,
                                                                                                           params)
    L = max(map(len, prompts))
    assert c > 20 and [p.positions for p in passes] == [c + 3 * (L - c)]  # the system turn once, then 3 tails
    ref, lean = out["transformers"], out["lean"]
    assert [x.token_ids for x in lean] == [x.token_ids for x in ref]
    assert [x.truncated for x in lean] == [x.truncated for x in ref]
    with torch.no_grad():
        scale = tiny_model.get_output_embeddings().weight.abs().max().item() * 10  # |logit| bound, as above
    assert max(abs(a - b) for x, y in zip(lean, ref) for a, b in zip(x.logprobs, y.logprobs)) <= MODEL_REORDER * scale


def test_grouped_decode_attention_is_each_rows_softmax_attention():
    """One decode step of the grouped attention against a brute-force loop: row r's query against the concatenation of
    its prompt's keys (padding masked) and its own generated keys, softmax in float64. Rows of unequal groups (a
    prompt with no row left, one with one), grouped-query heads (4 query heads per key head)."""
    from types import SimpleNamespace

    from grail_exp.compute.attention import RowGroups
    from grail_exp.compute.model_attention import DECODE_PROMPTS, DecodeKV, grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    U, Hkv, Hq, P, D, T = 3, 2, 8, 5, 4, 6
    keys, values = torch.randn(U, Hkv, P, D, generator=g), torch.randn(U, Hkv, P, D, generator=g)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    groups = RowGroups(torch.tensor([0, 0, 0, 2]), U)  # prompt 1 has no row left, prompt 2 one
    kv = DecodeKV(keys, values, prompt_mask, T, groups)
    for _ in range(3):  # three generated positions per row
        kv.write(torch.randn(4, Hkv, 1, D, generator=g), torch.randn(4, Hkv, 1, D, generator=g))
    q = torch.randn(4, Hq, 1, D, generator=g)
    # the layer's own generated keys and values as key / value, its prompts' part through the keyword (layer 1 of 2)
    out, _ = grouped_decode_attention(SimpleNamespace(layer_idx=1), q, kv.kg[:, :, :3], kv.vg[:, :, :3], scaling=0.5,
                                      **{DECODE_PROMPTS: [None, kv]})
    for r, u in enumerate([0, 0, 0, 2]):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            K = torch.cat([keys[u, kh][prompt_mask[u].bool()], kv.kg[r, kh, :3]]).double()
            V = torch.cat([values[u, kh][prompt_mask[u].bool()], kv.vg[r, kh, :3]]).double()
            a = torch.softmax(q[r, h, 0].double() @ K.T * 0.5, -1)
            assert torch.allclose(out[r, 0, h].double(), a @ V, atol=1e-5)


def test_dropping_finished_rows_changes_nothing(tiny_model, tiny_tokenizer):
    """Finished rows leave the computed batch (compact_at): the tokens and log-probs are those of a loop that keeps
    every row to the end (the rows are independent; only matrix-product batch sizes change)."""
    from grail_exp.rollout.hf import left_pad, sample

    tiny_model.config._attn_implementation = "sdpa"
    ids, attn = left_pad(_prompts(tiny_tokenizer), tiny_tokenizer.pad_token_id, "cpu")
    params = SamplingParams(n=4, max_new_tokens=16, logprobs=True, temperature=1.0)
    stops = list(range(20, 120))  # a third of the vocabulary: rows stop at different steps
    pad = tiny_tokenizer.pad_token_id
    res = []
    for compact_at in (0.01, 2.0):  # drop at the first finished row | never
        torch.manual_seed(5)
        res.append(sample(tiny_model.eval(), ids, attn, params, stops, pad, compact_at=compact_at))
    (t1, l1), (t2, l2) = res
    assert torch.equal(t1, t2)
    lengths = (t1 != pad).sum(1)
    assert lengths.min() < lengths.max() < 16  # early and late stops
    live = torch.arange(16)[None, :] < lengths[:, None]  # up to and including each row's stop token
    assert torch.allclose(l1[live], l2[live], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the inverse-CDF draw
def _warped_distribution(z: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution transformers' sampling defines, from its documented rules, one row at a time in float64:
    z / T; top-k keeps every score >= the k-th largest; top-p (on the scores sorted ascending) removes the tokens
    whose cumulative probability is <= 1 - top_p, never the most likely one."""
    out = []
    for row in z.double() / temperature:
        keep = torch.ones_like(row, dtype=torch.bool)
        if top_k:
            keep &= row >= torch.sort(row, descending=True).values[top_k - 1]
        p = torch.where(keep, row, torch.tensor(float("-inf"), dtype=row.dtype)).softmax(-1)
        if top_p < 1.0:
            order = torch.argsort(p)  # ascending
            cum = torch.cumsum(p[order], 0)
            removed = order[cum <= 1 - top_p]
            removed = removed[removed != order[-1]]
            keep[removed] = False
            p = torch.where(keep, row, torch.tensor(float("-inf"), dtype=row.dtype)).softmax(-1)
        out.append(p)
    return torch.stack(out)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.6, 4, 1.0), (1.0, 0, 0.8),
                                                        (0.6, 4, 0.9), (0.8, 3, 0.5)])
def test_the_inverse_cdf_draw_samples_the_warped_distribution(temperature, top_k, top_p):
    """Every row's empirical frequencies against the distribution written out from the rules (above), for scores with
    ties at the k-th place (bf16 logits tie often): each frequency within 5 binomial standard deviations (+ 1/N), and
    as many tokens drawn as the rules keep. 3 distinct score rows, each repeated N times in one call."""
    from grail_exp.rollout.hf import draw_inverse_cdf

    base = torch.tensor([[2.0, 1.5, 1.5, 1.5, 0.3, -0.2, -1.0, -3.0],  # three ties at 2nd-4th: top-3/4 keeps them all
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # uniform: everything tied
                         [5.0, -2.0, 1.0, 0.5, -4.0, 3.0, 0.0, -1.0]])
    N = 40_000
    scores = base.repeat_interleave(N, 0)
    torch.manual_seed(11)
    B = scores.shape[0]
    tokens = draw_inverse_cdf(scores, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), B,
                              torch.arange(B))
    expected = _warped_distribution(base, temperature, top_k, top_p)
    for r in range(3):
        freq = torch.bincount(tokens[r * N:(r + 1) * N], minlength=8).double() / N
        # Which of several tied tokens top-p removes is the sort's choice (transformers' too): compare per group of
        # equal scores — its kept mass and how many of its tokens are kept are fixed by the rules.
        for v in base[r].unique():
            group = base[r] == v
            want, got = expected[r][group].sum(), freq[group].sum()
            assert abs(got - want) <= 5 * (want * (1 - want) / N).sqrt() + 1 / N, (r, v, freq, expected[r])
            drawn, kept = int((freq[group] > 0).sum()), int((expected[r][group] > 0).sum())
            assert drawn <= kept and (drawn == kept or want * N < 50 * kept), (r, v, freq, expected[r])


def test_the_inverse_cdf_candidates_are_transformers_warped_distribution_on_a_large_vocabulary():
    """At a 49,152-token vocabulary (T 0.6, top-k 20, top-p 0.95, the evaluation's sampling): the candidates the fast
    path draws from (top-p on the top-k candidates only) carry the probabilities transformers' own warpers give over
    the whole vocabulary, and nothing else has mass."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from grail_exp.rollout.hf import inverse_cdf_candidates

    g = torch.Generator().manual_seed(0)
    B, V = 256, 49_152
    scores = torch.randn(B, V, generator=g) * 4
    params = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    z, index = inverse_cdf_candidates(scores, params)
    fast = torch.zeros(B, V, dtype=torch.float64).scatter_(1, index, torch.softmax(z.double(), -1))
    ref = scores
    for w in (TemperatureLogitsWarper(0.6), TopKLogitsWarper(20), TopPLogitsWarper(0.95)):
        ref = w(None, ref)
    ref = torch.softmax(ref.double(), -1)
    assert torch.equal(fast > 0, ref > 0)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=0)  # float32 scores divided by T in both; softmax in float64


def test_the_inverse_cdf_draw_gives_each_row_its_own_uniform_whichever_rows_are_computed():
    """Rows that left the batch do not shift the others' random stream: drawing rows {1, 3} of 4 gives those rows'
    tokens of the full draw, and both consume the same stream (one uniform per row of all B)."""
    from grail_exp.rollout.hf import draw_inverse_cdf

    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 50, generator=g)
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(4)
    full, after_full = draw_inverse_cdf(scores, params, 4, torch.arange(4)), torch.rand(1)
    torch.manual_seed(4)
    part, after_part = draw_inverse_cdf(scores[[1, 3]], params, 4, torch.tensor([1, 3])), torch.rand(1)
    assert part.tolist() == full[[1, 3]].tolist() and torch.equal(after_full, after_part)


@pytest.mark.parametrize("kw", SAMPLINGS[:2], ids=["plain", "top_k_top_p"])
def test_the_engine_with_the_inverse_cdf_draw(tiny_model, tiny_tokenizer, kw):
    """``rollout.draw=inverse_cdf`` through the engine: stop flags and shapes as ever, log-probs those of the trainer's
    forward (the draw changes which tokens, not how they are scored), and another stream than ``generate``'s."""
    from grail_exp.rollout.hf import HFRolloutEngine

    tiny_model.config._attn_implementation = "sdpa"
    params = SamplingParams(n=4, max_new_tokens=12, logprobs=True, **kw)
    out = {}
    for draw in ("multinomial", "inverse_cdf"):
        torch.manual_seed(3)
        out[draw] = HFRolloutEngine(tiny_model, tiny_tokenizer, draw=draw).generate(_prompts(tiny_tokenizer), params)
    fast = out["inverse_cdf"]
    assert [c.token_ids for c in fast] != [c.token_ids for c in out["multinomial"]]
    rb = pad_completions(fast, tiny_tokenizer.pad_token_id)
    attn = rb.attention_mask
    with torch.no_grad():
        logits = completion_logits(tiny_model.eval(), rb.input_ids, attn, position_ids_from_mask(attn),
                                   rb.completion_ids.shape[1], kw["temperature"])
    m = rb.completion_mask.bool()
    logp = selective_log_softmax(logits, rb.completion_ids)
    assert torch.allclose(logp[m], rb.sampling_logprobs[m], rtol=0, atol=MODEL_REORDER * logits.abs().max().item())
    for c in fast:
        assert c.truncated == (len(c.token_ids) == 12 and c.token_ids[-1] not in (tiny_tokenizer.eos_token_id,
                                                                                  tiny_tokenizer.pad_token_id))


def test_an_unknown_draw_is_refused_naming_the_key(compose_cfg):
    from grail_exp.errors import ConfigError
    from grail_exp.rollout.hf import DRAWS
    from grail_exp.validate import ROLLOUT_DRAWS, validate

    assert ROLLOUT_DRAWS == DRAWS  # what validate accepts is what the engine runs
    cfg = compose_cfg(["rollout.draw=gumbel"])
    with pytest.raises(ConfigError, match=r"rollout.draw = 'gumbel': must be one of: multinomial, inverse_cdf"):
        validate(cfg)
