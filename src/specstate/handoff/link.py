"""Moving handed-off requests from a prefill engine to a decode engine: the in-process link.

`HandoffLink` connects two engines of one process (one thread drives both). Each `pump` hands
every parked request whose first token has settled across, through the wire form (`encode` then
`decode`: exactly what a transport carries), and releases it on the prefill side once the decode
engine admitted it::

    prefill.export_handoff(id) -> encode -> decode -> decode_engine.admit_handoff(record)
        admitted:  prefill.release_handoff(id)               (HANDED_OFF; its pages freed)
        refused:   prefill.release_handoff(id, error=...)    (ERROR, naming why; pages freed)

`serve_disaggregated` drives both engines until every request ended on one side or the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from specstate.core.errors import InvariantViolation, SpecStateError
from specstate.core.params import SamplingParams
from specstate.core.request import Req
from specstate.engine.engine import Engine
from specstate.handoff.codec import decode, encode

__all__ = ["HandoffLink", "LinkStats", "serve_disaggregated"]


@attrs.define
class LinkStats:
    """What a link moved: handoffs, bytes of tensor data, refusals."""

    handoffs: int = 0
    bytes: int = 0
    refused: int = 0


class HandoffLink:
    """One prefill engine feeding one decode engine in this process (module docstring).

    Args:
        prefill: the engine requests are submitted to (`Engine.submit_prefill`).
        decode: the engine that continues them (`Engine.admit_handoff`).
    """

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        self.prefill = prefill
        self.decode = decode
        self.stats = LinkStats()

    def transfer(self, request_id: str) -> Req:
        """Hand ``request_id`` (parked, first token settled) to the decode engine.

        Returns:
            The request on the decode engine.

        Raises:
            SpecStateError: the decode engine refused the record (`HandoffError`,
                `InvalidRequest`, or `UsageError` once it closed): the prefill side ended the
                request with ERROR naming why and freed its pages.
        """
        record = self.prefill.export_handoff(request_id)
        wire = encode(record)
        try:
            req = self.decode.admit_handoff(decode(wire))
        except SpecStateError as exc:
            self.stats.refused += 1
            self.prefill.release_handoff(request_id, error=f"{type(exc).__name__}: {exc}")
            raise
        self.prefill.release_handoff(request_id)  # the acknowledgement: decode owns it now
        self.stats.handoffs += 1
        self.stats.bytes += sum(t.numel() * t.element_size() for t in wire)
        return req

    def check(self) -> None:
        """``handoff-owner``: between transfers, no request is live on both engines (ownership
        moves inside `transfer`, from the admission to the release).

        Raises:
            InvariantViolation: naming the requests live on both.
        """
        both = {r.request_id for r in self.prefill.lifecycle.live()} & {
            r.request_id for r in self.decode.lifecycle.live()
        }
        if both:
            raise InvariantViolation(
                "handoff-owner", f"requests {sorted(both)} are live on both engines"
            )

    def pump(self) -> list[Req]:
        """Transfer every request ready on the prefill engine; the decode side's requests."""
        return [self.transfer(rid) for rid in self.prefill.handoff_ready()]


def serve_disaggregated(
    link: HandoffLink,
    requests: Sequence[tuple[str, Sequence[int], SamplingParams]],
    *,
    max_steps: int = 100_000,
    after_step: Callable[[Engine], None] | None = None,
) -> dict[str, Req]:
    """Submit ``requests`` (id, prompt, sampling) to the prefill engine and drive both engines
    until idle; each id's final request (the decode engine's, or the prefill engine's when it
    ended there: a stop at its first token). ``after_step`` runs after every step of either
    engine (an invariant check); with it, `HandoffLink.check` runs after every pump too.

    Raises:
        InvalidConfig: not idle after ``max_steps`` steps of both.
    """
    out: dict[str, Req] = {}
    for rid, prompt, sampling in requests:
        out[rid] = link.prefill.submit_prefill(rid, prompt, sampling)
    for _ in range(max_steps):
        if link.prefill.is_idle and link.decode.is_idle and not link.prefill.handoff_ready():
            return out
        for engine in (link.prefill, link.decode):
            if not engine.is_idle:
                engine.step()
                if after_step is not None:
                    after_step(engine)
        for req in link.pump():
            out[req.request_id] = req
        if after_step is not None:
            link.check()
    link.prefill.run_until_idle(max_steps=1)  # raises InvalidConfig: not idle
    return out
