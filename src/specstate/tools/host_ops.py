"""The device-op counter every side of the host comparison shares: one launch model for all.

On a GPU each tensor operation a scheduler makes on a device tensor is a kernel launch (or a
copy), paid on the host; on the CPU these harnesses run on, the same operation is a cheap CPU
call, or nothing at all. To charge every side the same, a round's tensor operations are
*counted* (`OpCounter`, in an untimed replay of the same draws) and each is charged one
modelled launch (``--launch-us``) on top of the round's measured host time.

What counts as one operation, on every side alike:

* every ATen operation that reaches the dispatcher and does work; views (``slice``,
  ``select``, ``view``...), allocation without a kernel (``empty``) and the wrapping of Python
  data into a tensor (``lift_fresh``) are not counted;
* every ``Tensor.to`` / ``.cpu()`` / ``.cuda()`` call that is a no-op here because source and
  target are both the CPU (on a GPU it may be a host-device copy: the counter cannot tell a
  tensor that would live on the device from one that would stay on the host, so it counts
  them all), and every ``torch.tensor`` / ``torch.as_tensor`` given a ``device``;
* an operation a harness models as fused kernels (a peer's Triton kernel, which runs a CPU
  stand-in here) counts as the launches it makes (`OpCounter.kernel`), nothing inside it.

On a CPU every tensor is a host tensor, so operations on what a GPU deployment keeps on the
host (SGLang's ``*_cpu`` mirrors, say) are counted too: a host tensor operation costs a few
microseconds of dispatch on any machine. NumPy work is host work on every side and is timed,
not counted.

This module imports only torch, so a peer's harness loads it by file path, as it loads the
workload (`specstate.tools.host_workload`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NOT_COUNTED", "OpCounter", "count_ops_of"]

NOT_COUNTED: Final = frozenset(
    {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias", "resize_", "set_"}
)
"""ATen operations (by packet name) that launch no kernel on a GPU."""

_MOVES: Final = frozenset({"to", "cpu", "cuda"})
"""Tensor methods that move a tensor between devices (a no-op here when they return it)."""
_FACTORIES: Final = frozenset({"tensor", "as_tensor"})
"""Factories from Python or host data that copy to their ``device``."""


class OpCounter:
    """Counts the tensor operations of the regions it is `enabled` in (module docstring).

    Enter it (``with counter:``) around a whole untimed replay; set `enabled` around the
    parts a round times, so the replay's own untimed work (its forward, its joiners' prefill)
    is not counted. `take` returns the count since the last `take`. Torch's modes are per
    thread: work a replay hands to another thread (a CPU stream's worker) is counted when it
    runs through `bound`. Entering twice in one thread raises.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._count = 0
        self._moves = 0
        self._inside_kernel = 0
        self._local = threading.local()
        self._lock = threading.Lock()

    def __enter__(self) -> OpCounter:
        if getattr(self._local, "modes", None):
            raise RuntimeError("OpCounter is already entered in this thread")
        self._local.modes = [_Moves(self), _Dispatch(self)]
        for mode in self._local.modes:
            mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        modes, self._local.modes = self._local.modes, []
        for mode in reversed(modes):
            mode.__exit__(exc_type, exc, tb)

    def bound(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, counted in whatever thread runs it (entering the counter there if needed)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "modes", None):
                return fn(*args, **kwargs)
            with self:
                return fn(*args, **kwargs)

        return counted

    @property
    def counting(self) -> bool:
        """Whether an operation now is counted (enabled, and not inside a modelled kernel)."""
        return self.enabled and not self._inside_kernel

    def kernel(self, launches: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as modelled kernels: ``launches`` counted, nothing inside it."""
        self.add(launches)
        self._inside_kernel += 1
        try:
            return fn(*args)
        finally:
            self._inside_kernel -= 1

    def add(self, launches: int) -> None:
        """Count ``launches`` operations that are not torch calls (a NumPy store standing in
        for a device write, say)."""
        if self.counting:
            with self._lock:
                self._count += launches

    def add_move(self) -> None:
        """Count one host-device move that is a no-op here."""
        if self.counting:
            with self._lock:
                self._count += 1
                self._moves += 1

    def take(self) -> tuple[int, int]:
        """The operations counted since the last call, and how many of them were moves;
        resets both."""
        with self._lock:
            counted = (self._count, self._moves)
            self._count = self._moves = 0
        return counted


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._counter = counter

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self._counter.counting and _does_work(func):
            self._counter.add(1)
        return func(*args, **(kwargs or {}))


class _Moves(TorchFunctionMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self._counter = counter

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not self._counter.counting:
            return out
        if name in _MOVES and args and out is args[0] and _names_device(name, args, kwargs):
            self._counter.add_move()  # a copy did run otherwise, and the dispatcher counted it
        elif name in _FACTORIES and kwargs.get("device") is not None:
            self._counter.add_move()
        return out


def _names_device(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``to`` call names a device (``cpu`` and ``cuda`` always do)."""
    if name != "to":
        return True
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, str | torch.device) for a in args[1:])


def _does_work(func: Any) -> bool:
    if getattr(func, "is_view", False):
        return False
    return bool(func.__name__.split(".")[0] not in NOT_COUNTED)


def count_ops_of(fn: Callable[[], Any]) -> tuple[int, int]:
    """The operations ``fn()`` makes and the moves among them (everything it does counts)."""
    counter = OpCounter()
    with counter:
        counter.enabled = True
        fn()
    return counter.take()
