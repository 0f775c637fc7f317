"""Forward modes, with the scheduler's level and the worker's level kept apart.

The scheduler only ever puts EXTEND, DECODE, MIXED or IDLE on a `ScheduleBatch`. TARGET_VERIFY and
DRAFT_EXTEND are worker-internal: a worker may set them on the batch inside a forward, and
`forward_isolation` rolls them back when the forward returns. Member order carries no meaning;
every question is a named predicate.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["ForwardMode"]


class ForwardMode(enum.Enum):
    """What one forward computes."""

    EXTEND = "extend"
    """Prefill or a prefill chunk (including 1-token extends): new tokens after a KV prefix."""
    DECODE = "decode"
    """One decode round; with speculation, one whole draft → verify → accept transaction."""
    MIXED = "mixed"
    """Prefill chunks plus running requests riding as 1-token extends (the mixed tail)."""
    IDLE = "idle"
    """No tokens (a data-parallel rank with nothing to do)."""
    TARGET_VERIFY = "target_verify"
    """Worker-internal: the target scores a chain of draft tokens."""
    DRAFT_EXTEND = "draft_extend"
    """Worker-internal: the drafter catches up on the accepted tokens after a verify."""

    def is_scheduler_mode(self) -> bool:
        """True for the modes a scheduler may put on a batch."""
        return self in _SCHEDULER_MODES  # a tuple: identity, no Enum hashing

    def is_worker_internal(self) -> bool:
        """True for TARGET_VERIFY and DRAFT_EXTEND, which never outlive a forward."""
        return not self.is_scheduler_mode()

    def is_extend(self, *, include_draft_extend: bool = False) -> bool:
        """True when the forward appends several tokens per request after a KV prefix.

        EXTEND, MIXED and TARGET_VERIFY always; DRAFT_EXTEND only when asked, because
        attention backends differ on whether they treat it as an extend.
        """
        if self is ForwardMode.DRAFT_EXTEND:
            return include_draft_extend
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        """True for DECODE only."""
        return self is ForwardMode.DECODE

    def is_mixed(self) -> bool:
        """True for MIXED only."""
        return self is ForwardMode.MIXED

    def is_idle(self) -> bool:
        """True for IDLE only."""
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        """True for DECODE and IDLE: the modes whose batch shape is fixed per request."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


_SCHEDULER_MODES: Final = (
    ForwardMode.EXTEND,
    ForwardMode.DECODE,
    ForwardMode.MIXED,
    ForwardMode.IDLE,
)
