"""Device audit: prove on a CPU that code keeps host and device tensors apart and never syncs.

A CPU run cannot notice the two ways code breaks on a GPU: an op that mixes a host tensor with
a device tensor (CUDA raises "Expected all tensors to be on the same device") and a host read of
a device tensor's values (``.item()``, ``.tolist()``, ``int()``, ``bool()``, ``.cpu()``,
``.numpy()``, ``nonzero()``, boolean-mask indexing: each blocks the host until the device has
caught up, which serializes an overlap loop). `DeviceAudit` makes both visible on a CPU.

Run the engine with a *tagged* device, ``torch.device("cpu", 0)`` (`AUDIT_DEVICE`): CPU memory,
but a device identity distinct from the host's ``torch.device("cpu")``. Under the audit (a
``TorchFunctionMode``), every tensor created on the tagged device (a factory called with
``device=AUDIT_DEVICE``, or ``.to(AUDIT_DEVICE)``), and every tensor computed from one, is a
`DeviceTensor`; every other tensor is a host tensor. ``t.device`` of a device tensor reads as
`AUDIT_DEVICE`, so code that places by ``device=t.device`` keeps the placement. Module
parameters count as device tensors (moving a module to a CPU device keeps its tensors, so they
cannot be tagged; by the placement rule, weights live on the device). The audit records

* a **mix**: an op whose inputs hold a device tensor and a host tensor of one or more
  dimensions (0-dim host tensors are allowed, as CUDA allows CPU scalars); transfers
  (``to``, ``copy_``, ``cpu``, ``numpy`` ...) are exempt;
* a **sync**: a host read of a device tensor's values, counted per *phase* — a label the caller
  sets per thread with `DeviceAudit.phase` (say ``"launch"``, ``"worker"``, ``"settle"``);
* an **h2d**: host data copied to the device (``torch.tensor(data, device=...)``, ``.to`` of a
  host tensor, a ``copy_`` into a device tensor); inside a forward stream's work such a copy
  from pageable memory waits for the stream, so the launch should have none;
* a **d2h**: a ``non_blocking`` copy of a device tensor into a host tensor (not a sync: the host
  reads it after an event).

The mode stack is per thread: enter the audit on every thread whose work is audited
(`DeviceAudit.on_this_thread`). A mix or a sync is recorded with the op and the innermost frame
of the code under audit, so a failure names the line to fix.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode

__all__ = ["AUDIT_DEVICE", "DeviceAudit", "DeviceTensor", "Finding"]

AUDIT_DEVICE = torch.device("cpu", 0)
_HOST = torch.device("cpu")
_T = torch.Tensor

# Host reads of a device tensor's values: each blocks the host on the device.
_SYNCS: frozenset[Any] = frozenset(
    {
        _T.item,
        _T.tolist,
        _T.__int__,
        _T.__float__,
        _T.__bool__,
        _T.__index__,
        _T.__complex__,
        _T.__array__,
        _T.numpy,
        _T.cpu,
        _T.nonzero,
        torch.nonzero,
        _T.masked_select,
        torch.masked_select,
        _T.unique,
        torch.unique,
        _T.equal,
        torch.equal,
        _T.allclose,
        torch.allclose,
    }
)
# Ops that move data between host and device: never a mix (the direction decides a sync).
_TRANSFERS: frozenset[Any] = frozenset(
    {_T.to, _T.copy_, _T.cpu, _T.numpy, _T.__array__, _T.tolist, _T.item, _T.cuda}
)


class DeviceTensor(torch.Tensor):
    """A tensor that lives on the audited device (CPU memory, device identity `AUDIT_DEVICE`)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


@attrs.frozen
class Finding:
    """One mix or sync: the op, the phase, and where the audited code called it."""

    kind: str
    op: str
    phase: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.phase}: {self.op} at {self.where}"


def _op_name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    return str(name or func)


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that called the op."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and not path.endswith("device_audit.py"):
            return f"{path.rsplit('/src/', 1)[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)


def _on_device(t: torch.Tensor) -> bool:
    """Tagged, or a module parameter (weights live on the device by the placement rule)."""
    return isinstance(t, DeviceTensor | torch.nn.Parameter)


def _is_audit_device(value: object) -> bool:
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError:
            return False
    return isinstance(value, torch.device) and value == AUDIT_DEVICE


def _target_device(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Where ``Tensor.to`` sends its input: "device", "host", or None (dtype only)."""
    for value in (*args[1:], kwargs.get("device"), kwargs.get("other")):
        if isinstance(value, DeviceTensor) or _is_audit_device(value):
            return "device"
        if isinstance(value, torch.Tensor):
            return "host"
        if isinstance(value, str | torch.device):
            return "host"
    return None


class DeviceAudit(TorchFunctionMode):
    """Tags device tensors, and records mixes and syncs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()  # per thread: the phase, and whether the mode is on
        self._lock = threading.Lock()
        self.findings: list[Finding] = []

    # ------------------------------------------------------------------ phases
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label what this thread does while inside (syncs are counted per label)."""
        previous = getattr(self._local, "phase", "host")
        self._local.phase = name
        try:
            yield
        finally:
            self._local.phase = previous

    @contextmanager
    def on_this_thread(self, phase: str) -> Iterator[None]:
        """Audit this thread's torch calls (the mode stack is per thread), in ``phase``."""
        with self, self.phase(phase):
            self._local.active = True
            try:
                yield
            finally:
                self._local.active = False

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """``fn`` audited, in ``phase``, on whichever thread calls it."""

        def audited(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "active", False):
                with self.phase(phase):
                    return fn(*args, **kwargs)
            with self.on_this_thread(phase):
                return fn(*args, **kwargs)

        return audited

    # ----------------------------------------------------------------- reports
    def syncs(self, phase: str | None = None) -> list[Finding]:
        """Recorded syncs (of ``phase``)."""
        return [f for f in self.findings if f.kind == "sync" and phase in (None, f.phase)]

    def mixes(self) -> list[Finding]:
        """Recorded mixes."""
        return [f for f in self.findings if f.kind == "mix"]

    def of(self, kind: str, phase: str | None = None) -> list[Finding]:
        """Recorded findings of ``kind`` (of ``phase``)."""
        return [f for f in self.findings if f.kind == kind and phase in (None, f.phase)]

    def sync_counts(self) -> Counter[str]:
        """Syncs per phase."""
        return Counter(f.phase for f in self.findings if f.kind == "sync")

    def clear(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self.findings.clear()

    def _record(self, kind: str, func: Any) -> None:
        finding = Finding(
            kind=kind,
            op=_op_name(func),
            phase=getattr(self._local, "phase", "host"),
            where=_caller(),
        )
        with self._lock:
            self.findings.append(finding)

    # -------------------------------------------------------------------- mode
    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _T.device and isinstance(args[0], DeviceTensor):
            return AUDIT_DEVICE
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        on_device = any(_on_device(t) for t in inputs)
        out = func(*args, **kwargs)
        if func in _TRANSFERS:
            return self._transfer(func, args, kwargs, out, on_device)
        if on_device:
            if func in _SYNCS or self._masks(func, args):
                self._record("sync", func)
            if any(not _on_device(t) and t.dim() > 0 for t in inputs):
                self._record("mix", func)
            return self._tag(out) if func not in _SYNCS else out
        if _is_audit_device(kwargs.get("device")):
            if func in (torch.tensor, torch.as_tensor):
                self._record("h2d", func)
            return self._tag(out)
        return out

    def _transfer(
        self,
        func: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        out: Any,
        on_device: bool,
    ) -> Any:
        if func is _T.copy_:
            dst, src = args[0], args[1]
            if isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor):
                blocking = not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking")
                self._record("sync" if blocking else "d2h", func)
            elif isinstance(dst, DeviceTensor) and not _on_device(src) and src.dim() > 0:
                self._record("h2d", func)
            return out
        if func is _T.to:
            target = _target_device(args, kwargs)
            if target == "device":
                if not _on_device(args[0]):
                    self._record("h2d", func)
                return self._tag(out)
            if target == "host" and isinstance(args[0], DeviceTensor):
                self._record("sync", func)
                return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
            return self._tag(out) if isinstance(args[0], DeviceTensor) else out
        if func is _T.cuda:
            return out
        if on_device:
            self._record("sync", func)
        if isinstance(out, DeviceTensor):
            return out.as_subclass(torch.Tensor)
        return out

    @staticmethod
    def _masks(func: Any, args: Sequence[Any]) -> bool:
        """Boolean-mask indexing: its output size depends on the values (a sync on CUDA)."""
        if func not in (_T.__getitem__, _T.__setitem__) or len(args) < 2:
            return False
        return any(t.dtype == torch.bool for t in _tensors(args[1]))

    def _tag(self, out: Any) -> Any:
        if isinstance(out, DeviceTensor):
            return out
        if isinstance(out, torch.Tensor):
            return out.as_subclass(DeviceTensor)
        if isinstance(out, tuple) and hasattr(out, "_fields"):  # a torch.return_types value
            return type(out)(tuple(self._tag(v) for v in out))
        if isinstance(out, list | tuple):
            return type(out)(self._tag(v) for v in out)
        return out
