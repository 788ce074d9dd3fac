"""The documentation: README.md (the front door) and the MkDocs site under docs/.

Nothing may be lost when the README's sections move into the site, and links must not rot:
- every section heading the README had before the split (tests/data/readme_sections.txt) is still a heading in
  README.md or docs/**/*.md, with its text unchanged (or renamed on purpose, recorded there as "old => new");
- every relative link in README.md and docs/ points to a file or folder that exists, and so does every link of the
  README once mkdocs_hooks.py has made it the site's home page;
- every page under docs/ is in mkdocs.yml's nav, and the site builds with warnings as errors (`make docs`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SECTIONS = Path(__file__).with_name("data") / "readme_sections.txt"

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target), with an optional "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of the Markdown outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def headings(text: str) -> list[str]:
    return [m.group(2) for _, line in prose_lines(text) if (m := HEADING.match(line))]


def relative_links(text: str):
    """(line number, target) of every link that is not external and not a bare #anchor; code spans ignored."""
    for number, line in prose_lines(text):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if EXTERNAL.match(target) or target.startswith("#"):
                continue
            yield number, target


def broken_links(text: str, base: Path, name: str) -> list[str]:
    broken = []
    for number, target in relative_links(text):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (base / path).exists():
            broken.append(f"{name}:{number}: {target}")
    return broken


def former_sections() -> list[tuple[str, str]]:
    """(former heading, the heading it must be found as) for each line of readme_sections.txt."""
    pairs = []
    for line in SECTIONS.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        old, _, new = line.partition(" => ")
        pairs.append((old, new or old))
    return pairs


def test_the_parsers_see_headings_and_links_but_not_code():
    text = "# Top\n\n```bash\n# a shell comment\n[x](nowhere.md)\n```\n## `a=b` — c\nSee [p](p.md#s) and `[q](q.md)`.\n"
    assert headings(text) == ["Top", "`a=b` — c"]
    assert list(relative_links(text)) == [(8, "p.md#s")]
    assert list(relative_links("[a](https://x.org) [b](#here) ![c](img/c.png)")) == [(1, "img/c.png")]


def test_every_former_readme_section_is_still_a_heading():
    pairs = former_sections()
    assert len(pairs) == 47  # the README's 47 section headings at the split
    found = set()
    for path in markdown_files():
        found.update(headings(path.read_text(encoding="utf-8")))
    missing = [f"{old!r}" + (f" (renamed {new!r})" if new != old else "") for old, new in pairs if new not in found]
    assert not missing, "former README sections that are no heading in README.md or docs/: " + ", ".join(missing)


def test_relative_links_resolve():
    broken = []
    for path in markdown_files():
        broken += broken_links(path.read_text(encoding="utf-8"), path.parent, str(path.relative_to(ROOT)))
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*\w\.md\b")  # a repository path such as docs/notes/shapes.md


def test_docs_paths_named_in_code_comments_and_files_exist():
    """A page that moves must take every mention along: code comments, tests, scripts, configs, results."""
    sources = [ROOT / "Makefile", ROOT / ".ci" / "run", ROOT / "pyproject.toml", ROOT / "mkdocs.yml", *markdown_files()]
    for folder, pattern in (("grail_exp", "*.py"), ("tests", "*.py"), ("sweeps", "*"), ("conf", "*.yaml"),
                            ("hydra_plugins", "*.py"), ("results", "*.md")):
        sources += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    missing = []
    for path in sources:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            missing += [f"{path.relative_to(ROOT)}:{number}: {m}" for m in DOC_PATH.findall(line)
                        if not (ROOT / m).is_file()]
    assert not missing, "documentation paths that do not exist:\n" + "\n".join(missing)


def test_readme_links_resolve_on_the_site_home_page():
    sys.path.insert(0, str(ROOT))
    try:
        from mkdocs_hooks import readme_as_home
    finally:
        sys.path.remove(str(ROOT))
    home = readme_as_home(README.read_text(encoding="utf-8"))
    assert "](docs/" not in home
    targets = [t for _, t in relative_links(home)]
    assert "schemes.md" in targets and "developer.md" in targets
    broken = broken_links(home, DOCS, "README.md as docs/index.md")
    assert not broken, "README links that break on the site's home page:\n" + "\n".join(broken)


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail into a docs/ page"
    for section in ("Two commands", "Results", "A tour of the config groups", "Documentation"):
        assert section in headings("\n".join(lines)), section


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return [p for item in node for p in _nav_pages(item)]


class _ConfigLoader(yaml.SafeLoader):
    """mkdocs.yml without running its !!python tags (the slugify function): only the nav is read here."""


_ConfigLoader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def test_every_page_is_in_the_nav_once():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_ConfigLoader)
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, (
        f"in docs/ but not in the nav: {sorted(set(pages) - set(nav))}; in the nav but not in docs/: "
        f"{sorted(set(nav) - set(pages))}; listed twice: {sorted({p for p in nav if nav.count(p) > 1})}"
    )


@pytest.mark.e2e
def test_site_builds_with_warnings_as_errors(tmp_path):
    """What `make docs` runs: broken links or anchors, and pages left out of the nav, fail the build.

    Not `-q`: mkdocs --quiet drops warnings before --strict counts them, and a broken link would pass."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Two commands" in home and 'href="schemes.html"' in home  # README.md is the home page, links rewritten
    for page in ("objective", "schemes", "grpo-family", "evaluation", "recipes", "scaling", "sweeps", "reliability",
                 "performance", "results", "developer"):
        assert (tmp_path / "site" / f"{page}.html").is_file(), page


def _name_map_tables() -> tuple[dict[str, str], set[tuple[str, str, str]]]:
    """docs/developer.md's "Config name → file": ({key: default file with ``<x>``}, {(key, name, file)} exceptions)."""
    text = (DOCS / "developer.md").read_text(encoding="utf-8")
    section = text.split("## Config name → file", 1)[1].split("\n## ", 1)[0]
    defaults, exceptions = {}, set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`") and cells[1].startswith("`grail_exp/"):
            defaults[cells[0].strip("`")] = cells[1].strip("`")
        if len(cells) == 3 and cells[0].startswith("`") and cells[2].startswith("`grail_exp/"):
            for name in cells[1].split(","):
                exceptions.add((cells[0].strip("`"), name.strip().strip("`"), cells[2].strip("`")))
    return defaults, exceptions


def name_map_exceptions(defaults: dict[str, str], registered: set[tuple[str, str, str]]) -> set[tuple[str, str, str]]:
    """The (key, name, file) of ``registered`` whose file is not the key's default with ``<x>`` = the name."""
    return {(key, name, path) for key, name, path in registered if defaults.get(key, "").replace("<x>", name) != path}


def test_the_name_map_rule_needs_rows_for_exceptions_only():
    """The rule's own arithmetic, on names made up here: a name in its own file needs no row, one sharing a file
    does, and a key without a default needs a row for every name."""
    defaults = {"advantage=": "grail_exp/advantages/<x>.py", "loss.kl_estimator=": "grail_exp/loss/kl.py"}
    registered = {("advantage=", "foo", "grail_exp/advantages/foo.py"), ("advantage=", "foo_b", "grail_exp/advantages/foo.py"),
                  ("loss.kl_estimator=", "k9", "grail_exp/loss/kl.py"), ("trainer.strategy=", "x", "grail_exp/x.py")}
    assert name_map_exceptions(defaults, registered) == {("advantage=", "foo_b", "grail_exp/advantages/foo.py"),
                                                        ("trainer.strategy=", "x", "grail_exp/x.py")}


def test_the_config_name_map_lists_every_exception_to_its_rule():
    """docs/developer.md's "Config name → file" equals the registries: its defaults table names one rule per registry
    (``<x>`` = the name), and its exceptions table lists exactly the names whose defining file (the source file of the
    registered class or function) breaks that rule, so the map cannot rot and a name in its own file needs no row."""
    import inspect

    import grail_exp.estimators  # noqa: F401  (registers)
    import grail_exp.loss  # noqa: F401
    import grail_exp.training.backends  # noqa: F401
    from grail_exp.advantages import SCHEMES
    from grail_exp.estimators.base import ESTIMATORS
    from grail_exp.loss.aggregation import AGGREGATIONS
    from grail_exp.loss.kl import KL_ESTIMATORS
    from grail_exp.loss.policy import POLICY_LOSSES
    from grail_exp.loss.terms import LOSS_TERMS
    from grail_exp.training.backends.base import BACKENDS

    registries = {"advantage=": SCHEMES, "estimator=": {k: v.fn for k, v in ESTIMATORS.items()},
                  "loss.policy_loss=": POLICY_LOSSES, "loss.loss_type=": AGGREGATIONS,
                  "loss.kl_estimator=": KL_ESTIMATORS, "loss.terms:": LOSS_TERMS, "trainer.strategy=": BACKENDS}
    registered = set()
    for key, reg in registries.items():
        for name, obj in reg.items():
            path = Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT).as_posix()
            registered.add((key, name, path))
    defaults, have = _name_map_tables()
    assert set(defaults) == set(registries), f"defaults table keys {sorted(defaults)} != {sorted(registries)}"
    want = name_map_exceptions(defaults, registered)
    assert have == want, f"missing: {sorted(want - have)}; stale or covered by the rule: {sorted(have - want)}"


def _readme_code_table() -> list[tuple[str, list[str], list[str]]]:
    """(row, files, names) of the README's "Where the math lives" table: its file column's backticked paths (braces
    expanded) and its function column's backticked names (``Class.method`` or a plain name)."""
    text = README.read_text().split("## Where the math lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("what", "---"):
            continue
        files = []
        for path in re.findall(r"`([^`]+)`", cells[1]):
            if not path.endswith((".py", "/")):  # a name in the prose of the cell (each backend's `planned_*`)
                continue
            path = path.replace("<name>.py", "")  # one file per registered name: the folder holds them
            if not path.startswith("grail_exp/"):
                path = "grail_exp/" + path
            m = re.match(r"(.*)\{([^}]*)\}(.*)", path)
            files += [m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [path]
        names = [n for n in re.findall(r"`([^`]+)`", cells[2]) if re.fullmatch(r"[A-Za-z_][\w.]*", n)]
        rows.append((cells[0], files, names))
    return rows


def test_every_file_and_function_the_readmes_code_table_names_exists():
    rows = _readme_code_table()
    assert len(rows) >= 15
    missing = []
    for what, files, names in rows:
        paths = [ROOT / f for f in files]
        missing += [f"{what}: {f}" for f, p in zip(files, paths) if not p.exists()]
        sources = "\n".join(p.read_text() for p in paths if p.is_file()) + "\n".join(
            q.read_text() for p in paths if p.is_dir() for q in p.glob("*.py"))
        for name in names:
            parts = name.split(".")
            if not re.search(rf"^\s*(def|class)\s+{re.escape(parts[-1])}\b", sources, re.M):
                missing.append(f"{what}: {name} is defined in none of {files}")
            elif len(parts) == 2 and not re.search(rf"^class\s+{re.escape(parts[0])}\b", sources, re.M):
                missing.append(f"{what}: class {parts[0]} is defined in none of {files}")
    assert not missing, "README's code table names what is not there:\n" + "\n".join(missing)
