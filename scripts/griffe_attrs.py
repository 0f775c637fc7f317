"""A Griffe extension for the API reference: the constructors of attrs classes, with defaults.

Griffe reads the source statically, and attrs writes a class's ``__init__`` at run time, so the
API reference showed ``EngineConfig`` without a signature. For every class the static analysis
found without an ``__init__``, this imports the class and, if it is an attrs class, gives it the
``__init__`` attrs made: each parameter's name (attrs drops a private field's underscore), kind
(keyword-only or not), annotation and default (``factory()`` for a factory default), read from
``attrs.fields`` and ``inspect.signature``. mkdocstrings' ``merge_init_into_class`` then shows
it as the class's signature. Loaded by mkdocs.yml (``extensions: [scripts/griffe_attrs.py]``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import attrs
import griffe


class AttrsInit(griffe.Extension):
    """Adds the attrs-generated ``__init__`` to attrs classes (see the module docstring)."""

    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Once the tree is built: give an attrs class without ``__init__`` its constructor."""
        del loader, kwargs
        if "__init__" in cls.members:
            return
        runtime = _runtime_class(cls.module.path, cls.path)
        if runtime is None or not attrs.has(runtime):
            return
        parameters = [
            griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword),
            *_parameters(runtime),
        ]
        init = griffe.Function(
            "__init__",
            lineno=cls.lineno,
            endlineno=cls.lineno,
            parent=cls,
            parameters=griffe.Parameters(*parameters),
            returns="None",
        )
        cls.set_member("__init__", init)


def _runtime_class(module_path: str, class_path: str) -> type | None:
    """The class at ``class_path`` (``module.Class`` or ``module.Outer.Inner``), if importable."""
    try:
        found: object = importlib.import_module(module_path)
    except Exception:
        return None
    for part in class_path.removeprefix(module_path + ".").split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


def _parameters(runtime: type) -> list[griffe.Parameter]:
    """The parameters of the attrs-generated ``__init__``, in its order."""
    fields = {field.alias: field for field in attrs.fields(runtime) if field.init}
    found = []
    for name, param in inspect.signature(runtime).parameters.items():  # the __init__'s, no self
        field = fields.get(name)
        default: str | None = None
        if field is not None and field.default is not attrs.NOTHING:
            value = field.default
            if isinstance(value, attrs.Factory):  # type: ignore[arg-type]
                default = f"{getattr(value.factory, '__name__', 'factory')}()"
            else:
                default = repr(value)
        annotation = param.annotation
        found.append(
            griffe.Parameter(
                name,
                annotation=None if annotation is inspect.Parameter.empty else _text(annotation),
                kind=griffe.ParameterKind(param.kind.description),
                default=default,
            )
        )
    return found


def _text(annotation: object) -> str:
    """An annotation as source text (with postponed evaluation it already is one)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
