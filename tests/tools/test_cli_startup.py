"""`specstate --version` and `--help` are instant: the command imports only what it runs.

Each check runs in a fresh interpreter (the test process has torch loaded already) and reports
which modules the command left in ``sys.modules``. These rely on ``import specstate`` itself
being light (its names are imported lazily); without that, the torch checks fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import specstate

SUBCOMMAND_MODULES = {
    f"specstate.tools.{m}" for m in ("demo", "lint", "generate", "serve", "bench", "trace")
}

PROBE = textwrap.dedent(
    """\
    import contextlib, io, json, sys
    from specstate.tools.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(sys.argv[1:])
        except SystemExit as exc:
            code = exc.code
    heavy = ("torch", "numpy", "tqdm", "safetensors")
    print(json.dumps({
        "code": code,
        "out": out.getvalue(),
        "heavy": sorted(m for m in heavy if m in sys.modules),
        "loaded": sorted(m for m in sys.modules if m.startswith("specstate.tools.")),
    }))
    """
)


def _probe(*argv: str, cwd: Path | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    )
    found: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return found


def test_version_imports_no_subcommand_and_no_torch() -> None:
    """--version prints the package version with no subcommand module and no torch loaded."""
    got = _probe("--version")
    assert got["code"] == 0 and got["out"] == f"specstate {specstate.__version__}\n"
    assert got["loaded"] == ["specstate.tools.cli"]
    assert got["heavy"] == []


def test_help_imports_only_the_named_command(tmp_path: Path) -> None:
    """`specstate --help` loads no subcommand; `lint` and `generate --help` load their own
    module only, and none of them torch."""
    top = _probe("--help")
    assert top["code"] == 0 and "generate" in str(top["out"]) and top["heavy"] == []
    assert top["loaded"] == ["specstate.tools.cli"]
    for argv in (["generate", "--help"], ["demo", "--help"]):
        got = _probe(*argv)
        assert got["code"] == 0 and "--threads" in str(got["out"])
        assert got["heavy"] == []
        loaded = set(got["loaded"])
        assert loaded & SUBCOMMAND_MODULES == {f"specstate.tools.{argv[0]}"}
    (tmp_path / "a.py").write_text("def f(req):\n    req.kv_committed_len += 1\n")
    linted = _probe("lint", "a.py", cwd=tmp_path)
    assert linted["code"] == 1 and str(linted["out"]).startswith("a.py:2:5: augassign")
    assert linted["heavy"] == [] and linted["loaded"] == [
        "specstate.tools.cli",
        "specstate.tools.lint",
    ]
