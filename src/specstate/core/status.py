"""A request's status, the lifecycle's moves, and how a request ended: the value types of a
request's life (`specstate.core.request.Req` makes the moves).

Lifecycle (one checked transition function, `Req.transition`)::

    WAITING ──> PREFILL ──> RUNNING ──> FINISHED
       │          │ │          │
       │          │ └──────────┼──────> FINISHED   (first token already ends the request)
       │          └─────┬──────┘
       │                v
       │            RETRACTED ──> WAITING        (incarnation += 1 on entering RETRACTED)
       v                │
    ABORTED <───────────┴─── (from WAITING, PREFILL, RUNNING, RETRACTED)

FINISHED and ABORTED are terminal.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

import attrs

__all__ = ["TRANSITIONS", "FinishReason", "FinishState", "ReqSnapshot", "ReqStatus"]


class ReqStatus(enum.Enum):
    """Where a request is in its life. Member order carries no meaning."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    RETRACTED = "retracted"
    ABORTED = "aborted"

    # Members are singletons compared by identity: hash them by identity too (C-level; the
    # default hashes the name in Python, and every transition looks statuses up).
    __hash__ = object.__hash__


TRANSITIONS: Final[Mapping[ReqStatus, frozenset[ReqStatus]]] = {
    ReqStatus.WAITING: frozenset({ReqStatus.PREFILL, ReqStatus.ABORTED}),
    ReqStatus.PREFILL: frozenset(
        {ReqStatus.RUNNING, ReqStatus.FINISHED, ReqStatus.RETRACTED, ReqStatus.ABORTED}
    ),
    ReqStatus.RUNNING: frozenset({ReqStatus.FINISHED, ReqStatus.RETRACTED, ReqStatus.ABORTED}),
    ReqStatus.RETRACTED: frozenset({ReqStatus.WAITING, ReqStatus.ABORTED}),
    ReqStatus.FINISHED: frozenset(),
    ReqStatus.ABORTED: frozenset(),
}
"""The statuses each status may move to (the diagram above)."""


class FinishReason(enum.Enum):
    """Why a request ended."""

    STOP = "stop"
    """A stop token (or EOS unless ``ignore_eos``) was emitted; it is included in the output."""
    LENGTH = "length"
    """``max_new_tokens`` outputs were emitted."""
    ABORT = "abort"
    """The user aborted it, or the KV pool could not hold even this one request."""
    ERROR = "error"
    """The worker raised while running a batch that held it."""
    HANDED_OFF = "handed_off"
    """A prefill engine handed it to a decode engine, which acknowledged it; it goes on there."""

    __hash__ = object.__hash__  # by identity, in C (as `ReqStatus`): releases look reasons up


@attrs.frozen(kw_only=True)
class FinishState:
    """How a request ended: the reason and how many output tokens the user sees.

    Attributes:
        reason: why it ended.
        finished_len: output tokens the user sees (``Req.emitted_ids``); tokens settled past
            a stop or the cap are cut.
        detail: a human-readable reason (the stop token, the abort message, the error).
        traceback: for an ERROR finish, the worker failure's formatted traceback; else "".
    """

    reason: FinishReason
    finished_len: int
    detail: str = ""
    traceback: str = ""


@attrs.frozen(kw_only=True)
class ReqSnapshot:
    """One request at one instant, for tests, traces and users.

    Attributes:
        request_id: the id given to `Engine.submit`.
        status: its lifecycle state.
        incarnation: how many times it was retracted.
        prompt_len: prompt tokens.
        output_ids: every settled output token.
        finish: how it ended, or None while it runs.
    """

    request_id: str
    status: ReqStatus
    incarnation: int
    prompt_len: int
    output_ids: tuple[int, ...]
    finish: FinishState | None

    @property
    def seqlen(self) -> int:
        """Host-settled clock: ``prompt_len + len(output_ids)``."""
        return self.prompt_len + len(self.output_ids)
