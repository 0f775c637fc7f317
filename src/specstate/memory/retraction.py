"""Retraction under KV pressure: who gives up its KV so the rest can decode.

Before each decode prepare the scheduler asks whether the pool can hold the next reservation of
every running request (`KvAllocator.decode_tokens_needed`, page for page what the reservation
will take), counting the prefix cache's unreferenced pages as available: the reservation evicts
them before anyone is retracted. If even that is not enough, requests are retracted in
`retraction_order` — fewest output tokens first, ties to the longer prompt — until the rest
fit. At least one request keeps running; if even the last one cannot fit, it is aborted. A
retracted request has its KV released (counters zeroed), its incarnation bumped (so a late
result for it is refused) and is re-queued by the scheduler; its output so far is kept and
re-prefilled on re-admission.

Speculation has no special branch here: it lives only in the memory estimate.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from specstate.core.errors import InvalidTransition
from specstate.core.request import Req
from specstate.core.status import FinishReason, FinishState, ReqStatus
from specstate.memory.allocation import KvAllocator
from specstate.memory.releases import ReleasedKv

__all__ = ["RetractionOutcome", "retract_for_decode", "retraction_order"]


def retraction_order(reqs: Sequence[Req]) -> list[Req]:
    """``reqs`` in retraction order: fewest output tokens first, ties → longer prompt first."""
    return sorted(reqs, key=lambda r: (r.num_outputs, -len(r.prompt_ids)))


@attrs.frozen(kw_only=True)
class RetractionOutcome:
    """What a retraction pass did: who keeps running, who was retracted, who must end.

    Attributes:
        kept: the requests whose next decode reservation now fits.
        retracted: moved to RETRACTED, KV released (the scheduler re-queues them).
        aborted: the last request, which could not fit alone: its KV is released and it
            must end with ``aborted_finishes`` (the engine's lifecycle ends it; this pass
            only decides).
        aborted_finishes: one ABORT finish per ``aborted`` request.
        released: what each release gave back.
    """

    kept: tuple[Req, ...]
    retracted: tuple[Req, ...]
    aborted: tuple[Req, ...]
    released: tuple[ReleasedKv, ...]
    aborted_finishes: tuple[FinishState, ...] = ()


def _fits(allocator: KvAllocator, reqs: Sequence[Req], slots: torch.Tensor | None = None) -> bool:
    if slots is None:
        slots = torch.tensor([allocator.slot_of(r) for r in reqs], dtype=torch.int64)
    return allocator.decode_tokens_needed(slots) <= allocator.available_tokens()


def retract_for_decode(
    allocator: KvAllocator, running: Sequence[Req], *, slots: torch.Tensor | None = None
) -> RetractionOutcome:
    """Retract running requests until the next decode reservation of the rest fits.

    Retracted requests move to RETRACTED (the scheduler re-queues them as WAITING); a last
    request that cannot fit alone is reported in ``aborted`` with an ABORT finish for the
    engine to end it. Both have released KV.
    ``slots`` (the slots of ``running``, if the caller has them) saves the common no-pressure
    check from looking every slot up again.
    """
    live = (ReqStatus.RUNNING, ReqStatus.PREFILL)
    stuck = [r.request_id for r in running if r.status not in live]
    if stuck:
        raise InvalidTransition(f"requests {stuck} are not running; only running ones retract")
    kept = list(running)
    retracted: list[Req] = []
    aborted: list[Req] = []
    finishes: list[FinishState] = []
    released: list[ReleasedKv] = []
    if _fits(allocator, running, slots):
        return RetractionOutcome(kept=tuple(running), retracted=(), aborted=(), released=())
    order = retraction_order(running)
    while kept and not _fits(allocator, kept):
        if len(kept) == 1:
            victim = kept.pop()
            needed = allocator.decode_tokens_needed(
                torch.tensor([allocator.slot_of(victim)], dtype=torch.int64)
            )
            released.append(allocator.release(victim))
            finishes.append(
                FinishState(
                    reason=FinishReason.ABORT,
                    finished_len=min(victim.num_outputs, victim.sampling.max_new_tokens),
                    detail=f"KV pool cannot hold its next decode ({needed} tokens)",
                )
            )
            aborted.append(victim)
            break
        victim = order.pop(0)
        kept.remove(victim)
        released.append(allocator.release(victim))
        victim.transition(ReqStatus.RETRACTED)
        retracted.append(victim)
    return RetractionOutcome(
        kept=tuple(kept),
        retracted=tuple(retracted),
        aborted=tuple(aborted),
        released=tuple(released),
        aborted_finishes=tuple(finishes),
    )
