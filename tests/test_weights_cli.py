"""`python -m grail_exp.weights`: format, errors, and agreement with the training path's weights."""

import json
import subprocess
import sys

import pytest
import torch

from helpers.module import build_module, small_config
from helpers.tolerances import HANG_TIMEOUT_S


def _training_rows(compose_cfg, model_dir, scheme_overrides):
    """Weights the training step computes for one micro-batch, plus the rows that reproduce it."""
    cfg = small_config(compose_cfg, model_dir, scheme_overrides)
    module = build_module(cfg, model_dir)
    torch.manual_seed(0)
    batch, _ = module.rollout.make_batch(0, {})
    module.rollout.prepare(batch, {})
    captured = []
    real, real_fwd = module.scheme.weights, module.scheme.weights_from_forward

    def spy(model, b, *forward):
        out = (real_fwd if forward else real)(model, b, *forward)
        captured.append((b, out.weights.clone()))
        return out

    module.scheme.weights = spy
    module.scheme.weights_from_forward = spy
    module.manual_backward = lambda loss: loss.backward()
    opt = torch.optim.SGD(module.policy.parameters(), lr=0.0)

    class Opt:
        def step(self):
            opt.step()

        def zero_grad(self, set_to_none=True):
            opt.zero_grad(set_to_none=set_to_none)

    # weights are computed with the parameters before the step: capture the first micro-batch only
    module.update.step(batch, Opt(), torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       batch.loss_mask.sum().item(), {}, 0)
    b, w = captured[0]
    P = b.prompt_length
    rows = []
    for i in range(b.input_ids.shape[0]):
        pm = b.attention_mask[i, :P].bool()
        cm = b.completion_mask[i].bool()
        rows.append({"prompt_ids": b.input_ids[i, :P][pm].tolist(), "completion_ids": b.completion_ids[i][cm].tolist(),
                     "advantage": float(b.advantages[i])})
    return rows, w, b.completion_mask


@pytest.mark.parametrize("scheme", ["grail", "oar_g"])
def test_weights_cli_matches_training_path(compose_cfg, tiny_model_dir, tmp_path, scheme):
    from helpers.compose import compose_weights

    extra = ["advantage=grail", "advantage.symmetry=both"] if scheme == "grail" else ["advantage=oar_g", "advantage.noise_std=0.0"]
    rows, w_train, mask = _training_rows(compose_cfg, tiny_model_dir, extra)
    inp = tmp_path / "rows.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "w.json"
    from grail_exp.weights import compute

    cfg = compose_weights(tmp_path, [f"model.name_or_path={tiny_model_dir}", f"input={inp}", f"output={out}",
                                     *extra])
    result = compute(cfg)
    assert len(result) == len(rows)
    for i, r in enumerate(result):
        n = len(rows[i]["completion_ids"])
        assert r["completion_ids"] == rows[i]["completion_ids"] and len(r["weights"]) == len(r["tokens"]) == n
        assert torch.allclose(torch.tensor(r["weights"]), w_train[i][:n].float(), atol=1e-5), i


def test_weights_cli_rows_carry_their_grade_for_the_heatmap(tiny_model_dir, tmp_path):
    """A row's ``reward`` gives its grade (``correct``), which files it in the heatmap's column: a correct rollout of an
    all-correct group (A = 0) under "correct rollouts"; a row without a reward has no grade (the page uses A)."""
    from grail_exp.analysis.viz import weights_html
    from grail_exp.weights import compute
    from helpers.compose import compose_weights

    prompt = "<|im_start|>user\nCompute 2+2.<|im_end|>\n<|im_start|>assistant\n"
    rows = [{"prompt": prompt, "completion": "2+2=4. \\boxed{4}<|im_end|>", "advantage": 0.0, "reward": 1.0},
            {"prompt": prompt, "completion": "2+2=5. \\boxed{5}<|im_end|>", "advantage": 0.0}]
    inp = tmp_path / "rows.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    result = compute(compose_weights(tmp_path, [f"model.name_or_path={tiny_model_dir}", f"input={inp}",
                                                f"output={tmp_path / 'w.json'}", "advantage=grail"]))
    assert result[0]["correct"] is True and "correct" not in result[1]
    correct_col, wrong_col = weights_html(result).split("<h2>")[1:3]
    assert correct_col.startswith("correct rollouts (1)") and wrong_col.startswith("wrong rollouts (1)")


@pytest.mark.e2e
def test_weights_cli_end_to_end_with_text_rows_and_html(tiny_model_dir, tmp_path):
    inp = tmp_path / "rows.jsonl"
    rows = [{"prompt": "<|im_start|>user\nCompute 7+5-3.<|im_end|>\n<|im_start|>assistant\n",
             "completion": "7+5=12. 12-3=9. \\boxed{9}<|im_end|>", "advantage": -0.5},
            {"prompt": "<|im_start|>user\nCompute 2+2.<|im_end|>\n<|im_start|>assistant\n",
             "completion": "2+2=4. \\boxed{4}<|im_end|>", "advantage": 0.5}]
    inp.write_text("\n".join(json.dumps(r) for r in rows))
    out, html = tmp_path / "w.json", tmp_path / "w.html"
    proc = subprocess.run([sys.executable, "-m", "grail_exp.weights", "advantage=grail",
                           f"model.name_or_path={tiny_model_dir}", f"input={inp}", f"output={out}", f"html={html}",
                           f"paths.root_dir={tmp_path}", "advantage.std=0.7"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [set(r) >= {"completion_ids", "tokens", "weights"} for r in result] == [True, True]
    assert "".join(result[0]["tokens"]).startswith("7+5=12.")
    assert result[0]["completion_ids"][-1] == 2  # <|im_end|> is a single special token (id 2)
    page = html.read_text()
    assert "wrong rollouts" in page and "correct rollouts" in page and "w = 5.000" in page


@pytest.mark.e2e
def test_weights_cli_bad_row_names_file_and_line(tiny_model_dir, tmp_path):
    inp = tmp_path / "rows.jsonl"
    inp.write_text('{"prompt_ids": [1, 2], "completion_ids": [3], "advantage": 1.0}\n{"prompt_ids": [1], "advantage": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "grail_exp.weights", f"model.name_or_path={tiny_model_dir}",
                           f"input={inp}", f"output={tmp_path}/o.json", f"paths.root_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 2
    assert f"{inp}:2" in proc.stderr and "completion_ids" in proc.stderr
