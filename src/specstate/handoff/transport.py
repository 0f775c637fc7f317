"""Handoffs between processes: the `HandoffTransport` interface, its torch.distributed form, and
the two role loops (a prefill process, a decode process).

A transport moves three kinds of message between two peers, in order, each way::

    prefill -> decode   RECORD  a record's wire form (`specstate.handoff.codec`): the header,
                                then every tensor it lists (point-to-point sends)
                        CLOSE   no more records
    decode -> prefill   ACK     (request id, admitted or not, why not)

`TorchDistributedTransport` sends each message as a frame ``int64 [kind, header bytes, count]``
then its parts, with ``torch.distributed`` point-to-point sends (gloo on a CPU; NCCL with
``device="cuda"``: every tensor then crosses on the device). A reader thread receives whole
messages in the background, so a decode engine keeps stepping while a record's KV lands, and
admits the request only once every tensor of it has arrived (`poll`). Another KV-transfer
library (NIXL, Mooncake) plugs in by implementing the same four calls (docs/handoff.md).

Faults, each bounded in time:

* the decode process dies during a transfer: the send or the acknowledgement fails (the peer
  closed the connection, or no ACK within ``ack_timeout_s``): `serve_prefill` ends the request
  with ``FinishReason.ERROR`` naming the failure and frees its pages; later requests fail the
  same way at once (no retry on another decode engine);
* the prefill process dies: the reader fails (connection closed) or nothing arrives within
  ``idle_timeout_s``: `serve_decode` finishes what it admitted and returns the failure; a record
  half received is never admitted, so nothing was written;
* a record that does not decode, or that this engine cannot serve: NACKed, the prefill side ends
  the request with ERROR; the decode side wrote nothing.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
import torch.distributed as dist

from specstate.core.errors import (
    HandoffError,
    HandoffFailed,
    InvalidRequest,
    MalformedRecord,
    UsageError,
)
from specstate.core.params import SamplingParams
from specstate.core.request import Req
from specstate.engine.engine import Engine
from specstate.handoff.codec import (
    decode,
    decode_header,
    encode,
    manifest_of,
    sampling_from,
    sampling_json,
)
from specstate.handoff.record import HandoffRecord

__all__ = [
    "Ack",
    "Arrival",
    "Closed",
    "DecodeOutcome",
    "FrontDoorTransport",
    "HandoffTransport",
    "Message",
    "RemoteAbort",
    "RemoteEnd",
    "RemoteSubmit",
    "TorchDistributedTransport",
    "admit_arrival",
    "serve_decode",
    "serve_prefill",
]

_RECORD, _ACK, _CLOSE, _SUBMIT, _ABORT, _END = 1, 2, 3, 4, 5, 6


@attrs.frozen(kw_only=True)
class Ack:
    """The decode side's answer to one record: admitted (``ok``) or refused (``detail``)."""

    request_id: str
    ok: bool
    detail: str = ""


@attrs.frozen(kw_only=True, eq=False)
class Arrival:
    """A record that arrived whole (``record``), or one that did not decode (``error``)."""

    record: HandoffRecord | None
    error: MalformedRecord | None = None
    request_id: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    """From the record's frame to its last tensor landing (the receiving side's transfer time)."""


@attrs.frozen
class Closed:
    """The peer sends no more records (or, to a prefill process serving a front door, no more
    requests)."""


@attrs.frozen(kw_only=True)
class RemoteSubmit:
    """A front door asks the prefill process to prefill a request (`serve_prefill` with
    ``remote=True``); answered with an `Ack` (submitted, or refused and why)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams


@attrs.frozen(kw_only=True)
class RemoteAbort:
    """A front door aborts a request it submitted to the prefill process."""

    request_id: str
    reason: str


@attrs.frozen(kw_only=True)
class RemoteEnd:
    """A request submitted by a front door ended on the prefill process without a record (at
    its first token, aborted, or failed): its emitted tokens and finish."""

    request_id: str
    output_ids: tuple[int, ...]
    reason: str
    detail: str = ""


Message = Ack | Arrival | Closed | RemoteSubmit | RemoteAbort | RemoteEnd


@runtime_checkable
class HandoffTransport(Protocol):
    """Moves records one way and acknowledgements the other, in order (module docstring)."""

    def send_record(self, record: HandoffRecord) -> int:
        """Send ``record`` whole; the bytes sent.

        Raises:
            HandoffFailed: the peer is gone or the send did not finish in time.
        """
        ...

    def send_ack(self, ack: Ack) -> None:
        """Send an acknowledgement (HandoffFailed as `send_record`)."""
        ...

    def send_close(self) -> None:
        """Tell the peer no more records follow (HandoffFailed as `send_record`)."""
        ...

    def poll(self, timeout_s: float) -> Message | None:
        """The next message that arrived whole, waiting at most ``timeout_s``; None if none.

        Raises:
            HandoffFailed: the peer is gone (the connection closed) or the stream broke.
        """
        ...


@runtime_checkable
class FrontDoorTransport(HandoffTransport, Protocol):
    """A `HandoffTransport` that also carries a front door's requests to a prefill process
    (`RemoteSubmit`, `RemoteAbort`) and their ends back (`RemoteEnd`): ``specstate serve
    --prefill``."""

    def send_submit(self, message: RemoteSubmit) -> None:
        """A front door's request, to the prefill process (HandoffFailed as `send_record`)."""
        ...

    def send_abort(self, message: RemoteAbort) -> None:
        """A front door's abort, to the prefill process (HandoffFailed as `send_record`)."""
        ...

    def send_end(self, message: RemoteEnd) -> None:
        """A request that ended on the prefill process, back (HandoffFailed as `send_record`)."""
        ...


class TorchDistributedTransport:
    """`HandoffTransport` over ``torch.distributed`` point-to-point sends (module docstring).

    Both peers must be ranks of an initialized process group (``group``, default the world).

    Args:
        peer: the other side's rank.
        device: where tensors cross (``cpu`` for gloo, ``cuda`` for NCCL).
        group: the process group; None for the default one.
    """

    def __init__(
        self, peer: int, *, device: str = "cpu", group: dist.ProcessGroup | None = None
    ) -> None:
        self._peer = peer
        self._rank = dist.get_rank()
        self._device = torch.device(device)
        self._group = group
        self._inbox: queue.Queue[Message | BaseException] = queue.Queue()
        self._failure: HandoffFailed | None = None
        self._reader = threading.Thread(
            target=self._read_loop, name=f"handoff-reader-{peer}", daemon=True
        )
        self._reader.start()

    # ------------------------------------------------------------------ send
    def send_record(self, record: HandoffRecord) -> int:
        """Send ``record`` whole; the bytes sent."""
        wire = [t.to(self._device) for t in encode(record)]
        frame = torch.tensor([_RECORD, wire[0].numel(), len(wire) - 1], dtype=torch.int64)
        self._send([frame.to(self._device), *wire], f"record of request {record.request_id!r}")
        return sum(t.numel() * t.element_size() for t in wire)

    def send_ack(self, ack: Ack) -> None:
        """Send an acknowledgement."""
        payload = {"request_id": ack.request_id, "ok": ack.ok, "detail": ack.detail}
        self._send_json(_ACK, payload, f"acknowledgement of request {ack.request_id!r}")

    def send_submit(self, message: RemoteSubmit) -> None:
        """A front door's request, to the prefill process."""
        payload = {
            "request_id": message.request_id,
            "prompt_ids": list(message.prompt_ids),
            "sampling": sampling_json(message.sampling),
        }
        self._send_json(_SUBMIT, payload, f"request {message.request_id!r}")

    def send_abort(self, message: RemoteAbort) -> None:
        """A front door's abort, to the prefill process."""
        payload = {"request_id": message.request_id, "reason": message.reason}
        self._send_json(_ABORT, payload, f"abort of request {message.request_id!r}")

    def send_end(self, message: RemoteEnd) -> None:
        """A front door's request that ended on the prefill process, back to the front door."""
        payload = {
            "request_id": message.request_id,
            "output_ids": list(message.output_ids),
            "reason": message.reason,
            "detail": message.detail,
        }
        self._send_json(_END, payload, f"end of request {message.request_id!r}")

    def _send_json(self, kind: int, payload: dict[str, Any], what: str) -> None:
        data = json.dumps(payload).encode()
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        frame = torch.tensor([kind, body.numel(), 0], dtype=torch.int64).to(self._device)
        self._send([frame, body], what)

    def send_close(self) -> None:
        """Tell the peer no more records follow."""
        frame = torch.tensor([_CLOSE, 0, 0], dtype=torch.int64).to(self._device)
        self._send([frame], "close")

    def _send(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        if self._failure is not None:
            raise HandoffFailed(f"cannot send the {what}: {self._failure}")
        try:
            works = [
                dist.isend(t.contiguous(), dst=self._peer, group=self._group, tag=self._rank)
                for t in tensors
            ]
            for work in works:
                _wait(work)
        except RuntimeError as exc:
            failure = HandoffFailed(f"sending the {what} to rank {self._peer} failed: {exc}")
            self._failure = failure
            raise failure from exc

    # --------------------------------------------------------------- receive
    def poll(self, timeout_s: float) -> Message | None:
        """The next message that arrived whole, waiting at most ``timeout_s``."""
        try:
            item = (
                self._inbox.get(timeout=max(timeout_s, 0.0))
                if timeout_s > 0
                else (self._inbox.get_nowait())
            )
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            failure = HandoffFailed(f"rank {self._peer}: {item}")
            self._failure = failure
            self._inbox.put(item)  # every later poll fails the same way
            raise failure from item
        return item

    def _recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=dtype, device=self._device)
        _wait(dist.irecv(buf, src=self._peer, group=self._group, tag=self._peer))
        return buf

    def _read_loop(self) -> None:
        try:
            while True:
                kind, size, count = (int(x) for x in self._recv((3,), torch.int64).cpu())
                if kind == _CLOSE:
                    self._inbox.put(Closed())
                elif kind in (_ACK, _SUBMIT, _ABORT, _END):
                    body = self._recv((size,), torch.uint8).cpu().numpy().tobytes()
                    self._inbox.put(_json_message(kind, json.loads(body.decode())))
                elif kind == _RECORD:
                    self._inbox.put(self._read_record(size, count))
                else:
                    raise MalformedRecord(f"unknown message kind {kind}: the stream is broken")
        except BaseException as exc:  # the peer closed, or the stream broke: report it
            self._inbox.put(exc)

    def _read_record(self, size: int, count: int) -> Arrival:
        started = time.monotonic()
        header_tensor = self._recv((size,), torch.uint8)
        try:
            header = decode_header(header_tensor)
            manifest = manifest_of(header)
        except MalformedRecord as exc:  # the shapes are unknown: the stream cannot go on
            raise MalformedRecord(f"{exc}; the stream is broken") from exc
        if len(manifest) != count:
            raise MalformedRecord(
                f"handoff record: the frame announces {count} tensors, the header lists "
                f"{len(manifest)}; the stream is broken"
            )
        body = [self._recv(shape, dtype) for _, dtype, shape in manifest]
        request_id = str(header.get("request_id", ""))
        num_bytes = sum(t.numel() * t.element_size() for t in body)
        seconds = time.monotonic() - started
        try:  # every tensor has landed: decode (on the host, where the engine admits it)
            record = decode([header_tensor.cpu(), *(t.cpu() for t in body)])
        except MalformedRecord as exc:
            return Arrival(
                record=None, error=exc, request_id=request_id, num_bytes=num_bytes, seconds=seconds
            )
        return Arrival(record=record, request_id=request_id, num_bytes=num_bytes, seconds=seconds)


def _json_message(kind: int, value: Any) -> Message:
    """The message of a JSON body (`MalformedRecord` if it is not one: the stream broke)."""
    try:
        if kind == _ACK:
            return Ack(request_id=value["request_id"], ok=value["ok"], detail=value["detail"])
        if kind == _SUBMIT:
            return RemoteSubmit(
                request_id=value["request_id"],
                prompt_ids=tuple(int(t) for t in value["prompt_ids"]),
                sampling=sampling_from(value["sampling"]),
            )
        if kind == _ABORT:
            return RemoteAbort(request_id=value["request_id"], reason=value["reason"])
        return RemoteEnd(
            request_id=value["request_id"],
            output_ids=tuple(int(t) for t in value["output_ids"]),
            reason=value["reason"],
            detail=value["detail"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRecord(
            f"message kind {kind}: a bad body ({exc}); the stream is broken"
        ) from exc


def _wait(work: dist.Work | None) -> None:
    """Wait for a point-to-point operation (None: it completed when posted)."""
    if work is not None:
        work.wait()


# ------------------------------------------------------------------ role loops
def _wait_ack(
    transport: HandoffTransport, request_id: str, timeout_s: float, deferred: list[Message]
) -> Ack:
    """The decode side's acknowledgement of ``request_id``; other messages go to ``deferred``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandoffFailed(
                f"request {request_id!r}: no acknowledgement from the decode side within "
                f"{timeout_s:g} s"
            )
        message = transport.poll(min(left, 0.5))
        if isinstance(message, Ack):
            if message.request_id != request_id:
                raise HandoffFailed(
                    f"request {request_id!r}: acknowledgement for {message.request_id!r} "
                    "arrived instead"
                )
            return message
        if message is not None:
            deferred.append(message)


def serve_prefill(
    engine: Engine,
    transport: HandoffTransport,
    requests: Sequence[tuple[str, Sequence[int], SamplingParams]],
    *,
    ack_timeout_s: float = 30.0,
    after_step: Callable[[Engine], None] | None = None,
    on_export: Callable[[HandoffRecord], HandoffRecord] | None = None,
    remote: bool = False,
) -> dict[str, Req]:
    """The prefill process: prefill ``requests``, send each record, release it on its ACK.

    A failed transfer (module docstring) ends the request with ERROR and frees its pages; once
    the transport failed, every later request fails the same way without a send. Returns the
    prefill side's requests (``HANDED_OFF``, ``ERROR``, or ended here at their first token).
    ``on_export`` may replace a record before it is sent (a fault-injection test).

    ``remote=True`` serves a front door on the peer (``specstate serve --prefill``): requests
    also arrive over the transport (`RemoteSubmit`, each answered with an `Ack`; `RemoteAbort`),
    a request that ends here without a record is reported back (`RemoteEnd`), and the loop runs
    until the peer closes (`Closed`) or the transport fails (then what runs here is aborted).
    The transport must then also implement ``send_end`` (`TorchDistributedTransport` does).
    """
    if remote and not isinstance(transport, FrontDoorTransport):
        raise UsageError(
            f"serve_prefill(remote=True): {type(transport).__name__} cannot report a request's "
            "end to the front door (no send_end)"
        )
    reqs = {rid: engine.submit_prefill(rid, prompt, sp) for rid, prompt, sp in requests}
    failure: HandoffFailed | None = None
    deferred: list[Message] = []
    remote_live: dict[str, Req] = {}  # a front door's requests not exported nor ended yet
    done = not remote  # no more requests can arrive
    while not done or not engine.is_idle or engine.handoff_ready():
        if not done:
            done = _take_remote(engine, transport, reqs, remote_live, deferred)
        if not engine.is_idle:
            engine.step()
            if after_step is not None:
                after_step(engine)
        for rid in engine.handoff_ready():
            remote_live.pop(rid, None)
            record = engine.export_handoff(rid)
            if failure is not None:
                engine.release_handoff(rid, error=f"decode side unavailable: {failure}")
                continue
            try:
                transport.send_record(record if on_export is None else on_export(record))
                ack = _wait_ack(transport, rid, ack_timeout_s, deferred)
            except HandoffFailed as exc:
                failure = exc
                engine.release_handoff(rid, error=f"handoff failed: {exc}")
                if not done:  # the front door is gone: stop what still runs here
                    done = True
                    for live in remote_live:
                        engine.abort(live, f"the front door is unavailable: {exc}")
                continue
            engine.release_handoff(rid, error=None if ack.ok else f"refused: {ack.detail}")
        if isinstance(transport, FrontDoorTransport):
            _report_ends(transport, remote_live, failure)
    if failure is None:
        transport.send_close()
    return reqs


def _take_remote(
    engine: Engine,
    transport: HandoffTransport,
    reqs: dict[str, Req],
    remote_live: dict[str, Req],
    deferred: list[Message],
) -> bool:
    """Apply the front door's messages that arrived (waiting briefly when there is nothing to
    do); True once no more can arrive (it closed, or the transport failed)."""
    idle = engine.is_idle and not engine.handoff_ready()
    messages, deferred[:] = list(deferred), []
    try:
        message = transport.poll(0.05 if idle and not messages else 0.0)
        while message is not None:
            messages.append(message)
            message = transport.poll(0.0)
        for message in messages:
            if isinstance(message, Closed):  # nobody reads what still runs here: stop it
                for rid in remote_live:
                    engine.abort(rid, "the front door closed")
                return True
            if isinstance(message, RemoteSubmit):
                _submit_remote(engine, transport, message, reqs, remote_live)
            elif isinstance(message, RemoteAbort) and message.request_id in remote_live:
                engine.abort(message.request_id, message.reason)
    except HandoffFailed as exc:
        for rid in remote_live:
            engine.abort(rid, f"the front door is unavailable: {exc}")
        return True
    return False


def _submit_remote(
    engine: Engine,
    transport: HandoffTransport,
    message: RemoteSubmit,
    reqs: dict[str, Req],
    remote_live: dict[str, Req],
) -> None:
    rid = message.request_id
    try:
        req = engine.submit_prefill(rid, message.prompt_ids, message.sampling)
    except (InvalidRequest, HandoffError) as exc:
        transport.send_ack(Ack(request_id=rid, ok=False, detail=str(exc)))
        return
    reqs[rid] = remote_live[rid] = req
    transport.send_ack(Ack(request_id=rid, ok=True))


def _report_ends(
    transport: FrontDoorTransport, remote_live: dict[str, Req], failure: HandoffFailed | None
) -> None:
    """Tell the front door of its requests that ended here without a record."""
    for rid, req in list(remote_live.items()):
        if req.finish is None:
            continue
        del remote_live[rid]
        if failure is None:
            end = RemoteEnd(
                request_id=rid,
                output_ids=tuple(req.emitted_ids),
                reason=req.finish.reason.value,
                detail=req.finish.detail,
            )
            try:
                transport.send_end(end)
            except HandoffFailed:
                return  # the front door is gone: the next poll ends the loop


@attrs.frozen(kw_only=True)
class DecodeOutcome:
    """What a decode process did: its requests, and the transport failure it stopped on."""

    requests: dict[str, Req]
    failure: str | None = None
    num_bytes: int = 0


def serve_decode(
    engine: Engine,
    transport: HandoffTransport,
    *,
    idle_timeout_s: float = 30.0,
    after_step: Callable[[Engine], None] | None = None,
) -> DecodeOutcome:
    """The decode process: admit records as they land (between steps), ACK each, decode.

    Returns once the prefill side closed and every request ended, or, on a transport failure
    or ``idle_timeout_s`` with nothing to do and nothing arriving, once what was admitted ended.
    """
    reqs: dict[str, Req] = {}
    num_bytes = 0
    failure: str | None = None
    closed = False
    quiet_since = time.monotonic()
    while True:
        if not engine.is_idle:
            engine.step()
            if after_step is not None:
                after_step(engine)
        if closed or failure is not None:
            if engine.is_idle:
                return DecodeOutcome(requests=reqs, failure=failure, num_bytes=num_bytes)
            continue
        try:
            message = transport.poll(0.0 if not engine.is_idle else 0.05)
        except HandoffFailed as exc:
            failure = str(exc)
            continue
        if message is None:
            if not engine.is_idle:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > idle_timeout_s:
                failure = f"nothing arrived from the prefill side within {idle_timeout_s:g} s"
            continue
        quiet_since = time.monotonic()
        if isinstance(message, Closed):
            closed = True
        elif isinstance(message, Arrival):
            num_bytes += message.num_bytes
            ack = _admit(engine, message, reqs)
            try:
                transport.send_ack(ack)
            except HandoffFailed as exc:
                failure = str(exc)


def _admit(engine: Engine, arrival: Arrival, reqs: dict[str, Req]) -> Ack:
    ack, req = admit_arrival(engine, arrival)
    if req is not None:
        reqs[req.request_id] = req
    return ack


def admit_arrival(engine: Engine, arrival: Arrival) -> tuple[Ack, Req | None]:
    """The decode side's answer to ``arrival``: admitted into ``engine`` (the request), or
    refused, nothing written (a record that did not decode, or that the engine cannot serve)."""
    if arrival.record is None:
        detail = f"MalformedRecord: {arrival.error}"
        return Ack(request_id=arrival.request_id, ok=False, detail=detail), None
    try:
        req = engine.admit_handoff(arrival.record)
    except (HandoffError, InvalidRequest) as exc:
        detail = f"{type(exc).__name__}: {exc}"
        return Ack(request_id=arrival.request_id, ok=False, detail=detail), None
    return Ack(request_id=req.request_id, ok=True), req
