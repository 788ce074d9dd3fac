"""grail_exp/registry.py: one name → object registry for every pluggable kind, and the package import that fills it."""

from __future__ import annotations

import sys

import pytest

from grail_exp.registry import Registry, UnknownNameError, import_modules


def test_a_name_registered_twice_is_refused_naming_both_places():
    reg = Registry("widget")

    @reg.register("a")
    def first():
        pass

    with pytest.raises(ValueError) as info:
        @reg.register("a")
        def second():
            pass
    msg = str(info.value)
    assert msg.startswith("widget 'a' registered twice: by ") and f"{__name__}." in msg
    assert "first" in msg and "second" in msg
    assert reg["a"] is first  # the first registration stands


def test_a_class_registered_under_several_names_is_refused_before_any_is_taken():
    reg = Registry("backend")
    reg.register("b")(object)
    with pytest.raises(ValueError, match="backend 'b' registered twice"):
        reg.register("a", "b")(dict)
    assert sorted(reg) == ["b"]  # "a" was not taken by the refused class


def test_an_unknown_name_lists_the_known_ones():
    reg = Registry("policy loss")
    reg.add("zeta", 1)
    reg.add("alpha", 2)
    with pytest.raises(KeyError) as info:
        reg["nope"]
    assert isinstance(info.value, UnknownNameError)
    assert str(info.value) == "unknown policy loss 'nope'; known: alpha, zeta"
    assert "nope" not in reg and reg.get("nope") is None  # membership and get() stay quiet


def test_then_attaches_before_registering():
    reg = Registry("scheme")

    def attach(cls):
        cls.name = "mine"

    cls = reg.register("mine", then=attach)(type("Mine", (), {}))
    assert reg["mine"] is cls and cls.name == "mine"


def test_a_package_imports_every_module_in_its_folder(tmp_path, monkeypatch):
    """A made-up package of three modules registering themselves, a private one and a sub-package: importing the
    package through ``import_modules`` registers the three, skips the private module and leaves the sub-package."""
    pkg = tmp_path / "plugins_for_registry_test"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "registry_of_it.py").write_text("from grail_exp.registry import Registry\nTHINGS = Registry('thing')\n")
    for name in ("one", "two"):
        (pkg / f"{name}.py").write_text(
            f"from plugins_for_registry_test.registry_of_it import THINGS\nTHINGS.add({name!r}, {name!r})\n")
    (pkg / "_private.py").write_text("raise RuntimeError('a private module is not imported')\n")
    (pkg / "sub" / "__init__.py").write_text("raise RuntimeError('a sub-package is not imported')\n")
    (pkg / "__init__.py").write_text("from grail_exp.registry import import_modules\n"
                                     "import_modules(__name__, __path__)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import plugins_for_registry_test.registry_of_it as reg_mod  # runs the package's __init__ first

        assert sorted(reg_mod.THINGS) == ["one", "two"]
        import_modules("plugins_for_registry_test", [str(pkg)], skip=("two",))  # already imported: nothing twice
        assert sorted(reg_mod.THINGS) == ["one", "two"]
    finally:
        for name in [m for m in sys.modules if m.startswith("plugins_for_registry_test")]:
            del sys.modules[name]


def test_every_registry_of_the_package_is_one():
    """The nine kinds keep a ``Registry`` (their decorators' duplicate and unknown-name errors are its)."""
    from grail_exp.advantages import SCHEMES
    from grail_exp.data import BENCHMARKS, DATASETS
    from grail_exp.estimators import ESTIMATORS
    from grail_exp.loss import AGGREGATIONS, KL_ESTIMATORS, LOSS_TERMS, POLICY_LOSSES
    from grail_exp.training.backends import BACKENDS

    for reg in (SCHEMES, ESTIMATORS, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, LOSS_TERMS, BACKENDS, DATASETS,
                BENCHMARKS):
        assert isinstance(reg, Registry) and len(reg) > 0, reg
    with pytest.raises(ValueError, match="advantage scheme 'grail' registered twice"):
        from grail_exp.advantages import register_scheme

        register_scheme("grail", object)(type("Another", (), {}))
    assert SCHEMES["grail"].__name__ == "GrailScheme"
