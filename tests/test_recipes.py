"""The GRAIL paper's fifteen recipes (conf/experiment/paper/*) and the reference's prompt order (data.order).

The expected values are written out here from the method spec (§2.2, §4.3, §5.6, §6.1, §7.1, §11.13-11.14) and
the reference configs, not read back from the YAML, so a wrong recipe value fails.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from grail_exp.tracking import flatten
from grail_exp.validate import validate
from helpers.compose import compose

MODELS = {  # model -> (model.name_or_path, model.prompt_style)
    "qwen3_4b": ("Qwen/Qwen3-4B", "chat"),
    "qwen3_8b": ("Qwen/Qwen3-8B", "chat"),
    "r1_distill_llama_8b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "chat"),
    "octothinker_3b": ("OctoThinker/OctoThinker-3B-Short-Base", "plain"),
    "octothinker_8b": ("OctoThinker/OctoThinker-8B-Short-Base", "plain"),
}
SCHEMES = ("grpo", "grail", "oar_g")
BACKSPACE_INSTRUCTION = " Please reason step by step, and put your final answer within \x08oxed{}."  # spec §11.13

SHARED = {  # every paper recipe
    "seed": 42,
    "data.name": "deepmath", "data.shuffle_seed": 42, "data.order": "reference", "data.sampler_seed": None,
    "data.instruction": BACKSPACE_INSTRUCTION, "benchmark.instruction": BACKSPACE_INSTRUCTION,
    "benchmark.names": ["math500", "aime24", "amc23", "minerva_math", "college_math_200", "olympiadbench_200"],
    "benchmark.olympiad_gold": "str", "benchmark.extraction": "paper", "reward.extraction": "paper",
    "eval.n": 3, "eval.temperature": 0.6, "eval.top_p": 0.95, "eval.top_k": 20, "eval.max_tokens": 8192,
    "rollout.num_generations": 8, "rollout.max_completion_length": 4096, "rollout.temperature": 1.0,
    "rollout.top_p": 1.0, "rollout.top_k": 50,
    # the reference's colocated vLLM (rollout=vllm_paper): processed log-probs, TRL's sequence mask at 3
    "rollout.engine": "vllm", "rollout.vllm.logprobs_mode": "processed_logprobs",
    "rollout.is_correction.mode": "sequence_mask", "rollout.is_correction.clip_min": None,
    "rollout.is_correction.clip_max": 3.0, "rollout.vllm.gpu_memory_utilization": 0.2,
    "loss.scale_rewards": "none", "loss.epsilon": 0.2, "loss.epsilon_high": 0.28, "loss.loss_type": "dr_grpo",
    "loss.beta": 0.0, "loss.num_iterations": 4, "loss.mask_truncated_completions": True,
    "optim.lr": 1e-6, "optim.warmup_steps": 0, "optim.max_grad_norm": 1.0, "optim.weight_decay": 0.0,
    "trainer.max_steps": 200, "trainer.prompts_per_step": 32, "trainer.checkpoint_every": 50,
    "trainer.eval_at_end": True, "model.dtype": "bfloat16",
    # the reference's layout (spec §6.1): 4 GPUs under ZeRO-2, vLLM colocated at 0.2 of each GPU
    "trainer.devices": 4, "trainer.name": "fsdp_zero2", "trainer.strategy": "fsdp",
    "trainer.sharding_strategy": "SHARD_GRAD_OP",
    "recipe.name": "paper", "recipe.base": "conf/recipe/paper/base.yaml",
}
PER_SCHEME = {
    "grpo": {"advantage.name": "grpo", "trainer.micro_batch_size": 8, "recipe.scheme": None},
    "grail": {"advantage.name": "grail", "advantage.std": 0.5, "advantage.mean": 1.0, "advantage.w_min": 0.5,
              "advantage.w_max": 5.0, "advantage.leaf_source": "embeddings", "advantage.symmetry": "wrong",
              "trainer.micro_batch_size": 8, "recipe.scheme": None},
    "oar_g": {"advantage.name": "oar_g", "advantage.variant": "grail_repo", "advantage.tau": 0.4,
              "advantage.beta": 2.0, "advantage.noise_std": 1e-3, "trainer.micro_batch_size": 2,
              "recipe.scheme": "conf/recipe/paper/oar_g.yaml"},
}


@cache
def _flat(model: str, scheme: str) -> dict:
    """The composed, validated recipe as {dotted.key: value} (paths excluded: they hold the temp dir)."""
    cfg = validate(compose([f"experiment=paper/{model}_{scheme}"], Path("/nonexistent")))  # paths: never written
    out = flatten(OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in out.items() if not k.startswith("paths.")}


def _diff(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if json.dumps(a.get(k)) != json.dumps(b.get(k))}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_recipe_values(model, scheme):
    flat = _flat(model, scheme)
    expected = {**SHARED, **PER_SCHEME[scheme], "model.name": model, "model.name_or_path": MODELS[model][0],
                "model.prompt_style": MODELS[model][1], "task_name": f"paper_{model}_{scheme}"}
    wrong = {k: (flat.get(k, "<missing>"), v) for k, v in expected.items() if flat.get(k, "<missing>") != v}
    assert not wrong, f"paper/{model}_{scheme}: key: (got, expected) {wrong}"
    # the paper's 256 completions per optimiser step, whatever the micro-batch
    assert flat["trainer.prompts_per_step"] * flat["rollout.num_generations"] == 256


def test_recipes_differ_only_in_scheme_or_model_keys():
    for model in MODELS:  # one model, three schemes: the advantage.* keys, OAR-G's micro-batch and the run name
        for a, b in [("grpo", "grail"), ("grpo", "oar_g"), ("grail", "oar_g")]:
            d = _diff(_flat(model, a), _flat(model, b))
            allowed = {k for k in d if k.startswith("advantage.")} | {"task_name", "recipe.scheme"}
            if "oar_g" in (a, b):
                allowed.add("trainer.micro_batch_size")
            assert d <= allowed, (model, a, b, sorted(d - allowed))
            assert any(k.startswith("advantage.") for k in d)
            assert ("trainer.micro_batch_size" in d) == ("oar_g" in (a, b))
    for scheme in SCHEMES:  # one scheme, five models: only model.* keys and the run name
        base = _flat("qwen3_4b", scheme)
        for model in MODELS:
            d = _diff(base, _flat(model, scheme))
            assert {k for k in d if not k.startswith("model.")} <= {"task_name"}, (scheme, model, sorted(d))


def test_recipe_records_the_prompt_template_of_the_model():
    # R1-Distill / OctoThinker prompting is not in the paper (spec §10.2): the choice travels with every table
    from grail_exp.evaluation import evaluation_params

    cfg = validate(compose(["experiment=paper/octothinker_3b_grpo"]))
    params = evaluation_params(cfg, tokenizer=None)  # plain template: no tokenizer needed
    assert params["eval.prompt_style"] == "plain"
    assert params["eval.prompt_template"] == "Question: {problem}" + BACKSPACE_INSTRUCTION + "\nAnswer:"
    assert params["eval.extraction"].startswith("paper:")
    assert params["eval.olympiad_gold"] == "str"


# ---------------------------------------------------------------------------------------------- prompt order


def _reference_stream(n_rows: int, P: int, seed: int, shuffle_seed: int, n_steps: int, G: int, repeat: int):
    """Independent re-implementation of the rows the reference trains on, step by step.

    1. ``datasets.Dataset.shuffle(seed)`` = ``np.random.default_rng(seed).permutation(n)`` as an indices mapping.
    2. TRL's RepeatSampler over the shuffled rows: per pass, ``torch.randperm(n)`` from one generator seeded once,
       chunks of P (last incomplete chunk dropped), each index yielded ``repeat x G`` times (mu x accumulation
       reuses, G samples). A rollout batch is the next ``P * G * repeat`` indices; its distinct prompts, in order,
       are the step's P prompts.
    """
    shuffled = np.random.default_rng(shuffle_seed).permutation(n_rows)
    g = torch.Generator()
    g.manual_seed(seed)

    def sampler():
        while True:  # the trainer re-iterates the sampler every epoch
            perm = torch.randperm(n_rows, generator=g).tolist()
            chunks = [perm[i:i + P] for i in range(0, n_rows, P)]
            for chunk in (c for c in chunks if len(c) == P):
                for _ in range(repeat):
                    for idx in chunk:
                        for _ in range(G):
                            yield idx

    it, steps = sampler(), []
    for _ in range(n_steps):
        batch = [next(it) for _ in range(P * G * repeat)]
        steps.append([int(shuffled[i]) for i in dict.fromkeys(batch)])  # original row ids
    return steps


@pytest.mark.parametrize("n_rows, P", [(23, 4), (20, 5)])  # 23 % 4 != 0: the sampler drops 3 rows per epoch
def test_reference_order_matches_trl_repeat_sampler(tmp_path, n_rows, P):
    from grail_exp.data import build_source

    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "solution": str(i)})
                           for i in range(n_rows)))
    cfg = OmegaConf.create({"name": "deepmath", "path": str(f), "revision": None, "split": "train",
                            "problem_field": "prompt", "answer_field": "solution", "shuffle_seed": 42,
                            "order": "reference", "sampler_seed": None})
    n_steps = 3 * (n_rows // P) + 2  # more than three epochs
    expected = _reference_stream(n_rows, P, seed=7, shuffle_seed=42, n_steps=n_steps, G=3, repeat=2)
    src = build_source(cfg, seed=7, prompts_per_step=P)
    got = [[int(src[r * P + j].answer) for j in range(P)] for r in range(n_steps)]
    assert got == expected
    # a fresh source (a resumed run) gives the same prompts at any position, without replaying the stream
    assert [int(build_source(cfg, seed=7, prompts_per_step=P)[i].answer) for i in (n_steps * P - 1, 0)] == \
           [expected[-1][-1], expected[0][0]]
    # sampler_seed overrides the run seed; the shuffled order is today's cycled datasets.shuffle
    other = build_source(OmegaConf.merge(cfg, {"sampler_seed": 7}), seed=123, prompts_per_step=P)
    assert [int(other[i].answer) for i in range(P)] == expected[0]
    shuffled = build_source(OmegaConf.merge(cfg, {"order": "shuffled"}))
    perm = np.random.default_rng(42).permutation(n_rows)
    assert [int(shuffled[i].answer) for i in range(2 * n_rows)] == [int(perm[i % n_rows]) for i in range(2 * n_rows)]


def test_reference_order_needs_seed_and_rejects_generated_data(tmp_path, compose_cfg):
    from grail_exp.config import ConfigError
    from grail_exp.data import build_source

    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "solution": str(i)}) for i in range(3)))
    cfg = OmegaConf.create({"name": "deepmath", "path": str(f), "revision": None, "split": "train",
                            "problem_field": "prompt", "answer_field": "solution", "shuffle_seed": 42,
                            "order": "reference", "sampler_seed": None})
    with pytest.raises(ValueError, match="prompts_per_step"):
        build_source(cfg, seed=1, prompts_per_step=4)  # 3 rows < 4 prompts: the sampler yields nothing
    with pytest.raises(ValueError, match="sampler seed"):
        build_source(cfg)
    with pytest.raises(ConfigError, match="data.order"):
        validate(compose_cfg(["data.order=reference"]))  # the default data is the generated arithmetic stream
    with pytest.raises(ConfigError, match="data.order"):
        validate(compose_cfg(["data=deepmath", "data.order=random"]))


# ---------------------------------------------------------------------------------------------- method settings
CONF = Path(__file__).resolve().parent.parent / "conf"
FAMILIES = {"demo": [], "paper": ["model=qwen3_4b"], "smollm2": ["model=smollm2_135m"],
            "baselines": ["recipe=baselines", "model=qwen3_4b"]}
TRAINING_KEYS = ("loss.", "optim.", "trainer.", "rollout.", "reward.")


def _method_files():
    """(group, file, its command-line selection) of every file of the method groups: estimators, advantage schemes,
    auxiliary loss terms."""
    for group, select in (("estimator", "{}={}"), ("advantage", "{}={}"), ("loss_term", "+{}={}")):
        for f in sorted((CONF / group).glob("*.yaml")):
            yield group, f, select.format(group, f.stem)


OWN_NODE = {"estimator": "estimator.", "advantage": "advantage.", "loss_term": "loss.terms.{}."}


def _method(group: str, path: Path):
    from grail_exp.advantages import SCHEMES
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.loss import LOSS_TERMS

    return {"estimator": ESTIMATORS, "advantage": SCHEMES, "loss_term": LOSS_TERMS}[group][path.stem]


def _file_settings(group: str, path: Path) -> dict:
    """The leaves a group file sets itself, as root-level dotted keys (its `# @package` line, else the group's
    package)."""
    text = path.read_text()
    package = next((line.split()[2] for line in text.splitlines() if line.startswith("# @package")), group)
    node = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    node.pop("defaults", None)
    return flatten(node, "" if package == "_global_" else package + ".")


def _settings(group: str, path: Path) -> dict:
    """Every value selecting the method gives: its dataclass defaults (the first layer of its group file), then the
    leaves the file sets itself."""
    defaults = OmegaConf.to_container(OmegaConf.structured(_method(group, path).config_class))
    if group != "loss_term":
        defaults["name"] = path.stem  # estimators without a dataclass of their own share EstimatorConfig's
    return {**flatten(defaults, OWN_NODE[group].format(path.stem)), **_file_settings(group, path)}


def _requires(group: str, path: Path, settings: dict) -> dict:
    return _method(group, path).requires


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("group, path, select", list(_method_files()), ids=lambda x: getattr(x, "stem", x))
def test_a_methods_group_settings_survive_every_recipe_family(group, path, select, family):
    """Every value a method's group file sets is the composed value under each recipe family (a family recipe once
    put back the paper's loss over estimator=scrl's)."""
    composed = flatten(OmegaConf.to_container(compose([*FAMILIES[family], select]), resolve=False))
    for key, value in _settings(group, path).items():
        assert composed[key] == value, (key, composed[key], value)


@pytest.mark.parametrize("group, path, select", list(_method_files()), ids=lambda x: getattr(x, "stem", x))
def test_training_keys_a_method_sets_are_its_declared_requirements(group, path, select):
    """A method group that sets training keys outside its own node declares them as `requires`, so validate()
    refuses an experiment file or override that changes them (tests/test_scrl.py), and declares nothing it does not
    set (that would refuse every run)."""
    settings = _settings(group, path)
    own = OWN_NODE[group].format(path.stem)
    outside = {k: v for k, v in settings.items() if not k.startswith(own) and k.startswith(TRAINING_KEYS)}
    assert outside == _requires(group, path, settings)
