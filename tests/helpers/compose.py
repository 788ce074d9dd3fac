"""Helpers importable by tests (pytest does not import conftest.py as a module)."""

from conftest import compose


def compose_weights(tmp, overrides):
    return compose(overrides, tmp, config_name="weights")
