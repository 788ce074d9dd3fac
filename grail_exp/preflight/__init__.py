"""``python -m grail_exp.preflight <the run's overrides> [preflight.<key>=<value> ...]``: the dress rehearsal of a run
on the user's own node before a multi-day job (docs/recipes-card.md, "Preflight on your cluster").

The same command line, shrunk in depth (``preflight.layers`` decoder layers at the real widths and vocabulary, random
weights), run in its real layout (trainer, devices, engine) by ``rehearsal.py``: a training run of
``preflight.rounds`` rollout batches with its final checkpoint and evaluation, then a resumed run that the preflight
stops by sending SIGTERM to one rank. ``checks.py`` judges what every rank's probe (``probe.py``) recorded, one
function per check; ``report.py`` prints one table and the exit code: 0 when every check passed, 1 with one line per
failure naming the config key that fixes it.
"""
