"""Docs are part of the product: every Python block in README.md and docs/*.md runs as written.

Each block runs on its own, in a fresh namespace and an empty working directory (so no block
leans on a file lying around), with nothing but the installed package. Links inside the docs
point at files that exist.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#:]+)(?:#[^)]*)?\)")


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for i, code in enumerate(BLOCK.findall(page.read_text(encoding="utf-8"))):
            found.append((f"{page.relative_to(ROOT)}#{i}", code))
    return found


@pytest.mark.parametrize(("where", "code"), _blocks(), ids=[w for w, _ in _blocks()])
def test_every_python_block_runs(where: str, code: str, tmp_path: Path) -> None:
    """The block runs without error in an empty directory."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_point_at_files(page: Path) -> None:
    """Every relative link of a page names a file of the project."""
    missing = [
        target
        for target in LINK.findall(page.read_text(encoding="utf-8"))
        if not (page.parent / target).exists()
    ]
    assert missing == []


def test_every_page_is_in_the_site_navigation() -> None:
    """mkdocs.yml lists every docs page (a page left out is built but unreachable)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages - listed == set()
    assert listed - pages == set()
