"""Compose the real config tree like ``python -m grail_exp.<entry point> <overrides>`` does, with temp paths."""

from __future__ import annotations

from pathlib import Path


def compose(overrides: list[str] | None = None, tmp: Path | None = None, config_name: str = "config"):
    """The composed ``config_name`` tree (``config`` = the training run's) with ``overrides``; with ``tmp``, every
    path the run writes (root, output, cache) lies under it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs

    register_configs()
    schemas = {"report": "grail_exp.reporting.schema", "extrapolate": "grail_exp.extrapolate"}
    if config_name in schemas:  # their schemas are stored by their own modules
        __import__(schemas[config_name])
    GlobalHydra.instance().clear()
    paths = []
    if tmp is not None:
        paths = [f"paths.root_dir={tmp}", f"paths.output_dir={tmp}/run", f"paths.cache_dir={tmp}/cache"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=paths + list(overrides or []))


def compose_weights(tmp, overrides):
    """``python -m grail_exp.weights``'s config."""
    return compose(overrides, tmp, config_name="weights")
