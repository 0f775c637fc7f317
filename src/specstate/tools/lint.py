"""The ownership linter: finds every write to a tracked scheduling counter in Python source.

It owns no state; it reads ASTs. A *site* is one of:

* an assignment or augmented assignment whose target is an attribute (or a subscript of an
  attribute) named like a tracked counter, whatever the receiver (``req.kv.kv_committed_len += n``
  counts) — except an assignment of the literal ``0``, which is a reset;
* a call of a list mutator (``append``, ``extend``, ``insert``, ...) or a torch in-place method
  (any name ending in ``_``, such as ``index_copy_``) on such an attribute;
* a call of an owner mutator by name (``advance_committed``, ``grow_allocated``, ...).

Each site is keyed by (path, scope, kind) where scope is the dotted chain of enclosing classes
and functions. Adapter code owns none of these counters, so on an engine's adapter every site
is a violation; the project itself compares its sites with an exact-count allowlist
(tests/tools/test_lint_self.py), so a new writer anywhere fails CI until it is reviewed.

Usage: ``specstate lint PATH...`` or ``python -m specstate.lint PATH...``; exit 1 with
``file:line: message`` rows when any site is found outside ``--allow`` scopes.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import attrs

__all__ = ["LintSite", "main", "scan_paths", "scan_source", "site_counts"]

TRACKED_COUNTERS: Final[frozenset[str]] = frozenset(
    {
        "kv_committed_len",
        "kv_allocated_len",
        "cache_protected_len",
        "decode_batch_idx",
        "extend_batch_idx",
        "spec_verify_ct",
        "output_ids",
        # The ledger's and Req's private stores of the same counters.
        "_kv_committed",
        "_kv_allocated",
        "_cache_protected",
        "_output_ids",
        # Their host (NumPy) views, and the output table's columns.
        "_kv_committed_host",
        "_kv_allocated_host",
        "_cache_protected_host",
        "_output_tokens",
        "_output_tokens_flat",
        "_output_lengths",
    }
)
"""Attribute names whose writes are sites."""

OWNER_MUTATORS: Final[frozenset[str]] = frozenset(
    {
        "advance_committed",
        "commit_extend",
        "grow_allocated",
        "set_protected",
        "open_slot",
        "close_slot",
        "close_slots",
        "append_outputs",
        "append_runs",
        "open_row",
    }
)
"""Owner methods whose every call is a site (they write tracked counters)."""

_LIST_MUTATORS: Final[frozenset[str]] = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
)


@attrs.frozen(kw_only=True)
class LintSite:
    """One write to a tracked counter: where, in which scope, and what kind."""

    path: str
    line: int
    scope: str
    kind: str

    def render(self) -> str:
        """``file:line: message`` for terminals and editors."""
        return f"{self.path}:{self.line}: {self.kind} in {self.scope} (not an owner scope)"


def _attr_name(node: ast.expr) -> str | None:
    """The tracked attribute a target writes, looking through subscripts."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in TRACKED_COUNTERS:
        return node.attr
    return None


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


class _Visitor(ast.NodeVisitor):
    """Collects sites with their enclosing scope."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.sites: list[LintSite] = []

    def _add(self, node: ast.AST, kind: str) -> None:
        scope = ".".join(self.scope) or "<module>"
        line = getattr(node, "lineno", 0)
        self.sites.append(LintSite(path=self.path, line=line, scope=scope, kind=kind))

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = _scoped
    visit_FunctionDef = _scoped
    visit_AsyncFunctionDef = _scoped

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                name = _attr_name(elt)
                if name is not None and not _is_zero(node.value):
                    self._add(node, f"assign {name}")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        name = _attr_name(node.target)
        if name is not None:
            self._add(node, f"augassign {name}")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        name = _attr_name(node.target)
        if name is not None and node.value is not None and not _is_zero(node.value):
            self._add(node, f"assign {name}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            name = _attr_name(func.value)
            method = func.attr
            if name is not None and (method in _LIST_MUTATORS or method.endswith("_")):
                self._add(node, f"mutate {name}.{method}")
            elif method in OWNER_MUTATORS:
                self._add(node, f"call {method}")
        self.generic_visit(node)


def scan_source(source: str, path: str) -> list[LintSite]:
    """Every site in one module's source text, in line order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(source, filename=path)
    visitor = _Visitor(path)
    visitor.visit(tree)
    return sorted(visitor.sites, key=lambda s: (s.line, s.kind))


def _python_files(paths: Sequence[Path]) -> Iterator[tuple[Path, Path]]:
    """(file, root) pairs: each .py file under each path, with the root it is relative to."""
    for root in paths:
        if root.is_file():
            yield root, root.parent
        else:
            for file in sorted(root.rglob("*.py")):
                yield file, root


def scan_paths(paths: Sequence[Path], errors: list[str] | None = None) -> list[LintSite]:
    """Every site in the Python files at or under ``paths`` (paths reported relative to each).

    With ``errors``, a file that cannot be read or parsed is recorded there (``file:line:
    message``) and the scan goes on; without it the error is raised.
    """
    sites: list[LintSite] = []
    for file, root in _python_files(paths):
        rel = file.relative_to(root).as_posix()
        try:
            sites.extend(scan_source(file.read_text(encoding="utf-8-sig"), rel))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
            if errors is None:
                raise
            line = getattr(exc, "lineno", None) or 0
            errors.append(f"{file}:{line}: cannot parse ({type(exc).__name__}: {exc})")
    return sites


def site_counts(sites: Sequence[LintSite]) -> Counter[tuple[str, str, str]]:
    """Sites counted by (path, scope, kind): the shape of an exact-count allowlist."""
    return Counter((s.path, s.scope, s.kind) for s in sites)


def _allowed(site: LintSite, patterns: Sequence[str]) -> bool:
    key = f"{site.path}::{site.scope}"
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(site.scope, p) for p in patterns)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``lint`` command's arguments (shared by ``specstate lint`` and ``-m``)."""
    parser = parser or argparse.ArgumentParser(prog="specstate lint")
    parser.description = "Report writes to tracked scheduling counters outside owner scopes."
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders to scan")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="SCOPE",
        help="glob of an owner scope allowed to write, as 'path::Class.method' or "
        "'Class.method' (repeatable)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Print violations; 0 when none, 1 when any, 2 when a path is missing or unparsable.

    A file that cannot be parsed is reported and skipped; the others are still scanned.
    """
    missing = [p for p in args.paths if not p.exists()]
    if missing:
        print(f"specstate lint: no such path: {missing[0]}", file=sys.stderr)
        return 2
    errors: list[str] = []
    found = [s for s in scan_paths(args.paths, errors) if not _allowed(s, args.allow)]
    for site in found:
        print(site.render())
    for error in errors:
        print(f"specstate lint: {error}", file=sys.stderr)
    if found:
        print(f"{len(found)} ownership violation(s)", file=sys.stderr)
    if errors:
        return 2
    return 1 if found else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m specstate.lint``."""
    return run(build_parser().parse_args(argv))
