"""The test suite's own rules: what tests share comes from tests/helpers/ (conftest.py holds fixtures only, and is
never imported; a test file is never imported either: its helpers move to tests/helpers/ once a second file needs
them), and every end-to-end test is marked ``e2e``, so that ``-m "not e2e"`` is the unit suite (``make test-unit``).

An end-to-end test runs a child process through ``subprocess`` — an entry point (``python -m grail_exp.*``, torchrun),
a script of sweeps/, a build tool, a measurement in a fresh interpreter — itself, through a function it calls (in its file, in another test file or in
tests/helpers/) or through a fixture of its file. Worker processes a library starts (the grader's pool, spawned gloo
ranks) do not count: the test still calls library code in its own process.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SPAWNS = {"run", "Popen", "call", "check_call", "check_output"}  # subprocess.<one of these>(...)


def _module_name(path: Path) -> str:
    rel = path.relative_to(TESTS).with_suffix("")
    return ".".join(rel.parts) if rel.parts[0] == "helpers" else rel.name


def _is_e2e_mark(node: ast.AST) -> bool:
    return "pytest.mark.e2e" in ast.unparse(node)


class _Module:
    def __init__(self, path: Path, root: Path = TESTS):
        self.path, self.rel, self.src = path, path.relative_to(root), path.read_text()
        self.tree = ast.parse(self.src)
        self.functions = {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef)}
        self.imported = {}  # local name -> (module, name)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.imported[a.asname or a.name] = (node.module, a.name)
        self.marked_module = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                                   for t in n.targets) and _is_e2e_mark(n.value)
                                 for n in self.tree.body)

    def tests(self):
        """(name, function node) of every test, methods of test classes included."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                yield node.name, node


def _modules() -> dict[str, _Module]:
    return {_module_name(p): _Module(p) for p in TESTS.rglob("*.py") if p.name != "conftest.py"}


def e2e_tests(mods: dict[str, _Module]) -> tuple[set[str], set[str]]:
    """(tests that run a child process, tests marked e2e), as ``file::name``."""
    memo: dict[tuple[str, str], bool] = {}

    def spawns(mod: str, name: str, seen: frozenset = frozenset()) -> bool:
        key = (mod, name)
        if key in memo or key in seen or mod not in mods or name not in mods[mod].functions:
            return memo.get(key, False)
        m, fn = mods[mod], mods[mod].functions[name]
        out = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in SPAWNS
                  and getattr(c.func.value, "id", "") == "subprocess" for c in ast.walk(fn))
        callees = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        fixtures = {a.arg for a in fn.args.args}  # a fixture of this file that runs a child process counts
        for callee in callees | fixtures:
            target = (mod, callee) if callee in m.functions else m.imported.get(callee)
            if target and not out:
                out = spawns(*target, seen | {key})
        memo[key] = out
        return out

    spawning, marked = set(), set()
    for mod, m in mods.items():
        if mod.startswith("helpers"):
            continue
        for name, fn in m.tests():
            where = f"{m.rel}::{name}"
            if spawns(mod, name):
                spawning.add(where)
            if m.marked_module or any(_is_e2e_mark(d) for d in fn.decorator_list):
                marked.add(where)
    return spawning, marked


def test_the_scanner_follows_calls_fixtures_and_imports(tmp_path):
    files = {
        "helpers/run.py": "import subprocess\ndef go():\n    return subprocess.run(['true'])\n",
        "test_a.py": ("import pytest\nfrom helpers.run import go\n"
                      "def _local():\n    return go()\n"
                      "@pytest.fixture\ndef started():\n    return _local()\n"
                      "def test_direct():\n    import subprocess\n    subprocess.Popen(['true'])\n"
                      "def test_via_helper():\n    _local()\n"
                      "def test_via_fixture(started):\n    pass\n"
                      "@pytest.mark.e2e\ndef test_unit_but_marked():\n    assert 1\n"
                      "def test_unit():\n    assert 1\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = {}
    for p in tmp_path.rglob("*.py"):
        rel = p.relative_to(tmp_path).with_suffix("")
        mods[".".join(rel.parts) if rel.parts[0] == "helpers" else rel.name] = _Module(p, tmp_path)
    spawning, marked = e2e_tests(mods)
    names = lambda s: {w.rsplit("::", 1)[1] for w in s}  # noqa: E731
    assert names(spawning) == {"test_direct", "test_via_helper", "test_via_fixture"}
    assert names(marked) == {"test_unit_but_marked"}


def test_every_end_to_end_test_is_marked_e2e_and_only_those():
    spawning, marked = e2e_tests(_modules())
    assert not spawning - marked, ("tests that run a child process without @pytest.mark.e2e (or a module pytestmark): "
                                   + ", ".join(sorted(spawning - marked)))
    assert not marked - spawning, "marked e2e but run no child process: " + ", ".join(sorted(marked - spawning))


def test_the_e2e_folder_holds_only_end_to_end_tests():
    spawning, _ = e2e_tests(_modules())
    for path in (TESTS / "e2e").glob("test_*.py"):
        m = _Module(path)
        assert m.marked_module, f"{m.rel}: set pytestmark = pytest.mark.e2e"
        rest = [n for n, _ in m.tests() if f"{m.rel}::{n}" not in spawning]
        assert not rest, f"{m.rel}: not end to end, move them beside the unit tests: {rest}"


def test_no_test_imports_conftest():
    offenders = [f"{m.rel}: {mod}.{name}" for m in _modules().values()
                 for mod, name in m.imported.values() if mod.split(".")[-1] == "conftest"]
    offenders += [f"{p.relative_to(TESTS)}" for p in TESTS.rglob("*.py")
                  if re.search(r"^\s*import (tests\.)?conftest\b", p.read_text(), re.M)]
    assert not offenders, "import these from tests/helpers/ instead of conftest.py: " + "; ".join(offenders)


def imports_of_test_files(root: Path = TESTS) -> list[str]:
    """``file:line: module`` of every import (at any depth of a file) of a test file under ``root``: ``from test_x
    import ...``, ``import test_x``, ``from tests.test_x import ...``, ``from e2e import test_x``."""

    def is_test_file(dotted: str) -> bool:
        parts = dotted.split(".")
        parts = parts[1:] if parts[0] == root.name else parts  # ``tests.test_x`` from the repository root
        return parts[-1].startswith("test_") and root.joinpath(*parts).with_suffix(".py").is_file()

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in sorted(ast.walk(ast.parse(path.read_text())), key=lambda n: getattr(n, "lineno", 0)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno}: {t}" for t in targets if is_test_file(t)]
    return found


def test_the_test_file_import_scanner_catches_every_spelling(tmp_path):
    files = {"test_a.py": "def shared():\n    return 1\n", "e2e/test_b.py": "", "helpers/util.py": "",
             "test_uses.py": ("import pytest\nfrom helpers.util import x\nfrom grail_exp.data import test_split\n"
                              "def test_one():\n    from test_a import shared\n"
                              "import test_a\nimport tests.test_a as t\nfrom e2e import test_b\n"
                              "from e2e.test_b import y\n")}
    root = tmp_path / "tests"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    found = imports_of_test_files(root)
    assert [f.split(": ", 1)[1] for f in found] == ["test_a", "test_a", "tests.test_a", "e2e.test_b", "e2e.test_b"], found


def test_no_test_imports_another_test_file():
    offenders = imports_of_test_files()
    assert not offenders, ("imports of a test file (tests share code through tests/helpers/, never a test file): "
                           + "; ".join(offenders))



def test_every_file_with_vllm_tests_is_run_by_make_test_vllm():
    """`make test-vllm` names its files: a file whose tests need vLLM but is not named there never runs in CI (its
    tests skip in the main environment)."""
    makefile = (TESTS.parent / "Makefile").read_text()
    recipe = re.search(r"^test-vllm:.*\n\t(.*)$", makefile, re.M).group(1)
    named = set(re.findall(r"tests/\S+\.py", recipe))
    marked = {str(f.relative_to(TESTS.parent)) for f in TESTS.rglob("test_*.py")
              if re.search(r"pytest\.mark\.vllm\b", f.read_text())}
    assert marked - named == set(), f"files with vLLM tests that make test-vllm does not run: {sorted(marked - named)}"
