"""The house rules of the code (issue 21 §3): no import circles, the LightningModule stays glue, and no file outside
the update backends asks which parallel strategy it runs under."""

from __future__ import annotations

import ast
import importlib.util
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


def strategy_names() -> set[str]:
    """Every name that denotes a parallel strategy: the update backends' ``trainer.strategy`` names, the trainer
    options that select one (``fsdp_zero2``, ``deepspeed_zero2``, ...), FSDP's sharding strategies and ZeRO's stages.
    ``auto`` is left out: it is also the "decide for me" value of many unrelated keys (``resume``, ``dtype``,
    ``share_prompts``), and a comparison with it is caught by ``STRATEGY_BRANCH`` when the value is a strategy."""
    from grail_exp.memory.recompose import group_options, option_file
    from grail_exp.training.backends import BACKENDS
    from grail_exp.training.backends.fsdp import SHARDING_STRATEGIES

    options = {o for o in group_options("trainer") if str(option_file("trainer", o).get("strategy", "auto")) != "auto"}
    return (set(BACKENDS) - {"auto"}) | options | set(SHARDING_STRATEGIES) | {f"zero{i}" for i in range(4)}


def _is_strategy_name(text: str, names: set[str], prefix: bool) -> bool:
    """``text`` names a strategy (or a layout derived from one: ``fsdp_full``); ``prefix``: ``text`` is a
    ``startswith`` argument, so a prefix of a name counts too."""
    return any(text == n or text.startswith(n + "_") or (prefix and text and n.startswith(text)) for n in names)


def strategy_name_tests(source: str, names: set[str]) -> list[str]:
    """The comparisons (``==``, ``!=``, ``in``, ``match`` cases) and ``startswith`` / ``endswith`` calls of
    ``source`` that test a value against a strategy name, whatever the value is called."""
    found = []
    for node in ast.walk(ast.parse(source)):
        strings, prefix = [], False
        if isinstance(node, ast.Compare):
            strings = [c for part in [node.left, *node.comparators] for c in ast.walk(part)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith"):
            strings, prefix = [c for a in node.args for c in ast.walk(a)], True
        elif isinstance(node, ast.MatchValue):
            strings = list(ast.walk(node.value))
        if any(isinstance(c, ast.Constant) and isinstance(c.value, str) and _is_strategy_name(c.value, names, prefix)
               for c in strings):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_strategy_branches_outside_the_update_backends():
    allowed = {PKG / "distributed.py"}  # build_strategy: "auto" is Lightning's own single-process strategy
    names = strategy_names()
    offenders = []
    for f in PKG.rglob("*.py"):
        if "backends" in f.relative_to(PKG).parts or f in allowed:
            continue
        for m in STRATEGY_BRANCH.finditer(_code(f)):
            offenders.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
        offenders += [f"{f.relative_to(ROOT)} {hit}" for hit in strategy_name_tests(f.read_text(), names)]
    assert not offenders, "strategy branches outside grail_exp/training/backends: " + "; ".join(offenders)


def test_the_strategy_branch_pattern_catches_the_old_module():
    old = 'self.fsdp = str(cfg.trainer.strategy) == "fsdp"\nif self.zero is not None:\n    pass\n'
    assert len(STRATEGY_BRANCH.findall(old)) == 3  # self.fsdp, strategy ==, self.zero


def test_the_strategy_name_scan_catches_branches_whatever_the_variable():
    """The old planner's branches (its variable was ``strat``), a match statement and a set test are found; the same
    names in strings that are not compared (a suggested override, a message) and other keys' values are not."""
    names = strategy_names()
    assert {"ddp", "fsdp", "deepspeed", "fsdp_zero2", "deepspeed_zero2", "SHARD_GRAD_OP", "zero2"} <= names
    branches = (
        'if strat.startswith("fsdp"):\n    pass\n'
        'if strat in ("single", "ddp"):\n    pass\n'
        'x = "zero1" if layout == "zero1" else "zero2"\n'
        'if (t.get("sharding_strategy") or "FULL_SHARD") == "SHARD_GRAD_OP":\n    pass\n'
        'if kind != "fsdp_full":\n    pass\n'
        'match mode:\n    case "deepspeed":\n        pass\n'
    )
    assert len(strategy_name_tests(branches, names)) == 6, strategy_name_tests(branches, names)
    plain = ('options = [["trainer=fsdp_zero2", "trainer.devices=2"]]\nmsg = "use fsdp"\n'
             'if resume == "auto" or dtype != "auto" or name.startswith("gpu"):\n    pass\n')
    assert strategy_name_tests(plain, names) == []


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


# Collectives of torch.distributed: every one the package issues goes through grail_exp/world.py, which puts
# its tensor on the process group's device (NCCL refuses CPU tensors; gloo, what CPU runs use, takes them).
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "gather", "gather_object",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv"}
# Files allowed to call them directly: none today. (The update backends' libraries — FSDP2, DeepSpeed, DCP — and the
# rollout engine's own process groups run collectives inside their own code, which this scan does not see.)
COLLECTIVE_EXCEPTIONS: dict[str, str] = {}


def _collective_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every call ``<something>.<collective>(...)`` whose receiver is torch.distributed, ``dist`` or a
    name bound to it (``import torch.distributed as d``; ``from torch import distributed``)."""
    aliases = {"dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [(node.lineno, a.name) for a in node.names if a.name in COLLECTIVES]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        recv = ast.unparse(node.func.value)
        if recv == "torch.distributed" or recv in aliases:
            found.append((node.lineno, node.func.attr))
    return found


def test_every_collective_goes_through_the_world_module():
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel == "grail_exp/world.py" or rel in COLLECTIVE_EXCEPTIONS:
            continue
        offenders += [f"{rel}:{line}: torch.distributed.{name}" for line, name in _collective_calls(ast.parse(f.read_text()))]
    assert not offenders, ("collectives outside grail_exp/world.py (use its helpers: they put the tensor on "
                           "the process group's device):\n" + "\n".join(offenders))


def test_the_collective_scan_sees_the_spellings_it_must_refuse():
    src = ("import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
           "torch.distributed.all_reduce(x)\nd.broadcast(x, 0)\ndistributed.barrier()\ndist.gather_object(o, l)\n"
           "from torch.distributed import all_gather_object\nworld.all_reduce_sum(x)\n")
    assert sorted(_collective_calls(ast.parse(src))) == [
        (4, "all_reduce"), (5, "broadcast"), (6, "barrier"), (7, "gather_object"), (8, "all_gather_object")]


# The CPU fast paths (the host heap, the leading-rows backward, the CPU attention kernels) stay behind two seams: the
# policy forward (input gradients, attention) and the update backend (heap returns). The algorithm's rooms and the
# two training phases never reach for them.
CPU_MACHINERY = ("grail_exp.compute.host", "grail_exp.compute.leading_rows", "grail_exp.compute.attention")
ALGORITHM_ROOMS = ("grail_exp.advantages", "grail_exp.loss", "grail_exp.estimators", "grail_exp.training.update",
                   "grail_exp.training.rollout")


def test_the_algorithm_and_the_training_phases_import_no_cpu_machinery():
    graph = import_graph()
    offenders = [f"{m} imports {t}" for m, targets in sorted(graph.items())
                 if m.startswith(ALGORITHM_ROOMS) for t in sorted(targets) if t.startswith(CPU_MACHINERY)]
    assert not offenders, "CPU machinery imported by the algorithm or a training phase (ask the forward or the " \
                          "update backend instead):\n" + "\n".join(offenders)


# The `python -m` entry points: thin modules over the library, which nothing imports (their library lives elsewhere:
# evaluate.py over evaluation.py, report.py over reporting/, bench/ over its modes, preflight/ over its checks).
ENTRY_POINTS = ("grail_exp.run", "grail_exp.evaluate", "grail_exp.report", "grail_exp.tune", "grail_exp.plan",
                "grail_exp.weights", "grail_exp.extrapolate", "grail_exp.bench.__main__",
                "grail_exp.preflight.__main__")


def test_nothing_imports_an_entry_point():
    graph = import_graph()
    assert set(ENTRY_POINTS) <= set(graph), sorted(set(ENTRY_POINTS) - set(graph))
    offenders = [f"{m} imports {t}" for m, targets in sorted(graph.items()) for t in sorted(targets)
                 if t in ENTRY_POINTS and m != t]
    assert not offenders, "entry points imported as libraries (move what they share below them):\n" + \
                          "\n".join(offenders)


def test_the_package_root_holds_at_most_27_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 27, f"{len(root)} modules at grail_exp/'s root (group them by role): {root}"


def test_no_module_is_over_800_lines():
    """A file past 800 lines holds several rooms: split it by role (as report.py over reporting/)."""
    long = {str(f.relative_to(ROOT)): n for f in sorted(PKG.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > 800}
    assert not long, f"modules over 800 lines: {long}"


# A scheme's behaviour is asked of its class (``needs_model``, ``planned_update_transient``, ...), never decided by
# comparing its name: a new scheme is then one file, with no branch to add elsewhere (docs/add-a-method.md).
def scheme_name_tests(source: str, names: set[str]) -> list[str]:
    """The comparisons (``==``, ``!=``, ``in``, ``match`` cases) and ``startswith`` / ``endswith`` calls of ``source``
    that test a value against one of ``names``, whatever the value is called."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith"):
            parts = node.args
        elif isinstance(node, ast.MatchValue):
            parts = [node.value]
        else:
            continue
        # the operands themselves, or the items of a tuple / list / set operand (``in ("a", "b")``); not the
        # arguments of a call inside an operand (``L.get("delta") is None`` reads a key of that name)
        operands = [c for part in parts for c in (part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set))
                                                   else [part])]
        if any(isinstance(c, ast.Constant) and c.value in names for c in operands):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_scheme_name_is_compared_outside_the_file_that_registers_it():
    import inspect

    from grail_exp.advantages import SCHEMES

    home = {name: Path(inspect.getsourcefile(cls)).resolve() for name, cls in SCHEMES.items()}
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        names = {n for n, path in home.items() if path != f.resolve()}
        offenders += [f"{f.relative_to(ROOT)} {hit}" for hit in scheme_name_tests(f.read_text(), names)]
    assert not offenders, "scheme names compared outside their own file (ask the scheme class instead):\n" + \
                          "\n".join(offenders)


def test_the_scheme_name_scan_catches_the_old_branches():
    """The planner's and the bench's former branches are found; the same names outside a comparison are not."""
    names = {"grpo", "grail", "oar_g"}
    old = ('teacher = saved if str(cfg.advantage.get("name", "")) == "oar_g" else 0.0\n'
           'if scheme == "grail":\n    total += 1\nelif scheme in ("oar_g",):\n    total += 2\n'
           'names.sort(key=lambda n: n != "grpo")\n')
    assert len(scheme_name_tests(old, names)) == 4, scheme_name_tests(old, names)
    plain = ('SCHEMES = ("grpo", "grail")\nrun(["advantage=grail"], baseline="grpo")\nif x == "grpo_passk":\n    pass\n'
             'if cfg.get("grail") is None:\n    pass\n')
    assert scheme_name_tests(plain, names) == []


# Function length: physical lines from the `def` line to the function's last line (ast's lineno .. end_lineno), every
# method and nested function counted on its own. `python sweeps/function_lengths.py` lists them. The house's end
# state, reached: no function over 80 lines (the longest is 80) and 6 over 60. Ceilings that only go down.
LONGEST_FUNCTION_CEILING = 80
OVER_60_LINES_CEILING = 6


def _function_lengths(source: str) -> list[tuple[int, int, str]]:
    """(lines, def line, name) of every function in ``source``."""
    return [
        (node.end_lineno - node.lineno + 1, node.lineno, node.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _package_function_lengths() -> list[tuple[int, str, str]]:
    return sorted(
        ((n, f"{f.relative_to(ROOT)}:{line}", name) for f in PKG.rglob("*.py")
         for n, line, name in _function_lengths(f.read_text())),
        reverse=True,
    )  # fmt: skip


def test_the_function_length_scan_counts_every_line_of_nested_functions_and_methods():
    body = "\n".join(f"            x{i} = {i}" for i in range(80))
    src = f"class A:\n    @property\n    def m(self):\n        def inner():\n{body}\n        return 1\n\n\ndef f():\n    pass\n"
    # inner (line 4): its def line and 80 body lines = 81; m (line 3, decorator not counted): its def line, inner's 81
    # and its return = 83; f on line 3 + 83 + 2 blank lines = 88: 2 lines
    assert sorted(_function_lengths(src)) == [(2, 88, "f"), (81, 4, "inner"), (83, 3, "m")]


def test_no_function_is_over_the_length_ceiling_which_the_end_state_lowers_to_80_lines():
    lengths = _package_function_lengths()
    longest = [r for r in lengths if r[0] > LONGEST_FUNCTION_CEILING]
    assert not longest, f"functions over {LONGEST_FUNCTION_CEILING} lines (split them): {longest}"
    over_60 = [r for r in lengths if r[0] > 60]
    assert len(over_60) <= OVER_60_LINES_CEILING, (
        f"{len(over_60)} functions over 60 lines, more than the {OVER_60_LINES_CEILING} of the ceiling: {over_60}"
    )


def test_the_function_length_script_measures_as_this_file_does():
    """sweeps/function_lengths.py (the table for people) and the scan above (the ceiling) count the same lines."""
    spec = importlib.util.spec_from_file_location("function_lengths", ROOT / "sweeps" / "function_lengths.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    by_script = sorted((n, where) for n, where, _ in script.measure([PKG]))
    assert by_script == sorted((n, where) for n, where, _ in _package_function_lengths())
