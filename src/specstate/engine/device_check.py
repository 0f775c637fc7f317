"""Whether this machine can hold the engine's tensors on a device: checked where a config is made.

`EngineConfig` calls `device_problems` from its validation, so ``EngineConfig(device="cuda")`` on
a torch without CUDA, ``cuda:7`` on a machine with two GPUs, or ``mps`` where Metal is
unavailable is an `InvalidConfig` naming the device at once, instead of a raw error from torch
(an ``AssertionError: Torch not compiled with CUDA enabled``) deep inside the engine's build.

The engine runs on ``cpu`` and ``cuda`` devices: its forward stream (`specstate.relay.streams`)
is a worker thread on a CPU and a ``torch.cuda.Stream`` on a GPU. ``cpu:N`` is a CPU device with
an identity of its own, which `specstate.testing.device_audit` uses to check placement without a
GPU. The check reads only what torch reports without creating a CUDA context.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["ENGINE_DEVICE_TYPES", "device_problems"]

ENGINE_DEVICE_TYPES: Final = ("cpu", "cuda")
"""The device types the engine's forward stream exists for."""


def device_problems(device: object) -> list[str]:
    """Why ``device`` cannot hold the engine's tensors on this machine; empty when it can.

    Each problem is one phrase naming the device as given: not a torch device, a backend this
    torch build or machine lacks, an index past the devices visible, or a device type the engine
    has no forward stream for.
    """
    try:
        parsed = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        return [f"device {device!r} is not a torch device"]
    if parsed.type == "cpu":
        return []
    if parsed.type == "cuda":
        return _cuda_problems(device, parsed)
    backend = getattr(torch.backends, parsed.type, None) or getattr(torch, parsed.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        return [
            f"device {device!r} is not available: this machine or torch build "
            f"({torch.__version__}) has no {parsed.type} backend"
        ]
    return [
        f"device {device!r}: the engine runs on {' or '.join(map(repr, ENGINE_DEVICE_TYPES))} "
        "devices (its forward stream exists for those)"
    ]


def _cuda_problems(device: object, parsed: torch.device) -> list[str]:
    """A CUDA device: this torch has CUDA, a device is visible, and the index names one."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch build ({torch.__version__}) has no CUDA support"
        else:
            why = (
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                "(check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"
            )
        return [f"device {device!r} is not available: {why}"]
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        return [
            f"device {device!r} does not exist: {count} CUDA device(s) are visible "
            f"(cuda:0 to cuda:{count - 1})"
        ]
    return []
