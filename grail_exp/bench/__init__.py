"""`python -m grail_exp.bench`: the synthetic update bench, real steps of an experiment, the attention bench."""

from grail_exp.bench.synthetic import main  # noqa: E402,F401  (the entry point)
