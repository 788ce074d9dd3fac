"""``python -m grail_exp.preflight <the run's overrides>``: see ``grail_exp/preflight/__init__.py``."""

import sys

from grail_exp.errors import exit_on_user_error
from grail_exp.preflight.cli import main, stops_end_the_rehearsal

if __name__ == "__main__":  # pragma: no cover
    with exit_on_user_error(), stops_end_the_rehearsal():
        sys.exit(main())
