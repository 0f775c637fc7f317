"""The ownership linter: finds every write to a tracked scheduling counter in Python source.

It owns no state; it reads ASTs. A *site* is one of:

* an assignment or augmented assignment whose target is an attribute (or a subscript of an
  attribute) named like a tracked counter, whatever the receiver (``req.kv.kv_committed_len += n``
  counts) — except an assignment of the literal ``0``, which is a reset;
* a call of a list mutator (``append``, ``extend``, ``insert``, ...) or a torch in-place method
  (any name ending in ``_``, such as ``index_copy_``) on such an attribute;
* a call of an owner mutator by name (``advance_committed``, ``grow_allocated``, ...).

``output_ids`` is a common name (tokenizer and detokenizer results carry one), so a write to it
is a site only when its owner is a request. The linter knows a request by

* its annotation: a parameter or variable annotated with a class named ``Req``, ``Request`` or
  ending so (``ScheduleReq``, ``Optional[Req]``, ``"Req | None"``);
* its name, when not annotated otherwise: ``req``, ``request`` or a name ending ``_req`` /
  ``_request`` (``new_req``, ``self.cur_req``); ``output_ids`` of ``req_output`` is not one;
* where it comes from: an item of a request collection (``reqs[i]``, ``batch.reqs[i]``,
  ``for r in batch.reqs``, ``for i, r in enumerate(requests)``, ``for r, n in zip(reqs, ns)``),
  a collection being named ``reqs`` / ``requests`` / ``*_reqs`` / ``*_requests`` or annotated
  ``list[Req]``, ``Sequence[Req]``, ...;
* ``self`` in a class named like a request type.

Each site is keyed by (path, scope, kind) where scope is the dotted chain of enclosing classes
and functions and path is relative to the scanned root (so the key is the same from any working
directory). Adapter code owns none of these counters, so on an engine's adapter every site
is a violation; the project itself compares its sites with an exact-count allowlist
(tests/tools/test_lint_self.py), so a new writer anywhere fails CI until it is reviewed.

Usage: ``specstate lint PATH...`` or ``python -m specstate.lint PATH...``; exit 1 with
``file:line:col: message`` rows when any site is found outside ``--allow`` scopes. The file is
shown the way an editor or terminal opens it: relative to the working directory when it lies
under it, absolute otherwise (as ruff does).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

__all__ = [
    "LintSite",
    "add_arguments",
    "build_parser",
    "display_path",
    "main",
    "scan_paths",
    "scan_source",
    "site_counts",
]

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
        # The recurrent-state pool's committed lengths (hybrid models).
        "recurrent_committed_len",
        "_recurrent_committed",
    }
)
"""Attribute names whose writes are sites."""

REQUEST_COUNTERS: Final[frozenset[str]] = frozenset({"output_ids"})
"""Tracked names that are sites only on a request (the name is common elsewhere)."""

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
        "open_state",
        "close_states",
        "commit_states",
        "commit_prefilled",
        "settle_states",
    }
)
"""Owner methods whose every call is a site (they write tracked counters)."""

_LIST_MUTATORS: Final[frozenset[str]] = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}
)

_REQUEST_NAME: Final = re.compile(r"(?:\w+_)?(?:req|request)")
_REQUESTS_NAME: Final = re.compile(r"(?:\w+_)?(?:reqs|requests)")
_COLLECTIONS: Final[frozenset[str]] = frozenset(
    {
        "list",
        "List",
        "tuple",
        "Tuple",
        "set",
        "Set",
        "frozenset",
        "FrozenSet",
        "deque",
        "Deque",
        "Sequence",
        "MutableSequence",
        "Iterable",
        "Iterator",
        "Collection",
    }
)

_Kind = Literal["req", "reqs", None]
"""What an expression holds, as far as the linter can tell: a request, a request collection,
or something else / unknown (None)."""


@attrs.frozen(kw_only=True)
class LintSite:
    """One write to a tracked counter: where, in which scope, and what kind.

    ``path`` is relative to the scanned root (the allowlist key); ``file`` is where a user opens
    it (`display_path`); ``col`` is 1-based, like ruff's and mypy's.
    """

    path: str
    line: int
    scope: str
    kind: str
    col: int = 1
    file: str = ""

    def render(self) -> str:
        """``file:line:col: message`` for terminals and editors."""
        where = self.file or self.path
        return f"{where}:{self.line}:{self.col}: {self.kind} in {self.scope} (not an owner scope)"


def display_path(file: Path) -> str:
    """``file`` as a user opens it: relative to the working directory if under it, else absolute."""
    absolute = Path(os.path.abspath(file))
    try:
        return absolute.relative_to(os.getcwd()).as_posix()
    except ValueError:
        return str(absolute)


def _tracked(node: ast.expr) -> ast.Attribute | None:
    """The tracked attribute a target writes, looking through subscripts."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in TRACKED_COUNTERS:
        return node
    return None


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _name_kind(name: str) -> _Kind:
    if _REQUEST_NAME.fullmatch(name):
        return "req"
    if _REQUESTS_NAME.fullmatch(name):
        return "reqs"
    return None


def _annotation_kind(node: ast.expr | None) -> _Kind:
    """What an annotation declares: a request, a collection of requests, or neither."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # "Req", "list[Req]"
        try:
            parsed = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
        return _annotation_kind(parsed)
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return "req" if name.endswith(("Req", "Request")) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # Req | None
        return _annotation_kind(node.left) or _annotation_kind(node.right)
    if isinstance(node, ast.Subscript):
        outer = node.value.id if isinstance(node.value, ast.Name) else None
        if isinstance(node.value, ast.Attribute):
            outer = node.value.attr
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer in ("Optional", "Union"):
            return next((k for k in map(_annotation_kind, args) if k is not None), None)
        if outer in _COLLECTIONS and args and _annotation_kind(args[0]) == "req":
            return "reqs"
    return None


class _Visitor(ast.NodeVisitor):
    """Collects sites with their enclosing scope; tracks which names hold requests."""

    def __init__(self, path: str, file: str) -> None:
        self.path = path
        self.file = file
        self.scope: list[str] = []
        self.classes: list[str] = []
        self.names: list[dict[str, _Kind]] = [{}]  # per function: name -> what it holds
        self.sites: list[LintSite] = []

    # ---------------------------------------------------------------- what a value is
    def _kind(self, node: ast.expr) -> _Kind:
        if isinstance(node, ast.Name):
            return self.names[-1].get(node.id) or _name_kind(node.id)
        if isinstance(node, ast.Attribute):
            return _name_kind(node.attr)
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            return "req" if self._kind(node.value) == "reqs" else None
        if isinstance(node, ast.Subscript):  # reqs[1:]
            return self._kind(node.value)
        return None

    def _bind(self, target: ast.expr, kind: _Kind) -> None:
        """Record what a name now holds; an unknown value leaves the name rule to decide."""
        if isinstance(target, ast.Name):
            if kind is None:
                self.names[-1].pop(target.id, None)
            else:
                self.names[-1][target.id] = kind

    def _bind_loop(self, target: ast.expr, items: ast.expr) -> None:
        """``for target in items``: enumerate and zip pair their items with the target's parts."""
        if isinstance(items, ast.Call) and isinstance(items.func, ast.Name):
            parts = target.elts if isinstance(target, ast.Tuple) else None
            if items.func.id == "enumerate" and items.args and parts and len(parts) == 2:
                self._bind(parts[0], None)
                self._bind_loop(parts[1], items.args[0])
                return
            if items.func.id == "zip" and parts and len(parts) == len(items.args):
                for part, source in zip(parts, items.args, strict=True):
                    self._bind_loop(part, source)
                return
        self._bind(target, "req" if self._kind(items) == "reqs" else None)

    # ---------------------------------------------------------------- scopes and bindings
    def _add(self, node: ast.AST, kind: str) -> None:
        scope = ".".join(self.scope) or "<module>"
        line = getattr(node, "lineno", 0)
        col = getattr(node, "col_offset", 0) + 1
        site = LintSite(path=self.path, line=line, col=col, scope=scope, kind=kind, file=self.file)
        self.sites.append(site)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()
        self.scope.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        names: dict[str, _Kind] = {}
        a = node.args
        positional = (*a.posonlyargs, *a.args)
        for arg in (*positional, *a.kwonlyargs):
            if _annotation_kind(arg.annotation) is not None:
                names[arg.arg] = _annotation_kind(arg.annotation)
        decorators = node.decorator_list
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in decorators)
        method = bool(self.classes) and not static  # reset below: a nested def is no method
        if method and positional and self.classes[-1].endswith(("Req", "Request")):
            names.setdefault(positional[0].arg, "req")  # ``self`` of a request class
        self.names.append(names)
        classes, self.classes = self.classes, []
        self.generic_visit(node)
        self.classes = classes
        self.names.pop()
        self.scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self._bind_loop(node.target, node.iter)
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind_loop(node.target, node.iter)
        self.generic_visit(node)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        for generator in node.generators:  # bind the loop names before the element reads them
            self.visit(generator)
        self.visit(node.elt)

    visit_ListComp = _comprehension
    visit_SetComp = _comprehension
    visit_GeneratorExp = _comprehension

    def visit_DictComp(self, node: ast.DictComp) -> None:
        for generator in node.generators:
            self.visit(generator)
        self.visit(node.key)
        self.visit(node.value)

    # ---------------------------------------------------------------- sites
    def _counter(self, node: ast.expr) -> str | None:
        """The tracked counter a target or receiver writes, if its owner qualifies."""
        attr = _tracked(node)
        if attr is None:
            return None
        if attr.attr in REQUEST_COUNTERS and self._kind(attr.value) != "req":
            return None
        return attr.attr

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for elt in target.elts if isinstance(target, ast.Tuple) else [target]:
                name = self._counter(elt)
                if name is not None and not _is_zero(node.value):
                    self._add(node, f"assign {name}")
        self.generic_visit(node)
        if len(node.targets) == 1:
            self._bind(node.targets[0], self._kind(node.value))

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        name = self._counter(node.target)
        if name is not None:
            self._add(node, f"augassign {name}")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        name = self._counter(node.target)
        if name is not None and node.value is not None and not _is_zero(node.value):
            self._add(node, f"assign {name}")
        self.generic_visit(node)
        self._bind(node.target, _annotation_kind(node.annotation))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            name = self._counter(func.value)
            method = func.attr
            if name is not None and (method in _LIST_MUTATORS or method.endswith("_")):
                self._add(node, f"mutate {name}.{method}")
            elif method in OWNER_MUTATORS:
                self._add(node, f"call {method}")
        self.generic_visit(node)


def scan_source(source: str, path: str, file: str | None = None) -> list[LintSite]:
    """Every site in one module's source text, in line order.

    ``path`` keys the sites (`site_counts`, ``--allow``); ``file`` (default: ``path``) is what
    `LintSite.render` shows.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(source, filename=file or path)
    visitor = _Visitor(path, file or path)
    visitor.visit(tree)
    return sorted(visitor.sites, key=lambda s: (s.line, s.col, s.kind))


def _python_files(paths: Sequence[Path]) -> Iterator[tuple[Path, Path]]:
    """(file, root) pairs: each .py file under each path, with the root it is relative to."""
    for root in paths:
        if root.is_file():
            yield root, root.parent
        else:
            for file in sorted(root.rglob("*.py")):
                yield file, root


def scan_paths(paths: Sequence[Path], errors: list[str] | None = None) -> list[LintSite]:
    """Every site in the Python files at or under ``paths``.

    Each site's ``path`` is relative to the scanned path it was found under (the allowlist key,
    the same from any working directory); its ``file`` is `display_path`. With ``errors``, a
    file that cannot be read or parsed is recorded there (``file:line:col: message``) and the
    scan goes on; without it the error is raised.
    """
    sites: list[LintSite] = []
    for file, root in _python_files(paths):
        rel = file.relative_to(root).as_posix()
        shown = display_path(file)
        try:
            sites.extend(scan_source(file.read_text(encoding="utf-8-sig"), rel, shown))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
            if errors is None:
                raise
            line = getattr(exc, "lineno", None) or 0
            col = getattr(exc, "offset", None) or 0
            errors.append(f"{shown}:{line}:{col}: cannot parse ({type(exc).__name__}: {exc})")
    return sites


def site_counts(sites: Sequence[LintSite]) -> Counter[tuple[str, str, str]]:
    """Sites counted by (path, scope, kind): the shape of an exact-count allowlist."""
    return Counter((s.path, s.scope, s.kind) for s in sites)


def _allowed(site: LintSite, patterns: Sequence[str]) -> bool:
    keys = (f"{site.file}::{site.scope}", f"{site.path}::{site.scope}", site.scope)
    return any(fnmatch.fnmatchcase(key, p) for p in patterns for key in keys)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lint`` command's arguments (shared by ``specstate lint`` and ``-m``)."""
    parser.description = "Report writes to tracked scheduling counters outside owner scopes."
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders to scan")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="SCOPE",
        help="glob of an owner scope allowed to write, as 'path::Class.method' (the path as "
        "shown, or relative to the scanned folder) or 'Class.method' (repeatable)",
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """A parser with the ``lint`` arguments (a new one named ``specstate lint`` by default)."""
    parser = parser or argparse.ArgumentParser(prog="specstate lint")
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Print violations (or ``N files clean``); 0 when none, 1 when any, 2 when a path is
    missing or unparsable.

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
    if not found:
        count = sum(1 for _ in _python_files(args.paths))
        print(f"{count} file{'' if count == 1 else 's'} clean")
    return 1 if found else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m specstate.lint``."""
    return run(build_parser().parse_args(argv))
