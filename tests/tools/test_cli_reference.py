"""docs/cli.md against the command line itself: the reference cannot drift from ``--help``.

Each ``## `specstate CMD` `` section of the page is read and checked against that command's
parser (`specstate.tools.cli.COMMANDS`): its synopsis lists every option the parser has and no
other, every option its tables or prose name exists, and a table row that gives one option a
default gives the parser's. The request fields of ``generate`` are checked against the reader's
(`specstate.tools.generate.request_lines.FIELDS`), and what the page says a text or grammar line
needs against what the command accepts: a subword checkpoint runs both (``tests/tools/
test_generate_subword.py``), so no sentence may say they need a byte-level one.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from specstate.tools.cli import COMMANDS
from specstate.tools.generate.request_lines import FIELDS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SYNOPSIS_COMMANDS = ("generate", "serve", "lint")
"""The commands whose section opens with a synopsis block (demo's options are one table)."""
IN_PROSE_ONLY = {"--nproc-per-node"}
"""Options the page names that belong to another program (``torchrun --nproc-per-node``)."""


def _sections() -> dict[str, str]:
    """The page's ``## `specstate CMD` `` sections by command."""
    found = {}
    for section in re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.M):
        title = re.match(r"`specstate (\w+)`", section)
        if title is not None and title.group(1) in COMMANDS:
            found[title.group(1)] = section
    return found


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"specstate {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option of ``parser`` (``--help`` aside) and its action."""
    return {
        option: action
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def test_the_page_has_a_section_for_each_command_it_details() -> None:
    """demo, generate, serve and lint each have their section; the command table names all."""
    sections = _sections()
    assert {"demo", "generate", "serve", "lint"} <= set(sections)
    table = PAGE.read_text(encoding="utf-8").split("## Exit codes")[0]
    assert {c for c in COMMANDS if f"`specstate {c}" not in table} == set()


@pytest.mark.parametrize("command", SYNOPSIS_COMMANDS)
def test_each_synopsis_lists_exactly_the_parsers_options(command: str) -> None:
    """The ``text`` synopsis of the section has every option of ``--help``, and no other."""
    section = _sections()[command]
    block = re.search(r"```text\n(specstate " + command + r"\b.*?)```", section, re.S)
    assert block is not None, f"no synopsis for {command}"
    listed = set(OPTION.findall(block.group(1)))
    assert listed == set(_options(_parser(command)))


@pytest.mark.parametrize("command", ["demo", *SYNOPSIS_COMMANDS])
def test_every_option_the_section_names_exists(command: str) -> None:
    """No table or sentence of the section names an option the command does not take."""
    named = set(OPTION.findall(_sections()[command])) - IN_PROSE_ONLY
    assert named - set(_options(_parser(command))) == set()


def _table_defaults(section: str) -> list[tuple[str, str]]:
    """``(option, default cell)`` of every option-table row that documents one option."""
    row = re.compile(r"^\| `(--[^`]*)`(?: / `--no-[^`]*`)? \|([^|]*)\|", re.M)
    return [(first.split()[0], default.strip()) for first, default in row.findall(section)]


def _shown(action: argparse.Action) -> str:
    """The parser's default as the page writes it in a default column."""
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return {True: "on", False: "off", None: ""}[default]
    if action.nargs == 0:  # store_true
        return "on" if default else "off"
    return "" if default is None else str(default)


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_every_default_in_an_option_table_is_the_parsers(command: str) -> None:
    """A one-option row's default column says what ``--help`` says (blank for none)."""
    options = _options(_parser(command))
    words = {"torch's": "", "on a terminal": "", "overlap": "on"}  # said in words, not a value
    wrong = []
    for option, cell in _table_defaults(_sections()[command]):
        written = cell.strip("`")
        written = words.get(written, written)
        if re.fullmatch(r"`?[\w* +]+`?", cell) and "*" in cell:
            continue  # a formula (num_steps * topk + 1): the parser's default is None
        if written != _shown(options[option]):
            wrong.append((option, cell, _shown(options[option])))
    assert wrong == []


def test_the_request_fields_table_lists_exactly_the_fields_read() -> None:
    """The ``Requests`` table of ``generate`` has one row per field a request line may have."""
    section = _sections()["generate"]
    table = section.split("### Requests")[1].split("###")[0]
    first_cells = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \|", table, re.M)
    documented = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    assert documented == set(FIELDS)


def test_no_sentence_says_text_or_grammars_need_a_byte_level_checkpoint() -> None:
    """``text`` and ``grammar`` run on a checkpoint with a subword ``tokenizer.json`` too; the
    pages that describe ``generate`` may not say otherwise."""
    stale = re.compile(
        r"(needs a byte-level checkpoint|takes text only for a byte-level|"
        r"for a byte-level checkpoint only)"
    )
    pages = [PAGE, ROOT / "docs" / "non-goals.md", ROOT / "docs" / "grammar.md"]
    found = [
        f"{page.name}: {m.group(0)}"
        for page in pages
        for m in stale.finditer(page.read_text(encoding="utf-8"))
    ]
    assert found == []
