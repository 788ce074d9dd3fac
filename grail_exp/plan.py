"""``python -m grail_exp.plan <overrides>``: the memory plan per device of the run those overrides compose.

    python -m grail_exp.plan model=qwen3_8b advantage=grail                             # this machine's GPU
    python -m grail_exp.plan model=qwen3_8b advantage=grail trainer.device_memory_gb=79  # offline: an H100 80GB

The same composition as ``python -m grail_exp.run`` (overrides, recipes, experiments); prints the table of
``grail_exp/memory/`` and exits 1 when the plan does not fit the device (with what would), 0 otherwise, also when
there is no device to judge (CPU runs, no CUDA device and no ``trainer.device_memory_gb``). docs/memory-planner.md.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from hydra import compose, initialize_config_dir

    from grail_exp.conf_path import CONFIG_DIR
    from grail_exp.config import register_configs
    from grail_exp.memory import plan, refusal, render, tight_warning

    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*argv, "paths.output_dir=."])
    p = plan(cfg)
    print(render(p))
    if p.fits is False:
        print("\n" + refusal(cfg, p))
        return 1
    warning = tight_warning(cfg, p)
    if warning:
        print("\nwarning: " + warning)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
