"""`specstate lint` finds counter writes in adapter code and names file and line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specstate.tools.cli import main as cli_main
from specstate.tools.lint import scan_source

ADAPTER = textwrap.dedent(
    """\
    class MyWorker:
        def forward(self, batch, req, ledger, slots, n):
            req.kv_committed_len += 3
            req.kv.kv_allocated_len = batch.nxt
            req.kv_committed_len = 0
            req.output_ids.append(7)
            req.output_ids[0] = 1
            batch.decode_batch_idx += 1
            ledger.advance_committed(slots, n)
            ledger._kv_committed.index_copy_(0, slots, n)
            x = req.kv_committed_len + 1
            return x
    """
)


def test_scan_finds_each_kind_of_write() -> None:
    """Assignments, list and in-place mutation and owner calls are sites; reads, resets not."""
    sites = scan_source(ADAPTER, "adapter.py")
    got = [(s.line, s.kind) for s in sites]
    assert got == [
        (3, "augassign kv_committed_len"),
        (4, "assign kv_allocated_len"),
        (6, "mutate output_ids.append"),
        (7, "assign output_ids"),
        (8, "augassign decode_batch_idx"),
        (9, "call advance_committed"),
        (10, "mutate _kv_committed.index_copy_"),
    ]
    assert {s.scope for s in sites} == {"MyWorker.forward"}


def test_cli_exits_1_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`specstate lint` prints file:line rows and exits 1 on an adapter with a violation."""
    (tmp_path / "adapter.py").write_text(ADAPTER)
    assert cli_main(["lint", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0]
        == "adapter.py:3: augassign kv_committed_len in MyWorker.forward (not an owner scope)"
    )
    assert len(out) == 7


def test_allow_scopes_and_clean_code(tmp_path: Path) -> None:
    """An allowed scope silences its sites; clean code exits 0; a missing path exits 2."""
    (tmp_path / "adapter.py").write_text(ADAPTER)
    assert cli_main(["lint", str(tmp_path), "--allow", "MyWorker.*"]) == 0
    (tmp_path / "adapter.py").write_text("def f(req):\n    return req.kv_committed_len\n")
    assert cli_main(["lint", str(tmp_path / "adapter.py")]) == 0
    assert cli_main(["lint", str(tmp_path / "missing")]) == 2


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    """`python -m specstate.lint` behaves like the subcommand."""
    (tmp_path / "a.py").write_text("def f(r):\n    r.kv_allocated_len += 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "specstate.lint", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout.startswith("a.py:2: augassign kv_allocated_len in f")


def test_an_unparsable_file_is_reported_and_the_rest_still_scanned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A syntax error is one line on stderr, exit 2; violations elsewhere are still listed."""
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "adapter.py").write_text("def f(req):\n    req.kv_committed_len = 3\n")
    assert cli_main(["lint", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "adapter.py:2:" in out
    assert "broken.py:1: cannot parse (SyntaxError" in err and "Traceback" not in err
