"""The handoff desk: one engine's side of a prefill → decode handoff (docs/handoff.md).

A request is owned by exactly one engine at a time. The ownership timeline, per side::

    prefill engine   submit_prefill -> PREFILL -> parked (first token settled; holds its slot
                     and pages, never decoded here) -> export (a record; still parked, its
                     outputs frozen) -> release: the decode side acknowledged (FinishReason
                     HANDED_OFF) or failed (ERROR); its pages are freed either way
    decode engine    admit (record checked against this engine's descriptor, nothing written
                     on a mismatch) -> arriving (WAITING, no slot) -> one import batch (slot and
                     pages through the allocator, the ledger commits the record's KV, the worker
                     writes the record's state: no prefill, no drafter prefill) -> running

The acknowledgement is the moment ownership moves: the decode engine owns the request once it
admitted the record (it holds the record's tensors, so the prefill engine's pages are no longer
needed), and the prefill engine then releases it.

Invariant (``handoff``, `specstate.engine.invariants`): a parked request is RUNNING, holds a slot
and sits in no other scheduler place (so no round decodes it: its outputs stay those its record
carries); an arriving request is WAITING and holds no slot.
"""

from __future__ import annotations

from importlib.metadata import version

import torch

from specstate.core.errors import HandoffUnsupported, InvariantViolation, UsageError
from specstate.core.ledger import LedgerReader
from specstate.core.params import RequestLimits
from specstate.core.request import Req
from specstate.core.status import FinishReason, FinishState
from specstate.engine.config import EngineConfig
from specstate.engine.launch.launcher import Launcher
from specstate.engine.schedule.scheduler import Scheduler
from specstate.engine.settle.lifecycle import RequestLifecycle
from specstate.engine.worker import WorkerProtocol, handoff_worker
from specstate.handoff.record import (
    HANDOFF_VERSION,
    ROW,
    CompatibilityDescriptor,
    DraftState,
    HandoffRecord,
)
from specstate.memory.allocation import KvAllocator
from specstate.memory.recurrent import RecurrentStatePool

__all__ = ["HandoffDesk"]


class HandoffDesk:
    """Exports parked requests, releases them, and checks arriving records (module docstring)."""

    def __init__(
        self,
        *,
        worker: WorkerProtocol,
        config: EngineConfig,
        limits: RequestLimits,
        scheduler: Scheduler,
        lifecycle: RequestLifecycle,
        allocator: KvAllocator,
        ledger: LedgerReader,
        launcher: Launcher,
        recurrent: RecurrentStatePool | None = None,
    ) -> None:
        self._worker = worker
        self._config = config
        self._limits = limits
        self._scheduler = scheduler
        self._lifecycle = lifecycle
        self._allocator = allocator
        self._ledger = ledger
        self._launcher = launcher
        self._recurrent = recurrent
        self._descriptor: CompatibilityDescriptor | None = None
        self.exported: dict[Req, HandoffRecord] = {}
        self.num_exported = 0
        self.num_imported = 0

    def descriptor(self) -> CompatibilityDescriptor:
        """This engine's compatibility descriptor (built once).

        Raises:
            HandoffUnsupported: the worker does not hand off (or not this configuration).
        """
        if self._descriptor is None:
            worker = handoff_worker(self._worker)
            caps = self._worker.capabilities
            model, drafter = worker.handoff_identity()
            layout = worker.handoff_layout()
            self._descriptor = CompatibilityDescriptor(
                model_digest=model,
                drafter_digest=drafter,
                dtype=layout[0][1] if layout else "",
                page_size=self._config.page_size,
                layout=layout,
                algorithm=caps.algorithm,
                num_steps=caps.num_steps,
                topk=caps.topk,
                library_version=version("specstate"),
            )
        return self._descriptor

    # ---------------------------------------------------------------- prefill
    def ready(self) -> tuple[str, ...]:
        """Parked requests with a settled first token, not exported yet."""
        return tuple(
            req.request_id
            for req in self._scheduler.parked
            if req.num_outputs >= 1 and req not in self.exported and not req.is_finished
        )

    def export(self, request_id: str) -> HandoffRecord:
        """The record of a parked request whose first token has settled; it stays parked.

        Raises:
            UsageError: no such parked request, or its prefill has not settled yet.
            HandoffUnsupported: the worker cannot hand off.
        """
        req = self._parked(request_id)
        if req.num_outputs < 1:
            raise UsageError(f"request {request_id!r}: its prefill has not settled yet; step first")
        descriptor = self.descriptor()
        slot = self._allocator.slot_of(req)
        at = torch.tensor([slot], dtype=torch.int64)
        committed = int(self._ledger.committed(at)[0])
        if committed != req.seqlen - 1:
            raise InvariantViolation(
                "handoff",
                f"request {request_id!r}: parked with committed {committed}, seqlen {req.seqlen}",
            )
        locs = self._allocator.req_to_token[slot, :committed]
        state_row = None
        if self._recurrent is not None:  # the state after the committed tokens
            state_row = self._recurrent.layout.rows(at, torch.tensor([committed]))
        state = handoff_worker(self._worker).export_handoff(locs, state_row=state_row)
        rows = {name: t for name, t in state.items() if name.startswith(ROW)}
        state = {name: t for name, t in state.items() if not name.startswith(ROW)}
        relay = self._launcher.future_map.resolve_forward_inputs(at.to(self._config.device))
        bonus = int(relay.bonus_tokens[0])
        if bonus != req.output_ids[-1]:
            raise InvariantViolation(
                "handoff",
                f"request {request_id!r}: relayed bonus {bonus} is not its last output "
                f"{req.output_ids[-1]}",
            )

        def row(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[0].clone()

        record = HandoffRecord(
            version=HANDOFF_VERSION,
            request_id=request_id,
            prompt_ids=tuple(req.prompt_ids),
            output_ids=tuple(req.output_ids),
            sampling=req.sampling,
            committed_len=committed,
            descriptor=descriptor,
            slot_state=state,
            draft_state=DraftState(
                bonus_token=bonus,
                hidden_states=row(relay.hidden_states),
                topk_p=row(relay.topk_p),
                topk_index=row(relay.topk_index),
            ),
            recurrent_state=rows,
            output_logprobs=req.logprobs,
            output_top_logprobs=req.top_logprobs,
        )
        self.exported[req] = record
        self.num_exported += 1
        return record

    def release(self, request_id: str, *, error: str | None, until_batch: int) -> Req:
        """End a parked request: handed off (``error`` None) or failed; its KV is deferred.

        Raises:
            UsageError: no such parked request.
        """
        req = self._parked(request_id)
        self.exported.pop(req, None)
        emitted = min(req.num_outputs, req.sampling.max_new_tokens)
        if error is None:
            finish = FinishState(reason=FinishReason.HANDED_OFF, finished_len=emitted)
        else:
            finish = FinishState(reason=FinishReason.ERROR, finished_len=emitted, detail=error)
        self._lifecycle.finish([req], [finish], until_batch=until_batch)
        return req

    def _parked(self, request_id: str) -> Req:
        req = self._lifecycle.find(request_id)
        if req is None or req.is_finished or req not in self._scheduler.parked:
            raise UsageError(f"request {request_id!r} is not parked for a handoff on this engine")
        return req

    # ----------------------------------------------------------------- decode
    def admitted(self) -> None:
        """Count a record `Engine.admit_handoff` admitted (after `check_arrival`)."""
        self.num_imported += 1

    def check_arrival(self, record: HandoffRecord) -> None:
        """Refuse ``record`` before anything is written.

        Raises:
            HandoffMismatch: its descriptor differs from this engine's (the field named).
            HandoffUnsupported: not a first-token record.
        """
        self.descriptor().check(record.descriptor, request_id=record.request_id)
        if len(record.output_ids) != 1:
            raise HandoffUnsupported(
                f"request {record.request_id!r}: a decode engine admits records at their first "
                f"token; this one carries {len(record.output_ids)} outputs"
            )
