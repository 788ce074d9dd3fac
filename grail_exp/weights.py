"""``python -m grail_exp.weights``: inspect the token weights a scheme gives to given rollouts.

    python -m grail_exp.weights advantage=grail model.name_or_path=<HF dir> input=rows.jsonl output=w.json html=w.html

Every given completion token counts as generated and valid (mask 1), as for a completion that ended with
its EOS token. The computation runs in float32 on CPU unless ``dtype`` / ``device`` say otherwise, through
the same scheme code as training (``SchemeBatch`` built the same way: prompts left-padded, completions
right-padded, positions from the attention mask), so the weights match the training path's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from grail_exp.conf_path import CONFIG_DIR
from grail_exp.config import register_configs
from grail_exp.data.jsonl import iter_jsonl_objects
from grail_exp.data.prompting import encode_prompt_texts
from grail_exp.errors import UserError

log = logging.getLogger("grail_exp.weights")
register_configs()


class InputError(UserError, ValueError):
    """A bad rollouts file or scheme choice for ``grail_exp.weights``; the message names the file and line."""


def read_rows(path: str | Path, tokenizer) -> list[dict]:
    """Rows with ``prompt_ids``, ``completion_ids`` and ``advantage``; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input={str(path)!r}: no such file (a JSONL of rollouts)")
    rows = []
    for lineno, r in iter_jsonl_objects(path, InputError):
        if "prompt_ids" not in r and "prompt" in r:
            r["prompt_ids"] = encode_prompt_texts([r["prompt"]], tokenizer)[0]  # as training encodes it (BOS)
        if "completion_ids" not in r and "completion" in r:
            r["completion_ids"] = tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
        for key in ("prompt_ids", "completion_ids"):
            v = r.get(key)
            if not isinstance(v, list) or not v or not all(isinstance(t, int) for t in v):
                raise InputError(f"{path}:{lineno}: '{key}' (or its text form) must be a non-empty list of token ids")
            if max(v) >= len(tokenizer) or min(v) < 0:
                raise InputError(f"{path}:{lineno}: '{key}' has ids outside the vocabulary (size {len(tokenizer)})")
        if not isinstance(r.get("advantage"), (int, float)):
            raise InputError(f"{path}:{lineno}: 'advantage' must be a number")
        rows.append(r)
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def scheme_batch(rows: list[dict], pad_id: int, device, sampling_temperature: float, generator=None):
    """The ``SchemeBatch`` of the given rows, laid out exactly like a training rollout batch, with its context:
    groups (``group`` field, else rows with the same prompt), problems / gold answers (``problem`` / ``answer``
    fields, for schemes that build teacher prompts) and rewards (``reward`` field, else A > 0)."""
    from grail_exp.advantages import SchemeBatch
    from grail_exp.compute.forward import position_ids_from_mask
    from grail_exp.rollout import Completion, pad_completions

    rb = pad_completions([Completion(r["prompt_ids"], r["completion_ids"], None, False) for r in rows], pad_id)
    attn = rb.attention_mask
    adv = torch.tensor([float(r["advantage"]) for r in rows])
    rewards = torch.tensor([float(r.get("reward", float(r["advantage"] > 0))) for r in rows])
    keys = [r.get("group", tuple(r["prompt_ids"])) for r in rows]
    first_seen = {k: i for i, k in reversed(list(enumerate(keys)))}
    groups = sorted(set(first_seen.values()))
    group_ids = torch.tensor([groups.index(first_seen[k]) for k in keys])
    sizes = torch.bincount(group_ids)
    return SchemeBatch(
        input_ids=rb.input_ids.to(device), attention_mask=attn.to(device),
        position_ids=position_ids_from_mask(attn).to(device), prompt_length=rb.prompt_ids.shape[1],
        completion_ids=rb.completion_ids.to(device), completion_mask=rb.completion_mask.float().to(device),
        advantages=adv.to(device), rewards=rewards.to(device),
        sampling_temperature=sampling_temperature, generator=generator,
        row_index=torch.arange(len(rows), device=device), group_ids=group_ids.to(device),
        num_generations=int(sizes.max()) if bool((sizes == sizes.max()).all()) else None,
        problems=[r.get("problem") for r in rows] if all("problem" in r for r in rows) else None,
        gold_answers=[str(r["answer"]) for r in rows] if all("answer" in r for r in rows) else None,
        prompt_ids=[list(r["prompt_ids"]) for r in rows],
    )


def scheme_weights(scheme, model, batch, micro_batch_size: int) -> torch.Tensor:
    """(N, C) weights of a whole rollout batch through the scheme contract, as the trainer drives it: ``prepare`` on
    the whole batch, then ``weights`` per micro-batch with the prepared state sliced to its rows."""
    from grail_exp.advantages.base import slice_prepared

    prepared = scheme.prepare(model, batch)
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    n = batch.input_ids.shape[0]
    for s in range(0, n, micro_batch_size):
        idx = torch.arange(s, min(s + micro_batch_size, n), device=batch.input_ids.device)
        mb = batch.rows(idx)
        mb.prepared = slice_prepared(prepared, idx)
        out[s:s + len(idx)] = scheme.weights(model, mb).weights.float().cpu()
    return out


def compute(cfg: DictConfig) -> list[dict]:
    from grail_exp.advantages import SCHEMES, build_scheme, scheme_config_class
    from grail_exp.compute.forward import share_prompts_of
    from grail_exp.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
    from grail_exp.validate import validate_weights

    validate_weights(cfg)  # the rollouts file and the model's files, before a model (or its warm start) loads
    if cfg.advantage.name not in SCHEMES:
        raise InputError(f"advantage={cfg.advantage.name!r}: valid schemes: {', '.join(sorted(SCHEMES))}")
    adv_cfg = OmegaConf.merge(OmegaConf.structured(scheme_config_class(cfg.advantage.name)), cfg.advantage)
    problems = SCHEMES[cfg.advantage.name].check_config(adv_cfg)
    if problems:
        raise InputError("invalid advantage config: " + "; ".join(f"advantage.{p}" for p in problems))
    with_dtype = OmegaConf.merge(cfg, {"model": {"dtype": cfg.dtype}})
    path = resolve_model_path(with_dtype)
    tokenizer = load_tokenizer(path, with_dtype)
    model = load_causal_lm(path, with_dtype, trainable=True).to(cfg.device)
    rows = read_rows(cfg.input, tokenizer)
    scheme = build_scheme(adv_cfg, tokenizer, {"model": with_dtype.model, "seed": cfg.seed, "data": cfg.data,
                                                         "share_prompts": share_prompts_of(with_dtype)})
    generator = torch.Generator(device="cpu").manual_seed(int(cfg.seed))
    batch = scheme_batch(rows, tokenizer.pad_token_id, cfg.device, cfg.sampling_temperature, generator)
    batch.completion_texts = tokenizer.batch_decode([r["completion_ids"] for r in rows], skip_special_tokens=True)
    w = scheme_weights(scheme, model, batch, cfg.batch_size)
    out = []
    for i, r in enumerate(rows):
        ids = r["completion_ids"]
        out.append({
            "completion_ids": ids,
            "tokens": [tokenizer.decode([t]) for t in ids],
            "weights": [round(float(x), 7) for x in w[i, : len(ids)]],
            "advantage": float(r["advantage"]),
        })
        if isinstance(r.get("reward"), (int, float)):  # the heatmap's columns split by grade, not by the sign of A
            out[-1]["correct"] = r["reward"] > 0
    return out


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="weights")
def main(cfg: DictConfig) -> None:
    from grail_exp.errors import exit_on_user_error

    with exit_on_user_error(extra=(InputError,)):
        result = compute(cfg)
        Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output).write_text(json.dumps(result))
        print(f"wrote {len(result)} rows of {cfg.advantage.name} weights to {cfg.output}")
        if cfg.html:
            from grail_exp.analysis.viz import weights_html

            Path(cfg.html).write_text(weights_html(result, title=f"{cfg.advantage.name} token weights"))
            print(f"heatmap: {cfg.html}")


if __name__ == "__main__":
    main()
