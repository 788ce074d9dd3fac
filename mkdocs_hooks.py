r"""MkDocs hooks (mkdocs.yml `hooks:`): the pages render on the site as they do when the repository is browsed as files.

- The site's home page is README.md, so the front door is written once. README.md links into the site as
  `docs/<page>.md`; on the site those pages sit beside the home page, so the `docs/` prefix is dropped. The strict
  build then checks the README's links and anchors like any page's.
- A table cell writes a literal pipe as `\|`, also inside a code span (`a=x\|y`): that is how GitHub-flavoured
  Markdown reads it, while Python-Markdown keeps the backslash inside code. The backslash is dropped in table cells.
"""

from __future__ import annotations

import re
from pathlib import Path

HOME = "index.md"
CELL = re.compile(r"<t([dh])\b[^>]*>.*?</t\1>", re.S)


def readme_as_home(readme_text: str) -> str:
    """README.md's Markdown with its links into docs/ made relative to docs/ (where the home page lives)."""
    return re.sub(r"\]\(docs/", "](", readme_text)


def unescape_table_pipes(html: str) -> str:
    r"""`\|` -> `|` inside <td>/<th> cells (GitHub's rule for pipes in table cells, code spans included)."""
    return CELL.sub(lambda m: m.group(0).replace("\\|", "|"), html)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != HOME:
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return readme_as_home(readme.read_text(encoding="utf-8"))


def on_page_content(html: str, page, config, files) -> str:
    return unescape_table_pipes(html)
