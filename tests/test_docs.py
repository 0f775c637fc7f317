"""Docs are part of the product: every Python block in README.md and docs/*.md runs as written.

Each block runs on its own, in a fresh namespace and an empty working directory (so no block
leans on a file lying around), with nothing but the installed package. A block that a page
follows with "It prints...:" and a ``text`` block must print exactly that. Links inside the docs
point at files that exist. The API reference renders every helper the guides tell adapter
authors to use, and no public signature shows a private default.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```(?:\n\nIt prints[^\n]*:\n\n```text\n(.*?)```)?", re.S)
"""A Python block, and the output a page says it prints (its ``text`` block), if it says."""
HEADLINES = ("README.md#0", "docs/index.md#0", "docs/serving.md#0")
"""The first examples a reader runs: each shows its output, and the output has text in it."""
LINK = re.compile(r"\]\(([^)#:]+)(?:#[^)]*)?\)")


def _blocks() -> list[tuple[str, str, str]]:
    """``(where, code, output)`` of every Python block; ``output`` is "" when none is shown."""
    found = []
    for page in PAGES:
        for i, (code, output) in enumerate(BLOCK.findall(page.read_text(encoding="utf-8"))):
            found.append((f"{page.relative_to(ROOT).as_posix()}#{i}", code, output))
    return found


@pytest.mark.parametrize(("where", "code", "output"), _blocks(), ids=[w for w, *_ in _blocks()])
def test_every_python_block_runs(where: str, code: str, output: str, tmp_path: Path) -> None:
    """The block runs without error in an empty directory, printing what the page shows."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, where, "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)
    if output:
        assert printed.getvalue() == output


def test_the_headline_examples_show_visible_output() -> None:
    """README's first program, docs/index.md's and docs/serving.md's first examples each show
    what they print, and it is not only whitespace and punctuation (the embedded model answers
    some prompts with spaces alone: those would look broken)."""
    shown = {where: output for where, _, output in _blocks()}
    for where in HEADLINES:
        assert shown[where], f"{where} shows no output"
        output = shown[where]
        quoted = [  # the texts it printed, as repr (a dict's keys left out)
            m.group(0)
            for m in re.finditer(r"'(?:[^'\\]|\\.)*'", output)
            if output[m.end() : m.end() + 1] != ":"
        ]
        text = "".join(ast.literal_eval(q) for q in quoted)
        assert re.search(r"[A-Za-z]", text), (where, text)


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
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - listed == set()
    assert listed - pages == set()


ADAPTER_HELPERS = {
    "TokenHistory",
    "TokenSampler",
    "TokenCounts",
    "filtered_probs",
    "verify_greedy_chain",
    "verify_sampled_chain",
    "verify_chain_targets",
    "apply_logit_controls",
    "seeded_uniforms",
    "default_registry",
    "checkpoint_limits",
    "build_worker",
    "register_metrics",
    "TimedWaitWorker",
    "TraceRecorder",
    "check_worker",
    "assert_worker_conforms",
    "DeviceAudit",
    "kv_tokens_for_budget",
    "TextStream",
    "load_codec",
    "register_request_metrics",
}
"""Helpers docs/workers.md, example-adapter.md, cli.md, observability.md, gpu.md and serving.md
name."""
DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:    .*\n)*)", re.M)


def _rendered_names() -> set[str]:
    """The names the API pages' ``:::`` directives render: a module's ``__all__`` (or the
    ``members`` it lists), or the one object named."""
    names: set[str] = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for path, options in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            members = re.search(r"members: \[(.*?)\]", options)
            try:
                module = importlib.import_module(path)
            except ModuleNotFoundError:
                names.add(path.rsplit(".", 1)[1])
                continue
            if members is not None:
                names |= {m.strip() for m in members.group(1).split(",")}
            else:
                names |= set(getattr(module, "__all__", ()))
    return names


def test_the_api_reference_renders_the_helpers_the_guides_name() -> None:
    """Every helper the guides send adapter authors to has an entry in the API reference."""
    assert ADAPTER_HELPERS - _rendered_names() == set()
    for name in ADAPTER_HELPERS:
        assert any(name in page.read_text(encoding="utf-8") for page in PAGES), name


def test_no_public_signature_shows_a_private_default() -> None:
    """A default like ``prompts=_PROMPTS`` is unreadable in the reference: public functions
    and methods default to literals, public constants or None."""
    found = []
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if node.name.startswith("_") and node.name != "__init__":
                continue
            defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {sub.id}"
                for default in defaults
                for sub in ast.walk(default)
                if isinstance(sub, ast.Name) and sub.id.startswith("_")
            ]
    assert found == []


def _console_lines(page: Path) -> list[str]:
    """The lines of a page's plain and ``console`` code blocks."""
    blocks = re.findall(r"```(?:console)?\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    return [line for block in blocks for line in block.splitlines()]


def test_ci_runs_the_readme_test_command_and_the_torch_line_is_the_cpu_build() -> None:
    """.ci/run's command is the README's test command, verbatim; the README installs torch's
    CPU build from PyTorch's CPU index first, before the commands that pin it."""
    readme = _console_lines(ROOT / "README.md")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci in readme
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert readme.index(cpu) < readme.index(ci)


def test_no_install_line_points_at_an_address_the_project_does_not_have() -> None:
    """The project has no public repository, docs site or package index entry: no page, and
    no package metadata, sends a user to one (a clone URL, ``pip install git+...``)."""
    places = [*PAGES, ROOT / "pyproject.toml", ROOT / "CHANGELOG.md"]
    found = [
        f"{place.relative_to(ROOT)}: {m.group(0)}"
        for place in places
        for m in re.finditer(
            r"github\.com/specstate|specstate\.github\.io|git\+https?://\S+",
            place.read_text(encoding="utf-8"),
        )
    ]
    assert found == []
