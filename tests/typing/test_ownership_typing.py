"""mypy --strict rejects every ownership violation in the snippets and accepts the legal calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mypy import api as mypy_api

SNIPPETS = Path(__file__).parent / "snippets"
ROOT = Path(__file__).parents[2]
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")
_MARK = re.compile(r"#\s*E:\s*(?P<code>[a-z-]+)")


def _expected(path: Path) -> set[tuple[int, str]]:
    lines = path.read_text().splitlines()
    return {(i, m["code"]) for i, text in enumerate(lines, start=1) if (m := _MARK.search(text))}


@pytest.fixture(scope="module")
def mypy_errors() -> dict[str, set[tuple[int, str]]]:
    """One mypy --strict run over every snippet: errors by file name."""
    files = sorted(str(p) for p in SNIPPETS.glob("*.py"))
    stdout, stderr, _ = mypy_api.run(
        ["--strict", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental", *files]
    )
    assert "error: " not in stderr, stderr
    found: dict[str, set[tuple[int, str]]] = {Path(f).name: set() for f in files}
    for row in stdout.splitlines():
        if m := _ERROR.match(row):
            found[Path(m["file"]).name].add((int(m["line"]), m["code"]))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("snippet", sorted(p.name for p in SNIPPETS.glob("*.py")))
def test_mypy_reports_exactly_the_marked_lines(
    mypy_errors: dict[str, set[tuple[int, str]]], snippet: str
) -> None:
    """Each `# E: code` line fails with that code, and no other line fails."""
    expected = _expected(SNIPPETS / snippet)
    if snippet.startswith("fail_"):
        assert expected, f"{snippet} marks no expected error"
    else:
        assert not expected
    assert mypy_errors[snippet] == expected
