"""Prefill → decode handoff: the record of a request's committed state, and its wire form.

`HandoffRecord` and `CompatibilityDescriptor` (`specstate.handoff.record`) say what crosses;
`encode` / `decode` (`specstate.handoff.codec`) turn a record into a flat list of tensors and
back. Engines export and admit records (`Engine.export_handoff`, `Engine.admit_handoff`);
`specstate.handoff.link` moves them in one process, `specstate.handoff.transport` between
processes (docs/handoff.md).
"""

from specstate.handoff.codec import decode, encode
from specstate.handoff.record import (
    HANDOFF_VERSION,
    CompatibilityDescriptor,
    DraftState,
    HandoffRecord,
)

__all__ = [
    "HANDOFF_VERSION",
    "CompatibilityDescriptor",
    "DraftState",
    "HandoffRecord",
    "decode",
    "encode",
]
