"""The public surface: two layers, pinned, lazily imported, and every symbol documented.

``specstate`` is what users and worker authors need; ``specstate.internals`` is what the engine
composes. Both ``__all__`` lists are sorted and complete, the layers do not overlap, importing
the package imports no torch, and every public symbol documents its contract: a docstring of its
own, one for every public method and property of a user-layer class, and every field of a
user-layer attrs class named in its docstring.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import types

import attrs
import pytest

import specstate
import specstate.internals

SUBPACKAGES = {
    "batch",
    "core",
    "distributed",
    "engine",
    "grammar",
    "handoff",
    "internals",
    "lint",
    "memory",
    "reference",
    "relay",
    "serving",
    "testing",
    "tools",
}


def _own_public(module: types.ModuleType) -> set[str]:
    for name in module.__all__:  # load every lazy name first
        getattr(module, name)
    names = {n for n in vars(module) if not n.startswith("_")}
    return names - {"annotations", "importlib", "warnings", "TYPE_CHECKING", "Any"} - SUBPACKAGES


@pytest.mark.parametrize("module", [specstate, specstate.internals], ids=lambda m: m.__name__)
def test_all_is_sorted_and_complete(module: types.ModuleType) -> None:
    """Every public name is exported, nothing else, in sorted order."""
    assert list(module.__all__) == sorted(module.__all__)
    assert set(module.__all__) - {"__version__"} == _own_public(module)


def test_the_layers_do_not_overlap() -> None:
    """A name lives in one layer."""
    assert set(specstate.__all__) & set(specstate.internals.__all__) == set()


def test_importing_the_package_imports_no_torch() -> None:
    """``import specstate`` is light (``specstate --version`` relies on it); a name loads torch."""
    code = (
        "import sys, specstate; assert 'torch' not in sys.modules, 'eager'; "
        "specstate.Engine; assert 'torch' in sys.modules, 'lazy name did not load'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_moved_name_still_resolves_with_a_warning() -> None:
    """Pre-0.1 top-level names of internals resolve, with a DeprecationWarning naming the move."""
    with pytest.warns(DeprecationWarning, match=r"specstate.internals.FutureMap"):
        moved = specstate.FutureMap  # type: ignore[attr-defined]
    assert moved is specstate.internals.FutureMap
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        specstate.Nonexistent  # type: ignore[attr-defined]  # noqa: B018


def _public_symbols() -> list[tuple[str, object]]:
    out = []
    for module in (specstate, specstate.internals):
        for name in module.__all__:
            if name != "__version__":
                out.append((f"{module.__name__}.{name}", getattr(module, name)))
    return out


def _own_doc(obj: object) -> str:
    if isinstance(obj, type):
        return obj.__dict__.get("__doc__") or ""
    return inspect.getdoc(obj) or ""


def _alias_docstring(name: str) -> str:
    """The string literal right under ``name = ...`` in its defining module ('' if none)."""
    source = inspect.getsource(importlib.import_module(specstate._EXPORTS[name]))
    found = re.search(rf'^{name} = .*\n"""(.+?)"""', source, re.M | re.S)
    return found.group(1) if found else ""


@pytest.mark.parametrize(("qualname", "obj"), _public_symbols(), ids=lambda v: str(v))
def test_every_public_symbol_has_its_own_docstring(qualname: str, obj: object) -> None:
    """A class or function documents itself (not inherited from object or attrs)."""
    if isinstance(obj, types.GenericAlias):  # e.g. OnPublish = Callable[[Tensor], None]
        name = qualname.rpartition(".")[2]
        assert len(_alias_docstring(name).strip()) >= 20, f"{qualname}: no docstring"
        return
    doc = _own_doc(obj)
    assert len(doc.strip()) >= 20, f"{qualname} has no docstring of its own"


def _user_classes() -> list[tuple[str, type]]:
    return [
        (f"specstate.{n}", obj)
        for n in specstate.__all__
        if isinstance(obj := getattr(specstate, n), type)
    ]


@pytest.mark.parametrize(("qualname", "cls"), _user_classes(), ids=lambda v: str(v))
def test_every_user_layer_member_is_documented(qualname: str, cls: type) -> None:
    """Public methods and properties have docstrings; attrs fields are named in the class doc."""
    undocumented = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        is_member = isinstance(member, property) or inspect.isfunction(member)
        if is_member and not (inspect.getdoc(member) or "").strip():
            undocumented.append(name)
    if attrs.has(cls):
        doc = cls.__dict__.get("__doc__") or ""
        undocumented += [
            f"field {f.name}"
            for f in attrs.fields(cls)
            if not f.name.startswith("_") and not re.search(rf"^\s+{f.name}:", doc, re.M)
        ]
    assert undocumented == [], f"{qualname}: undocumented {undocumented}"
