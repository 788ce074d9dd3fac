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
