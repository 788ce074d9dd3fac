"""Where the Hydra config tree lives: the top-level ``conf/`` of a checkout, or its copy inside a wheel.

The tree is the project's interface and sits beside ``grail_exp/`` in the repository (design.md layout).
A wheel installs the same files as the package ``grail_exp.conf`` (pyproject maps ``conf/`` there), so
``python -m grail_exp.run`` works from any directory, from a checkout (editable install) or from a wheel.
"""

from __future__ import annotations

import warnings
from pathlib import Path

# conf/hydra/launcher/submitit_{slurm,local}.yaml extend the submitit plugin's configs of the same names on purpose
# (`hydra/launcher=submitit_slurm` must give our requeue-with-resume launcher). Hydra 1.3 then validates them
# against the plugin's schemas, which is what we want, but announces it with a deprecation warning on every run.
warnings.filterwarnings("ignore", message=r"(?s).*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore schema")

_CHECKOUT_CONF = Path(__file__).resolve().parent.parent / "conf"


def config_dir() -> str:
    """Absolute path of the config tree (a checkout's ``conf/``, else the installed ``grail_exp/conf``)."""
    if (_CHECKOUT_CONF / "config.yaml").is_file():
        return str(_CHECKOUT_CONF)
    from importlib.resources import files

    installed = files("grail_exp.conf")
    if not installed.joinpath("config.yaml").is_file():
        raise FileNotFoundError("the grail_exp config tree is missing: neither <checkout>/conf nor the installed "
                                "grail_exp/conf has config.yaml; reinstall the package")
    return str(installed)


CONFIG_DIR = config_dir()
