"""The starting weights a study's arms will load, built (or read from the cache) and checked before the first arm:
exit 0 and print the sha256 when it starts with ``--expect``; exit 2 naming both values when it does not.

    python sweeps/check_start_weights.py --expect 3d9a6684 experiment=real/chain_grpo [overrides...]

The same composition as ``python -m grail_exp.run <overrides>`` (``model.cold_start`` builds the supervised cold start
on first use, cached under ``paths.cache_dir``); the sha256 is the one each arm records (``start_weights_sha256``).
A cold start is deterministic on one CPU and thread count only: another processor's rounding gives other bits.
"""

from __future__ import annotations

import argparse
import sys


def start_weights(overrides: list[str]) -> tuple[str, str]:
    """(directory, sha256) of the weights a run with ``overrides`` starts from."""
    from hydra import compose, initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.models.architectures import weights_sha256
    from grail_exp.models.loading import resolve_model_path

    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    path = resolve_model_path(cfg)
    return path, weights_sha256(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", required=True, help="the sha256 (or its prefix) the study declared")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    path, sha = start_weights(args.overrides)
    if not sha.startswith(args.expect.lower()):
        print(f"starting weights {path}: sha256 {sha}, but the study declared {args.expect}: the arms would not start "
              f"from the declared weights (another CPU's rounding rebuilds the cold start with other bits)",
              file=sys.stderr)
        return 2
    print(sha)
    return 0


if __name__ == "__main__":
    sys.exit(main())
