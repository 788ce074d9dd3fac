"""MkDocs hook (mkdocs.yml `hooks:`): the site's home page is README.md, so the front door is written once.

README.md links into the site as `docs/<page>.md`, which works when the repository is browsed as files; on the site
those pages sit beside the home page, so the `docs/` prefix is dropped. The strict build then checks the README's
links and anchors like any page's.
"""

from __future__ import annotations

import re
from pathlib import Path

HOME = "index.md"


def readme_as_home(readme_text: str) -> str:
    """README.md's Markdown with its links into docs/ made relative to docs/ (where the home page lives)."""
    return re.sub(r"\]\(docs/", "](", readme_text)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != HOME:
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return readme_as_home(readme.read_text(encoding="utf-8"))
