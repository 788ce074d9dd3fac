"""Command-line overrides applied to a config that is already composed, as Hydra would apply them.

The memory planner names overrides that would make a run fit (``trainer=fsdp_zero2 trainer.devices=4``,
``rollout=hf``) and plans each one first, on the run's composed config — without the overrides that composed it,
which Hydra's composed config does not keep. So:

- ``key=value`` sets the key (its value read as YAML);
- ``group=option`` is composed by Hydra from the option's own file and defaults list (``fsdp_zero2`` ← ``fsdp`` ←
  ``gpu``) over the group's schema defaults, and the run's values that its current option does not explain — what
  its recipe, experiment file or command line set on top — are laid over it again, as Hydra would keep them. The
  current option is the one that explains the most of the run's values (the fewest left to have been set on top):
  the composed config does not record which option a group had.

Group overrides are applied before key overrides, whatever their order, as Hydra does.

Where Hydra composed this process's config (``python -m grail_exp.run`` / ``plan``: ``HydraConfig`` holds the command
line), ``recompose`` composes the run's recorded overrides with the new ones from scratch instead — Hydra's own answer,
without the ambiguity below; ``apply_overrides`` is the fallback for a config composed elsewhere (tests, tools).

What cannot be told apart: a value set on top that equals the current option's own. It is taken to come from the
option, so a new option that does not set the key gives it the schema's default, where Hydra would keep the value
set on top (the paper recipe's ``rollout.vllm.gpu_memory_utilization: 0.2``, which ``rollout/vllm_paper.yaml`` also
sets, after ``rollout=hf``; an HF run never reads it). ``tests/test_recompose.py`` compares against Hydra's own
composition of the command line.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path


def recorded_overrides() -> list[str] | None:
    """The command-line overrides Hydra composed this process's config from (``hydra.overrides.task``), or None when
    no Hydra application composed it."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001  (no Hydra config of this process: fall back)
        return None


def override_key(override: str) -> str:
    """``trainer``, ``trainer.devices``: what an override sets, without its ``+`` / ``~`` / ``++`` prefix."""
    return override.split("=", 1)[0].lstrip("+~")


def recompose(recorded: list[str], overrides: list[str], config_name: str = "config"):
    """The run Hydra composes from ``recorded`` with ``overrides`` on top (an override of the same key replaces the
    recorded one, as on the command line the user would run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR

    merged = {override_key(o): o for o in recorded}
    merged.update({override_key(o): o for o in overrides})
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=list(merged.values()))
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(merged.values()))


def apply_overrides(cfg, overrides: list[str]):
    """A new config: ``cfg`` with ``overrides`` (``group=option`` or ``dotted.key=value``) applied."""
    import yaml
    from omegaconf import OmegaConf, open_dict

    pairs = [o.split("=", 1) for o in overrides]
    new = copy.deepcopy(cfg)
    with open_dict(new):
        for group, option in (p for p in pairs if "." not in p[0]):
            switch_option(new, group, option)
        for key, value in (p for p in pairs if "." in p[0]):
            OmegaConf.update(new, key, yaml.safe_load(value), merge=False)
    return new


def switch_option(cfg, group: str, option: str) -> None:
    """Replace ``cfg[group]`` (in place) by Hydra's composition of ``group=option`` with the run's own values of the
    group laid over it (see the module docstring)."""
    from omegaconf import OmegaConf

    mine = _leaves(cfg[group])
    schema = _schema_defaults(cfg[group])
    on_top = {o: _set_on_top(mine, _leaves(_composed(schema, group, o))) for o in group_options(group)}
    current = min(on_top, key=lambda o: len(on_top[o]))
    cfg[group] = OmegaConf.merge(_composed(schema, group, option), _nested(on_top[current]))


def group_options(group: str) -> list[str]:
    """The options of a config group: the files of ``conf/<group>/``, sorted (ties of ``switch_option`` go to the
    first)."""
    from grail_exp.conf_path import CONFIG_DIR

    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


@cache
def option_file(group: str, option: str) -> dict:
    """The group node Hydra composes from ``conf/<group>/<option>.yaml`` and its defaults list, interpolations kept.
    Inside a Hydra app (``python -m grail_exp.run``) Hydra is initialised already, with this config tree."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from grail_exp.conf_path import CONFIG_DIR

    name = f"{group}/{option}"
    if GlobalHydra.instance().is_initialized():
        node = compose(config_name=name)
    else:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            node = compose(config_name=name)
    return OmegaConf.to_container(node[group], resolve=False)


def _composed(schema, group: str, option: str):
    from omegaconf import OmegaConf

    return OmegaConf.merge(schema, option_file(group, option))


def _schema_defaults(node):
    """The group's typed schema with its defaults (``config.py``'s dataclass the node was composed with), or an empty
    node for an untyped group."""
    from dataclasses import is_dataclass

    from omegaconf import OmegaConf

    kind = OmegaConf.get_type(node)
    return OmegaConf.structured(kind) if kind is not None and is_dataclass(kind) else OmegaConf.create({})


def _leaves(node) -> dict:
    """{dotted key: value} of a node's leaves (lists are leaves), interpolations as written."""
    from omegaconf import OmegaConf

    out: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node)
    return out


def _set_on_top(mine: dict, base: dict) -> dict:
    """The run's leaves that ``base`` (an option's composition) does not give."""
    return {k: v for k, v in mine.items() if k not in base or base[k] != v}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out
