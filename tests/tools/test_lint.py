"""`specstate lint` finds counter writes in adapter code and names file, line and column."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specstate.tools.cli import main as cli_main
from specstate.tools.lint import scan_paths, scan_source

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


def test_cli_exits_1_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specstate lint` prints file:line:col rows and exits 1 on an adapter with a violation."""
    (tmp_path / "adapter.py").write_text(ADAPTER)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["lint", "."]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "adapter.py:3:9: augassign kv_committed_len in MyWorker.forward (not an owner scope)"
    )
    assert len(out) == 7


def _first_path(out: str) -> str:
    return out.splitlines()[0].split(":")[0]


def test_paths_are_shown_as_the_user_opens_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the working directory a path is relative to it (not to the scanned folder);
    outside it, absolute; either way the row's file:line:col opens at the write."""
    pkg = tmp_path / "project" / "src" / "adapters"
    pkg.mkdir(parents=True)
    (pkg / "adapter.py").write_text(ADAPTER)
    monkeypatch.chdir(tmp_path / "project")
    assert cli_main(["lint", "src/adapters"]) == 1
    assert _first_path(capsys.readouterr().out) == "src/adapters/adapter.py"
    assert cli_main(["lint", str(pkg)]) == 1  # an absolute argument under the cwd: relative
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("src/adapters/adapter.py:3:9: ")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli_main(["lint", "../project/src/adapters"]) == 1
    shown = _first_path(capsys.readouterr().out)
    assert shown == str(pkg / "adapter.py")
    for row in rows:  # every row points at the written attribute's statement
        file, line, col = row.split(":")[:3]
        text = (tmp_path / "project" / file).read_text().splitlines()[int(line) - 1]
        assert text[int(col) - 1 :].startswith(("req.", "batch.", "ledger."))


def test_allow_takes_the_shown_path_or_the_path_in_the_scanned_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--allow 'path::scope' matches the path as shown and the path under the scanned folder."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "adapter.py").write_text(ADAPTER)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["lint", "pkg", "--allow", "pkg/adapter.py::MyWorker.*"]) == 0
    assert cli_main(["lint", "pkg", "--allow", "adapter.py::MyWorker.*"]) == 0
    assert cli_main(["lint", "pkg", "--allow", "other.py::MyWorker.*"]) == 1


def test_the_allowlist_key_does_not_depend_on_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scan_paths` keys sites by the path under the scanned folder, from any cwd."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "adapter.py").write_text(ADAPTER)
    monkeypatch.chdir(tmp_path)
    here = scan_paths([Path("pkg")])
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    there = scan_paths([tmp_path / "pkg"])
    assert {s.path for s in here} == {s.path for s in there} == {"adapter.py"}
    assert {s.file for s in here} == {"pkg/adapter.py"}
    assert {s.file for s in there} == {str(tmp_path / "pkg" / "adapter.py")}


NOT_REQUESTS = textwrap.dedent(
    """\
    class Detokenizer:
        def handle(self, recv_obj, tok_result, out, req_output):
            tok_result.output_ids.append(1)
            out.output_ids = [1, 2]
            self.output_ids = []
            req_output.output_ids.append(3)
            recv_obj.output_ids[0] = 4
            for item in recv_obj.outputs:
                item.output_ids.extend([5])

    def decode(result: "TokenizerOutput", r):
        result.output_ids.append(1)
        r.output_ids.append(2)

    class Req:
        @staticmethod
        def helper(item):
            item.output_ids.append(1)
    """
)

REQUESTS = textwrap.dedent(
    """\
    from typing import Optional

    class MyWorker:
        def forward(self, batch, req, new_req):
            req.output_ids.append(1)
            new_req.output_ids[0] = 2
            self.cur_req.output_ids.extend([3])
            batch.reqs[0].output_ids.append(4)
            for r in batch.reqs:
                r.output_ids.append(5)
            for i, r2 in enumerate(self.running_reqs):
                r2.output_ids = [6]
            for r3, t in zip(batch.requests, range(3)):
                r3.output_ids.append(t)
            [q.output_ids.append(7) for q in batch.reqs]
            first = batch.reqs[0]
            first.output_ids.append(8)

    def typed(a: "Req | None", b: Optional[ScheduleReq], c: list[Req], d: GenerationRequest):
        a.output_ids.append(1)
        b.output_ids.append(2)
        c[0].output_ids.append(3)
        d.output_ids.append(4)
        e: Req = make()
        e.output_ids.append(5)

    class Req:
        def __init__(self):
            self.output_ids = []
    """
)


def test_output_ids_is_a_site_only_on_a_request() -> None:
    """`output_ids` of a tokenizer result, a detokenizer or any non-request is not a site;
    a request's is, whether known by name, annotation, collection or class."""
    assert scan_source(NOT_REQUESTS, "detok.py") == []
    sites = scan_source(REQUESTS, "worker.py")
    lines = [s.line for s in sites]
    assert lines == [5, 6, 7, 8, 10, 12, 14, 15, 17, 20, 21, 22, 23, 25, 29]
    assert all("output_ids" in s.kind for s in sites)


def test_allow_scopes_and_clean_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An allowed scope silences its sites; clean code exits 0 with one line saying how many
    files were clean; a missing path exits 2."""
    (tmp_path / "adapter.py").write_text(ADAPTER)
    (tmp_path / "other.py").write_text("x = 1\n")
    assert cli_main(["lint", str(tmp_path), "--allow", "MyWorker.*"]) == 0
    assert capsys.readouterr().out == "2 files clean\n"
    (tmp_path / "adapter.py").write_text("def f(req):\n    return req.kv_committed_len\n")
    assert cli_main(["lint", str(tmp_path / "adapter.py")]) == 0
    assert capsys.readouterr().out == "1 file clean\n"
    assert cli_main(["lint", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().out == ""


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    """`python -m specstate.lint` behaves like the subcommand."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(r):\n    r.kv_allocated_len += 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "specstate.lint", "src"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert proc.stdout.startswith("src/a.py:2:5: augassign kv_allocated_len in f")


def test_an_unparsable_file_is_reported_and_the_rest_still_scanned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A syntax error is one line on stderr, exit 2; violations elsewhere are still listed."""
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "adapter.py").write_text("def f(req):\n    req.kv_committed_len = 3\n")
    assert cli_main(["lint", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert f"{tmp_path}/adapter.py:2:5:" in out
    assert f"{tmp_path}/broken.py:1:7: cannot parse (SyntaxError" in err
    assert "Traceback" not in err
