"""Records that travel: paths written into files that get committed (study arms, benchmark JSON and Markdown, report
pages, logs copied into ``results/``) name places relative to the project, never an absolute path of the machine that
wrote them.

    portable_path("/home/me/grail_exp/outputs/run", root="/home/me/grail_exp")  -> "outputs/run"
    portable_text("json=/tmp/bench/a.json from sqlite:////home/me/grail_exp/results/mlflow.db", root=...)
        -> "json=<tmp>/bench/a.json from sqlite:///results/mlflow.db"
    python -m grail_exp.analysis.portable [--root DIR] < log > results/gpu/x.log      # a filter for shell pipelines

A path inside the project (``root``, default the current directory) becomes relative to it (the root itself ``.``);
an SQLite URI to a file inside it stays an SQLite URI with a relative path (``sqlite:///results/mlflow.db``, which
MLflow resolves against the working directory). A path elsewhere keeps its tail but names its machine-specific head
by what it is: ``<home>`` (``/root``, ``/home/<user>``, ``/Users/<user>``, ``C:\\Users\\<user>``), ``<tmp>``
(``/tmp``, ``/var/tmp``), ``<site-packages>`` (an installed package's directory) and ``<work>`` (``/work``, the
shared working directory of this project's machines).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# The machine-specific heads, first match wins (more specific before more general). Each must start where a path
# starts: not after a word character, a dot or another path character, so relative paths such as outputs/tmp/x and
# URLs such as https://host/home/x are left alone.
_START = r"(?<![\w.~<>-])"
_END = r"(?![\w-])"
HEADS: list[tuple[re.Pattern, str]] = [
    (re.compile(_START + r"/[^\s'\"`:;,()\[\]{}]*?/(?:site|dist)-packages" + _END), "<site-packages>"),
    (re.compile(_START + r"/tmp/site" + _END), "<site-packages>"),  # the GPU machines install packages there
    (re.compile(_START + r"/(?:var/)?tmp" + _END), "<tmp>"),
    (re.compile(_START + r"/(?:root|home/[^/\s'\"`]+|Users/[^/\s'\"`]+)" + _END), "<home>"),
    (re.compile(r"(?<![\w\\])[A-Za-z]:\\{1,2}Users\\{1,2}[^\\\s'\"`]+"), "<home>"),
    (re.compile(_START + r"/work" + _END), "<work>"),
]


def code_root() -> Path:
    """The checkout (or installation) the running code comes from: the folder that holds ``grail_exp/``."""
    return Path(__file__).resolve().parents[2]  # grail_exp/analysis/portable.py


def resolve_recorded(path: str) -> str:
    """A path as a record names it, back to one this machine can open: an absolute path or one that exists from the
    working directory as it is, else a relative path under :func:`code_root` when it exists there (a record written
    relative to the project read from another working directory); anything else unchanged (a hub id, a placeholder)."""
    p = Path(path)
    if p.is_absolute() or p.exists() or not (code_root() / p).exists():
        return path
    return str(code_root() / p)


def _roots(root: str | os.PathLike | None, extra: tuple = ()) -> list[str]:
    """The project root (and any other checkouts of it), as absolute strings without a trailing slash, longest first
    so that a nested root wins."""
    out = {str(Path(r).expanduser().resolve()) for r in ([root or os.getcwd()] + list(extra))}
    return sorted(out, key=len, reverse=True)


def portable_path(path: str | os.PathLike, root: str | os.PathLike | None = None) -> str:
    """``path`` relative to ``root`` (the project) when inside it, else with its machine-specific head named
    (module docstring). A relative path is returned as it is."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        return p.as_posix()
    p = p.resolve()
    for r in _roots(root):
        if p == Path(r) or p.is_relative_to(r):
            rel = p.relative_to(r).as_posix()
            return rel if rel else "."
    return portable_text(p.as_posix(), root)


def portable_text(text: str, root: str | os.PathLike | None = None, other_roots: tuple = ()) -> str:
    """Every absolute path in ``text`` made portable (module docstring): paths inside ``root`` or ``other_roots``
    (other checkouts of the project, e.g. worktrees) relative to it, SQLite URIs to files inside it relative, every
    other absolute path's machine-specific head named (``<home>``, ``<tmp>``, ``<site-packages>``, ``<work>``)."""
    for r in _roots(root, other_roots):
        if r == "/":
            continue
        esc = re.escape(r)
        text = re.sub(r"sqlite:///" + esc + "/", "sqlite:///", text)
        text = re.sub(_START + esc + r"/", "", text)
        text = re.sub(_START + esc + _END, ".", text)
    for pattern, name in HEADS:
        text = pattern.sub(name, text)
    return text


def main(argv: list[str] | None = None) -> None:
    """A filter: stdin to stdout with every line made portable (``--root`` the project, default the current
    directory; ``--also`` other checkouts of it)."""
    parser = argparse.ArgumentParser(prog="python -m grail_exp.analysis.portable", description=main.__doc__)
    parser.add_argument("--root", default=None)
    parser.add_argument("--also", action="append", default=[])
    args = parser.parse_args(argv)
    for line in sys.stdin:
        sys.stdout.write(portable_text(line, args.root, tuple(args.also)))
        sys.stdout.flush()  # a live log stays live through the filter


if __name__ == "__main__":
    main()
