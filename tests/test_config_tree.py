"""The config tree: each default stated once, one recipe group, the algorithm orthogonal to the recipe.

The expected values are written out here from the method spec (§2.2 the paper's objective, §4.3 GRAIL, §5.6 OAR-G,
§6.1 the setup), the reference configs (qwen3_{grpo,grail,oar_g}.yaml) and the algorithms' papers, not read back
from the YAML or the dataclasses, so a default moved to a wrong value fails here.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from grail_exp.tracking import flatten
from helpers.compose import compose

CONF = Path(__file__).resolve().parent.parent / "conf"
NOWHERE = Path("/nonexistent")  # paths: never written


@cache
def _flat(*overrides: str) -> dict:
    """The composed config as {dotted.key: value}, paths excluded."""
    out = flatten(OmegaConf.to_container(compose(list(overrides), NOWHERE), resolve=True))
    return {k: v for k, v in out.items() if not k.startswith("paths.")}


def _wrong(flat: dict, expected: dict) -> dict:
    return {k: (flat.get(k, "<missing>"), v) for k, v in expected.items() if flat.get(k, "<missing>") != v}


# ---------------------------------------------------------------------------------------------- the defaults
PAPER_OBJECTIVE = {  # spec §2.2 (qwen3_grpo.yaml): what LossConfig's defaults state, mu aside
    "loss.scale_rewards": "none", "loss.epsilon": 0.2, "loss.epsilon_high": 0.28, "loss.loss_type": "dr_grpo",
    "loss.beta": 0.0, "loss.kl_estimator": "k3", "loss.policy_loss": "ppo_clip", "loss.mask_truncated_completions": True,
    "loss.delta": None, "loss.top_entropy_quantile": 1.0, "loss.off_policy_mask_threshold": None,
}
PAPER_GRAIL = {  # spec §4.3, the qwen3_grail.yaml column (not GrailConfigV2's dataclass defaults)
    "advantage.name": "grail", "advantage.std": 0.5, "advantage.mean": 1.0, "advantage.w_min": 0.5,
    "advantage.w_max": 5.0, "advantage.leaf_source": "embeddings", "advantage.symmetry": "wrong",
}
PAPER_OAR_G = {  # spec §5.6 / §6.1 (qwen3_oar_g.yaml): GRAIL's re-implementation
    "advantage.name": "oar_g", "advantage.variant": "grail_repo", "advantage.tau": 0.4, "advantage.beta": 2.0,
    "advantage.eps": 1e-12, "advantage.noise_std": 1e-3,
}
ADAMW = {  # transformers' TrainingArguments defaults, which the reference keeps (spec §6.1), and clipping at 1.0
    "optim.betas": [0.9, 0.999], "optim.eps": 1e-8, "optim.weight_decay": 0.0, "optim.max_grad_norm": 1.0,
    "optim.warmup_steps": 0,
}
DEMO = {  # the embedded demo around the defaults: lr 1e-4 and mu 1 on the 0.4 M model, the CPU trainer
    "recipe.name": "demo", "seed": 42, "task_name": "train", "optim.lr": 1e-4, "loss.num_iterations": 1,
    "rollout.num_generations": 8, "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0,
    "rollout.max_completion_length": 64, "trainer.name": "cpu", "data.name": "arithmetic", "eval.name": "quick",
    "reward.extraction": "last_balanced", "reward.num_workers": 2, "optimized_metric": "eval/arithmetic/acc",
}


def test_the_defaults_are_the_papers_objective_and_grail():
    """Stated once (LossConfig, OptimConfig, GrailConfig), the defaults compose to the paper's values on the demo."""
    assert not _wrong(_flat(), {**PAPER_OBJECTIVE, **PAPER_GRAIL, **ADAMW, **DEMO})


def test_the_paper_recipe_keeps_the_defaults_it_does_not_state():
    """recipe=paper states only mu, lr and what else differs; the objective, AdamW and the schemes' values come from
    the defaults and are the paper's."""
    for scheme, values in (("grail", PAPER_GRAIL), ("oar_g", PAPER_OAR_G), ("grpo", {"advantage.name": "grpo"})):
        flat = _flat("model=qwen3_8b", f"advantage={scheme}")
        expected = {**PAPER_OBJECTIVE, **ADAMW, **values, "loss.num_iterations": 4, "optim.lr": 1e-6, "seed": 42,
                    "rollout.num_generations": 8, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
                    "rollout.top_k": 50, "rollout.repetition_penalty": 1.0, "rollout.max_completion_length": 4096,
                    "data.shuffle_seed": 42, "data.sampler_seed": None, "trainer.max_steps": 200,
                    "trainer.eval_at_end": True, "rollout.vllm.gpu_memory_utilization": 0.2,
                    "trainer.micro_batch_size": 2 if scheme == "oar_g" else 8}
        assert not _wrong(flat, expected), scheme


def test_smollm2_recipe_values():
    flat = _flat("model=smollm2_135m")
    expected = {**PAPER_OBJECTIVE, **PAPER_GRAIL, "recipe.name": "smollm2", "recipe.base": "conf/recipe/smollm2/base.yaml",
                "recipe.scheme": None, "model.dtype": "bfloat16", "optim.lr": 3e-5, "optim.allow_high_lr": True,
                "optim.warmup_steps": 0, "optim.max_grad_norm": 1.0, "rollout.num_generations": 8,
                "rollout.max_completion_length": 24, "rollout.temperature": 1.0, "rollout.top_p": 1.0,
                "rollout.top_k": 0, "data.name": "arithmetic", "trainer.name": "cpu", "trainer.max_steps": 20,
                "trainer.prompts_per_step": 4, "trainer.micro_batch_size": 32, "eval.n": 2, "eval.max_tokens": 24,
                "loss.num_iterations": 1}
    assert not _wrong(flat, expected)
    assert len(flat["model.few_shot"]) == 3


@pytest.mark.parametrize("scheme, values", [("grpo", {"advantage.name": "grpo"}), ("grail", PAPER_GRAIL),
                                            ("oar_g", PAPER_OAR_G)])
def test_the_real_model_study_values(scheme, values):
    """The study's arms (experiment=real/chain_<scheme>, recipe=smollm2_chain) run the paper's scheme settings, which
    are the defaults: a changed default fails here before it can change the study (docs/real-model-study.md)."""
    flat = _flat(f"experiment=real/chain_{scheme}")
    expected = {**PAPER_OBJECTIVE, **values, "recipe.name": "smollm2_chain",
                "recipe.base": "conf/recipe/smollm2_chain/base.yaml", "recipe.scheme": None,
                "model.name_or_path": "pkg:smollm2", "model.dtype": "bfloat16", "model.few_shot": [],
                "model.cold_start.enabled": True, "model.cold_start.steps": 40, "model.cold_start.batch_size": 8,
                "model.cold_start.lr": 1e-4, "data.min_steps": 2, "data.max_steps": 3, "data.max_operand": 10,
                "data.solution_style": "words", "data.num_test": 200, "optim.lr": 3e-5, "optim.warmup_steps": 0,
                "optim.max_grad_norm": 1.0, "rollout.num_generations": 8, "rollout.max_completion_length": 96,
                "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0, "loss.num_iterations": 1,
                "trainer.max_steps": 60, "trainer.prompts_per_step": 4, "trainer.micro_batch_size": 8,
                "trainer.eval_before_training": True, "trainer.eval_at_end": True, "trainer.eval_cache": True,
                "trainer.checkpoint_every": 10, "trainer.keep_last_checkpoints": 1,
                "trainer.save_final_checkpoint": True, "trainer.weights_table_every": 5,
                "trainer.weights_table_rows": 32, "eval.n": 4, "eval.max_tokens": 96, "eval.temperature": 0.6,
                "eval.top_p": 0.95, "eval.top_k": 20, "task_name": "real_chain_study"}
    assert not _wrong(flat, expected)


# ---------------------------------------------------------------------------------------------- stated once
def _schema_defaults() -> dict:
    """{dotted key: default} of every key RunConfig types, and {group: {option: {dotted key: value}}} of the
    options a recipe is layered on."""
    from grail_exp import config as C

    out = {}
    for node, cls in (("", C.RunConfig), ("model.", C.ModelConfig), ("data.", C.DataConfig),
                      ("rollout.", C.RolloutConfig), ("eval.", C.EvalConfig), ("benchmark.", C.BenchmarkConfig),
                      ("trainer.", C.TrainerConfig)):
        out.update(flatten(OmegaConf.to_container(OmegaConf.structured(cls), resolve=False), node))
    return out


def _method_defaults(group: str, name: str) -> dict:
    from grail_exp.advantages import SCHEMES
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.loss import LOSS_TERMS

    method = {"advantage": SCHEMES, "estimator": ESTIMATORS, "loss_term": LOSS_TERMS}[group][name]
    return OmegaConf.to_container(OmegaConf.structured(method.config_class))


@pytest.mark.parametrize("group", ["advantage", "estimator", "loss_term"])
def test_a_method_file_restates_no_value_of_its_dataclass(group):
    """A method's values live in its dataclass (one commented line per key, beside its code); its group file names
    the choice, composes that dataclass first (``/schema/<group>``) and sets only what differs."""
    for path in sorted((CONF / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        is_global = path.read_text().startswith("# @package _global_")  # estimator=scrl also sets loss keys
        assert {f"/schema/{group}@{group if is_global else '_here_'}": path.stem} in node.pop("defaults"), path
        own = node.get(group, {}) if is_global else node
        defaults = _method_defaults(group, path.stem)
        restated = {k: v for k, v in own.items() if k in defaults and defaults[k] == v}
        assert not restated, f"{path}: {restated} restate {group} {path.stem}'s dataclass defaults"


@pytest.mark.parametrize("root, schema", [("config", "RunConfig"), ("evaluate", "EvaluateConfig"),
                                          ("weights", "WeightsConfig")])
def test_root_configs_restate_no_schema_default(root, schema):
    from grail_exp import config as C

    node = OmegaConf.to_container(OmegaConf.load(CONF / f"{root}.yaml"), resolve=False)
    node.pop("defaults")
    defaults = flatten(OmegaConf.to_container(OmegaConf.structured(getattr(C, schema)), resolve=False))
    restated = {k: v for k, v in flatten(node).items() if k in defaults and defaults[k] == v}
    assert not restated, f"conf/{root}.yaml restates {schema}'s defaults: {restated}"


@cache
def _option_value(group: str, option: str, key: str):
    """The value of ``key`` with one option of its group and no recipe keys (recipe=none)."""
    return _flat("recipe=none", f"{group}={option}").get(key, "<missing>")


def _recipe_files():
    return sorted(p for p in (CONF / "recipe").rglob("*.yaml"))


@pytest.mark.parametrize("path", _recipe_files(), ids=lambda p: str(p.relative_to(CONF / "recipe")))
def test_a_recipe_states_only_what_differs(path):
    """No recipe key may be one that every choice of its group already gives it: then the recipe restates a default.
    (A value one option of the group also sets stays: the recipe's value must survive picking another option.)"""
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    node.pop("defaults", None)
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    redundant = {}
    for key, value in flatten(node).items():
        head = key.split(".")[0]
        if head == "recipe" or isinstance(value, str) and "${" in value:
            continue
        if head == "advantage":  # a scheme part: against the scheme's own values
            values = [_flat(f"advantage={path.stem}", "recipe=none").get(key)]
        elif head in groups:
            values = [_option_value(head, p.stem, key) for p in (CONF / head).glob("*.yaml")]
        else:
            values = [_flat("recipe=none").get(key, "<missing>")]
        if all(json.dumps(v) == json.dumps(value) for v in values):
            redundant[key] = value
    assert not redundant, f"{path} restates defaults: {redundant}"


# ---------------------------------------------------------------------------------------------- one recipe group
def test_the_recipe_is_one_group_with_one_rule():
    """conf/recipe/<family>/base.yaml is the family (selected by recipe=<family> or the model); any other file of the
    folder is a scheme's part, named after an advantage option and composed when that scheme runs."""
    assert not (CONF / "recipe_base").exists() and not (CONF / "recipe_scheme").exists()
    schemes = {p.stem for p in (CONF / "advantage").glob("*.yaml")}
    families = sorted(p.name for p in (CONF / "recipe").iterdir() if p.is_dir())
    assert families == ["baselines", "demo", "none", "paper", "smollm2", "smollm2_chain"]
    assert not list((CONF / "recipe").glob("*.yaml"))  # the family is a choice only: no file holds just a name
    for family in families:
        flat = _flat(f"recipe={family}")
        assert (flat["recipe.name"], flat["recipe.base"]) == (family, f"conf/recipe/{family}/base.yaml")
        for part in (CONF / "recipe" / family).glob("*.yaml"):
            if part.stem == "base":
                continue
            assert part.stem in schemes, part
            with_part = _flat(f"recipe={family}", f"advantage={part.stem}")
            assert with_part["recipe.scheme"] == f"conf/recipe/{family}/{part.stem}.yaml"
            other = next(s for s in sorted(schemes) if not (CONF / "recipe" / family / f"{s}.yaml").exists())
            assert _flat(f"recipe={family}", f"advantage={other}")["recipe.scheme"] is None


# ---------------------------------------------------------------------------------------------- algorithms
ALGOS = {  # the algorithm's defining keys, from its paper (TRL / verl where the paper leaves a value open)
    "grpo": ("grpo", {"loss.scale_rewards": "group", "loss.epsilon": 0.2, "loss.epsilon_high": 0.2,
                      "loss.loss_type": "grpo", "loss.policy_loss": "ppo_clip"}),
    "dr_grpo": ("grpo", {"loss.scale_rewards": "none", "loss.epsilon": 0.2, "loss.epsilon_high": 0.2,
                         "loss.loss_type": "dr_grpo", "loss.policy_loss": "ppo_clip"}),
    "dapo": ("grpo", {"loss.scale_rewards": "group", "loss.epsilon": 0.2, "loss.epsilon_high": 0.28,
                      "loss.loss_type": "dapo", "loss.mask_truncated_completions": False, "loss.beta": 0.0,
                      "rollout.dynamic_sampling.enabled": True, "rollout.dynamic_sampling.max_extra_rounds": 3,
                      "reward.overlong_buffer.enabled": True, "reward.overlong_buffer.penalty_factor": 1.0}),
    "gspo": ("grpo", {"loss.policy_loss": "gspo", "loss.scale_rewards": "group", "loss.epsilon": 3e-4,
                      "loss.epsilon_high": 4e-4, "loss.loss_type": "grpo"}),
    "cispo": ("grpo", {"loss.policy_loss": "cispo", "loss.scale_rewards": "group", "loss.epsilon": 1.0,
                       "loss.epsilon_high": 4.0, "loss.loss_type": "dapo"}),
    "sapo": ("grpo", {"loss.policy_loss": "sapo", "loss.scale_rewards": "group", "loss.sapo_tau_pos": 1.0,
                      "loss.sapo_tau_neg": 1.05}),
    "gmpo": ("grpo", {"loss.policy_loss": "gmpo", "loss.scale_rewards": "group", "loss.epsilon": 0.4,
                      "loss.epsilon_high": 0.4}),
    "gpg": ("gpg", {"loss.policy_loss": "gpg", "loss.scale_rewards": "none", "loss.loss_type": "dapo"}),
    "rloo": ("rloo", {"loss.scale_rewards": "none", "loss.epsilon": 0.2, "loss.epsilon_high": 0.2}),
    "reinforce_pp": ("reinforce_plus_plus_baseline", {"loss.scale_rewards": "none", "loss.epsilon": 0.2,
                                                      "loss.epsilon_high": 0.2, "loss.loss_type": "dapo"}),
    "remax": ("remax", {"loss.scale_rewards": "none", "loss.epsilon": 0.2, "loss.epsilon_high": 0.2}),
    "opo": ("opo", {"loss.scale_rewards": "none"}),
    "otb": ("optimal_token_baseline", {"loss.scale_rewards": "none"}),
}
RECIPES = {  # a recipe's own values that an algorithm leaves alone
    "demo": ((), {"recipe.name": "demo", "optim.lr": 1e-4, "loss.num_iterations": 1,
                  "rollout.max_completion_length": 64, "trainer.name": "cpu"}),
    "paper": (("model=qwen3_4b",), {"recipe.name": "paper", "optim.lr": 1e-6, "loss.num_iterations": 4,
                                    "rollout.max_completion_length": 4096, "trainer.name": "fsdp_zero2"}),
    "smollm2": (("model=smollm2_135m",), {"recipe.name": "smollm2", "optim.lr": 3e-5, "loss.num_iterations": 1,
                                          "rollout.max_completion_length": 24, "trainer.name": "cpu"}),
    "baselines": (("recipe=baselines", "model=qwen3_4b"),
                  {"recipe.name": "baselines", "optim.lr": 1e-6, "optim.warmup_steps": 20, "loss.num_iterations": 4,
                   "rollout.max_completion_length": 4096, "trainer.name": "gpu"}),
}


def test_every_algorithm_has_its_file():
    assert sorted(p.stem for p in (CONF / "algo").glob("*.yaml")) == sorted(ALGOS)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_an_algorithm_composes_with_any_recipe(algo, recipe):
    estimator, keys = ALGOS[algo]
    overrides, recipe_values = RECIPES[recipe]
    flat = _flat(*overrides, f"algo={algo}")
    assert not _wrong(flat, {**keys, **recipe_values, "advantage.name": "grpo", "estimator.name": estimator})
    if algo == "dapo":  # the overlong buffer: the last quarter of the recipe's completion budget
        assert flat["reward.overlong_buffer.length"] == recipe_values["rollout.max_completion_length"] // 4
    if recipe == "demo":  # a scheme on the command line combines with the algorithm
        assert _flat(f"algo={algo}", "advantage=grail")["advantage.name"] == "grail"


@pytest.mark.parametrize("algo, recipe", [("dapo", "demo"), ("dapo", "baselines"), ("gpg", "paper"), ("otb", "paper"),
                                          ("cispo", "smollm2")])
def test_an_algorithm_validates_on_a_recipe(compose_cfg, algo, recipe):
    from grail_exp.validate import validate

    validate(compose_cfg([*RECIPES[recipe][0], f"algo={algo}", "logger=none"]))


def test_dynamic_sampling_on_the_papers_four_gpus_is_refused(compose_cfg):
    """DAPO's dynamic sampling runs in one process: on the paper's 4-GPU layout validate() says so (recipe=baselines
    or trainer=gpu run it)."""
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    with pytest.raises(ConfigError, match=r"rollout.dynamic_sampling.enabled = true: only implemented for one process"):
        validate(compose_cfg(["model=qwen3_4b", "algo=dapo", "logger=none"]))


@pytest.mark.parametrize("algo", ALGOS)
def test_the_baseline_presets_are_the_algorithm_and_a_recipe(algo):
    """experiment=baselines/<algo>_cpu is `algo=<algo>` and experiment=baselines/<algo> is `recipe=baselines
    model=qwen3_4b algo=<algo>`, under their run names; the GPU scale is written out."""
    def differ(a, b):
        return {k for k in a.keys() | b.keys() if json.dumps(a.get(k)) != json.dumps(b.get(k))}

    assert differ(_flat(f"experiment=baselines/{algo}_cpu"), _flat(f"algo={algo}")) == {"task_name"}
    gpu = _flat(f"experiment=baselines/{algo}")
    assert differ(gpu, _flat("recipe=baselines", "model=qwen3_4b", f"algo={algo}")) == {"task_name"}
    assert gpu["task_name"] == f"baseline_{algo}"
    scale = {"model.name": "qwen3_4b", "data.name": "deepmath", "benchmark.name": "paper", "eval.name": "paper",
             "trainer.name": "gpu", "rollout.engine": "hf", "rollout.num_generations": 8,
             "rollout.max_completion_length": 4096, "rollout.top_k": 50, "optim.lr": 1e-6, "optim.warmup_steps": 20,
             "loss.num_iterations": 4, "trainer.max_steps": 200, "trainer.prompts_per_step": 32,
             "trainer.micro_batch_size": 8, "trainer.checkpoint_every": 50,
             "data.instruction": " Please reason step by step, and put your final answer within \\boxed{}."}
    assert not _wrong(gpu, scale)


def test_dynamic_sampling_with_a_device_list_is_refused(compose_cfg):
    """trainer.devices=[0,1] is two ranks, as trainer.devices=2 is (the world size has one definition)."""
    from grail_exp.config import ConfigError
    from grail_exp.validate import validate

    refusal = r"dynamic_sampling.enabled = true: only implemented for one process \(world size 2\)"
    with pytest.raises(ConfigError, match=refusal):
        validate(compose_cfg(["algo=dapo", "trainer=ddp", "trainer.devices=[0,1]", "logger=none"]))
