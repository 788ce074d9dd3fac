"""``python -m grail_exp.bench`` (issue 12 §1): the table's entries, their arithmetic, and its errors."""

from __future__ import annotations

import json

import pytest


def test_bench_times_every_scheme_through_the_trainer(tmp_path, tiny_model_dir):
    from grail_exp.bench import main

    out = tmp_path / "bench.json"
    payload = main([f"model.name_or_path={tiny_model_dir}", "bench.prompts=2", "bench.num_generations=4",
                    "bench.completion_length=24", "bench.prompt_length=8", "bench.warmup=1", "bench.repeats=1",
                    "bench.micro_batch_size=4", "bench.passes=2", "bench.schemes=[grpo,grail,oar_g]", "bench.per_rollout=[grail]",
                    f"json={out}", f"markdown={tmp_path / 'bench.md'}", f"paths.cache_dir={tmp_path}"])
    written = json.loads(out.read_text())
    assert list(written["schemes"]) == ["grpo", "grail", "grail_per_rollout", "oar_g"]
    for name, r in written["schemes"].items():
        assert set(r) == {"old_logp_s", "scheme_s", "update_s", "step_s", "peak_mem_mb", "step_per_old_logp"}, name
        assert r["step_s"] == pytest.approx(r["scheme_s"] + r["update_s"])
        assert r["step_s"] > 0 and r["old_logp_s"] > 0 and r["scheme_s"] >= 0  # μ = 2 needs the old log-probs
    # No comparison of the timings here: which scheme is slower is the benchmark's finding (results/bench.md), and a
    # wall-clock order between two single measurements is a race on a loaded machine.
    assert written["config"]["vocab_size"] > 0 and written["config"]["bench.iterations"] == 2
    assert "| grail_per_rollout |" in (tmp_path / "bench.md").read_text()
    assert payload["schemes"] == written["schemes"]


def test_bench_rejects_unknown_schemes_and_keys():
    from grail_exp.bench import main

    with pytest.raises(SystemExit, match="unknown scheme"):
        main(["bench.schemes=[grpo,nope]"])
    with pytest.raises(SystemExit, match="bench.yaml"):
        main(["bench.not_a_key=1"])


def test_bench_help_prints_the_phases_instead_of_composing(capsys):
    from grail_exp.bench import main

    assert main(["--help"]) == {}
    out = capsys.readouterr().out
    assert "step_per_old_logp" in out and "conf/bench.yaml" in out


def test_real_mode_runs_training_steps_per_scheme(tmp_path, tiny_model_dir):
    """bench.mode=real: each scheme's own process runs the composed run's real steps (generation, grading, update) and
    the table reports phase times, tokens, token efficiency, peak memory and the floor. Grading runs in its own worker
    process, as in a real run (a daemonic pool worker could not start it)."""
    from grail_exp.bench import main

    out = tmp_path / "real.json"
    payload = main(["bench.mode=real", "bench.steps=2", "bench.skip=1", "bench.schemes=[grpo]", "bench.threads=1",
                    "bench.variants={grail: [advantage=grail]}",  # a variant row: its profile files carry the row's name
                    f"model.name_or_path={tiny_model_dir}", "trainer.prompts_per_step=2", "rollout.num_generations=4",
                    "rollout.max_completion_length=12", "trainer.micro_batch_size=8", "reward.num_workers=1",
                    f"bench.profile={tmp_path / 'profile'}",
                    f"paths.cache_dir={tmp_path}", f"json={out}", f"markdown={tmp_path / 'real.md'}"])
    written = json.loads(out.read_text())
    assert list(written["schemes"]) == ["grpo", "grpo+grail"]
    for name, s in written["schemes"].items():
        steps = written["steps"][name]["records"]
        assert len(steps) == 2 and len(s["rewards"]) == 2
        last = steps[-1]
        assert s["step_s"] == last["step_s"] > 0 and s["threads"] == 1  # skip=1: the median of the second step alone
        assert last["prompts"] == 2 and last["completion_tokens"] >= 8  # 2 prompts x 4 completions of >= 1 token
        assert last["token_efficiency"] == pytest.approx(last["update_tokens"] / last["computed_positions"])
        assert last["floor_ratio"] == pytest.approx(last["step_s"] / last["floor_s"])
        assert s["peak_memory_gb"] > 0 and s["matmul_gflops"] > 0
        profiled = written["steps"][name]["profile"]  # one more step, not among the timed ones (2 records above)
        for phase in ("generation", "update"):
            p = profiled[phase]
            assert 0 < p["matmul_s"] <= p["ops_s"] and 0 < p["matmul_share"] <= 1 and p["matmul_gflops"] > 0
            assert "aten::mm" in (tmp_path / "profile" / f"{name}_{phase}_matmuls.txt").read_text()
            assert "Self CPU" in (tmp_path / "profile" / f"{name}_{phase}_ops.txt").read_text()
    md = (tmp_path / "real.md").read_text()
    assert "| grpo+grail | hf |" in md and "- grpo+grail, update (profiled step): ops" in md
    assert payload["schemes"]["grpo"]["engine"] == "hf"


def test_paired_mode_takes_the_schemes_steps_in_turn_in_one_process(tmp_path, tiny_model_dir, monkeypatch):
    """bench.paired: one process builds every scheme and takes their steps round by round in a rotating order; the
    ratio column is the median of the per-round ratios to GRPO, with their range."""
    import tempfile

    import grail_exp.bench.real as real
    from grail_exp.bench import main

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where each scheme's run folder is made
    order = []
    step = real._one_step
    monkeypatch.setattr(real, "in_own_process", lambda fn, *args: fn(*args))  # in this process, to watch the order
    monkeypatch.setattr(real, "_one_step", lambda module, opt, sched, r, shape, scheme, phase=None: (
        order.append((r, scheme)), step(module, opt, sched, r, shape, scheme, phase))[1])
    out = tmp_path / "paired.json"
    payload = main(["bench.mode=real", "bench.paired=true", "bench.steps=3", "bench.skip=1",
                    "bench.schemes=[grpo,grail]", "bench.threads=1", f"model.name_or_path={tiny_model_dir}",
                    "trainer.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_completion_length=12",
                    "trainer.micro_batch_size=8", "reward.num_workers=1", f"paths.cache_dir={tmp_path}", f"json={out}",
                    f"markdown={tmp_path / 'paired.md'}"])
    assert order == [(0, "grpo"), (0, "grail"), (1, "grail"), (1, "grpo"), (2, "grpo"), (2, "grail")]
    written = json.loads(out.read_text())
    grail, grpo = (written["steps"][n]["records"] for n in ("grail", "grpo"))
    ratios = sorted(a["step_s"] / b["step_s"] for a, b in zip(grail[1:], grpo[1:]))  # rounds 2 and 3
    s = written["schemes"]["grail"]
    assert s["step_ratio"] == pytest.approx(sum(ratios) / 2) and s["step_ratio_range"] == pytest.approx(ratios)
    assert written["schemes"]["grpo"]["step_ratio"] == 1.0 and s["peak_memory_gb"] is None
    md = (tmp_path / "paired.md").read_text()
    assert "update / grpo" in md and f"{s['step_ratio']:.2f}x ({ratios[0]:.2f}–{ratios[1]:.2f})" in md
    assert "Paired: all schemes in one process" in md and payload["schemes"]["grpo"]["engine"] == "hf"
    assert list(scratch.iterdir()) == []  # the runs' folders are removed (nothing in them is kept)


def test_the_benches_write_their_tables_with_one_function():
    """Every bench mode's table comes out of ``table_markdown``: a heading row, the alignment rule (``---`` text,
    ``--:`` numbers), one line per row, an empty cell as a single space and an error row as short as it is."""
    from grail_exp.bench.real import table_markdown

    got = table_markdown(["scheme", "step s", "peak GB"], "lrr", [["grpo", "1.00", 2], ["grail", "", "—"],
                                                                  ["oar_g", "error: E"]])
    assert got == ("| scheme | step s | peak GB |\n|---|--:|--:|\n| grpo | 1.00 | 2 |\n| grail | | — |\n"
                   "| oar_g | error: E |")


def test_matmul_flops_by_hand():
    from grail_exp.bench.real import matmul_flops

    assert matmul_flops("aten::mm", [[64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::addmm", [[16], [64, 32], [32, 16]]) == 2 * 64 * 32 * 16
    assert matmul_flops("aten::bmm", [[3, 5, 7], [3, 7, 2]]) == 2 * 3 * 5 * 7 * 2
    assert matmul_flops("aten::baddbmm", [[3, 5, 2], [3, 5, 7], [3, 7, 2]]) == 2 * 3 * 5 * 7 * 2
    assert matmul_flops("aten::add", [[64, 32], [64, 32]]) == 0.0


def test_step_flops_counts_each_prompt_once():
    """The floor's FLOPs by hand: 3 rows sharing one 3-token prompt (one row left-padded out of a 4-wide prompt
    column), completions of 2, 1 and 2 tokens; a 1-layer model, h 4, i 6, 2 heads of 2, 1 KV head, V 10."""
    import torch

    from grail_exp.bench.real import step_flops
    from grail_exp.training.batch import TrainingBatch

    s = dict(layers=1, hidden=4, intermediate=6, heads=2, kv_heads=1, head_dim=2, vocab=10)
    ids = torch.tensor([[0, 5, 6, 7, 1, 2], [0, 5, 6, 7, 3, 0], [0, 5, 6, 7, 1, 1]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    batch = TrainingBatch(ids, attn, attn.cumsum(1) - 1, 4, ids[:, 4:], attn[:, 4:].float(), torch.zeros(3),
                          torch.zeros(3), ["", "", ""])
    per_token = 2 * (4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 6)  # q, k and v, o, gate / up / down: 2 x 120 = 240
    attend = 4 * 2 * 2  # per (query, key) pair: 4 x heads x head_dim
    prompt = 3 * per_token + 9 / 2 * attend  # the prompt once
    comps = sum(c * per_token + (c * 3 + c * c / 2) * attend + 2 * c * 10 * 4 for c in (2, 1, 2))
    generation = prompt + comps + 2 * 10 * 4  # + the first token's logits of the one prompt
    assert step_flops(s, batch, "grpo", old_logp=False) == pytest.approx(generation + 3 * (prompt + comps))
    assert step_flops(s, batch, "oar_g", old_logp=True) == pytest.approx(generation + 4 * (prompt + comps) + 2 * comps)


def _start_a_grandchild() -> int:
    """What a run does in the bench's per-scheme process: start a process of its own (the grading workers)."""
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=int)
    p.start()
    p.join()
    return p.exitcode


def test_real_mode_scheme_process_may_start_processes():
    """Each scheme's process may start processes (the grading pool): a daemonic pool worker could not."""
    from grail_exp.bench.real import in_own_process

    assert in_own_process(_start_a_grandchild) == 0
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        in_own_process(divmod, 1, 0)


def test_attention_mode_times_both_paths_and_marks_the_default_pick(tmp_path):
    """bench.mode=attention: both attention paths per shape, the same output, and the explicit one picked exactly
    where query × key positions <= model.cpu_explicit_attention_max_scores."""
    import json

    from grail_exp.bench import main
    from grail_exp.config import ModelConfig

    side = int(ModelConfig.cpu_explicit_attention_max_scores ** 0.5)
    md = tmp_path / "attention.md"
    payload = main(["bench.mode=attention", f"bench.attention.shapes=[[3,5],[{side},{side}],[{side},{side + 1}]]",
                    "bench.attention.rows=2", "bench.attention.heads=4", "bench.attention.kv_heads=2",
                    "bench.attention.head_dim=8", "bench.warmup=0", "bench.repeats=1", "bench.threads=1",
                    f"json={tmp_path / 'a.json'}", f"markdown={md}"])
    rows = payload["shapes"]
    assert [(r["queries"], r["keys"]) for r in rows] == [(3, 5), (side, side), (side, side + 1)]
    assert all(r["same_output"] and r["fused_ms"] > 0 and r["explicit_ms"] > 0 for r in rows)
    picks = [line.rsplit("|", 2)[1].strip() for line in md.read_text().splitlines() if line.startswith("| ")][1:]
    assert picks == ["explicit", "explicit", "fused"]
    assert json.loads((tmp_path / "a.json").read_text())["shapes"] == rows


def test_attention_mode_times_the_runs_policy_both_ways(tmp_path, tiny_model_dir, monkeypatch):
    """With run overrides, bench.mode=attention also times the policy's forward + backward with the fused kernel and
    with the run's setting — and the explicit path really runs in the second."""
    from grail_exp.bench import main
    from grail_exp.compute import attention as cpu_attention

    calls = []  # the explicit attention of an unshared or prefix pass, and of a suffix pass over shared prompts
    for fn in (cpu_attention.ExplicitAttention, cpu_attention.PrefixSuffixAttention):
        monkeypatch.setattr(fn, "apply", lambda *a, real=fn.apply: calls.append(1) or real(*a))
    payload = main(["bench.mode=attention", "bench.attention.shapes=[]", "bench.prompts=2", "bench.num_generations=2",
                    "bench.prompt_length=6", "bench.completion_length=12", "bench.micro_batch_size=2",
                    "bench.warmup=0", "bench.repeats=2", "bench.threads=1", f"model.name_or_path={tiny_model_dir}",
                    "model.attn_implementation=sdpa", "model.cpu_explicit_attention_max_scores=500"])
    p = payload["policy"]
    assert p["max_scores"] == 500 and p["rows"] == 4 and p["fused_s"] > 0 and p["explicit_s"] > 0
    assert calls  # 2 repeats x 2 micro-batches x the layers, only in the explicit half
