"""Stand-ins for two packages a peer imports at module scope but never runs on a CPU.

SGLang imports ``triton`` (GPU kernels) and ``torchvision`` (multimodal helpers) while it loads.
Neither can work here: triton needs a GPU driver, and the torchvision wheel does not load beside
the CPU build of torch. `install` puts an import hook in front of the import system that builds
each stubbed package on demand: every attribute is a `Stub`, which can be called, subscripted,
subclassed and used as a decorator (it then returns the function unchanged).

Three triton details are real, because SGLang reads them while importing: ``triton.jit`` and
friends return the decorated Python function (so a launch, ``kernel[grid](...)``, fails loudly
instead of doing nothing), ``cdiv`` and ``next_power_of_2`` compute, and
``triton.runtime.driver.active`` raises as real triton does on a machine without a GPU driver.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["install"]


class _StubType(type):
    """Stub classes are permissive too: attributes, calls, subscripts, ``|``."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if (
            len(args) == 1
            and not kwargs
            and callable(args[0])
            and not isinstance(args[0], _StubType)
        ):
            return args[0]  # a bare decorator
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __iter__(cls) -> Any:
        return iter(())


class Stub(metaclass=_StubType):
    """An instance is as permissive as its class; calling it with a function returns it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a parametrised decorator
        return Stub()


def _stub(name: str) -> type:
    return _StubType(name, (Stub,), {"__module__": __name__})


def _decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


class _NoDriver:
    @property
    def active(self) -> Any:
        raise RuntimeError("0 active drivers ([]). There should only be one.")


_REAL = {
    "triton": {
        "jit": _decorator,
        "autotune": _decorator,
        "heuristics": _decorator,
        "cdiv": lambda a, b: -(-a // b),
        "next_power_of_2": lambda n: 1 if n <= 1 else 1 << (int(n) - 1).bit_length(),
    },
    "triton.runtime": {"driver": _NoDriver()},
}


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in _REAL:
            return importlib.import_module(full)
        value = _stub(name)
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Package(spec.name)
        module.__path__ = []  # a package: submodules come from here too
        module.__version__ = "0.0.0+stub"
        for key, value in _REAL.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


def install() -> list[str]:
    """Stub torchvision, and triton where it is not installed; the stubbed names."""
    roots = ["torchvision"]
    if importlib.util.find_spec("triton") is None:
        # NOTE: torch.compile decorators run while SGLang imports; inductor probes for triton
        # once, and must do so before the stub exists.
        import torch._inductor.compile_fx  # noqa: F401

        roots.append("triton")
    sys.meta_path.insert(0, _Finder(frozenset(roots)))
    return roots
