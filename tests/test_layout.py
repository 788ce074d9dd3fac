"""The house rules of the code (issue 21 §3): no import circles, the LightningModule stays glue, and no file outside
the update backends asks which parallel strategy it runs under."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "grail_exp"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, at any depth of the file (function-level imports count: they run
    too). Importing ``a.b.c`` also runs the ``__init__`` of ``a.b``, so it counts as importing ``a.b`` as well — except
    from inside ``a.b`` itself, where the package is already being initialised."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if not t or t == name:
                    continue
                graph[name].add(t)
                parts = t.split(".")
                for i in range(2, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in mods and not name.startswith(parent + ".") and parent != name:
                        graph[name].add(parent)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_checker_finds_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import circles (move the shared piece below both sides): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_lightning_module_is_glue():
    lines = (PKG / "training" / "module.py").read_text().count("\n")
    assert lines <= 300, f"grail_exp/training/module.py has {lines} lines: a phase's work belongs in its phase's file"


def _code(path: Path) -> str:
    """The file's code with comments and strings blanked (so docstrings may name strategies)."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            out.append(tok.string)
    return " ".join(out)


# A branch on the parallel strategy: comparing trainer.strategy, or reaching for a strategy's own object.
STRATEGY_BRANCH = re.compile(r"\bstrategy\b\s*\)?\s*(==|!=|\bin\b|\.\s*startswith)|\.\s*(fsdp|zero)\b")


def test_no_strategy_branches_outside_the_update_backends():
    allowed = {PKG / "distributed.py"}  # build_strategy: "auto" is Lightning's own single-process strategy
    offenders = []
    for f in PKG.rglob("*.py"):
        if "backends" in f.relative_to(PKG).parts or f in allowed:
            continue
        for m in STRATEGY_BRANCH.finditer(_code(f)):
            offenders.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not offenders, "strategy branches outside grail_exp/training/backends: " + "; ".join(offenders)


def test_the_strategy_branch_pattern_catches_the_old_module():
    old = 'self.fsdp = str(cfg.trainer.strategy) == "fsdp"\nif self.zero is not None:\n    pass\n'
    assert len(STRATEGY_BRANCH.findall(old)) == 3  # self.fsdp, strategy ==, self.zero


def test_every_module_has_a_room_in_the_developer_guide():
    """docs/developer.md's layout section names every module and package of grail_exp (one paragraph each)."""
    text = (ROOT / "docs" / "developer.md").read_text()
    section = text.split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    missing = []
    for name in _modules():
        rel = name.replace(".", "/")
        if name == "grail_exp" or name.startswith("grail_exp.conf"):
            continue
        leaf = rel.split("/", 1)[1]
        if f"`{leaf}.py`" not in section and f"`{leaf}/`" not in section and f"`{leaf}`" not in section:
            top = leaf.split("/")[0]
            if f"`{top}/`" not in section:  # a package's files may be described together
                missing.append(leaf)
    assert not missing, f"not in docs/developer.md's layout section: {missing}"
